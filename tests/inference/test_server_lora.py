"""LoRA adapters over the HTTP server (vLLM's shape): `model` = an adapter's name runs that adapter (completions and
chat, streaming or not, greedy output equal to `LLM.generate` / `LLM.chat` with the LoRARequest), the base model
and adapters in concurrent requests, GET /v1/models with `parent`, 404s for unknown names, and the runtime
POST /v1/load_lora_adapter / unload_lora_adapter (a bad path a 400 with the loader's message; unloading waits for
the adapter's requests in flight). SmolLM2 (the session's LoRA-enabled `smollm2_lora`) with random PEFT adapters."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from configs.presets import get_model_config
from inference import LoRARequest, SamplingParams
from inference.entrypoints.openai.errors import OpenAIError
from inference.entrypoints.openai.models import ServedModels
from inference.entrypoints.openai.server import ServerThread
from tests import lora_adapters
from tests.server_clients import async_openai_client, openai_client

BASE = "smollm2-135m"
PROMPTS = ["The capital of France is", "My favourite food is"]
CHAT = [{"role": "user", "content": "Name a primary color."}]
TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
# Ids of their own in the session's LLM (the launcher test counts from 1, the reference test from 81).
IDS = {"srv-a": 61, "srv-b": 62}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root, config = tmp_path_factory.mktemp("server_adapters"), get_model_config(BASE)
    specs = {"srv-a": dict(rank=8, alpha=16, seed=31), "srv-b": dict(rank=16, alpha=16, seed=32, use_rslora=True,
                                                                     modules=("q_proj", "v_proj", "o_proj")),
             "srv-c": dict(rank=4, alpha=8, seed=33, modules=("gate_proj", "up_proj", "down_proj"))}
    return {name: lora_adapters.make_adapter(str(root / name), config, std=0.04, **spec)
            for name, spec in specs.items()}


@pytest.fixture(scope="module")
def offline(smollm2_lora, adapters):
    """Each model's greedy completions of PROMPTS and its chat reply, from the offline API (before the server's
    engine loop starts, so nothing else steps the engine meanwhile). Adapters under names and ids of their own."""
    loras = {None: None, **{name: LoRARequest(f"ref-{name}", 71 + i, path)
                            for i, (name, path) in enumerate(adapters.items())}}
    want = {}
    for name, lora in loras.items():
        outs = smollm2_lora.generate(PROMPTS, GREEDY, lora_request=lora)
        chat = smollm2_lora.chat(CHAT, GREEDY, lora_request=lora)[0]
        assert all(o.error is None for o in [*outs, chat])
        want[name] = ([o.outputs[0].text for o in outs], chat.outputs[0].text)
    assert len({tuple(texts) for texts, _ in want.values()}) == len(want)  # every adapter changes the output
    return want


@pytest.fixture(scope="module")
def server(smollm2_lora, adapters, offline):
    static = [LoRARequest(name, IDS[name], adapters[name]) for name in ("srv-a", "srv-b")]
    with ServerThread(smollm2_lora, lora_modules=static, allow_runtime_lora=True) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _completion(client, model: str, stream: bool) -> list[str]:
    if not stream:
        r = client.completions.create(model=model, prompt=PROMPTS, max_tokens=TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.model == model
        return [c.text for c in r.choices]
    texts = ["" for _ in PROMPTS]
    for chunk in client.completions.create(model=model, prompt=PROMPTS, max_tokens=TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        assert chunk.model == model
        for c in chunk.choices:
            texts[c.index] += c.text
    return texts


def _chat(client, model: str, stream: bool) -> str:
    kwargs = dict(model=model, messages=CHAT, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        r = client.chat.completions.create(**kwargs)
        assert r.model == model
        return r.choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                   if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_each_adapter_over_http_equals_generate_with_its_lora_request(client, offline, stream):
    for model, name in ((BASE, None), ("srv-a", "srv-a"), ("srv-b", "srv-b")):
        texts, reply = offline[name]
        assert _completion(client, model, stream) == texts, model
        assert _chat(client, model, stream) == reply, model


def test_base_and_adapters_in_concurrent_requests(server, offline):
    async def run():
        aclient = async_openai_client(server)
        models = [BASE, "srv-a", "srv-b"] * 2

        async def one(i: int, model: str) -> str:
            kwargs = dict(model=model, prompt=PROMPTS[i % 2], max_tokens=TOKENS, temperature=0,
                          extra_body={"ignore_eos": True})
            if i % 3:  # a mix of whole and streamed answers
                return (await aclient.completions.create(**kwargs)).choices[0].text
            return "".join([c.choices[0].text async for c in await aclient.completions.create(**kwargs, stream=True)
                            if c.choices])

        try:
            return models, await asyncio.gather(*(one(i, m) for i, m in enumerate(models)))
        finally:
            await aclient.close()

    models, texts = asyncio.run(run())
    for i, (model, text) in enumerate(zip(models, texts)):
        assert text == offline[None if model == BASE else model][0][i % 2], (i, model)


def test_models_list_the_base_and_each_adapter_with_its_parent(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [BASE, "srv-a", "srv-b"]
    assert cards[BASE].parent is None
    for name in ("srv-a", "srv-b"):
        assert cards[name].parent == BASE and cards[name].root == adapters[name]


def test_unknown_model_is_a_404_naming_the_served_models(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="srv-z", prompt=PROMPTS[0], max_tokens=2)
    assert "'srv-z' does not exist" in str(err.value) and "'srv-a'" in str(err.value)
    assert client.completions.create(model="srv-a", prompt=PROMPTS[0], max_tokens=2).choices[0].text


def test_runtime_load_and_unload(server, client, smollm2_lora, adapters, offline):
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server}/v1/{path}", json=body, timeout=60)

    r = post("load_lora_adapter", {"lora_name": "srv-c", "lora_path": adapters["srv-c"]})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'srv-c' added successfully."
    assert [m.id for m in client.models.list().data][-1] == "srv-c"
    assert _completion(client, "srv-c", stream=False) == offline["srv-c"][0]  # a third adapter in two slots: LRU

    again = post("load_lora_adapter", {"lora_name": "srv-c", "lora_path": adapters["srv-a"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = post("load_lora_adapter", {"lora_name": "srv-bad", "lora_path": "/nonexistent/adapter"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert "is not a folder" in bad.json()["error"]["message"]  # the loader's own message
    assert "srv-bad" not in [m.id for m in client.models.list().data]
    assert post("load_lora_adapter", {"lora_name": "x"}).status_code == 400  # lora_path missing

    # Unload while a request with the adapter streams: it finishes with the adapter; then the engine forgets it.
    stream = client.completions.create(model="srv-c", prompt=PROMPTS, max_tokens=TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    r = post("unload_lora_adapter", {"lora_name": "srv-c"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'srv-c' removed successfully."
    texts = ["" for _ in PROMPTS]
    for chunk in [first, *chunks]:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == offline["srv-c"][0]
    manager = smollm2_lora.engine.lora
    assert "srv-c" not in manager.ids and all(a.name != "srv-c" for a in manager.adapters.values())
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="srv-c", prompt=PROMPTS[0], max_tokens=2)
    missing = post("unload_lora_adapter", {"lora_name": "srv-c"})
    assert missing.status_code == 404 and "cannot be found" in missing.json()["error"]["message"]

    # The name can be loaded again (under a new id: ids key the prefix cache and are never reused).
    assert post("load_lora_adapter", {"lora_name": "srv-c", "lora_path": adapters["srv-c"]}).status_code == 200
    assert _chat(client, "srv-c", stream=True) == offline["srv-c"][1]
    assert post("unload_lora_adapter", {"lora_name": "srv-c"}).status_code == 200


def test_without_lora_an_adapter_name_is_a_404_and_runtime_loading_is_off(tiny_llama):
    with ServerThread(tiny_llama, served_model_name="tiny") as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": "srv-a", "prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 404 and "this server serves 'tiny'" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"})
        assert r.status_code == 404 and "--allow_runtime_lora" in r.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny"]
    with pytest.raises(ValueError, match="enable_lora=True"):
        ServedModels(["tiny"], tiny_llama.engine, allow_runtime_lora=True)


class _FakeEngine:
    """Records remove_lora; its manager registers anything (ServedModels's bookkeeping alone)."""

    class lora:  # noqa: N801 - stands in for the LoRAManager attribute
        adapters: dict = {}

        @staticmethod
        def register(request):
            return request.lora_int_id

    def __init__(self, busy: bool = False):
        self.removed, self.busy = [], busy

    def remove_lora(self, lora_id: int) -> None:
        if self.busy:
            raise ValueError("still used")
        self.removed.append(lora_id)


def test_unloading_waits_for_the_adapters_requests_in_flight():
    engine = _FakeEngine()
    models = ServedModels(["base"], engine, loras=[LoRARequest("a", 5, "/a")], allow_runtime_lora=True)
    lora = models.resolve("a")
    models.hold(lora, 2)
    models.unload("a")
    with pytest.raises(OpenAIError, match="does not exist"):
        models.resolve("a")
    models.release(lora)
    assert engine.removed == []  # one request still runs with it
    models.load("a", "/a2")  # the name is free again, under a new id
    models.release(lora)
    assert engine.removed == [5]
    assert models.resolve("a").lora_int_id == 6
    with pytest.raises(ValueError, match="given twice"):
        ServedModels(["base"], engine, loras=[LoRARequest("base", 7, "/b")])
    # An engine that refuses (a request from outside the server holds the adapter): the name still goes, quietly.
    refusing = ServedModels(["base"], _FakeEngine(busy=True), loras=[LoRARequest("a", 5, "/a")],
                            allow_runtime_lora=True)
    refusing.unload("a")
    assert refusing.names() == ["base"]
