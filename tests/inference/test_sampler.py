"""Sampler: vLLM semantics (greedy, temperature, min-p -> top-k -> top-p), seed reproducibility independent of the
batch, exact sampled distributions (chi-square), logprobs, and that the no-filter path compiles no sort/top-k.

Statistical tests use fixed seeds, so they are deterministic; the chi-square critical values are for alpha = 1e-3
(hard-coded below, no scipy), and each test also checks that the statistic would reject a plausible wrong answer.
"""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.sampling import sampler as S
from inference.sampling.params import SamplingParams

NUM_TOP = 5


@functools.partial(jax.jit, static_argnames=("use_filters",))
def _run(logits: jax.Array, t: S.SamplingTensors, use_filters: bool):
    """All public entry points in one jit, so each (shape, use_filters) compiles once for the whole module
    (compiles dominate this file's run time on a 2-core CPU)."""
    tokens = S.sample(logits, t, use_filters=use_filters)
    return (
        S.process_logits(logits, t, use_filters=use_filters),
        tokens,
        S.sample_with_logprobs(logits, t, use_filters=use_filters, num_top=NUM_TOP),
        S.compute_processed_logprobs(logits, tokens, t, NUM_TOP, use_filters=use_filters),
    )


def _process(logits, t, *, use_filters: bool) -> np.ndarray:
    return np.asarray(_run(logits, t, use_filters)[0])


def _sample(logits, t, *, use_filters: bool) -> np.ndarray:
    return np.asarray(_run(logits, t, use_filters)[1])


def _sample_lp(logits, t, *, use_filters: bool) -> S.SamplerOutput:
    return jax.tree_util.tree_map(np.asarray, _run(logits, t, use_filters)[2])


_logprobs = jax.jit(S.compute_logprobs, static_argnames=("num_top",))

# Batch shapes used below (each compiles `_run` once per use_filters): [8, 64], [8, 1000], [N_DRAWS, 7].

# Upper 0.1% points of the chi-square distribution, indexed by degrees of freedom (standard tables).
CHI2_CRIT_1E3 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

N_DRAWS = 20_000
# One fixed probability vector for all statistical tests (V = 7), so they share compiled shapes.
PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])
LOGITS = np.log(PROBS).astype(np.float32)


ROWS = 8  # every non-statistical batch is padded to ROWS rows (greedy padding), V = 64 or 1000


def _tensors(params: list[SamplingParams], seeds: list[int] | None = None, steps: list[int] | None = None,
             pad_to: int = ROWS) -> S.SamplingTensors:
    n = len(params)
    return S.SamplingTensors.from_params(
        params, seeds if seeds is not None else list(range(n)), steps if steps is not None else [0] * n, pad_to)


def _pad_logits(logits: np.ndarray, rows: int = ROWS) -> np.ndarray:
    out = np.zeros((rows, logits.shape[-1]), np.float32)
    out[: len(logits)] = logits
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _draw(params: SamplingParams, *, seed: int = 1234, logits: np.ndarray = LOGITS) -> np.ndarray:
    """N_DRAWS samples of one request: the same row at steps 0..N-1 (one key per step), as one batch."""
    t = _tensors([params] * N_DRAWS, [seed] * N_DRAWS, list(range(N_DRAWS)), pad_to=N_DRAWS)
    batch = np.broadcast_to(logits, (N_DRAWS, logits.shape[-1]))
    tokens = np.asarray(_sample(batch, t, use_filters=params.uses_filters))
    return np.bincount(tokens, minlength=logits.shape[-1])


def _chi2(counts: np.ndarray, expected_probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic over the support of expected_probs; counts outside the support must be zero."""
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"sampled outside the kept set: {counts}"
    n = counts.sum()
    e = n * expected_probs[support]
    return float(((counts[support] - e) ** 2 / e).sum()), int(support.sum() - 1)


def _assert_follows(counts: np.ndarray, expected: np.ndarray, wrong: np.ndarray) -> None:
    stat, df = _chi2(counts, expected)
    assert stat < CHI2_CRIT_1E3[df], (stat, df, counts, expected)
    # Power check: the same counts must reject a nearby wrong distribution on the same support.
    support = expected > 0
    e_wrong = counts.sum() * wrong[support] / wrong[support].sum()
    stat_wrong = float(((counts[support] - e_wrong) ** 2 / e_wrong).sum())
    assert stat_wrong > CHI2_CRIT_1E3[df], (stat_wrong, counts, wrong)


def _renorm(p: np.ndarray, keep: np.ndarray) -> np.ndarray:
    q = np.where(keep, p, 0.0)
    return q / q.sum()


# --------------------------------------------------------------------------------------------------------------------
# numpy reference of vLLM v1: temperature -> min-p -> top-k -> top-p (the PyTorch code path, ascending sort).


def _ref_keep(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> tuple[np.ndarray, float]:
    """Kept-token mask per vLLM, and the distance of the top-p cumulative sums from the cut (to skip float ties)."""
    x = logits.astype(np.float64) / temperature
    v = x.shape[-1]
    p = _softmax(x)
    x = np.where(p < min_p * p.max(), -np.inf, x)
    order = np.argsort(x, kind="stable")
    xs = x[order].copy()
    margin = np.inf
    if 0 < top_k < v:
        xs = np.where(xs < xs[v - top_k], -np.inf, xs)
    if top_p < 1.0:
        cs = np.cumsum(_softmax(xs))
        margin = float(np.min(np.abs(cs - (1 - top_p))))
        mask = cs <= 1 - top_p
        mask[-1] = False
        xs[mask] = -np.inf
    out = np.empty(v)
    out[order] = xs
    return np.isfinite(out), margin


# --------------------------------------------------------------------------------------------------------------------
# Greedy


@pytest.mark.parametrize("use_filters", [False, True])
def test_greedy_is_argmax_of_raw_logits(use_filters: bool) -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(ROWS, 64)).astype(np.float32) * 4
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6, top_k=3, top_p=0.1, min_p=0.9)] * 4
    tokens = _sample(logits, _tensors(params), use_filters=use_filters)
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_greedy_rows_in_mixed_batch_and_padding() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(ROWS, 64)).astype(np.float32)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_p=0.8)] * 3
    t = _tensors(params)
    np.testing.assert_array_equal(t.temperature[6:], 0.0)  # padding rows are greedy
    tokens = _sample(logits, t, use_filters=True)
    greedy_rows = [0, 2, 4, 6, 7]
    np.testing.assert_array_equal(tokens[greedy_rows], logits.argmax(-1)[greedy_rows])


def test_argmax_ties_take_first_index_like_numpy() -> None:
    logits = np.full((ROWS, 64), -5.0, np.float32)
    logits[0, [1, 2]] = 3.0
    logits[1, :] = 2.0
    tokens = _sample(logits, _tensors([SamplingParams(temperature=0)] * 2), use_filters=False)
    np.testing.assert_array_equal(tokens[:2], [1, 0])


def test_top_k_1_is_argmax() -> None:
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(ROWS, 1000)).astype(np.float32)
    params = [SamplingParams(temperature=1.7, top_k=1)] * ROWS
    tokens = _sample(logits, _tensors(params, seeds=list(range(100, 100 + ROWS))), use_filters=True)
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_greedy_rows_processed_logits_are_raw() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(ROWS, 64)).astype(np.float32)
    t = _tensors([SamplingParams(temperature=0, top_k=2, top_p=0.3), SamplingParams(temperature=2.0)])
    x = _process(logits, t, use_filters=True)
    np.testing.assert_array_equal(x[0], logits[0])
    np.testing.assert_allclose(x[1], logits[1] / 2.0, rtol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# Keys and reproducibility


def test_keys_are_fold_in_of_seed_and_step() -> None:
    seeds, steps = [0, 7, 2**32 - 1, 123456], [0, 3, 11, 100000]
    t = _tensors([SamplingParams()] * 4, seeds, steps, pad_to=4)
    got = np.asarray(jax.jit(lambda t: t.keys())(t))
    for i, (seed, step) in enumerate(zip(seeds, steps)):
        want = jax.random.key_data(jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), step))
        np.testing.assert_array_equal(got[i], np.asarray(want))


def test_64_bit_seeds_keep_both_halves() -> None:
    t = _tensors([SamplingParams()] * 3, [5, 5 + 2**32, -1], [0, 0, 0], pad_to=3)
    np.testing.assert_array_equal(t.seed_key, [[0, 5], [1, 5], [0xFFFFFFFF, 0xFFFFFFFF]])


@pytest.mark.parametrize("use_filters", [False, True])
def test_seeded_row_is_independent_of_batch(use_filters: bool) -> None:
    rng = np.random.default_rng(4)
    v = 1000
    target_logits = rng.normal(size=v).astype(np.float32)  # flat enough that the draw is genuinely random
    target = SamplingParams(temperature=1.0, top_p=0.95 if use_filters else 1.0, top_k=500 if use_filters else 0,
                            seed=1234)
    # (live rows, position of the target). All padded to ROWS rows, plus one batch of a different compiled shape.
    layouts = [(1, 0, ROWS), (5, 3, ROWS), (ROWS, 7, ROWS), (ROWS, 0, ROWS)] + ([(3, 1, 3)] if use_filters else [])
    results = []
    for live, pos, rows in layouts:
        logits = _pad_logits(rng.normal(size=(live, v)).astype(np.float32) * rng.uniform(0.1, 5), rows)
        logits[pos] = target_logits
        others = [SamplingParams(temperature=float(rng.uniform(0, 2)), top_k=int(rng.integers(0, 5)),
                                 top_p=float(rng.uniform(0.5, 1)), min_p=float(rng.uniform(0, 0.2)))
                  for _ in range(live)]
        params = others[:pos] + [target] + others[pos + 1:]
        seeds = [int(s) for s in rng.integers(0, 2**31, live)]
        seeds[pos] = target.seed
        steps = [int(s) for s in rng.integers(0, 100, live)]
        steps[pos] = 42
        tokens = _sample(logits, _tensors(params, seeds, steps, pad_to=rows), use_filters=use_filters)
        results.append(int(tokens[pos]))
    assert len(set(results)) == 1, results

    # ... while other seeds / steps give other tokens (so the check above is not vacuous).
    logits = np.broadcast_to(target_logits, (ROWS, v))
    by_seed = _sample(logits, _tensors([target] * ROWS, list(range(ROWS)), [42] * ROWS), use_filters=use_filters)
    by_step = _sample(logits, _tensors([target] * ROWS, [1234] * ROWS, list(range(ROWS))), use_filters=use_filters)
    assert len(set(by_seed.tolist())) > ROWS // 2 and len(set(by_step.tolist())) > ROWS // 2


def test_from_params_validates_lengths() -> None:
    with pytest.raises(ValueError):
        S.SamplingTensors.from_params([SamplingParams()] * 2, [0], [0, 0], 4)
    with pytest.raises(ValueError):
        S.SamplingTensors.from_params([SamplingParams()] * 3, [0] * 3, [0] * 3, 2)


def test_needs_filters() -> None:
    assert not S.needs_filters([SamplingParams(), SamplingParams(temperature=0, top_k=3)])
    assert S.needs_filters([SamplingParams(), SamplingParams(min_p=0.1)])


# --------------------------------------------------------------------------------------------------------------------
# Distributions (chi-square over N_DRAWS draws of one row: same seed, steps 0..N-1)


def test_temperature_sampling_follows_tempered_softmax() -> None:
    counts = _draw(SamplingParams(temperature=0.7))
    _assert_follows(counts, _softmax(LOGITS / 0.7), wrong=_softmax(LOGITS / 0.75))


def test_plain_sampling_follows_softmax() -> None:
    counts = _draw(SamplingParams(temperature=1.0), seed=99)
    _assert_follows(counts, PROBS, wrong=_softmax(LOGITS / 1.1))


def test_top_k_is_renormalised_truncation() -> None:
    counts = _draw(SamplingParams(top_k=3))
    keep = np.arange(7) < 3
    _assert_follows(counts, _renorm(PROBS, keep), wrong=_renorm(_softmax(LOGITS / 1.2), keep))


def test_top_p_is_renormalised_truncation() -> None:
    # Mass before each token: 0, .4, .65, .8 -> with top_p=.75 the third token crosses the threshold and is kept.
    counts = _draw(SamplingParams(top_p=0.75))
    keep = np.arange(7) < 3
    _assert_follows(counts, _renorm(PROBS, keep), wrong=_renorm(_softmax(LOGITS / 1.2), keep))


def test_min_p_is_renormalised_truncation() -> None:
    counts = _draw(SamplingParams(min_p=0.2))  # keeps p >= 0.08: four tokens
    keep = PROBS >= 0.08
    _assert_follows(counts, _renorm(PROBS, keep), wrong=_renorm(_softmax(LOGITS / 1.2), keep))


def test_combined_filters_with_temperature() -> None:
    keep, _ = _ref_keep(LOGITS, 0.8, 5, 0.9, 0.05)
    assert 2 <= keep.sum() < 7
    counts = _draw(SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05), seed=7)
    _assert_follows(counts, _renorm(_softmax(LOGITS / 0.8), keep), wrong=_renorm(_softmax(LOGITS / 0.9), keep))


# --------------------------------------------------------------------------------------------------------------------
# Filter sets (exact, against the numpy reference)


def _kept(logits: np.ndarray, params: list[SamplingParams]) -> np.ndarray:
    """Kept-token masks of the first len(params) rows; logits [n, V] with V in (64, 1000), padded to ROWS rows."""
    n = len(params)
    x = _process(_pad_logits(np.asarray(logits, np.float32)), _tensors(params), use_filters=True)
    return np.isfinite(x[:n])


def _row64(values: list[float] | np.ndarray) -> np.ndarray:
    """One row of V=64 logits: `values` followed by tokens too unlikely to matter (-50)."""
    row = np.full((1, 64), -50.0, np.float32)
    row[0, : len(values)] = values
    return row


@pytest.mark.parametrize(
    ("top_p", "n_kept"),
    [(1e-6, 1), (0.49, 1), (0.5 + 1e-3, 2), (0.6, 2), (0.79, 2), (0.81, 3), (1.0, 3)],
)
def test_top_p_boundary_keeps_the_crossing_token(top_p: float, n_kept: int) -> None:
    logits = np.full((1, 64), -np.inf, np.float32)  # -inf tail: exactly three tokens carry the mass
    logits[0, :3] = np.log([0.2, 0.5, 0.3])
    kept = _kept(logits, [SamplingParams(top_p=top_p)])[0]
    assert kept.sum() == n_kept
    assert kept[[1, 2, 0][:n_kept]].all()  # in probability order


def test_top_k_keeps_ties_with_kth_value() -> None:
    kept = _kept(_row64([3.0, 2.0, 2.0, 1.0, 2.0]), [SamplingParams(top_k=2)])[0]
    np.testing.assert_array_equal(kept[:5], [True, True, True, False, True])
    assert kept.sum() == 4


def test_min_p_applies_before_top_p_as_in_vllm_v1() -> None:
    # min_p=.2 keeps p >= .08 (four tokens, mass .9); renormalised: .444 .278 .167 .111, so top_p=.7 keeps two.
    # (Applying top-p to the unfiltered distribution first would keep three.)
    kept = _kept(_row64(LOGITS), [SamplingParams(min_p=0.2, top_p=0.7)])[0]
    np.testing.assert_array_equal(np.flatnonzero(kept), [0, 1])


def test_filters_match_vllm_reference_on_random_batches() -> None:
    """Mixed batches; V=1000 exercises the exact bisection fallback (top_k > candidates, flat top-p sets)."""
    assert S.FILTER_CANDIDATES < 300 < 1000
    rng = np.random.default_rng(5)
    configs = list(itertools.product((0.5, 1.0, 1.5), (0, 1, 5, 300), (1.0, 0.5, 0.9, 0.99), (0.0, 0.05)))
    checked = 0
    for v in (64, 1000):
        for start in range(0, len(configs), ROWS):
            chunk = configs[start:start + ROWS]
            params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in chunk]
            logits = rng.normal(size=(len(chunk), v)) * rng.uniform(0.3, 5, size=(len(chunk), 1))
            kept = _kept(logits.astype(np.float32), params)
            for i, p in enumerate(params):
                want, margin = _ref_keep(logits[i].astype(np.float32), p.temperature, p.top_k, p.top_p, p.min_p)
                if margin < 1e-5:  # cumulative mass within float error of the cut: either answer is right
                    continue
                checked += 1
                np.testing.assert_array_equal(kept[i], want, err_msg=f"V={v} {p}")
    assert checked > 0.9 * 2 * len(configs)


@settings(max_examples=60, deadline=None)
@given(
    # XLA CPU flushes subnormals to zero, which turns them into ties the numpy reference does not see.
    logits=st.lists(st.floats(-8, 8, allow_nan=False, allow_subnormal=False, width=32), min_size=12, max_size=12),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.05, 1.0),
    min_p=st.sampled_from([0.0, 0.01, 0.2, 0.9]),
)
def test_filters_match_reference_property(logits: list[float], top_k: int, top_p: float, min_p: float) -> None:
    x = _row64(logits)[0]
    want, margin = _ref_keep(x, 1.0, top_k, top_p, min_p)
    if margin < 1e-5:
        return
    got = _kept(x[None], [SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p)])[0]
    # vLLM splits exact logit ties at the top-p cut by sort order; we keep the whole tie. Allow only that difference.
    assert not (want & ~got).any()
    extra = got & ~want
    if extra.any():
        assert top_p < 1.0 and set(x[extra].tolist()) <= set(x[want].tolist())


# --------------------------------------------------------------------------------------------------------------------
# Logprobs


def test_compute_logprobs() -> None:
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(ROWS, 64)).astype(np.float32) * 3
    tokens = rng.integers(0, 64, size=ROWS).astype(np.int32)
    tok_lp, top_ids, top_lp = map(np.asarray, _logprobs(logits, tokens, num_top=5))
    ref = _log_softmax(logits)
    np.testing.assert_allclose(tok_lp, ref[np.arange(ROWS), tokens], atol=1e-5)
    np.testing.assert_array_equal(top_ids, np.argsort(-ref, axis=-1)[:, :5])
    np.testing.assert_allclose(top_lp, np.take_along_axis(ref, top_ids, -1), atol=1e-5)
    assert (np.diff(top_lp, axis=-1) <= 0).all()
    assert (np.exp(top_lp).sum(-1) <= 1 + 1e-6).all()
    assert top_ids.dtype == np.int32 and top_lp.dtype == np.float32

    tok_lp0, ids0, lp0 = _logprobs(logits, tokens, num_top=0)
    assert ids0.shape == (ROWS, 0) and lp0.shape == (ROWS, 0)
    np.testing.assert_allclose(np.asarray(tok_lp0), tok_lp)


def test_sample_with_logprobs_raw_and_processed_rows() -> None:
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(ROWS, 64)).astype(np.float32) * 2
    logits[1] = logits[0]
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=5),  # raw
        SamplingParams(temperature=0.5, top_k=3, logprobs=5, logprobs_mode="processed"),
        SamplingParams(temperature=0, logprobs=5, logprobs_mode="processed"),  # greedy: processed == raw
        SamplingParams(temperature=1.0, logprobs=5),
    ]
    t = _tensors(params, seeds=[11, 11, 12, 13], steps=[0, 0, 0, 0])
    out = _sample_lp(logits, t, use_filters=True)
    tokens = out.tokens
    np.testing.assert_array_equal(tokens, _sample(logits, t, use_filters=True))
    assert tokens[0] == tokens[1]  # same seed, step, logits and filters: same draw
    assert tokens[2] == logits[2].argmax()

    raw = _log_softmax(logits)
    proc = _log_softmax(_process(logits, t, use_filters=True))
    for i, src in [(0, raw), (1, proc), (2, raw), (3, raw)]:
        finite = np.isfinite(out.top_logprobs[i])
        np.testing.assert_allclose(out.logprob[i], src[i, tokens[i]], atol=1e-5)
        np.testing.assert_allclose(out.top_logprobs[i][finite], src[i, out.top_ids[i]][finite], atol=1e-5)
        assert np.exp(out.top_logprobs[i]).sum() <= 1 + 1e-6
    np.testing.assert_array_equal(out.top_ids[0], np.argsort(-raw[0])[:NUM_TOP])
    # Processed row under top_k=3: exactly three finite entries carrying all the mass; the tail is -inf.
    assert np.isfinite(out.top_logprobs[1]).sum() == 3 and np.isneginf(out.top_logprobs[1, 3:]).all()
    np.testing.assert_allclose(np.exp(out.top_logprobs[1, :3]).sum(), 1.0, atol=1e-5)
    assert np.isfinite(out.logprob[1])  # the sampled token is always in the kept set


def test_processed_logprobs_helper_matches_log_softmax_of_processed() -> None:
    rng = np.random.default_rng(8)
    logits = rng.normal(size=(ROWS, 64)).astype(np.float32)
    t = _tensors([SamplingParams(temperature=0.9, top_p=0.6), SamplingParams(temperature=0)])
    _, tokens, _, (tok_lp, ids, lps) = jax.tree_util.tree_map(np.asarray, _run(logits, t, True))
    ref = _log_softmax(_process(logits, t, use_filters=True))
    np.testing.assert_allclose(tok_lp, ref[np.arange(ROWS), tokens], atol=1e-5)
    assert np.isfinite(tok_lp).all()
    np.testing.assert_array_equal(ids[1], np.argsort(-logits[1])[:NUM_TOP])  # greedy row: raw logprobs
    np.testing.assert_allclose(lps[1], np.sort(_log_softmax(logits)[1])[::-1][:NUM_TOP], atol=1e-5)
    assert 1 <= np.isfinite(ref[0]).sum() < 64  # top_p=.6 really filtered row 0
    np.testing.assert_allclose(lps[0], np.sort(ref[0])[::-1][:NUM_TOP], atol=1e-5)


# --------------------------------------------------------------------------------------------------------------------
# Compilation


def _primitives(jaxpr_text: str) -> set[str]:
    return set(re.findall(r"= ([a-z_]+)\[", jaxpr_text)) | set(re.findall(r"= ([a-z_]+) ", jaxpr_text))


def test_no_filter_path_traces_no_sort_or_top_k() -> None:
    logits = jnp.zeros((4, 100), jnp.float32)
    t = _tensors([SamplingParams(temperature=0.8)] * 4, pad_to=4)
    off = _primitives(str(jax.make_jaxpr(lambda l, t: S.sample(l, t, use_filters=False))(logits, t)))
    on = _primitives(str(jax.make_jaxpr(lambda l, t: S.sample(l, t, use_filters=True))(logits, t)))
    assert {"sort", "top_k", "while", "cumsum"}.isdisjoint(off), off
    assert "top_k" in on and "sort" not in on, on


def test_jit_with_static_flags_and_pytree_tensors() -> None:
    t = jax.device_put(_tensors([SamplingParams(top_p=0.5)] * 3))
    logits = jnp.zeros((ROWS, 64), jnp.float32)
    for use_filters in (False, True):
        assert _run(logits, t, use_filters)[1].dtype == jnp.int32
    out = jax.jit(S.sample_with_logprobs, static_argnames=("use_filters", "num_top"))(
        logits, t, use_filters=False, num_top=0)
    assert out.top_ids.shape == (ROWS, 0) and out.tokens.shape == (ROWS,)
    assert len(jax.tree_util.tree_leaves(t)) == 7 and t.num_rows == ROWS


def test_no_logprobs_asked_skips_the_log_softmax() -> None:
    """num_top=0 (no row asked for logprobs): the same tokens as with logprobs, no logprob or rank returned, and no
    exp / log traced (the greedy and Gumbel paths need neither; the noise's logs are inside its cond)."""
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(ROWS, 64)).astype(np.float32)
    t = _tensors([SamplingParams(temperature=0.7), SamplingParams(temperature=0), SamplingParams(temperature=1.3),
                  SamplingParams(temperature=0.7, top_k=5)], seeds=[1, 2, 3, 4], steps=[5, 5, 5, 5])
    bare = jax.jit(S.sample_with_logprobs, static_argnames=("use_filters", "num_top"))(
        logits, t, use_filters=True, num_top=0)
    np.testing.assert_array_equal(np.asarray(bare.tokens), _sample_lp(logits, t, use_filters=True).tokens)
    assert bare.logprob is None and bare.rank is None and bare.top_ids.shape == (ROWS, 0)
    greedy = _tensors([SamplingParams(temperature=0)] * ROWS)
    jaxpr = jax.make_jaxpr(lambda l, t: S.sample_with_logprobs(l, t, use_filters=False, num_top=0))(logits, greedy)
    outer = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
    assert {"exp", "log"}.isdisjoint(outer), outer


def test_rows_hold_each_requests_sampling_parameters() -> None:
    """`from_params` reads each request's cached `sampling_row`: a greedy request's filters off, a top_k past int32
    held there (off, as any k past the vocabulary), processed logprobs by row, padding rows greedy."""
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logprobs_mode="processed"),
              SamplingParams(temperature=0.0, top_k=7, top_p=0.5, min_p=0.2),
              SamplingParams(temperature=1.3, top_k=2**40),
              SamplingParams(temperature=2, top_k=-1, logprobs_mode="processed")]
    t = S.SamplingTensors.from_params(params, [1, 2, 3, 4], [0, 1, 2, 3], pad_to=6)
    np.testing.assert_array_equal(t.temperature, np.float32([0.7, 0.0, 1.3, 2.0, 0.0, 0.0]))
    np.testing.assert_array_equal(t.top_k, [5, 0, 2**31 - 1, 0, 0, 0])
    np.testing.assert_array_equal(t.top_p, np.float32([0.9, 1.0, 1.0, 1.0, 1.0, 1.0]))
    np.testing.assert_array_equal(t.min_p, np.float32([0.05, 0.0, 0.0, 0.0, 0.0, 0.0]))
    np.testing.assert_array_equal(t.processed_logprobs, [True, False, False, True, False, False])
    np.testing.assert_array_equal(t.step, [0, 1, 2, 3, 0, 0])
    assert t.temperature.dtype == np.float32 and t.top_k.dtype == np.int32
