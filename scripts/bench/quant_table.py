"""The quantization table: memory, speed and quality of SmolLM2 (or any model) per weight / KV-cache format, one
process, one row after another.

    python scripts/bench/quant_table.py --json                      # f32, int8, int4, int4-awq, gguf, int4/awq g64, kv int8
    python scripts/bench/quant_table.py --rows=f32,int4,int4-awq --steps=8

Columns (every row against the f32 row, which always runs first):

    weight MiB       every parameter leaf (codes, scales, zero points / mins, norms)
    KV B/token       bytes of the runner's KV cache (every leaf, scales included) / token slots
    tok/s b=1, b=32  decode throughput of the continuous-batching engine, greedy, ignore_eos: (N-token run - 1-token
                     run) / generated tokens, after a warm-up run of each shape (so no compile is timed)
    ppl              perplexity on the shipped text (inference/data/eval_text.txt, ~3.2k tokens), window 512, stride
                     256, cache-free forward (inference/tools/evaluate.py); for f32 and rows with a KV-cache dtype also
                     through the engine's prompt logprobs (ppl_engine), since the forward has no KV cache
    KL mean / max    per-position KL(p_f32 || p_row) of next-token distributions, cache-free forward, over every
                     position of the reference fixture prompts
    greedy           16 prompts x 32 greedy tokens vs f32's: exact-match count, and the mean fraction of tokens equal
                     up to the first divergence (tokens after a difference are not comparable)

With --json the last line printed is one JSON object (metadata and rows).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
from absl import app, flags
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from inference.tools.evaluate import llm_perplexity  # noqa: E402
from inference.entrypoints.llm import LLM  # noqa: E402
from inference.sampling.params import SamplingParams  # noqa: E402
from models.quantization.modes import param_bytes  # noqa: E402
from tests.reference_fixtures import load_reference  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset name, .gguf file or HF folder.")
flags.DEFINE_list("rows", ["f32", "int8", "int4", "int4-awq", "gguf", "int4-g64", "int4-awq-g64", "kv-int8",
                                  "int8+kv-int8", "fp8", "kv-fp8", "fp8+kv-fp8"],
                  "Rows to measure (see ROWS); f32 always runs first.")
flags.DEFINE_integer("steps", 16, "Decode steps per timed run.")
flags.DEFINE_list("batch", ["1", "32"], "Batch sizes for decode tok/s.")
flags.DEFINE_integer("window", 512, "Perplexity window.")
flags.DEFINE_integer("stride", 256, "Perplexity stride.")
flags.DEFINE_boolean("json", False, "Print one JSON object as the last line.")

#: Row name -> LLM keyword arguments.
ROWS = {
    "f32": {},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "int4-awq": {"quantization": "int4-awq"},
    "gguf": {"quantization": "gguf"},
    "int4-g64": {"quantization": "int4", "quantization_group_size": 64},
    "int4-awq-g64": {"quantization": "int4-awq", "quantization_group_size": 64},
    "kv-int8": {"kv_cache_dtype": "int8"},
    "int8+kv-int8": {"quantization": "int8", "kv_cache_dtype": "int8"},  # the fastest CPU configuration
    "fp8": {"quantization": "fp8"},  # on CPU: weight-only dots of the e4m3 codes (no FP8 units)
    "kv-fp8": {"kv_cache_dtype": "fp8"},
    "fp8+kv-fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}

#: 16 prompts for the greedy comparison: chat questions and plain-text openings, short and long.
PROMPTS = [
    ("chat", "What is the capital of France?"),
    ("chat", "Explain photosynthesis in two sentences."),
    ("chat", "Write a haiku about the sea."),
    ("chat", "List three uses of copper."),
    ("chat", "Why is the sky blue?"),
    ("chat", "Give me a tip for learning a new language."),
    ("chat", "What does a compiler do?"),
    ("chat", "Summarize the plot of Romeo and Juliet in one sentence."),
    ("chat", "How many legs does a spider have, and why?"),
    ("chat", "Suggest a name for a small bakery."),
    ("plain", "Once upon a time, in a village at the edge of a forest,"),
    ("plain", "The most important thing to remember when cooking rice is"),
    ("plain", "def fibonacci(n):\n    "),
    ("plain", "The French Revolution began in 1789 when"),
    ("plain", "Dear hiring manager, I am writing to apply for"),
    ("plain", "In mathematics, a prime number is"),
]


def build(row: str) -> LLM:
    if row not in ROWS:
        raise ValueError(f"unknown row {row!r}; known: {sorted(ROWS)}")
    return LLM(FLAGS.model, kv_cache_memory_bytes=256 << 20, max_num_seqs=32, max_num_batched_tokens=512,
               **ROWS[row])


def prompt_ids(llm: LLM) -> list[list[int]]:
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
            if kind == "chat" else tok.encode(text) for kind, text in PROMPTS]


def greedy(llm: LLM, prompts: list[list[int]], n: int = 32) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(ref: list[int], got: list[int]) -> float:
    """Fraction of the tokens equal up to the first divergence (1.0: identical)."""
    return next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref)) / len(ref)


def fixture_logprobs(llm: LLM) -> list[np.ndarray]:
    """Per-position next-token log-probabilities [L, V] of the cache-free forward on each fixture prompt."""
    model = nnx.merge(llm.runner.graphdef, llm.runner.params)
    forward = nnx.jit(lambda m, t: jax.nn.log_softmax(m.forward(t)[0], axis=-1))
    return [np.asarray(forward(model, np.asarray(p["prompt_ids"], np.int32)[None]))
            for p in load_reference()["prompts"]]


def decode_tok_s(llm: LLM, batch: int, steps: int) -> float:
    prompt = [[1 + (i * 7 + j) % 500 for j in range(16)] for i in range(batch)]

    def run(n):
        t = time.perf_counter()
        llm.generate(prompt_token_ids=prompt,
                     sampling_params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t

    run(steps), run(1)  # compile and warm both shapes
    t_n, t_1 = min(run(steps) for _ in range(2)), min(run(1) for _ in range(2))
    return batch * (steps - 1) / max(t_n - t_1, 1e-9)


def kv_bytes_per_token(llm: LLM) -> float:
    runner = llm.runner
    return param_bytes(runner.kv_caches) / (runner.num_pages * runner.page_size)


def measure(row: str, base: dict | None) -> dict:
    t0 = time.perf_counter()
    try:
        llm = build(row)
    except (ValueError, KeyError, NotImplementedError) as exc:  # e.g. a KV dtype the model does not support yet
        return {"row": row, "error": f"{type(exc).__name__}: {exc}"}
    out = {"row": row, "load_s": time.perf_counter() - t0, "weight_bytes": param_bytes(llm.get_params()),
           "kv_bytes_per_token": kv_bytes_per_token(llm)}
    prompts = prompt_ids(llm)
    toks = greedy(llm, prompts)
    lps = fixture_logprobs(llm)
    ppl = llm_perplexity(llm, window=FLAGS.window, stride=FLAGS.stride)
    out.update(ppl=ppl.perplexity, ppl_tokens=ppl.num_tokens)
    if row == "f32" or "kv_cache_dtype" in ROWS[row]:  # the cache-free forward cannot see the KV cache format
        out["ppl_engine"] = llm_perplexity(llm, window=FLAGS.window, stride=FLAGS.stride, through="engine").perplexity
    if base is not None:
        kls = np.concatenate([np.sum(np.exp(a) * (a - b), axis=-1) for a, b in zip(base["lps"], lps)])
        out.update(kl_mean=float(kls.mean()), kl_max=float(kls.max()),
                   greedy_agreement=float(np.mean([agreement(a, b) for a, b in zip(base["toks"], toks)])),
                   greedy_exact=int(sum(a == b for a, b in zip(base["toks"], toks))), greedy_prompts=len(toks))
    for b in FLAGS.batch:
        out[f"decode_tok_s_b{b}"] = decode_tok_s(llm, int(b), FLAGS.steps)
    out["_lps"], out["_toks"] = lps, toks
    return out


def _fmt(r: dict, key: str, spec: str) -> str:
    return format(r[key], spec) if key in r else "—"


def main(argv):
    del argv
    rows = ["f32"] + [r for r in FLAGS.rows if r != "f32"]
    results, base = [], None
    for row in rows:
        r = measure(row, base)
        if row == "f32" and "error" not in r:
            base = {"lps": r["_lps"], "toks": r["_toks"]}
        r.pop("_lps", None), r.pop("_toks", None)
        results.append(r)
        print(json.dumps(r), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    meta = dict(date=str(datetime.date.today()), commit=commit, machine=platform.processor() or platform.machine(),
                cpus=os.cpu_count(), backend=jax.devices()[0].platform,
                jax=jax.__version__, model=FLAGS.model,
                command="python scripts/bench/quant_table.py " + " ".join(sys.argv[1:]))
    print(f"\n{meta}\n")
    bcols = "".join(f" decode tok/s b={b} |" for b in FLAGS.batch)
    print(f"| row | weight MiB | KV B/token |{bcols} ppl | KL mean / max | greedy exact | greedy agreement |")
    print("|---|" + "---|" * (6 + len(FLAGS.batch)))
    for r in results:
        if "error" in r:
            print(f"| {r['row']} | not run: {r['error']} |")
            continue
        tps = "".join(f" {_fmt(r, f'decode_tok_s_b{b}', '.1f')} |" for b in FLAGS.batch)
        kl = f"{r['kl_mean']:.4f} / {r['kl_max']:.3f}" if "kl_mean" in r else "0 / 0"
        exact = f"{r['greedy_exact']}/{r['greedy_prompts']}" if "greedy_exact" in r else "—"
        ppl = f"{r['ppl']:.3f}" + (f" (engine {r['ppl_engine']:.3f})" if "ppl_engine" in r else "")
        print(f"| {r['row']} | {r['weight_bytes'] / 2**20:.1f} | {r['kv_bytes_per_token']:.0f} |{tps} "
              f"{ppl} | {kl} | {exact} | {_fmt(r, 'greedy_agreement', '.2f')} |")
    if FLAGS.json:
        print(json.dumps({"metadata": meta, "rows": results}))


if __name__ == "__main__":
    app.run(main)
