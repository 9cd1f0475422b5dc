"""Speculative decoding's verifier: rejection sampling that keeps the target model's distribution exact.

A proposer guesses up to k next tokens per sequence (cheaply: an n-gram lookup in the sequence itself, or a small
draft model); the target model then scores all k guesses plus one more position in a single forward pass, and
`rejection_sample` decides how many of the guesses to keep. The point of the construction (Leviathan et al. 2023,
Chen et al. 2023) is that the emitted tokens are distributed *exactly* as if the target model had sampled them one at
a time, whatever the draft proposes; a good draft only makes more of its guesses survive.

Notation (as in the lecture): q is the target's distribution, p the draft's. At draft position i the draft token x
is accepted with probability min(1, q(x) / p(x)); at the first rejection one token is drawn from the residual
(q - p)+ / Z and the step ends; if all guesses survive, a bonus token is drawn from the target's next distribution.
So every call emits between 1 and k + 1 tokens.

Everything in `rejection_sample` / `probs_from_logits` is jittable with static shapes and vectorised over the S rows
(no Python loops over rows, no host syncs), so it can live inside the engine's jitted verification step. The
proposers run on the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from inference.sampling.sampler import PRNG_IMPL, SamplingTensors, _argmax, process_logits

#: Residual masses Z = sum((q - p)+) at or below this are treated as zero and the recovery token is drawn from q
#: instead of the residual. Why this is harmless: with normalised q and p the probability of rejecting at a position
#: is sum((p - q)+) = Z, so replacing the residual by q there moves the output distribution by at most Z <= 1e-6 in
#: total variation; and a residual that small is f32 cancellation noise of q - p, not a distribution worth sampling.
RESIDUAL_EPS = 1e-6


def probs_from_logits(logits: jax.Array, sampling_tensors: SamplingTensors, use_filters: bool) -> jax.Array:
    """Softmax of `inference.sampling.sampler.process_logits`: the distribution each row actually samples from,
    f32[..., V].

    Why: the rejection test is only exact if q and p are the distributions the target and the draft really sample
    from, i.e. after temperature and the min-p / top-k / top-p filters (filtered tokens get probability exactly 0).
    Both sides must go through this same function with the same `sampling_tensors` (the draft must also *sample* its
    proposals from the probabilities returned here). The filters are the sampler's own; nothing is reimplemented.

    Args:
      logits: f32[S, V], or f32[S, T, V] for T positions per row (the target's k + 1 verification positions, or the
        draft's k); every position of a row uses that row's parameters.
      sampling_tensors: per-row parameters for the S rows.
      use_filters: static, as in `process_logits` (False only when no row uses top-k / top-p / min-p).

    Greedy rows (temperature < SAMPLING_EPS) get the softmax of their raw logits (process_logits leaves them as they
    are); pass `greedy=` to `rejection_sample` so they are verified by argmax instead of by sampling.
    """
    logits = jnp.asarray(logits)
    if logits.ndim == 2:
        return jax.nn.softmax(process_logits(logits, sampling_tensors, use_filters=use_filters), axis=-1)
    if logits.ndim != 3:
        raise ValueError(f"logits must be [S, V] or [S, T, V], got shape {logits.shape}")
    s, t, v = logits.shape
    # One row of parameters per (row, position): repeat each per-row field T times, flatten, process, unflatten.
    rep = jax.tree_util.tree_map(lambda a: jnp.repeat(jnp.asarray(a), t, axis=0), sampling_tensors)
    x = process_logits(logits.reshape(s * t, v), rep, use_filters=use_filters)
    return jax.nn.softmax(x, axis=-1).reshape(s, t, v)


def _row_keys(key: jax.Array, s: int) -> tuple[jax.Array, bool]:
    """Normalise `key` to typed keys: (keys, per_row). Accepts one key (typed scalar or raw u32[2]) or one per row
    (typed [S] or raw u32[S, 2], e.g. `SamplingTensors.keys()`); raw data is read as threefry2x32 like the sampler."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        typed = key
    else:
        typed = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32), impl=PRNG_IMPL)
    if typed.ndim == 0:
        return typed, False
    if typed.shape == (s,):
        return typed, True
    raise ValueError(f"key must be a single key or one key per row ({s}), got key shape {typed.shape}")


def rejection_sample(
    target_probs: jax.Array,
    draft_probs: jax.Array | None,
    draft_tokens: jax.Array,
    key: jax.Array,
    *,
    greedy: jax.Array | None = None,
    num_draft: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Verify draft tokens against the target; returns (emitted i32[S, k+1], num_accepted i32[S]).

    Args:
      target_probs: f32[S, k+1, V], q: the target's distribution at each draft position plus the bonus position
        (after temperature and filters, see `probs_from_logits`). Rows are renormalised here and negatives clipped.
      draft_probs: f32[S, k, V], p: the distribution each draft token was sampled from, processed the same way. None
        means deterministic proposals (an n-gram proposer, or a greedy draft): p is one-hot on the draft token, so x is
        accepted with probability q(x) and the residual is q with x removed, without materialising [S, k, V].
      draft_tokens: i32[S, k], the proposed tokens.
      key: one PRNG key for the whole batch, or one per row (typed [S] or raw u32[S, 2], e.g. a fold_in of the
        row's (seed, step) key) so a seeded row's outcome does not depend on the rest of the batch.
      greedy: optional bool[S]; greedy rows (temperature 0) accept a draft token iff it is the argmax of the target at
        that position, and emit the target's argmax at the first mismatch (or as the bonus) -- the temperature-0
        limit of the rule, computed without randomness. Argmax ties go to the lowest id, like the sampler. The argmax
        is taken on target_probs; softmax is monotone, so it is the sampler's argmax of the raw logits unless two
        logits are so close that their f32 probabilities round to the same value.
      num_draft: optional i32[S] in [0, k]: how many of a row's k draft tokens are real (proposers may find fewer than
        k, or none). A row uses only its first num_draft tokens and, if it accepts them all, draws its bonus from
        target position num_draft; the rest of its draft row (padding) is ignored. Default: k for every row.

    Returns:
      emitted: i32[S, k+1]: the n accepted draft tokens, then the one recovered / bonus token, then -1 padding;
        every row emits n + 1 >= 1 tokens.
      num_accepted: i32[S], n, the number of draft tokens accepted (0..num_draft).

    Exactness: with u ~ U[0, 1), the test `u * p(x) < q(x)` accepts with probability min(1, q(x)/p(x)) without a
    division (p(x) = 0 accepts iff q(x) > 0). The accepted mass at token x is p(x) * min(1, q/p) = min(p, q)(x) and
    the rejection mass sum((p - q)+) equals Z = sum((q - p)+), so accepted plus residual is exactly q. The recovery
    and bonus draws use Gumbel-max on log-probabilities (accurate for small probabilities, unlike an f32 inverse
    CDF over a large vocabulary). Z <= RESIDUAL_EPS (q == p up to rounding, or a draft token impossible under both)
    falls back to q.

    Randomness: one uniform draw of k + V values per row (k acceptance tests, V Gumbel values); a batch whose rows
    are all greedy draws nothing. Per-row keys make each row's draw depend only on its own key.
    """
    q = jnp.maximum(jnp.asarray(target_probs, jnp.float32), 0.0)
    if q.ndim != 3:
        raise ValueError(f"target_probs must be [S, k+1, V], got shape {q.shape}")
    s, k1, v = q.shape
    k = k1 - 1
    if k < 0:
        raise ValueError("target_probs needs at least one position (k + 1 >= 1)")
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    if draft_tokens.shape != (s, k):
        raise ValueError(f"draft_tokens must be [S, k] = {(s, k)}, got {draft_tokens.shape}")
    if draft_probs is not None and jnp.shape(draft_probs) != (s, k, v):
        raise ValueError(f"draft_probs must be [S, k, V] = {(s, k, v)}, got {jnp.shape(draft_probs)}")
    # Out-of-range ids (e.g. -1 padding beyond num_draft) only ever index; clip them so the gathers stay in bounds.
    x = jnp.clip(draft_tokens, 0, v - 1)
    nd = jnp.full((s,), k, jnp.int32) if num_draft is None else jnp.clip(jnp.asarray(num_draft, jnp.int32), 0, k)

    q_sum = jnp.sum(q, axis=-1)  # [S, k+1]
    q_sum = jnp.where(q_sum > 0, q_sum, 1.0)
    q_x = jnp.take_along_axis(q[:, :k], x[..., None], axis=-1)[..., 0] / q_sum[:, :k]  # [S, k]
    if draft_probs is None:
        p_x = jnp.ones((s, k), jnp.float32)
    else:
        p = jnp.maximum(jnp.asarray(draft_probs, jnp.float32), 0.0)
        p_sum = jnp.sum(p, axis=-1)
        p_sum = jnp.where(p_sum > 0, p_sum, 1.0)
        p_x = jnp.take_along_axis(p, x[..., None], axis=-1)[..., 0] / p_sum

    # One uniform draw per row covers both the k acceptance tests and the Gumbel noise of the final draw (one RNG
    # site keeps compile time down); batches where every row is greedy use no randomness and skip it.
    keys, per_row = _row_keys(key, s)
    tiny = jnp.finfo(jnp.float32).tiny

    def draw() -> jax.Array:
        if per_row:
            return jax.vmap(lambda kk: jax.random.uniform(kk, (k + v,), jnp.float32, tiny, 1.0))(keys)
        return jax.random.uniform(keys, (s, k + v), jnp.float32, tiny, 1.0)

    if greedy is None:
        rand = draw()
    else:
        greedy = jnp.asarray(greedy, jnp.bool_)
        rand = lax.cond(jnp.all(greedy), lambda: jnp.full((s, k + v), 0.5, jnp.float32), draw)
    u = rand[:, :k]
    gumbel = -jnp.log(-jnp.log(rand[:, k:]))  # u in [tiny, 1): finite, as jax.random.gumbel

    accept = u * p_x < q_x  # P = min(1, q/p), no division
    if greedy is not None:
        tgt_argmax = _argmax(q)  # [S, k+1]; first index of the max, as the sampler's greedy path
        accept = jnp.where(greedy[:, None], x == tgt_argmax[:, :k], accept)
    pos_k = lax.broadcasted_iota(jnp.int32, (s, k), 1)
    accept = accept & (pos_k < nd[:, None])
    n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)  # leading accepts

    # The one extra token, from target position n: the bonus (n == num_draft) draws from q_n, a rejection from the
    # residual (q_n - p_n)+. Only position n is gathered, so no [S, k, V] residual is formed.
    q_n = jnp.take_along_axis(q, n[:, None, None], axis=1)[:, 0] / jnp.take_along_axis(q_sum, n[:, None], axis=1)
    bonus = n >= nd
    if k == 0:
        resid = q_n
    else:
        n_d = jnp.minimum(n, k - 1)  # the rejected draft position (clamped for bonus rows, whose residual is unused)
        if draft_probs is None:
            x_n = jnp.take_along_axis(x, n_d[:, None], axis=1)
            resid = jnp.where(lax.broadcasted_iota(jnp.int32, (s, v), 1) == x_n, 0.0, q_n)
        else:
            p_n = jnp.take_along_axis(p, n_d[:, None, None], axis=1)[:, 0] / jnp.take_along_axis(
                p_sum, n_d[:, None], axis=1
            )
            resid = jnp.maximum(q_n - p_n, 0.0)
    z = jnp.sum(resid, axis=-1)
    w = jnp.where((bonus | (z <= RESIDUAL_EPS))[:, None], q_n, resid)
    logw = jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1.0)), -jnp.inf)
    final = _argmax(logw + gumbel)
    if greedy is not None:
        final = jnp.where(greedy, jnp.take_along_axis(tgt_argmax, n[:, None], axis=1)[:, 0], final)

    pos = lax.broadcasted_iota(jnp.int32, (s, k + 1), 1)
    drafts = jnp.concatenate([draft_tokens, jnp.zeros((s, 1), jnp.int32)], axis=1)
    emitted = jnp.where(pos < n[:, None], drafts, jnp.where(pos == n[:, None], final[:, None], -1))
    return emitted.astype(jnp.int32), n
