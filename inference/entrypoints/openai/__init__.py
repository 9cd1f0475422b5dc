"""An OpenAI-compatible HTTP server over the engine's background loop (continuous batching across requests).

`build_app(llm, ...)` gives the FastAPI app (`app.py`); `serve(llm, ...)` runs it under uvicorn and drains in-flight
requests on SIGTERM (`server.py`); `scripts/serve.py` is the command line. One concept a module: the request
shapes (`protocol.py`), OpenAI-style errors (`errors.py`), logprob formatting (`logprobs.py`), the asyncio bridge to
the engine loop with its admission bound (`async_engine.py`), the two generation endpoints (`completions.py`,
`chat.py`), SSE framing (`sse.py`) and the Prometheus metrics (`metrics.py`).
"""
