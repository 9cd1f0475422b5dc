"""Ragged paged attention as a Pallas GPU kernel (Triton lowering), with the signature of the pure-JAX reference.

Semantics are exactly those of `ragged_paged_attention_reference`; this docstring says why the kernel is shaped
the way it is.

Why the Triton lowering (`jax.experimental.pallas.triton`) and not Mosaic GPU: on Hopper, Pallas-Triton is the
mature path (JAX's own GPU attention ops use it), it has pointer-based gathers, so one `k_ref[pages]` load
fetches a block of scattered pages, and it runs on CPU in Pallas' generic interpreter (`interpret=True`), which is
how it is tested here. Mosaic GPU (TMA, warpgroup MMA) could go faster on H100/H200, but on jax 0.10.2 its
interpreter cannot run BlockSpecs (`pl.pallas_call` with non-trivial BlockSpecs fails, `plgpu.kernel(...,
interpret=True)` has no discharge rule for `copy_gmem_to_smem`), so a Mosaic GPU kernel could not be tested without
hardware.

Grid `(sequence, kv_head, query_block * num_kv_splits)`.
  * One program owns the `group = Hq // Hkv` query heads of one KV head for `block_q` query tokens of one sequence,
    as the rows of a single `[rows, D]` tile (rows = token-major, head-minor; `group` zero-padded to a power of two
    `Gp`). Each KV page is loaded once per (sequence, KV head, query block) and reused by every query head of the
    group, which is GQA's whole bandwidth saving. Triton wants every tensor dimension a power of two and `tl.dot`
    wants M, N, K >= 16, so rows = block_q * Gp is a power of two >= 16 and a KV block is `pages_per_block` whole
    pages with `pages_per_block * page_size` a power of two >= 16 (page_size must be a power of two).
  * The wrapper lays q out as `[Hkv, T_pad * Gp, D]` (a cheap transpose of q, not of the cache), so a query block is
    one contiguous row range, and pads T by `block_q` tokens so a block that starts near the end never reads past
    the array (Pallas' interpreter would clamp such a slice where Triton would not). The output uses the same
    layout; a program stores only the rows it owns (masked store), so neighbouring sequences' programs write
    disjoint rows and need no ordering; rows owned by no valid sequence are zeroed by the wrapper.
  * KV (`kv_cache/layout.py`: `[Hkv, num_pages, page_size, 2 * D]`, each token's K in lanes [0, D), V in [D, 2D)): K and
    V are two BlockSpecs over KV head h's pages, column blocks 0 and 1 of width D (no copy; on Triton a BlockSpec
    is pointer arithmetic), and a block of pages is one gathered load `k_ref[pages]`: per page `page_size` rows of
    D contiguous elements. Page-table entries past the sequence's last page are replaced by page 0 before the
    load, so garbage table entries are never dereferenced.
  * Stale slots: a slot no query of the block sees (past kv_len, before the sliding window, a page that a padding
    table entry points at) may hold anything, NaN/Inf included (a freed page keeps its last owner's data), and
    K and V of a token share a row, so both are stale together. Keys outside `[kv_lo, kv_hi)` (the window start
    of the block's first query, the causal horizon of its last) have their V rows and V/K scales zeroed before
    anything multiplies them: V by a masked load (`other=0`), so a stale row is not even read (MLA, whose value
    is key part 0, by a `where`). A stale K only reaches its own score column, which the mask `where` replaces,
    so K is loaded unmasked. A masked key's probability is 0, or 1 while its row has seen no visible key yet
    (wiped by `alpha = 0` at the row's first visible key), and 0 * NaN would be NaN.
  * The KV loop runs only over blocks inside the causal horizon and the sliding window of the block's queries
    (dynamic fori_loop bounds), with the online softmax (running max, sum, accumulator in f32).
  * int8 cache: the scales `[Hkv, scale_rows, 128]` are passed as `[Hkv, scale_rows * 128]` (a reshape, no copy)
    and KV head h's flat row is gathered at `page * 2 * page_size + t` (K) and `+ page_size` (V) for the block's
    pages, then applied to score columns (K) and probability columns (V), as JAX's GPU paged attention does,
    rather than dequantizing `[block_kv, D]` tiles: the same product with fewer multiplies. The padding tail of
    the scale rows is never read.
  * Split-KV (`num_kv_splits > 1`, static; by default chosen from the grid size): long decode has few programs
    (sequences x KV heads: 8 x 3 = 24 for SmolLM2 at batch 8) for a GPU's 132 SMs, so each program's KV block range
    is cut into `num_kv_splits` contiguous chunks on the third grid axis;
    each writes its partial (max, sum, accumulator) in f32 and a second pass (plain XLA, tiny: `splits * T * Hq *
    D`) rescales and sums them. A split whose chunk is empty writes (mask, 0, 0) and gets weight 0.
  * The score is a sum of per-part dots (`paged_flash_attention` takes several (query, key) parts and an optional
    separate value), so the MLA kernel (`mla/gpu.py`: parts (q_latent, c) and (q_rope, k_rope), value =
    c) is this kernel, not a copy of it.
  * Precision: bf16 (and int8, computed in q's dtype) inputs use bf16 dots with f32 accumulation and probabilities
    rounded to bf16 for `p @ V`. f32 inputs use IEEE f32 dots (`F32_PRECISION = Precision.HIGHEST`: FMAs on the
    CUDA cores, no tensor cores), because the f32 path is the accuracy path (same numbers as the reference and the
    CPU kernel; bf16 is the serving dtype). Alternatives (compiled; accuracy emulated in numpy at D=128, relative
    to the output): TF32 (Triton's default) is ~5e-4 off, so it is not f32; 3xTF32
    (`DotAlgorithmPreset.TF32_TF32_F32_X3`) is f32-accurate on tensor cores but sits at 255 registers for 64+ row
    prefill tiles and cannot run in the CPU interpreter (XLA CPU rejects the algorithm); bf16x3 is ~1e-5 off.
    The cost of HIGHEST is f32 prefill at CUDA-core rate and small tiles (`BLOCK_SIZES`); ptxas's register use
    for the FMA dot is erratic across neighbouring tile shapes (some spill tens of KB), so the f32 entries were
    picked by compiling each of them, like all the others.

Block sizes: `gpu_tuning.BLOCK_SIZES` (per chip, decode / mixed / prefill, by dtype; each entry with the measurement
it came from) and the split rule `gpu_tuning.SPLIT_RULES`, chosen from deviceless compiles (`jax 0.12`,
`gpu_compile_report.py` parses ptxas): every table entry compiles for H100 and H200 without spills, at D 64/128,
Hkv 3/8 (split-KV on and off). Shared memory per program, as measured, follows from the tiles: the 64+ row
prefill tiles hold the q tile plus `num_stages` K+V blocks (bf16 D=128: 32 KiB q + 2 x 32 KiB = 96 KiB; 173
registers x 8 warps: one program per SM by registers, two by shared memory); the 16-row decode tiles hold
`num_stages - 1` K+V blocks plus a few KiB of layout-conversion scratch (bf16 D=128, 128 tokens: 64 + 8 = 72
KiB; 122 registers: two programs per SM). `num_stages=3` adds no third buffer for these gathered loads (only
barrier bytes), so the table uses 2 (1 for f32, whose loads are staged through shared memory anyway). V is
masked by a masked load rather than a `where` because the `where` kept V in registers (bf16 decode, 4 warps:
242 registers and 104 KiB with it, 168 and 72 KiB with the masked load).

Status: tested on CPU in interpret mode; compiled deviceless for sm_90a (Triton + ptxas) in the tests where
jax-cuda13-plugin is installed; not yet run on a GPU (`scripts/bench/kernel_bench.py` is the first check to run on
one), so the table is tuned on compiler numbers, not timings. Pallas' Triton backend is deprecated since jax
0.11 (still works in 0.12 with a DeprecationWarning).

Known costs (not correctness issues): decode with a small group wastes rows (MHA decode fills 1 of 16 rows; the
MMA is idle, not the memory system); each K/V load of a block is a gather of `page_size * D` contiguous elements
per page; no software pipelining beyond what Triton's `num_stages` does for the loop.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.backend import target_device_kind
from kernels_pallas.kv_cache.layout import cache_dims
from kernels_pallas.attention.reference import DEFAULT_MASK_VALUE, check_attention_inputs
from kernels_pallas.attention.gpu_tuning import SPLIT_RULES, batch_kind, blocks

MIN_DOT = 16  # tl.dot needs M, N, K >= 16

# f32 dots (an f32 cache with f32 queries): see the module docstring.
F32_PRECISION = lax.Precision.HIGHEST



def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a, b):
    """Ceil division of non-negative ints (traced or static)."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return lax.div(a + b - 1, b)


def _kernel(kv_lens_ref, cu_q_lens_ref, num_seqs_ref, page_table_ref, *refs, num_parts, value_is_key0, quantized,
            block_q, group_pad, page_size, pages_per_block, pages_per_seq, num_kv_splits, sm_scale, sliding_window,
            soft_cap, mask_value, v_scale, precision):
    """One (sequence, KV head, query block, KV split) program. refs: `num_parts` query refs, `num_parts` key refs
    (score = sum of the parts' dots: one part for plain attention, (latent, rope) for MLA), the value ref unless
    the value is key part 0 (MLA's latent), the KV head's flat scales for an int8 cache, then the outputs."""
    refs = list(refs)
    q_refs, k_refs = refs[:num_parts], refs[num_parts:2 * num_parts]
    refs = refs[2 * num_parts:]
    v_ref = None if value_is_key0 else refs.pop(0)
    scales_ref = refs.pop(0) if quantized else None
    out_refs = refs
    s = pl.program_id(0)
    j = pl.program_id(2)
    qb = lax.div(j, num_kv_splits)
    split = lax.rem(j, num_kv_splits)
    rows = block_q * group_pad
    block_kv = pages_per_block * page_size

    q_start = cu_q_lens_ref[s]
    q_len = cu_q_lens_ref[s + 1] - q_start
    kv_len = kv_lens_ref[s]
    block_first = qb * block_q  # index within the sequence of the block's first query
    n_valid = jnp.minimum(block_q, q_len - block_first)

    @pl.when((s < num_seqs_ref[0]) & (n_valid > 0))
    def _():
        row0 = (q_start + block_first) * group_pad
        qs = [r[pl.ds(row0, rows), :] for r in q_refs]  # [rows, D_i] each
        compute_dtype = qs[0].dtype
        dot_precision = precision if compute_dtype == jnp.float32 else None
        tok = lax.div(lax.broadcasted_iota(jnp.int32, (rows,), 0), group_pad)  # token offset of each row
        owned = tok < n_valid
        first_pos = kv_len - q_len + block_first
        q_pos = first_pos + tok  # [rows]

        # Keys some query of the block sees: [kv_lo, kv_hi) (causal horizon, sliding window). In KV blocks, then
        # this split's chunk. Slots outside it may hold anything (NaN/Inf of a freed page's last owner).
        kv_hi = first_pos + n_valid
        kv_lo = 0 if sliding_window is None else jnp.maximum(0, first_pos - sliding_window + 1)
        b_start = lax.div(kv_lo, block_kv)
        b_end = _cdiv(kv_hi, block_kv)
        chunk = _cdiv(b_end - b_start, num_kv_splits)
        lo = jnp.minimum(b_start + split * chunk, b_end)
        hi = jnp.minimum(lo + chunk, b_end)
        seq_pages = jnp.minimum(_cdiv(kv_len, page_size), pages_per_seq)

        def body(b, carry):
            m_prev, l_prev, acc_prev = carry
            page_no = b * pages_per_block + lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)
            pages = page_table_ref[pl.ds(b * pages_per_block, pages_per_block)]
            pages = jnp.where(page_no < seq_pages, pages, 0)  # never follow a table entry past the sequence
            k_pos = b * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
            in_range = (k_pos >= kv_lo) & (k_pos < kv_hi)
            ks = [r[pages].reshape(block_kv, -1) for r in k_refs]  # [block_kv, D_i] each: a gather of pages
            # V rows outside [kv_lo, kv_hi) must be zeros before `p @ V`: a masked key has p = 0 (or 1 while a row
            # has seen nothing yet), and 0 * NaN is NaN. A masked load (other=0) does not read them and, unlike a
            # `where`, costs no registers (module docstring). K needs no zeroing: a NaN stays in its own score
            # column, which the `where` below replaces.
            if value_is_key0:
                v = jnp.where(in_range[:, None], ks[0], jnp.zeros_like(ks[0]))
            else:
                shape = (pages_per_block, page_size, v_ref.shape[-1])  # index every axis: the interpreter's
                at = [lax.broadcasted_iota(jnp.int32, shape, a) for a in (1, 2)]  # masked load needs it
                at = (jnp.broadcast_to(pages[:, None, None], shape), *at)
                rows_ok = jnp.broadcast_to(in_range.reshape(pages_per_block, page_size, 1), shape)
                v = plgpu.load(v_ref.at[at], mask=rows_ok, other=jnp.zeros((), v_ref.dtype)).reshape(block_kv, -1)
            scores = sum(plgpu.dot(q, k.astype(compute_dtype), trans_b=True, precision=dot_precision)
                         for q, k in zip(qs, ks)) * sm_scale  # [rows, block_kv] f32
            if quantized:  # the KV head's scales flattened: page p's K scales at p * 2 * page_size, V after them
                scale_at = pages[:, None] * (2 * page_size) + lax.broadcasted_iota(
                    jnp.int32, (pages_per_block, page_size), 1)
                k_sc = jnp.where(in_range, scales_ref[scale_at].reshape(block_kv), 0.0)
                v_sc = jnp.where(in_range, scales_ref[scale_at + page_size].reshape(block_kv), 0.0)
                scores = scores * k_sc[None, :]
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < kv_len)
            if sliding_window is not None:
                visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
            scores = jnp.where(visible, scores, mask_value)

            m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.exp(scores - m_new[:, None])
            l_new = alpha * l_prev + jnp.sum(p, axis=1)
            if quantized:
                p = p * v_sc[None, :]
            pv = plgpu.dot(p.astype(compute_dtype), v.astype(compute_dtype), precision=dot_precision)
            return m_new, l_new, alpha[:, None] * acc_prev + pv

        value_dim = out_refs[0].shape[-1]
        init = (jnp.full((rows,), mask_value, jnp.float32), jnp.zeros((rows,), jnp.float32),
                jnp.zeros((rows, value_dim), jnp.float32))
        m_fin, l_fin, acc = lax.fori_loop(lo, hi, body, init)
        if v_scale is not None:
            acc = acc * v_scale
        row_slice = pl.ds(row0, rows)
        mask2d = jnp.broadcast_to(owned[:, None], acc.shape)
        if num_kv_splits == 1:
            (o_ref,) = out_refs
            out = acc / jnp.where(l_fin > 0, l_fin, 1.0)[:, None]
            plgpu.store(o_ref.at[row_slice, :], out.astype(o_ref.dtype), mask=mask2d)
        else:
            acc_ref, m_ref, l_ref = out_refs
            plgpu.store(acc_ref.at[row_slice, :], acc, mask=mask2d)
            plgpu.store(m_ref.at[row_slice], m_fin, mask=owned)
            plgpu.store(l_ref.at[row_slice], l_fin, mask=owned)


def tiles_ok(page_size: int, *dims: int) -> bool:
    """Whether the kernel can tile these shapes (Triton tensors need power-of-two sizes); "auto" falls back to the
    reference when it cannot (e.g. head_dim 80 or 96)."""
    return all(d > 0 and not d & (d - 1) for d in (page_size, *dims))


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Second split-KV pass: partial (acc [K, ..., D], max [K, ...], sum [K, ...]) over K splits -> softmax output."""
    m_max = jnp.max(m, axis=0)
    w = jnp.exp(m - m_max[None])
    l_tot = jnp.sum(w * l, axis=0)
    out = jnp.sum(w[..., None] * acc, axis=0)
    return out / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]


def gpu_chip(device_kind: str | None = None) -> str:
    """'h100', 'h200' or 'default' from a device kind ("NVIDIA H100 80GB HBM3", "NVIDIA H200"); None: the chip
    being compiled for (`backend.target_device_kind`)."""
    kind = (device_kind or target_device_kind("gpu") or "").lower()
    return next((chip for chip in ("h100", "h200") if chip in kind), "default")


def block_config(chip: str | None, group: int, page_size: int, pages_per_seq: int, max_q_len: int,
                 key_width: int, value_dim: int, dtype: str, kind: str | None = None) -> dict:
    """(block_q, pages_per_block, num_warps, num_stages) from the `gpu_tuning` entry of (chip, kind, dtype); kind
    None: decode for `max_q_len == 1`, else prefill. Rows = block_q * Gp: the entry's `rows`, scaled down for
    value dims over 128 (the f32 accumulator is rows x value_dim), fewer for short queries, at least 16 and at
    least Gp. KV block: the largest power of two within the entry's kv_tokens and kv_bytes; `key_width` is the
    lanes of K (all parts) plus V per token, and the block is not much longer than the longest sequence."""
    kind = kind or ("decode" if max_q_len == 1 else "prefill")
    entry = dataclasses.asdict(blocks(gpu_chip() if chip is None else chip, kind, dtype))
    group_pad = _next_pow2(group)
    rows = min(entry["rows"], max(MIN_DOT, entry["rows"] * 128 // value_dim))
    block_q = max(MIN_DOT // group_pad, min(_next_pow2(max_q_len), rows // group_pad), 1)
    token_bytes = key_width * jnp.dtype(dtype).itemsize
    fit = 1 << max(0, (entry["kv_bytes"] // token_bytes).bit_length() - 1)  # largest power of two within budget
    block_kv = max(MIN_DOT, min(entry["kv_tokens"], fit, _next_pow2(pages_per_seq * page_size)))
    return dict(block_q=block_q, pages_per_block=max(1, block_kv // page_size), num_warps=entry["num_warps"],
                num_stages=entry["num_stages"])


def default_kv_splits(num_programs: int, num_kv_blocks: int, target_programs: int = 512, max_splits: int = 16) -> int:
    """Split-KV count when the caller gives none: enough splits that the grid has ~`target_programs` programs
    (about 4 per SM on a 132-SM H100/H200, so that few long sequences still fill the GPU), a power of two, at most
    `max_splits` and at most the number of KV blocks of the longest sequence (`gpu_tuning.SPLIT_RULES` per chip,
    with what it was measured at)."""
    want = -(-target_programs // max(num_programs, 1))
    return max(1, min(max_splits, _next_pow2(want), num_kv_blocks))


def check_block_sizes(rows: int, block_kv: int) -> None:
    for name, val in (("block_q * next_pow2(group)", rows), ("pages_per_block * page_size", block_kv)):
        if val < MIN_DOT or val & (val - 1):
            raise ValueError(f"{name} = {val} must be a power of two >= {MIN_DOT} (Triton dot tiles); pick "
                             "block_q / pages_per_block accordingly or leave them None")


def to_rows(x: jax.Array, block_q: int, group_pad: int) -> jax.Array:
    """[T, Hkv, group, D] -> [Hkv, (T + block_q) * Gp, D]: a query block is one contiguous row range, and T is padded
    by block_q tokens so no block's window runs off the end."""
    num_tokens, num_kv_heads, group, dim = x.shape
    x = jnp.pad(x, ((0, block_q), (0, 0), (0, group_pad - group), (0, 0)))
    return x.transpose(1, 0, 2, 3).reshape(num_kv_heads, (num_tokens + block_q) * group_pad, dim)


def from_rows(out: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int, group: int,
              group_pad: int, dtype) -> jax.Array:
    """Inverse of `to_rows` -> [T, Hkv * group, D], zeroing tokens at or past cu_q_lens[num_seqs] (they belong to no
    valid sequence, so no program stored their rows)."""
    num_kv_heads, total_rows, dim = out.shape
    out = out.reshape(num_kv_heads, total_rows // group_pad, group_pad, dim)[:, :num_tokens, :group]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_kv_heads * group, dim)
    token_valid = jnp.arange(num_tokens) < cu_q_lens[num_seqs[0]]
    return jnp.where(token_valid[:, None, None], out, 0).astype(dtype)


def paged_flash_attention(q_parts, key_operands, value_operand, scale_operands, page_indices, kv_lens, cu_q_lens,
                          num_seqs, *, page_size, value_dim, sm_scale, sliding_window, soft_cap, mask_value, v_scale,
                          max_q_len, interpret, num_kv_splits, block_q, pages_per_block, num_warps, num_stages,
                          chip=None):
    """Validate, lay out and launch. q_parts: `[T, Hkv, group, D_i]` each; key / value / scale operands: (array,
    BlockSpec) pairs over the page pool (value None: the value is key part 0). Returns `[T, Hkv * group,
    value_dim]` in q's dtype, split-KV partials combined and rows of no valid sequence zeroed."""
    num_tokens, num_kv_heads, group, _ = q_parts[0].shape
    if sliding_window is not None and sliding_window < 1:  # MLA reaches here without check_attention_inputs
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    dims = [value_dim] + [p.shape[-1] for p in q_parts]
    if not tiles_ok(page_size, *dims):
        raise ValueError(f"the GPU kernel needs page_size and head dims to be powers of two (Triton tiles), got "
                         f"page_size={page_size}, head dims={dims}; use impl='reference' for other shapes")
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1 (or None for the default), got {num_kv_splits}")
    group_pad = _next_pow2(group)
    max_seqs, pages_per_seq = page_indices.shape
    max_q_len = num_tokens if max_q_len is None else max(1, min(max_q_len, num_tokens))
    key_width = sum(p.shape[-1] for p in q_parts) + (value_dim if value_operand is not None else 0)
    kv_dtype = jnp.dtype(key_operands[0][0].dtype)
    tiles = "float32" if jnp.dtype(jnp.float32) in (kv_dtype, jnp.dtype(q_parts[0].dtype)) else kv_dtype.name
    tiles = "int8" if kv_dtype == jnp.float8_e4m3fn else tiles  # an fp8 cache: 1 byte a value, int8's tiles
    chip = gpu_chip() if chip is None else chip
    config = block_config(chip, group, page_size, pages_per_seq, max_q_len, key_width, value_dim, tiles,
                          kind=batch_kind(max_q_len, num_tokens, max_seqs))
    given = dict(block_q=block_q, pages_per_block=pages_per_block, num_warps=num_warps, num_stages=num_stages)
    config |= {k: v for k, v in given.items() if v is not None}
    block_q, pages_per_block = config["block_q"], config["pages_per_block"]
    check_block_sizes(block_q * group_pad, pages_per_block * page_size)
    mask_value = DEFAULT_MASK_VALUE if mask_value is None else mask_value

    q_rows = [to_rows(p, block_q, group_pad) for p in q_parts]
    total_rows = q_rows[0].shape[1]
    padded_pages = _cdiv(pages_per_seq, pages_per_block) * pages_per_block
    page_table = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, padded_pages - pages_per_seq)))
    num_q_blocks = _cdiv(max_q_len, block_q)
    rule = SPLIT_RULES.get(chip, SPLIT_RULES["default"])
    splits = num_kv_splits or default_kv_splits(max_seqs * num_kv_heads * num_q_blocks, padded_pages // pages_per_block,
                                                rule.target_programs, rule.max_splits)
    whole = pl.no_block_spec
    in_specs = [whole, whole, whole, pl.BlockSpec((None, padded_pages), lambda s, h, j: (s, 0))]
    operands = [kv_lens.astype(jnp.int32), cu_q_lens.astype(jnp.int32), num_seqs.astype(jnp.int32), page_table]
    for part in q_rows:
        in_specs.append(pl.BlockSpec((None, total_rows, part.shape[-1]), lambda s, h, j: (h, 0, 0)))
        operands.append(part)
    for array, spec in [*key_operands, *([value_operand] if value_operand else []), *scale_operands]:
        in_specs.append(spec)
        operands.append(array)
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((num_kv_heads, total_rows, value_dim), q_parts[0].dtype)]
        out_specs = [pl.BlockSpec((None, total_rows, value_dim), lambda s, h, j: (h, 0, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((splits, num_kv_heads, total_rows, value_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits, num_kv_heads, total_rows), jnp.float32),
                     jax.ShapeDtypeStruct((splits, num_kv_heads, total_rows), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, total_rows, value_dim), lambda s, h, j: (j % splits, h, 0, 0)),
                     pl.BlockSpec((None, None, total_rows), lambda s, h, j: (j % splits, h, 0)),
                     pl.BlockSpec((None, None, total_rows), lambda s, h, j: (j % splits, h, 0))]
    kernel = functools.partial(
        _kernel, num_parts=len(q_parts), value_is_key0=value_operand is None, quantized=bool(scale_operands),
        block_q=block_q, group_pad=group_pad, page_size=page_size, pages_per_block=pages_per_block,
        pages_per_seq=pages_per_seq, num_kv_splits=splits, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, mask_value=mask_value, v_scale=v_scale,
        precision=F32_PRECISION)
    outs = pl.pallas_call(
        kernel, grid=(max_seqs, num_kv_heads, num_q_blocks * splits), in_specs=in_specs,
        out_specs=out_specs, out_shape=out_shape, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config["num_warps"], num_stages=config["num_stages"]),
        name="ragged_paged_attention_gpu",
    )(*operands)
    out = outs[0] if splits == 1 else combine_splits(*outs)
    return from_rows(out, cu_q_lens, num_seqs, num_tokens, group, group_pad, q_parts[0].dtype)


def ragged_paged_attention_gpu(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [Hkv, num_pages, page_size, 2 * D] (kv_cache/layout.py): K lanes, then V lanes
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    max_q_len: int | None = None,
    kv_scales: jax.Array | None = None,  # f32[Hkv, scale_rows, 128] for an int8 cache (kv_cache/layout.py)
    interpret: bool = False,
    num_kv_splits: int | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    chip: str | None = None,
) -> jax.Array:
    """Same contract as `ragged_paged_attention_reference`; returns `[T, Hq, D]` in q's dtype.

    `interpret=True` runs Pallas' generic interpreter (the only way off GPU). `num_kv_splits` (static) cuts each
    program's KV range into that many chunks on the grid, combined in a second pass, for long decode with few
    sequences; None picks `default_kv_splits` from the grid size. `block_q` (query tokens per program; block_q *
    next_pow2(group) must be a power of two >= 16), `pages_per_block` (pages per KV block; times page_size a
    power of two >= 16), `num_warps` and `num_stages` (Triton's) override the `gpu_tuning` entry of `chip` ('h100',
    'h200'; default: the GPU this runs on, see `gpu_chip`) for the batch's kind (`gpu_tuning.batch_kind`).
    """
    num_kv_heads, group = check_attention_inputs(q, kv_pages, kv_scales, sliding_window)
    num_tokens, _, head_dim = q.shape
    _, num_pages, page_size, _ = cache_dims(kv_pages)
    # K and V are column blocks 0 and 1 (lanes [0, D) and [D, 2D)) of KV head h's pages: no copy, on Triton a
    # BlockSpec is pointer arithmetic.
    kv_spec = lambda half: pl.BlockSpec((None, num_pages, page_size, head_dim),  # noqa: E731
                                        lambda s, h, j: (h, 0, 0, half))
    scales = []
    if kv_scales is not None:  # [Hkv, scale_rows * 128]: a reshape of contiguous rows, no copy
        flat = kv_scales.astype(jnp.float32).reshape(num_kv_heads, -1)
        scales = [(flat, pl.BlockSpec((None, flat.shape[1]), lambda s, h, j: (h, 0)))]
    return paged_flash_attention(
        [q.reshape(num_tokens, num_kv_heads, group, head_dim)], [(kv_pages, kv_spec(0))],
        (kv_pages, kv_spec(1)), scales, page_indices, kv_lens, cu_q_lens, num_seqs, page_size=page_size,
        value_dim=head_dim, sm_scale=sm_scale if k_scale is None else sm_scale * k_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value, v_scale=v_scale,
        max_q_len=max_q_len, interpret=interpret, num_kv_splits=num_kv_splits, block_q=block_q,
        pages_per_block=pages_per_block, num_warps=num_warps, num_stages=num_stages, chip=chip)
