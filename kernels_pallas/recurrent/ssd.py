"""Mamba2's state space duality (SSD) over a ragged batch: the chunked (matmul) form for prefill, the recurrent
form (a scan over tokens) for decode, and the invariant form, the recurrent one with its sum over the state in a
fixed order (recurrent/ordered_sum.py), for batch-invariant mode. Pure JAX, with the signature a Pallas kernel would
have; the reference kernels are tested against.

Per head h of sequence s, with the discretized step dt (softplus'ed, biased and clamped by the caller), the state
`[head_dim P, d_state N]` evolves token by token as

    state <- exp(dt * A[h]) * state + dt * outer(x, B[group(h)]),    y = state @ C[group(h)]

(transformers' `mamba2_selective_state_update`, and `mamba2_chunk_scan`'s chunked form of the same; head h reads
group h // (H / G) of B and C, `repeat_interleave`'s order). The D skip, the gate and the norm are the caller's
(models/mamba2.py). Sequence s starts from slot `state_slots[s]` of the state cache, or from zeros when the step
holds its first token (`kv_lens[s] == q_len`: a fresh slot needs no clearing), and its final state goes back to
that slot. The chunked form lays every sequence out on chunks of its own, so no chunk mixes two sequences, and
chains the chunks' states with an associative scan that restarts at each sequence's first chunk.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kernels_pallas.recurrent.ordered_sum import ordered_sum
from kernels_pallas.recurrent.ragged import (check_meta, initial_states, query_spans, spec_destinations,
                                             token_sequences, write_final_states, write_position_states)

SSD_MODES = ("chunked", "recurrent", "invariant")


def check_ssd_inputs(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, state: jax.Array,
                     meta: Any, chunk_size: int, mode: str) -> None:
    """The contract's shape checks (shared by every impl of `ragged_ssd`)."""
    check_meta(meta)
    if x.ndim != 3:
        raise ValueError(f"x must be [tokens, heads, head_dim], got shape {x.shape}")
    tokens, heads, head_dim = x.shape
    if dt.shape != (tokens, heads) or A.shape != (heads,):
        raise ValueError(f"dt must be [tokens, heads] = {(tokens, heads)} and A [heads] = {(heads,)}, got dt "
                         f"{dt.shape} and A {A.shape}")
    if B.ndim != 3 or B.shape != C.shape or B.shape[0] != tokens:
        raise ValueError(f"B and C must both be [tokens={tokens}, groups, d_state], got {B.shape} and {C.shape}")
    if heads % B.shape[1]:
        raise ValueError(f"{heads} heads are not a multiple of {B.shape[1]} B/C groups")
    if state.ndim != 4 or state.shape[1:] != (heads, head_dim, B.shape[2]):
        raise ValueError(f"state must be [slots, heads, head_dim, d_state] = [N, {heads}, {head_dim}, {B.shape[2]}] "
                         f"(kernels_pallas/recurrent/layout.py), got {state.shape}")
    if mode not in SSD_MODES:
        raise ValueError(f"unknown SSD mode {mode!r}; expected one of {SSD_MODES}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if getattr(meta, "state_spec_slots", None) is not None and mode == "chunked":
        raise ValueError("state_spec_slots (per-token states for speculative verification) needs mode='recurrent' "
                         "or 'invariant'")


def _by_head(v: jax.Array, heads: int) -> jax.Array:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H / G)."""
    return jnp.repeat(v, heads // v.shape[-2], axis=-2)


def _lay_out(v: jax.Array, dest: jax.Array, rows: int, width: int) -> jax.Array:
    """Packed rows v[T, ...] -> [rows, width, ...] float32 at flat positions `dest` (out of range: dropped); the
    positions no token fills are zeros, which the recurrences read as "no input, no decay"."""
    buf = jnp.zeros((rows * width, *v.shape[1:]), jnp.float32)
    return buf.at[dest].set(v.astype(jnp.float32), mode="drop").reshape(rows, width, *v.shape[1:])


def _recurrent(x, dt, A, B, C, h0, seq, offset, valid, q_block: int, keep_states: bool, ordered: bool):
    """Scan over each sequence's tokens, all sequences at once, on a [S, q_block] layout (empty rows have dt = 0
    and x = 0, so they leave the state as it is); `ordered`: y's sum over N in a fixed order. Returns
    (y [T, H, P], final [S, H, P, N], each token's state [T, H, P, N] or None)."""
    heads = x.shape[1]
    seqs = h0.shape[0]
    dest = jnp.where(valid & (offset < q_block), seq * q_block + offset, seqs * q_block)
    xs, dts, bs, cs = (jnp.moveaxis(_lay_out(v, dest, seqs, q_block), 1, 0) for v in (x, dt, B, C))  # [Qb, S, ...]

    def step(h, inputs):
        x_t, dt_t, b_t, c_t = inputs
        h = (h * jnp.exp(dt_t * A)[..., None, None]
             + (x_t * dt_t[..., None])[..., None] * _by_head(b_t, heads)[..., None, :])
        y = (ordered_sum if ordered else jnp.sum)(h * _by_head(c_t, heads)[..., None, :], axis=-1)
        return h, (y, h if keep_states else None)

    final, (ys, hs) = jax.lax.scan(step, h0, (xs, dts, bs, cs))
    take = lambda v: jnp.moveaxis(v, 0, 1).reshape(seqs * q_block, *v.shape[2:]).at[dest].get(  # noqa: E731
        mode="fill", fill_value=0.0)
    return take(ys), final, None if hs is None else take(hs)


def _segsum(a: jax.Array) -> jax.Array:
    """[..., L] -> [..., L, L]: out[l, s] = a[s+1] + ... + a[l] for l >= s, -inf above the diagonal (transformers'
    `segment_sum`: masked cumulative sums rather than differences of one cumsum, which cancel)."""
    length = a.shape[-1]
    below = jnp.tril(jnp.ones((length, length), bool), -1)
    sums = jnp.cumsum(jnp.where(below, a[..., :, None], 0.0), axis=-2)
    return jnp.where(jnp.tril(jnp.ones((length, length), bool)), sums, -jnp.inf)


def _chunked(x, dt, A, B, C, h0, q_lens, seq, offset, valid, chunk_size: int):
    """The matmul form on chunks that each hold one sequence's tokens. Returns (y [T, H, P], final [S, H, P, N])."""
    tokens, heads, head_dim = x.shape
    seqs, groups = q_lens.shape[0], B.shape[1]
    L = chunk_size
    num_chunks = -(-tokens // L) + seqs  # sum of ceil(q_len / L) <= ceil(T / L) + S
    seq_chunks = -(-q_lens // L)
    first_chunk = jnp.cumsum(seq_chunks) - seq_chunks  # [S]
    # Token at offset p of sequence s goes to row (first_chunk[s] + p // L) * L + p % L; padding tokens nowhere.
    dest = jnp.where(valid, (first_chunk[seq] + offset // L) * L + offset % L, num_chunks * L)
    xc, dtc, bc, cc = (_lay_out(v, dest, num_chunks, L) for v in (x, dt, B, C))
    per_group = heads // groups
    xdt = (xc * dtc[..., None]).reshape(num_chunks, L, groups, per_group, head_dim)
    a = jnp.moveaxis(dtc * A, 1, 2)  # [c, H, L]
    a_cum = jnp.cumsum(a, axis=-1)
    decay = jnp.exp(_segsum(a)).reshape(num_chunks, groups, per_group, L, L)  # [c, g, j, l, s]
    scores = jnp.einsum("clgn,csgn->cgls", cc, bc)
    y_diag = jnp.einsum("cgls,cgjls,csgjp->clgjp", scores, decay, xdt)
    to_end = jnp.exp(a_cum[..., -1:] - a_cum).reshape(num_chunks, groups, per_group, L)
    chunk_states = jnp.einsum("clgn,cgjl,clgjp->cgjpn", bc, to_end, xdt).reshape(num_chunks, heads, head_dim, -1)

    # Chain the chunks: state_out[c] = total[c] * state_in[c] + chunk_states[c], state_in[c] = state_out[c - 1],
    # except at a sequence's first chunk, where it is the sequence's initial state.
    chunk = jnp.arange(num_chunks, dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(first_chunk + seq_chunks, chunk, side="right"), seqs - 1)
    starts = chunk == first_chunk[owner]
    init = h0[owner]  # [c, H, P, N]
    total = jnp.exp(a_cum[..., -1])  # [c, H]
    carry_in = jnp.where(starts[:, None], 0.0, total)[..., None, None]
    offset_in = chunk_states + jnp.where(starts[:, None, None, None], total[..., None, None] * init, 0.0)

    def combine(left, right):
        return left[0] * right[0], right[0] * left[1] + right[1]

    _, state_out = jax.lax.associative_scan(combine, (carry_in, offset_in))
    state_in = jnp.where(starts[:, None, None, None], init,
                         jnp.concatenate([jnp.zeros_like(state_out[:1]), state_out[:-1]]))
    c_by_head = jnp.moveaxis(_by_head(cc, heads), 2, 1)  # [c, H, L, N]
    y_off = jnp.einsum("chln,chpn->clhp", c_by_head, state_in) * jnp.moveaxis(jnp.exp(a_cum), 1, 2)[..., None]
    y = (y_diag.reshape(num_chunks, L, heads, head_dim) + y_off).reshape(num_chunks * L, heads, head_dim)
    y = y.at[dest].get(mode="fill", fill_value=0.0)
    last = jnp.clip(first_chunk + seq_chunks - 1, 0, num_chunks - 1)
    final = jnp.where((seq_chunks > 0)[:, None, None, None], state_out[last], h0)
    return y, final


def ragged_ssd(
    x: jax.Array,  # [T, H, P]
    dt: jax.Array,  # [T, H]: the discretization step, softplus(dt + dt_bias) clamped (the caller's)
    A: jax.Array,  # [H]: -exp(A_log)
    B: jax.Array,  # [T, G, N]
    C: jax.Array,  # [T, G, N]
    state: jax.Array,  # [num_slots, H, P, N] float32 (RecurrentState.ssm)
    meta: Any,  # cu_q_lens, kv_lens, num_seqs, state_slots, state_spec_slots, max_q_len (recurrent/ragged.py)
    *,
    chunk_size: int = 128,
    mode: str = "chunked",
) -> tuple[jax.Array, jax.Array]:
    """Mamba2's SSD over packed ragged sequences. Returns (y [T, H, P] float32, the updated state cache).

    Rows of no sequence come back as zeros. The recurrent form scans `meta.max_q_len` steps (a static bound on
    every sequence's token count this step; the whole T when the meta has none). With `meta.state_spec_slots`
    (speculative verification) the state after the j-th token of sequence s is also written to slot
    `state_spec_slots[s, j]`; the recurrent form keeps those per-token states, so it requires mode="recurrent" (or
    "invariant", the same form).
    """
    check_ssd_inputs(x, dt, A, B, C, state, meta, chunk_size, mode)
    tokens = x.shape[0]
    seq, offset, valid = token_sequences(meta, tokens)
    state = jnp.asarray(state)
    h0 = initial_states(state, meta).astype(jnp.float32)
    x, dt, A, B, C = (jnp.asarray(v, jnp.float32) for v in (x, dt, A, B, C))
    spec = getattr(meta, "state_spec_slots", None)
    if mode != "chunked":
        q_block = min(getattr(meta, "max_q_len", None) or tokens, tokens)
        y, final, per_token = _recurrent(x, dt, A, B, C, h0, seq, offset, valid, q_block, spec is not None,
                                         mode == "invariant")
    else:
        _, q_lens = query_spans(meta)
        y, final = _chunked(x, dt, A, B, C, h0, q_lens, seq, offset, valid, chunk_size)
    state = write_final_states(state, final, meta)
    if spec is not None:
        state = write_position_states(state, per_token, spec_destinations(meta, seq, offset, valid, state.shape[0]))
    return y, state
