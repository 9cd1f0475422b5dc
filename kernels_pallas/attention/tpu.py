"""Ragged paged attention as a Pallas Mosaic (TPU) kernel, with the signature of the pure-JAX reference.

Semantics are exactly those of `ragged_paged_attention_reference` (see that module); this docstring explains why
the kernel is shaped the way it is.

Grid `(kv_head, sequence, query_block)`.
  * One grid point owns the `group = Hq // Hkv` query heads of one KV head for one block of `block_q` query tokens
    of one sequence. Every K/V page is therefore fetched from HBM once per (sequence, KV head, query block) and
    reused by all `group` query heads: decode is HBM-bandwidth bound on KV, and GQA's whole saving is lost if each
    query head re-reads its pages.
  * Looping over KV heads in the grid (rather than loading all `2*Hkv` combined heads of a page at once, as JAX's
    in-tree op does) removes every tiling constraint on the head axis: the in-tree op needs `2*Hkv` to be
    "XLA fully tiled" and `head_dim % 128 == 0`, so SmolLM2's 3 KV heads x 64 would need padding there.
  * The KV-head axis comes first and is the only "parallel" one. On megacore chips (v4/v5p) Mosaic splits the
    leading parallel axis across the two TensorCores; different KV heads write disjoint output columns, so that
    split is race-free. The sequence and query-block axes must stay "arbitrary" (in order) because of the output
    read-modify-write explained below.

Scalar prefetch (`PrefetchScalarGridSpec`): `kv_lens`, `page_indices` (flattened, so SMEM pads one axis, not two),
`cu_q_lens` and `num_seqs` are copied to SMEM before the grid runs. Everything that decides *which* bytes to move
(the page ids, the sequence's token range, the causal/sliding-window KV range) is a scalar read from SMEM, so
address generation never waits on a vector load.

All of q, kv_pages and the output stay in HBM (`memory_space=pl.ANY`) and are moved by hand with
`pltpu.make_async_copy`. What the real Mosaic compiler allows shaped this (deviceless compiles,
`scripts/tools/aot_compile.py`): a DMA may start a tiled (last two) axis only at a tile boundary, and bf16/int8 pack 2/4
rows into one 32-bit sublane row, so single rows of a packed array cannot be addressed.
  * KV (`kv_cache/layout.py`: `[Hkv, num_pages, page_size, 2 * D]`): one (KV head, page) is one contiguous
    `[page_size, 2D]` block, copied whole by one DMA into slot `j` of a `[2, pages_per_block, page_size, 2D]`
    buffer (leading axes only, so any page_size works for any dtype); K and V are lane slices of it.
  * Double buffering: the copies for KV block `b + 1` are started before block `b` is computed and waited on only
    when block `b + 1` is needed, so HBM latency hides behind the MXU/VPU work of the current block. Each buffer
    slot has its own DMA semaphore.
  * Only pages that hold tokens of this sequence are fetched (`page < cdiv(kv_len, page_size)`), so stale or
    garbage entries at the end of a page-table row are never dereferenced, and blocks entirely beyond the causal
    horizon or before the sliding window are never fetched or computed (the fori_loop bounds are computed from
    SMEM scalars). Tokens inside a fetched block that no query may see are masked, and their V rows (and V
    scales) are zeroed before `p @ V`: unfetched VMEM is uninitialised (NaN in the TPU interpreter), a freed page
    keeps its last owner's data, and `0 * NaN` would poison the accumulator.
  * q and out are packed ragged along tokens, so a sequence's rows start at an arbitrary token offset and a
    query block is generally not aligned to any fixed tile of the token axis. DMA sizes must be static, so each
    grid point moves a full `block_q`-row window that starts at `min(token_start, T - block_q)` (in bounds by
    construction; the wrapper pads T up to `block_q` when T is smaller) and tracks which of the window's rows are
    its own. Rows it does not own (the previous/next sequence's, or padding) are preserved by a
    read-modify-write of the output window: read the current window, `where`-merge the owned rows, write back.
    This needs the grid points that touch neighbouring windows to run in order (hence "arbitrary"), and the
    output is aliased to a zero-initialised input so rows owned by no valid sequence come out as zeros without a
    separate pass.
  * q and out travel as float32 `[T, Hq, D]`: one query head of a window is one sublane row per token, which a
    DMA can address only in a 32-bit array. q is cast to the cache's dtype in VMEM for the MXU, so bf16 still
    runs bf16 matmuls; q and out are a small fraction of the bytes a step moves (the cache is the rest). In VMEM
    q is head-major `[group * block_q, D]` (one strided DMA per query head into a static row range), so the
    `group` heads of the KV head are rows of a single `[group*block_q, D] x [D, block_kv]` MXU matmul.

Online softmax (flash-attention style) over KV blocks with the running max `m`, sum `l` and accumulator as
fori_loop carries in f32: the full `[rows, kv_len]` score matrix never exists, so VMEM use is independent of the
context length. The first block a row sees may be fully masked (sliding window); then `m` is the mask value and
the garbage it accumulates is wiped by `alpha = exp(mask - m_new) = 0` as soon as the row's first visible key
(its own position, always visible) arrives. Scores are computed with f32 accumulation
(`preferred_element_type`); for bf16 inputs the probabilities are cast to bf16 for the second matmul (the MXU's
native path), which costs ~3 significant digits and is why bf16 is tested at ~2e-2.

int8 KV cache (`kv_scales`, `[Hkv, scale_rows, 128]`): the 128-lane row(s) holding a page's K and V scales are
DMA'd with the page; a dynamic lane rotation brings the page's scales to lane 0, and the pages' scales are joined
into one `[1, block_kv]` row each for K and V. int8 values are exact in bf16, so K and V enter the MXU as bf16
(f32 for f32 queries) and the scales multiply score columns (K) and probability columns (V), the same product
with `block_kv` instead of `block_kv * D` multiplies. HBM traffic per token and head is D int8 values + 4 bytes of
scale each for K and V.

Block sizes come from `BLOCK_SIZES` (per chip generation: KV tokens per block, query rows per block), sized so the
double-buffered KV block stays far inside the default scoped VMEM; `scripts/tools/aot_compile.py` compiles them for
each chip. They are not yet tuned on hardware.

Known costs of this design (deliberate simplicity, not correctness issues): KV for the next grid point is not
prefetched across grid points, so every grid point pays one exposed DMA latency; a decode query block of
`block_q` rows uses one row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.backend import target_device_kind
from kernels_pallas.kv_cache.layout import SCALE_LANES
from kernels_pallas.attention.reference import DEFAULT_MASK_VALUE, check_attention_inputs

# Per TPU generation: KV tokens per block (rounded to whole pages) and query rows per block. The double-buffered
# KV block is 2 * kv_tokens * 2D * itemsize bytes (1 MiB for 512 bf16 tokens at D = 256), far inside the default
# scoped VMEM (16 MiB on v5e, 32 MiB on v6e); larger blocks amortise the per-block DMA and loop overhead.
BLOCK_SIZES = {
    "v5e": dict(kv_tokens=256, block_q=8),
    "v6e": dict(kv_tokens=512, block_q=8),
    "v5p": dict(kv_tokens=512, block_q=8),
    "default": dict(kv_tokens=256, block_q=8),
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


def _div(a, b):
    """Floor division of non-negative ints; lax.div (truncating) avoids jnp's sign fix-up on the scalar unit."""
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    return lax.div(a, b)


def _cdiv(a, b):
    return _div(a + b - 1, b)


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref, page_indices_ref, cu_q_lens_ref, num_seqs_ref,
    # inputs (HBM): q_hbm, kv_hbm, [scales_hbm,] out_init_hbm; output (HBM, aliased to out_init_hbm): out_hbm;
    # scratch: q_vmem, o_vmem, kv_vmem, [s_vmem,] kv_sems, io_sems  ([...] only for an int8 cache)
    *refs,
    block_q, group, page_size, pages_per_block, pages_per_seq, num_tokens, sm_scale, sliding_window, soft_cap,
    mask_value, k_scale, v_scale, quantized, compute_dtype,
):
    if quantized:
        q_hbm, kv_hbm, scales_hbm, _, out_hbm, q_vmem, o_vmem, kv_vmem, s_vmem, kv_sems, io_sems = refs
    else:
        q_hbm, kv_hbm, _, out_hbm, q_vmem, o_vmem, kv_vmem, kv_sems, io_sems = refs
        scales_hbm = s_vmem = None
    h = pl.program_id(0)
    s = pl.program_id(1)
    qb = pl.program_id(2)
    block_kv = pages_per_block * page_size
    rows = group * block_q
    head_dim = kv_vmem.shape[-1] // 2
    scale_span = 2 * page_size  # a page's K then V scales, in its head's flattened scales
    rows_per_page = max(1, scale_span // SCALE_LANES)

    q_start = cu_q_lens_ref[s]
    q_len = cu_q_lens_ref[s + 1] - q_start
    kv_len = kv_lens_ref[s]
    block_first = qb * block_q  # index within the sequence of the block's first query
    n_valid = jnp.minimum(block_q, q_len - block_first)

    @pl.when((s < num_seqs_ref[0]) & (n_valid > 0))
    def _():
        tok_start = q_start + block_first
        win_start = jnp.minimum(tok_start, num_tokens - block_q)
        shift = tok_start - win_start  # window row `shift` is this block's first query

        def q_copy(g):
            return pltpu.make_async_copy(q_hbm.at[pl.ds(win_start, block_q), h * group + g],
                                         q_vmem.at[pl.ds(g * block_q, block_q)], io_sems.at[0])

        def out_read(g):
            return pltpu.make_async_copy(out_hbm.at[pl.ds(win_start, block_q), h * group + g],
                                         o_vmem.at[pl.ds(g * block_q, block_q)], io_sems.at[1])

        def out_write(g):
            return pltpu.make_async_copy(o_vmem.at[pl.ds(g * block_q, block_q)],
                                         out_hbm.at[pl.ds(win_start, block_q), h * group + g], io_sems.at[2])

        # Causal / sliding-window KV range of the block's valid queries, in tokens, then in KV blocks.
        first_pos = kv_len - q_len + block_first
        last_pos = first_pos + n_valid - 1
        kv_hi = last_pos + 1
        kv_lo = 0 if sliding_window is None else jnp.maximum(0, first_pos - sliding_window + 1)
        b_start = _div(kv_lo, block_kv)
        b_end = _cdiv(kv_hi, block_kv)
        seq_pages = jnp.minimum(_cdiv(kv_len, page_size), pages_per_seq)

        def page_of(b, j):
            page_no = b * pages_per_block + j
            return page_no, page_indices_ref[s * pages_per_seq + jnp.minimum(page_no, pages_per_seq - 1)]

        def kv_copies(b, slot):
            """(condition, copies) for each page of KV block b into buffer slot `slot`: its [page_size, 2D] rows
            of this KV head and, for an int8 cache, the 128-lane scale row(s) holding the page's scales."""
            out = []
            for j in range(pages_per_block):
                page_no, page = page_of(b, j)
                copies = [pltpu.make_async_copy(kv_hbm.at[h, page], kv_vmem.at[slot, j], kv_sems.at[slot])]
                if quantized:
                    row = _div(page * scale_span, SCALE_LANES)
                    copies.append(pltpu.make_async_copy(
                        scales_hbm.at[h, pl.ds(row, rows_per_page)],
                        s_vmem.at[slot, pl.ds(j * rows_per_page, rows_per_page)], kv_sems.at[slot]))
                out.append((page_no < seq_pages, copies))
            return out

        def start_kv(b, slot):
            for cond, copies in kv_copies(b, slot):
                @pl.when(cond)
                def _():
                    for cp in copies:
                        cp.start()

        def wait_kv(b, slot):
            for cond, copies in kv_copies(b, slot):
                @pl.when(cond)
                def _():
                    for cp in copies:
                        cp.wait()

        def block_scales(b, slot):
            """([1, block_kv] K scales, [1, block_kv] V scales) of KV block b's keys."""
            k_parts, v_parts = [], []
            for j in range(pages_per_block):
                if rows_per_page == 1:
                    _, page = page_of(b, j)
                    lane = lax.rem(page * scale_span, SCALE_LANES)
                    row = pltpu.roll(s_vmem[slot, pl.ds(j, 1), :], lax.rem(SCALE_LANES - lane, SCALE_LANES), 1)
                    k_parts.append(row[:, :page_size])
                    v_parts.append(row[:, page_size:scale_span])
                else:  # a page's scales fill whole rows: K rows, then V rows
                    half = rows_per_page // 2
                    for r in range(half):
                        k_parts.append(s_vmem[slot, pl.ds(j * rows_per_page + r, 1), :])
                        v_parts.append(s_vmem[slot, pl.ds(j * rows_per_page + half + r, 1), :])
            return jnp.concatenate(k_parts, axis=1), jnp.concatenate(v_parts, axis=1)

        for g in range(group):
            q_copy(g).start()
            out_read(g).start()

        @pl.when(b_start < b_end)
        def _():
            start_kv(b_start, 0)

        for g in range(group):
            q_copy(g).wait()

        # Per-row bookkeeping: row r is query head r // block_q, window row r % block_q.
        win_row = lax.rem(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), block_q)
        q_idx = block_first + win_row - shift  # index within the sequence
        row_valid = (q_idx >= 0) & (q_idx < block_first + n_valid)
        q_pos = kv_len - q_len + q_idx  # [rows, 1]
        q = q_vmem[...].astype(compute_dtype)

        def body(b, carry):
            m_prev, l_prev, acc_prev = carry
            slot = lax.rem(b - b_start, 2)

            @pl.when(b + 1 < b_end)
            def _():
                start_kv(b + 1, 1 - slot)

            wait_kv(b, slot)
            kv = kv_vmem[slot]  # [pages_per_block, page_size, 2D]
            if quantized:  # int8 values are exact in bf16; the scales multiply columns below
                kv = kv.astype(jnp.float32)
            kv = kv.reshape(block_kv, 2 * head_dim).astype(compute_dtype)
            k, v = kv[:, :head_dim], kv[:, head_dim:]
            scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            scale = sm_scale if k_scale is None else sm_scale * k_scale
            k_pos = b * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            key_seen = (k_pos >= kv_lo) & (k_pos < kv_len)  # keys some query of the block may see
            if quantized:
                k_sc, v_sc = block_scales(b, slot)
                scores = scores * k_sc
            scores = scores * scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            visible = (k_pos <= q_pos) & key_seen
            if sliding_window is not None:
                visible &= k_pos > q_pos - sliding_window
            scores = jnp.where(visible, scores, mask_value)
            k_col = b * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
            v = jnp.where((k_col >= kv_lo) & (k_col < kv_len), v, jnp.zeros_like(v))  # stale / unfetched rows

            m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.exp(scores - m_new)
            l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            if quantized:
                p = p * jnp.where(key_seen, v_sc, 0.0)
            pv = lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
            return m_new, l_new, alpha * acc_prev + pv

        init = (jnp.full((rows, 1), mask_value, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
                jnp.zeros((rows, head_dim), jnp.float32))
        _, l_fin, acc = lax.fori_loop(b_start, b_end, body, init)
        result = acc / jnp.where(l_fin > 0, l_fin, 1.0)
        if v_scale is not None:
            result = result * v_scale

        for g in range(group):
            out_read(g).wait()
        o_vmem[...] = jnp.where(row_valid, result, o_vmem[...])
        for g in range(group):
            out_write(g).start()
        for g in range(group):
            out_write(g).wait()


def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [Hkv, num_pages, page_size, 2 * D] (kv_cache/layout.py)
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
    interpret=False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    kv_scales: jax.Array | None = None,
    chip: str | None = None,
) -> jax.Array:
    """Same contract as `ragged_paged_attention_reference`; returns `[T, Hq, D]` in q's dtype.

    `max_q_len` (static) bounds any valid sequence's query length and sets the number of query blocks per
    sequence (default: T). `interpret` is passed to `pl.pallas_call` (e.g. `pltpu.InterpretParams()` on CPU).
    `block_q` and `pages_per_block` override `BLOCK_SIZES[chip]` (`chip`: 'v5e', 'v6e', 'v5p'; default: the
    TPU this runs on, see `chip_generation`). `kv_scales`: an int8 cache's scales (kv_cache/layout.py); page_size must
    then divide 64 or be a multiple of 64, so a page's scales never straddle a 128-lane row.
    """
    num_kv_heads, group = check_attention_inputs(q, kv_pages, kv_scales, sliding_window)
    num_tokens, num_q_heads, head_dim = q.shape
    page_size = kv_pages.shape[2]
    quantized = kv_scales is not None
    if quantized and SCALE_LANES % (2 * page_size) and (2 * page_size) % SCALE_LANES:
        raise ValueError(f"an int8 cache on TPU needs page_size dividing 64 or a multiple of 64, got {page_size}")
    max_seqs, pages_per_seq = page_indices.shape
    sizes = BLOCK_SIZES[chip_generation() if chip is None else chip]
    block_q = sizes["block_q"] if block_q is None else block_q
    if pages_per_block is None:
        pages_per_block = max(1, min(pages_per_seq, sizes["kv_tokens"] // page_size))
    max_q_len = num_tokens if max_q_len is None else min(max_q_len, num_tokens)
    num_q_blocks = max(1, _cdiv(max_q_len, block_q))
    mask_value = DEFAULT_MASK_VALUE if mask_value is None else mask_value
    # bf16 (or f32) matmuls as the cache is stored; an int8 cache computes in q's dtype.
    compute_dtype = q.dtype if quantized or kv_pages.dtype == q.dtype else jnp.float32

    padded_tokens = max(num_tokens, block_q)  # every grid point moves a full block_q-row window
    q32 = q.astype(jnp.float32)  # one head of a window is one row per token: addressable only at 32 bits
    if padded_tokens != num_tokens:
        q32 = jnp.pad(q32, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
    out_init = jnp.zeros((padded_tokens, num_q_heads, head_dim), jnp.float32)
    rows_per_page = max(1, 2 * page_size // SCALE_LANES)

    kernel = functools.partial(
        _kernel, block_q=block_q, group=group, page_size=page_size, pages_per_block=pages_per_block,
        pages_per_seq=pages_per_seq, num_tokens=padded_tokens, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, mask_value=mask_value, k_scale=k_scale, v_scale=v_scale, quantized=quantized,
        compute_dtype=compute_dtype)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(num_kv_heads, max_seqs, num_q_blocks),
        in_specs=[any_spec] * (4 if quantized else 3),
        out_specs=any_spec,
        scratch_shapes=[
            pltpu.VMEM((group * block_q, head_dim), jnp.float32),  # q rows, head-major
            pltpu.VMEM((group * block_q, head_dim), jnp.float32),  # output window (read-modify-write)
            pltpu.VMEM((2, pages_per_block, page_size, 2 * head_dim), kv_pages.dtype),  # KV double buffer
            *([pltpu.VMEM((2, pages_per_block * rows_per_page, SCALE_LANES), jnp.float32)] if quantized else []),
            pltpu.SemaphoreType.DMA((2,)),  # one per KV buffer slot
            pltpu.SemaphoreType.DMA((3,)),  # q read, out read, out write
        ],
    )
    scales_in = (kv_scales.astype(jnp.float32),) if quantized else ()
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((padded_tokens, num_q_heads, head_dim), jnp.float32),
        # Operand indices count the scalar-prefetch operands: 4 prefetch + q, kv_pages, [kv_scales,] out_init.
        input_output_aliases={7 if quantized else 6: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32).reshape(-1), cu_q_lens.astype(jnp.int32),
      num_seqs.astype(jnp.int32), q32, kv_pages, *scales_in, out_init)
    return out[:num_tokens].astype(q.dtype)
