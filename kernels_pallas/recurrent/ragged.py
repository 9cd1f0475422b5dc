"""The ragged batch as the state layers' ops see it: which sequence each packed token belongs to, each sequence's
initial state (read from its slot, or zeros for a sequence with no context before this chunk), and where final and
per-position states are written. Shared by the conv and every recurrence, so they agree on the slot rules
(`AttentionMetadata.state_slots` / `state_spec_slots`, models/attention.py).

`meta` is any object with the attention metadata's fields `cu_q_lens` i32[S+1], `kv_lens` i32[S], `num_seqs`
i32[1], `state_slots` i32[S] and `state_spec_slots` i32[S, k+1] | None (kernels know no model, so no import of its
class). As in the attention reference, sequences at index >= num_seqs are padding: their tokens give zeros, and
they hold no token here, so they write their (zero) initial state to their slot, the null slot 0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def query_spans(meta: Any) -> tuple[jax.Array, jax.Array]:
    """(starts[S], q_lens[S]): each sequence's first token and token count this step (0 for padding sequences)."""
    starts = meta.cu_q_lens[:-1]
    real = jnp.arange(starts.shape[0]) < meta.num_seqs[0]
    return starts, jnp.where(real, meta.cu_q_lens[1:] - starts, 0)


def token_sequences(meta: Any, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(seq[T], offset[T], valid[T]): each token's sequence, its index within that sequence's chunk, and whether it
    belongs to a real sequence (tokens of padding sequences, or past cu_q_lens[S], do not)."""
    cu_q_lens = meta.cu_q_lens
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = cu_q_lens.shape[0] - 1
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1, 0, num_seqs - 1)
    valid = t < cu_q_lens[jnp.minimum(meta.num_seqs[0], num_seqs)]
    return seq, t - cu_q_lens[seq], valid


def fresh_sequences(meta: Any) -> jax.Array:
    """bool[S]: sequences with no context before this step's chunk, which start from a zero state."""
    q_lens = meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]
    return meta.kv_lens - q_lens <= 0


def check_meta(meta: Any) -> None:
    """Shape checks of the fields the ops read, with the fix in the message."""
    if getattr(meta, "state_slots", None) is None:
        raise ValueError("a state layer needs AttentionMetadata.state_slots (i32[S], one slot per sequence, 0 for "
                         "padding rows); build the metadata with the runner's state slots")
    num_seqs = meta.cu_q_lens.shape[0] - 1
    if meta.state_slots.shape != (num_seqs,) or meta.kv_lens.shape != (num_seqs,):
        raise ValueError(f"state_slots {meta.state_slots.shape} and kv_lens {meta.kv_lens.shape} must both be "
                         f"[{num_seqs}] (one per sequence of cu_q_lens)")
    spec = getattr(meta, "state_spec_slots", None)
    if spec is not None and (spec.ndim != 2 or spec.shape[0] != num_seqs):
        raise ValueError(f"state_spec_slots must be [{num_seqs}, k + 1], got {spec.shape}")


def initial_states(cache: jax.Array, meta: Any) -> jax.Array:
    """[S, ...]: each sequence's initial state from `cache` [N, ...] at its slot, zeros for a fresh sequence."""
    state = cache[meta.state_slots]
    keep = ~fresh_sequences(meta)
    return jnp.where(keep.reshape((-1,) + (1,) * (state.ndim - 1)), state, jnp.zeros_like(state))


def write_final_states(cache: jax.Array, final: jax.Array, meta: Any) -> jax.Array:
    """`cache` with each sequence's final state [S, ...] written to its slot (padding rows share slot 0)."""
    return cache.at[meta.state_slots].set(final.astype(cache.dtype))


def spec_destinations(meta: Any, seq: jax.Array, offset: jax.Array, valid: jax.Array, num_slots: int) -> jax.Array:
    """i32[T]: the slot each token's post-token state is also written to under speculative verification
    (`state_spec_slots[seq, offset]`), or `num_slots` (out of range: the scatter drops it) for none."""
    spec = meta.state_spec_slots
    width = spec.shape[1]
    dst = spec[seq, jnp.minimum(offset, width - 1)]
    ok = valid & (offset < width) & (dst >= 0)
    return jnp.where(ok, dst, num_slots)


def write_position_states(cache: jax.Array, states: jax.Array, dst: jax.Array) -> jax.Array:
    """`cache` with per-token states [T, ...] scattered to slots `dst` [T] (out-of-range entries dropped)."""
    return cache.at[dst].set(states.astype(cache.dtype), mode="drop")
