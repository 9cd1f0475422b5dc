"""The compile budget of an engine: every step variant a serving workload can compile, by family, and the warm-up
that compiles them all before traffic, so a warmed-up server compiles nothing.

Families: `decode` and `prefill` (the target's steps), `verify` (speculative verification: drafts in the batch),
`draft` (the draft model's catch-up chunks and proposal step, `speculative_method="draft"`), `copy_pages`
(copy-on-write page copies, one per power-of-two count), `copy_state_slots` (a hybrid model's state-slot copies:
forks, prefix checkpoints and their restores, one per power-of-two count). Async scheduling's gather of the previous step's tokens
runs inside every step (`TokenFeed`), so it adds no family and no variant. A family's variants are its shapes
(`inference/runtime/warmup.py`) times the static flags a batch can pick (`inference/runtime/step_variants.py`:
filters, and the folded extras: logprobs, token mask and penalties, in decode and verification; prompt logprobs
in prefill, which always runs filters and extras; draft probabilities in verification). The token mask carries
`allowed_token_ids` too, and the extras the sparse logit edits (`logit_bias`, `bad_words`, `min_tokens`) up to
`FOLDED_EDITS` per row. Not counted and not warmed: a row with more edits than that (its list length keeps its own
bucket), and LoRA slot writes (`inference/lora/slots.py`, one executable).

Each executable holds memory mappings (XLA:CPU maps every compiled kernel's code and data separately: about 600
for a SmolLM2 step), and a process may have only `vm.max_map_count` (65,530 by default on Linux) of them, so on
CPU the budget is also a hard ceiling near a hundred SmolLM2 steps per process (BENCHMARKS.md, compile budget).
"""

from __future__ import annotations

import time

from inference.runtime.step_variants import StepFlags, StepVariant, penalty_length, warm_variants
from inference.runtime.warmup import decode_shapes, prefill_shapes, verify_shapes
from inference.spec_decode.proposer import DraftModelProposer
from inference.runtime.batch import bucket, bucket_ladder
from kernels_pallas.attention.dispatch import resolve_impl
from kernels_pallas.backend import target_backend
from kernels_pallas.mla.dispatch import resolve_mla_impl

FAMILIES = ("decode", "prefill", "verify", "draft", "copy_pages", "copy_state_slots")

#: The flag sets a decode (or verification) step can take; a prefill step (filters and extras always on,
#: `StepFlags.of_batch`); a verification step that also carries prompt chunks (mixed scheduling).
_DECODE_FLAGS = [StepFlags(f, e) for f in (False, True) for e in (False, True)]
_PREFILL_FLAGS = [StepFlags(True, True), StepFlags(True, True, True)]
_MIXED_VERIFY_FLAGS = _DECODE_FLAGS + [StepFlags(f, True, True) for f in (False, True)]


def reads_padded_pages(config, page_size: int, attn_impl: str = "auto", kv_dtype=None) -> bool:
    """Whether decode attention costs every padded page (so finer page buckets pay) on CPU: the pure-JAX references
    do, the C++ kernel stops at each sequence's length. Which one `attn_impl` runs is the dispatchers' answer
    (`resolve_impl`, `resolve_mla_impl`), asked rather than re-derived so the two cannot disagree. Off CPU it stays
    False: there the reference runs only where a kernel cannot tile the shapes (or for MLA on TPU), and whether the
    finer ladder pays for its extra compiles there is unmeasured. `kv_dtype`: the cache's (the CPU kernel reads
    `cpu.KV_DTYPES`; None: one every kernel reads)."""
    return target_backend() == "cpu" and attention_is_reference(config, page_size, attn_impl, kv_dtype)


def attention_is_reference(config, page_size: int, attn_impl: str = "auto", kv_dtype=None) -> bool:
    """Whether the steps' attention is the pure-JAX reference (GQA or MLA), the dispatchers' own answer."""
    if config.is_mla:
        return resolve_mla_impl(attn_impl, page_size, config.kv_lora_rank, config.qk_rope_head_dim) == "reference"
    return resolve_impl(attn_impl, page_size, config.head_dim, kv_dtype) == "reference"


def scheduling_policy(config, page_size: int, attn_impl: str, kv_dtype, scheduler, num_spec: int = 0) -> str:
    """The policy `SchedulerConfig(policy="auto")` runs: "mixed" (every running sequence's decode token and prompt
    chunks in one step, so decode rows never sit out a prefill) where attention is a ragged kernel, which pays for
    each sequence's own query; "prefill_first" under the pure-JAX reference, which pays for the step's longest query
    in every sequence, when the token budget cannot hold a decode token for each of `max_num_seqs` sequences, or when
    speculating (`num_spec` drafts: mixed verification steps add every prefill shape to the verify family,
    `serving_variants`, several times the executables a process may map on CPU).
    Measured on CPU (the C++ kernel): mixed held ITL p99 / p50 lower while prompts arrive (BENCHMARKS.md, host
    overhead, third round), and lost throughput on a whole batch at once (fourth round): the engine runs "auto"'s
    mixed steps prefill_first where only final outputs are read (`Engine._step`). On the accelerators' ragged
    kernels it follows vLLM V1's default, unmeasured here."""
    if scheduler.policy != "auto":
        return scheduler.policy
    if num_spec or scheduler.max_num_batched_tokens < scheduler.max_num_seqs or \
            attention_is_reference(config, page_size, attn_impl, kv_dtype):
        return "prefill_first"
    return "mixed"


def padding_is_free(config, page_size: int, attn_impl: str = "auto", kv_dtype=None) -> bool:
    """Whether the attention kernel the steps run ignores the longest-query bound and reads no page past a
    sequence's length, so those two bucket axes buy nothing (`BucketLimits.query_buckets` / `page_buckets` off):
    the C++ CPU kernel. The reference reads every padded query and page; the TPU and Triton kernels size their
    grids by both, so they keep the buckets."""
    if target_backend() != "cpu" or config.is_mla:
        return False
    return resolve_impl(attn_impl, page_size, config.head_dim, kv_dtype) == "cpu"


def serving_variants(engine, *, prefill: bool = True, extras: bool = True) -> dict[str, list[StepVariant]]:
    """The target's step variants serving can compile under `engine`'s limits, by family. `prefill=False`: decode
    only; `extras=False`: without the extras flag and prompt logprobs (those then compile on first use)."""
    limits, page = engine.limits, engine.page_size
    decode_flags = [f for f in _DECODE_FLAGS if extras or not f.extras]
    prefill_flags = [f for f in _PREFILL_FLAGS if extras or not f.prompt_logprobs]
    mixed_flags = [f for f in _MIXED_VERIFY_FLAGS if extras or not f.extras]
    out = {"decode": [StepVariant(s, True, f) for s in decode_shapes(limits) for f in decode_flags]}
    if not prefill:
        return out
    out["prefill"] = [StepVariant(s, False, f) for s in prefill_shapes(limits, page) for f in prefill_flags]
    if engine.num_spec:
        mixed = engine.scheduler.config.policy == "mixed"
        with_probs = (False, True) if isinstance(engine.proposer, DraftModelProposer) else (False,)
        out["verify"] = [StepVariant(s, False, f, engine.num_spec, p)
                         for s in verify_shapes(limits, page, engine.num_spec, mixed=mixed)
                         for f in (mixed_flags if mixed else decode_flags) for p in with_probs]
    return out


def count_variants(engine) -> dict[str, int]:
    """How many executables serving can compile, by family (`FAMILIES`), at `engine`'s limits."""
    counts = {k: len(v) for k, v in serving_variants(engine).items()}
    if engine.proposer is not None and engine.proposer.num_variants():
        counts["draft"] = engine.proposer.num_variants()
    counts["copy_pages"] = len(_copy_counts(engine))
    if engine.runner.num_state_slots:
        counts["copy_state_slots"] = len(_state_copy_counts(engine))
    return counts


def _state_copy_counts(engine) -> list[int]:
    """The padded numbers of state-slot copies a step can ask for (forks, checkpoints, restores): queued copies
    have distinct destinations, so at most one per slot."""
    return bucket_ladder(1, bucket(engine.runner.num_state_slots))


def _copy_counts(engine) -> list[int]:
    """The padded numbers of page copies a step can ask for: at most one partial page per sequence per group."""
    return bucket_ladder(1, bucket(engine.limits.max_seqs))


def warmup_serving(engine, *, prefill: bool = True, extras: bool = True) -> dict[str, dict]:
    """Compile every variant of `serving_variants` (and the draft model's steps, and the page copies, with
    `prefill`); returns per family {"variants", "compiled", "seconds"} (compiled < variants where an earlier call
    or warm-up already held some)."""
    report = {}
    penalty_len = penalty_length(engine.max_model_len)
    families = serving_variants(engine, prefill=prefill, extras=extras)
    for family, variants in families.items():
        start = time.perf_counter()
        compiled = warm_variants(engine.runner, variants, penalty_len=penalty_len)
        report[family] = {"variants": len(variants), "compiled": compiled, "seconds": time.perf_counter() - start}
    if not prefill:
        return report
    if engine.proposer is not None and engine.proposer.num_variants():
        start = time.perf_counter()
        compiled = engine.proposer.warmup()
        report["draft"] = {"variants": engine.proposer.num_variants(), "compiled": compiled,
                           "seconds": time.perf_counter() - start}
    start, before = time.perf_counter(), engine.runner.num_compilations()["copy_pages"]
    counts = _copy_counts(engine)
    for group in range(len(engine.runner.group_caches)):
        for n in counts:
            engine.runner.copy_pages([(0, 0)] * n, group=group)  # page 0 onto itself: rewrites the same values
    compiled = engine.runner.num_compilations()["copy_pages"] - before
    report["copy_pages"] = {"variants": len(counts), "compiled": compiled, "seconds": time.perf_counter() - start}
    if engine.runner.num_state_slots:
        start, before = time.perf_counter(), engine.runner.num_compilations()["copy_state_slots"]
        counts = _state_copy_counts(engine)
        for n in counts:
            engine.runner.copy_state_slots([(0, 0)] * n)  # the null slot onto itself
        compiled = engine.runner.num_compilations()["copy_state_slots"] - before
        report["copy_state_slots"] = {"variants": len(counts), "compiled": compiled,
                                      "seconds": time.perf_counter() - start}
    return report
