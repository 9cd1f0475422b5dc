"""Speculative decoding: exactness of `rejection_sample` (statistically), its greedy limit, padding/counts, and the
n-gram proposer.

Statistical tests use fixed seeds, so they are deterministic. Each draws >= 200,000 verification steps (vmap over
keys) and checks, with a chi-square test at alpha = 1e-3 (critical values from scipy, a dependency of jax itself):
the first emitted token ~ q_0; for later positions, the emitted token at position i given that the first i drafts
were accepted ~ q_i (the synthetic target's distributions do not depend on the prefix, so this is what "exactly the
target's distribution" means here); the accepted mass at each token equals min(p, q) within 5 standard errors; and
the number accepted follows prod(alpha). Negative controls run the same chi-square on a wrong sampler (the draft
itself; "on rejection resample from q") and must reject it, so the tests have power at this sample size.

Notation as in the lecture: q = target, p = draft.
"""

from __future__ import annotations

import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from inference.sampling import sampler as S
from inference.sampling.params import SamplingParams
from inference.sampling.rejection import probs_from_logits, rejection_sample
from inference.spec_decode.ngram import NgramProposer, PromptLookupProposer
from inference.engine.config import check_num_drafts
from inference.spec_decode.proposer import DraftModelProposer, DraftProposal, Proposer

N_DRAWS = 200_000
ALPHA = 1e-3

# Compiles dominate this file's run time on a 2-core CPU (~2 s each), so everything is jitted and the tests share a
# few shapes: the statistical tests use _draws at (k=1, V=8), (k=3, V=50), (k=5, V=23); the unit tests use one
# [US, UK, UV] batch through `_rs`, which always passes greedy / num_draft as arrays (the None defaults are covered
# by the statistical harness).
US, UK, UV = 8, 4, 16
_rs_jit = jax.jit(rejection_sample)
_probs = jax.jit(probs_from_logits, static_argnums=2)


def _rs(q, p, drafts, key, *, greedy=None, num_draft=None) -> tuple[np.ndarray, np.ndarray]:
    s, k = np.shape(drafts)
    greedy = np.zeros(s, bool) if greedy is None else np.asarray(greedy, bool)
    num_draft = np.full(s, k, np.int32) if num_draft is None else np.asarray(num_draft, np.int32)
    e, n = _rs_jit(q, p, drafts, key, greedy=greedy, num_draft=num_draft)
    return np.asarray(e), np.asarray(n)


# ---------------------------------------------------------------------------------------------------------------
# Harness


@jax.jit
def _draws(q: jax.Array, p: jax.Array, draft_tokens: jax.Array, keys: jax.Array):
    """N independent verifications of one row: q [k+1, V], p [k, V], draft_tokens [N, k], keys [N]."""
    one = lambda kk, dt: rejection_sample(q[None], p[None], dt[None], kk)  # noqa: E731
    e, n = jax.vmap(one)(keys, draft_tokens)
    return e[:, 0], n[:, 0]


@jax.jit
def _draws_deterministic(q: jax.Array, draft_tokens: jax.Array, keys: jax.Array):
    """As `_draws` with draft_probs=None (one-hot drafts, e.g. n-gram proposals)."""
    one = lambda kk, dt: rejection_sample(q[None], None, dt[None], kk)  # noqa: E731
    e, n = jax.vmap(one)(keys, draft_tokens)
    return e[:, 0], n[:, 0]


def _sample_rows(rng: np.random.Generator, probs: np.ndarray, n: int) -> np.ndarray:
    """n i.i.d. draws from each row of probs [k, V] by inverse CDF in float64: int32[n, k]."""
    probs = np.asarray(probs, np.float64)
    out = np.empty((n, probs.shape[0]), np.int32)
    for i, row in enumerate(probs):
        cdf = np.cumsum(row)
        # side="right": a zero-probability token (cdf[j] == cdf[j-1]) can never be returned.
        out[:, i] = np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"), len(row) - 1)
    return out


def _run_draws(q: np.ndarray, p: np.ndarray, drafts: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    e, n = _draws(jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32), drafts, _keys(seed, len(drafts)))
    return np.asarray(e), np.asarray(n)


def _pad_vocab(x: np.ndarray, v: int) -> np.ndarray:
    """Zero-probability padding of the last axis to v tokens (lets small examples share a compiled shape; the padded
    tokens must then never be emitted, which `_chi2` checks)."""
    return np.concatenate([x, np.zeros(x.shape[:-1] + (v - x.shape[-1],))], axis=-1)


def _keys(seed: int, n: int) -> jax.Array:
    return jax.random.split(jax.random.key(seed), n)


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(statistic, critical value at ALPHA) of observed counts against probs; cells with expected < 5 are pooled.

    A count in a zero-probability cell makes the statistic inf (the sampler emitted an impossible token)."""
    counts = np.asarray(counts, np.float64)
    probs = np.asarray(probs, np.float64)
    probs = probs / probs.sum()
    total = counts.sum()
    if np.any(counts[probs == 0] > 0):
        return float("inf"), 0.0
    exp = total * probs
    big = exp >= 5
    obs_c = list(counts[big])
    exp_c = list(exp[big])
    if np.any(~big & (probs > 0)):
        obs_c.append(counts[~big].sum())
        exp_c.append(exp[~big].sum())
    obs_c, exp_c = np.array(obs_c), np.array(exp_c)
    stat = float(np.sum((obs_c - exp_c) ** 2 / exp_c))
    df = len(obs_c) - 1
    if df == 0:
        return stat, float("inf")
    return stat, float(stats.chi2.ppf(1 - ALPHA, df))


def _assert_dist(tokens: np.ndarray, probs: np.ndarray, what: str) -> None:
    counts = np.bincount(tokens, minlength=len(probs))
    assert len(counts) == len(probs), f"{what}: token id out of range"
    stat, crit = _chi2(counts, probs)
    assert stat < crit, f"{what}: chi2 {stat:.2f} >= {crit:.2f} (n={len(tokens)})"


def _rejects(tokens: np.ndarray, probs: np.ndarray) -> bool:
    stat, crit = _chi2(np.bincount(tokens, minlength=len(probs)), probs)
    return stat >= crit


def _assert_mass(hits: np.ndarray, total: int, expected: np.ndarray, what: str) -> None:
    """hits[t] / total vs expected[t] per token, within 5 binomial standard errors (plus 1 count for rounding)."""
    freq = hits / total
    se = np.sqrt(expected * (1 - expected) / total)
    bad = np.abs(freq - expected) > 5 * se + 1.0 / total
    assert not bad.any(), f"{what}: tokens {np.flatnonzero(bad)} freq {freq[bad]} vs {expected[bad]}"


def _check_exact(q: np.ndarray, p: np.ndarray, emitted: np.ndarray, n: np.ndarray, label: str) -> None:
    """All exactness checks for N draws of one (q [k+1, V], p [k, V]) pair."""
    q = np.asarray(q, np.float64)
    p = np.asarray(p, np.float64)
    q /= q.sum(-1, keepdims=True)
    p /= p.sum(-1, keepdims=True)
    k, v = p.shape
    total = len(n)
    assert emitted.shape == (total, k + 1)
    # Structure: n accepted drafts, then one token, then -1 padding.
    pos = np.arange(k + 1)[None]
    assert np.all((emitted >= 0) == (pos <= n[:, None])), f"{label}: padding"
    # Number accepted: P(n = j) = prod_{i<j} alpha_i * (1 - alpha_j), alpha_i = sum(min(p_i, q_i)).
    alpha = np.minimum(p, q[:k]).sum(-1)
    pn = np.array([np.prod(alpha[:j]) * (1 - alpha[j]) for j in range(k)] + [np.prod(alpha)])
    _assert_dist(n, pn, f"{label}: num_accepted")
    for i in range(k + 1):
        reached = n >= i
        m = int(reached.sum())
        if m < 50 * v:  # too few draws reach this position for a meaningful test
            continue
        _assert_dist(emitted[reached, i], q[i], f"{label}: token {i} given {i} accepted")
        if i < k:
            acc = emitted[reached & (n > i), i]
            _assert_mass(np.bincount(acc, minlength=v), m, np.minimum(p[i], q[i]), f"{label}: accepted mass at {i}")


def _mix(rng: np.random.Generator, v: int) -> np.ndarray:
    """A random distribution over v tokens, kept away from 0 (>= 0.3 / v) so every cell has expected counts."""
    return 0.7 * rng.dirichlet(np.ones(v)) + 0.3 / v


# ---------------------------------------------------------------------------------------------------------------
# Exactness


LECTURE_P = np.array([0.8, 0.2])  # draft
LECTURE_Q = np.array([0.5, 0.5])  # target


def _broken_resample_from_q(rng: np.random.Generator, q: np.ndarray, p: np.ndarray, n: int) -> np.ndarray:
    """First emitted token under a classic bug: accept with min(1, q/p), but on rejection draw from q, not (q-p)+."""
    x = _sample_rows(rng, p[None], n)[:, 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(p[x] > 0, q[x] / p[x], 1.0)
    accept = rng.random(n) < np.minimum(1.0, ratio)
    return np.where(accept, x, _sample_rows(rng, q[None], n)[:, 0])


def test_lecture_example_first_token_and_accepted_mass():
    """p = (0.8, 0.2), q = (0.5, 0.5), k = 1 (vocabulary zero-padded to 8 to share a compiled shape)."""
    rng = np.random.default_rng(0)
    q = _pad_vocab(np.stack([LECTURE_Q, LECTURE_Q]), 8)
    p = _pad_vocab(LECTURE_P[None], 8)
    drafts = _sample_rows(rng, p, N_DRAWS)
    emitted, n = _run_draws(q, p, drafts, 0)
    _check_exact(q, p, emitted, n, "lecture k=1")
    # Spelled out: accepted mass min(p, q) = (0.5, 0.2), acceptance rate 0.7; first token ~ (0.5, 0.5).
    _assert_mass(np.bincount(emitted[n == 1, 0], minlength=2), N_DRAWS, np.array([0.5, 0.2]), "lecture mass")
    _assert_dist(emitted[:, 0], LECTURE_Q, "lecture first token")

    # Negative controls: the same test rejects the draft itself and the resample-from-q bug (which gives 0.65/0.35).
    assert _rejects(drafts[:, 0], LECTURE_Q)
    assert _rejects(_broken_resample_from_q(rng, LECTURE_Q, LECTURE_P, N_DRAWS), LECTURE_Q)
    # ...and a correct reference sampler passes it (the test is not trivially rejecting).
    assert not _rejects(_sample_rows(rng, LECTURE_Q[None], N_DRAWS)[:, 0], LECTURE_Q)


def test_lecture_example_token_stream_joint():
    """k = 3 with identical rows: the emitted stream is i.i.d. q, so its first two tokens ~ q x q (4 cells).

    The stream is one verification call's emitted tokens followed by a second, independent call's (a call emits at
    least one token), so pairs inside one call (accepted draft followed by the next) and across calls both occur.
    Vocabulary zero-padded to 50 to share a compiled shape."""
    k = 3
    rng = np.random.default_rng(1)
    q = _pad_vocab(np.tile(LECTURE_Q, (k + 1, 1)), 50)
    p = _pad_vocab(np.tile(LECTURE_P, (k, 1)), 50)
    e1, n1 = _run_draws(q, p, _sample_rows(rng, p, N_DRAWS), 1)
    e2, _ = _run_draws(q, p, _sample_rows(rng, p, N_DRAWS), 2)
    _check_exact(q, p, e1, n1, "lecture k=3")
    second = np.where(n1 >= 1, e1[:, 1], e2[:, 0])
    assert (n1 >= 1).mean() > 0.6  # most pairs come from inside one call
    _assert_dist(e1[:, 0] * 2 + second, np.outer(LECTURE_Q, LECTURE_Q).ravel(), "lecture joint of first two")


FILTER_PARAMS = [
    SamplingParams(temperature=1.2, top_k=12, top_p=0.95, min_p=0.02),  # the row the statistical test uses
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.6, top_p=0.7),
]


def _filter_tensors() -> S.SamplingTensors:
    return S.SamplingTensors.from_params(FILTER_PARAMS, [0, 1, 2], [0, 0, 0], pad_to=len(FILTER_PARAMS))


def _filtered_case(rng: np.random.Generator, v: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """q, p from random target / draft logits through the sampler's temperature + min-p/top-k/top-p (row 0)."""
    t = _filter_tensors()
    tl = rng.normal(size=(len(FILTER_PARAMS), k + 1, v)).astype(np.float32)
    dl = tl[:, :k] + rng.normal(size=(len(FILTER_PARAMS), k, v)).astype(np.float32)
    q = np.asarray(_probs(tl, t, True))[0]
    p = np.asarray(_probs(dl, t, True))[0]
    assert (q == 0).any() and (p == 0).any()  # the filters really removed tokens ...
    assert np.all((q > 0).sum(-1) >= 5) and np.all((p > 0).sum(-1) >= 5)  # ... and left something to test
    return q, p


@pytest.mark.parametrize(
    "v,k,filtered",
    [(8, 1, False), (50, 3, False), (23, 5, False), (50, 3, True)],
    ids=["V8-k1", "V50-k3", "V23-k5", "V50-k3-filtered"],
)
def test_random_distributions_exact(v: int, k: int, filtered: bool):
    rng = np.random.default_rng(100 + v + k + filtered)
    if filtered:
        q, p = _filtered_case(rng, v, k)
    else:
        q = np.stack([_mix(rng, v) for _ in range(k + 1)])
        p = np.stack([_mix(rng, v) for _ in range(k)])
    drafts = _sample_rows(rng, p, N_DRAWS)
    emitted, n = _run_draws(q, p, drafts, v * 10 + k + filtered)
    _check_exact(q, p, emitted, n, f"V={v} k={k} filtered={filtered}")
    # Power at this sample size for these very distributions: the draft and the resample-from-q bug are rejected.
    qn = q[0] / q[0].sum()
    pn = p[0] / p[0].sum()
    assert _rejects(drafts[:, 0], qn)
    assert _rejects(_broken_resample_from_q(rng, qn, pn, N_DRAWS), qn)


def test_deterministic_drafts_exact():
    """draft_probs=None (n-gram proposals): any fixed proposal, output still ~ q; accepted mass at x is q(x)."""
    v, k = 10, 3
    rng = np.random.default_rng(7)
    q = np.stack([_mix(rng, v) for _ in range(k + 1)])
    drafts = np.tile(np.array([[3, 3, 0]], np.int32), (N_DRAWS, 1))
    emitted, n = map(np.asarray, _draws_deterministic(jnp.asarray(q, jnp.float32), drafts, _keys(7, N_DRAWS)))
    p = np.zeros((k, v))
    p[np.arange(k), drafts[0]] = 1.0
    _check_exact(q, p, emitted, n, "one-hot drafts")
    assert abs((n >= 1).mean() - q[0, 3]) < 5 * np.sqrt(q[0, 3] * (1 - q[0, 3]) / N_DRAWS)


def test_zero_residual_falls_back_to_q():
    """A rejected draft token with q == p (Z = 0): the token comes from q, never NaN / -1 / the impossible token."""
    q = _pad_vocab(np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]), 8)
    p = q[:1].copy()
    drafts = np.full((N_DRAWS, 1), 2, np.int32)  # impossible under both: always rejected, residual (q - p)+ = 0
    emitted, n = _run_draws(q, p, drafts, 3)
    assert np.all(n == 0) and np.all(emitted[:, 1] == -1)
    _assert_dist(emitted[:, 0], q[0], "Z=0 fallback")


# ---------------------------------------------------------------------------------------------------------------
# Greedy, padding, counts, edge cases (one [US, UK, UV] shape)


def _peaked(rng: np.random.Generator, s: int = US, t: int = UK + 1, v: int = UV) -> tuple[np.ndarray, np.ndarray]:
    """Random probs [s, t, v] with a unique argmax per position, and that argmax."""
    probs = rng.dirichlet(np.ones(v), size=(s, t))
    am = probs.argmax(-1)
    np.put_along_axis(probs, am[..., None], 2.0, axis=-1)
    return (probs / probs.sum(-1, keepdims=True)).astype(np.float32), am.astype(np.int32)


def _draft_probs(rng: np.random.Generator) -> np.ndarray:
    return rng.dirichlet(np.ones(UV), size=(US, UK)).astype(np.float32)


def test_one_hot_draft_probs_match_none():
    """Explicit one-hot draft_probs and draft_probs=None are the same rule, so with the same keys the same output."""
    rng = np.random.default_rng(8)
    q = rng.dirichlet(np.ones(UV), size=(US, UK + 1)).astype(np.float32)
    drafts = rng.integers(0, UV, size=(US, UK)).astype(np.int32)
    for seed in range(3):
        a = _rs(q, np.asarray(jax.nn.one_hot(drafts, UV)), drafts, jax.random.key(seed))
        b = _rs(q, None, drafts, jax.random.key(seed))
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


def test_greedy_accepts_iff_argmax_and_emits_argmax():
    rng = np.random.default_rng(11)
    q, am = _peaked(rng)
    p = _draft_probs(rng)
    first_wrong = np.array([0, 1, 2, 3, 4, 4, 2, 0])  # UK = 4: all accepted
    drafts = am[:, :UK].copy()
    for r, j in enumerate(first_wrong):
        if j < UK:
            drafts[r, j] = (am[r, j] + 1) % UV  # later matches (kept) must not count after a mismatch
    greedy = np.ones(US, bool)
    outs = [_rs(q, p, drafts, jax.random.key(seed), greedy=greedy) for seed in (0, 1)]
    for emitted, n in outs:
        np.testing.assert_array_equal(n, first_wrong)
        for r, j in enumerate(first_wrong):
            expect = list(drafts[r, :j]) + [am[r, j]] + [-1] * (UK - j)
            assert emitted[r].tolist() == expect, (r, emitted[r], expect)
    np.testing.assert_array_equal(outs[0][0], outs[1][0])  # no randomness in greedy rows


def test_greedy_is_the_temperature_zero_limit():
    """One-hot targets through the sampling rule give exactly the greedy rule's output (and use no randomness)."""
    rng = np.random.default_rng(12)
    for _ in range(3):
        q, am = _peaked(rng)
        q_hot = np.asarray(jax.nn.one_hot(am, UV), np.float32)
        drafts = np.where(rng.random((US, UK)) < 0.7, am[:, :UK], rng.integers(0, UV, (US, UK))).astype(np.int32)
        p = _draft_probs(rng)
        g = _rs(q, p, drafts, jax.random.key(0), greedy=np.ones(US, bool))
        for seed in (1, 2):
            h = _rs(q_hot, p, drafts, jax.random.key(seed))
            np.testing.assert_array_equal(g[0], h[0])
            np.testing.assert_array_equal(g[1], h[1])


def test_mixed_batch_greedy_rows_unaffected():
    rng = np.random.default_rng(13)
    q, am = _peaked(rng)
    p = _draft_probs(rng)
    drafts = am[:, :UK].copy()
    greedy = np.arange(US) % 2 == 0
    a = _rs(q, p, drafts, jax.random.key(0), greedy=greedy)
    b = _rs(q, p, drafts, jax.random.key(5), greedy=greedy)
    np.testing.assert_array_equal(a[0][greedy], b[0][greedy])
    assert np.all(a[1][greedy] == UK)
    np.testing.assert_array_equal(a[0][greedy, UK], am[greedy, UK])  # bonus = argmax at position k


def test_all_accepted_bonus_from_position_k():
    """q == p exactly: every draft is accepted (u * p < p), and the bonus comes from target position k."""
    rng = np.random.default_rng(14)
    rows = rng.dirichlet(np.ones(UV), size=(US, UK)).astype(np.float32)
    q = np.concatenate([rows, np.asarray(jax.nn.one_hot(np.full((US, 1), 3), UV), np.float32)], axis=1)
    for seed in range(20):
        drafts = np.stack([_sample_rows(rng, rows[r], 1)[0] for r in range(US)])
        emitted, n = _rs(q, rows, drafts, jax.random.key(seed))
        assert np.all(n == UK)
        np.testing.assert_array_equal(emitted[:, :UK], drafts)
        assert np.all(emitted[:, UK] == 3)  # only token 3 is possible at position k


def test_num_draft_padding_and_count():
    """Rows with fewer real drafts use only those; the bonus comes from target position num_draft; -1 after it."""
    num_draft = np.array([0, 1, 2, 4, 3, 0, 4, 1])
    q = np.zeros((US, UK + 1, UV), np.float32)
    q[:, :, 0] = 1.0  # the target only ever wants token 0 ...
    for r, d in enumerate(num_draft):
        q[r, d] = np.eye(UV, dtype=np.float32)[d + 1]  # ... except at the row's bonus position: token d + 1
    drafts = np.zeros((US, UK), np.int32)
    drafts[np.arange(UK)[None] >= num_draft[:, None]] = -1  # padding ids beyond num_draft
    p = np.asarray(jax.nn.one_hot(np.maximum(drafts, 0), UV), np.float32)
    for greedy in (np.ones(US, bool), np.zeros(US, bool), np.arange(US) % 3 == 0):
        emitted, n = _rs(q, p, drafts, jax.random.key(0), greedy=greedy, num_draft=num_draft)
        np.testing.assert_array_equal(n, num_draft)
        for r, d in enumerate(num_draft):
            assert emitted[r].tolist() == [0] * d + [d + 1] + [-1] * (UK - d)


def test_unnormalised_inputs_are_renormalised():
    rng = np.random.default_rng(15)
    q = rng.dirichlet(np.ones(UV), size=(US, UK + 1)).astype(np.float32)
    p = _draft_probs(rng)
    drafts = rng.integers(0, UV, (US, UK)).astype(np.int32)
    for seed in range(3):
        a = _rs(q, p, drafts, jax.random.key(seed))
        b = _rs(q * 4.0, p * 0.5, drafts, jax.random.key(seed))  # powers of 2: the renormalised values are equal
        np.testing.assert_array_equal(a[0], b[0])


def test_per_row_keys_make_rows_independent_of_the_batch():
    """With per-row keys (raw u32[S, 2] from the sampler's (seed, step) keys), a row's result does not depend on
    which other rows share the batch or where it sits."""
    rng = np.random.default_rng(16)
    q = rng.dirichlet(np.ones(UV) * 0.3, size=(US, UK + 1)).astype(np.float32)
    p = rng.dirichlet(np.ones(UV) * 0.3, size=(US, UK)).astype(np.float32)
    drafts = np.stack([_sample_rows(rng, p[r], 1)[0] for r in range(US)])
    params = [SamplingParams(temperature=1.0)] * US
    keys = np.asarray(S.SamplingTensors.from_params(params, list(range(US)), [5] * US, pad_to=US).keys())
    e, n = _rs(q, p, drafts, keys)
    # Permute the batch and replace half of it by unrelated rows: the kept rows' results are unchanged.
    perm = rng.permutation(US)
    keep = perm[: US // 2]
    q2, p2, d2, k2 = q[perm], p[perm], drafts[perm], keys[perm]
    q2[US // 2 :] = rng.dirichlet(np.ones(UV), size=(US - US // 2, UK + 1))
    d2[US // 2 :] = 0
    k2[US // 2 :] = 12345
    e2, n2 = _rs(q2, p2, d2, k2)
    np.testing.assert_array_equal(e[keep], e2[: US // 2])
    np.testing.assert_array_equal(n[keep], n2[: US // 2])
    assert len({tuple(r) for r in e}) > 1  # rows really differ
    typed = jax.random.wrap_key_data(keys, impl="threefry2x32")
    np.testing.assert_array_equal(_rs(q, p, drafts, typed)[0], e)


def test_shapes_and_validation():
    q = np.full((US, UK + 1, UV), 1.0 / UV, np.float32)
    p = np.full((US, UK, UV), 1.0 / UV, np.float32)
    d = np.zeros((US, UK), np.int32)
    emitted, n = _rs_jit(q, p, d, jax.random.key(0), greedy=np.ones(US, bool), num_draft=np.full(US, 2))
    assert emitted.shape == (US, UK + 1) and emitted.dtype == jnp.int32
    assert n.shape == (US,) and n.dtype == jnp.int32
    with pytest.raises(ValueError):
        _rs_jit(q, p, np.zeros((US, UK + 1), np.int32), jax.random.key(0))
    with pytest.raises(ValueError):
        _rs_jit(q, p, d, jax.random.split(jax.random.key(0), US + 1))


def test_k_zero_is_plain_sampling():
    s, v = 4000, 4
    q = np.tile(np.array([[[0.1, 0.2, 0.3, 0.4]]], np.float32), (s, 1, 1))
    emitted, n = map(np.asarray, _rs_jit(q, np.zeros((s, 0, v), np.float32), np.zeros((s, 0), np.int32),
                                         jax.random.key(0)))
    assert emitted.shape == (s, 1) and np.all(n == 0)
    _assert_dist(emitted[:, 0], q[0, 0], "k=0")


# ---------------------------------------------------------------------------------------------------------------
# probs_from_logits


def test_probs_from_logits_matches_sampler_processing():
    """[S, T, V] logits: each position processed with its row's parameters, exactly like [S, V] calls."""
    s, t, v = len(FILTER_PARAMS), 4, 50  # the filtered exactness case's shape
    rng = np.random.default_rng(17)
    logits = rng.normal(size=(s, t, v)).astype(np.float32) * 3
    tensors = _filter_tensors()
    probs = np.asarray(_probs(logits, tensors, True))
    assert probs.shape == (s, t, v)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    for j in range(t):
        np.testing.assert_allclose(probs[:, j], _probs(logits[:, j], tensors, True), rtol=1e-6, atol=1e-8)
    assert np.all((probs[0] > 0).sum(-1) <= 12)  # row 0: top-k 12
    np.testing.assert_allclose(probs[1], jax.nn.softmax(logits[1], axis=-1), rtol=1e-5, atol=1e-8)  # greedy: raw
    ref = np.exp(logits[2] / 0.6 - (logits[2] / 0.6).max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    kept = probs[2] > 0
    assert np.all(kept.sum(-1) < v)  # top-p 0.7 removed something
    np.testing.assert_allclose(probs[2][kept], (ref / np.where(kept, ref, 0).sum(-1, keepdims=True))[kept], rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# N-gram proposer


def _ngram_reference(tokens: list[int], n_max: int, n_min: int, k: int) -> list[int]:
    """Brute force: longest n first, then the most recent start j with tokens[j:j+n] == suffix and j + n < L."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        for j in range(length - n - 1, -1, -1):
            if tokens[j : j + n] == suffix:
                return tokens[j + n : j + n + k]
    return []


def test_ngram_longest_match_wins_over_more_recent_shorter():
    ng = NgramProposer(n_max=3, n_min=1, k=2)
    #        0  1  2  3  4  5  6  7  8  9
    toks = [1, 2, 3, 40, 41, 9, 3, 50, 2, 3]
    # suffix (2, 3) occurs at 1 -> propose 40, 41; the more recent single "3" at 6 (-> 50) is shorter.
    assert ng.propose(toks) == [40, 41]
    assert ng.find_match(toks) == (1, 2)
    assert NgramProposer(n_max=1, k=2).propose(toks) == [50, 2]  # n = 1 only: the most recent "3" is at 6


def test_ngram_most_recent_among_equal_length():
    ng = NgramProposer(n_max=2, n_min=2, k=3)
    toks = [5, 6, 1, 1, 1, 5, 6, 2, 2, 2, 5, 6]
    assert ng.propose(toks) == [2, 2, 2]


def test_ngram_no_match_and_n_min():
    assert NgramProposer().propose([1, 2, 3, 4]) == []
    assert NgramProposer().propose([]) == []
    assert NgramProposer().propose([7]) == []
    # Only a 1-token match exists; n_min = 2 refuses it.
    assert NgramProposer(n_max=3, n_min=2).propose([1, 2, 9, 3, 2]) == []
    assert NgramProposer(n_max=3, n_min=1).propose([1, 2, 9, 3, 2]) == [9, 3, 2]


def test_ngram_k_respected_and_truncated_at_end():
    toks = list(range(20)) + [3, 4]
    assert NgramProposer(k=4).propose(toks) == [5, 6, 7, 8]
    assert NgramProposer(k=1).propose(toks) == [5]
    assert NgramProposer(k=4).propose([7, 7, 7, 7]) == [7]  # most recent occurrence: only one token follows it
    assert NgramProposer(k=4, extend_periodic=True).propose([7, 7, 7, 7]) == [7, 7, 7, 7]
    assert NgramProposer(k=5, extend_periodic=True).propose([1, 2, 3, 1, 2]) == [3, 1, 2, 3, 1]
    assert NgramProposer(k=2).propose(np.array([4, 5, 6, 4, 5])) == [6, 4]  # numpy input
    assert NgramProposer(k=3).propose_batch([[1, 2, 1], [1, 2, 3]]) == [[2, 1], []]
    with pytest.raises(ValueError):
        NgramProposer(n_max=1, n_min=2)
    with pytest.raises(ValueError):
        NgramProposer(k=0)


@settings(max_examples=300, deadline=None)
@given(
    toks=st.lists(st.integers(0, 3), max_size=40),
    n_max=st.integers(1, 4),
    n_min=st.integers(1, 4),
    k=st.integers(1, 5),
)
def test_ngram_matches_brute_force(toks: list[int], n_max: int, n_min: int, k: int):
    if n_min > n_max:
        n_min, n_max = n_max, n_min
    got = NgramProposer(n_max=n_max, n_min=n_min, k=k).propose(toks)
    assert got == _ngram_reference(toks, n_max, n_min, k)
    assert len(got) <= k


def test_prompt_lookup_proposer_is_the_engine_interface():
    """The n-gram proposer behind `Proposer`: its proposal is made at scheduling (`reserve`, capped at k), and
    `propose` hands back the placed tokens without probabilities."""
    ng = PromptLookupProposer(NgramProposer(k=3))
    assert isinstance(ng, Proposer) and ng.k == 3
    seq = types.SimpleNamespace(token_ids=[1, 2, 3, 4, 1, 2], spec_tokens=[])
    assert ng.reserve(seq, 3) == [3, 4, 1] and ng.reserve(seq, 1) == [3]
    seq.spec_tokens = [3, 4]
    other = types.SimpleNamespace(token_ids=[9], spec_tokens=[])
    assert ng.propose([seq, other], pad_to=4) == DraftProposal([[3, 4], []], None)
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
            check_num_drafts(bad)
    assert check_num_drafts(4) == 4


def test_ngram_fast_on_long_sequences():
    rng = np.random.default_rng(18)
    toks = rng.integers(0, 200, size=4000).tolist()
    ng = NgramProposer(n_max=3, n_min=1, k=4)
    ng.propose(toks)
    t0 = time.perf_counter()
    for i in range(200):
        ng.propose(toks[: 3800 + i])
    per_call = (time.perf_counter() - t0) / 200
    assert per_call < 5e-3, f"{per_call * 1e3:.2f} ms per call"


# ---------------------------------------------------------------------------------------------------------------
# Draft-model interface


def test_draft_model_proposer_interface():
    with pytest.raises(TypeError):
        DraftModelProposer()  # abstract

    class Fixed(DraftModelProposer):
        k = 2

        def propose(self, seqs, pad_to=None):
            return DraftProposal(token_ids=[[1, 2] for _ in seqs], draft_probs=jnp.full((len(seqs), 2, 4), 0.25))

    out = Fixed().propose([object(), object()])
    assert out.token_ids == [[1, 2], [1, 2]] and out.draft_probs.shape == (2, 2, 4)
    Fixed().on_accepted([], [])
    assert Fixed().reserve(object(), 2) == [0, 0]  # model-backed: placeholders, filled by propose
