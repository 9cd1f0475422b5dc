"""SmolLM2 (or any model) with quantized weights side by side with float32 in one process.

    python scripts/quant_model_bench.py                       # f32, int8, int4, gguf on smollm2-135m
    python scripts/quant_model_bench.py --modes=int8 --steps=16

Prints a markdown table: parameter bytes (all leaves; linears = q/k/v/o/gate/up/down + LM head/tied embedding),
decode tok/s at batch 1 and 32 (continuous-batching engine, greedy, ignore_eos; decode time = time of N-token runs
minus 1-token runs, after a warm-up run of the same shape), greedy agreement with float32 over 32 tokens on the
reference fixture prompts (identical continuations, and the mean fraction of tokens before the first difference:
tokens after a difference are not comparable), and the mean / max per-position KL(p_f32 || p_quant) of the cache-free forward's
next-token distributions over the fixture prompts.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.llm import LLM  # noqa: E402
from inference.sampling_params import SamplingParams  # noqa: E402
from models.quantized import param_bytes  # noqa: E402
from tests.reference_fixtures import load_reference  # noqa: E402


def linear_bytes(llm: LLM) -> int:
    model = nnx.merge(llm.runner.graphdef, llm.runner.params)
    from models.decoder import linear_weight_names, weight_targets
    targets = weight_targets(model)
    names = linear_weight_names(model) + (["embed"] if model.lm_head is None else [])
    return sum(param_bytes(targets[n].get_value()) for n in names)


def forward_logprobs(llm: LLM, ids: np.ndarray) -> np.ndarray:
    model = nnx.merge(llm.runner.graphdef, llm.runner.params)
    logits = nnx.jit(lambda m, t: m.forward(t))(model, jnp.asarray(ids)[None])[0]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))


def kl(p_log: np.ndarray, q_log: np.ndarray) -> np.ndarray:
    """Per-position KL(p || q) in nats."""
    return np.sum(np.exp(p_log) * (p_log - q_log), axis=-1)


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(ref: list[int], got: list[int]) -> float:
    """Fraction of the tokens generated before the first difference (1.0: identical)."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i / len(ref)
    return 1.0


def decode_tok_s(llm: LLM, batch: int, steps: int) -> float:
    prompt = [[1 + (i * 7 + j) % 500 for j in range(16)] for i in range(batch)]

    def run(n):
        t = time.perf_counter()
        llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=n, temperature=0.0,
                                                                             ignore_eos=True))
        return time.perf_counter() - t

    run(steps), run(1)  # compile and warm
    t_n, t_1 = min(run(steps) for _ in range(2)), min(run(1) for _ in range(2))
    return batch * (steps - 1) / max(t_n - t_1, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--modes", default="f32,int8,int4,gguf")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed run")
    ap.add_argument("--greedy-tokens", type=int, default=32)
    args = ap.parse_args()
    ref = load_reference()["prompts"]
    prompts = [[int(t) for t in p["prompt_ids"]] for p in ref]
    rows, base_lp, base_greedy = [], None, None
    for mode in args.modes.split(","):
        llm = LLM(args.model, quantization=None if mode == "f32" else mode, kv_cache_memory_bytes=256 << 20,
                  max_num_seqs=32, max_num_batched_tokens=512, compilation_cache_dir=None)
        lps = [forward_logprobs(llm, np.asarray(p)) for p in prompts]
        toks = greedy(llm, prompts, args.greedy_tokens)
        if base_lp is None:
            base_lp, base_greedy = lps, toks
        kls = np.concatenate([kl(a, b) for a, b in zip(base_lp, lps)])
        agree = [agreement(a, b) for a, b in zip(base_greedy, toks)]
        exact = sum(a == b for a, b in zip(base_greedy, toks))
        row = dict(mode=mode, bytes=param_bytes(llm.get_params()), linear=linear_bytes(llm),
                   tok1=decode_tok_s(llm, 1, args.steps), tok32=decode_tok_s(llm, 32, args.steps),
                   kl_mean=float(kls.mean()), kl_max=float(kls.max()),
                   agree=float(np.mean(agree)), exact=f"{exact}/{len(toks)}")
        rows.append(row)
        print(row, flush=True)
        del llm
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    print(f"\n{datetime.date.today()} commit {commit}, {platform.processor() or platform.machine()}, "
          f"{jax.devices()[0].platform}, jax {jax.__version__}\n")
    print("| weights | param MiB | linear+head MiB | decode tok/s b=1 | decode tok/s b=32 | KL mean / max (nats) "
          "| greedy 32 tok: identical | prefix agreement |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['bytes'] / 2**20:.1f} | {r['linear'] / 2**20:.1f} | {r['tok1']:.1f} | "
              f"{r['tok32']:.1f} | {r['kl_mean']:.4f} / {r['kl_max']:.3f} | {r['exact']} | {r['agree']:.2f} |")


if __name__ == "__main__":
    main()
