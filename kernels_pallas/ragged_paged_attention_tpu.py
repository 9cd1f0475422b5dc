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
`pltpu.make_async_copy`:
  * KV: a sequence's pages are scattered over the pool, so no BlockSpec index map can describe a KV block of
    several pages; manual DMA of each page into a contiguous VMEM buffer does. Each page is copied with two
    strided DMAs (its K head slot and its V head slot), each landing on a static, tile-aligned row offset of a
    `[2, pages_per_block * page_size, head_dim]` buffer, so the matmul sees one contiguous `[block_kv, D]` tile
    with no in-kernel reshape.
  * Double buffering: the copies for KV block `b + 1` are started before block `b` is computed and waited on only
    when block `b + 1` is needed, so HBM latency hides behind the MXU/VPU work of the current block. Each buffer
    slot has its own DMA semaphore.
  * Only pages that hold tokens of this sequence are fetched (`page < cdiv(kv_len, page_size)`), so stale or
    garbage entries at the end of a page-table row are never dereferenced, and blocks entirely beyond the causal
    horizon or before the sliding window are never fetched or computed (the fori_loop bounds are computed from
    SMEM scalars). Tokens inside a fetched block that are out of range are masked; V rows beyond `kv_len` are
    zeroed before `p @ V`, because unfetched VMEM is uninitialised (NaN in the TPU interpreter) and `0 * NaN`
    would poison the accumulator.
  * q and out are packed ragged along tokens, so a sequence's rows start at an arbitrary token offset and a
    query block is generally not aligned to any fixed tile of the token axis. DMA sizes must be static, so each
    grid point moves a full `block_q`-row window that starts at `min(token_start, T - block_q)` (in bounds by
    construction; the wrapper pads T up to `block_q` when T is smaller) and tracks which of the window's rows are
    its own. Rows it does not own (the previous/next sequence's, or padding) are preserved by a
    read-modify-write of the output window: read the current window, `where`-merge the owned rows, write back.
    This needs the grid points that touch neighbouring windows to run in order (hence "arbitrary"), and the
    output is aliased to a zero-initialised input so rows owned by no valid sequence come out as zeros without a
    separate pass.
  * q is stored in VMEM head-major as `[group * block_q, D]` (one strided DMA per query head into a static,
    tile-aligned row range), so the `group` heads of the KV head become rows of a single `[group*block_q, D] x
    [D, block_kv]` MXU matmul instead of `group` small ones, and no sublane-strided load or reshape is needed.

Online softmax (flash-attention style) over KV blocks with the running max `m`, sum `l` and accumulator as
fori_loop carries in f32: the full `[rows, kv_len]` score matrix never exists, so VMEM use is independent of the
context length. The first block a row sees may be fully masked (sliding window); then `m` is the mask value and
the garbage it accumulates is wiped by `alpha = exp(mask - m_new) = 0` as soon as the row's first visible key
(its own position, always visible) arrives. Scores are computed with f32 accumulation
(`preferred_element_type`); for bf16 inputs the probabilities are cast to the V dtype for the second matmul (the
MXU's native bf16 path), which costs ~3 significant digits and is why bf16 is tested at ~2e-2.

int8 KV cache (`kv_scales`, see `kv_cache.py`): each page's `[page_size, 2]` (K scale, V scale) columns of this KV
head are DMA'd with its K/V rows into a third double buffer on the same semaphore, and K/V are dequantized in VMEM
as `int8 * scale` in f32 (the scale is a per-row column broadcast along lanes, which Mosaic does natively) before
the matmuls. HBM traffic per token and head is D int8 values + 4 bytes of scale each for K and V.

Known costs of this design (deliberate simplicity, not correctness issues): KV for the next grid point is not
prefetched across grid points, so every grid point pays one exposed DMA latency; per-(page, head) DMAs move
`page_size` rows of `head_dim` elements each (short bursts; a head-major page layout would make them contiguous);
a decode query block of `block_q` rows uses one row (pick `block_q=8`, the f32 sublane count; 16 for bf16 packing).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.ragged_paged_attention_ref import DEFAULT_MASK_VALUE, check_attention_inputs


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
    # scratch: q_vmem, o_vmem, k_vmem, v_vmem, [s_vmem,] kv_sems, io_sems  ([...] only for an int8 cache)
    *refs,
    block_q, group, page_size, pages_per_block, pages_per_seq, num_tokens, sm_scale, sliding_window, soft_cap,
    mask_value, k_scale, v_scale, quantized,
):
    if quantized:
        q_hbm, kv_hbm, scales_hbm, _, out_hbm, q_vmem, o_vmem, k_vmem, v_vmem, s_vmem, kv_sems, io_sems = refs
    else:
        q_hbm, kv_hbm, _, out_hbm, q_vmem, o_vmem, k_vmem, v_vmem, kv_sems, io_sems = refs
        scales_hbm = s_vmem = None
    h = pl.program_id(0)
    s = pl.program_id(1)
    qb = pl.program_id(2)
    block_kv = pages_per_block * page_size
    rows = group * block_q

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

        def kv_copies(b, slot):
            """(condition, copies) for each page of KV block b into buffer slot `slot`: its K head slot, its V
            head slot and, for an int8 cache, the page's [page_size, 2] (K scale, V scale) columns."""
            out = []
            for j in range(pages_per_block):
                page_no = b * pages_per_block + j
                page = page_indices_ref[s * pages_per_seq + jnp.minimum(page_no, pages_per_seq - 1)]
                dst = pl.ds(j * page_size, page_size)
                copies = [pltpu.make_async_copy(kv_hbm.at[page, :, 2 * h], k_vmem.at[slot, dst], kv_sems.at[slot]),
                          pltpu.make_async_copy(kv_hbm.at[page, :, 2 * h + 1], v_vmem.at[slot, dst],
                                                kv_sems.at[slot])]
                if quantized:
                    copies.append(pltpu.make_async_copy(scales_hbm.at[page, :, pl.ds(2 * h, 2)],
                                                        s_vmem.at[slot, dst], kv_sems.at[slot]))
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

        q = q_vmem[...]
        compute_dtype = q.dtype if kv_hbm.dtype == q.dtype and not quantized else jnp.float32
        q = q.astype(compute_dtype)

        def body(b, carry):
            m_prev, l_prev, acc_prev = carry
            slot = lax.rem(b - b_start, 2)

            @pl.when(b + 1 < b_end)
            def _():
                start_kv(b + 1, 1 - slot)

            wait_kv(b, slot)
            k = k_vmem[slot].astype(compute_dtype)  # [block_kv, D]
            v = v_vmem[slot]
            if quantized:  # per-token scales broadcast along D (lanes): dequantize in f32 before the matmuls
                kv_sc = s_vmem[slot]  # [block_kv, 2]
                k = k * kv_sc[:, 0:1]
                v = v.astype(jnp.float32) * kv_sc[:, 1:2]
            scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            scale = sm_scale if k_scale is None else sm_scale * k_scale
            scores = scores * scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            k_pos = b * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            visible = (k_pos <= q_pos) & (k_pos < kv_len)
            if sliding_window is not None:
                visible &= k_pos > q_pos - sliding_window
            scores = jnp.where(visible, scores, mask_value)
            k_col = b * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
            v = jnp.where(k_col < kv_len, v, jnp.zeros_like(v))  # unfetched VMEM may hold NaN

            m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.exp(scores - m_new)
            l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            pv_dtype = v.dtype if v.dtype == q.dtype else jnp.float32
            pv = lax.dot_general(p.astype(pv_dtype), v.astype(pv_dtype), (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
            return m_new, l_new, alpha * acc_prev + pv

        head_dim = q.shape[-1]
        init = (jnp.full((rows, 1), mask_value, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
                jnp.zeros((rows, head_dim), jnp.float32))
        _, l_fin, acc = lax.fori_loop(b_start, b_end, body, init)
        result = acc / jnp.where(l_fin > 0, l_fin, 1.0)
        if v_scale is not None:
            result = result * v_scale

        for g in range(group):
            out_read(g).wait()
        o_vmem[...] = jnp.where(row_valid, result.astype(o_vmem.dtype), o_vmem[...])
        for g in range(group):
            out_write(g).start()
        for g in range(group):
            out_write(g).wait()


def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * Hkv, D]; K at even, V at odd head slots
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
) -> jax.Array:
    """Same contract as `ragged_paged_attention_reference`; returns `[T, Hq, D]` in q's dtype.

    `max_q_len` (static) bounds any valid sequence's query length and sets the number of query blocks per
    sequence (default: T). `interpret` is passed to `pl.pallas_call` (e.g. `pltpu.InterpretParams()` on CPU).
    `block_q` (query tokens per block, default 8 for 4-byte and 16 for narrower q) and `pages_per_block` (pages per
    KV block, default: enough for ~128 tokens, at most pages_per_seq) are tuning knobs. `kv_scales` (int8 cache,
    `[num_pages, page_size, 2 * Hkv]` f32): each page's two scale columns of this KV head are DMA'd beside its K/V
    rows and K/V are dequantized in VMEM (f32) before the matmuls.
    """
    num_kv_heads, group = check_attention_inputs(q, kv_pages, kv_scales, sliding_window)
    num_tokens, num_q_heads, head_dim = q.shape
    page_size = kv_pages.shape[1]
    quantized = kv_scales is not None
    max_seqs, pages_per_seq = page_indices.shape
    if block_q is None:
        block_q = 8 if jnp.dtype(q.dtype).itemsize >= 4 else 16
    if pages_per_block is None:
        pages_per_block = max(1, min(pages_per_seq, 128 // page_size))
    max_q_len = num_tokens if max_q_len is None else min(max_q_len, num_tokens)
    num_q_blocks = max(1, _cdiv(max_q_len, block_q))
    mask_value = DEFAULT_MASK_VALUE if mask_value is None else mask_value

    padded_tokens = max(num_tokens, block_q)  # every grid point moves a full block_q-row window
    if padded_tokens != num_tokens:
        q = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
    out_init = jnp.zeros((padded_tokens, num_q_heads, head_dim), q.dtype)
    block_kv = pages_per_block * page_size

    kernel = functools.partial(
        _kernel, block_q=block_q, group=group, page_size=page_size, pages_per_block=pages_per_block,
        pages_per_seq=pages_per_seq, num_tokens=padded_tokens, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, mask_value=mask_value, k_scale=k_scale, v_scale=v_scale, quantized=quantized)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(num_kv_heads, max_seqs, num_q_blocks),
        in_specs=[any_spec] * (4 if quantized else 3),
        out_specs=any_spec,
        scratch_shapes=[
            pltpu.VMEM((group * block_q, head_dim), q.dtype),  # q rows, head-major
            pltpu.VMEM((group * block_q, head_dim), q.dtype),  # output window (read-modify-write)
            pltpu.VMEM((2, block_kv, head_dim), kv_pages.dtype),  # K double buffer
            pltpu.VMEM((2, block_kv, head_dim), kv_pages.dtype),  # V double buffer
            *([pltpu.VMEM((2, block_kv, 2), jnp.float32)] if quantized else []),  # (K, V) scales double buffer
            pltpu.SemaphoreType.DMA((2,)),  # one per KV buffer slot
            pltpu.SemaphoreType.DMA((3,)),  # q read, out read, out write
        ],
    )
    scales_in = (kv_scales.astype(jnp.float32),) if quantized else ()
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((padded_tokens, num_q_heads, head_dim), q.dtype),
        # Operand indices count the scalar-prefetch operands: 4 prefetch + q, kv_pages, [kv_scales,] out_init.
        input_output_aliases={7 if quantized else 6: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32).reshape(-1), cu_q_lens.astype(jnp.int32),
      num_seqs.astype(jnp.int32), q, kv_pages, *scales_in, out_init)
    return out[:num_tokens]
