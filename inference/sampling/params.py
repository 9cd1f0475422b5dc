"""Per-request sampling parameters, named and defaulted as in vLLM's `SamplingParams`.

The object is validated once, at construction, so the jitted sampler never has to guard against bad values: every
number it receives from here is in range. It is a frozen dataclass whose list-valued fields are normalised to tuples,
so two equal parameter sets compare and hash equal (usable as dict keys / cache keys) and nobody can mutate a request's
parameters after it has been scheduled.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
from typing import Any, Literal

from inference.structured.params import StructuredOutputsParams

#: Upper bound on `logprobs` / `prompt_logprobs` (number of top alternatives returned per token). vLLM's default
#: `max_logprobs` is 20 as well; the bound keeps the static `num_top` of the jitted logprob kernel small.
MAX_LOGPROBS = 20

#: Temperatures below this are treated as greedy (argmax), exactly like vLLM's `_SAMPLING_EPS`.
SAMPLING_EPS = 1e-5

LOGPROBS_MODES = ("raw", "processed")

LogprobsMode = Literal["raw", "processed"]

#: vLLM (after the OpenAI API) clamps every logit bias into this range.
LOGIT_BIAS_LIMIT = 100.0


class FrozenLogitBias(dict):
    """`SamplingParams.logit_bias`: a dict (token id -> bias) that cannot change and hashes, so SamplingParams stays
    frozen and hashable like its tuple-valued fields."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def __reduce__(self):  # pickle / deepcopy rebuild it whole (dict's default would call the blocked __setitem__)
        return (FrozenLogitBias, (dict(self),))

    def _read_only(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("SamplingParams.logit_bias is read-only; use params.replace(logit_bias=...)")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _read_only  # type: ignore[assignment]


def _is_int(value: Any) -> bool:
    # bool is an Integral subclass; `seed=True` or `n=True` is a bug at the call site, not a number.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


_INT32_MAX = 2**31 - 1

#: Bits of `SamplingParams.needs`: the optional parts of a step a request needs (a batch needs its rows' OR).
NEEDS_FILTERS, NEEDS_PENALTIES, NEEDS_LOGIT_RULES, NEEDS_LOGPROBS, NEEDS_PROMPT_LOGPROBS, NEEDS_ALLOWED = (
    1 << i for i in range(6))


def some_set(params_list: list[SamplingParams], field: str) -> bool:
    """Whether some request sets an optional parameter (`field` not None), in a C loop over the requests."""
    return operator.countOf(map(operator.attrgetter(field), params_list), None) != len(params_list)


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
      logit_bias: {token id: bias} added to those logits (ids as ints or digit strings; each bias clamped to
        [-100, 100] as vLLM does); ids must be in the model's vocabulary (checked when the request is added).
      allowed_token_ids: only these ids may be sampled (a non-empty list; every other logit becomes -inf).
      bad_words: words never to generate: each is tokenized with and without a leading space, and a word's last
        token is banned whenever the tokens before it end the output so far (vLLM's semantics).
      min_tokens: EOS and `stop_token_ids` are banned, and stop strings not honoured, until this many tokens have
        been generated (0 <= min_tokens <= max_tokens).
      These four edit the logits before the penalties (vLLM V1's order: allowed list, bad words, min_tokens,
      logit_bias), in the jitted sampler (inference/sampling/logit_bias.py); "processed" logprobs include them,
      "raw" ones do not.
      truncate_prompt_tokens: keep only the last k prompt tokens (k >= 1), or -1 for the longest prompt the engine
        admits (max_model_len - 1); None keeps the whole prompt.
      detokenize: False returns token ids only (empty text, no decoded tokens in logprobs); stop strings then need
        detokenize=True, as in vLLM.
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
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | tuple[int, ...] | None = None
    bad_words: list[str] | tuple[str, ...] | None = None
    min_tokens: int = 0
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True

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
            if not -(1 << 63) <= self.seed < 1 << 64:  # the sampler keys on it modulo 2**64: past these it aliases
                raise ValueError(f"seed must be in [-2**63, 2**64) (a 64-bit seed, as torch's), got {self.seed}")
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

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
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
        set_("logit_bias", _normalise_logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(i) and i >= 0 for i in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids >= 0 or None, got {ids!r}")
            set_("allowed_token_ids", tuple(int(i) for i in ids))
        set_("bad_words", _normalise_strings("bad_words", self.bad_words))
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        set_("min_tokens", int(self.min_tokens))
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k == -1 or k >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 for the longest prompt the "
                             f"model admits, or None, got {k!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True; set detokenize=True to use "
                             "stop, or stop_token_ids to stop on token ids")

    # The properties below are read for every row of a step the engine builds in general (a row joins or leaves
    # the batch, a prompt chunk runs): cached on first read, so each is an attribute lookup after it. The fields
    # they read never change (a frozen dataclass; `replace` makes a new object).

    @functools.cached_property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0, or below `SAMPLING_EPS` as in vLLM)."""
        return self.temperature < SAMPLING_EPS

    @functools.cached_property
    def uses_filters(self) -> bool:
        """True when sampling this request needs the top-k / top-p / min-p filter pass.

        The engine ORs this over the batch to pick the static `use_filters` flag of the sampler; greedy requests never
        need it because filters cannot change the argmax.
        """
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @functools.cached_property
    def uses_penalties(self) -> bool:
        """True when this request needs the penalty pass (and so the rows' token counts on the device).

        The engine ORs this over the batch; batches where it is False run the sampler exactly as without penalties.
        """
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @functools.cached_property
    def uses_logit_rules(self) -> bool:
        """True when this request edits logits sparsely (logit_bias, bad_words, min_tokens); the engine builds
        `LogitBiasTensors` only for batches with such a row (and only when an edit applies). `allowed_token_ids`
        goes through the token bitmask instead."""
        return bool(self.logit_bias) or bool(self.bad_words) or self.min_tokens > 0

    @functools.cached_property
    def needs(self) -> int:
        """The `NEEDS_*` bits of this request: filters, penalties, sparse logit edits, logprobs, prompt logprobs, an
        allowed list. The engine keeps them per row (`InputRows`) and ORs its rows' for a step."""
        return (NEEDS_FILTERS * self.uses_filters | NEEDS_PENALTIES * self.uses_penalties
                | NEEDS_LOGIT_RULES * self.uses_logit_rules | NEEDS_LOGPROBS * (self.logprobs is not None)
                | NEEDS_PROMPT_LOGPROBS * (self.prompt_logprobs is not None)
                | NEEDS_ALLOWED * (self.allowed_token_ids is not None))

    @functools.cached_property
    def sampling_row(self) -> tuple[float, int, float, float, bool]:
        """(temperature, top_k, top_p, min_p, processed logprobs): the request's row of `SamplingTensors`, filters
        off for a greedy request (its temperature 0 marks it greedy), top_k held to int32 (any k past the vocabulary
        is off)."""
        processed = self.logprobs_mode == "processed"
        if self.greedy:
            return 0.0, 0, 1.0, 0.0, processed
        return self.temperature, min(self.top_k, _INT32_MAX), self.top_p, self.min_p, processed

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied, validated again."""
        return dataclasses.replace(self, **changes)


def _normalise_stop(stop: Any) -> tuple[str, ...]:
    return _normalise_strings("stop", stop)


def _normalise_strings(name: str, value: Any) -> tuple[str, ...]:
    """`stop` / `bad_words`: a string or a list of non-empty strings, as a tuple."""
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"{name} must be a string, a list of strings or None, got {value!r}")
    for s in items:
        if not isinstance(s, str):
            raise ValueError(f"{name} must contain only strings, got {s!r} in {value!r}")
        if not s:
            raise ValueError(f"{name} strings must be non-empty, got {s!r} in {value!r}")
    return tuple(items)


def _normalise_logit_bias(bias: Any) -> FrozenLogitBias | None:
    """vLLM's conversion: keys to int (OpenAI clients send digit strings), biases clamped to [-100, 100]."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias or None, got {bias!r}")
    result = {}
    for token, value in bias.items():
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if not _is_real(value) or math.isnan(value):
            raise ValueError(f"logit_bias values must be numbers, got {value!r} for token {token}")
        result[int(token)] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
    return FrozenLogitBias(result)


def _normalise_stop_token_ids(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of integers >= 0 or None, got {ids!r}")
    for i in ids:
        if not _is_int(i) or i < 0:
            raise ValueError(f"stop_token_ids must contain only integers >= 0, got {i!r} in {ids!r}")
    return tuple(int(i) for i in ids)
