"""Ragged paged attention as a Pallas Mosaic (TPU) kernel, with the signature of the pure-JAX reference.

Semantics are exactly those of `ragged_paged_attention_reference` (see that module); this docstring explains why
the kernel is shaped the way it is. Decode is bound by HBM bandwidth on the KV cache, so the design goal is one
stream of large KV DMAs that never drains.

Grid `(Hkv / heads,)`, "parallel" (`heads` = `kv_heads_per_block`: all KV heads on one-core v5e / v6e, half on
megacore v5p); inside a grid step a ragged loop over *work items*.
  * A work item is one block of `block_q` query tokens of one valid sequence. XLA lists the items before the call
    (`work_items`: `cdiv(q_len, block_q)` per sequence, in token order, and their count) and they reach SMEM as
    scalar prefetch, so the kernel loops `for item < count`: padded sequence slots, sequences without queries and
    the query blocks a short sequence lacks cost nothing (a grid `(Hkv, max_seqs, cdiv(max_q_len, block_q))` would
    pay an empty step for each). Like tpu-inference's RPA v3 (`v3/kernel.py`: a loop over real sequences inside one
    grid step), not JAX's in-tree op (a grid over query blocks).
  * One grid step owns `heads` KV heads and their `group = Hq // Hkv` query heads each: a K/V page is fetched from
    HBM once per (item, KV head) and reused by all `group` heads (GQA's saving); a loop over the step's KV heads
    runs each one's matmuls and online softmax (state in VMEM scratch, like JAX's in-tree kernel's per-head
    `m`/`l`/`acc`). The head axis has no tiling constraint (the in-tree op needs `2*Hkv` "XLA fully tiled" and
    `head_dim % 128 == 0`).
  * **Page-wide DMAs.** A KV DMA moves one page of all the step's KV heads, `[heads, page_size, 2D]` (RPA v3 moves
    a page of all heads per DMA; its layout makes them contiguous). The cache layout (`kv_cache/layout.py`,
    head-major, shared with every impl and tensor parallelism's head split) is kept: a head's page is contiguous
    and the heads are `num_pages` pages apart, so the copy is one strided descriptor, which Mosaic compiles (v5e,
    v6e; jax 0.10.2 and 0.12). At Llama-3-8B's 8 KV heads, page 16 and bf16 that is 8 DMAs of 64 KiB where one
    per (head, page) was 64 of 8 KiB (`scripts/tools/tpu_schedule.py`). In VMEM the block is head-major
    `[heads, pages, page_size, 2D]`, so a head's block is one contiguous `[block_kv, 2D]` operand.

The pipeline, all `pltpu.make_async_copy` between HBM (`memory_space=pl.ANY`) and VMEM scratch:
  * KV: double-buffered blocks of `pages_per_block` pages. While block b computes, block b + 1 is in flight; at
    an item's last block the *next item's* first block is started (JAX's in-tree kernel prefetches the next
    sequence's first block the same way, `kernel.py` "prefetch_first_kv_blk"/next_async_copy_kv; RPA v3 does it
    across its sequence loop), so the stream restarts cold only once per grid step, not once per sequence.
  * A block is `pages_per_block` page copies (one per page: pages are scattered) and **one wait**, on a descriptor
    of the whole buffer slot: DMA semaphores count bytes in Mosaic and in the interpreter, so one wait of N pages'
    bytes covers N copies (RPA v3's one wait per block; its wait descriptor is dynamically sized, ours is static:
    pages past a sequence's end re-read its last page, masked, so every block is the same size and no copy sits
    behind a `pl.when`). Only pages of the sequence are dereferenced: page-table tails are never read.
  * q and out: double-buffered per item. The next item's q rows are started when an item begins; an item's output
    is written asynchronously and waited on only after the next item computed (RPA v3's async `bo` send).
  * Query windows: DMA sizes are static, so an item moves `block_q` rows from its first token (q and out are
    padded by `block_q - 1` rows). Its rows past its own queries belong to the next items (or padding): items are
    in token order and each item's write is waited on before the next one starts, so every row's last writer is
    its owner; rows no item owns are zeroed by the wrapper. No read-modify-write of the output.
  * q and out travel as f32 `[Tp, Hkv, group, D]`: one query head of one token is one 32-bit sublane row, the only
    width at which a DMA can address single rows (bf16/int8 pack 2/4 rows per sublane); q is cast to the cache's
    dtype in VMEM for the MXU. In VMEM q is `[heads, group * block_q, D]`, head-major per KV head, so a KV head's
    query heads are rows of one `[rows, D] x [D, block_kv]` matmul.

Decode variant (static `max_q_len == 1`, `block_q = 1`): one copy moves a token's `heads * group` query heads
(contiguous), the query sits at `kv_len - 1` so the causal mask is just `k < kv_len` (and the window), and there
is no padding row: RPA v3's separate decode compile, here a static branch of the same kernel.

Masking: tokens inside a fetched block that no query may see are masked, and their V rows (and V scales) are
zeroed before `p @ V`: unfetched VMEM is uninitialised (NaN in the TPU interpreter), a freed page keeps its last
owner's data, and `0 * NaN` would poison the accumulator. Blocks entirely beyond the causal horizon or before the
sliding window are never fetched (the loop bounds are SMEM scalars).

Online softmax (flash-attention style) over KV blocks with the running max, sum and accumulator per KV head in f32
VMEM scratch; the first block a row sees may be fully masked (sliding window), and the garbage it accumulates is wiped by
`alpha = exp(mask - m_new) = 0` when the row's first visible key arrives. bf16 probabilities feed the second
matmul (the MXU's native path), which is why bf16 is tested at ~2e-2.

int8 / fp8 KV cache (`kv_scales`, `[Hkv, scale_rows, 128]`): the 128-lane row(s) holding a page's K and V scales
are DMA'd with the page, for all the step's heads in one strided copy (same semaphore, same single wait); a lane
rotation brings the page's scales to lane 0; K and V enter the MXU in q's dtype (int8 is exact in bf16) and the
scales multiply score and probability columns.

Block sizes and `vmem_limit_bytes` come from the table in `tpu_block_sizes.py` (chip, head_dim, dtype, page size,
case). `schedule_params` is the static schedule the kernel and the schedule report share.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.kv_cache.layout import SCALE_LANES, SCALED_DTYPES
from kernels_pallas.attention.reference import DEFAULT_MASK_VALUE, check_attention_inputs
from kernels_pallas.attention.tpu_block_sizes import KV_BUFFER_BYTES, block_sizes, chip_generation, kv_heads_per_step

__all__ = ["ragged_paged_attention_tpu", "work_items", "chip_generation"]


def _div(a, b):
    """Floor division of non-negative ints; lax.div (truncating) avoids jnp's sign fix-up on the scalar unit."""
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    return lax.div(a, b)


def _cdiv(a, b):
    return _div(a + b - 1, b)


class WorkItems(NamedTuple):
    """The ragged loop's work list: item i is query block `qb[i]` of sequence `seq[i]`, in token order; only the
    first `count[0]` are real (the rest repeat the last sequence and are never read)."""

    seq: jax.Array  # i32[max_items]
    qb: jax.Array  # i32[max_items]
    count: jax.Array  # i32[1]


def work_items(cu_q_lens: jax.Array, num_seqs: jax.Array, block_q: int, num_tokens: int) -> WorkItems:
    """One item per query block of each valid sequence (`cdiv(q_len, block_q)` of them), computed by XLA before the
    kernel so the kernel loops over real work only. At most `cdiv(T, block_q) + S` items exist (each sequence wastes
    less than one block), which is the static size."""
    max_seqs = cu_q_lens.shape[0] - 1
    max_items = _cdiv(num_tokens, block_q) + max_seqs
    q_lens = jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = jnp.where(jnp.arange(max_seqs) < num_seqs[0], (q_lens + block_q - 1) // block_q, 0)
    ends = jnp.cumsum(blocks)
    item = jnp.arange(max_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, item, side="right"), max_seqs - 1).astype(jnp.int32)
    qb = item - (ends[seq] - blocks[seq])
    return WorkItems(seq, qb.astype(jnp.int32), jnp.minimum(ends[-1:], max_items).astype(jnp.int32))


class _Item(NamedTuple):
    """SMEM scalars of one work item: its sequence, first token, first query's position, its causal/window KV range
    in blocks, and the sequence's page count."""

    seq: jax.Array
    tok: jax.Array
    kv_len: jax.Array
    first_pos: jax.Array
    kv_lo: jax.Array
    b_start: jax.Array
    b_end: jax.Array
    seq_pages: jax.Array


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref, page_indices_ref, cu_q_lens_ref, item_seq_ref, item_qb_ref, num_items_ref,
    # inputs (HBM): q_hbm, kv_hbm, [scales_hbm]; output (HBM): out_hbm; scratch: q_vmem, o_vmem, kv_vmem,
    # [s_vmem,] m_vmem, l_vmem, acc_vmem, kv_sems, q_sems, o_sems  ([...] only for a scaled cache)
    *refs,
    decode, block_q, group, heads, page_size, pages_per_block, pages_per_seq, sm_scale, sliding_window, soft_cap,
    mask_value, k_scale, v_scale, quantized, compute_dtype,
):
    if quantized:
        (q_hbm, kv_hbm, scales_hbm, out_hbm, q_vmem, o_vmem, kv_vmem, s_vmem, m_vmem, l_vmem, acc_vmem, kv_sems,
         q_sems, o_sems) = refs
    else:
        q_hbm, kv_hbm, out_hbm, q_vmem, o_vmem, kv_vmem, m_vmem, l_vmem, acc_vmem, kv_sems, q_sems, o_sems = refs
        scales_hbm = s_vmem = None
    h0 = pl.program_id(0) * heads  # this grid step's first KV head
    num_items = num_items_ref[0]
    block_kv = pages_per_block * page_size
    rows = group * block_q
    head_dim = kv_vmem.shape[-1] // 2
    scale_span = 2 * page_size  # a page's K then V scales, in its head's flattened scales
    rows_per_page = max(1, scale_span // SCALE_LANES)

    def item(i) -> _Item:
        s = item_seq_ref[i]
        q_start = cu_q_lens_ref[s]
        q_len = cu_q_lens_ref[s + 1] - q_start
        kv_len = kv_lens_ref[s]
        block_first = item_qb_ref[i] * block_q
        first_pos = kv_len - q_len + block_first
        kv_hi = first_pos + jnp.minimum(block_q, q_len - block_first)
        kv_lo = 0 if sliding_window is None else jnp.maximum(0, first_pos - sliding_window + 1)
        b_start = _div(kv_lo, block_kv)
        # At least one block, so a prefetched block is always waited on (malformed kv_len < q_len included).
        b_end = jnp.maximum(_cdiv(kv_hi, block_kv), b_start + 1)
        seq_pages = jnp.maximum(jnp.minimum(_cdiv(kv_len, page_size), pages_per_seq), 1)
        return _Item(s, q_start + block_first, kv_len, first_pos, kv_lo, b_start, b_end, seq_pages)

    def page_of(it, b, j):
        """Page j of KV block b; pages past the sequence's last re-read its last page (masked), so every block is
        the same `pages_per_block` copies and one wait of the whole buffer covers them (RPA v3's one wait per
        block, with a static size: Mosaic and the interpreter both count the semaphore in bytes)."""
        page_no = jnp.minimum(b * pages_per_block + j, it.seq_pages - 1)
        return page_indices_ref[it.seq * pages_per_seq + page_no]

    def start_kv(it, b, slot):
        """One DMA per page for all of the step's KV heads: a strided `[heads, page_size, 2D]` copy (each head's
        page is contiguous in HBM; the heads sit `num_pages` pages apart)."""
        for j in range(pages_per_block):
            page = page_of(it, b, j)
            pltpu.make_async_copy(kv_hbm.at[pl.ds(h0, heads), page], kv_vmem.at[slot, :, j],
                                  kv_sems.at[slot]).start()
            if quantized:
                row = _div(page * scale_span, SCALE_LANES)
                pltpu.make_async_copy(scales_hbm.at[pl.ds(h0, heads), pl.ds(row, rows_per_page)],
                                      s_vmem.at[slot, :, pl.ds(j * rows_per_page, rows_per_page)],
                                      kv_sems.at[slot]).start()

    def wait_all(buf, sem):
        """One wait for every copy into `buf` (a descriptor of the whole buffer: same byte count)."""
        pltpu.make_async_copy(buf, buf, sem).wait()

    def wait_kv(slot):
        wait_all(kv_vmem.at[slot], kv_sems.at[slot])
        if quantized:
            wait_all(s_vmem.at[slot], kv_sems.at[slot])

    def q_copies(it, slot, to_hbm):
        """The DMAs moving item `it`'s query (or output) rows between HBM ([Tp, Hkv, group, D]) and VMEM slot
        `slot` ([heads, rows, D]): decode: one copy of the step's `heads * group` rows of one token (contiguous);
        else one per query head (head-major rows)."""
        hbm, vmem = (out_hbm, o_vmem) if to_hbm else (q_hbm, q_vmem)
        if decode:
            pairs = [(hbm.at[it.tok, pl.ds(h0, heads)], vmem.at[slot])]
        else:
            pairs = [(hbm.at[pl.ds(it.tok, block_q), h0 + hh, g], vmem.at[slot, hh, pl.ds(g * block_q, block_q)])
                     for hh in range(heads) for g in range(group)]
        sem = (o_sems if to_hbm else q_sems).at[slot]
        return [pltpu.make_async_copy(*((v, x) if to_hbm else (x, v)), sem) for x, v in pairs]

    def block_scales(it, b, slot, hh):
        """([1, block_kv] K scales, [1, block_kv] V scales) of KV block b's keys, for head `hh` of the step."""
        k_parts, v_parts = [], []
        for j in range(pages_per_block):
            if rows_per_page == 1:
                lane = lax.rem(page_of(it, b, j) * scale_span, SCALE_LANES)
                row = pltpu.roll(s_vmem[slot, hh, pl.ds(j, 1), :], lax.rem(SCALE_LANES - lane, SCALE_LANES), 1)
                k_parts.append(row[:, :page_size])
                v_parts.append(row[:, page_size:scale_span])
            else:  # a page's scales fill whole rows: K rows, then V rows
                half = rows_per_page // 2
                for r in range(half):
                    k_parts.append(s_vmem[slot, hh, pl.ds(j * rows_per_page + r, 1), :])
                    v_parts.append(s_vmem[slot, hh, pl.ds(j * rows_per_page + half + r, 1), :])
        return jnp.concatenate(k_parts, axis=1), jnp.concatenate(v_parts, axis=1)

    def item_body(i, kv_slot):
        it = item(i)
        qs = lax.rem(i, 2)
        has_next = i + 1 < num_items
        nxt = item(jnp.minimum(i + 1, num_items - 1))
        wait_all(q_vmem.at[qs], q_sems.at[qs])

        @pl.when(has_next)
        def _():
            for cp in q_copies(nxt, 1 - qs, False):
                cp.start()

        m_vmem[...] = jnp.full(m_vmem.shape, mask_value, jnp.float32)
        l_vmem[...] = jnp.zeros(l_vmem.shape, jnp.float32)
        acc_vmem[...] = jnp.zeros(acc_vmem.shape, jnp.float32)
        # Row r is query head r // block_q at query (r % block_q) of the block: its cache position.
        q_pos = it.first_pos + lax.rem(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), block_q)

        def body(b, slot):
            last = b + 1 >= it.b_end

            @pl.when(jnp.logical_not(last))
            def _():
                start_kv(it, b + 1, 1 - slot)

            @pl.when(last & has_next)  # the next item's (usually the next sequence's) first block
            def _():
                start_kv(nxt, nxt.b_start, 1 - slot)

            wait_kv(slot)
            k_pos = b * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            key_seen = (k_pos >= it.kv_lo) & (k_pos < it.kv_len)  # keys some query of the block may see
            if decode:  # the one query sits at kv_len - 1: causality and the window are `key_seen`
                visible = key_seen
            else:
                visible = (k_pos <= q_pos) & key_seen
                if sliding_window is not None:
                    visible &= k_pos > q_pos - sliding_window
            k_col = b * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
            v_seen = (k_col >= it.kv_lo) & (k_col < it.kv_len)
            scale = sm_scale if k_scale is None else sm_scale * k_scale

            def head(hh, carry):
                """One KV head of the block: its `group` query heads' online-softmax update (state in VMEM)."""
                q = q_vmem[qs, hh].astype(compute_dtype)  # [rows, D]
                kv = kv_vmem[slot, hh]  # [pages_per_block, page_size, 2D]
                if quantized:  # int8 / fp8 values are exact in f32; the scales multiply columns below
                    kv = kv.astype(jnp.float32)
                kv = kv.reshape(block_kv, 2 * head_dim).astype(compute_dtype)
                k, v = kv[:, :head_dim], kv[:, head_dim:]
                scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                if quantized:
                    k_sc, v_sc = block_scales(it, b, slot, hh)
                    scores = scores * k_sc
                scores = scores * scale
                if soft_cap is not None:
                    scores = soft_cap * jnp.tanh(scores / soft_cap)
                scores = jnp.where(visible, scores, mask_value)
                v = jnp.where(v_seen, v, jnp.zeros_like(v))  # stale / unfetched
                m_prev, l_prev = m_vmem[hh], l_vmem[hh]
                m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
                alpha = jnp.exp(m_prev - m_new)
                p = jnp.exp(scores - m_new)
                l_vmem[hh] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
                m_vmem[hh] = m_new
                if quantized:
                    p = p * jnp.where(key_seen, v_sc, 0.0)
                pv = lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)
                acc_vmem[hh] = alpha * acc_vmem[hh] + pv
                return carry

            lax.fori_loop(0, heads, head, 0)
            return 1 - slot

        kv_slot = lax.fori_loop(it.b_start, it.b_end, body, kv_slot)

        # The previous item's output write must land first: its window's rows past its own queries are the next
        # items' rows, which their (later) writes overwrite. Waiting here keeps that write behind this item's
        # compute; slot 1 - qs is then free for the next item.
        @pl.when(i > 0)
        def _():
            wait_all(o_vmem.at[1 - qs], o_sems.at[1 - qs])

        l_fin = l_vmem[...]
        result = acc_vmem[...] / jnp.where(l_fin > 0, l_fin, 1.0)
        o_vmem[qs] = result if v_scale is None else result * v_scale
        for cp in q_copies(it, qs, True):
            cp.start()
        return kv_slot

    @pl.when(num_items > 0)
    def _():
        first = item(0)
        for cp in q_copies(first, 0, False):
            cp.start()
        start_kv(first, first.b_start, 0)
        lax.fori_loop(0, num_items, item_body, 0)
        last = lax.rem(num_items - 1, 2)
        wait_all(o_vmem.at[last], o_sems.at[last])


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
    kv_heads_per_block: int | None = None,
    kv_scales: jax.Array | None = None,
    chip: str | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """Same contract as `ragged_paged_attention_reference`; returns `[T, Hq, D]` in q's dtype.

    `max_q_len` (static) bounds any valid sequence's query length (default: T); 1 selects the decode variant.
    `interpret` is passed to `pl.pallas_call` (e.g. `pltpu.InterpretParams()` on CPU). `block_q`,
    `pages_per_block`, `kv_heads_per_block` (KV heads per grid step and per DMA; must divide Hkv) and
    `vmem_limit_bytes` override the table (`tpu_block_sizes`; `chip`: 'v5e', 'v6e', 'v5p'; default: the TPU this
    runs on). `kv_scales`: an int8 / fp8 cache's scales (kv_cache/layout.py); page_size must then divide 64 or be
    a multiple of 64, so a page's scales never straddle a 128-lane row.
    """
    num_kv_heads, group = check_attention_inputs(q, kv_pages, kv_scales, sliding_window)
    plan = schedule_params(q.shape, kv_pages.shape, kv_pages.dtype, page_indices.shape, max_q_len=max_q_len,
                           block_q=block_q, pages_per_block=pages_per_block, kv_heads_per_block=kv_heads_per_block,
                           chip=chip, vmem_limit_bytes=vmem_limit_bytes)
    num_tokens, num_q_heads, head_dim = q.shape
    page_size = kv_pages.shape[2]
    quantized = kv_scales is not None
    if quantized and SCALE_LANES % (2 * page_size) and (2 * page_size) % SCALE_LANES:
        raise ValueError(f"a scaled (int8 / fp8) cache on TPU needs page_size dividing 64 or a multiple of 64, "
                         f"got {page_size}")
    max_seqs, pages_per_seq = page_indices.shape
    block_q, pages_per_block, decode = plan["block_q"], plan["pages_per_block"], plan["decode"]
    heads = plan["kv_heads_per_block"]
    mask_value = DEFAULT_MASK_VALUE if mask_value is None else mask_value
    # bf16 (or f32) matmuls as the cache is stored; a scaled cache computes in q's dtype.
    compute_dtype = q.dtype if quantized or kv_pages.dtype == q.dtype else jnp.float32

    # q and out travel as f32 [Tp, Hkv, group, D]: one query head of a token is one 32-bit sublane row (a DMA can
    # address single rows only at 32 bits), and a decode token's heads are one contiguous copy. Tp: room for a
    # full block_q window at the last token.
    padded_tokens = num_tokens + block_q - 1
    q32 = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    if padded_tokens != num_tokens:
        q32 = jnp.pad(q32, ((0, padded_tokens - num_tokens), (0, 0), (0, 0), (0, 0)))
    items = work_items(cu_q_lens.astype(jnp.int32), num_seqs.astype(jnp.int32), block_q, num_tokens)
    rows = group * block_q
    rows_per_page = max(1, 2 * page_size // SCALE_LANES)

    kernel = functools.partial(
        _kernel, decode=decode, block_q=block_q, group=group, heads=heads, page_size=page_size,
        pages_per_block=pages_per_block, pages_per_seq=pages_per_seq, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value, k_scale=k_scale, v_scale=v_scale,
        quantized=quantized, compute_dtype=compute_dtype)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(num_kv_heads // heads,),
        in_specs=[any_spec] * (3 if quantized else 2),
        out_specs=any_spec,
        scratch_shapes=[
            pltpu.VMEM((2, heads, rows, head_dim), jnp.float32),  # q rows, head-major, double-buffered by item
            pltpu.VMEM((2, heads, rows, head_dim), jnp.float32),  # output rows, double-buffered (async writes)
            # KV double buffer, head-major so one head's block is contiguous for the matmuls; a page's DMA
            # writes all `heads` of it (strided).
            pltpu.VMEM((2, heads, pages_per_block, page_size, 2 * head_dim), kv_pages.dtype),
            *([pltpu.VMEM((2, heads, pages_per_block * rows_per_page, SCALE_LANES), jnp.float32)]
              if quantized else []),
            pltpu.VMEM((heads, rows, 1), jnp.float32),  # running max, per KV head of the step
            pltpu.VMEM((heads, rows, 1), jnp.float32),  # running sum
            pltpu.VMEM((heads, rows, head_dim), jnp.float32),  # accumulator
            pltpu.SemaphoreType.DMA((2,)),  # KV (and scales), per buffer slot
            pltpu.SemaphoreType.DMA((2,)),  # q, per slot
            pltpu.SemaphoreType.DMA((2,)),  # out, per slot
        ],
    )
    scales_in = (kv_scales.astype(jnp.float32),) if quantized else ()
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q32.shape, jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=plan["vmem_limit_bytes"]),
        interpret=interpret,
        name="ragged_paged_attention_tpu_decode" if decode else "ragged_paged_attention_tpu",
    )(kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32).reshape(-1), cu_q_lens.astype(jnp.int32),
      items.seq, items.qb, items.count, q32, kv_pages, *scales_in)
    out = out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim)
    # Rows of no work item (padding tokens) were never written, or hold a window's spill-over: zeros, per contract.
    owned = jnp.arange(num_tokens) < cu_q_lens[jnp.minimum(num_seqs[0], max_seqs)]
    return jnp.where(owned[:, None, None], out, 0.0).astype(q.dtype)


def schedule_params(q_shape, kv_shape, kv_dtype, page_indices_shape, *, max_q_len=None, block_q=None,
                    pages_per_block=None, kv_heads_per_block=None, chip=None, vmem_limit_bytes=None) -> dict:
    """The kernel's static schedule for these shapes: variant, block sizes, KV heads per step (and per DMA), VMEM
    scratch bytes and limit. The schedule report (`scripts/tools/tpu_schedule.py`) and the kernel read the same
    answer."""
    num_tokens, num_q_heads, head_dim = q_shape
    num_kv_heads, _, page_size, _ = kv_shape
    _, pages_per_seq = page_indices_shape
    group = num_q_heads // num_kv_heads
    max_q_len = num_tokens if max_q_len is None else min(max_q_len, num_tokens)
    chip = chip_generation() if chip is None else chip
    itemsize = jnp.dtype(kv_dtype).itemsize
    blocks = block_sizes(chip, head_dim, jnp.dtype(kv_dtype).name, page_size, max_q_len)
    decode = max_q_len == 1
    block_q = 1 if decode else (blocks.block_q if block_q is None else block_q)
    heads = kv_heads_per_step(chip, num_kv_heads) if kv_heads_per_block is None else kv_heads_per_block
    if heads < 1 or num_kv_heads % heads:
        raise ValueError(f"kv_heads_per_block={heads} must divide the cache's {num_kv_heads} KV heads")
    page_bytes = heads * page_size * 2 * head_dim * itemsize  # one page of the step's heads: one DMA
    if pages_per_block is None:
        budget_pages = max(1, KV_BUFFER_BYTES[chip] // (2 * page_bytes))
        pages_per_block = max(1, min(pages_per_seq, blocks.kv_tokens // page_size, budget_pages))
    rows = group * block_q
    vmem = 2 * pages_per_block * page_bytes + 2 * 2 * heads * rows * head_dim * 4  # KV, q and out buffers
    vmem += heads * rows * (2 * SCALE_LANES + head_dim) * 4  # max and sum (lane-padded), accumulator
    if jnp.dtype(kv_dtype) in SCALED_DTYPES:
        vmem += 2 * heads * pages_per_block * max(1, 2 * page_size // SCALE_LANES) * SCALE_LANES * 4
    return dict(decode=decode, block_q=block_q, pages_per_block=pages_per_block, kv_heads_per_block=heads,
                bytes_per_kv_dma=page_bytes, vmem_scratch_bytes=vmem,
                vmem_limit_bytes=blocks.vmem_limit_bytes if vmem_limit_bytes is None else vmem_limit_bytes)
