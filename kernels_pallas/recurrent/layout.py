"""The state cache's layout: the one place that spells it (the model, the runner, the cost model and the tools build
state caches through the specs here).

A state layer (Gated DeltaNet, Mamba2) keeps, per sequence, a constant-size state instead of a growing KV cache: the
last K-1 inputs of its short causal conv1d and the recurrent state. One state layer's cache is a `RecurrentState`
of N slots, `conv: [N, C, K-1]` (C the conv's channels, in the model dtype: it holds model activations) and
`ssm: [N, ...]` (float32 always: the recurrence sums over the whole context, and rounding it to bf16 every token
drifts). A sequence owns one slot while it runs (`AttentionMetadata.state_slots`); slot 0 is the null slot that
padding rows read and write, so it is never handed to a sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class RecurrentState:
    """One state layer's cache: `conv` [N, C, K-1] and `ssm` [N, ...] (see the module docstring). A pytree, so a
    step donates it and `jax.tree` maps over it like the KV cache's arrays."""

    conv: jax.Array
    ssm: jax.Array

    @property
    def num_slots(self) -> int:
        return self.conv.shape[0]


def recurrent_state_spec(num_slots: int, conv_dim: int, conv_kernel: int, num_heads: int, state_rows: int,
                         state_cols: int, dtype=jnp.float32) -> RecurrentState:
    """A state layer's cache as `jax.ShapeDtypeStruct`s: conv [N, conv_dim, K-1] in `dtype`, the recurrent state
    [N, heads, rows, cols] in float32. One spec serves every state layer, since each keeps these two leaves: Gated
    DeltaNet's delta-rule state is [N, Hv, Dk, Dv] (transformers' `recurrent_states` per sequence), Mamba2's SSD
    state [N, heads, head_dim, d_state] (`ModelConfig.state_cache_spec` picks the dimensions by layer kind)."""
    if min(num_slots, conv_dim, conv_kernel - 1, num_heads, state_rows, state_cols) < 1:
        raise ValueError(f"every state cache dimension must be >= 1 (and the conv kernel >= 2), got num_slots="
                         f"{num_slots}, conv_dim={conv_dim}, conv_kernel={conv_kernel}, heads={num_heads}, "
                         f"state_rows={state_rows}, state_cols={state_cols}")
    return RecurrentState(
        conv=jax.ShapeDtypeStruct((num_slots, conv_dim, conv_kernel - 1), jnp.dtype(dtype)),
        ssm=jax.ShapeDtypeStruct((num_slots, num_heads, state_rows, state_cols), jnp.float32))


def zero_state(spec: RecurrentState) -> RecurrentState:
    """A zeroed state cache of `spec`'s shapes (slot 0 included)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec)


def state_bytes(spec: RecurrentState) -> int:
    """Bytes of a state cache of `spec` (every slot)."""
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(spec))


def copy_state_slots(cache: RecurrentState, src: jax.Array, dst: jax.Array) -> RecurrentState:
    """Copy slots `src[i]` -> `dst[i]` of one state layer's cache (forks, prefix checkpoints). Pairs whose dst is 0
    (the null slot) are padding: they write slot 0, which no sequence reads."""
    return jax.tree.map(lambda x: x.at[dst].set(x[src]), cache)
