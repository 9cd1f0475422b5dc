"""POST /v1/completions: prompts as text, token ids, or lists of either; `n`, `logprobs`, `echo`, `stream`.

Each prompt is one engine request with the request's `n` samples; choice `i * n + j` is sample j of prompt i
(OpenAI's order). `echo` puts the prompt before the completion and, with `logprobs`, the prompt's own logprobs
before the completion's (the first prompt token has none): what lm-eval's loglikelihood requests read.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import Request

from inference.engine.outputs import RequestOutput
from inference.entrypoints.openai import serving
from inference.entrypoints.openai.errors import OpenAIError, sampling_error
from inference.entrypoints.openai.logprobs import completion_logprobs
from inference.entrypoints.openai.protocol import CompletionRequest
from inference.entrypoints.openai.serving import ServingContext
from inference.entrypoints.openai.sse import event, event_stream


def _prompts(ctx: ServingContext, prompt) -> list[tuple[list[int], str | None]]:
    """(token ids, text) per prompt; text is None for a token-id prompt (decoded later only if echoed)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt must not be empty: give a string, a list of strings, a list of token ids "
                          "or a list of token-id lists", param="prompt", code="invalid_prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    if isinstance(prompt[0], str):
        if ctx.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer, so it cannot read text prompts; send the prompt "
                              "as token ids", param="prompt", code="invalid_prompt")
        return [(serving.encode(ctx.tokenizer, p, "prompt"), p) for p in prompt]
    return [(list(p), None) for p in prompt]


def _prompt_text(ctx: ServingContext, ids: list[int], text: str | None) -> str:
    if text is not None:
        return text
    return ctx.tokenizer.decode(ids) if ctx.tokenizer is not None else ""


async def create_completion(ctx: ServingContext, body: CompletionRequest, request: Request):
    lora = ctx.models.resolve(body.model)  # None: the base model
    serving.check_stream_options(body)
    try:
        params = body.to_sampling_params()
    except ValueError as exc:
        raise sampling_error(exc, body.param_names()) from None
    if body.stream and body.echo and body.logprobs is not None:
        raise OpenAIError(400, "echo with logprobs is not supported with stream=true; set stream=false (the "
                          "prompt's logprobs come with the whole response)", param="echo", code="unsupported")
    prompts = _prompts(ctx, body.prompt)
    request_id = serving.new_id("cmpl")
    streams = serving.submit_all(ctx, request_id, prompts, params, "prompt", lora)
    model = ctx.models.response_name(lora)
    if body.stream:
        return event_stream(serving.sse_events(_stream(ctx, body, model, request_id, prompts, streams), streams))
    try:
        outputs = await serving.collect(request, streams)
    except OpenAIError:
        raise
    except Exception as exc:  # noqa: BLE001 - the engine's failure, as a 500 for this request only
        raise serving.engine_failure(exc) from None
    return _response(ctx, body, model, request_id, prompts, outputs)


def _response(ctx: ServingContext, body: CompletionRequest, model: str, request_id: str, prompts,
              outputs: list[RequestOutput]):
    choices, completion_tokens = [], 0
    for i, ((ids, text), out) in enumerate(zip(prompts, outputs)):
        if out.error is not None:
            raise serving.engine_failure(RuntimeError(out.error))
        prefix = _prompt_text(ctx, ids, text) if body.echo else ""
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            choice = {"index": i * body.n + c.index, "text": prefix + c.text, "logprobs": None,
                      "finish_reason": c.finish_reason}
            if body.logprobs is not None:
                tokens = (ids if body.echo else []) + c.token_ids
                entries = (out.prompt_logprobs if body.echo else []) + c.logprobs
                choice["logprobs"] = completion_logprobs(ctx.tokenizer, tokens, entries)
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
                choice["prompt_token_ids"] = ids
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    return {"id": request_id, "object": "text_completion", "created": serving.now(), "model": model,
            "choices": choices, "usage": serving.usage(sum(len(ids) for ids, _ in prompts), completion_tokens)}


async def _stream(ctx: ServingContext, body: CompletionRequest, model: str, request_id: str, prompts,
                  streams) -> AsyncIterator[str]:
    created = serving.now()

    def chunk(choices: list[dict], **extra) -> str:
        return event({"id": request_id, "object": "text_completion", "created": created, "model": model,
                      "choices": choices, **extra})

    offsets: dict[int, int] = {}  # choice index -> text streamed so far (for text_offset)
    completion_tokens = 0
    if body.echo:
        for i, (ids, text) in enumerate(prompts):
            prefix = _prompt_text(ctx, ids, text)
            for j in range(body.n):
                offsets[i * body.n + j] = len(prefix)
                yield chunk([{"index": i * body.n + j, "text": prefix, "logprobs": None, "finish_reason": None}])
    async with contextlib.aclosing(serving.merged_deltas(streams)) as deltas:
        async for i, delta in deltas:
            index = i * body.n + delta.index
            if delta.output is not None and delta.output.error is not None:
                raise serving.engine_failure(RuntimeError(delta.output.error))
            completion_tokens += len(delta.token_ids)
            choice = {"index": index, "text": delta.text, "logprobs": None,
                      "finish_reason": delta.finish_reason if delta.finished else None}
            if body.logprobs is not None and delta.logprobs is not None:
                choice["logprobs"] = completion_logprobs(ctx.tokenizer, delta.token_ids, delta.logprobs,
                                                         offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(delta.text)
            if body.return_token_ids:
                choice["token_ids"] = delta.token_ids
            yield chunk([choice])
    if body.stream_options is not None and body.stream_options.include_usage:
        yield chunk([], usage=serving.usage(sum(len(ids) for ids, _ in prompts), completion_tokens))
