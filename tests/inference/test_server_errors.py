"""Bad requests to the HTTP server: each gets the right status and an OpenAI-style error naming the problem (and
the parameter), and the server answers the next good request. The tiny model (no tokenizer, no chat template)
behind an API key and a 16 KiB body limit."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from inference.entrypoints.openai.server import ServerThread
from tests.server_clients import openai_client

KEY = "sekrit-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# ignore_eos: the random tiny model samples its EOS (id 0) about once in 500 tokens, and a good request must
# still give exactly max_tokens tokens.
GOOD = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama):
    with ServerThread(tiny_llama, served_model_name="tiny", api_key=KEY, max_body_bytes=16 << 10) as url:
        yield url


def post(url: str, path: str, body, headers=AUTH) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) or callable(getattr(body, "__next__", None)) \
        else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, headers={"Content-Type": "application/json", **headers},
                      timeout=60)


# (what, path, body, status, param, a piece of the message)
CASES = [
    ("wrong type", "/v1/completions", {**GOOD, "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ("bool for a number", "/v1/completions", {**GOOD, "temperature": True}, 400, "temperature", "valid number"),
    ("negative max_tokens", "/v1/completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens", "max_tokens must be"),
    ("top_p 0", "/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
    ("n 0", "/v1/completions", {**GOOD, "n": 0}, 400, "n", "n must be an integer >= 1"),
    ("negative temperature", "/v1/completions", {**GOOD, "temperature": -0.5}, 400, "temperature", "finite number"),
    ("logprobs over the maximum", "/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    ("echo logprobs over the maximum", "/v1/completions", {**GOOD, "logprobs": 30, "echo": True}, 400, "logprobs",
     "[0, 20]"),
    ("empty stop string", "/v1/completions", {**GOOD, "stop": [""]}, 400, "stop", "non-empty"),
    ("unknown field", "/v1/completions", {**GOOD, "best_of_n": 2}, 400, "best_of_n", "unrecognized"),
    ("missing prompt", "/v1/completions", {"model": "tiny"}, 400, "prompt", "missing required parameter"),
    ("empty prompt", "/v1/completions", {**GOOD, "prompt": []}, 400, "prompt", "must not be empty"),
    ("token id outside the vocabulary", "/v1/completions", {**GOOD, "prompt": [1, 99999]}, 400, "prompt",
     "outside the vocabulary"),
    ("prompt longer than the context", "/v1/completions", {**GOOD, "prompt": [3] * 1100}, 400, "prompt",
     "model context is"),
    ("text prompt without a tokenizer", "/v1/completions", {**GOOD, "prompt": "hello"}, 400, "prompt",
     "no tokenizer"),
    ("malformed JSON", "/v1/completions", '{"prompt": [1, 2', 400, None, "not valid JSON"),
    ("body not an object", "/v1/completions", "[1, 2]", 400, None, "JSON object"),
    ("chat without messages", "/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages",
     "at least 1"),
    ("chat without a template", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user",
                                                                                       "content": "hi"}]},
     400, "messages", "no chat template"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs",
     "needs logprobs=true"),
    ("max_tokens past the context", "/v1/completions", {**GOOD, "max_tokens": 100_000}, 400, "max_tokens",
     "lower max_tokens to at most"),
    ("stream_options without stream", "/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400,
     "stream_options", "only allowed with stream=true"),
    ("empty body", "/v1/completions", "", 400, None, "the request body is empty"),
    ("body not UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "encoded as UTF-8"),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-9"}, 404, "model", "does not exist"),
    ("oversized body", "/v1/completions", {**GOOD, "prompt": [3] * 8000}, 413, None, "larger than"),
    ("missing auth", "/v1/completions", GOOD, 401, None, "API key"),
    ("wrong key", "/v1/completions", GOOD, 401, None, "API key"),
    ("unknown path", "/v1/embeddings", GOOD, 404, None, "Not Found"),
]


@pytest.mark.parametrize("what, path, body, status, param, message", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_its_status_and_message(server, what, path, body, status, param, message):
    headers = {} if what == "missing auth" else {"Authorization": "Bearer wrong"} if what == "wrong key" else AUTH
    r = post(server, path, body, headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"], error
    assert error["param"] == param
    ok = post(server, "/v1/completions", GOOD)  # the server still serves
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_body_sent_as_plain_text_is_told_the_content_type(server):
    r = post(server, "/v1/completions", GOOD, {**AUTH, "Content-Type": "text/plain"})
    assert r.status_code == 400, r.text
    assert "Content-Type: application/json (got 'text/plain')" in r.json()["error"]["message"]
    assert post(server, "/v1/completions", GOOD).status_code == 200


def test_a_chunked_body_over_the_limit_is_a_413(server):
    chunks = (b'{"model": "tiny", "prompt": [' + b"3, " * 8000 + b'3]}' for _ in range(1))
    r = post(server, "/v1/completions", chunks)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]


def test_the_openai_client_sees_typed_errors(server):
    good = openai_client(server, KEY)
    with pytest.raises(openai.BadRequestError, match="top_p must be"):
        good.completions.create(model="tiny", prompt=[1, 2], top_p=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        good.completions.create(model="nope", prompt=[1, 2])
    with pytest.raises(openai.AuthenticationError):
        openai_client(server, "wrong").models.list()
    assert good.completions.create(model="tiny", prompt=[1, 2], max_tokens=3,
                                   extra_body={"ignore_eos": True}).usage.completion_tokens == 3
    # /health and /metrics stay open without the key (probes and scrapers carry none)
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/metrics").status_code == 200
