"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status OpenAI uses.

Every failure a client can cause ends here with a message naming the problem and the parameter, and none of them
reaches the engine loop, so one bad request never disturbs the others.
"""

from __future__ import annotations

import dataclasses
import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference.sampling.params import SamplingParams

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 503: "server_overloaded", 500: "server_error"}
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class OpenAIError(Exception):
    """A request failure with its HTTP status; `headers` (e.g. Retry-After) go on the response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def sampling_error(exc: ValueError, param_names: dict[str, str] | None = None) -> OpenAIError:
    """A SamplingParams ValueError as a 400. Its messages begin with the field's name ("top_p must be ..."), which
    is mapped back to the request's parameter name where the two differ (`param_names`)."""
    message = str(exc)
    field = message.split(" ", 1)[0].rstrip(":")
    param = None
    if field in _SAMPLING_FIELDS:
        param = (param_names or {}).get(field, field)
        if param != field:  # the message speaks of the request's parameter, as the client named it
            message = param + message[len(field):]
    return OpenAIError(400, message, param=param, code="invalid_value")


def _location(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body"]
    # pydantic names the union member it tried ("prompt.str"); the client knows only the field
    return ".".join(p for p in parts if not (p in ("str", "int", "list[str]", "list[int]", "list[list[int]]")
                                                or p.startswith(("list[", "function-"))))


async def validation_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 as OpenAI's 400, naming the first offending parameter."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg"))
        return OpenAIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json").response()
    param = _location(tuple(first.get("loc", ()))) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        message = f"unrecognized request argument supplied: {param}"
    elif kind == "missing" and not param:
        message = "the request body is empty; send a JSON object of the endpoint's parameters"
    elif kind == "missing":
        message = f"missing required parameter: {param}"
    elif kind == "model_attributes_type" and not param:
        content_type = request.headers.get("content-type", "")
        message = "the request body must be a JSON object" + (
            "" if not content_type or "json" in content_type.lower() else
            f", sent with Content-Type: application/json (got {content_type!r})")
    else:
        given = first.get("input")
        shown = json.dumps(given)[:80] if _jsonable(given) else repr(given)[:80]
        message = f"invalid value for {param or 'the body'}: {first.get('msg')} (got {shown})"
    return OpenAIError(400, message, param=param, code=kind or None).response()


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


async def openai_error_handler(request: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response()


# FastAPI's detail when the body is no JSON it can read (invalid UTF-8, nesting past the parser's depth)
_UNPARSED_BODY = "There was an error parsing the body"


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown path, a wrong method) in the same shape."""
    if exc.status_code == 400 and exc.detail == _UNPARSED_BODY:
        return OpenAIError(400, "the request body could not be read as JSON (it is not UTF-8, or it nests too "
                           "deeply); send a JSON object encoded as UTF-8", code="invalid_json").response()
    return OpenAIError(exc.status_code, str(exc.detail), code=None, headers=exc.headers).response()
