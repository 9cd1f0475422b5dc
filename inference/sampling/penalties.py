"""vLLM's repetition / presence / frequency penalties inside the jitted sampler (the semantics are in
inference/sampling/sampler.py's module docstring, step 0): the per-row values and the token ids they count, and their
effect on the logits. An optional part of `SamplingTensors`, None in batches without penalties, like the sparse logit
edits (logit_bias.py) and the structured-outputs mask (token_mask.py)."""

from __future__ import annotations

import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from inference.sampling.logit_bias import pow2_bucket
from inference.sampling.params import SamplingParams

#: Token-id arrays of `PenaltyTensors` are padded to a power of two at least this long, so a growing output
#: recompiles the step only at each doubling of its length.
MIN_PENALTY_TOKENS = 16


@flax.struct.dataclass
class PenaltyTensors:
    """Per-row penalty values and the token ids the penalties count, for a batch of S rows.

    Attributes:
      repetition: f32[S]; 1 = off.
      presence: f32[S]; 0 = off.
      frequency: f32[S]; 0 = off.
      prompt_ids: i32[S, Lp]; the row's prompt tokens, padded with -1 (ignored).
      output_ids: i32[S, Lo]; the tokens the row has generated so far, padded with -1.

    Why token ids and not counts: an [S, V] count matrix would cross host -> device every step; the ids are small and
    the counts are a scatter-add inside the jit. Lp and Lo are powers of two (>= MIN_PENALTY_TOKENS) so the step
    compiles once per doubling, not once per token.
    """

    repetition: jax.Array
    presence: jax.Array
    frequency: jax.Array
    prompt_ids: jax.Array
    output_ids: jax.Array

    @classmethod
    def from_params(
        cls,
        params_list: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        pad_to: int,
    ) -> PenaltyTensors:
        """Numpy per-row arrays; padding rows (and rows without penalties) get the no-op values 1, 0, 0."""
        n = len(params_list)
        if len(prompt_token_ids) != n or len(output_token_ids) != n:
            raise ValueError(f"params_list, prompt_token_ids and output_token_ids must have equal lengths, got {n}, "
                             f"{len(prompt_token_ids)}, {len(output_token_ids)}")
        repetition = np.ones(pad_to, np.float32)
        presence = np.zeros(pad_to, np.float32)
        frequency = np.zeros(pad_to, np.float32)
        lp = pow2_bucket(max((len(t) for t in prompt_token_ids), default=0), MIN_PENALTY_TOKENS)
        lo = pow2_bucket(max((len(t) for t in output_token_ids), default=0), MIN_PENALTY_TOKENS)
        prompt_ids = np.full((pad_to, lp), -1, np.int32)
        output_ids = np.full((pad_to, lo), -1, np.int32)
        for i, (p, prompt, output) in enumerate(zip(params_list, prompt_token_ids, output_token_ids)):
            if not p.uses_penalties:
                continue  # its row stays a no-op; the token ids are not needed
            repetition[i] = p.repetition_penalty
            presence[i] = p.presence_penalty
            frequency[i] = p.frequency_penalty
            prompt_ids[i, :len(prompt)] = prompt
            output_ids[i, :len(output)] = output
        return cls(repetition=repetition, presence=presence, frequency=frequency, prompt_ids=prompt_ids,
                   output_ids=output_ids)


def _token_counts(ids: jax.Array, v: int) -> jax.Array:
    """i32[S, V] occurrences of each token in each row of ids i32[S, L]; ids outside [0, V) (padding) are ignored."""
    s = ids.shape[0]
    ids = jnp.where((ids >= 0) & (ids < v), ids, v).astype(jnp.int32)
    rows = lax.broadcasted_iota(jnp.int32, ids.shape, 0)
    return jnp.zeros((s, v + 1), jnp.int32).at[rows, ids].add(1)[:, :v]


def apply_penalties(logits: jax.Array, pen: PenaltyTensors) -> jax.Array:
    """vLLM's `apply_penalties` on f32[S, V] logits (see the module docstring); rows with values 1, 0, 0 unchanged.
    A step whose every row is such a row (the extras variant, inference/runtime/step_variants.py) skips the token
    counts and the [S, V] passes altogether."""
    x = logits.astype(jnp.float32)
    active = ((jnp.asarray(pen.repetition) != 1.0) | (jnp.asarray(pen.presence) != 0.0)
              | (jnp.asarray(pen.frequency) != 0.0))
    return lax.cond(jnp.any(active), functools.partial(_penalize, pen=pen), lambda y: y, x)


def _penalize(x: jax.Array, pen: PenaltyTensors) -> jax.Array:
    v = x.shape[-1]
    seen_in_prompt = _token_counts(jnp.asarray(pen.prompt_ids), v) > 0
    out_counts = _token_counts(jnp.asarray(pen.output_ids), v)
    out_seen = out_counts > 0
    r = jnp.where(seen_in_prompt | out_seen, jnp.asarray(pen.repetition, jnp.float32)[:, None], 1.0)
    x = jnp.where(x > 0, x / r, x * r)
    x = x - jnp.asarray(pen.frequency, jnp.float32)[:, None] * out_counts.astype(jnp.float32)
    return x - jnp.asarray(pen.presence, jnp.float32)[:, None] * out_seen.astype(jnp.float32)
