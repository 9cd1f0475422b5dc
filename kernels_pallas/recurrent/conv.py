"""The short causal conv1d of the state layers (Gated DeltaNet over q|k|v, Mamba2 over x|B|C) over a ragged batch.

Each token's output is a depthwise conv over its sequence's last K inputs (this token and the K-1 before it): the
earlier ones come from this step's chunk where the sequence has them here, else from its conv state, the last K-1
inputs of the previous steps (`RecurrentState.conv`, [N, C, K-1], oldest first), as transformers'
`causal_conv1d_update` keeps it. A fresh sequence starts from zeros (the conv's left padding in the uncached forward).
The activation is the caller's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kernels_pallas.recurrent.ordered_sum import ordered_sum
from kernels_pallas.recurrent.ragged import (check_meta, initial_states, query_spans, spec_destinations,
                                             token_sequences, write_final_states, write_position_states)


def ragged_causal_conv1d(x: jax.Array, weight: jax.Array, bias: jax.Array | None, conv_state: jax.Array,
                         meta: Any) -> tuple[jax.Array, jax.Array]:
    """x[T, C], weight[C, K] (taps oldest first), bias[C] | None, conv_state[N, C, K-1] -> (y[T, C], conv_state')
    with each sequence's last K-1 inputs written to its slot (and each token's to `meta.state_spec_slots`)."""
    num_tokens, channels = x.shape
    if weight.ndim != 2 or weight.shape[0] != channels:
        raise ValueError(f"conv weight must be [C={channels}, K], got {weight.shape}")
    taps = weight.shape[1]
    if conv_state.ndim != 3 or conv_state.shape[1:] != (channels, taps - 1):
        raise ValueError(f"conv_state must be [N, {channels}, {taps - 1}] for a {taps}-tap conv, got "
                         f"{conv_state.shape}")
    check_meta(meta)
    seq, offset, valid = token_sequences(meta, num_tokens)
    init = initial_states(conv_state, meta).astype(jnp.float32)  # [S, C, K-1]
    xf = jnp.where(valid[:, None], x.astype(jnp.float32), 0.0)
    # window[t, k]: the input k - (K-1) tokens before token t (k = K-1 is t itself), from x or the conv state.
    back = jnp.arange(taps, dtype=jnp.int32) - (taps - 1)  # [K], <= 0
    rel = offset[:, None] + back[None, :]  # [T, K]: index within the sequence's chunk
    from_x = xf[jnp.clip(jnp.arange(num_tokens)[:, None] + back[None, :], 0, num_tokens - 1)]  # [T, K, C]
    state_col = jnp.clip(taps - 1 + rel, 0, taps - 2)  # the conv state's column for rel < 0
    from_state = jnp.take_along_axis(init[seq], state_col[:, None, :], axis=2).transpose(0, 2, 1)  # [T, K, C]
    window = jnp.where((rel >= 0)[..., None], from_x, from_state)
    # Products and a fixed-order sum over the K taps (pairwise), not a dot nor a reduce: each token's bits must not
    # depend on how many tokens share the step (batch-invariant mode; recurrent/ordered_sum.py).
    y = ordered_sum(window * weight.astype(jnp.float32).T[None], axis=1)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    after = window[:, 1:].transpose(0, 2, 1)  # [T, C, K-1]: the conv state after each token
    starts, q_lens = query_spans(meta)
    last = jnp.clip(starts + q_lens - 1, 0, num_tokens - 1)
    final = jnp.where((q_lens > 0)[:, None, None], after[last], init)
    new_state = write_final_states(conv_state, final, meta)
    if getattr(meta, "state_spec_slots", None) is not None:
        dst = spec_destinations(meta, seq, offset, valid, conv_state.shape[0])
        new_state = write_position_states(new_state, after, dst)
    return jnp.where(valid[:, None], y, 0.0).astype(x.dtype), new_state
