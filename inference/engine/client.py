"""The engine interface the entry points are written against, so one engine and a data-parallel group of them are
interchangeable: `LLM` and `EngineLoop` hold an `EngineClient`, `Engine` and `DataParallelEngine` implement it.

A `typing.Protocol` (structural): the two implementations share no base class, and a test double only needs the
methods. `runtime_checkable`, so tests can assert that an implementation still has every member.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from inference.engine.llm_engine import Request
    from inference.engine.metrics import EngineStats
    from inference.engine.outputs import RequestOutput
    from inference.runtime.runner import ModelRunner
    from inference.sampling.params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: object
    max_model_len: int
    runner: ModelRunner  # the (first replica's) runner, for code that inspects the model or its compiles

    @property
    def requests(self) -> Mapping[str, Request]:
        """Every request not yet popped, by id (finished ones included until `pop_finished`)."""

    @property
    def stats(self) -> EngineStats: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request; ValueError (and nothing queued) if it can never run."""

    def abort(self, request_id: str) -> None: ...

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One model step; an output for every request that advanced (`finished_only`: for those that finished)."""

    def has_unfinished_requests(self) -> bool: ...

    def drain(self) -> list[RequestOutput]:
        """Fold the step in flight (async scheduling); the outputs it advanced, which no `step` will report."""

    def settle(self) -> None:
        """Fold the step in flight (async scheduling); the next `step` reports the outputs it advanced."""

    def output_of(self, request_id: str) -> RequestOutput: ...

    def pop_finished(self, request_id: str) -> None: ...

    def warmup(self, prefill: bool = True, extras: bool = True) -> int: ...

    def reset_prefix_cache(self) -> None: ...

    def recompute_running(self) -> int: ...

    def reset_stats(self) -> None: ...

    def metrics_summary(self) -> dict[str, float]: ...


__all__ = ["EngineClient"]
