"""Decode throughput with half of a batch constrained by a JSON schema against none, in one run, and the mask's
cost per step (host fill, and the in-jit apply on its own).

    PYTHONPATH=. python scripts/bench/structured_bench.py --out=structured_bench.json
    PYTHONPATH=. python scripts/bench/structured_bench.py --batch=32 --max_tokens=64 --rounds=2

Both modes decode the same prompts on the same engine, alternating, after one untimed warm-up round of each (which
compiles their step variants). Every row runs exactly --max_tokens tokens: free rows with ignore_eos, constrained
rows under a schema (one long string field) that cannot finish sooner, so both modes decode the same number of
tokens and the throughput ratio is a time ratio. Decode throughput counts decode steps only (prefill steps are
timed apart); the host mask time is `StructuredOutputManager.mask_seconds` over the steps that carried a mask.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from inference import SamplingParams, StructuredOutputsParams
from inference.sampling.sampler import SamplingTensors, sample_with_logprobs
from inference.sampling.token_mask import all_allowed, apply_token_mask

QUESTIONS = ["Tell me about the sea.", "Describe a city.", "Write about a cat.", "Explain rain.",
             "Describe a forest.", "Tell a story about a robot.", "Write about winter.", "Describe a market."]
#: A string field with a minimum length the model cannot reach within --max_tokens: no row stops early.
LONG_SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
               "required": ["story"], "additionalProperties": False}


def run_round(llm, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, float]:
    """Step the engine over the prompts; decode and prefill step time and tokens, and the host mask time."""
    engine = llm.engine
    structured = engine.structured
    mask_s, masked = structured.mask_seconds, structured.masked_steps
    ids = [f"bench-{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    decode_s = prefill_s = 0.0
    decode_steps = decode_tokens = 0
    seqs = [s for rid in ids for s in engine.requests[rid].seqs]
    while engine.has_unfinished_requests():
        steps_before = engine.stats.decode_steps
        tokens_before = sum(s.num_output_tokens for s in seqs)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if engine.stats.decode_steps > steps_before:
            decode_s += elapsed
            decode_steps += 1
            decode_tokens += sum(s.num_output_tokens for s in seqs) - tokens_before
        else:
            prefill_s += elapsed
    outputs = [engine.output_of(rid) for rid in ids]
    for rid in ids:
        engine.pop_finished(rid)
    return {"decode_s": decode_s, "decode_steps": decode_steps, "decode_tokens": decode_tokens,
            "decode_tok_s": decode_tokens / decode_s, "prefill_s": prefill_s,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "host_mask_s": structured.mask_seconds - mask_s, "masked_steps": structured.masked_steps - masked,
            "constrained_valid_prefix": all(o.outputs[0].text.startswith('{"story"') for o, p in
                                            zip(outputs, params) if p.structured_outputs is not None)}


def sampler_apply_cost(batch: int, vocab: int, repeats: int) -> dict[str, float]:
    """The jitted sampler on random [batch, vocab] logits with and without an (all-ones) mask, and the mask apply
    alone; the variants are timed interleaved (best of `repeats` each), so a busy machine slows them alike."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(batch, vocab)).astype(np.float32))
    mask = all_allowed(batch, vocab)
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(batch)]
    sample = jax.jit(lambda x, t: sample_with_logprobs(x, t, use_filters=False, num_top=0).tokens)
    tensors = {name: SamplingTensors.from_params(params, list(range(batch)), [0] * batch, pad_to=batch,
                                                 token_mask=m) for name, m in (("no_mask", None), ("mask", mask))}
    calls = {f"sampler_{name}_ms": (lambda t=t: sample(logits, t)) for name, t in tensors.items()}
    apply = jax.jit(lambda x, m: jnp.max(apply_token_mask(x, m), axis=-1))
    calls["mask_apply_alone_ms"] = lambda: apply(logits, mask)
    calls["max_alone_ms"] = lambda: apply(logits, None)  # the same reduction without the mask: the baseline
    best = {name: float("inf") for name in calls}
    for _ in range(repeats + 1):  # the first pass compiles
        for name, call in calls.items():
            start = time.perf_counter()
            call().block_until_ready()
            best[name] = min(best[name], 1e3 * (time.perf_counter() - start))
    best["sampler_mask_apply_ms"] = best["sampler_mask_ms"] - best["sampler_no_mask_ms"]
    best["mask_apply_ms"] = best["mask_apply_alone_ms"] - best["max_alone_ms"]
    return best


def cpu_name() -> str:
    """The host CPU's model name (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="none / half-constrained pairs, alternating")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args()
    from inference.entrypoints.llm import LLM

    llm = LLM(args.model, kv_cache_memory_bytes=256 << 20, max_num_seqs=args.batch, max_num_batched_tokens=512,
              compilation_cache_dir=None)
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
               for i in range(args.batch)]
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    schema = StructuredOutputsParams(json=LONG_SCHEMA, disable_any_whitespace=True)
    constrained = free.replace(structured_outputs=schema)
    modes = {"none": [free] * args.batch,
             "half_constrained": [constrained if i % 2 == 0 else free for i in range(args.batch)]}
    for params in modes.values():  # warm-up: compiles each mode's step variants
        run_round(llm, prompts, params)
    rounds: dict[str, list[dict]] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, params in modes.items():
            rounds[name].append(run_round(llm, prompts, params))
    best = {name: max(rs, key=lambda r: r["decode_tok_s"]) for name, rs in rounds.items()}
    half = best["half_constrained"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "model": args.model, "batch": args.batch, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "jax": jax.__version__, "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "decode_tok_s": {name: r["decode_tok_s"] for name, r in best.items()},
        "decode_tok_s_all_rounds": {name: [r["decode_tok_s"] for r in rs] for name, rs in rounds.items()},
        "ratio_half_constrained_vs_none": half["decode_tok_s"] / best["none"]["decode_tok_s"],
        "decode_step_ms": {name: 1e3 * r["decode_s"] / r["decode_steps"] for name, r in best.items()},
        "host_mask_ms_per_step": 1e3 * half["host_mask_s"] / max(half["masked_steps"], 1),
        "host_mask_rows_per_step": args.batch // 2 + args.batch % 2,
        "constrained_valid_prefix": half["constrained_valid_prefix"],
        **sampler_apply_cost(args.batch, llm.config.vocab_size, repeats=50),
        "rounds_detail": rounds,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
