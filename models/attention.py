"""Grouped-query attention over a paged KV cache, and a cache-free causal path for reference checks.

Both paths share the projections and RoPE, so a difference between them can only come from the cache handling.
MHA and MQA are the cases num_kv_heads == num_heads and num_kv_heads == 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from kernels_pallas import ragged_paged_attention, sharded_ragged_paged_attention, write_kv
from kernels_pallas.attention.causal import causal_visible, dense_causal_attention, paged_causal_attention
from kernels_pallas.attention.reference import masked_softmax
from models.config import ModelConfig
from models.layers import Linear, RMSNorm, apply_rope, rope_inv_freq


def causal_softmax(scores: jax.Array, sliding_window: int | None, soft_cap: float | None) -> jax.Array:
    """Softmax of cache-free scores [..., L, L] over keys, with the paged path's soft cap and window: key m is
    visible to query l when m <= l and m > l - window. Shared by `Attention` and MLA's `forward_dense`."""
    return masked_softmax(scores, causal_visible(scores.shape[-1], sliding_window), soft_cap, -jnp.inf)


@struct.dataclass
class QuantizedKV:
    """One layer's int8 or fp8 KV cache: int8 / float8_e4m3fn `pages` and their float32 per-token-per-head
    `scales`, both in `kernels_pallas.kv_cache_spec`'s layout (kernels_pallas/kv_cache/writes.py says why per token
    and head). A pytree, so the steps donate and shard it like a plain cache array."""

    pages: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.pages.shape


@struct.dataclass
class AttentionMetadata:
    """Where each packed token lives in the paged cache and which sequence it belongs to (see docs/architecture.md)."""

    slot_mapping: jax.Array  # i32[T]; -1 for padding tokens
    kv_lens: jax.Array  # i32[S]; cached tokens per sequence after this step's writes
    page_indices: jax.Array  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array  # i32[S + 1]
    num_seqs: jax.Array  # i32[1]
    max_q_len: int = struct.field(pytree_node=False, default=1)
    # State layers (kernels_pallas/recurrent/): sequence s reads its initial state from slot state_slots[s] and
    # writes its final state there (padding rows: the null slot 0); it starts from zeros instead when it has no
    # context before this step's chunk (kv_lens[s] == its query length), so a new slot needs no clearing. None
    # when the model has no state layer.
    state_slots: jax.Array | None = None  # i32[S]
    # Speculative verification: the state after the j-th token of sequence s's chunk is also written to slot
    # state_spec_slots[s, j] (-1: not written), so the state at the accepted prefix is kept without a rerun.
    state_spec_slots: jax.Array | None = None  # i32[S, k + 1]

    def for_group(self, group: int) -> "AttentionMetadata":
        """The slots and page table of KV cache group `group` (`ModelConfig.kv_group`). A model with several groups
        gets them stacked, slot_mapping [G, T] and page_indices [G, S, P]; unstacked ones serve every layer."""
        if self.page_indices.ndim == 2:
            return self
        return self.replace(slot_mapping=self.slot_mapping[group], page_indices=self.page_indices[group])


class Attention(nnx.Module):
    """Attention of layer `layer`: its window, RoPE base and scaling come from the config (`layer_window`,
    `layer_rope`); QK-norm, the score scale and the logit soft cap are config values shared by all layers.

    Under cross-layer attention (`cla_factor` > 1) a layer that does not own its KV (`config.owns_kv`) has no K/V
    projections: it attends over the cache the first layer of its run wrote in the same step."""

    def __init__(self, config: ModelConfig, layer: int = 0, *, dtype=jnp.float32, attn_impl: str = "auto",
                 mesh: jax.sharding.Mesh | None = None, rngs: nnx.Rngs):
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.output_gate = config.attn_output_gate  # q_proj yields [q | gate] per head
        self.q_proj = Linear(d, config.num_heads * hd * (2 if self.output_gate else 1), use_bias=config.attention_bias,
                             dtype=dtype, rngs=rngs)
        self.owns_kv = config.owns_kv(layer)
        if self.owns_kv:
            self.k_proj = Linear(d, config.num_kv_heads * hd, use_bias=config.attention_bias, dtype=dtype, rngs=rngs)
            self.v_proj = Linear(d, config.num_kv_heads * hd, use_bias=config.attention_bias, dtype=dtype, rngs=rngs)
        else:
            self.k_proj = self.v_proj = None
        self.o_proj = Linear(config.num_heads * hd, d, dtype=dtype, rngs=rngs)
        norm = lambda: RMSNorm(hd, config.rms_norm_eps, style=config.norm_style, dtype=dtype)  # noqa: E731
        self.q_norm = norm() if config.qk_norm else None
        self.k_norm = norm() if config.qk_norm and self.owns_kv else None
        self.rope = (config.rotary_dim, *config.layer_rope(layer))  # static; the frequencies are trace-time numpy
        self.sm_scale = config.attn_scale
        self.sliding_window = config.layer_window(layer)
        self.kv_group = config.kv_group(layer)  # static: which page table of the metadata this layer reads
        # Tensor parallelism (given at build time, sharding.shard_decoder): attention then runs one head shard per
        # device through shard_map (kernels_pallas/sharded.py), since XLA cannot partition a Pallas kernel itself.
        self.mesh = mesh
        self.soft_cap = config.attn_logit_softcap
        self.attn_impl = attn_impl
        self.batch_invariant = False  # models/batch_invariant.py: forward_dense through the paged C++ kernel

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """RoPE on each head's first `rotary_dim` dims (all of them unless partial_rotary_factor < 1)."""
        inv_freq = rope_inv_freq(*self.rope)
        dim = self.rope[0]
        if dim == self.head_dim:
            return apply_rope(x, positions, inv_freq)
        return jnp.concatenate([apply_rope(x[..., :dim], positions, inv_freq), x[..., dim:]], axis=-1)

    def _qkv(self, x: jax.Array, positions: jax.Array):
        """Roped q [T, Hq, D], roped k and v [T, Hkv, D] (None, None for a layer that shares its KV), and the
        output gate [T, Hq * D] (None without attn_output_gate)."""
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, self.num_heads, -1)
        gate = None
        if self.output_gate:  # per head [q | gate] (Qwen3NextAttention)
            q, gate = q[..., :self.head_dim], q[..., self.head_dim:].reshape(*lead, -1)
        if self.q_norm is not None:  # per head, over head_dim, before RoPE (Qwen3Attention, Gemma3Attention)
            q = self.q_norm(q)
        q = self._rope(q, positions)
        if not self.owns_kv:
            return q, None, None, gate
        k = self.k_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return q, self._rope(k, positions), v, gate

    def _output(self, out: jax.Array, gate: jax.Array | None) -> jax.Array:
        """o_proj of the heads' outputs [..., Hq * D], gated by sigmoid(gate) first when the layer has a gate."""
        if gate is not None:
            out = (out * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(out.dtype)
        return self.o_proj(out)

    def __call__(self, x: jax.Array, positions: jax.Array, kv_pages: jax.Array | QuantizedKV,
                 meta: AttentionMetadata) -> tuple[jax.Array, jax.Array | QuantizedKV]:
        """x[T, D] packed tokens -> (out[T, D], updated kv_pages); an int8 cache (QuantizedKV) is quantized on
        write and dequantized by the attention kernel."""
        meta = meta.for_group(self.kv_group)
        q, k, v, gate = self._qkv(x, positions)
        quantized = isinstance(kv_pages, QuantizedKV)
        pages, scales = (kv_pages.pages, kv_pages.scales) if quantized else (kv_pages, None)
        if self.owns_kv and quantized:
            pages, scales = write_kv(pages, k, v, meta.slot_mapping, kv_scales=scales, sharded=self.mesh is not None)
            kv_pages = QuantizedKV(pages=pages, scales=scales)
        elif self.owns_kv:
            kv_pages = pages = write_kv(pages, k, v, meta.slot_mapping, sharded=self.mesh is not None)
        kw = dict(sm_scale=self.sm_scale, sliding_window=self.sliding_window, soft_cap=self.soft_cap,
                  impl=self.attn_impl, max_q_len=meta.max_q_len, kv_scales=scales)
        args = (q, pages, meta.kv_lens, meta.page_indices, meta.cu_q_lens, meta.num_seqs)
        out = (ragged_paged_attention(*args, **kw) if self.mesh is None
               else sharded_ragged_paged_attention(*args, mesh=self.mesh, **kw))
        return self._output(out.reshape(x.shape[0], -1), gate), kv_pages

    def forward_dense(self, x: jax.Array, positions: jax.Array, shared_kv=None):
        """Cache-free causal attention over x[B, L, D] (positions[L] shared by the batch), with the same window and
        soft cap as the paged path: key m is visible to query l when m <= l and m > l - window. Returns (out, (k,
        v)); a layer that shares its KV takes the owner's (k, v) as `shared_kv`."""
        batch, length, _ = x.shape
        q, k, v, gate = jax.vmap(lambda xb: self._qkv(xb, positions))(x)
        if not self.owns_kv:
            k, v = shared_kv
        attend = paged_causal_attention if self.batch_invariant else dense_causal_attention
        out = attend(q, k, v, sm_scale=self.sm_scale, sliding_window=self.sliding_window,
                     soft_cap=self.soft_cap).astype(x.dtype)
        return self._output(out.reshape(batch, length, -1), gate), (k, v)

