"""The Pallas Triton attention kernel's tuning (`attention/gpu.py`) as data, per chip: for each kind of batch
(decode, mixed, prefill) and tile dtype, the query rows per program, the KV block, Triton's warps and pipeline depth;
and the split-KV rule. tpu-inference keeps its kernels' tuning the same way (`tuned_block_sizes.py`).

Every entry says what it rests on (`source`): a timing on a device (the run named, its figures in
BENCHMARKS.md's H200 section), or "default" with what it was chosen from (ptxas's registers, spills and
shared memory in deviceless compiles: it fits; nothing about speed) and the bench run that would tune it. One
configuration per entry has been timed at most: no entry is the winner of a sweep yet.

What ptxas says about each entry (deviceless, sm_90a, `scripts/tools/aot_compile.py --what=kernels --quick`, its
D 128 / Hkv 8 cases: decode 64 x 2048, mixed 32 decodes + 2 x 256-query chunks, prefill 4 x 512; Hq 32, page 16)
is in `docs/accelerators.md` ("The Triton kernel's tuning table, compiled"), and `tests/scripts/test_aot_compile.py`
checks that every entry compiles for H100 and H200 without bf16 spills, within the shared memory a block may opt
into.

Kinds: decode is `max_q_len == 1`; mixed is longer queries in a batch whose static shape leaves at least half of
its slots' query capacity empty (`num_tokens * 2 <= max_seqs * max_q_len`: mostly short sequences beside a few
prefill chunks, the engine's mixed steps; its own prefill buckets, 4 x 512 in 2048 tokens, are full); prefill is
the rest.
"""

from __future__ import annotations

import dataclasses

KINDS = ("decode", "mixed", "prefill")
DTYPES = ("bfloat16", "int8", "float32")  # the tiles' dtype: float32 when q or the cache is f32


@dataclasses.dataclass(frozen=True)
class Blocks:
    rows: int  # query rows per program: block_q * next_pow2(group)
    kv_tokens: int  # most KV tokens per block
    kv_bytes: int  # most bytes of K + V per block (one pipeline stage's shared-memory buffer)
    num_warps: int
    num_stages: int
    source: str


@dataclasses.dataclass(frozen=True)
class SplitRule:
    """Split each program's KV range until the grid has about `target_programs` programs, at most `max_splits`."""

    target_programs: int
    max_splits: int
    source: str


def batch_kind(max_q_len: int, num_tokens: int, max_seqs: int) -> str:
    """decode / mixed / prefill from the batch's static shape (the module docstring says why)."""
    if max_q_len == 1:
        return "decode"
    return "mixed" if 2 * num_tokens <= max_seqs * max_q_len else "prefill"


_KIB = 1024
_H200_RUN = "H200, 2026-12-04, commit d9c3466, scripts/bench/kernel_bench.py (BENCHMARKS.md's H200 section)"
_COMPILED = ("default: chosen from deviceless compiles (no spills, registers well under 255, jax 0.12), never "
             "timed")
_SWEEP = "`kernel_bench.py --sweep` on the chip (KV block, warps, stages; rows for mixed) would tune it"

_HOPPER = {
    ("decode", "bfloat16"): Blocks(
        16, 256, 64 * _KIB, 8, 2,
        f"{_H200_RUN}: decode 64 x 2048 (Hq 32 / Hkv 8 / D 128, page 16: 128-token blocks) 0.266 ms, 64% of copy "
        f"bandwidth, the only configuration timed; {_SWEEP}"),
    ("decode", "int8"): Blocks(
        16, 128, 16 * _KIB, 8, 2,
        f"{_H200_RUN}: decode_int8 at 8 KV splits 0.292 ms, 30% of copy bandwidth, the only configuration timed; "
        f"{_SWEEP}, with --splits"),
    ("decode", "float32"): Blocks(16, 32, 32 * _KIB, 8, 1, f"{_COMPILED}; {_SWEEP} (f32 is the accuracy path)"),
    ("prefill", "bfloat16"): Blocks(
        128, 64, 32 * _KIB, 8, 2,
        f"{_COMPILED} as a kernel (the Llama-3-8B prefill of the {_H200_RUN.split(',')[0]} run used it, timed only "
        f"end to end); {_SWEEP}"),
    ("prefill", "int8"): Blocks(128, 64, 8 * _KIB, 8, 2, f"{_COMPILED}; {_SWEEP}"),
    ("prefill", "float32"): Blocks(64, 32, 16 * _KIB, 8, 1, f"{_COMPILED}; {_SWEEP}"),
}
# mixed batches: the prefill entries' values (what they ran with before mixed had entries of its own)
_HOPPER |= {("mixed", d): dataclasses.replace(_HOPPER[("prefill", d)], source=f"{_COMPILED} (the prefill entry's "
                                                                              f"values); {_SWEEP}")
            for d in DTYPES}
_HOPPER[("mixed", "bfloat16")] = dataclasses.replace(
    _HOPPER[("prefill", "bfloat16")],
    source=f"{_H200_RUN}: mixed (16 decodes of 2048 + 2 x 512-query chunks) 0.276 ms, 18% of copy bandwidth with "
           f"these values (the prefill entry's, before mixed had its own); {_SWEEP}")
_H100_SOURCE = "default: the H200's entry (the same SM: 132 SMs, 227 KiB shared memory a block; only HBM differs)"

# chip -> (kind, dtype) -> Blocks. "default": any other GPU.
BLOCK_SIZES = {
    "h200": _HOPPER,
    "h100": {k: dataclasses.replace(v, source=f"{_H100_SOURCE}; never timed on an H100") for k, v in _HOPPER.items()},
    "default": {k: dataclasses.replace(v, source="default: the Hopper entry; never timed on this GPU")
                for k, v in _HOPPER.items()},
}

_H200_SPLITS = SplitRule(
    512, 16,
    f"{_H200_RUN}: at 64 x 2048 (512 programs at Hkv 8) splits 1 / 4 / 8 gave 64% / 64% / 60% of copy bandwidth, "
    "and the rule picks 1 there; fewer programs (small batches) were never timed: kernel_bench.py at batch 1-16 "
    "with --splits would tune the target")
SPLIT_RULES = {
    "h200": _H200_SPLITS,
    "h100": dataclasses.replace(_H200_SPLITS, source=f"{_H100_SOURCE}; never timed on an H100"),
    "default": dataclasses.replace(_H200_SPLITS, source="default: the Hopper rule; never timed on this GPU"),
}


def blocks(chip: str, kind: str, dtype: str) -> Blocks:
    """The entry of `chip` ('h100', 'h200' or 'default') for a batch `kind` and tile `dtype`."""
    if kind not in KINDS or dtype not in DTYPES:
        raise ValueError(f"no Triton tuning entry for kind {kind!r}, dtype {dtype!r}; kinds {KINDS}, dtypes {DTYPES}")
    return BLOCK_SIZES.get(chip, BLOCK_SIZES["default"])[(kind, dtype)]
