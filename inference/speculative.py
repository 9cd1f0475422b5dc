"""Speculative decoding: the rejection-sampling verifier and the proposers that feed it.

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

import abc
import math
import weakref
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from inference.sampler import SamplingTensors, _argmax, process_logits

__all__ = [
    "RESIDUAL_EPS",
    "AdaptiveK",
    "DraftModelProposer",
    "DraftProposal",
    "NgramProposer",
    "probs_from_logits",
    "rejection_sample",
]

#: Residual masses Z = sum((q - p)+) at or below this are treated as zero and the recovery token is drawn from q
#: instead of the residual. Why this is harmless: with normalised q and p the probability of rejecting at a position
#: is sum((p - q)+) = Z, so replacing the residual by q there moves the output distribution by at most Z <= 1e-6 in
#: total variation; and a residual that small is f32 cancellation noise of q - p, not a distribution worth sampling.
RESIDUAL_EPS = 1e-6

_PRNG_IMPL = "threefry2x32"  # same explicit implementation as the sampler, for raw u32 key data


def probs_from_logits(logits: jax.Array, sampling_tensors: SamplingTensors, use_filters: bool) -> jax.Array:
    """Softmax of `inference.sampler.process_logits`: the distribution each row actually samples from, f32[..., V].

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
        typed = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32), impl=_PRNG_IMPL)
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


# ----------------------------------------------------------------------------------------------------------------
# Proposers (host side).


class NgramProposer:
    """Prompt-lookup decoding: guess that the text continues as it did after the last time its tail occurred.

    Why: on summarisation, code editing, RAG and chat with quoted context the output often copies spans of the prompt
    (or of itself), and finding them costs no model at all. The proposal is deterministic, so verify it with
    `rejection_sample(..., draft_probs=None, ...)` (p is one-hot on the proposed token).

    `propose(tokens)` takes the sequence's own tokens (prompt + generated so far), looks for the most recent earlier
    occurrence of its last n tokens, longest n first (n_max down to n_min), and returns up to k tokens that followed
    that occurrence; [] if no suffix of length >= n_min occurs earlier. "Earlier" means the occurrence is followed by
    at least one token inside the sequence, so the suffix never matches itself. The continuation stops at the end of
    the sequence, so a match near the end yields fewer than k tokens (with `extend_periodic=True` it is instead
    continued by the same copy rule, i.e. the repetition it found is assumed to keep going, giving k tokens).

    Cost: one vectorised numpy comparison of the last token against the whole sequence, then the candidate set only
    shrinks as the match is extended backwards (O(L + n_max * matches)): ~10 us for 4000 tokens given as a numpy
    array, ~0.3 ms given as a Python list (the conversion dominates; keep an array per sequence if that matters).
    """

    def __init__(self, n_max: int = 3, n_min: int = 1, k: int = 4, *, extend_periodic: bool = False) -> None:
        if not (isinstance(n_min, int) and isinstance(n_max, int) and 1 <= n_min <= n_max):
            raise ValueError(f"need integers 1 <= n_min <= n_max, got n_min={n_min!r}, n_max={n_max!r}")
        if not (isinstance(k, int) and k >= 1):
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        self.n_max = n_max
        self.n_min = n_min
        self.k = k
        self.extend_periodic = extend_periodic

    def find_match(self, tokens: Sequence[int] | np.ndarray) -> tuple[int, int] | None:
        """(start, n) of the chosen earlier occurrence of the last n tokens (longest n, then most recent), or None."""
        arr = np.asarray(tokens)
        length = arr.shape[0]
        if length < self.n_min + 1:
            return None
        # Candidate end positions e of an occurrence (e <= L - 2 so a token follows it), matching on the last token.
        ends = np.flatnonzero(arr[: length - 1] == arr[length - 1])
        best: tuple[int, int] | None = None
        n = 1
        while ends.size:
            if n >= self.n_min:
                best = (int(ends[-1]) - n + 1, n)  # ends is ascending: the last one is the most recent
            if n == self.n_max or n == length - 1:
                break
            ends = ends[ends >= n]  # room for one more token before the occurrence
            ends = ends[arr[ends - n] == arr[length - 1 - n]]
            n += 1
        return best

    def propose(self, tokens: Sequence[int] | np.ndarray) -> list[int]:
        """Up to k proposed next tokens for one sequence (possibly [])."""
        match = self.find_match(tokens)
        if match is None:
            return []
        start, n = match
        begin = start + n
        if not self.extend_periodic:
            return [int(t) for t in np.asarray(tokens)[begin : begin + self.k]]
        out = [int(t) for t in np.asarray(tokens)[begin:]]
        length = len(tokens)
        # ext[L + i] = ext[begin + i]; begin + i < L + i, so every copied token already exists.
        while len(out) < self.k:
            i = len(out)
            out.append(int(tokens[begin + i]) if begin + i < length else out[begin + i - length])
        return out[: self.k]

    def propose_batch(self, token_lists: Sequence[Sequence[int] | np.ndarray]) -> list[list[int]]:
        """`propose` for each sequence (e.g. `[seq.token_ids for seq in seqs]`)."""
        return [self.propose(t) for t in token_lists]


class DraftProposal(NamedTuple):
    """What a model-backed proposer returns for a batch of sequences.

    token_ids: per sequence, the proposed tokens (0..k of them; fewer when the sequence is near its token budget).
    draft_probs: f32[S, k, V], the *processed* draft distribution (`probs_from_logits` with the request's
      SamplingTensors) each proposed token was sampled from; row i, position j is meaningful for
      j < len(token_ids[i]), the rest is padding. Greedy rows may hold anything (they are verified by argmax).
    """

    token_ids: list[list[int]]
    draft_probs: jax.Array | None


class DraftModelProposer(abc.ABC):
    """Interface of a draft-model proposer; the implementation is `inference.draft_model.PagedDraftProposer`.

    The engine calls `propose(seqs, pad_to)` once per step, after scheduling and before the target's verification
    pass, with the step's sequences in batch order (`inference.sequence.Sequence` objects: it reads `token_ids`,
    `params`, `seed`, `pages`). The scheduler has reserved `len(seq.spec_tokens)` draft slots (and their pages) for
    each sequence that speculates; the proposer returns exactly that many tokens for those and none for the others.
    It runs the draft model autoregressively (keeping its own KV cache), *sampling* each token from
    `probs_from_logits(draft_logits, tensors, use_filters)` with the request's own sampling parameters (greedy rows
    take the argmax), and returns the tokens with those probabilities in the target's row layout [pad_to, k, V]
    (None when every speculating row is greedy: they are verified by argmax). The runner then calls
    `rejection_sample(target_probs, proposal.draft_probs, tokens, keys, greedy=..., num_draft=...)`.

    Why the probabilities and not just the tokens: the acceptance test needs p(x) for each draft token and the
    residual needs the whole p at the rejected position; sampling the draft from anything other than the returned p
    breaks exactness. A draft key per (seed, step, position) that differs from the verification key keeps the draft
    and the acceptance test independent, which the proof assumes.
    """

    k: int

    @abc.abstractmethod
    def propose(self, seqs: Sequence[object]) -> DraftProposal:
        """Propose up to `k` tokens per sequence; see the class docstring for the contract."""

    def forget(self, seq: object) -> None:  # noqa: B027
        """Hook when `seq` is preempted (its pages released): drop what the draft's cache holds for it."""

    def on_accepted(self, seqs: Sequence[object], num_accepted: Sequence[int]) -> None:  # noqa: B027
        """Hook after verification: roll the draft's own KV cache back to the accepted prefix. Default: nothing."""


class AdaptiveK:
    """Per-sequence draft length from an exponential moving average of the sequence's acceptance rate.

    Why: a draft token costs a proposal (a draft-model step, or nothing for prompt lookup) and a verification slot,
    and it pays only when accepted. With per-token acceptance rate a, the expected run of accepted drafts (with no
    cap) is a / (1 - a); proposing about that many (`k_for_rate`: ceil(a / (1 - a)), clipped to [1, k_max]) keeps k
    near where the next draft is still more likely than not to be used. So k shrinks while drafts are rejected and
    grows back when they are accepted. Each verification adds the observation accepted / trials, with trials =
    accepted + 1 at a rejection and = accepted when every draft survived; the EMA keeps `decay` of the old estimate.
    A new sequence starts at k_max (rate k_max / (k_max + 1)). State is kept per sequence object (weakly: finished
    sequences drop out).
    """

    def __init__(self, k_max: int, *, decay: float = 0.5) -> None:
        if not (isinstance(k_max, int) and k_max >= 1):
            raise ValueError(f"k_max must be an integer >= 1, got {k_max!r}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.k_max = k_max
        self.decay = decay
        self._rate: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @staticmethod
    def k_for_rate(rate: float, k_max: int) -> int:
        if rate >= 1.0:
            return k_max
        return max(1, min(k_max, math.ceil(rate / (1.0 - rate) - 1e-9)))

    def rate(self, seq: object) -> float:
        return self._rate.get(seq, self.k_max / (self.k_max + 1.0))

    def k(self, seq: object) -> int:
        """The number of drafts `seq` should get this step."""
        return self.k_for_rate(self.rate(seq), self.k_max)

    def update(self, seq: object, proposed: int, accepted: int) -> None:
        """Fold one verification (`accepted` of `proposed` drafts kept) into the sequence's rate."""
        if proposed <= 0:
            return
        trials = accepted + (1 if accepted < proposed else 0)
        self._rate[seq] = self.decay * self.rate(seq) + (1.0 - self.decay) * accepted / trials
