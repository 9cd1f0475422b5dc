"""Pure-JAX ragged paged attention: the reference every kernel is checked against, and the fallback on any backend
without a kernel (on CPU where the C++ kernel cannot be compiled).

Semantics are those of JAX's in-tree TPU op (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`), so the
two can be compared directly: the query tokens of all sequences are packed along one axis, `cu_q_lens` cuts them
into sequences, each sequence reads its KV through its row of `page_indices`, and query i of a sequence with
`q_len` queries and `kv_len` cached tokens (the new ones included) sits at position `kv_len - q_len + i` (causal).

Unlike the in-tree reference this one is jittable: instead of a Python loop over `num_seqs` it gathers each
sequence's queries into a `[S, max_q_len]` block and its pages into a `[S, pages_per_seq * page_size]` block and
runs one batched masked softmax. Its cost is `S * max_q_len * pages_per_seq * page_size`, so callers that know a
bound on the longest query run pass `max_q_len` (1 for decode) to keep decode cheap.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas.kv_cache.layout import cache_dims, check_kv_scales, scales_by_page, split_kv

DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_attention_inputs(q: jax.Array, kv_pages: jax.Array, kv_scales: jax.Array | None,
                           sliding_window: int | None) -> tuple[int, int]:
    """The contract's shape checks, shared by every impl; returns (num_kv_heads, query heads per KV head)."""
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads, _, _, cache_head_dim = cache_dims(kv_pages)
    if cache_head_dim != head_dim:
        raise ValueError(f"kv_pages shape {kv_pages.shape} does not match q shape {q.shape}: expected "
                         f"[num_kv_heads, num_pages, page_size, 2 * {head_dim}] (kernels_pallas.kv_cache_spec)")
    check_kv_scales(kv_pages, kv_scales)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return num_kv_heads, num_q_heads // num_kv_heads


def gather_pages(pages: jax.Array, page_indices: jax.Array) -> jax.Array:
    """pages[:, page_indices]: each sequence's pages of every KV head, [Hkv, S, pages_per_seq, ...].

    Page indices are in bounds by contract (padding rows point at a real page, usually 0), so the gather promises
    it: XLA CPU then copies whole page rows instead of clamping every element."""
    return pages.at[:, page_indices].get(mode="promise_in_bounds")


class QueryBlocks(NamedTuple):
    """Where each sequence's queries sit: row r of sequence s is packed token `gather_index[s, r]` (T for padding
    rows, which read a zero row and are never written back) at cache position `q_pos[s, r]`."""

    gather_index: jax.Array  # i32[S, Qb]
    row_valid: jax.Array  # bool[S, Qb]
    q_pos: jax.Array  # i32[S, Qb]


def query_blocks(kv_lens: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int,
                 q_block: int) -> QueryBlocks:
    """Cut packed ragged queries into a `[S, q_block]` block per sequence (q_block bounds every query length)."""
    max_seqs = kv_lens.shape[0]
    q_starts = cu_q_lens[:-1]
    q_lens = cu_q_lens[1:] - q_starts
    q_offsets = jnp.arange(q_block, dtype=jnp.int32)
    token_index = q_starts[:, None] + q_offsets[None, :]  # [S, Qb]
    seq_valid = jnp.arange(max_seqs) < num_seqs[0]
    row_valid = seq_valid[:, None] & (q_offsets[None, :] < q_lens[:, None])
    gather_index = jnp.where(row_valid, token_index, num_tokens)
    q_pos = (kv_lens - q_lens)[:, None] + q_offsets[None, :]
    return QueryBlocks(gather_index, row_valid, q_pos)


def gather_queries(x: jax.Array, blocks: QueryBlocks) -> jax.Array:
    """[T, ...] packed rows -> [S, Qb, ...] float32 (padding rows are zeros)."""
    padded = jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)], axis=0)
    return padded[blocks.gather_index].astype(jnp.float32)


def visible_keys(blocks: QueryBlocks, kv_lens: jax.Array, kv_len_max: int,
                 sliding_window: int | None) -> jax.Array:
    """bool[S, Qb, L]: causal (key position <= query position), inside kv_len, inside the sliding window."""
    k_pos = jnp.arange(kv_len_max, dtype=jnp.int32)
    q_pos = blocks.q_pos[:, :, None]
    visible = (k_pos[None, None, :] <= q_pos) & (k_pos[None, None, :] < kv_lens[:, None, None])
    if sliding_window is not None:
        visible &= k_pos[None, None, :] > q_pos - sliding_window
    return visible


def masked_softmax(scores: jax.Array, visible: jax.Array, soft_cap: float | None, mask_value: float) -> jax.Array:
    """Soft cap (Gemma 2), then mask, then softmax over the last (key) axis."""
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    return jax.nn.softmax(jnp.where(visible, scores, mask_value), axis=-1)


def scatter_queries(out: jax.Array, blocks: QueryBlocks, num_tokens: int) -> jax.Array:
    """[S, Qb, ...] -> packed [T, ...] float32; rows of no valid sequence are zeros."""
    out = jnp.where(blocks.row_valid.reshape(*blocks.row_valid.shape, *(1,) * (out.ndim - 2)), out, 0.0)
    packed = jnp.zeros((num_tokens + 1, *out.shape[2:]), jnp.float32)
    return packed.at[blocks.gather_index].add(out)[:num_tokens]


def ragged_paged_attention_reference(
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
) -> jax.Array:
    """Attention of packed ragged queries over paged KV. Returns `[T, Hq, D]` in q's dtype.

    Rows of q that belong to no valid sequence (padding, or sequences at index >= num_seqs) come back as zeros.
    `max_q_len` is a static upper bound on any valid sequence's query length (default: T).
    `kv_scales` (int8 cache, see `kv_cache/writes.py`): per-token-per-head scales; K/V are dequantized as
    `int8 * scale` (and then by the static `k_scale`/`v_scale` if given).
    Whatever a slot holds that no query may see (past `kv_len`, before the window, pages that padding entries of
    `page_indices` point at: a freed page keeps its last owner's data, NaN included) changes no output.
    """
    num_kv_heads, group = check_attention_inputs(q, kv_pages, kv_scales, sliding_window)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_pages, page_size, _ = kv_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    q_block = num_tokens if max_q_len is None else min(max_q_len, num_tokens)
    kv_len_max = pages_per_seq * page_size
    mask_value = DEFAULT_MASK_VALUE if mask_value is None else mask_value

    kv = gather_pages(kv_pages, page_indices).reshape(num_kv_heads, max_seqs, kv_len_max, 2 * head_dim)
    k, v = (x.astype(jnp.float32) for x in split_kv(kv))  # [Hkv, S, L, D]
    if kv_scales is not None:
        scales = gather_pages(scales_by_page(kv_scales, num_pages, page_size), page_indices)  # [Hkv, S, P, 2, ps]
        scales = jnp.moveaxis(scales, 3, 0).reshape(2, num_kv_heads, max_seqs, kv_len_max, 1)
        k = k * scales[0]
        v = v * scales[1]
    if k_scale is not None:
        k = k * k_scale
    if v_scale is not None:
        v = v * v_scale

    blocks = query_blocks(kv_lens, cu_q_lens, num_seqs, num_tokens, q_block)
    qs = gather_queries(q, blocks).reshape(max_seqs, q_block, num_kv_heads, group, head_dim)
    scores = jnp.einsum("sqhgd,hsld->shgql", qs, k) * sm_scale
    visible = visible_keys(blocks, kv_lens, kv_len_max, sliding_window)
    probs = masked_softmax(scores, visible[:, None, None], soft_cap, mask_value)
    # A key no query of its sequence sees has probability 0 everywhere, but 0 * NaN is NaN: zero its V.
    v = jnp.where(jnp.any(visible, axis=1)[None, :, :, None], v, 0.0)
    out = jnp.einsum("shgql,hsld->sqhgd", probs, v).reshape(max_seqs, q_block, num_q_heads, head_dim)
    return scatter_queries(out, blocks, num_tokens).astype(q.dtype)
