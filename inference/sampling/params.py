"""Per-request sampling parameters, named and defaulted as in vLLM's `SamplingParams`.

The object is validated once, at construction, so the jitted sampler never has to guard against bad values: every
number it receives from here is in range. It is a frozen dataclass whose list-valued fields are normalised to tuples,
so two equal parameter sets compare and hash equal (usable as dict keys / cache keys) and nobody can mutate a request's
parameters after it has been scheduled.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Literal

from inference.structured.params import StructuredOutputsParams

#: Upper bound on `logprobs` / `prompt_logprobs` (number of top alternatives returned per token). vLLM's default
#: `max_logprobs` is 20 as well; the bound keeps the static `num_top` of the jitted logprob kernel small.
MAX_LOGPROBS = 20

#: Temperatures below this are treated as greedy (argmax), exactly like vLLM's `_SAMPLING_EPS`.
SAMPLING_EPS = 1e-5

LOGPROBS_MODES = ("raw", "processed")

LogprobsMode = Literal["raw", "processed"]


def _is_int(value: Any) -> bool:
    # bool is an Integral subclass; `seed=True` or `n=True` is a bug at the call site, not a number.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request's continuation (vLLM names and defaults).

    Attributes:
      n: number of independent completions to return for the prompt (>= 1).
      temperature: softmax temperature (>= 0). Below `SAMPLING_EPS` the request is greedy (argmax of the raw logits)
        and top_k / top_p / min_p are ignored, as in vLLM.
      top_p: nucleus sampling; keep the smallest set of most-probable tokens whose probability mass is >= top_p.
        In (0, 1]; 1 disables it.
      top_k: keep the k most probable tokens. 0 or -1 disables it (-1 is normalised to 0).
      min_p: drop tokens whose probability is < min_p * (probability of the most likely token). In [0, 1].
      seed: per-request RNG seed; with a seed the sampled tokens depend only on (seed, logits), not on which other
        requests share the batch. None: the engine draws a random seed once for the request.
      max_tokens: maximum number of generated tokens (>= 1), or None for "until the context is full".
      stop: stop string(s); normalised to a tuple of non-empty strings.
      stop_token_ids: extra token ids that end generation; normalised to a tuple of ints.
      ignore_eos: keep generating after the EOS token.
      logprobs: number of top alternatives (with their logprobs) to return per generated token, 0..MAX_LOGPROBS, or
        None for no logprobs. With 0 only the sampled token's logprob is returned.
      prompt_logprobs: same for the prompt tokens.
      include_stop_str_in_output: keep the matched stop string in the returned text.
      skip_special_tokens: drop special tokens when detokenising.
      logprobs_mode: "raw" = log-softmax of the model's logits (before temperature and filters); "processed" =
        log-softmax of the distribution actually sampled from (after temperature, min-p, top-k, top-p; filtered-out
        tokens get -inf). For greedy requests both are the raw logprobs.
      repetition_penalty: (> 0; 1 = off) every token present in the prompt or the output so far has its logit
        divided by it when positive and multiplied by it otherwise (vLLM / CTRL semantics).
      presence_penalty: in [-2, 2] (0 = off); subtracted once from the logit of every token already in the output.
      frequency_penalty: in [-2, 2] (0 = off); subtracted from each token's logit once per occurrence in the output.
      The three penalties act on the raw logits before temperature and the filters (vLLM's order), greedy rows
      included; "processed" logprobs include them, "raw" ones do not.
      structured_outputs: a `StructuredOutputsParams` (JSON schema, regex, choice, grammar or any JSON object) the
        output must match, or None. Tokens the grammar forbids are masked out of the logits before anything else,
        so both "raw" and "processed" logprobs are of the constrained distribution (vLLM's behaviour). The sequence
        stops ("stop") when the grammar is complete; it ends with "length" and the text so far if max_tokens comes
        first.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs_mode: LogprobsMode = "raw"
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen dataclass)

        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        set_("n", int(self.n))

        if not _is_real(self.temperature) or math.isnan(self.temperature) or not (0.0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        set_("temperature", float(self.temperature))

        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):  # NaN fails the comparison too
            raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {self.top_p!r}")
        set_("top_p", float(self.top_p))

        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer: -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        set_("top_k", 0 if self.top_k == -1 else int(self.top_k))

        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 = disabled), got {self.min_p!r}")
        set_("min_p", float(self.min_p))

        if self.seed is not None:
            if not _is_int(self.seed):
                raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
            set_("seed", int(self.seed))

        if self.max_tokens is not None:
            if not _is_int(self.max_tokens) or self.max_tokens < 1:
                raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
            set_("max_tokens", int(self.max_tokens))

        set_("stop", _normalise_stop(self.stop))
        set_("stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_int(value) or not (0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
            set_(name, int(value))

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")

        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")

        # vLLM's ranges. NaN fails every comparison, so it is rejected too.
        if not _is_real(self.repetition_penalty) or not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}")
        set_("repetition_penalty", float(self.repetition_penalty))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value!r}")
            set_(name, float(value))

        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (inference.structured.params), got "
                             f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0, or below `SAMPLING_EPS` as in vLLM)."""
        return self.temperature < SAMPLING_EPS

    @property
    def uses_filters(self) -> bool:
        """True when sampling this request needs the top-k / top-p / min-p filter pass.

        The engine ORs this over the batch to pick the static `use_filters` flag of the sampler; greedy requests never
        need it because filters cannot change the argmax.
        """
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def uses_penalties(self) -> bool:
        """True when this request needs the penalty pass (and so the rows' token counts on the device).

        The engine ORs this over the batch; batches where it is False run the sampler exactly as without penalties.
        """
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied, validated again."""
        return dataclasses.replace(self, **changes)


def _normalise_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
    for s in items:
        if not isinstance(s, str):
            raise ValueError(f"stop must contain only strings, got {s!r} in {stop!r}")
        if not s:
            raise ValueError(f"stop strings must be non-empty, got {s!r} in {stop!r}")
    return tuple(items)


def _normalise_stop_token_ids(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of integers >= 0 or None, got {ids!r}")
    for i in ids:
        if not _is_int(i) or i < 0:
            raise ValueError(f"stop_token_ids must contain only integers >= 0, got {i!r} in {ids!r}")
    return tuple(int(i) for i in ids)
