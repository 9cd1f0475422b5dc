"""Writing new keys and values into the paged KV cache.

The cache of one layer is `[num_pages, page_size, 2 * Hkv, D]` with K at even and V at odd head slots (the layout
of JAX's ragged paged attention op). A token's slot is `page * page_size + offset`; padding tokens carry a negative
slot and leave the cache untouched, so a padded batch never writes outside its own pages.

Why a loop of `dynamic_update_slice` and not one scatter: on XLA CPU a scatter whose result is read again in the
same computation (attention reads the pages right after the write) made XLA copy the whole cache, every layer,
every step (0.2 s per decode step for a 200 MB cache). A while loop with a traced trip count keeps the update in
place, at a few microseconds per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def interleave_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """[T, Hkv, D] x2 -> [T, 2 * Hkv, D] with K at even and V at odd slots."""
    num_tokens, num_kv_heads, head_dim = k.shape
    return jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)


def write_kv(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Write the new K/V of T tokens into their slots; slots < 0 are padding and are skipped."""
    page_size = kv_pages.shape[1]
    new = interleave_kv(k, v).astype(kv_pages.dtype)[:, None, None]  # [T, 1, 1, 2Hkv, D]
    # A traced trip count stops XLA from unrolling (and then copying) short loops.
    trip_count = jax.lax.optimization_barrier(jnp.int32(slot_mapping.shape[0]))

    def write_one(i, pages):
        slot = slot_mapping[i]
        start = (jnp.maximum(slot, 0) // page_size, jnp.maximum(slot, 0) % page_size, 0, 0)
        current = jax.lax.dynamic_slice(pages, start, new.shape[1:])
        return jax.lax.dynamic_update_slice(pages, jnp.where(slot >= 0, new[i], current), start)

    return jax.lax.fori_loop(0, trip_count, write_one, kv_pages)


def copy_pages(kv_pages: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copy whole pages src[i] -> dst[i] in order (copy-on-write of shared pages); in place, as in `write_kv`."""
    trip_count = jax.lax.optimization_barrier(jnp.int32(src.shape[0]))

    def copy_one(i, pages):
        page = jax.lax.dynamic_slice_in_dim(pages, src[i], 1, axis=0)
        return jax.lax.dynamic_update_slice_in_dim(pages, page, dst[i], axis=0)

    return jax.lax.fori_loop(0, trip_count, copy_one, kv_pages)
