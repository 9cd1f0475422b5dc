"""The HTTP server with the real `openai` client on SmolLM2 (where text matters): completions and chat, streaming
and not, `n`, `logprobs`, `echo`, seeds, and greedy output equal to `LLM.generate` / `LLM.chat` on the same
prompts."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from inference import SamplingParams
from inference.entrypoints.openai.logprobs import logprob_value
from inference.entrypoints.openai.server import ServerThread
from tests.server_clients import openai_client

MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "Water boils at", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name a primary color."}]


@pytest.fixture(scope="module")
def server(smollm2):
    with ServerThread(smollm2) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_completions_greedy_equal_generate(smollm2, client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    offline = smollm2.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in offline]
    assert [c.token_ids for c in r.choices] == [o.outputs[0].token_ids for o in offline]
    assert [c.finish_reason for c in r.choices] == [o.outputs[0].finish_reason for o in offline]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in offline)
    assert r.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in offline)
    assert r.model == MODEL and r.object == "text_completion"


def test_token_id_prompt_and_stream_equal_the_text_prompt(smollm2, client):
    ids = smollm2.tokenizer.encode(PROMPTS[0])
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    offline = smollm2.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert whole.choices[0].text == text == offline.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == offline.finish_reason
    assert chunks[-1].usage.completion_tokens == len(offline.token_ids) and not chunks[-1].choices


def test_chat_greedy_equals_llm_chat_streamed_or_not(smollm2, client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=16, temperature=0)
    streamed = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True)
    deltas = list(streamed)
    offline = smollm2.chat(CHAT, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert r.choices[0].message.content == offline.text
    assert r.choices[0].message.role == "assistant"
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == offline.text
    assert deltas[-1].choices[0].finish_reason == offline.finish_reason
    assert r.usage.completion_tokens == len(offline.token_ids)


def test_seeded_samples_reproduce_and_equal_the_offline_run(smollm2, client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=1.0, n=3, seed=7)
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    offline = smollm2.generate(PROMPTS[1:2], SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=10))[0]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in second.choices] == [o.text for o in offline.outputs]
    assert len(set(texts)) > 1  # n samples differ from each other
    chat = [client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=1.0, n=2, seed=3)
            for _ in range(2)]
    assert [c.message.content for c in chat[0].choices] == [c.message.content for c in chat[1].choices]


def test_completion_logprobs_and_echo_equal_the_engine(smollm2, client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3,
                                  echo=True)
    [offline] = smollm2.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                              prompt_logprobs=3))
    out, lp = offline.outputs[0], r.choices[0].logprobs
    ids = offline.prompt_token_ids + out.token_ids
    assert r.choices[0].text == PROMPTS[0] + out.text
    assert lp.tokens == [smollm2.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [logprob_value(e[t]) for t, e in zip(ids[1:], offline.prompt_logprobs[1:] + out.logprobs)]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs[1:])  # the chosen token and the top 3
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=0)
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(expected[-6:], abs=1e-5)


def test_chat_logprobs_equal_the_engine(smollm2, client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    out = smollm2.chat(CHAT, SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0].outputs[0]
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([logprob_value(e[t]) for t, e in
                                                          zip(out.token_ids, out.logprobs)], abs=1e-5)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)  # greedy: the chosen is the top
    streamed = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True)
    tokens = [c.token for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for c in chunk.choices[0].logprobs.content]
    assert tokens == [c.token for c in content]


def test_stop_strings_models_health_and_metrics(smollm2, client, server):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"])
    offline = smollm2.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20, stop=[" 7"]))[0]
    assert r.choices[0].text == offline.outputs[0].text and r.choices[0].finish_reason == "stop"
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{server}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prefix_cache_hits_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "prompt_tokens_total", "generation_tokens_total"):
        assert f"pagejax_{name}" in metrics, name
    assert 'pagejax_request_success_total{finished_reason="stop",model_name="smollm2-135m"}' in metrics


def test_chat_response_format_json_schema_equals_structured_outputs(smollm2, client):
    """OpenAI's response_format goes through the structured-outputs path: the reply parses and validates, equals
    LLM.chat with the same StructuredOutputsParams, and a malformed schema is a 400 naming response_format."""
    import json

    import jsonschema

    from inference.structured.params import from_response_format

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "color", "schema": schema}}
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                       response_format=fmt)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    offline = smollm2.chat(CHAT, SamplingParams(temperature=0, max_tokens=24,
                                                structured_outputs=from_response_format(fmt)))[0].outputs[0]
    assert text == offline.text and r.choices[0].finish_reason == offline.finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert bad.value.body["param"] == "response_format", bad.value.body


def test_serve_freezes_the_heap_before_it_binds(smollm2, monkeypatch):
    """`serve` holds its process for the server's life: the loaded model goes out of the collector's full
    collections (`freeze_heap`) before uvicorn runs. `ServerThread` (this module's server) freezes nothing."""
    import gc
    import signal

    import uvicorn

    from inference.entrypoints.openai.server import free_port, serve

    frozen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: frozen.append(gc.get_freeze_count()))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        serve(smollm2, port=free_port())
    finally:
        signal.signal(signal.SIGTERM, previous)
        gc.unfreeze()
    assert frozen and frozen[0] > 0


def test_chat_and_tokenizer_requests_with_bad_values_name_them(smollm2, server):
    """A text part without its text, top_logprobs past the maximum (named as the client named it), a completion
    budget past the context, token ids past the vocabulary: each a 400 naming the parameter, and the server serves
    on."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ({**chat, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
         "a text content part needs a string 'text'"),
        ({**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be"),
        ({**chat, "max_completion_tokens": 10 ** 6}, "max_completion_tokens",
         f"maximum context length is {smollm2.engine.max_model_len} tokens"),
    ]
    for body, param, message in cases:
        r = httpx.post(f"{server}/v1/chat/completions", json=body, headers={"Connection": "close"}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"], error
    for path, body, param in (("/v1/completions", {"model": MODEL, "prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
                              ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
                              ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "a\udc80"}]},
                               "messages")):
        r = httpx.post(f"{server}{path}", content=json.dumps(body), timeout=60,
                       headers={"Connection": "close", "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "lone UTF-16 surrogate" in r.json()["error"]["message"]
    vocab = max(smollm2.tokenizer.vocab_size, smollm2.config.vocab_size)
    for tokens in ([-1], [1, vocab]):
        r = httpx.post(f"{server}/detokenize", json={"tokens": tokens}, headers={"Connection": "close"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
        assert f"must be in [0, {vocab})" in r.json()["error"]["message"]
    ok = httpx.post(f"{server}/v1/chat/completions", json=chat, headers={"Connection": "close"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
