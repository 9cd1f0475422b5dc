"""Streaming: token and text deltas as requests advance, and a background engine loop that any thread may feed.

RL and serving code add requests while generation runs: `EngineLoop` owns a thread that steps the engine whenever
work exists, and `submit` (thread-safe) returns a `RequestStream` to iterate deltas from, or to wait on for the
final `RequestOutput`. `LLM.stream` offers the same deltas without a thread.

Text deltas are cut from the engine's detokenized text, holding back a trailing incomplete character (U+FFFD)
and, when the request has stop strings, the last characters that could still begin a stop string, so streamed
text never shows what the final output truncates.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
from typing import Iterator

from inference.engine.client import EngineClient
from inference.engine.outputs import RequestOutput
from inference.lora.request import LoRARequest
from inference.sampling.params import SamplingParams


@dataclasses.dataclass
class StreamDelta:
    request_id: str
    index: int  # sample index
    token_ids: list[int]  # tokens new since the last delta
    text: str  # text new since the last delta
    finished: bool
    finish_reason: str | None = None
    output: RequestOutput | None = None  # the whole request's output, on the delta that finishes it
    logprobs: list | None = None  # the new tokens' logprob entries, when the request asked for logprobs


class DeltaTracker:
    """Turns successive cumulative RequestOutputs of one request into deltas."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.sent_tokens: dict[int, int] = {}
        self.sent_text: dict[int, int] = {}

    def deltas(self, out: RequestOutput) -> list[StreamDelta]:
        result = []
        for completion in out.outputs:
            i = completion.index
            n_tok, n_txt = self.sent_tokens.get(i, 0), self.sent_text.get(i, 0)
            done = completion.finish_reason is not None
            text = completion.text
            end = len(text)
            if not done:
                end -= self.holdback
                while end > n_txt and text[end - 1] == "\ufffd":
                    end -= 1
            end = max(end, n_txt)
            new_tokens = completion.token_ids[n_tok:]
            if not new_tokens and end == n_txt and not done:
                continue
            if done and i in self.sent_tokens and self.sent_tokens[i] < 0:
                continue  # already reported finished
            self.sent_tokens[i] = -1 if done else len(completion.token_ids)
            self.sent_text[i] = end
            new_logprobs = None if completion.logprobs is None else list(completion.logprobs[n_tok:])
            result.append(StreamDelta(out.request_id, i, list(new_tokens), text[n_txt:end], done,
                                      completion.finish_reason, logprobs=new_logprobs))
        if out.finished:  # the last delta of a request carries its whole output
            if not result:
                last = out.outputs[-1]
                result.append(StreamDelta(out.request_id, last.index, [], "", True, last.finish_reason))
            result[-1].output = out
        return result


class RequestStream:
    """Deltas of one request, filled by the engine loop's thread."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: queue.Queue[StreamDelta | BaseException] = queue.Queue()
        self._final: RequestOutput | None = None

    def _put(self, item: StreamDelta | BaseException) -> None:
        self._queue.put(item)

    def __iter__(self) -> Iterator[StreamDelta]:
        while self._final is None:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.output is not None:
                self._final = item.output
            yield item

    def result(self) -> RequestOutput:
        """Block until the request finishes; its final output."""
        for _ in self:
            pass
        return self._final


class EngineLoop:
    """Steps `engine` on a background thread whenever it has work."""

    def __init__(self, engine: EngineClient):
        self.engine = engine
        self._streams: dict[str, tuple[RequestStream, DeltaTracker]] = {}
        self._ids = itertools.count()
        self._wake = threading.Condition()
        self._closed = False
        self._paused = False  # pause / resume: no step starts while set
        self._stepping = False  # the thread is inside a step (pause waits for it to end)
        self._thread = threading.Thread(target=self._run, name="pagejax-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, *, prompt: str | None = None,
               priority: int = 0, request_id: str | None = None,
               lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request from any thread (with `lora_request`'s adapter). Raises ValueError at once if it can
        never run."""
        request_id = request_id or f"loop-{next(self._ids)}"
        stream = RequestStream(request_id)
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine loop is closed")
            if request_id in self._streams:  # the engine refuses it too, but the first request's stream is kept
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (stream, DeltaTracker(params))
            try:
                lora = {} if lora_request is None else {"lora_request": lora_request}  # engines without LoRA
                self.engine.add_request(request_id, prompt_token_ids, params, prompt=prompt, priority=priority,
                                        **lora)
            except Exception:
                del self._streams[request_id]
                raise
            self._wake.notify_all()  # all: pause() waits on the same condition
        return stream

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        with self._wake:
            self._wake.notify_all()

    def pause(self) -> None:
        """Stop stepping after the current step; returns once no step runs. In-flight requests keep their state
        (tokens, pages); `submit` still queues and `abort` still ends requests (their final output is published
        while paused). The moment for `LLM.update_weights` from an RL trainer."""
        with self._wake:
            self._paused = True
            while self._stepping:
                self._wake.wait()
            self._publish(self.engine.drain())  # async scheduling: the in-flight step's tokens, folded and sent

    def resume(self, *, recompute: bool = False) -> None:
        """Continue the in-flight requests. `recompute=True`: first release every running sequence's KV cache
        and recompute it from its tokens (preempt-and-recompute), so the rest of each request is generated with
        the new weights throughout; False keeps the KV written under the old weights."""
        with self._wake:
            if recompute:
                self.engine.recompute_running()
            self._paused = False
            self._wake.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def close(self) -> None:
        """Stop the loop thread. Requests still running are aborted (their pages freed) and their streams end with
        a RuntimeError, so no caller waits forever."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join()
        self._end_all(RuntimeError("the engine loop was closed while this request ran; it was aborted"))

    def _end_all(self, exc: BaseException) -> None:
        """Every open stream ends with `exc`; its request is aborted and dropped from the engine, so the engine is
        left without work nobody waits for (a loop that failed would otherwise retry it at once, forever)."""
        for request_id, (stream, _) in list(self._streams.items()):
            stream._put(exc)
            try:
                if request_id in self.engine.requests:
                    self.engine.abort(request_id)
                    self.engine.pop_finished(request_id)
            except Exception:  # noqa: BLE001 - an engine that failed may refuse; the stream has its error already
                pass
        self._streams.clear()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (self._paused or not self.engine.has_unfinished_requests()) \
                        and not self._pending_aborts():
                    self._wake.wait()
                if self._closed:
                    return
                step = not self._paused
                self._stepping = step
            try:  # published before `_stepping` clears, so pause() returns with every output delivered
                self._publish(self.engine.step() if step else [])
                self._publish(self._pending_aborts())
            except BaseException as exc:  # noqa: BLE001 - surface the failure to every waiting caller
                self._end_all(exc)
                continue
            finally:
                with self._wake:
                    self._stepping = False
                    self._wake.notify_all()

    def _pending_aborts(self) -> list[RequestOutput]:
        """Finished requests that no step reported (aborted ones): their final outputs."""
        return [self.engine.output_of(rid) for rid, _ in list(self._streams.items())
                if rid in self.engine.requests and self.engine.requests[rid].finished]

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue
            stream, tracker = entry
            for delta in tracker.deltas(out):
                stream._put(delta)
            if out.finished:
                del self._streams[out.request_id]
                self.engine.pop_finished(out.request_id)
