"""Sparse per-row logit edits: vLLM's `logit_bias`, `bad_words` and `min_tokens`, batched.

All three only touch a few token ids of a row, so a row carries *lists* of (token id, value) pairs rather than a
[vocab] mask: a bias adds its value, a ban adds -inf (bad words whose prefix the output just completed, and the stop
ids while a row is below its `min_tokens`). `allowed_token_ids` is the opposite case (every token but a few is
banned) and goes through the token bitmask instead (inference/sampling/token_mask.py: `allowed_row`). The lists are
padded (-1) to a power of two at least `MIN_RULE_TOKENS` long, so the jitted step compiles once per doubling, not
per request; `LogitBiasTensors.from_rows` returns None when no row has anything to apply, and
`SamplingTensors.logit_bias=None` traces the sampler exactly as without these parameters (the same static-flag trick
as `PenaltyTensors`).

Order (vLLM V1's `Sampler.forward`): the allowed list (the bitmask, applied first), bad words, min_tokens,
logit_bias, then the penalties, then temperature and the filters. All of it happens before sampling, so "processed"
logprobs include these edits and "raw" ones do not (as in vLLM).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from inference.sampling.params import SamplingParams

#: The shortest padded length of a row's rule list.
MIN_RULE_TOKENS = 16


def pow2_bucket(n: int, minimum: int) -> int:
    """The smallest power-of-two multiple of `minimum` that is >= n (static array lengths that grow by doubling)."""
    size = minimum
    while size < n:
        size *= 2
    return size


def bad_words_token_ids(bad_words: Sequence[str], tokenizer) -> list[list[int]]:
    """vLLM's `SamplingParams.update_from_tokenizer`: each bad word tokenized as written (left-stripped) and, to
    ban it in the middle of text too, with a leading space, the latter kept only when it gives a different first
    token and the same number of tokens."""
    result: list[list[int]] = []
    for word in bad_words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                continue
            if not prefix or (result and ids[0] != result[-1][0] and len(ids) == len(result[-1])):
                result.append([int(t) for t in ids])
    return result


def banned_by_bad_words(bad_words_ids: Iterable[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The last tokens of the bad words whose other tokens end the output so far (vLLM's `apply_bad_words`: a
    one-token bad word is always banned; only the generated tokens count, not the prompt)."""
    banned = []
    for word in bad_words_ids:
        prefix = len(word) - 1
        if prefix > len(output_ids):
            continue
        if prefix == 0 or list(output_ids[-prefix:]) == list(word[:prefix]):
            banned.append(int(word[-1]))
    return banned


def row_edits(params: SamplingParams, output_ids: Sequence[int], bad_words_ids: Sequence[Sequence[int]],
              stop_ids: Iterable[int]) -> list[tuple[int, float]]:
    """(token id, value to add) pairs of one row for this step: -inf bans, then the logit biases.

    `stop_ids`: the ids that end the request (EOS and `stop_token_ids`), banned while fewer than `min_tokens`
    tokens have been generated (vLLM's MinTokensLogitsProcessor)."""
    edits = [(t, -np.inf) for t in banned_by_bad_words(bad_words_ids, output_ids)]
    if len(output_ids) < params.min_tokens:
        edits += [(int(t), -np.inf) for t in sorted(set(stop_ids))]
    edits += [(int(t), float(b)) for t, b in (params.logit_bias or {}).items()]
    return edits


@flax.struct.dataclass
class LogitBiasTensors:
    """Per-row sparse logit edits for a batch of S rows.

    Attributes:
      ids: i32[S, L]; token ids to edit, padded with -1 (ignored).
      values: f32[S, L]; added to the logit of `ids` (a bias, or -inf for a ban).
    """

    ids: jax.Array
    values: jax.Array

    @classmethod
    def from_rows(cls, edits: Sequence[Sequence[tuple[int, float]]], pad_to: int) -> LogitBiasTensors | None:
        """Numpy arrays for the rows' `row_edits`; None if no row has one."""
        if not any(edits):
            return None
        width = pow2_bucket(max((len(e) for e in edits), default=0), MIN_RULE_TOKENS)
        ids = np.full((pad_to, width), -1, np.int32)
        values = np.zeros((pad_to, width), np.float32)
        for i, row in enumerate(edits):
            if row:
                ids[i, :len(row)] = [t for t, _ in row]
                values[i, :len(row)] = [v for _, v in row]
        return cls(ids=ids, values=values)


def apply_logit_bias(logits: jax.Array, t: LogitBiasTensors) -> jax.Array:
    """The bans and biases on f32[S, V] logits (padding ids are out of range and dropped by the scatter)."""
    x = logits.astype(jnp.float32)
    v = x.shape[-1]
    ids = jnp.asarray(t.ids, jnp.int32)
    rows = lax.broadcasted_iota(jnp.int32, ids.shape, 0)
    ids = jnp.where((ids >= 0) & (ids < v), ids, v)
    return x.at[rows, ids].add(jnp.asarray(t.values, jnp.float32), mode="drop")
