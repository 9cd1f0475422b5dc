"""Cache-free causal attention over whole sequences [B, L, ...]: XLA's dense form, and the same values through the
paged C++ kernel (`paged_causal_attention`), which is how a trainer's forward reproduces the engine bit for bit.

Why the paged kernel for a cache-free forward: in batch-invariant mode (`LLM(batch_invariant=True)`) a trainer's
teacher-forced logprobs must equal the engine's (`inference/rl/logprobs.py`). The engine's attention is the C++
kernel over its paged cache; a query row's result there is one fixed float program of the row's visible keys (their
scores one by one, an exact softmax over [first, last], values accumulated in key order; tested across chunkings), so
running the same kernel over a "virtual cache" holding the trainer's own K/V (consecutive pages per sequence, in
`kv_cache/layout.py`'s layout) gives the same bits. Its backward is the dense form's (`jax.custom_vjp`): a gradient
needs no bitwise match.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.attention.cpu import ragged_paged_attention_cpu
from kernels_pallas.attention.reference import masked_softmax
from kernels_pallas.kv_cache.layout import pack_kv

VIRTUAL_PAGE_SIZE = 16  # any size gives the same bits (a key's arithmetic does not depend on its page)


def causal_visible(length: int, sliding_window: int | None) -> jax.Array:
    """bool [L, L]: key m is visible to query l when m <= l and m > l - window."""
    visible = jnp.tril(jnp.ones((length, length), bool))
    if sliding_window is not None:
        visible &= ~jnp.tril(jnp.ones((length, length), bool), k=-sliding_window)
    return visible


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None) -> jax.Array:
    """q [B, L, Hq, D], k and v [B, L, Hkv, D] -> float32 [B, L, Hq, D]: causal GQA as XLA einsums."""
    batch, length, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    q = q.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim).astype(jnp.float32)
    scores = jnp.einsum("blhgd,bmhd->bhglm", q, k.astype(jnp.float32)) * sm_scale
    probs = masked_softmax(scores, causal_visible(length, sliding_window), soft_cap, -jnp.inf)
    out = jnp.einsum("bhglm,bmhd->blhgd", probs, v.astype(jnp.float32))
    return out.reshape(batch, length, num_heads, head_dim)


def _paged(q, k, v, sm_scale, sliding_window, soft_cap):
    batch, length, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    pages = -(-length // VIRTUAL_PAGE_SIZE)
    rows = pack_kv(k, v)  # [B, L, Hkv, 2D]
    rows = jnp.pad(rows, ((0, 0), (0, pages * VIRTUAL_PAGE_SIZE - length), (0, 0), (0, 0)))
    cache = rows.reshape(batch * pages, VIRTUAL_PAGE_SIZE, num_kv_heads, 2 * head_dim).transpose(2, 0, 1, 3)
    page_indices = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
    out = ragged_paged_attention_cpu(
        q.reshape(batch * length, num_heads, head_dim), cache, jnp.full((batch,), length, jnp.int32), page_indices,
        jnp.arange(batch + 1, dtype=jnp.int32) * length, jnp.array([batch], jnp.int32), sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap)
    return out.astype(jnp.float32).reshape(batch, length, num_heads, head_dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _paged_vjp(q, k, v, sm_scale, sliding_window, soft_cap):
    return _paged(q, k, v, sm_scale, sliding_window, soft_cap)


def _fwd(q, k, v, sm_scale, sliding_window, soft_cap):
    return _paged(q, k, v, sm_scale, sliding_window, soft_cap), (q, k, v)


def _bwd(sm_scale, sliding_window, soft_cap, residuals, g):
    dense = functools.partial(dense_causal_attention, sm_scale=sm_scale, sliding_window=sliding_window,
                              soft_cap=soft_cap)
    _, vjp = jax.vjp(dense, *residuals)
    return vjp(g)


_paged_vjp.defvjp(_fwd, _bwd)


def paged_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None) -> jax.Array:
    """`dense_causal_attention`'s values computed by the C++ paged kernel over a virtual cache of k and v (the
    module docstring), so each query row gets the bits the engine's paged step gives it. CPU only; differentiable
    (the dense form's gradient)."""
    if q.ndim != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or q.shape[2] % k.shape[2]:
        raise ValueError(f"expected q [B, L, Hq, D] and k, v [B, L, Hkv, D] with Hkv dividing Hq, got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    return _paged_vjp(q, k, v, float(sm_scale), sliding_window, soft_cap)


__all__ = ["causal_visible", "dense_causal_attention", "paged_causal_attention"]
