"""Server-sent events as OpenAI streams them: `data: <json>\\n\\n` per chunk, then `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

DONE = "data: [DONE]\n\n"


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def event_stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    """A streaming response; proxies are told not to buffer it. Starlette cancels `chunks` when the client goes
    away, and the generator's own `finally` aborts its requests."""
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
