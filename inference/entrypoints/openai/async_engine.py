"""The asyncio side of the engine loop: submit from a request handler, await deltas, abort on disconnect.

`EngineLoop` (inference/entrypoints/streaming.py) steps the engine on its own thread and fills a thread-safe
`RequestStream` per request. Here each submitted request gets a small pump thread that blocks on that stream and
hands every delta to the event loop (`call_soon_threadsafe`), so no handler ever blocks the event loop and every
HTTP request joins the same continuous batch.

Admission is bounded: the engine runs at most `slots` sequences at once (max_num_seqs per replica), and at most
`max_waiting` more may wait for a slot; a request whose `n` sequences would pass that gets a 503 with Retry-After
instead of a queue that grows without bound. The count is the server's own (sequences submitted and not finished),
so it never races the engine thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import AsyncIterator, Callable

from inference.engine.outputs import RequestOutput
from inference.entrypoints.openai.errors import OpenAIError
from inference.entrypoints.streaming import EngineLoop, RequestStream, StreamDelta
from inference.lora.request import LoRARequest
from inference.sampling.params import SamplingParams

RETRY_AFTER_S = 1
_END = object()


@dataclasses.dataclass
class Admission:
    """Sequences in flight, against the engine's slots plus the waiting bound."""

    slots: int
    max_waiting: int | None
    in_flight: int = 0
    draining: bool = False

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None (unbounded), got {self.max_waiting}; "
                             "pass 0 to admit only what the engine can run at once")


class AsyncStream:
    """One submitted request's deltas as an async iterator; `output` is the final RequestOutput once it is done."""

    def __init__(self, stream: RequestStream, engine: "AsyncEngine", num_seqs: int,
                 on_done: Callable[[], None] | None = None):
        self.request_id = stream.request_id
        self.output: RequestOutput | None = None
        self._stream, self._engine, self._num_seqs, self._on_done = stream, engine, num_seqs, on_done
        self._queue: asyncio.Queue = asyncio.Queue()
        self._aloop = asyncio.get_running_loop()
        threading.Thread(target=self._pump, name=f"pump-{self.request_id}", daemon=True).start()

    def _pump(self) -> None:
        item: object = _END
        final = None
        try:
            for delta in self._stream:
                final = delta.output or final
                self._hand(delta)
        except BaseException as exc:  # noqa: BLE001 - the engine's failure goes to this request's handler
            item = exc
        try:
            self._engine._release(self._num_seqs, final)
            if self._on_done is not None:  # the engine is done with the request (e.g. its LoRA adapter's count)
                self._on_done()
        finally:  # whatever those do, the handler hears the end
            self._hand(item)

    def _hand(self, item: object) -> None:
        try:
            self._aloop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shut down): nobody is listening
            pass

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            if item.output is not None:
                self.output = item.output
            yield item

    async def result(self) -> RequestOutput:
        async for _ in self:
            pass
        return self.output

    def abort(self) -> None:
        """Stop the request and free its pages (a no-op once it finished)."""
        if self.output is None:
            self._engine.loop.abort(self.request_id)


class AsyncEngine:
    def __init__(self, loop: EngineLoop, admission: Admission,
                 on_finished: Callable[[RequestOutput], None] | None = None):
        self.loop = loop
        self.admission = admission
        self._on_finished = on_finished
        self._lock = threading.Lock()

    def reserve(self, num_seqs: int) -> None:
        """Claim room for `num_seqs` sequences, or raise a 503 (overloaded, or shutting down)."""
        with self._lock:
            a = self.admission
            if a.draining:
                raise OpenAIError(503, "the server is shutting down; retry against another replica",
                                  code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
            if a.max_waiting is not None and num_seqs > a.slots + a.max_waiting:  # never fits: not retryable
                raise OpenAIError(400, f"this request needs {num_seqs} sequences (n times its prompts), more than "
                                  f"the server ever holds at once ({a.slots} running slots and max_waiting="
                                  f"{a.max_waiting}); lower n or send fewer prompts a request", param="n",
                                  code="too_many_sequences")
            if a.max_waiting is not None and a.in_flight + num_seqs - a.slots > a.max_waiting:
                raise OpenAIError(503, f"the server is at capacity ({a.in_flight} sequences in flight: {a.slots} "
                                  f"running slots and max_waiting={a.max_waiting}); retry later",
                                  code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
            a.in_flight += num_seqs

    def unreserve(self, num_seqs: int) -> None:
        with self._lock:
            self.admission.in_flight -= num_seqs

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None, *,
               lora_request: LoRARequest | None = None, on_done: Callable[[], None] | None = None) -> AsyncStream:
        """Queue a request whose room `reserve` claimed; ValueError (room given back) if the engine rejects it.
        `on_done` runs (on another thread) once the engine has finished with it."""
        try:
            stream = self.loop.submit(prompt_token_ids, params, prompt=prompt, request_id=request_id,
                                      lora_request=lora_request)
        except ValueError:
            self.unreserve(params.n)
            raise
        return AsyncStream(stream, self, params.n, on_done)

    def _release(self, num_seqs: int, output: RequestOutput | None) -> None:
        self.unreserve(num_seqs)
        if output is not None and self._on_finished is not None:
            self._on_finished(output)
