"""What both generation endpoints share: admission and submission of a request's prompts, and
waiting for them (aborting every one of them when the client goes away)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from typing import AsyncIterator

from fastapi import Request

from inference.engine.outputs import RequestOutput
from inference.entrypoints.openai.async_engine import AsyncEngine, AsyncStream
from inference.entrypoints.openai.errors import OpenAIError
from inference.entrypoints.openai.models import ServedModels
from inference.entrypoints.openai.sse import DONE, event
from inference.entrypoints.streaming import StreamDelta
from inference.lora.request import LoRARequest
from inference.sampling.params import SamplingParams

DISCONNECT_POLL_S = 0.25


@dataclasses.dataclass
class ServingContext:
    engine: AsyncEngine
    tokenizer: object  # inference.loading.tokenizer.Tokenizer, or None for a model without one
    models: ServedModels  # the names `model` may take: the base model's and the LoRA adapters'
    max_model_len: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def encode(tokenizer, text: str, param: str, **kwargs) -> list[int]:
    """`tokenizer.encode(text)`, its ValueError (text no tokenizer can read: a lone surrogate) a 400 naming
    `param`."""
    try:
        return tokenizer.encode(text, **kwargs)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param=param, code="invalid_value") from None


def check_stream_options(body) -> None:
    """`stream_options` means something only for a streamed response: a 400 otherwise, as vLLM and OpenAI answer."""
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream=true; drop it or set stream=true",
                          param="stream_options", code="invalid_value")


def check_context(ctx: ServingContext, prompts: list[tuple[list[int], str | None]], params: SamplingParams,
                  max_tokens_param: str) -> None:
    """A 400 where a prompt that fits the context leaves less room than `max_tokens` asks (OpenAI's and vLLM's
    servers refuse it rather than stop early with finish_reason "length"). A prompt alone past the context is the
    engine's rejection, which names the prompt (`submit_all`)."""
    if params.max_tokens is None:
        return
    for i, (ids, _) in enumerate(prompts):
        room = ctx.max_model_len - len(ids)
        if 0 < room < params.max_tokens:
            where = f" (prompt {i})" if len(prompts) > 1 else ""
            raise OpenAIError(400, f"this model's maximum context length is {ctx.max_model_len} tokens, but the "
                              f"prompt{where} has {len(ids)} and {max_tokens_param}={params.max_tokens} asks for "
                              f"{len(ids) + params.max_tokens}; lower {max_tokens_param} to at most {room} or shorten "
                              "the prompt", param=max_tokens_param, code="context_length_exceeded")


def submit_all(ctx: ServingContext, request_id: str, prompts: list[tuple[list[int], str | None]],
               params: SamplingParams, prompt_param: str, lora: LoRARequest | None = None, *,
               max_tokens_param: str = "max_tokens") -> list[AsyncStream]:
    """Check each prompt's room for `max_tokens` (`check_context`), reserve room for every prompt's `n` sequences
    at once (all or none: 503), then submit them (with `lora`'s adapter, held until each finishes); an engine
    rejection (a prompt too long for the context, a bad token id) aborts those already submitted and is a 400
    naming `prompt_param`."""
    check_context(ctx, prompts, params, max_tokens_param)
    ctx.engine.reserve(params.n * len(prompts))
    try:
        ctx.models.hold(lora, len(prompts))
    except OpenAIError:
        ctx.engine.unreserve(params.n * len(prompts))
        raise
    streams: list[AsyncStream] = []
    for i, (ids, text) in enumerate(prompts):
        try:
            streams.append(ctx.engine.submit(f"{request_id}-{i}", ids, params, text, lora_request=lora,
                                             on_done=functools.partial(ctx.models.release, lora)))
        except ValueError as exc:
            ctx.engine.unreserve(params.n * (len(prompts) - i - 1))
            ctx.models.release(lora, len(prompts) - i)
            for s in streams:
                s.abort()
            where = f" (prompt {i})" if len(prompts) > 1 else ""
            raise OpenAIError(400, f"{exc}{where}", param=prompt_param, code="invalid_prompt") from None
    return streams


async def collect(request: Request, streams: list[AsyncStream]) -> list[RequestOutput]:
    """Every stream's final output; if the client disconnects first, abort them all (their pages free at once)."""
    results = asyncio.gather(*(s.result() for s in streams))
    try:
        while True:
            done, _ = await asyncio.wait({results}, timeout=DISCONNECT_POLL_S)
            if done:
                return results.result()
            if await request.is_disconnected():
                raise OpenAIError(499, "the client disconnected; its requests were aborted", code="disconnected")
    finally:
        if not results.done():
            for s in streams:
                s.abort()
            results.cancel()


async def merged_deltas(streams: list[AsyncStream]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """(prompt index, delta) from every stream as they come. Closing the iterator early (the client went away)
    aborts every request still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def drain(i: int, s: AsyncStream) -> None:
        try:
            async for delta in s:
                await queue.put((i, delta))
        except BaseException as exc:  # noqa: BLE001 - re-raised to the consumer below
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    open_streams = len(streams)
    try:
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for s in streams:
            s.abort()
        for t in tasks:
            t.cancel()


async def sse_events(chunks: AsyncIterator[str], streams: list[AsyncStream]) -> AsyncIterator[str]:
    """An endpoint's SSE chunks, then `[DONE]`; a failure midway (the engine's, or a request's own error output)
    becomes an error event in the stream, since the 200 status has already been sent. However it ends (the
    client gone included: Starlette cancels this generator), every request still running is aborted."""
    try:
        async for c in chunks:
            yield c
    except OpenAIError as exc:
        yield event(exc.body())
    except Exception as exc:  # noqa: BLE001 - the engine's failure, reported in the stream
        yield event(engine_failure(exc).body())
    finally:
        for s in streams:
            s.abort()
        await chunks.aclose()
    yield DONE


def engine_failure(exc: BaseException) -> OpenAIError:
    return OpenAIError(500, f"the engine failed while running this request: {type(exc).__name__}: {exc}",
                       code="engine_error")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
