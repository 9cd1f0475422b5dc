"""What a request returns: vLLM's `RequestOutput` / `CompletionOutput` shapes, plus per-request metrics."""

from __future__ import annotations

import dataclasses


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
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None
    logprobs_mode: str | None = None  # "raw" or "processed" when logprobs were asked for

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
