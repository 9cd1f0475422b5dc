"""The state layers' ragged ops (kernels_pallas/recurrent/) against a naive per-sequence, per-token loop over random
ragged batches: several chunk sizes, sequences that start mid-block and with context in their slots, padding rows
on the null slot, per-position state writes."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.recurrent.conv import ragged_causal_conv1d
from kernels_pallas.recurrent.gated_delta_rule import ragged_gated_delta_rule
from kernels_pallas.recurrent.ordered_sum import ordered_sum

NUM_SLOTS = 8


def ragged_meta(rng, q_lens, num_tokens, padded_seqs, spec_width=None):
    """AttentionMetadata's state fields as the runner builds them (inference/runtime/batch.py): padding tokens
    belong to the first padded sequence, padded sequences have slot 0 and no context."""
    n = len(q_lens)
    cu = np.full(padded_seqs + 1, num_tokens, np.int32)
    cu[:n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    context = rng.integers(0, 3, n) * rng.integers(1, 9, n)  # some fresh (0), some with context
    kv_lens = np.zeros(padded_seqs, np.int32)
    kv_lens[:n] = context + np.asarray(q_lens)
    slots = np.zeros(padded_seqs, np.int32)
    slots[:n] = rng.permutation(np.arange(1, NUM_SLOTS))[:n]
    meta = SimpleNamespace(cu_q_lens=jnp.asarray(cu), kv_lens=jnp.asarray(kv_lens), state_slots=jnp.asarray(slots),
                           num_seqs=jnp.asarray([n], jnp.int32), max_q_len=int(max(q_lens)), state_spec_slots=None)
    if spec_width is not None:
        spec = np.full((padded_seqs, spec_width), -1, np.int32)
        free = [s for s in range(1, NUM_SLOTS) if s not in slots[:n]]
        for s in range(n):  # the free slots go to the first positions of the sequences, in order
            for j in range(spec_width):
                if free and rng.random() < 0.7:
                    spec[s, j] = free.pop()
        meta.state_spec_slots = jnp.asarray(spec)
    return meta, cu, context, slots


def naive_gdr(q, k, v, g, beta, state, cu, context, slots, n):
    hk, dk = q.shape[1:]
    hv = v.shape[1]
    out = np.zeros(v.shape, np.float64)
    new = state.astype(np.float64).copy()
    per_token = {}
    q = np.repeat(q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6), hv // hk, 1) * dk ** -0.5
    k = np.repeat(k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6), hv // hk, 1)
    for s in range(n):
        h = state[slots[s]].astype(np.float64) if context[s] else np.zeros(state.shape[1:])
        for t in range(cu[s], cu[s + 1]):
            h = h * np.exp(g[t])[:, None, None]
            delta = (v[t] - np.einsum("hkv,hk->hv", h, k[t])) * beta[t][:, None]
            h = h + k[t][:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hkv,hk->hv", h, q[t])
            per_token[t] = h.copy()
        new[slots[s]] = h
    return out, new, per_token


def naive_conv(x, w, conv_state, cu, context, slots, n):
    taps = w.shape[1]
    y = np.zeros(x.shape, np.float64)
    new = conv_state.astype(np.float64).copy()
    per_token = {}
    for s in range(n):
        hist = conv_state[slots[s]].astype(np.float64) if context[s] else np.zeros((x.shape[1], taps - 1))
        for t in range(cu[s], cu[s + 1]):
            window = np.concatenate([hist, x[t][:, None]], axis=1)
            y[t] = (window * w).sum(1)
            hist = window[:, 1:]
            per_token[t] = hist
        new[slots[s]] = hist
    return y, new, per_token


def random_batch(seed, q_lens, pad_tokens=3, pad_seqs=2, hk=2, hv=4, dk=8, dv=6):
    rng = np.random.default_rng(seed)
    t = sum(q_lens) + pad_tokens
    meta, cu, context, slots = ragged_meta(rng, q_lens, t, len(q_lens) + pad_seqs)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, k, v = f(t, hk, dk), f(t, hk, dk), f(t, hv, dv)
    g = -np.exp(f(t, hv)) * 0.3
    beta = 1 / (1 + np.exp(-f(t, hv)))
    state = f(NUM_SLOTS, hv, dk, dv)
    return rng, meta, cu, context, slots, (q, k, v, g, beta, state)


CASES = [[1, 1, 1], [7, 1, 12, 3], [16, 9, 1, 17, 2]]


@pytest.mark.parametrize("q_lens", CASES)
@pytest.mark.parametrize("mode,chunk", [("recurrent", 64), ("invariant", 64), ("chunked", 4), ("chunked", 8)])
def test_gated_delta_rule_matches_the_naive_loop(q_lens, mode, chunk):
    _, meta, cu, context, slots, args = random_batch(len(q_lens) * 7 + chunk, q_lens)
    run = jax.jit(lambda *a: ragged_gated_delta_rule(*a, meta, chunk_size=chunk, mode=mode))
    out, new = run(*map(jnp.asarray, args))
    want_out, want_state, _ = naive_gdr(*args, cu, context, slots, len(q_lens))
    np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-5, rtol=1e-4)
    real = slots[:len(q_lens)]
    np.testing.assert_allclose(np.asarray(new)[real], want_state[real], atol=2e-5, rtol=1e-4)
    untouched = [s for s in range(1, NUM_SLOTS) if s not in real]
    np.testing.assert_array_equal(np.asarray(new)[untouched], args[-1][untouched])
    assert not np.asarray(out)[cu[len(q_lens)]:].any()  # padding tokens give zeros


def test_chunked_and_recurrent_agree_on_one_long_sequence_across_blocks():
    _, meta, *_, args = random_batch(3, [37, 2], pad_tokens=0, pad_seqs=0)
    outs = [jax.jit(lambda *a, m=m: ragged_gated_delta_rule(*a, meta, chunk_size=16, mode=m))(*map(jnp.asarray, args))
            for m in ("chunked", "recurrent")]
    np.testing.assert_allclose(np.asarray(outs[0][0]), np.asarray(outs[1][0]), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(outs[0][1]), np.asarray(outs[1][1]), atol=2e-5, rtol=1e-4)


def test_recurrent_form_writes_per_position_states():
    rng = np.random.default_rng(5)
    q_lens = [3, 3, 1]
    _, _, _, _, _, args = random_batch(5, q_lens, pad_tokens=1)
    meta, cu, context, slots = ragged_meta(rng, q_lens, sum(q_lens) + 1, len(q_lens) + 2, spec_width=3)
    out, new = jax.jit(lambda *a: ragged_gated_delta_rule(*a, meta, mode="recurrent"))(*map(jnp.asarray, args))
    _, _, per_token = naive_gdr(*args, cu, context, slots, len(q_lens))
    spec = np.asarray(meta.state_spec_slots)
    written = 0
    for s in range(len(q_lens)):
        for j in range(q_lens[s]):
            if spec[s, j] >= 0:
                np.testing.assert_allclose(np.asarray(new)[spec[s, j]], per_token[cu[s] + j], atol=2e-5, rtol=1e-4)
                written += 1
    assert written >= 2
    with pytest.raises(ValueError, match="mode='recurrent' or 'invariant'"):
        ragged_gated_delta_rule(*map(jnp.asarray, args), meta, mode="chunked")


@pytest.mark.parametrize("q_lens", CASES)
@pytest.mark.parametrize("taps", [2, 4])
def test_causal_conv1d_matches_the_naive_loop(q_lens, taps):
    rng, meta, cu, context, slots, _ = random_batch(len(q_lens) + taps, q_lens)
    t, c = int(cu[-1]), 5
    x = rng.standard_normal((t, c)).astype(np.float32)
    w = rng.standard_normal((c, taps)).astype(np.float32)
    conv_state = rng.standard_normal((NUM_SLOTS, c, taps - 1)).astype(np.float32)
    y, new = jax.jit(lambda *a: ragged_causal_conv1d(a[0], a[1], None, a[2], meta))(x, w, conv_state)
    want_y, want_state, _ = naive_conv(x, w, conv_state, cu, context, slots, len(q_lens))
    np.testing.assert_allclose(np.asarray(y), want_y, atol=1e-5, rtol=1e-5)
    real = slots[:len(q_lens)]
    np.testing.assert_allclose(np.asarray(new)[real], want_state[real], atol=1e-6)


def test_causal_conv1d_writes_per_position_states():
    rng = np.random.default_rng(11)
    q_lens = [4, 2]
    meta, cu, context, slots = ragged_meta(rng, q_lens, 6, 3, spec_width=4)
    x = rng.standard_normal((6, 3)).astype(np.float32)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    conv_state = rng.standard_normal((NUM_SLOTS, 3, 3)).astype(np.float32)
    _, new = ragged_causal_conv1d(jnp.asarray(x), jnp.asarray(w), None, jnp.asarray(conv_state), meta)
    _, _, per_token = naive_conv(x, w, conv_state, cu, context, slots, 2)
    spec = np.asarray(meta.state_spec_slots)
    checked = [(s, j) for s in range(2) for j in range(q_lens[s]) if spec[s, j] >= 0]
    assert checked
    for s, j in checked:
        np.testing.assert_allclose(np.asarray(new)[spec[s, j]], per_token[cu[s] + j], atol=1e-6)


@pytest.mark.parametrize("axis,size", [(0, 64), (1, 16), (1, 5), (-1, 24), (-1, 1)])
def test_ordered_sum_is_the_pairwise_tree_at_every_shape(axis, size):
    """The same bits as numpy's float32 adds of the halves (the axis zero-padded to a power of two), whatever the
    other dimensions (1 to 64 rows), where a reduce's bits change with them on XLA:CPU."""
    rng = np.random.default_rng(4)
    run = jax.jit(lambda a: ordered_sum(a, axis))
    for rows in (1, 2, 5, 8, 64):
        shape = [size, rows, 24] if axis == 0 else [rows, 16, 24]
        shape[axis] = size
        x = rng.standard_normal(shape).astype(np.float32) * 100
        want = np.moveaxis(x, axis, 0)
        want = np.concatenate([want, np.zeros(((1 << (size - 1).bit_length()) - size,) + want.shape[1:], np.float32)])
        while len(want) > 1:
            want = want[:len(want) // 2] + want[len(want) // 2:]
        np.testing.assert_array_equal(np.asarray(run(x)), want[0])


def fresh_meta(q_lens, pad_seqs=0):
    """Sequences with no context in slots 1, 2, ... and `pad_seqs` padding sequences (the padding tokens past the
    real ones belong to none)."""
    n, real = len(q_lens), sum(q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens), [real] * pad_seqs]).astype(np.int32)
    kv = np.array(list(q_lens) + [0] * pad_seqs, np.int32)
    slots = np.array(list(range(1, n + 1)) + [0] * pad_seqs, np.int32)
    return SimpleNamespace(cu_q_lens=jnp.asarray(cu), kv_lens=jnp.asarray(kv), state_slots=jnp.asarray(slots),
                           num_seqs=jnp.asarray([n], jnp.int32), max_q_len=int(max(q_lens)), state_spec_slots=None)


def test_invariant_forms_give_a_sequence_the_same_bits_alone_batched_and_split():
    """Batch-invariant mode's contract at the ops: sequence 0's conv and gated-delta-rule outputs and final states
    are the same bits alone, batched with seven others (padding tokens and sequences included), and fed in two
    steps through its slot. The recurrent form's reduces vectorize by the shape on XLA:CPU, so its bits differ
    between these in the last place (kernels_pallas/recurrent/ordered_sum.py)."""
    rng = np.random.default_rng(12)
    hk, hv, dk, dv, taps = 2, 4, 16, 16, 4
    lens = [13, 5, 9, 1, 11, 7, 3, 8]
    seqs = [(rng.standard_normal((n, hk, dk)), rng.standard_normal((n, hk, dk)), rng.standard_normal((n, hv, dv)),
             -np.exp(rng.standard_normal((n, hv))) * 0.3, 1 / (1 + np.exp(-rng.standard_normal((n, hv)))),
             rng.standard_normal((n, hk * dk))) for n in lens]
    w = rng.standard_normal((hk * dk, taps)).astype(np.float32)

    def run(q, k, v, g, beta, x, ssm, conv, meta):
        y, conv = ragged_causal_conv1d(x, w, None, conv, meta)
        out, ssm = ragged_gated_delta_rule(q, k, v, g, beta, ssm, meta, mode="invariant")
        return y, out, ssm, conv

    def step(parts, meta, ssm, conv, pad_tokens):
        arrays = [np.concatenate([p[i] for p in parts]).astype(np.float32) for i in range(6)]
        arrays = [np.pad(a, [(0, pad_tokens)] + [(0, 0)] * (a.ndim - 1)) for a in arrays]
        return jax.jit(lambda *a: run(*a, meta))(*map(jnp.asarray, arrays), ssm, conv)

    ssm0, conv0 = jnp.zeros((NUM_SLOTS + 4, hv, dk, dv)), jnp.zeros((NUM_SLOTS + 4, hk * dk, taps - 1))
    alone = step(seqs[:1], fresh_meta(lens[:1]), ssm0, conv0, 0)
    batched = step(seqs, fresh_meta(lens, pad_seqs=2), ssm0, conv0, 5)
    first = step([[a[:6] for a in seqs[0]]], fresh_meta([6]), ssm0, conv0, 0)
    rest = fresh_meta([7])
    rest.kv_lens = jnp.asarray([13], jnp.int32)  # six tokens of context: its state comes from slot 1
    second = step([[a[6:] for a in seqs[0]]], rest, first[2], first[3], 0)
    n = lens[0]
    for got in (batched, (np.concatenate([first[0], second[0]]), np.concatenate([first[1], second[1]]),
                          second[2], second[3])):
        np.testing.assert_array_equal(np.asarray(got[0])[:n], np.asarray(alone[0]))  # the conv's outputs
        np.testing.assert_array_equal(np.asarray(got[1])[:n], np.asarray(alone[1]))  # the rule's outputs
        np.testing.assert_array_equal(np.asarray(got[2])[1], np.asarray(alone[2])[1])  # the state in slot 1
        np.testing.assert_array_equal(np.asarray(got[3])[1], np.asarray(alone[3])[1])  # the conv state


def test_bad_inputs_name_the_problem():
    _, meta, *_, args = random_batch(0, [3])
    q, k, v, g, beta, state = map(jnp.asarray, args)
    with pytest.raises(ValueError, match="float32"):
        ragged_gated_delta_rule(q, k, v, g, beta, state.astype(jnp.bfloat16), meta)
    with pytest.raises(ValueError, match="unknown mode"):
        ragged_gated_delta_rule(q, k, v, g, beta, state, meta, mode="fast")
    with pytest.raises(ValueError, match="state_slots"):
        ragged_gated_delta_rule(q, k, v, g, beta, state, SimpleNamespace(**{**vars(meta), "state_slots": None}))
    with pytest.raises(ValueError, match="conv_state must be"):
        ragged_causal_conv1d(q.reshape(q.shape[0], -1), jnp.ones((16, 4)), None, jnp.zeros((8, 16, 2)), meta)
