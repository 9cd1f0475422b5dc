"""Measure whether one request's logprobs are bitwise the same across batch compositions, prefill chunk sizes and
prefix-cache hits, in the default mode or with `--batch_invariant` (`LLM(batch_invariant=True)`).

    python scripts/tools/batch_invariance_probe.py --model=tiny-llama --trials=20 [--batch_invariant]

The target request (fixed prompt, greedy, logprobs=5 of every generated token) runs alone, then in --trials random
batches (0-15 random companions of random lengths, the target at a random position), with prefill chunks of 16 and
256 tokens, and a second time after its prompt is in the prefix cache. Reported: for each condition how many runs
gave the alone run's tokens, and bitwise-equal logprobs, and the largest logprob difference. The last line printed
is one JSON object.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from inference import LLM, SamplingParams  # noqa: E402

flags.DEFINE_string("model", "tiny-llama", "model name or path")
flags.DEFINE_integer("trials", 20, "random batch compositions")
flags.DEFINE_integer("seed", 0, "composition seed")
flags.DEFINE_bool("batch_invariant", False, "run the engine with batch_invariant=True")
FLAGS = flags.FLAGS


def _logprobs(out) -> tuple[list[int], np.ndarray]:
    """The generated tokens and each one's logprob (compared only when the tokens are the same)."""
    c = out.outputs[0]
    return list(c.token_ids), np.asarray([float(getattr(e[t], "logprob", e[t])) for e, t in
                                          zip(c.logprobs, c.token_ids)], np.float32)


def main(argv) -> None:
    del argv
    rng = np.random.default_rng(FLAGS.seed)
    vocab = None
    result = {"model": FLAGS.model, "batch_invariant": FLAGS.batch_invariant}
    target_params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    for chunk in (256, 16):
        llm = LLM(FLAGS.model, max_num_batched_tokens=chunk, max_num_seqs=16, kv_cache_memory_bytes=64 << 20,
                  enable_prefix_caching=True, batch_invariant=FLAGS.batch_invariant)
        vocab = llm.config.vocab_size
        target = rng.integers(1, vocab, 40).tolist() if chunk == 256 else result["target"]
        result["target"] = target
        llm.engine.reset_prefix_cache()
        alone_tokens, alone = _logprobs(llm.generate(prompt_token_ids=[target], sampling_params=target_params)[0])
        if chunk == 256:
            reference_tokens, reference = alone_tokens, alone
        rows = {"alone_vs_chunk256": {"same_tokens": alone_tokens == reference_tokens,
                                      "bitwise": bool(np.array_equal(alone, reference)),
                                      "max_abs": float(np.abs(alone - reference).max())}}
        # Prefix hit: the target's prompt pages are cached from the run above.
        hit_tokens, hit = _logprobs(llm.generate(prompt_token_ids=[target], sampling_params=target_params)[0])
        rows["prefix_hit"] = {"same_tokens": hit_tokens == reference_tokens,
                              "bitwise": bool(np.array_equal(hit, reference)),
                              "max_abs": float(np.abs(hit - reference).max())}
        same, bitwise, worst = 0, 0, 0.0
        for _ in range(FLAGS.trials):
            llm.engine.reset_prefix_cache()
            count = int(rng.integers(0, 16))
            others = [rng.integers(1, vocab, int(rng.integers(1, 60))).tolist() for _ in range(count)]
            pos = int(rng.integers(0, len(others) + 1))
            batch = others[:pos] + [target] + others[pos:]
            params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(4, 20)), ignore_eos=True)
                      for _ in batch]
            params[pos] = target_params
            tokens, lp = _logprobs(llm.generate(prompt_token_ids=batch, sampling_params=params)[pos])
            same += tokens == reference_tokens
            bitwise += bool(np.array_equal(lp, reference))
            worst = max(worst, float(np.abs(lp - reference).max()))
        rows["random_batches"] = {"trials": FLAGS.trials, "same_tokens": same, "bitwise": bitwise, "max_abs": worst}
        result[f"chunk{chunk}"] = rows
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
