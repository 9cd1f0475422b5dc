"""Pure-JAX ragged paged attention: the reference every kernel is checked against, and the CPU path.

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

import jax
import jax.numpy as jnp

DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def ragged_paged_attention_reference(
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
) -> jax.Array:
    """Attention of packed ragged queries over paged KV. Returns `[T, Hq, D]` in q's dtype.

    Rows of q that belong to no valid sequence (padding, or sequences at index >= num_seqs) come back as zeros.
    `max_q_len` is a static upper bound on any valid sequence's query length (default: T).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_combined_kv_heads, kv_head_dim = kv_pages.shape
    if kv_head_dim != head_dim or num_combined_kv_heads % 2:
        raise ValueError(f"kv_pages shape {kv_pages.shape} does not match q shape {q.shape}: expected "
                         "[num_pages, page_size, 2 * num_kv_heads, head_dim]")
    num_kv_heads = num_combined_kv_heads // 2
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    max_seqs, pages_per_seq = page_indices.shape
    q_block = num_tokens if max_q_len is None else min(max_q_len, num_tokens)
    kv_len_max = pages_per_seq * page_size
    mask_value = DEFAULT_MASK_VALUE if mask_value is None else mask_value

    kv = kv_pages[page_indices].reshape(max_seqs, kv_len_max, num_combined_kv_heads, head_dim)
    k = kv[:, :, 0::2].astype(jnp.float32)
    v = kv[:, :, 1::2].astype(jnp.float32)
    if k_scale is not None:
        k = k * k_scale
    if v_scale is not None:
        v = v * v_scale

    q_starts = cu_q_lens[:-1]
    q_lens = cu_q_lens[1:] - q_starts
    q_offsets = jnp.arange(q_block, dtype=jnp.int32)
    token_index = q_starts[:, None] + q_offsets[None, :]  # [S, Qb]
    seq_valid = jnp.arange(max_seqs) < num_seqs[0]
    row_valid = seq_valid[:, None] & (q_offsets[None, :] < q_lens[:, None])  # [S, Qb]
    gather_index = jnp.where(row_valid, token_index, num_tokens)
    q_padded = jnp.concatenate([q, jnp.zeros((1, num_q_heads, head_dim), q.dtype)], axis=0)
    qs = q_padded[gather_index].astype(jnp.float32).reshape(max_seqs, q_block, num_kv_heads, group, head_dim)

    scores = jnp.einsum("sqhgd,slhd->shgql", qs, k) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    q_pos = (kv_lens - q_lens)[:, None] + q_offsets[None, :]  # [S, Qb]
    k_pos = jnp.arange(kv_len_max, dtype=jnp.int32)
    visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < kv_lens[:, None, None])
    if sliding_window is not None:
        visible &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    scores = jnp.where(visible[:, None, None], scores, mask_value)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("shgql,slhd->sqhgd", probs, v).reshape(max_seqs, q_block, num_q_heads, head_dim)
    out = jnp.where(row_valid[:, :, None, None], out, 0.0)
    packed = jnp.zeros((num_tokens + 1, num_q_heads, head_dim), jnp.float32)
    packed = packed.at[gather_index].add(out)
    return packed[:num_tokens].astype(q.dtype)
