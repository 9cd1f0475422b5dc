"""One compiled step variant: a bucket shape plus the static flags a batch picks, the one fold that keeps those flags
few, and the warm-up run of a variant.

A jitted step compiles once per (shape, static arguments, pytree structure of its inputs). Besides the shape
(`inference/runtime/warmup.py`), a batch picks: sampling filters (top-k / top-p / min-p), sample logprobs, the
structured-outputs mask, penalties (whose token-id arrays also had a length bucket), prompt logprobs, and for a
verification step its drafts (with or without draft probabilities). Taken separately these multiply every shape
by 2 x 2 x 2 x (1 + penalty lengths) x 2. `fold_extras` folds three of them into one `extras` flag: a batch that
wants any of logprobs, a mask or penalties gets all three, as no-ops on the rows that did not ask (an all-ones mask
and penalty values 1, 0, 0 leave a row's logits exactly as they were; logprobs are only read for the rows that asked),
with the penalty ids padded to one length, the context. Filters stay their own flag in decode and verification
steps: they are the costly part of the sampler there. A prefill step runs both always (`StepFlags.of_batch`):
beside its T tokens the sampler's S rows cost little, and every prefill shape is then two variants (prompt
logprobs off / on). BENCHMARKS.md (compile budget) measures each fold.
The sparse logit edits (`logit_bias`, `bad_words`, `min_tokens`' stop-id bans) fold into the extras too, padded
to `FOLDED_EDITS` per row (padding ids are dropped by the scatter: a row's logits stay exactly as they were); a
row with more edits keeps its length bucket and compiles on first use. `allowed_token_ids` rides the token mask.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from inference.runtime.batch import ModelInput, SpecInput
from inference.runtime.runner import ModelRunner
from inference.runtime.warmup import StepShape
from inference.sampling.logit_bias import LogitBiasTensors, pow2_bucket
from inference.sampling.penalties import MIN_PENALTY_TOKENS, PenaltyTensors
from inference.sampling.sampler import SamplingTensors
from inference.sampling.token_mask import all_allowed


#: Sparse logit edits per row an extras step always carries (`fold_extras`): a request's logit_bias entries, its
#: bad-words bans and its min_tokens stop-id bans up to this many compile nothing new after warm-up.
FOLDED_EDITS = 64


@dataclasses.dataclass(frozen=True, order=True)
class StepFlags:
    """The static flags of a step besides its shape, after `fold_extras`."""

    use_filters: bool = False
    extras: bool = False  # sample logprobs, a token mask and penalties, all traced
    prompt_logprobs: bool = False

    @classmethod
    def of_batch(cls, use_filters: bool, logprobs: bool, token_mask: bool, penalties: bool,
                 prompt_logprobs: bool, prefill: bool = False, logit_edits: bool = False) -> "StepFlags":
        """The variant a batch runs: prompt logprobs come with the extras (their requests mostly ask for sample
        logprobs too, and it saves a variant per prefill shape). A prefill step (prompt chunks, no drafts) always
        runs filters and extras: they cost a few [S, V] passes over one row per sequence, small beside a step
        over its T tokens, and it leaves two variants per prefill shape (prompt logprobs off / on)."""
        if prefill:
            return cls(True, True, prompt_logprobs)
        return cls(use_filters, logprobs or token_mask or penalties or logit_edits or prompt_logprobs, prompt_logprobs)


@dataclasses.dataclass(frozen=True, order=True)
class StepVariant:
    """One compiled step: its shape, its flags, and for a verification step its draft slots."""

    shape: StepShape
    is_decode: bool
    flags: StepFlags = StepFlags()
    num_spec: int = 0  # > 0: a verification step with this many draft slots per sequence
    draft_probs: bool = False  # the drafts come with a draft model's probabilities (sampled drafts)


def penalty_length(max_model_len: int) -> int:
    """The one length of the penalties' token-id arrays under `fold_extras`: a prompt or an output never exceeds
    the context."""
    return pow2_bucket(max_model_len, MIN_PENALTY_TOKENS)


def fold_extras(sampling: SamplingTensors, flags: StepFlags, *, vocab_size: int, penalty_len: int,
                sharding: jax.sharding.Sharding | None = None) -> SamplingTensors:
    """`sampling` with the extras' parts present when `flags.extras` (an all-ones mask where no row is constrained,
    no-op penalties where no row has any, penalty ids padded to `penalty_len`, the sparse logit edits padded to
    `FOLDED_EDITS` or no-op ones), unchanged otherwise.

    `sharding` (the runner's `token_sharding`): the two large parts, the token mask [S, V/32] and the penalty ids
    [S, penalty_len], become device arrays committed there. The no-op ones are then made once per size and stay on
    the device, rather than crossing to it from numpy at every extras step (every prefill step); a real mask or real
    ids are put there too, so each leaf reaches the jitted step as the same kind of array in every step (jit keys a
    numpy argument apart from a committed one). The small per-row parts stay numpy, as `from_params` builds them.
    None: all numpy (tests that call the sampler directly)."""
    if not flags.extras:
        return sampling
    noop_mask, noop_in_raw, noop_pen, noop_edits = _noop_parts(sampling.num_rows, vocab_size, penalty_len, sharding)
    if sampling.token_mask is None:
        sampling = sampling.replace(token_mask=noop_mask, mask_in_raw=noop_in_raw)
    elif sharding is not None:
        sampling = sampling.replace(token_mask=jax.device_put(sampling.token_mask, sharding))
    sampling = sampling.replace(logit_bias=_fold_edits(sampling.logit_bias, noop_edits))
    pen = sampling.penalties
    if pen is None:
        return sampling.replace(penalties=noop_pen)
    if max(pen.prompt_ids.shape[1], pen.output_ids.shape[1]) > penalty_len:
        raise ValueError(f"penalty token ids of {pen.prompt_ids.shape[1]} / {pen.output_ids.shape[1]} exceed the "
                         f"folded length {penalty_len}; build it with penalty_length(max_model_len)")

    def pad(ids):
        return np.pad(np.asarray(ids), ((0, 0), (0, penalty_len - ids.shape[1])), constant_values=-1)

    ids = (pad(pen.prompt_ids), pad(pen.output_ids))
    if sharding is not None:
        ids = jax.device_put(ids, sharding)
    return sampling.replace(penalties=pen.replace(prompt_ids=ids[0], output_ids=ids[1]))


def _fold_edits(edits: LogitBiasTensors | None, noop: LogitBiasTensors) -> LogitBiasTensors:
    """The rows' sparse edits at `FOLDED_EDITS` per row (wider ones as they are), or the no-op edits."""
    if edits is None:
        return noop
    width = edits.ids.shape[1]
    if width >= FOLDED_EDITS:
        return edits
    pad = ((0, 0), (0, FOLDED_EDITS - width))
    return edits.replace(ids=np.pad(np.asarray(edits.ids), pad, constant_values=-1),
                         values=np.pad(np.asarray(edits.values), pad))


@functools.lru_cache(maxsize=64)
def _noop_parts(rows: int, vocab_size: int, penalty_len: int, sharding: jax.sharding.Sharding | None
                ) -> tuple[np.ndarray | jax.Array, np.ndarray, PenaltyTensors, LogitBiasTensors]:
    """An all-ones mask (seen by raw logprobs too), no-op penalties and edits for `rows` rows, built once per size
    (read-only: the step only reads them); the mask and the penalty ids on the device with `sharding`
    (`fold_extras`)."""
    mask = all_allowed(rows, vocab_size)
    in_raw = np.ones(rows, np.bool_)
    mask.flags.writeable = in_raw.flags.writeable = False
    pen = PenaltyTensors.from_params([], [], [], rows)
    ids = np.full((rows, penalty_len), -1, np.int32)
    ids.flags.writeable = False
    if sharding is not None:
        mask, ids = jax.device_put((mask, ids), sharding)
    edit_ids = np.full((rows, FOLDED_EDITS), -1, np.int32)
    edit_values = np.zeros((rows, FOLDED_EDITS), np.float32)
    edit_ids.flags.writeable = edit_values.flags.writeable = False
    return mask, in_raw, pen.replace(prompt_ids=ids, output_ids=ids), LogitBiasTensors(ids=edit_ids,
                                                                                        values=edit_values)


def warm_variants(runner: ModelRunner, variants: list[StepVariant], *, penalty_len: int) -> int:
    """Run each variant once on an input that reads and writes nothing (`ModelInput.empty`); returns how many new
    executables that compiled."""
    before = sum(runner.num_compilations().values())
    vocab = runner.config.vocab_size
    for v in variants:
        s = v.shape
        inp = ModelInput.empty(num_tokens=s.num_tokens, num_seqs=s.num_seqs, pages_per_seq=s.pages_per_seq,
                               max_q_len=s.max_q_len, num_groups=len(runner.group_caches))
        if v.num_spec:
            k = v.num_spec
            # A device array, as the draft's step returns it: jit keys a numpy argument apart from a jax.Array.
            # Committed to the runner's devices, as the draft runner's outputs are (jit keys committed apart too).
            probs = (jax.device_put(jnp.zeros((s.num_seqs, k, vocab), jnp.float32), runner.token_sharding)
                     if v.draft_probs else None)
            inp = inp.replace(spec=SpecInput(logits_indices=np.zeros((s.num_seqs, k + 1), np.int32),
                                             draft_tokens=np.zeros((s.num_seqs, k), np.int32),
                                             num_draft=np.zeros(s.num_seqs, np.int32), draft_probs=probs))
        sampling = fold_extras(SamplingTensors.from_params([], [], [], pad_to=s.num_seqs), v.flags,
                               vocab_size=vocab, penalty_len=penalty_len, sharding=runner.token_sharding)
        runner.execute(inp, sampling, is_decode=v.is_decode, use_filters=v.flags.use_filters,
                       logprobs=v.flags.extras, prompt_logprobs=v.flags.prompt_logprobs)
    return sum(runner.num_compilations().values()) - before
