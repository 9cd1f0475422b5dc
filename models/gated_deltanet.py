"""Gated DeltaNet, the "linear_attention" layer of Qwen3-Next (transformers' Qwen3NextGatedDeltaNet): a token mixer
with a constant-size state in the attention's place (models/decoder.py STATE_MIXERS).

in_proj_qkvz -> q, k, v, z and in_proj_ba -> b, a (columns grouped per key head, models/weights.py); a short causal
conv1d over q|k|v with SiLU; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule over
l2-normed q and k (kernels_pallas/recurrent/gated_delta_rule.py); an RMSNorm over each value head gated by
silu(z); out_proj. Its cache is a `RecurrentState` (the conv's last K-1 inputs, the [Hv, Dk, Dv] state) per slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas.recurrent.conv import ragged_causal_conv1d
from kernels_pallas.recurrent.gated_delta_rule import ragged_gated_delta_rule
from kernels_pallas.recurrent.layout import RecurrentState, zero_state
from models.attention import AttentionMetadata
from models.config import ModelConfig
from models.layers import Linear, RMSNorm, normal_init

CHUNK_SIZE = 64  # transformers' and FLA's block of the chunked form


class GatedDeltaNet(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int = 0, *, dtype=jnp.float32, attn_impl: str = "auto",
                 mesh: jax.sharding.Mesh | None = None, rngs: nnx.Rngs):
        if mesh is not None:
            raise ValueError("tensor parallelism (a mesh) is not supported for Gated DeltaNet layers yet; run the "
                             "hybrid model on one device (mesh=None)")
        d = config.hidden_size
        self.hk, self.hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.in_proj_qkvz = Linear(d, 2 * self.hk * self.dk + 2 * self.hv * self.dv, dtype=dtype, rngs=rngs)
        self.in_proj_ba = Linear(d, 2 * self.hv, dtype=dtype, rngs=rngs)
        self.conv1d = nnx.Param(normal_init(rngs, (config.linear_conv_dim, config.linear_conv_kernel_dim), dtype,
                                            std=0.5))
        self.dt_bias = nnx.Param(jnp.ones((self.hv,), dtype))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (self.hv,), jnp.float32, 1.0, 16.0))
                               .astype(dtype))
        self.norm = RMSNorm(self.dv, config.rms_norm_eps, style="rms", dtype=dtype)
        self.out_proj = Linear(self.hv * self.dv, d, dtype=dtype, rngs=rngs)
        self.config, self.layer = config, layer
        self.mesh, self.attn_impl = mesh, attn_impl  # what the runner asks of every layer's mixer
        self.batch_invariant = False  # models/batch_invariant.py: the invariant form for every step

    def mode(self, meta: AttentionMetadata) -> str:
        """The invariant form in batch-invariant mode (any split of a prompt, any batch, the same bits), the
        recurrent one for decode steps and speculative verification (per-token states), the chunked one otherwise."""
        if self.batch_invariant:
            return "invariant"
        return "recurrent" if meta.max_q_len <= 1 or meta.state_spec_slots is not None else "chunked"

    def _project(self, x: jax.Array):
        """x[T, D] -> (q|k|v [T, C] for the conv, z [T, Hv, Dv], b and a [T, Hv]), un-grouping transformers'
        per-key-head column order (`fix_query_key_value_ordering`)."""
        t, r = x.shape[0], self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).reshape(t, self.hk, -1)
        q, k, v, z = jnp.split(qkvz, [self.dk, 2 * self.dk, 2 * self.dk + r * self.dv], axis=-1)
        ba = self.in_proj_ba(x).reshape(t, self.hk, 2 * r)
        b, a = ba[..., :r].reshape(t, self.hv), ba[..., r:].reshape(t, self.hv)
        mixed = jnp.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], axis=-1)
        return mixed, z.reshape(t, self.hv, self.dv), b, a

    def __call__(self, x: jax.Array, positions: jax.Array, state: RecurrentState,
                 meta: AttentionMetadata) -> tuple[jax.Array, RecurrentState]:
        """x[T, D] packed tokens -> (out[T, D], the state cache with each sequence's slot advanced)."""
        del positions  # the recurrence is its own position signal
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        mixed, conv = ragged_causal_conv1d(mixed, self.conv1d[...], None, state.conv, meta)
        mixed = jax.nn.silu(mixed.astype(jnp.float32)).astype(x.dtype)
        key_width = self.hk * self.dk
        q = mixed[:, :key_width].reshape(t, self.hk, self.dk)
        k = mixed[:, key_width:2 * key_width].reshape(t, self.hk, self.dk)
        v = mixed[:, 2 * key_width:].reshape(t, self.hv, self.dv)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        o, ssm = ragged_gated_delta_rule(q, k, v, g, beta, state.ssm, meta, chunk_size=CHUNK_SIZE,
                                         mode=self.mode(meta))
        gated = self.norm(o) * jax.nn.silu(z.astype(jnp.float32))  # Qwen3NextRMSNormGated
        return self.out_proj(gated.astype(x.dtype).reshape(t, -1)), RecurrentState(conv=conv, ssm=ssm)

    def forward_dense(self, x: jax.Array, positions: jax.Array, shared_kv=None):
        """x[B, L, D], each row a whole sequence from a zero state -> (out[B, L, D], shared_kv unchanged): the
        ragged path over the B rows as B fresh sequences in slots 1..B of a scratch state cache."""
        batch, length, d = x.shape
        cu = jnp.arange(batch + 1, dtype=jnp.int32) * length
        meta = AttentionMetadata(slot_mapping=jnp.zeros(batch * length, jnp.int32),
                                 kv_lens=jnp.full(batch, length, jnp.int32),
                                 page_indices=jnp.zeros((batch, 1), jnp.int32), cu_q_lens=cu,
                                 num_seqs=jnp.array([batch], jnp.int32), max_q_len=length,
                                 state_slots=jnp.arange(1, batch + 1, dtype=jnp.int32))
        scratch = zero_state(self.config.state_cache_spec(self.layer, batch + 1, x.dtype))
        out, _ = self(x.reshape(batch * length, d), jnp.tile(positions, batch), scratch, meta)
        return out.reshape(batch, length, d), shared_kv
