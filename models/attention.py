"""Grouped-query attention over a paged KV cache, and a cache-free causal path for reference checks.

Both paths share the projections and RoPE, so a difference between them can only come from the cache handling.
MHA and MQA are the cases num_kv_heads == num_heads and num_kv_heads == 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from kernels_pallas import ragged_paged_attention, write_kv
from models.config import ModelConfig
from models.layers import Linear, RMSNorm, apply_rope, rope_inv_freq


@struct.dataclass
class AttentionMetadata:
    """Where each packed token lives in the paged cache and which sequence it belongs to (see DESIGN.md)."""

    slot_mapping: jax.Array  # i32[T]; -1 for padding tokens
    kv_lens: jax.Array  # i32[S]; cached tokens per sequence after this step's writes
    page_indices: jax.Array  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array  # i32[S + 1]
    num_seqs: jax.Array  # i32[1]
    max_q_len: int = struct.field(pytree_node=False, default=1)


class Attention(nnx.Module):
    """Attention of layer `layer`: its window, RoPE base and scaling come from the config (`layer_window`,
    `layer_rope`); QK-norm, the score scale and the logit soft cap are config values shared by all layers."""

    def __init__(self, config: ModelConfig, layer: int = 0, *, dtype=jnp.float32, attn_impl: str = "auto",
                 rngs: nnx.Rngs):
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.q_proj = Linear(d, config.num_heads * hd, use_bias=config.attention_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, config.num_kv_heads * hd, use_bias=config.attention_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, config.num_kv_heads * hd, use_bias=config.attention_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(config.num_heads * hd, d, dtype=dtype, rngs=rngs)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, style=config.norm_style, dtype=dtype)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, style=config.norm_style, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rope = (hd, *config.layer_rope(layer))  # static; the frequencies are trace-time numpy
        self.sm_scale = config.attn_scale
        self.sliding_window = config.layer_window(layer)
        self.soft_cap = config.attn_logit_softcap
        self.attn_impl = attn_impl

    def _qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # per head, over head_dim, before RoPE (Qwen3Attention, Gemma3Attention)
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inv_freq(*self.rope)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def __call__(self, x: jax.Array, positions: jax.Array, kv_pages: jax.Array,
                 meta: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
        """x[T, D] packed tokens -> (out[T, D], updated kv_pages)."""
        q, k, v = self._qkv(x, positions)
        kv_pages = write_kv(kv_pages, k, v, meta.slot_mapping)
        out = ragged_paged_attention(q, kv_pages, meta.kv_lens, meta.page_indices, meta.cu_q_lens, meta.num_seqs,
                                     sm_scale=self.sm_scale, sliding_window=self.sliding_window,
                                     soft_cap=self.soft_cap, impl=self.attn_impl, max_q_len=meta.max_q_len)
        return self.o_proj(out.reshape(x.shape[0], -1)), kv_pages

    def forward_dense(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Cache-free causal attention over x[B, L, D] (positions[L] shared by the batch), with the same window and
        soft cap as the paged path: key m is visible to query l when m <= l and m > l - window."""
        batch, length, _ = x.shape
        q, k, v = jax.vmap(lambda xb: self._qkv(xb, positions))(x)
        group = self.num_heads // self.num_kv_heads
        q = q.reshape(batch, length, self.num_kv_heads, group, self.head_dim).astype(jnp.float32)
        scores = jnp.einsum("blhgd,bmhd->bhglm", q, k.astype(jnp.float32)) * self.sm_scale
        if self.soft_cap is not None:
            scores = self.soft_cap * jnp.tanh(scores / self.soft_cap)
        causal = jnp.tril(jnp.ones((length, length), bool))
        if self.sliding_window is not None:
            causal &= ~jnp.tril(jnp.ones((length, length), bool), k=-self.sliding_window)
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        out = jnp.einsum("bhglm,bmhd->blhgd", probs, v.astype(jnp.float32)).astype(x.dtype)
        return self.o_proj(out.reshape(batch, length, -1))

