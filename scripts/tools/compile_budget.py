"""Compile budget of a serving engine: the step variants it can compile, by family, before and after the cuts, the
warm-up seconds per family, and what each cut costs a step (side-by-side ratios in one run).

    python scripts/tools/compile_budget.py                       # counts at the server's defaults (scripts/engine_flags.py)
    python scripts/tools/compile_budget.py --mode=warmup         # + LLM.warmup()'s seconds per family
    python scripts/tools/compile_budget.py --mode=cost           # + step time of each cut against the variant it replaces
    python scripts/tools/compile_budget.py --out=budget.json

"Before" counts the shapes with every bucket axis (`BucketLimits.query_buckets` / `page_buckets` on) and the
flags unfolded: filters x sample logprobs x token mask x (no penalties, or one per pair of penalty id-length
buckets), and prompt logprobs on prefill. "After" is `inference/engine/compile_budget.py: count_variants`.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

from absl import app, flags

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: the repo root, for `scripts`
from scripts.engine_flags import build_llm  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's own flags, defined when it runs (not on import: tests import it beside the other launchers,
    whose flags share the one absl namespace); the engine's are scripts/engine_flags.py's."""
    flags.DEFINE_enum("mode", "count", ["count", "warmup", "cost"], "count: variants only; warmup: also run "
                      "the warm-up per family; cost: also time each cut against the variant it replaces.")
    flags.DEFINE_string("out", None, "Write the JSON here (it is printed either way).")
    flags.DEFINE_integer("reps", 15, "--mode=cost: timed A/B pairs per comparison (medians reported).")


def count_before_after(engine) -> dict:
    """Variants per family with every axis and flag (before) and with the cuts and the fold (after)."""
    from inference.engine.compile_budget import count_variants
    from inference.runtime.batch import bucket_ladder
    from inference.runtime.step_variants import penalty_length
    from inference.runtime.warmup import decode_shapes, prefill_shapes, verify_shapes

    full = dataclasses.replace(engine.limits, query_buckets=True, page_buckets=True)
    lengths = len(bucket_ladder(16, penalty_length(engine.max_model_len)))  # MIN_PENALTY_TOKENS .. the context
    decode_flags = 2 * 2 * 2 * (1 + lengths * lengths)  # filters x logprobs x mask x (no penalties | Lp x Lo)
    before = {"decode": len(decode_shapes(full)) * decode_flags,
              "prefill": len(prefill_shapes(full, engine.page_size)) * decode_flags * 2}  # x prompt logprobs
    shapes = {"decode": [len(decode_shapes(full)), len(decode_shapes(engine.limits))],
              "prefill": [len(prefill_shapes(full, engine.page_size)),
                          len(prefill_shapes(engine.limits, engine.page_size))]}
    if engine.num_spec:
        before["verify"] = len(verify_shapes(full, engine.page_size, engine.num_spec)) * decode_flags * 2
        shapes["verify"] = [len(verify_shapes(full, engine.page_size, engine.num_spec)),
                            len(verify_shapes(engine.limits, engine.page_size, engine.num_spec))]
    # What warmup(prefill=True) compiled before this change: every shape with filters off / on, nothing else.
    before_warmup = 2 * (shapes["decode"][0] + shapes["prefill"][0])
    after = count_variants(engine)
    return {"limits": dataclasses.asdict(engine.limits), "penalty_length_buckets": lengths,
            "shapes_before_after": shapes, "variants_before": before, "variants_after": after,
            "total_before": sum(before.values()), "total_after": sum(after.values()),
            "old_warmup_prefill_true": before_warmup,
            "before_without_penalty_lengths": 8 * shapes["decode"][0] + 16 * shapes["prefill"][0]}


def _batch(n: int, context: int, count: int, page: int, params=None):
    """A batch of n sequences of `context` tokens whose last `count` tokens run now, on disjoint pages."""
    from inference.engine.scheduled_batch import ScheduledBatch
    from inference.engine.sequence import Sequence as Seq
    from inference.sampling.params import SamplingParams

    per_seq = -(-context // page)
    seqs = []
    for i in range(n):
        seq = Seq(seq_id=i, request_id=str(i), index=0, token_ids=[(7 * i + j) % 1000 + 10 for j in range(context)],
                  num_prompt_tokens=context if count > 1 else context - 1, params=params or SamplingParams(), seed=i,
                  arrival_order=i)
        seq.num_computed_tokens = context - count
        seq.block_tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))]
        seqs.append(seq)
    return ScheduledBatch(seqs, [count] * n)


def _ab(run_a, run_b, reps: int) -> dict:
    """Median seconds of A and B, timed alternately (A, B, A, B, ...) after one untimed call of each."""
    run_a(), run_b()
    a, b = [], []
    for _ in range(reps):
        for fn, out in ((run_a, a), (run_b, b)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    ma, mb = statistics.median(a), statistics.median(b)
    return {"a_ms": round(ma * 1e3, 2), "b_ms": round(mb * 1e3, 2), "ratio_b_over_a": round(mb / ma, 3)}


def cut_costs(llm, reps: int) -> dict:
    """Step time of each cut (B) against what it replaces (A), on the engine's own runner."""
    from inference.runtime.batch import build_model_input
    from inference.runtime.step_variants import StepFlags, fold_extras
    from inference.sampling.params import SamplingParams
    from inference.sampling.sampler import SamplingTensors
    from inference.sampling.token_mask import all_allowed

    engine, runner = llm.engine, llm.runner
    page, cut = engine.page_size, engine.limits
    full = dataclasses.replace(cut, query_buckets=True, page_buckets=True)
    vocab = runner.config.vocab_size
    out = {}

    def step(batch, limits, params, *, logprobs=False, mask=False, pen=False, fold=False, filters=False):
        """One step's call; `fold`: the extras variant (`fold_extras`), else only the parts named."""
        inp, _ = build_model_input(batch, page, limits)
        rows, seqs = inp.logits_indices.shape[0], batch.seqs
        sampling = SamplingTensors.from_params(
            params, [s.seed for s in seqs], [0] * len(seqs), pad_to=rows,
            prompt_token_ids=[s.token_ids[:s.num_prompt_tokens] for s in seqs] if pen else None,
            output_token_ids=[s.token_ids[s.num_prompt_tokens:] for s in seqs] if pen else None,
            token_mask=all_allowed(rows, vocab) if mask else None)
        if fold:
            sampling = fold_extras(sampling, StepFlags(extras=True), vocab_size=vocab, penalty_len=engine.penalty_len,
                                   sharding=engine.runner.token_sharding)
        return lambda: runner.execute(inp, sampling, is_decode=batch.is_decode, logprobs=logprobs or fold,
                                      use_filters=filters)

    greedy = SamplingParams(temperature=0.0)
    for n in (1, min(32, cut.max_seqs)):
        batch = _batch(n, 100, 1, page)
        out[f"decode_pages_{n}seq"] = {"a": f"{batch.seqs[0].pages.__len__()} pages bucketed", "b": "max width",
                                       **_ab(step(batch, full, [greedy] * n), step(batch, cut, [greedy] * n), reps)}
    sampled = SamplingParams(temperature=0.8, seed=0)
    for n, count in ((4, 30), (32, 2)):  # a 128-token and a 64-token prefill (the latter: many rows, few tokens)
        batch = _batch(n, 40, count, page)
        out[f"prefill_fold_{n}x{count}"] = {"a": "plain (sampled rows)", "b": "filters + extras (the prefill fold)",
                                            **_ab(step(batch, cut, [sampled] * n),
                                                  step(batch, cut, [sampled] * n, fold=True, filters=True), reps)}
    batch = _batch(4, 30, 30, page)  # 120 tokens: a 128-token bucket, longest query 30 (bucket 32)
    out["prefill_query_4x30"] = {"a": "query bucket 32, pages bucketed", "b": "query = token bucket, max width",
                                 **_ab(step(batch, full, [greedy] * 4), step(batch, cut, [greedy] * 4), reps)}
    for n in (1, min(32, cut.max_seqs)):
        batch = _batch(n, 100, 1, page)
        lp = [SamplingParams(temperature=0.0, logprobs=1)] + [greedy] * (n - 1)
        pen = [SamplingParams(temperature=0.0, repetition_penalty=1.2)] + [greedy] * (n - 1)
        folded = step(batch, cut, lp, fold=True)
        out[f"extras_logprobs_{n}seq"] = {"a": "logprobs only", "b": "extras (+ all-ones mask, no-op penalties)",
                                          **_ab(step(batch, cut, lp, logprobs=True), folded, reps)}
        out[f"extras_mask_{n}seq"] = {"a": "mask only", "b": "extras",
                                      **_ab(step(batch, cut, [greedy] * n, mask=True), folded, reps)}
        out[f"extras_penalties_{n}seq"] = {"a": "penalties only (ids bucketed)", "b": "extras (ids at the context)",
                                           **_ab(step(batch, cut, pen, pen=True),
                                                 step(batch, cut, pen, fold=True, pen=True), reps)}
    return out


def _memory_maps() -> int | None:
    """This process's memory mappings (Linux), or None elsewhere."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    import jax

    start = time.perf_counter()
    llm = build_llm()
    result = {"backend": jax.default_backend(), "jax": jax.__version__, "model": llm.runner.config.name,
              "attn_impl": llm.runner.attn_impl, "load_seconds": round(time.perf_counter() - start, 1),
              **count_before_after(llm.engine)}
    if FLAGS.mode == "warmup":
        from inference.engine.compile_budget import warmup_serving

        start, maps = time.perf_counter(), _memory_maps()
        result["warmup"] = warmup_serving(llm.engine)
        result["warmup_seconds"] = round(time.perf_counter() - start, 1)
        compiled = sum(v["compiled"] for v in result["warmup"].values())
        if maps is not None and compiled:  # XLA:CPU maps each kernel apart; vm.max_map_count caps a process
            result["memory_maps_per_executable"] = round((_memory_maps() - maps) / compiled)
            result["memory_maps_now"] = _memory_maps()
    if FLAGS.mode == "cost":
        result["cut_costs"] = cut_costs(llm, FLAGS.reps)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if FLAGS.out:
        Path(FLAGS.out).write_text(text)


if __name__ == "__main__":
    define_flags()
    app.run(main)
