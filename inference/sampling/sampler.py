"""Batched, jittable token sampling with vLLM semantics.

Everything here runs inside the model's jitted step on a batch of S rows (one row per sequence being decoded):
no Python loops over rows, no host syncs, static shapes. The host-side builder `SamplingTensors.from_params` turns
per-request `SamplingParams` into small per-row arrays once per step.

Semantics (vLLM v1, `vllm/v1/sample/sampler.py` + `ops/topk_topp_sampler.py`):

-1. Structured outputs and allowed_token_ids: where the batch carries `SamplingTensors.token_mask`, tokens a row's
   grammar or allowed list forbids are set to -inf first (inference/sampling/token_mask.py), so everything below,
   logprobs included, sees only allowed ones.
0. Sparse logit edits (inference/sampling/logit_bias.py: bad words, min_tokens, logit_bias) when
   the batch carries `SamplingTensors.logit_bias`, then
   penalties (vLLM's `apply_penalties`), on the raw logits of every row, greedy ones included, when the batch carries
   `SamplingTensors.penalties`: a token present in the prompt or the output has its logit divided by the row's
   repetition penalty if positive, else multiplied by it; then logit -= frequency * count_in_output
   + presence * (count_in_output > 0). The counts are built inside the jit from the padded token ids.
1. Greedy rows (temperature < 1e-5) take the argmax of the raw logits; filters never apply to them.
2. Other rows: logits / temperature, then
   a. min-p: drop tokens with prob < min_p * max prob (vLLM applies min-p as an argmax-invariant logits processor
      *before* top-k/top-p; min-p and top-k commute, but top-p is computed on the distribution renormalised after
      min-p and top-k);
   b. top-k: keep tokens whose logit is >= the k-th largest logit (ties with the k-th value are all kept, exactly
      like vLLM's `logits_sort < kth_value` mask);
   c. top-p: keep token i iff the probability mass of the tokens ranked strictly above it is < top_p, i.e. the
      smallest prefix (by probability) whose mass reaches top_p, including the token that crosses the threshold;
      the most likely token is always kept. Tokens tied with the last kept one are kept too (vLLM's ascending sort
      splits such ties arbitrarily; the tie case has probability zero for real logits).
   d. sample with the row's key by Gumbel-max on the filtered logits (same distribution as vLLM's exponential race /
      `jax.random.categorical`).

Implementation notes (why it looks the way it does):

* No full sort. On CPU a sort of [32, 49152] f32 costs more than the decode step itself. Top-k and top-p only need
  one *threshold* per row (keep x >= tau). The fast path reads both from the row's `FILTER_CANDIDATES` largest
  logits (`lax.top_k`, a small fraction of a sort): the k-th value directly, the top-p crossing point from a
  cumulative sum over the candidates. Rows the candidates cannot decide (top_k > FILTER_CANDIDATES, or a top-p set
  larger than the candidates, e.g. a flat distribution) use an exact 32-step bisection on the float's
  order-preserving uint32 image (slower than the fast path), inside a `lax.cond` so it runs only when such a row
  exists. The bisection returns a value present in the row, so both paths keep the same set.
* `use_filters` is static: with False none of the above is traced.
* Gumbel noise is drawn only when some row samples (a `lax.cond`), and argmax is max + first-index-of-max, which XLA
  CPU runs several times faster than its variadic argmax reduction.
* Per-row keys come from (seed, step) only: `fold_in(key(seed), step)` with the threefry2x32 implementation named
  explicitly, so the same seed yields the same tokens whatever else is in the batch and whatever
  `jax_default_prng_impl` says. The engine should pass, for a request without `seed`, a random seed drawn once per
  request, and as `step` the index of the token being generated (number of tokens already generated).

Gumbel precision: noise comes from f32 uniforms (jax's "low" mode), so a token more than ~20 nats below the row's
best logit (probability ratio < ~2e-9) can never be drawn; this is far below anything observable.
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Callable, NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas.matmul.invariant_cpu import invariant_matmul, invariant_row_sum
from inference.sampling.logit_bias import LogitBiasTensors, apply_logit_bias
from inference.sampling.params import SAMPLING_EPS, SamplingParams
from inference.sampling.penalties import PenaltyTensors, apply_penalties
from inference.sampling.token_mask import apply_token_mask

#: The PRNG implementation every sampling key uses (raw u32[2] key data), whatever JAX's default: the rejection
#: sampler and the draft model wrap key data with it too.
PRNG_IMPL = "threefry2x32"
_U32_MASK = 0xFFFFFFFF
_U64_MASK = 0xFFFFFFFFFFFFFFFF
_sampling_row = operator.attrgetter("sampling_row")
_uses_filters = operator.attrgetter("uses_filters")
_uses_penalties = operator.attrgetter("uses_penalties")

#: How many of each row's largest logits the filter fast path looks at (`lax.top_k`, far cheaper than a full sort on
#: CPU). Rows with top_k above this, or whose top-p set needs more tokens, fall back to an exact bisection (slower),
#: run only when such a row exists.
FILTER_CANDIDATES = 256

def sampling_rows(params_list: Sequence[SamplingParams], seeds: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's sampling values (f64[n, 5]: temperature, top_k, top_p, min_p, processed logprobs, from the cached
    `SamplingParams.sampling_row`s, exact through float64) and its seed's key data (u32[n, 2]), in C loops."""
    n = len(params_list)
    values = np.array(list(map(_sampling_row, params_list)), np.float64).reshape(n, 5)
    seed = np.fromiter(map(operator.and_, map(int, seeds), itertools.repeat(_U64_MASK)), np.uint64, n)
    seed_key = np.empty((n, 2), np.uint32)
    seed_key[:, 0] = seed >> np.uint64(32)
    seed_key[:, 1] = seed & np.uint64(_U32_MASK)
    return values, seed_key


@flax.struct.dataclass
class SamplingTensors:
    """Per-row sampling parameters for a batch of S rows (a pytree of plain arrays, so it can cross `jit`).

    Attributes:
      temperature: f32[S]; < SAMPLING_EPS marks a greedy row (padding rows are greedy).
      top_k: i32[S]; 0 = off (values >= vocab size are off too).
      top_p: f32[S]; 1 = off.
      min_p: f32[S]; 0 = off.
      seed_key: u32[S, 2]; raw threefry2x32 key data of the row's seed: [seed >> 32, seed & 0xffffffff] for the seed
        taken modulo 2**64, which equals `jax.random.key_data(jax.random.key(seed))` for 0 <= seed < 2**32.
      step: i32[S]; folded into the seed key to give this step's key (`keys()`).
      processed_logprobs: bool[S]; True where the request asked for logprobs_mode="processed".
      penalties: PenaltyTensors, or None when no row uses a penalty. None is part of the pytree structure, so it acts
        as a static flag: batches without penalties trace and compile exactly the step they did before penalties.
      token_mask: i32[S, ceil(V / 32)] bitmask of structured outputs and allowed lists (inference/sampling/
        token_mask.py; rows without either all ones), or None when no row has one: a static flag like `penalties`.
      mask_in_raw: bool[S], with `token_mask` (None without it): rows whose raw logprobs see the mask (grammar
        rows); False for a row whose mask is only its allowed list, which vLLM applies after the raw logprobs.
      logit_bias: LogitBiasTensors (logit_bias, bad_words, min_tokens), or None when no row has
        an edit this step; the same static flag.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed_key: jax.Array
    step: jax.Array
    processed_logprobs: jax.Array
    penalties: PenaltyTensors | None = None
    token_mask: jax.Array | None = None
    mask_in_raw: jax.Array | None = None
    logit_bias: LogitBiasTensors | None = None

    @classmethod
    def from_params(
        cls,
        params_list: Sequence[SamplingParams],
        seeds: Sequence[int] | None,
        steps: Sequence[int],
        pad_to: int,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        token_mask: np.ndarray | None = None,
        logit_bias: LogitBiasTensors | None = None,
        mask_in_raw: np.ndarray | None = None,
        rows: tuple[np.ndarray, np.ndarray] | None = None,
        uses_penalties: bool | None = None,
    ) -> SamplingTensors:
        """Build numpy per-row arrays for `params_list`, padded with greedy rows to `pad_to` rows.

        Args:
          params_list: one SamplingParams per live row, in batch order.
          seeds: the row's seed: `params.seed`, or for requests without one a seed the engine drew once per request
            (any Python int; it is reduced modulo 2**64).
          steps: the index of the token each row is generating (0 for the first generated token). Keys depend only
            on (seed, step), which is what makes seeded requests reproducible across batch compositions.
          pad_to: total number of rows (>= len(params_list)); the jitted step's static batch size.
          prompt_token_ids, output_token_ids: each row's prompt and generated tokens; required only when some row
            uses a penalty (`needs_penalties`), and only then read: otherwise `penalties` is None.
          token_mask: the step's bitmask [pad_to, ceil(V / 32)] (grammars, allowed lists), or None (neither).
          logit_bias: the rows' sparse edits (`LogitBiasTensors.from_rows`, padded to `pad_to`), or None.
          mask_in_raw: with `token_mask`, the rows whose raw logprobs see it (`token_mask.restrict_rows`); None:
            all of them.
          rows: `sampling_rows(params_list, seeds)` when the caller keeps them (the engine's `InputRows`; `seeds` is
            then not read and may be None); None: made here.
          uses_penalties: whether some row uses a penalty, when the caller keeps it (the engine's
            `SamplingParams.needs` bits); None: `needs_penalties(params_list)`, a loop over the rows.

        Greedy rows get top_k=0, top_p=1, min_p=0 so they never pay for or are affected by filtering.
        Host cost is a handful of small numpy writes per row (the arrays are transferred by the jit call).
        """
        n = len(params_list)
        if rows is None and (seeds is None or len(seeds) != n) or len(steps) != n:
            raise ValueError(f"params_list, seeds and steps must have equal lengths, got {n}, "
                             f"{None if seeds is None else len(seeds)}, {len(steps)}")
        if pad_to < n:
            raise ValueError(f"pad_to must be >= the number of rows ({n}), got {pad_to}")
        temperature = np.zeros(pad_to, np.float32)
        top_k = np.zeros(pad_to, np.int32)
        top_p = np.ones(pad_to, np.float32)
        min_p = np.zeros(pad_to, np.float32)
        seed_key = np.zeros((pad_to, 2), np.uint32)
        step = np.zeros(pad_to, np.int32)
        processed = np.zeros(pad_to, np.bool_)
        if n:
            values, seed_key[:n] = rows if rows is not None else sampling_rows(params_list, seeds)
            temperature[:n], top_k[:n], top_p[:n], min_p[:n] = values[:, 0], values[:, 1], values[:, 2], values[:, 3]
            processed[:n] = values[:, 4] != 0
        step[:n] = steps
        penalties = None
        if needs_penalties(params_list) if uses_penalties is None else uses_penalties:
            if prompt_token_ids is None or output_token_ids is None:
                raise ValueError("a row uses repetition/presence/frequency penalties: pass prompt_token_ids and "
                                 "output_token_ids")
            penalties = PenaltyTensors.from_params(params_list, prompt_token_ids, output_token_ids, pad_to)
        if token_mask is not None and token_mask.shape[0] != pad_to:
            raise ValueError(f"token_mask has {token_mask.shape[0]} rows, the batch {pad_to}")
        if token_mask is None:
            mask_in_raw = None
        elif mask_in_raw is None:
            mask_in_raw = np.ones(pad_to, np.bool_)
        return cls(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed_key=seed_key,
            step=step,
            processed_logprobs=processed,
            penalties=penalties,
            token_mask=token_mask,
            mask_in_raw=mask_in_raw,
            logit_bias=logit_bias,
        )

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    def keys(self) -> jax.Array:
        """u32[S, 2] raw key data of `fold_in(key(seed), step)` per row (jittable, no host work)."""
        return jax.random.key_data(row_keys(self))


class SamplerOutput(NamedTuple):
    """Tokens and their logprobs for one step.

    tokens: i32[S]; logprob: f32[S] logprob of the sampled token; top_ids: i32[S, num_top] and top_logprobs:
    f32[S, num_top], the num_top most likely tokens in descending order; rank: i32[S] the sampled token's rank
    (`token_rank`). logprob and rank are None where logprobs were not asked for (`num_top` 0). Which distribution
    the logprobs refer to is per row: raw logits, or the processed (tempered + filtered) ones where
    `processed_logprobs` is set.
    """

    tokens: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    rank: jax.Array | None = None


def needs_filters(params_list: Sequence[SamplingParams]) -> bool:
    """The static `use_filters` flag for a batch: True iff some non-greedy row uses top-k, top-p or min-p."""
    return any(map(_uses_filters, params_list))


def needs_penalties(params_list: Sequence[SamplingParams]) -> bool:
    """True iff some row uses repetition, presence or frequency penalties (then `SamplingTensors.penalties` is set)."""
    return any(map(_uses_penalties, params_list))


def row_keys(t: SamplingTensors) -> jax.Array:
    """Typed PRNG keys [S]: `fold_in(key(seed), step)` per row, threefry2x32 regardless of the global default."""
    base = jax.random.wrap_key_data(jnp.asarray(t.seed_key, jnp.uint32), impl=PRNG_IMPL)
    return jax.vmap(jax.random.fold_in)(base, jnp.asarray(t.step, jnp.int32))


def _argmax(x: jax.Array) -> jax.Array:
    """First index of the row maximum (like jnp.argmax), i32[S].

    max + min-index-where-equal is several times faster than XLA CPU's variadic argmax reduce on [32, 49152]. Rows whose
    max is NaN would match nothing; they are clamped to a valid id so no caller ever sees an out-of-range token.
    """
    v = x.shape[-1]
    m = jnp.max(x, axis=-1, keepdims=True)
    idx = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == m, idx, v), axis=-1)
    return jnp.minimum(first, v - 1).astype(jnp.int32)


def _ordered_u32(x: jax.Array) -> jax.Array:
    """Monotone map f32 -> u32 (a < b  =>  f(a) < f(b); -0.0 maps just below +0.0). NaN-free input assumed."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((bits >> 31) == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_ordered_u32(u: jax.Array) -> jax.Array:
    """Inverse of `_ordered_u32`."""
    bits = jnp.where(u >= jnp.uint32(0x80000000), u & jnp.uint32(0x7FFFFFFF), ~u)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _bisect_threshold(x: jax.Array, ok: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Per row of x f32[S, V], the largest value tau of the row with ok(tau) true; f32[S].

    `ok(tau f32[S]) -> bool[S]` must be monotone non-increasing in tau and true at the row minimum (it is for
    "count(x >= tau) >= k" with k <= V and for "mass(x >= tau) >= p * total" with p <= 1). The search runs on the
    order-preserving u32 image of the floats; 32 halvings cover the whole u32 range, so the answer is exact, and
    since ok can only change value at values present in the row, it is one of the row's values.
    """
    keys = _ordered_u32(x)
    lo = jnp.min(keys, axis=-1)
    hi = jnp.max(keys, axis=-1)

    def body(_, carry):
        lo, hi = carry
        span = hi - lo
        mid = lo + span // 2 + (span & 1)  # ceil midpoint without u32 overflow
        good = ok(_from_ordered_u32(mid))
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

    lo, _ = lax.fori_loop(0, 32, body, (lo, hi))
    return _from_ordered_u32(lo)


def _filter(x: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array, *,
            invariant: bool = False) -> jax.Array:
    """Apply min-p, top-k, top-p (vLLM order) to tempered logits x f32[S, V]; dropped tokens become -inf.

    Top-k and top-p each reduce to a per-row threshold (keep x >= tau). The fast path reads both from the row's
    `FILTER_CANDIDATES` largest values (`lax.top_k`, sorted): the k-th value directly, and the top-p crossing point
    from a cumulative sum over the candidates. A row whose k exceeds the candidate count, or whose top-p set is not
    contained in the candidates (flat distributions, top_p near 1), is resolved by an exact bisection over the full
    row instead; `lax.cond` runs that only when some row needs it. Both paths give the same set.
    `invariant` (static; batch-invariant mode): top-p's float sums in a fixed order (`invariant_row_sum`, and the
    cumulative sum as an fma chain against a triangle of ones), so which tokens a row keeps cannot depend on the batch.
    """
    row_sum = invariant_row_sum if invariant else functools.partial(jnp.sum, axis=-1)
    s, v = x.shape
    neg_inf = jnp.float32(-jnp.inf)
    row_max = jnp.max(x, axis=-1, keepdims=True)
    # Probabilities relative to the row max (p / p_max), so min-p is `rel < min_p`; the max token is always kept.
    rel = jnp.exp(x - row_max)
    x = jnp.where(rel >= min_p[:, None], x, neg_inf)
    c = min(v, FILTER_CANDIDATES)
    cand, _ = lax.top_k(x, c)  # f32[S, c], descending; -inf where min-p dropped

    # top-k: tau_k = k-th largest value (ties with it are kept).
    k_on = (top_k > 0) & (top_k < v)
    k = jnp.where(k_on, top_k, 1)
    k_fast = jnp.take_along_axis(cand, jnp.clip(k - 1, 0, c - 1)[:, None], axis=-1)[:, 0]
    k_slow_rows = k_on & (k > c)

    def k_slow() -> jax.Array:
        tau = _bisect_threshold(x, lambda t: jnp.sum(x >= t[:, None], axis=-1, dtype=jnp.int32) >= k)
        return jnp.where(k_slow_rows, tau, k_fast)

    tau_k = lax.cond(jnp.any(k_slow_rows), k_slow, lambda: k_fast)
    tau_k = jnp.where(k_on, tau_k, neg_inf)
    x = jnp.where(x >= tau_k[:, None], x, neg_inf)

    # top-p on the distribution renormalised over what min-p and top-k kept: keep the sorted prefix up to and
    # including the first token at which the cumulative mass reaches top_p; tau_p is that token's value.
    p_on = top_p < 1.0
    mass = jnp.where(x > neg_inf, rel, 0.0)
    need = top_p * row_sum(mass)
    kept = jnp.exp(cand - row_max) * (cand >= tau_k[:, None])
    cum = invariant_matmul(kept, jnp.triu(jnp.ones((c, c), jnp.float32))) if invariant else jnp.cumsum(kept, axis=-1)
    reached = cum >= need[:, None]
    first = jnp.minimum(jnp.sum(~reached, axis=-1), c - 1)
    p_fast = jnp.take_along_axis(cand, first[:, None], axis=-1)[:, 0]
    p_slow_rows = p_on & ~reached[:, -1]

    def p_slow() -> jax.Array:
        tau = _bisect_threshold(
            x, lambda t: row_sum(jnp.where(x >= t[:, None], mass, 0.0)) >= need
        )
        return jnp.where(p_slow_rows, tau, p_fast)

    tau_p = lax.cond(jnp.any(p_slow_rows), p_slow, lambda: p_fast)
    tau_p = jnp.where(p_on, tau_p, neg_inf)
    return jnp.where(x >= tau_p[:, None], x, neg_inf)


def process_logits(logits: jax.Array, t: SamplingTensors, *, use_filters: bool, invariant: bool = False) -> jax.Array:
    """The logits each row actually samples from, f32[S, V].

    First, when `t.token_mask` is set, tokens a row's grammar forbids become -inf (before anything else, so the
    edits, penalties, temperature and filters only ever see allowed tokens). Then, when `t.logit_bias` is set, the
    sparse edits (inference/sampling/logit_bias.py), then, when `t.penalties` is set, the penalties, on every row
    (vLLM V1's order, before greedy and temperature).
    Sampling rows: logits / temperature with min-p, top-k, top-p applied (dropped tokens = -inf) when `use_filters`.
    Greedy rows: the (penalised) logits unchanged (temperature treated as 1, no filters), so their argmax is vLLM's
    greedy token and, without penalties, their "processed" logprobs equal the raw ones.
    `use_filters` is static; with False the filter pass (and its cost) is skipped entirely and the row filters in `t`
    are ignored, so pass False only when `needs_filters(...)` is False. `invariant` (static): batch-invariant mode's
    fixed-order sums in the filters.
    """
    return _processed(apply_token_mask(logits.astype(jnp.float32), t.token_mask), t, use_filters=use_filters,
                      invariant=invariant)


def _processed(x: jax.Array, t: SamplingTensors, *, use_filters: bool, invariant: bool = False) -> jax.Array:
    """`process_logits` after the token mask (x is f32 and already masked)."""
    if t.logit_bias is not None:
        x = apply_logit_bias(x, t.logit_bias)
    if t.penalties is not None:
        x = apply_penalties(x, t.penalties)
    greedy = t.temperature < SAMPLING_EPS
    temp = jnp.where(greedy, 1.0, t.temperature).astype(jnp.float32)
    x = x / temp[:, None]
    if use_filters:
        x = _filter(
            x,
            jnp.where(greedy, 0, t.top_k).astype(jnp.int32),
            jnp.where(greedy, 1.0, t.top_p).astype(jnp.float32),
            jnp.where(greedy, 0.0, t.min_p).astype(jnp.float32),
            invariant=invariant,
        )
    return x


def _sample_processed(x: jax.Array, t: SamplingTensors) -> jax.Array:
    """Gumbel-max on processed logits for sampling rows, plain argmax for greedy rows; i32[S]."""
    greedy = t.temperature < SAMPLING_EPS

    def noise() -> jax.Array:
        return jax.vmap(lambda key: jax.random.gumbel(key, x.shape[-1:], jnp.float32))(row_keys(t))

    # All-greedy batches skip the RNG (a real share of a CPU step at V=49152). Only the noise is inside the cond: a
    # cond that takes the [S, V] logits as an operand measured several times slower on XLA CPU.
    g = lax.cond(jnp.all(greedy), lambda: jnp.zeros(x.shape, jnp.float32), noise)
    return _argmax(jnp.where(greedy[:, None], x, x + g))


def sample(logits: jax.Array, t: SamplingTensors, *, use_filters: bool) -> jax.Array:
    """Sample one token per row: i32[S]. `use_filters` is static (see `process_logits`)."""
    return _sample_processed(process_logits(logits, t, use_filters=use_filters), t)


def compute_logprobs(
    logits: jax.Array, tokens: jax.Array, num_top: int, *, invariant: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logprobs under softmax(logits): (token_logprob f32[S], top_ids i32[S, num_top], top_logprobs f32[S, num_top]).

    `num_top` is static (0 gives empty [S, 0] arrays). Top entries are in descending logprob order. Used for raw
    sample logprobs and for prompt logprobs (pass prompt logits [T, V] and the next prompt tokens [T]). If fewer than
    num_top tokens have finite logits (processed mode), the tail of top_* holds -inf with arbitrary ids.
    `invariant` (static; batch-invariant mode) sums the exponentials in a fixed order (`invariant_row_sum`).
    """
    # log_softmax(x)_i = (x_i - max) - log(sum(exp(x - max))), evaluated only at the entries we return: top-k runs
    # on the logits themselves (same order), so no [S, V] logprob array is materialised.
    x = logits.astype(jnp.float32)
    s = x.shape[0]
    row_max = lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    exps = jnp.exp(x - row_max)
    log_z = jnp.log(invariant_row_sum(exps)[:, None] if invariant else jnp.sum(exps, axis=-1, keepdims=True))
    token_x = jnp.take_along_axis(x, tokens.astype(jnp.int32)[:, None], axis=-1)
    token_lp = ((token_x - row_max) - log_z)[:, 0]
    if num_top == 0:
        return token_lp, jnp.zeros((s, 0), jnp.int32), jnp.zeros((s, 0), jnp.float32)
    top_x, top_ids = lax.top_k(x, num_top)
    return token_lp, top_ids.astype(jnp.int32), (top_x - row_max) - log_z


def token_rank(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """i32[S]: each row's token's 1-based rank under softmax(logits), counted as vLLM's `batched_count_greater_than`
    does (tokens whose logprob is >= the token's own, itself included; ties share the larger rank). Logits and
    logprobs differ by a per-row constant, so the count runs on the logits."""
    x = logits.astype(jnp.float32)
    token_x = jnp.take_along_axis(x, tokens.astype(jnp.int32)[:, None], axis=-1)
    return jnp.sum(x >= token_x, axis=-1, dtype=jnp.int32)


def compute_processed_logprobs(
    logits: jax.Array, tokens: jax.Array, t: SamplingTensors, num_top: int, *, use_filters: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`compute_logprobs` under the distribution actually sampled from (temperature + filters).

    Filtered-out tokens have logprob -inf. Greedy rows get the raw logprobs (their processed logits are the raw ones).
    """
    return compute_logprobs(process_logits(logits, t, use_filters=use_filters), tokens, num_top)


def sample_with_logprobs(
    logits: jax.Array, t: SamplingTensors, *, use_filters: bool, num_top: int, invariant: bool = False
) -> SamplerOutput:
    """`sample` plus logprobs, sharing one processed-logits pass. `use_filters` and `num_top` are static.

    Each row's logprobs come from the raw logits or, where `t.processed_logprobs` is set, from the processed ones;
    the choice is a per-row select, so a mixed batch still does one log-softmax and one top-k. A structured-outputs
    mask applies to both: "raw" is then the log-softmax of the masked logits (the constrained distribution before
    temperature and filters), as in vLLM, where the grammar bitmask is applied before the sampler; a row whose mask
    is only its `allowed_token_ids` (`t.mask_in_raw` False) keeps the unmasked raw logprobs, as vLLM's allowed list
    comes after them. The sampled tokens' logprobs and ranks come with num_top > 0 only: a step that returns no
    logprobs skips the log-softmax's passes over [S, V].
    """
    logits = logits.astype(jnp.float32)
    masked = apply_token_mask(logits, t.token_mask)
    x = _processed(masked, t, use_filters=use_filters, invariant=invariant)
    tokens = _sample_processed(x, t)
    if num_top == 0:  # no logprobs asked: their [S, V] passes (a log-softmax) would be computed and never read
        s = tokens.shape[0]
        return SamplerOutput(tokens=tokens, logprob=None, top_ids=jnp.zeros((s, 0), jnp.int32),
                             top_logprobs=jnp.zeros((s, 0), jnp.float32))
    raw = masked
    if t.token_mask is not None:
        in_raw = jnp.asarray(t.mask_in_raw)
        raw = jax.lax.cond(jnp.all(in_raw), lambda: masked, lambda: jnp.where(in_raw[:, None], masked, logits))
    src = jnp.where(jnp.asarray(t.processed_logprobs)[:, None], x, raw)
    token_lp, top_ids, top_lp = compute_logprobs(src, tokens, num_top, invariant=invariant)
    # The rank costs one more [S, V] pass: only steps that return logprobs (num_top > 0) pay for it.
    return SamplerOutput(tokens=tokens, logprob=token_lp, top_ids=top_ids, top_logprobs=top_lp,
                         rank=token_rank(src, tokens) if num_top else None)
