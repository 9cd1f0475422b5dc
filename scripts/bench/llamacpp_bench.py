"""The llama.cpp side of `scripts/bench/benchmark.py --compare=llamacpp`: greedy generation on a GGUF through
llama-cpp-python's low-level API, every prompt of a batch in one llama.cpp batch (one sequence id each).

    python scripts/bench/llamacpp_bench.py --gguf=path.gguf --prompts=prompts.json --output_len=128

Prints one JSON object with the keys the transformers side reports (`ttft_mean_s`, `output_tok_s`, `decode_tok_s`,
`wall_s`, `output_tokens`). benchmark.py runs it in a child process: llama.cpp's and XLA's thread pools in one
process would compete for the same cores and flatter pagejax's ratio (transformers slowed ~10x that way).

Why the low-level API: `llama_cpp.Llama` drives one sequence, so batch 32 through it would be 32 runs one after
another, not llama.cpp's batched decoding; a llama_batch with one sequence id per prompt is what llama.cpp's own
`llama-batched-bench` measures. Tokens are the same ids pagejax uses (the same GGUF vocabulary); no BOS is added.

Threads: llama.cpp's workers spin at their barriers. On a machine whose cores other processes also use, 2 threads
on 2 busy cores collapsed here (0.2 decode tok/s against 33 with 1 thread, same minute): pass --threads=1 there
(benchmark.py --llamacpp_threads=1) and say so next to the numbers.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

INSTALL_HINT = ("--compare=llamacpp needs llama-cpp-python: `pip install llama-cpp-python` (it compiles llama.cpp; "
                "with CMAKE_ARGS=\"-DGGML_NATIVE=ON\" for this CPU), or `pip install -e .[llamacpp]`")


def import_llama_cpp():
    """The llama_cpp module, or a ValueError that says how to install it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ValueError(f"{INSTALL_HINT} ({e})") from None
    return llama_cpp


class _Batch:
    """A llama_batch holding up to `capacity` tokens, one sequence id each."""

    def __init__(self, lib, capacity: int):
        self.lib, self.batch = lib, lib.llama_batch_init(capacity, 0, 1)

    def fill(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence id, wants logits)."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = tok, pos, 1, seq, int(logits)

    def free(self) -> None:
        self.lib.llama_batch_free(self.batch)


class LlamaCppGreedy:
    """A llama.cpp context sized for `num_seqs` sequences of `max_len` tokens; `generate` is greedy, EOS ignored."""

    def __init__(self, gguf_path: str, num_seqs: int, max_len: int, threads: int | None = None):
        lib = self.lib = import_llama_cpp()
        if not os.path.exists(gguf_path):
            raise ValueError(f"GGUF file {gguf_path!r} does not exist; pass the model's .gguf path")
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(gguf_path.encode(), mparams)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {gguf_path!r}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        threads = threads or len(os.sched_getaffinity(0))
        cparams = lib.llama_context_default_params()
        per_seq = -(-max_len // 256) * 256
        cparams.n_ctx = per_seq * num_seqs
        cparams.n_seq_max = num_seqs
        self.n_batch = cparams.n_batch = min(cparams.n_ctx, 2048)
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise ValueError("llama.cpp could not create a context; lower the batch or the lengths")
        self.batch = _Batch(lib, self.n_batch)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """Run the tokens in chunks of n_batch; returns the logits rows of the tokens that asked, in order."""
        rows = []
        for start in range(0, len(items), self.n_batch):
            chunk = items[start:start + self.n_batch]
            self.batch.fill(chunk)
            rc = self.lib.llama_decode(self.ctx, self.batch.batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            n_out = sum(1 for it in chunk if it[3])
            if n_out:
                ptr = self.lib.llama_get_logits(self.ctx)
                rows.append(np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab)).copy())
        return np.concatenate(rows) if rows else np.zeros((0, self.n_vocab), np.float32)

    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], float, float]:
        """Greedy tokens per prompt, the time to the first token of every prompt, and the total time."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        items = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        last = self._decode(items).argmax(-1)
        ttft = time.perf_counter() - t0
        out = [[int(t)] for t in last]
        for step in range(1, output_len):
            items = [(out[s][-1], len(p) + step - 1, s, True) for s, p in enumerate(prompts)]
            for s, t in enumerate(self._decode(items).argmax(-1)):
                out[s].append(int(t))
        return out, ttft, time.perf_counter() - t0

    def close(self) -> None:
        self.batch.free()
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def run_llamacpp(gguf_path: str, prompts: list[list[int]], output_len: int, threads: int | None = None) -> dict:
    """Warm up with 2 tokens, then the measured run; same keys and definitions as hf_bench.run_hf."""
    runner = LlamaCppGreedy(gguf_path, len(prompts), max(map(len, prompts)) + output_len, threads=threads)
    try:
        runner.generate(prompts, 2)
        tokens, ttft, wall = runner.generate(prompts, output_len)
    finally:
        runner.close()
    new = sum(map(len, tokens))
    decode_s = max(wall - ttft, 1e-9)
    import llama_cpp

    return {"ttft_mean_s": ttft, "ttft_s": {"mean": ttft}, "output_tok_s": new / wall,
            "decode_tok_s": len(prompts) * (output_len - 1) / decode_s,
            "wall_s": wall, "output_tokens": new, "first_tokens": [t[:8] for t in tokens],
            "version": getattr(llama_cpp, "__version__", "?"), "threads": threads or len(os.sched_getaffinity(0))}


def main(argv: list[str]) -> None:
    del argv
    with open(FLAGS.prompts) as f:
        prompts = json.load(f)
    print(json.dumps(run_llamacpp(FLAGS.gguf, prompts, FLAGS.output_len, FLAGS.threads or None)))


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("gguf", None, "The .gguf file.", required=True)
    flags.DEFINE_string("prompts", None, "A JSON file: a list of token-id lists.", required=True)
    flags.DEFINE_integer("output_len", 128, "Generated tokens per prompt.")
    flags.DEFINE_integer("threads", 0, "llama.cpp threads; 0: every core this process may use.")
    FLAGS = flags.FLAGS
    app.run(main)
