"""What a request returns: vLLM's `RequestOutput` / `CompletionOutput` shapes, plus per-request metrics."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter seconds) and counts of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclasses.dataclass
class Logprob:
    """One token's entry in a logprobs dict (vLLM's `vllm.logprobs.Logprob`).

    `logprob`: its log-probability (raw or processed, per `SamplingParams.logprobs_mode`). `rank`: its 1-based rank
    in the whole vocabulary under that distribution, as vLLM counts it (the number of tokens whose logprob is >= its
    own, so ties share the larger rank); the top-k alternatives of a position are ranked 1..k. `decoded_token`: the
    token decoded on its own (`tokenizer.decode([id])`, special tokens kept, as vLLM does), or None when the model
    has no tokenizer or the request set `detokenize=False`.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One position's logprobs: token id -> Logprob (the sampled or prompt token, plus the top-k alternatives).
LogprobsDict = dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobsDict] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None
    logprobs_mode: str | None = None  # "raw" or "processed" when logprobs were asked for
    # vLLM V1's: the sum of the sampled tokens' logprobs (in `logprobs_mode`'s distribution); None when the request
    # did not ask for logprobs, since the engine then brings no logprob back from the device.
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[LogprobsDict | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None


class DeferredRequestOutput(RequestOutput):
    """A `RequestOutput` whose completions are built when `outputs` is first read, from what the engine captured
    when it made the output (each sequence's token count, text and reasons at that step).

    Why: `Engine.step` returns an output for every request a step advanced, and building their `CompletionOutput`s
    (a copy of the tokens, the logprob lists) is per-sequence work on the step's critical path that most steps'
    callers never read (`LLM.generate` reads only final outputs). Later steps only append to a sequence's tokens
    and logprobs, so a deferred build gives exactly what an eager one would have."""

    @classmethod
    def of(cls, states: Any, build: Callable[[Any], list[CompletionOutput]], request_id: str, prompt: str | None,
           prompt_token_ids: list[int], prompt_logprobs, finished: bool, metrics: RequestMetrics | None,
           error: str | None, /) -> "DeferredRequestOutput":
        """`build(states)` makes the completions on first read. The engine makes one of these per request per
        step, so it is made without `__init__` (which, the dataclass's, takes `outputs`: `dataclasses.replace`)."""
        out = cls.__new__(cls)
        out.__dict__ = {"request_id": request_id, "prompt": prompt, "prompt_token_ids": prompt_token_ids,
                        "prompt_logprobs": prompt_logprobs, "finished": finished, "metrics": metrics, "error": error,
                        "_states": states, "_build_from": build}
        return out

    def __getattr__(self, name: str):
        if name != "outputs":  # only `outputs` is ever missing
            raise AttributeError(name)
        fields = self.__dict__
        if "_states" not in fields:
            raise AttributeError(name)
        self.outputs = fields.pop("_build_from")(fields.pop("_states"))
        return self.outputs

    def __eq__(self, other) -> bool:  # equal to the plain output it stands for
        fields = [f.name for f in dataclasses.fields(RequestOutput)]
        return isinstance(other, RequestOutput) and all(getattr(self, f) == getattr(other, f) for f in fields)

    __hash__ = None

    def __reduce__(self):  # pickled (or deep-copied) as the plain output it stands for
        return RequestOutput, tuple(getattr(self, f.name) for f in dataclasses.fields(RequestOutput))
