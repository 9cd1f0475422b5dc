"""The transformers side of `scripts/bench/benchmark.py --compare=hf`: `generate` (float32, greedy) on the same GGUF
weights, which transformers dequantizes, on the same token ids.

    python scripts/bench/hf_bench.py --gguf=path.gguf --prompts=prompts.json --output_len=128

Prints one JSON object with the keys the pagejax side reports (`ttft_mean_s`, `output_tok_s`, `decode_tok_s`,
`wall_s`, `output_tokens`, `first_tokens`). benchmark.py runs it in a child process: torch's and XLA's CPU thread
pools in one process slowed transformers down ~10x here, which would flatter the ratio. Needs the `reference` extra.
"""

from __future__ import annotations

import json
import os
import time


def load_hf(gguf_path: str):
    """transformers' model for the same GGUF weights (dequantized by transformers), float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                                dtype=torch.float32).eval()


def run_hf(model, prompts: list[list[int]], output_len: int) -> dict:
    """transformers' generate, greedy, timed like the pagejax side (a warm-up call first)."""
    import torch

    width = max(map(len, prompts))  # varied lengths are left-padded, as generate expects for a decoder-only model
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=mask)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
        wall = time.perf_counter() - t0
    new = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    decode_s = max(wall - ttft, 1e-9)
    return {"ttft_mean_s": ttft, "ttft_s": {"mean": ttft}, "output_tok_s": new / wall,
            "decode_tok_s": len(prompts) * (output_len - 1) / decode_s,
            "wall_s": wall, "output_tokens": int(new), "first_tokens": out[:, ids.shape[1]:ids.shape[1] + 8].tolist()}


def main(argv: list[str]) -> None:
    del argv
    with open(FLAGS.prompts) as f:
        prompts = json.load(f)
    print(json.dumps(run_hf(load_hf(FLAGS.gguf), prompts, FLAGS.output_len)))


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("gguf", None, "The .gguf file.", required=True)
    flags.DEFINE_string("prompts", None, "A JSON file: a list of token-id lists.", required=True)
    flags.DEFINE_integer("output_len", 128, "Generated tokens per prompt.")
    FLAGS = flags.FLAGS
    app.run(main)
