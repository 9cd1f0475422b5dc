"""Multi-head latent attention (DeepSeek-V2 §2.1.2-2.1.3) over a paged latent cache.

Each token caches one normalized latent c (kv_lora_rank values, 512 in DeepSeek-V2) and one RoPE key k_r shared by
all heads (qk_rope_head_dim, 64): 576 values per token per layer instead of 2·heads·head_dim. Per head, the key
is [W_UK c ; k_r] and the value W_UV c, with W_UK and W_UV the two halves of `kv_b_proj`.

Why absorption: q·[W_UK c ; k_r] = (W_UKᵀ q_nope)·c + q_rope·k_r, and Σ p·W_UV c = W_UV (Σ p·c). Folding W_UK into
the query and W_UV into the output lets attention run directly over the cached latents, so a decode step reads
576 values per cached token and never materializes per-head keys or values. The paged path always absorbs, for
prefill chunks too: one code path, exact in real arithmetic; a materialized prefill would cost fewer FLOPs for
long prompts (scores over qk_nope+rope = 192 instead of 576 dims) and is left for when prefill FLOPs matter.
`forward_dense` is the materialized form, as transformers computes it, and the tests hold the two equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas import ragged_paged_mla_attention, sharded_ragged_paged_mla_attention, write_latent
from models.attention import causal_softmax
from models.config import ModelConfig
from models.layers import Linear, RMSNorm, apply_rope, rope_inv_freq

# DeepseekV2Attention builds q_a_layernorm and kv_a_layernorm without passing rms_norm_eps: they use 1e-6 always.
LORA_NORM_EPS = 1e-6


class MLAttention(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int = 0, *, dtype=jnp.float32, attn_impl: str = "auto",
                 mesh: jax.sharding.Mesh | None = None, rngs: nnx.Rngs):
        d, heads = config.hidden_size, config.num_heads
        self.num_heads = heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        qk = self.nope_dim + self.rope_dim
        if config.q_lora_rank is None:
            self.q_proj = Linear(d, heads * qk, dtype=dtype, rngs=rngs)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(d, config.q_lora_rank, dtype=dtype, rngs=rngs)
            self.q_a_norm = RMSNorm(config.q_lora_rank, LORA_NORM_EPS, dtype=dtype)
            self.q_b_proj = Linear(config.q_lora_rank, heads * qk, dtype=dtype, rngs=rngs)
        self.kv_a_proj = Linear(d, self.rank + self.rope_dim, dtype=dtype, rngs=rngs)
        self.kv_a_norm = RMSNorm(self.rank, LORA_NORM_EPS, dtype=dtype)
        self.kv_b_proj = Linear(self.rank, heads * (self.nope_dim + self.v_dim), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(heads * self.v_dim, d, dtype=dtype, rngs=rngs)
        theta, scaling = config.layer_rope(layer)
        self.rope = (self.rope_dim, theta, scaling)  # static; the frequencies are trace-time numpy
        self.rope_scale = 1.0 if scaling is None else scaling.rope_attention_factor
        self.rope_interleaved = config.rope_interleaved
        self.sm_scale = config.attn_scale
        self.sliding_window = config.layer_window(layer)
        self.soft_cap = config.attn_logit_softcap
        self.attn_impl = attn_impl
        self.mesh = mesh  # tensor parallelism, given at build time (see models/attention.py)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return apply_rope(x, positions, rope_inv_freq(*self.rope), interleaved=self.rope_interleaved,
                          scale=self.rope_scale)

    def _project(self, x: jax.Array, positions: jax.Array):
        """x[T, D] -> q_nope [T, H, n], roped q_rope [T, H, r], normed latent c [T, C], roped k_rope [T, r]."""
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.reshape(x.shape[0], self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q[..., :self.nope_dim], self._rope(q[..., self.nope_dim:], positions)
        kv = self.kv_a_proj(x)
        latent = self.kv_a_norm(kv[:, :self.rank])
        k_rope = self._rope(kv[:, None, self.rank:], positions)[:, 0]
        return q_nope, q_rope, latent, k_rope

    def _up_projections(self) -> tuple[jax.Array, jax.Array]:
        """kv_b_proj [C, H·(n + v)] split per head into W_UK [C, H, n] and W_UV [C, H, v]."""
        w = self.kv_b_proj.kernel[...].reshape(self.rank, self.num_heads, self.nope_dim + self.v_dim)
        return w[..., :self.nope_dim], w[..., self.nope_dim:]

    def __call__(self, x: jax.Array, positions: jax.Array, latent_pages: jax.Array, meta) -> tuple[jax.Array, jax.Array]:
        """x[T, D] packed tokens -> (out[T, D], updated latent pages [P, page_size, C + r])."""
        q_nope, q_rope, latent, k_rope = self._project(x, positions)
        latent_pages = write_latent(latent_pages, jnp.concatenate([latent, k_rope], axis=-1), meta.slot_mapping,
                                    sharded=self.mesh is not None)
        w_uk, w_uv = self._up_projections()
        q_latent = jnp.einsum("thn,chn->thc", q_nope, w_uk)
        kw = dict(sm_scale=self.sm_scale, sliding_window=self.sliding_window, soft_cap=self.soft_cap,
                  impl=self.attn_impl, max_q_len=meta.max_q_len)
        args = (q_latent, q_rope, latent_pages, meta.kv_lens, meta.page_indices, meta.cu_q_lens, meta.num_seqs)
        out = (ragged_paged_mla_attention(*args, **kw) if self.mesh is None
               else sharded_ragged_paged_mla_attention(*args, mesh=self.mesh, **kw))
        out = jnp.einsum("thc,chv->thv", out, w_uv)
        return self.o_proj(out.reshape(x.shape[0], -1)), latent_pages

    def forward_dense(self, x: jax.Array, positions: jax.Array, shared_kv=None) -> tuple[jax.Array, None]:
        """Cache-free causal attention over x[B, L, D] with materialized per-head keys and values; (out, None) to
        match `Attention.forward_dense` (MLA layers never share KV across layers)."""
        del shared_kv
        batch, length, _ = x.shape
        q_nope, q_rope, latent, k_rope = jax.vmap(lambda xb: self._project(xb, positions))(x)
        kv = (latent @ self.kv_b_proj.kernel[...]).reshape(batch, length, self.num_heads, -1)
        k = jnp.concatenate([kv[..., :self.nope_dim],
                             jnp.broadcast_to(k_rope[:, :, None], (batch, length, self.num_heads, self.rope_dim))],
                            axis=-1)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        scores = jnp.einsum("blhd,bmhd->bhlm", q.astype(jnp.float32), k.astype(jnp.float32)) * self.sm_scale
        probs = causal_softmax(scores, self.sliding_window, self.soft_cap)
        out = jnp.einsum("bhlm,bmhv->blhv", probs, kv[..., self.nope_dim:].astype(jnp.float32)).astype(x.dtype)
        return self.o_proj(out.reshape(batch, length, -1)), None
