"""The FastAPI app: `build_app(llm, ...)`.

Routes: POST /v1/completions and /v1/chat/completions (streaming or not; `model` picks the base model or a LoRA
adapter), GET /v1/models, vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (only with
`allow_runtime_lora`), GET /health, GET /metrics (Prometheus text), and vLLM's POST /tokenize, POST /detokenize
and GET /tokenizer_info (lm-eval's remote tokenizer reads them, so lm-eval needs no local tokenizer). Every HTTP
request shares the one `EngineLoop`, so requests from different clients (and adapters) batch together.

A pure ASGI guard runs before the routes: with `api_key` set, every route but /health and /metrics needs
`Authorization: Bearer <key>` (compared with `hmac.compare_digest`, constant time); a body over `max_body_bytes` is a
413 before any of it is parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference.entrypoints.openai import chat, completions, errors, serving
from inference.entrypoints.openai.async_engine import Admission, AsyncEngine
from inference.entrypoints.openai.errors import OpenAIError
from inference.entrypoints.openai.metrics import ServerMetrics
from inference.entrypoints.openai.models import ServedModels
from inference.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                   LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest)
from inference.entrypoints.openai.serving import ServingContext
from inference.lora.request import LoRARequest

DEFAULT_MAX_BODY_BYTES = 4 << 20
_OPEN_PATHS = ("/health", "/metrics")


class _Guard:
    """Authentication and the body-size limit, as ASGI middleware (so an oversized body is never buffered whole)."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and scope["path"] not in _OPEN_PATHS and not self._authorized(scope):
            error = OpenAIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                code="invalid_api_key")
            return await error.response()(scope, receive, send)
        headers = dict(scope.get("headers", []))
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(scope, receive, send)
        body, more = b"", True
        while more:  # read the body here, stopping once it passes the limit
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, scope) -> bool:
        value = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _too_large(self, scope, receive, send):
        error = OpenAIError(413, f"the request body is larger than the server's limit of {self.max_body_bytes} "
                            "bytes; send a smaller request (or start the server with a larger --max_body_bytes)",
                            code="body_too_large")
        await error.response()(scope, receive, send)


def build_app(llm, *, served_model_name: str | Sequence[str] | None = None, api_key: str | None = None,
              max_waiting: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              lora_modules: Sequence[LoRARequest] = (), allow_runtime_lora: bool = False) -> FastAPI:
    """The server for `llm` (an `LLM`). `served_model_name`: the name(s) clients pass as `model` (default: the model
    argument `llm` was built with); `max_waiting`: sequences that may wait beyond the engine's running slots
    (None: unbounded); `lora_modules`: LoRA adapters served under their names (`llm` built with enable_lora=True;
    each is loaded and checked now); `allow_runtime_lora`: enable POST /v1/load_lora_adapter and
    /v1/unload_lora_adapter. The engine loop starts with the app and stops after it has drained."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string, or None for no authentication")
    names = served_model_name or llm.engine_config.model
    names = (names,) if isinstance(names, str) else tuple(names)
    replicas = llm.engine_config.parallel.data_parallel_size
    admission = Admission(slots=llm.engine_config.scheduler.max_num_seqs * replicas, max_waiting=max_waiting)
    metrics = ServerMetrics(llm.engine, names[0])
    created = int(time.time())
    models = ServedModels(names, llm.engine, loras=lora_modules, allow_runtime_lora=allow_runtime_lora,
                          max_model_len=llm.engine.max_model_len, created=created)
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = llm.background()
        state["ctx"] = ServingContext(AsyncEngine(loop, admission, on_finished=metrics.observe), llm.tokenizer,
                                      models, llm.engine.max_model_len)
        try:
            yield
        finally:
            admission.draining = True
            while admission.in_flight:  # uvicorn has waited for connections; requests it cut off are aborted
                await asyncio.sleep(0.05)
            loop.close()

    app = FastAPI(title="pagejax", lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, errors.validation_handler)
    app.add_exception_handler(OpenAIError, errors.openai_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.state.admission, app.state.metrics, app.state.models = admission, metrics, models

    def ctx() -> ServingContext:
        return state["ctx"]

    @app.post("/v1/completions")
    async def v1_completions(body: CompletionRequest, request: Request):
        return await completions.create_completion(ctx(), body, request)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat.create_chat_completion(ctx(), body, request)

    @app.get("/v1/models")
    async def v1_models():
        return {"object": "list", "data": models.cards()}

    # vLLM's runtime adapter endpoints; their answers are plain text, as vLLM's are. Loading reads files: off the
    # event loop, so generation requests keep streaming meanwhile.
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        return PlainTextResponse(await asyncio.to_thread(models.load, body.lora_name, body.lora_path))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return PlainTextResponse(models.unload(body.lora_name))

    @app.get("/health")
    async def health():
        if admission.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def tokenizer():
        if llm.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer", code="no_tokenizer")
        return llm.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        models.resolve(body.model)
        tokens = serving.encode(tokenizer(), body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        models.resolve(body.model)
        tk = tokenizer()
        vocab = max(tk.vocab_size, llm.config.vocab_size)  # a model's vocabulary may be padded past the tokenizer's
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"token ids must be in [0, {vocab}) for this model; got {bad[:8]}",
                              param="tokens", code="invalid_value")
        return {"prompt": tk.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tk = tokenizer()
        return {"eos_token": tk.eos_token, "bos_token": tk.bos_token, "pad_token": tk.pad_token,
                "chat_template": tk.chat_template, "model_max_length": llm.engine.max_model_len}

    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


__all__ = ["build_app", "DEFAULT_MAX_BODY_BYTES"]
