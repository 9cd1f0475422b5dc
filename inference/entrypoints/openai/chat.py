"""POST /v1/chat/completions: `messages` through the model's chat template, then one engine request with `n`
samples; `logprobs` + `top_logprobs`, `stream`, `max_tokens` / `max_completion_tokens`."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import Request

from inference.entrypoints.openai import serving
from inference.entrypoints.openai.errors import OpenAIError, sampling_error
from inference.entrypoints.openai.logprobs import chat_logprobs
from inference.entrypoints.openai.protocol import ChatCompletionRequest
from inference.entrypoints.openai.serving import ServingContext
from inference.entrypoints.openai.sse import event, event_stream


def _text(content) -> str:
    """A message's content: a string, or OpenAI's list of parts of which only text parts are supported."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise OpenAIError(400, f"only text content parts are supported, got a part of type {part.get('type')!r}",
                              param="messages", code="unsupported_content")
        if not isinstance(part.get("text"), str):
            raise OpenAIError(400, f"a text content part needs a string 'text', got {part.get('text')!r}",
                              param="messages", code="invalid_value")
        parts.append(part["text"])
    return "".join(parts)


def render(ctx: ServingContext, body: ChatCompletionRequest) -> tuple[list[int], str]:
    if ctx.tokenizer is None or not getattr(ctx.tokenizer, "chat_template", None):
        raise OpenAIError(400, "this model has no chat template; use /v1/completions with a plain prompt",
                          param="messages", code="no_chat_template")
    messages = [{**m.model_dump(exclude_none=True), "content": _text(m.content)} for m in body.messages]
    try:
        text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation (jinja raise_exception)
        raise OpenAIError(400, f"the chat template rejected the messages: {exc}", param="messages",
                          code="invalid_messages") from None
    return serving.encode(ctx.tokenizer, text, "messages", add_special_tokens=False), text


def _check(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, request: Request):
    lora = ctx.models.resolve(body.model)  # None: the base model
    serving.check_stream_options(body)
    _check(body)
    try:
        params = body.to_sampling_params()
    except ValueError as exc:
        raise sampling_error(exc, body.param_names()) from None
    ids, text = render(ctx, body)
    request_id = serving.new_id("chatcmpl")
    streams = serving.submit_all(ctx, request_id, [(ids, text)], params, "messages", lora,
                                 max_tokens_param=body.param_names()["max_tokens"])
    model = ctx.models.response_name(lora)
    if body.stream:
        return event_stream(serving.sse_events(_stream(ctx, body, model, request_id, len(ids), streams), streams))
    try:
        [out] = await serving.collect(request, streams)
    except OpenAIError:
        raise
    except Exception as exc:  # noqa: BLE001 - the engine's failure, as a 500 for this request only
        raise serving.engine_failure(exc) from None
    if out.error is not None:
        raise serving.engine_failure(RuntimeError(out.error))
    choices = []
    for c in out.outputs:
        choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                  "logprobs": None, "finish_reason": c.finish_reason}
        if body.logprobs:
            choice["logprobs"] = chat_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, body.top_logprobs or 0)
        if body.return_token_ids:
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    return {"id": request_id, "object": "chat.completion", "created": serving.now(), "model": model,
            "choices": choices,
            "usage": serving.usage(len(ids), sum(len(c.token_ids) for c in out.outputs))}


async def _stream(ctx: ServingContext, body: ChatCompletionRequest, model: str, request_id: str,
                  num_prompt_tokens: int, streams) -> AsyncIterator[str]:
    created = serving.now()

    def chunk(choices: list[dict], **extra) -> str:
        return event({"id": request_id, "object": "chat.completion.chunk", "created": created,
                      "model": model, "choices": choices, **extra})

    for j in range(body.n):  # OpenAI's first chunk of each choice names the role
        yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    completion_tokens = 0
    async with contextlib.aclosing(serving.merged_deltas(streams)) as deltas:
        async for _, delta in deltas:
            if delta.output is not None and delta.output.error is not None:
                raise serving.engine_failure(RuntimeError(delta.output.error))
            completion_tokens += len(delta.token_ids)
            choice = {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                      "logprobs": None, "finish_reason": delta.finish_reason if delta.finished else None}
            if body.logprobs and delta.logprobs:
                choice["logprobs"] = chat_logprobs(ctx.tokenizer, delta.token_ids, delta.logprobs,
                                                   body.top_logprobs or 0)
            if body.return_token_ids:
                choice["token_ids"] = delta.token_ids
            yield chunk([choice])
    if body.stream_options is not None and body.stream_options.include_usage:
        yield chunk([], usage=serving.usage(num_prompt_tokens, completion_tokens))
