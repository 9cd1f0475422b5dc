"""Ragged paged MLA (multi-head latent attention, DeepSeek-V2) over a latent cache: the pure-JAX reference.

MLA caches one latent row per token instead of per-head K/V: `latent_pages[num_pages, page_size, Dl + Dr]`, or
`[num_pages, page_size * (Dl + Dr)]` as TPU keeps it (`kv_cache/latent_layout.py`), each row `[c (Dl) | k_rope (Dr)]`
(Dl=512, Dr=64 for DeepSeek-V2; any sizes work here). With the key and value up-projections absorbed into the
query and output projections (the model's job), attention runs in latent space as multi-query attention with one
shared "KV head":

    score[t, h, j] = (q_latent[t, h] . c[j] + q_rope[t, h] . k_rope[j]) * sm_scale
    out[t, h]      = softmax_j(score[t, h, :]) @ c          -> [T, H, Dl], still in latent space

Ragged packing, paging, causality (query i of a sequence sits at kv_len - q_len + i), sliding window, soft cap,
`num_seqs` and `max_q_len` mean exactly what they mean for `ragged_paged_attention_reference`, whose helpers this
reference reuses. It is the CPU path and the contract for `mla/gpu.py`; `mla/dispatch.py` chooses between them and
`kv_cache/writes.py` writes the latent rows (`write_latent`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.attention.reference import (DEFAULT_MASK_VALUE, gather_queries, masked_softmax, query_blocks,
                                                scatter_queries, visible_keys)
from kernels_pallas.kv_cache.latent_layout import latent_page_size

def check_mla_shapes(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array) -> tuple[int, int]:
    """Shared validation; returns (Dl, Dr). `latent_pages` in either form of `kv_cache/latent_layout.py`."""
    if q_latent.ndim != 3 or q_rope.ndim != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_latent {q_latent.shape} and q_rope {q_rope.shape} must be [T, H, Dl] and [T, H, Dr]")
    latent_dim, rope_dim = q_latent.shape[-1], q_rope.shape[-1]
    latent_page_size(latent_pages.shape, latent_dim + rope_dim)
    return latent_dim, rope_dim


def ragged_paged_mla_attention_reference(
    q_latent: jax.Array,  # [T, H, Dl] (absorbed queries)
    q_rope: jax.Array,  # [T, H, Dr]
    latent_pages: jax.Array,  # [num_pages, page_size, Dl + Dr] or [num_pages, page_size * (Dl + Dr)]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = None,
    max_q_len: int | None = None,
) -> jax.Array:
    """MLA attention in latent space; returns `[T, H, Dl]` in q_latent's dtype (zeros for rows of no sequence)."""
    latent_dim, rope_dim = check_mla_shapes(q_latent, q_rope, latent_pages)
    num_tokens = q_latent.shape[0]
    max_seqs, pages_per_seq = page_indices.shape
    q_block = num_tokens if max_q_len is None else min(max_q_len, num_tokens)
    kv_len_max = pages_per_seq * latent_page_size(latent_pages.shape, latent_dim + rope_dim)
    mask_value = DEFAULT_MASK_VALUE if mask_value is None else mask_value

    # Gather whole pages in the cache's own shape and split them into rows after: reshaping a flat TPU cache
    # first would relayout (copy) all of it.
    rows = latent_pages[page_indices].reshape(max_seqs, kv_len_max, latent_dim + rope_dim).astype(jnp.float32)
    c, k_rope = rows[..., :latent_dim], rows[..., latent_dim:]
    blocks = query_blocks(kv_lens, cu_q_lens, num_seqs, num_tokens, q_block)
    ql, qr = gather_queries(q_latent, blocks), gather_queries(q_rope, blocks)  # [S, Qb, H, D*]
    scores = (jnp.einsum("sqhd,sld->shql", ql, c) + jnp.einsum("sqhd,sld->shql", qr, k_rope)) * sm_scale
    probs = masked_softmax(scores, visible_keys(blocks, kv_lens, kv_len_max, sliding_window)[:, None], soft_cap,
                           mask_value)
    out = jnp.einsum("shql,sld->sqhd", probs, c)
    return scatter_queries(out, blocks, num_tokens).astype(q_latent.dtype)
