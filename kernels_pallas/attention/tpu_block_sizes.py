"""Block sizes of the TPU ragged paged attention kernel (`attention/tpu.py`) as data: a table keyed by chip,
head_dim, KV dtype, page size and case, the way JAX's in-tree op (`ragged_paged_attention/tuned_block_sizes.py`)
and tpu-inference's RPA v3 (`v3/tuned_block_sizes.py`) keep theirs.

The entries are not tuned on hardware yet (no TPU was at hand): they are sized from VMEM arithmetic and the
upstream tables' choices for the same shapes, and compiled with the real Mosaic compiler for each chip
(`scripts/tools/aot_compile.py`). The first TPU sweep
(`scripts/bench/kernel_bench.py --tpu_ab`) replaces them; a lookup falls back from the exact key to the chip's
case default, so a new row changes nothing else.

KV moves one page of all a grid step's KV heads per DMA (`kv_heads_per_step`), so a block's VMEM is
`2 * heads * kv_tokens * 2D * itemsize`; `KV_BUFFER_BYTES` caps it.

Cases: "decode" (static `max_q_len == 1`: one query row per KV head and sequence, no causal mask) and "mixed"
(any other `max_q_len`: prefill, chunked prefill and decodes in one ragged batch).
"""

from __future__ import annotations

from typing import NamedTuple

from kernels_pallas.backend import target_device_kind

MiB = 1 << 20


class TpuBlocks(NamedTuple):
    """`kv_tokens`: KV tokens per block (rounded down to whole pages); `block_q`: query tokens per block (1 in
    decode); `vmem_limit_bytes`: the scoped-VMEM limit given to Mosaic (None: the compiler's default)."""

    kv_tokens: int
    block_q: int
    vmem_limit_bytes: int | None


# Scoped-VMEM limit per chip: physical VMEM is 128 MiB on v5e and v6e and 95 MiB on v5p; the compiler's default
# scoped limit (16 / 32 / 16 MiB) is what the kernel gets without one. Half of physical leaves room for XLA's
# own fusions around the call.
VMEM_LIMIT = {"v5e": 64 * MiB, "v6e": 64 * MiB, "v5p": 48 * MiB, "default": None}

# Budget of the double-buffered KV block (all of a grid step's KV heads): `pages_per_block` shrinks below
# `kv_tokens / page_size` when the step's heads would exceed it (many KV heads, or a wide head_dim).
KV_BUFFER_BYTES = {"v5e": 16 * MiB, "v6e": 16 * MiB, "v5p": 16 * MiB, "default": 8 * MiB}

# TensorCores per chip: a megacore chip (v5p) splits the parallel grid axis over its two cores, so its KV heads
# come in two steps; v5e and v6e have one core and take every KV head in one step (one DMA per page for all).
CORES = {"v5e": 1, "v6e": 1, "v5p": 2, "default": 1}

# (chip, case) -> (kv_tokens, block_q): the default of a chip and case.
CASE_DEFAULTS = {
    ("v5e", "decode"): (512, 1), ("v5e", "mixed"): (256, 32),
    ("v6e", "decode"): (1024, 1), ("v6e", "mixed"): (512, 32),
    ("v5p", "decode"): (1024, 1), ("v5p", "mixed"): (512, 32),
    ("default", "decode"): (512, 1), ("default", "mixed"): (256, 8),
}

# (chip, head_dim, kv dtype, page_size, case) -> (kv_tokens, block_q): shapes whose best block differs from the
# case default. head_dim 256 halves the KV tokens so a block moves the same bytes as at 128; int8 doubles them.
TUNED = {
    ("v5e", 256, "bfloat16", 16, "decode"): (256, 1),
    ("v5e", 256, "bfloat16", 16, "mixed"): (128, 32),
    ("v6e", 256, "bfloat16", 16, "decode"): (512, 1),
    ("v6e", 256, "bfloat16", 16, "mixed"): (256, 32),
    ("v5e", 128, "int8", 16, "decode"): (1024, 1),
    ("v6e", 128, "int8", 16, "decode"): (2048, 1),
    ("v6e", 64, "bfloat16", 16, "decode"): (2048, 1),
    ("v5e", 64, "bfloat16", 16, "decode"): (1024, 1),
}


def chip_generation(device_kind: str | None = None) -> str:
    """'v5e', 'v6e', 'v5p' or 'default' from a device kind ("TPU v5 lite", "TPU v6 lite", "TPU v5"); None: the
    chip being compiled for (`backend.target_device_kind`)."""
    kind = (device_kind or target_device_kind("tpu") or "").lower()
    if "v6" in kind:
        return "v6e"
    if "v5" in kind:
        return "v5e" if ("lite" in kind or "v5e" in kind) else "v5p"
    return "default"


def kv_heads_per_step(chip: str, num_kv_heads: int) -> int:
    """KV heads per grid step (and per KV DMA): all of them on a one-core chip; on a megacore chip an even head
    count is halved so both cores get a step (an odd one stays whole: one core idles rather than splitting a
    page's DMA unevenly)."""
    cores = CORES[chip]
    return num_kv_heads // cores if num_kv_heads % cores == 0 else num_kv_heads


def block_sizes(chip: str, head_dim: int, kv_dtype: str, page_size: int, max_q_len: int) -> TpuBlocks:
    """The table's entry for these shapes: the exact key, else the chip's default for the case."""
    if chip not in VMEM_LIMIT:
        raise ValueError(f"unknown TPU chip {chip!r}; expected one of {sorted(VMEM_LIMIT)}")
    case = "decode" if max_q_len == 1 else "mixed"
    kv_tokens, block_q = TUNED.get((chip, head_dim, str(kv_dtype), page_size, case), CASE_DEFAULTS[chip, case])
    return TpuBlocks(kv_tokens, min(block_q, max(1, max_q_len)), VMEM_LIMIT[chip])
