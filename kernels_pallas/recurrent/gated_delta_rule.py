"""The gated delta rule (Gated DeltaNet; Yang et al. 2024, as transformers' Qwen3-Next computes it) over a ragged
batch, in three forms with one signature.

Per value head, with S the state [Dk, Dv] and the query scaled by Dk ** -0.5 (q and k l2-normed first):
    S <- exp(g_t) * S;  S <- S + k_t (beta_t * (v_t - S^T k_t))^T;  o_t = S^T q_t
  * "recurrent": that update token by token (`torch_recurrent_gated_delta_rule`), every sequence of the batch in
    parallel, one scan step per position of the longest chunk (`meta.max_q_len`): decode is one step.
  * "invariant": the recurrent form with every sum over Dk in a fixed order (recurrent/ordered_sum.py) and the
    l2norm's rsqrt correctly rounded (`invariant_rsqrt`), so a sequence's bits depend neither on how its prompt is
    split nor on the other sequences of its steps (XLA:CPU's reduces vectorize by the shape); batch-invariant mode
    runs it.
  * "chunked": `torch_chunk_gated_delta_rule`'s matmul form. Each sequence's chunk is cut into blocks of
    `chunk_size` starting at its own first token, so no block mixes sequences; the intra-block part (the UT
    transform, a unit-lower-triangular solve) runs for all blocks at once, then one scan over the blocks carries
    the state, restarting from a sequence's initial state at its first block.
All read each sequence's initial state from its slot (zeros for a fresh sequence) and write its final state back
(kernels_pallas/recurrent/ragged.py has the rules); the recurrent form also writes per-position states
(`state_spec_slots`), as does the invariant form.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kernels_pallas.matmul.invariant_cpu import invariant_rsqrt
from kernels_pallas.recurrent.ordered_sum import ordered_sum
from kernels_pallas.recurrent.ragged import (check_meta, initial_states, query_spans, spec_destinations,
                                             token_sequences, write_final_states, write_position_states)

MODES = ("chunked", "recurrent", "invariant")


def l2norm(x: jax.Array, invariant: bool = False, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x²) + eps) over the last axis (transformers' / FLA's l2norm); `invariant`: the sum and the
    rsqrt the same bits at any shape."""
    if invariant:
        return x * invariant_rsqrt(ordered_sum(x * x, axis=-1)[..., None] + eps)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _check(q, k, v, g, beta, state, mode, chunk_size):
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != t or g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"gated delta rule shapes disagree: q {q.shape}, k {k.shape} (both [T, Hk, Dk]), v "
                         f"{v.shape} [T, Hv, Dv], g {g.shape} and beta {beta.shape} (both [T, Hv])")
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    if state.ndim != 4 or state.shape[1:] != (hv, dk, dv) or state.dtype != jnp.float32:
        raise ValueError(f"state must be float32 [N, {hv}, {dk}, {dv}], got {state.dtype} {state.shape}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def ragged_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                            state: jax.Array, meta: Any, *, chunk_size: int = 64, mode: str = "chunked",
                            use_qk_l2norm: bool = True, scale: float | None = None) -> tuple[jax.Array, jax.Array]:
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay, <= 0) and beta [T, Hv], state [N, Hv, Dk, Dv] float32 ->
    (o [T, Hv, Dv] in v's dtype, state'). Each key head serves Hv / Hk consecutive value heads. `scale`: the query
    scale, Dk ** -0.5 when None. Tokens of no sequence give zeros."""
    _check(q, k, v, g, beta, state, mode, chunk_size)
    check_meta(meta)
    if mode == "chunked" and getattr(meta, "state_spec_slots", None) is not None:
        raise ValueError("per-position states (state_spec_slots) need mode='recurrent' or 'invariant'")
    num_tokens, hk, dk = q.shape
    hv = v.shape[1]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    q, k = f32(q), f32(k)
    if use_qk_l2norm:
        q, k = l2norm(q, mode == "invariant"), l2norm(k, mode == "invariant")
    q = q * (dk ** -0.5 if scale is None else scale)
    if hv != hk:
        q, k = jnp.repeat(q, hv // hk, axis=1), jnp.repeat(k, hv // hk, axis=1)
    seq, offset, valid = token_sequences(meta, num_tokens)
    init = initial_states(state, meta)  # [S, Hv, Dk, Dv]
    zero = lambda x: jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0)  # noqa: E731
    args = tuple(zero(x) for x in (q, k, f32(v), f32(g), f32(beta)))
    if mode != "chunked":
        out, final, per_token = _recurrent(*args, init, meta, seq, offset, valid, mode == "invariant")
    else:
        out, final = _chunked(*args, init, meta, chunk_size)
        per_token = None
    new_state = write_final_states(state, final, meta)
    if per_token is not None:
        new_state = write_position_states(new_state, per_token,
                                          spec_destinations(meta, seq, offset, valid, state.shape[0]))
    return zero(out).astype(v.dtype), new_state


def _step(h, q, k, v, g, beta, ordered: bool):
    """One token for a batch of states h [B, Hv, Dk, Dv]; q, k [B, Hv, Dk], v [B, Hv, Dv], g, beta [B, Hv].
    Products and sums over Dk rather than dots: a dot's summation order may depend on B on XLA:CPU; `ordered`:
    the sums in a fixed order too (the invariant form)."""
    total = ordered_sum if ordered else jnp.sum
    h = h * jnp.exp(g)[..., None, None]
    delta = (v - total(h * k[..., :, None], axis=-2)) * beta[..., None]
    h = h + k[..., :, None] * delta[..., None, :]
    return h, total(h * q[..., :, None], axis=-2)


def _recurrent(q, k, v, g, beta, init, meta, seq, offset, valid, ordered: bool):
    """Every sequence advances one token per scan step (position j of its chunk), so decode is a single step."""
    num_tokens = q.shape[0]
    starts, q_lens = query_spans(meta)
    spec = getattr(meta, "state_spec_slots", None) is not None

    def body(carry, j):
        h, out = carry
        idx = starts + j
        active = (j < q_lens) & (idx < num_tokens)
        at = jnp.clip(idx, 0, num_tokens - 1)
        h_new, o = _step(h, q[at], k[at], v[at], g[at], beta[at], ordered)
        h = jnp.where(active[:, None, None, None], h_new, h)
        out = out.at[jnp.where(active, idx, num_tokens)].set(o, mode="drop")
        return (h, out), (h if spec else None)

    steps = max(int(meta.max_q_len), 1)
    (final, out), states = jax.lax.scan(body, (init, jnp.zeros(v.shape, jnp.float32)), jnp.arange(steps))
    per_token = None
    if spec:  # states [steps, S, ...] -> each token's post-token state (tokens past max_q_len: never written)
        per_token = states[jnp.clip(offset, 0, steps - 1), seq]
        per_token = jnp.where((offset < steps)[:, None, None, None], per_token, 0.0)
    return out, final, per_token


def _chunked(q, k, v, g, beta, init, meta, chunk):
    num_tokens, hv, dk = q.shape
    dv = v.shape[-1]
    num_seqs = meta.cu_q_lens.shape[0] - 1
    starts, q_lens = query_spans(meta)
    blocks_of = (q_lens + chunk - 1) // chunk
    first_block = jnp.cumsum(blocks_of) - blocks_of
    num_blocks = -(-num_tokens // chunk) + num_seqs  # a static bound on sum(ceil(q_len / chunk))
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    block_seq = jnp.clip(jnp.searchsorted(first_block + blocks_of, b, side="right").astype(jnp.int32), 0,
                         num_seqs - 1)
    block_valid = b < jnp.sum(blocks_of)
    within = (b - first_block[block_seq]) * chunk  # the block's first offset in its sequence's chunk
    pos = within[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [B, C]
    tok_ok = block_valid[:, None] & (pos < q_lens[block_seq][:, None])
    tok = jnp.where(tok_ok, starts[block_seq][:, None] + pos, num_tokens)  # num_tokens: padding
    gather = lambda x: jnp.where(tok_ok.reshape(tok_ok.shape + (1,) * (x.ndim - 1)),  # noqa: E731
                                 x[jnp.clip(tok, 0, num_tokens - 1)], 0.0)
    # [B, Hv, C, ...] as transformers lays the chunks out
    qc, kc, vc = (gather(x).transpose(0, 2, 1, 3) for x in (q, k, v))
    gc, bc = (gather(x).transpose(0, 2, 1) for x in (g, beta))
    cum = jnp.cumsum(gc, axis=-1)  # [B, Hv, C]
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    pair = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_beta, v_beta = kc * bc[..., None], vc * bc[..., None]
    ut = jnp.einsum("bhik,bhjk->bhij", k_beta, kc) * pair
    ut = jnp.where(jnp.tril(jnp.ones((chunk, chunk), bool), -1), ut, 0.0) + jnp.eye(chunk, dtype=ut.dtype)
    solve = lambda rhs: jax.scipy.linalg.solve_triangular(ut, rhs, lower=True, unit_diagonal=True)  # noqa: E731
    new_values = solve(v_beta)
    k_cumdecay = solve(k_beta * jnp.exp(cum)[..., None])
    intra = jnp.einsum("bhik,bhjk->bhij", qc, kc) * pair
    q_decayed = qc * jnp.exp(cum)[..., None]
    k_decayed = kc * jnp.exp(cum[..., -1:] - cum)[..., None]
    block_decay = jnp.exp(cum[..., -1])[..., None, None]  # [B, Hv, 1, 1]
    first = within == 0

    def body(carry, x):
        h, finals = carry
        s, is_first, ok, nv, kcd, qd, kd, attn, decay = x
        h = jnp.where(is_first, init[s], h)
        v_new = nv - jnp.einsum("hck,hkv->hcv", kcd, h)
        o = jnp.einsum("hck,hkv->hcv", qd, h) + jnp.einsum("hij,hjv->hiv", attn, v_new)
        h = h * decay + jnp.einsum("hck,hcv->hkv", kd, v_new)
        finals = finals.at[s].set(jnp.where(ok, h, finals[s]))
        return (h, finals), o

    xs = (block_seq, first, block_valid, new_values, k_cumdecay, q_decayed, k_decayed, intra, block_decay)
    (_, final), o_blocks = jax.lax.scan(body, (jnp.zeros((hv, dk, dv), jnp.float32), init), xs)
    out = jnp.zeros((num_tokens, hv, dv), jnp.float32)
    out = out.at[tok.reshape(-1)].set(o_blocks.transpose(0, 2, 1, 3).reshape(-1, hv, dv), mode="drop")
    return out, final
