"""The Mamba2 mixer of a hybrid model's "mamba" layers (Granite-4.0-H, Bamba, Nemotron-H), in the attention's place
of a decoder layer (models/decoder.py STATE_MIXERS) over the layer's `RecurrentState`: the conv state of x|B|C and
the SSD state `[heads, head_dim, ssm_state_size]` per slot.

Semantics are transformers' `BambaMixer` / `GraniteMoeHybridMambaLayer` torch path (Mamba2's `torch_forward`): one
in_proj gives the gate z, x|B|C and dt; a depthwise causal conv1d (with bias) and SiLU run over x|B|C; dt becomes
softplus(dt + dt_bias) clamped to the time-step limits, A = -exp(A_log); the SSD (kernels_pallas/recurrent/ssd.py)
plus the D skip gives y; the gated RMSNorm normalizes y * silu(z) over groups of width/n_groups channels; out_proj.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas.matmul.invariant_cpu import invariant_row_sum, invariant_rsqrt
from kernels_pallas.recurrent.conv import ragged_causal_conv1d
from kernels_pallas.recurrent.layout import RecurrentState
from kernels_pallas.recurrent.ssd import ragged_ssd
from models.config import ModelConfig
from models.layers import Linear, normal_init

# Canonical weight leaf (models/weights.py) -> the attribute path inside a DecoderLayer (its mixer is `attn`).
MAMBA2_WEIGHT_PATHS = {
    "in_proj": "attn.in_proj.kernel", "conv1d": "attn.conv1d", "conv1d_bias": "attn.conv1d_bias",
    "dt_bias": "attn.dt_bias", "A_log": "attn.A_log", "D": "attn.D", "mamba_norm": "attn.norm_weight",
    "out_proj": "attn.out_proj.kernel",
}


class Mamba2Mixer(nnx.Module):
    """Layer `layer`'s Mamba2 mixer. `__call__` runs the ragged batch over the state cache; `forward_dense` runs
    each row of a [B, L, D] batch from a zero state (the cache-free path the family tests compare)."""

    def __init__(self, config: ModelConfig, layer: int = 0, *, dtype, attn_impl: str = "auto",
                 mesh: jax.sharding.Mesh | None = None, rngs: nnx.Rngs):
        if mesh is not None:
            raise ValueError("tensor parallelism (a mesh) is not supported for Mamba2 layers yet; build the model "
                             "without one")
        d, width = config.hidden_size, config.mamba_intermediate_size
        heads, conv_dim = config.mamba_num_heads, config.mamba_conv_dim
        self.in_proj = Linear(d, width + conv_dim + heads, dtype=dtype, rngs=rngs)
        self.conv1d = nnx.Param(normal_init(rngs, (conv_dim, config.mamba_d_conv), dtype, std=0.2))
        self.conv1d_bias = nnx.Param(jnp.zeros((conv_dim,), dtype)) if config.mamba_conv_bias else None
        self.dt_bias = nnx.Param(jnp.ones((heads,), dtype))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, heads + 1, dtype=jnp.float32)).astype(dtype))
        self.D = nnx.Param(jnp.ones((heads,), dtype))
        self.norm_weight = nnx.Param(jnp.ones((width,), dtype))
        self.out_proj = Linear(width, d, dtype=dtype, rngs=rngs)
        self.width, self.heads, self.head_dim = width, heads, config.mamba_head_dim
        self.groups, self.state_size = config.mamba_n_groups, config.ssm_state_size
        self.eps = config.rms_norm_eps
        self.dt_limit = tuple(config.mamba_time_step_limit)
        self.chunk_size = config.mamba_chunk_size
        self.mesh = mesh  # None (checked above); the runner reads every mixer's

    def _split(self, x: jax.Array):
        """x[T, D] -> (z [T, width], x|B|C [T, conv_dim], dt [T, heads])."""
        zxbcdt = self.in_proj(x)
        return jnp.split(zxbcdt, [self.width, zxbcdt.shape[-1] - self.heads], axis=-1)

    def _ssm_inputs(self, xbc: jax.Array, dt: jax.Array):
        """The conv's output (SiLU applied here) and raw dt -> the SSD's x [T, H, P], dt, A, B, C [T, G, N]."""
        xbc = jax.nn.silu(xbc.astype(jnp.float32))
        gn = self.groups * self.state_size
        xs, B, C = jnp.split(xbc, [self.width, self.width + gn], axis=-1)
        step = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        low, high = self.dt_limit
        if (low, high) != (0.0, math.inf):
            step = jnp.clip(step, low, high)
        A = -jnp.exp(self.A_log[...].astype(jnp.float32))
        rows = xs.shape[0]
        return (xs.reshape(rows, self.heads, self.head_dim), step, A,
                B.reshape(rows, self.groups, self.state_size), C.reshape(rows, self.groups, self.state_size))

    def _output(self, y: jax.Array, xs: jax.Array, z: jax.Array, dtype) -> jax.Array:
        """y [T, H, P] of the SSD -> the mixer's output [T, D]: the D skip, the gated group RMSNorm, out_proj."""
        rows = y.shape[0]
        y = (y + xs * self.D[...].astype(jnp.float32)[:, None]).reshape(rows, self.width)
        gated = y * jax.nn.silu(z.astype(jnp.float32))
        grouped = gated.reshape(rows, self.groups, self.width // self.groups)
        squares = grouped * grouped
        mean = (invariant_row_sum(squares)[..., None] / squares.shape[-1] if self.batch_invariant
                else jnp.mean(squares, axis=-1, keepdims=True))
        normed = grouped * (invariant_rsqrt if self.batch_invariant else jax.lax.rsqrt)(mean + self.eps)
        # transformers casts back to the input dtype before the weight multiplies.
        out = self.norm_weight[...] * normed.reshape(rows, self.width).astype(dtype)
        return self.out_proj(out.astype(dtype))

    @property
    def batch_invariant(self) -> bool:
        """Set with the model's projections (models/batch_invariant.py flags every Linear): then the SSD runs in its
        invariant form on every step and the norm sums in a fixed order, so any split of a prompt gives the same
        bits."""
        return self.in_proj.batch_invariant

    def mode(self, meta) -> str:
        """The invariant form in batch-invariant mode (any split of a prompt, any batch, the same bits), the
        recurrent one for decode steps and speculative verification (per-token states), the chunked one otherwise."""
        if self.batch_invariant:
            return "invariant"
        if meta.max_q_len == 1 or getattr(meta, "state_spec_slots", None) is not None:
            return "recurrent"
        return "chunked"

    def __call__(self, x: jax.Array, positions: jax.Array, state: RecurrentState, meta):
        """x[T, D] packed tokens -> (out[T, D], the updated state); sequences' slots in `meta.state_slots`."""
        del positions  # Mamba2 has no positional encoding
        z, xbc, dt = self._split(x)
        conv_w = self.conv1d[...]
        bias = None if self.conv1d_bias is None else self.conv1d_bias[...]
        xbc, conv_state = ragged_causal_conv1d(xbc, conv_w, bias, state.conv, meta)
        xs, step, A, B, C = self._ssm_inputs(xbc, dt)
        y, ssm = ragged_ssd(xs, step, A, B, C, state.ssm, meta, chunk_size=self.chunk_size, mode=self.mode(meta))
        return self._output(y, xs, z, x.dtype), RecurrentState(conv=conv_state, ssm=ssm)

    def forward_dense(self, x: jax.Array, positions: jax.Array, shared_kv=None):
        """Cache-free: each row of x[B, L, D] as one sequence from a zero state (through the same ragged ops, on a
        throwaway state cache of B + 1 slots)."""
        batch, length, d = x.shape
        seq_ids = jnp.arange(batch, dtype=jnp.int32)
        meta = SimpleNamespace(cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32) * length,
                               kv_lens=jnp.full((batch,), length, jnp.int32),
                               num_seqs=jnp.array([batch], jnp.int32), state_slots=seq_ids + 1,
                               state_spec_slots=None, max_q_len=length)
        conv_dim = self.conv1d.shape[0]
        state = RecurrentState(
            conv=jnp.zeros((batch + 1, conv_dim, self.conv1d.shape[1] - 1), x.dtype),
            ssm=jnp.zeros((batch + 1, self.heads, self.head_dim, self.state_size), jnp.float32))
        out, _ = self(x.reshape(batch * length, d), positions, state, meta)
        return out.reshape(batch, length, d), shared_kv
