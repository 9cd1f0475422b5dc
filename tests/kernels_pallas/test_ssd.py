"""Mamba2's ragged SSD (kernels_pallas/recurrent/ssd.py) against a naive per-token loop: random ragged batches,
both forms, chunk sizes that split sequences mid-chunk, sequences that continue from their slot, padding rows and
padding sequences on slot 0, per-token states for speculative verification."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.recurrent.ssd import ragged_ssd

ATOL = 2e-5


def _naive(x, dt, A, B, C, state, q_lens, kv_lens, slots):
    """One token at a time, one sequence at a time (float64): y [T, H, P], the new state cache, and every
    sequence's per-token states."""
    x, dt, A, B, C = (np.asarray(v, np.float64) for v in (x, dt, A, B, C))
    state = np.array(state, np.float64)
    heads, groups = x.shape[1], B.shape[1]
    y = np.zeros_like(x)
    per_token = []
    start = 0
    for q_len, kv_len, slot in zip(q_lens, kv_lens, slots):
        h = np.zeros(state.shape[1:]) if kv_len == q_len else state[slot].copy()
        states = []
        for t in range(start, start + q_len):
            for head in range(heads):
                g = head // (heads // groups)
                h[head] = np.exp(dt[t, head] * A[head]) * h[head] + dt[t, head] * np.outer(x[t, head], B[t, g])
                y[t, head] = h[head] @ C[t, g]
            states.append(h.copy())
        state[slot] = h
        per_token.append(states)
        start += q_len
    return y, state, per_token


def _batch(rng, q_lens, kv_extra, *, slots, num_slots=8, pad_tokens=3, pad_seqs=1, heads=4, groups=2, head_dim=3,
           d_state=5):
    """Random inputs for sequences of `q_lens` new tokens after `kv_extra` cached ones, padded like the engine pads
    (extra tokens, extra sequences with zero tokens on slot 0)."""
    real = sum(q_lens)
    tokens = real + pad_tokens
    x = rng.normal(size=(tokens, heads, head_dim)).astype(np.float32)
    dt = np.log1p(np.exp(rng.normal(size=(tokens, heads)))).astype(np.float32)  # softplus: positive steps
    A = -np.exp(rng.normal(size=heads)).astype(np.float32)
    B = rng.normal(size=(tokens, groups, d_state)).astype(np.float32)
    C = rng.normal(size=(tokens, groups, d_state)).astype(np.float32)
    state = rng.normal(size=(num_slots, heads, head_dim, d_state)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens), [real] * pad_seqs]).astype(np.int32)
    kv_lens = np.array([q + e for q, e in zip(q_lens, kv_extra)] + [0] * pad_seqs, np.int32)
    slot_arr = np.array(list(slots) + [0] * pad_seqs, np.int32)
    return x, dt, A, B, C, state, cu, kv_lens, slot_arr


def _meta(cu, kv_lens, slots, spec=None, max_q_len=None):
    """The fields of AttentionMetadata the op reads (kernels know no model class); num_seqs counts the real
    sequences (every one has kv_len >= 1; _batch's padding sequences have 0)."""
    num_seqs = jnp.sum(jnp.asarray(kv_lens) > 0, dtype=jnp.int32)[None]
    return SimpleNamespace(cu_q_lens=cu, kv_lens=kv_lens, num_seqs=num_seqs, state_slots=slots,
                           state_spec_slots=spec, max_q_len=max_q_len)


def _run(inputs, max_q_len=None, spec=None, **kw):
    x, dt, A, B, C, state, cu, kv_lens, slots = inputs

    def step(x, dt, A, B, C, state, cu, kv_lens, slots, spec):
        return ragged_ssd(x, dt, A, B, C, state, _meta(cu, kv_lens, slots, spec, max_q_len), **kw)

    return jax.jit(step)(x, dt, A, B, C, state, cu, kv_lens, slots, spec)


@pytest.mark.parametrize("mode, chunk_size", [("chunked", 4), ("chunked", 5), ("chunked", 16), ("recurrent", 4),
                                              ("invariant", 4)])
@pytest.mark.parametrize("q_lens, kv_extra", [
    ([7, 1, 12, 3], [0, 5, 0, 9]),  # fresh and continuing sequences, lengths across chunk edges
    ([1, 1, 1], [4, 0, 2]),  # decode-shaped
    ([13], [6]),  # one sequence, several chunks, continuing from its slot
])
def test_ragged_ssd_matches_the_per_token_loop(mode, chunk_size, q_lens, kv_extra):
    rng = np.random.default_rng(len(q_lens) * 31 + chunk_size)
    slots = list(range(1, len(q_lens) + 1))[::-1]
    inputs = _batch(rng, q_lens, kv_extra, slots=slots)
    y, state = _run(inputs, chunk_size=chunk_size, mode=mode, max_q_len=max(q_lens) if mode != "chunked" else None)
    x, dt, A, B, C, state0, cu, kv_lens, slot_arr = inputs
    want_y, want_state, _ = _naive(x, dt, A, B, C, state0, q_lens, kv_lens, slots)
    real = sum(q_lens)
    np.testing.assert_allclose(np.asarray(y)[:real], want_y[:real], atol=ATOL, rtol=1e-5)
    assert not np.asarray(y)[real:].any()  # padding rows come back as zeros
    touched = set(slots) | {0}
    for slot in range(state0.shape[0]):
        if slot in touched - {0}:
            np.testing.assert_allclose(np.asarray(state)[slot], want_state[slot], atol=ATOL, rtol=1e-5)
        elif slot not in touched:
            np.testing.assert_array_equal(np.asarray(state)[slot], state0[slot])  # other slots untouched


def test_forms_agree_and_a_split_prompt_equals_the_whole():
    """Chunked == recurrent == invariant on one batch; and a prompt fed as two steps through its slot equals the
    prompt fed at once, in every form (the invariant form bitwise: batch-invariant mode relies on it)."""
    rng = np.random.default_rng(7)
    whole = _batch(rng, [11], [0], slots=[3], pad_tokens=0, pad_seqs=0)
    x, dt, A, B, C, state0, _, _, _ = whole
    for mode in ("chunked", "recurrent", "invariant"):
        y_whole, s_whole = _run(whole, mode=mode, chunk_size=4)
        first = (x[:6], dt[:6], A, B[:6], C[:6], state0, np.array([0, 6], np.int32), np.array([6], np.int32),
                 np.array([3], np.int32))
        y1, s1 = _run(first, mode=mode, chunk_size=4)
        second = (x[6:], dt[6:], A, B[6:], C[6:], np.asarray(s1), np.array([0, 5], np.int32),
                  np.array([11], np.int32), np.array([3], np.int32))
        y2, s2 = _run(second, mode=mode, chunk_size=4)
        split_y = np.concatenate([np.asarray(y1), np.asarray(y2)])
        if mode == "invariant":
            np.testing.assert_array_equal(split_y, np.asarray(y_whole))
            np.testing.assert_array_equal(np.asarray(s2)[3], np.asarray(s_whole)[3])
        else:
            np.testing.assert_allclose(split_y, np.asarray(y_whole), atol=ATOL, rtol=1e-5)
            np.testing.assert_allclose(np.asarray(s2)[3], np.asarray(s_whole)[3], atol=ATOL, rtol=1e-5)
    y_c, s_c = _run(whole, mode="chunked", chunk_size=3)
    for mode in ("recurrent", "invariant"):
        y_r, s_r = _run(whole, mode=mode)
        np.testing.assert_allclose(np.asarray(y_c), np.asarray(y_r), atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(s_c), np.asarray(s_r), atol=ATOL, rtol=1e-5)


def test_invariant_form_gives_a_sequence_the_same_bits_alone_and_batched():
    """A sequence's y and final state are the same bits alone and batched with five others (padding included): the
    invariant form sums over the state in a fixed order, where the recurrent form's reduce vectorizes by the number
    of sequences on XLA:CPU (kernels_pallas/recurrent/ordered_sum.py)."""
    rng = np.random.default_rng(21)
    q_lens = [9, 4, 1, 12, 6, 3]
    x, dt, A, B, C, state0, cu, kv_lens, slots = _batch(rng, q_lens, [0] * 6, slots=range(1, 7), d_state=16,
                                                        head_dim=16)
    n = q_lens[0]
    alone = (x[:n], dt[:n], A, B[:n], C[:n], state0, np.array([0, n], np.int32), np.array([n], np.int32),
             np.array([1], np.int32))
    y_alone, s_alone = _run(alone, mode="invariant", max_q_len=n)
    y, s = _run((x, dt, A, B, C, state0, cu, kv_lens, slots), mode="invariant", max_q_len=max(q_lens))
    np.testing.assert_array_equal(np.asarray(y)[:n], np.asarray(y_alone))
    np.testing.assert_array_equal(np.asarray(s)[1], np.asarray(s_alone)[1])


def test_speculative_slots_get_the_state_after_each_token():
    rng = np.random.default_rng(3)
    q_lens, slots = [3, 2], [1, 2]
    inputs = _batch(rng, q_lens, [4, 6], slots=slots, num_slots=10)
    spec = np.array([[5, -1, 6], [7, 8, 9], [-1, -1, -1]], np.int32)  # sequence 1 has 2 tokens: its 3rd is padding
    _, state = _run(inputs, mode="recurrent", max_q_len=3, spec=spec)
    x, dt, A, B, C, state0, cu, kv_lens, _ = inputs
    _, want_state, per_token = _naive(x, dt, A, B, C, state0, q_lens, kv_lens, slots)
    got = np.asarray(state)
    for (s, j), slot in {(0, 0): 5, (0, 2): 6, (1, 0): 7, (1, 1): 8}.items():
        np.testing.assert_allclose(got[slot], per_token[s][j], atol=ATOL, rtol=1e-5)
    for slot in (3, 9):  # 9: past sequence 1's last token, no state to write
        np.testing.assert_array_equal(got[slot], state0[slot])
    np.testing.assert_allclose(got[1], want_state[1], atol=ATOL, rtol=1e-5)


def test_bad_inputs_name_the_problem():
    rng = np.random.default_rng(0)
    x, dt, A, B, C, state, cu, kv_lens, slots = _batch(rng, [4], [0], slots=[1])
    meta = _meta(cu, kv_lens, slots)
    with pytest.raises(ValueError, match="state must be"):
        ragged_ssd(x, dt, A, B, C, state[:, :2], meta)
    with pytest.raises(ValueError, match="not a multiple of 3 B/C groups"):
        ragged_ssd(x, dt, A, np.zeros((x.shape[0], 3, 5)), np.zeros((x.shape[0], 3, 5)), state, meta)
    with pytest.raises(ValueError, match="unknown SSD mode"):
        ragged_ssd(x, dt, A, B, C, state, meta, mode="parallel")
    with pytest.raises(ValueError, match="needs mode='recurrent' or 'invariant'"):
        ragged_ssd(x, dt, A, B, C, state, _meta(cu, kv_lens, slots, np.zeros((2, 2), np.int32)))
    with pytest.raises(ValueError, match="state_slots"):
        ragged_ssd(x, dt, A, B, C, state, _meta(cu, kv_lens, None))
