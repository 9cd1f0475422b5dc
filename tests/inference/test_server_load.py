"""The HTTP server under load, on the random tiny model (token-id prompts; it has no tokenizer): 32 concurrent
streaming clients through the real `openai` client, clients that disconnect mid-stream (their pages come back, as
/metrics shows), and the bounded waiting queue (503 with Retry-After)."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import numpy as np
import openai
import pytest

from inference import SamplingParams
from inference.entrypoints.openai.server import ServerThread
from tests.inference.test_serving import make_llm
from tests.server_clients import async_openai_client

MODEL = "tiny"


@pytest.fixture(scope="module")
def llm():
    """The sharpened tiny model of test_serving (greedy choices far from ties, so batch composition cannot flip
    them); 16 running slots."""
    return make_llm()


@pytest.fixture(scope="module")
def server(llm):
    # 16 running slots + 16 waiting: exactly the 32 clients below fit, a 33rd sequence does not
    with ServerThread(llm, served_model_name=MODEL, max_waiting=16) as url:
        yield url


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 512, size=int(rng.integers(4, 40))).tolist() for _ in range(count)]


def metric(url: str, name: str, **labels: str) -> float:
    """A sample's value from /metrics, the one whose labels include `labels`."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        match = re.fullmatch(rf"pagejax_{name}(?:{{(.*)}})? (\S+)", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            return float(match.group(2))
    raise AssertionError(f"{name} {labels} missing from /metrics")


def wait_for_kv_usage_zero(url: str, timeout_s: float = 30.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (usage := metric(url, "kv_cache_usage_perc")) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return usage


async def stream_tokens(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"return_token_ids": True})
    tokens, reason = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            tokens += choice.token_ids
            reason = choice.finish_reason or reason
    return tokens, reason


def test_32_concurrent_streaming_clients_equal_the_offline_run(llm, server):
    ps = prompts(32)
    lengths = [8 + (i % 5) * 6 for i in range(32)]

    async def main():
        async with async_openai_client(server) as client:
            return await asyncio.gather(*(stream_tokens(client, p, n) for p, n in zip(ps, lengths)))

    results = asyncio.run(main())
    offline = llm.generate(prompt_token_ids=ps, sampling_params=[SamplingParams(temperature=0, max_tokens=n)
                                                                 for n in lengths])
    assert len(results) == 32
    for (tokens, reason), out in zip(results, offline):
        assert tokens == out.outputs[0].token_ids
        assert reason == out.outputs[0].finish_reason
    assert wait_for_kv_usage_zero(server) == 0.0


def test_clients_that_disconnect_mid_stream_free_their_pages(llm, server):
    """8 clients hang up after two chunks of a long generation while 8 others finish; the 8 finished ones equal
    the offline run and every page comes back."""
    leaving, staying = prompts(8, seed=1), prompts(8, seed=2)

    async def leave(client: httpx.AsyncClient, prompt: list[int]) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 300, "ignore_eos": True, "stream": True}
        chunks = 0
        async with client.stream("POST", f"{server}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks == 2:
                    break  # leaving the block closes the connection mid-stream
        return chunks

    async def main():
        async with httpx.AsyncClient(timeout=60) as http, \
                async_openai_client(server) as client:
            stays = [stream_tokens(client, p, 24) for p in staying]
            return await asyncio.gather(*(leave(http, p) for p in leaving), *stays)

    results = asyncio.run(main())
    assert results[:8] == [2] * 8
    offline = llm.generate(prompt_token_ids=staying, sampling_params=SamplingParams(temperature=0, max_tokens=24))
    assert [r[0] for r in results[8:]] == [o.outputs[0].token_ids for o in offline]
    assert wait_for_kv_usage_zero(server) == 0.0
    assert metric(server, "num_requests_running") == 0
    assert metric(server, "request_success_total", finished_reason="abort") == 8


def test_beyond_max_waiting_is_a_503_with_retry_after_and_the_rest_carry_on(server):
    """32 long streams fill the 16 slots and the 16 waiting places; one more request is refused at once, a
    finished one makes room again."""
    long_prompts = prompts(32, seed=3)

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            opened = []
            for p in long_prompts:
                body = {"model": MODEL, "prompt": p, "max_tokens": 300, "ignore_eos": True, "stream": True}
                response = await http.send(http.build_request("POST", f"{server}/v1/completions", json=body),
                                           stream=True)
                assert response.status_code == 200
                opened.append(response)
            refused = await http.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3]})
            for response in opened:
                await response.aclose()
            return refused

    refused = asyncio.run(main())
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert "max_waiting=16" in error["message"] and error["code"] == "overloaded"
    assert wait_for_kv_usage_zero(server) == 0.0
    ok = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2,
                                                                "ignore_eos": True},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_request_that_can_never_fit_is_a_400_not_a_retry(server):
    """33 sequences against 16 slots and 16 waiting places: no wait makes room for them, so no Retry-After."""
    body = {"model": MODEL, "prompt": [1, 2, 3], "n": 33, "max_tokens": 2}
    refused = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400 and "retry-after" not in refused.headers, refused.text
    error = refused.json()["error"]
    assert error["param"] == "n" and error["code"] == "too_many_sequences"
    assert "33 sequences" in error["message"] and "16 running slots and max_waiting=16" in error["message"]
    ok = httpx.post(f"{server}/v1/completions", json={**body, "n": 32, "ignore_eos": True}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 32


def test_a_non_streaming_client_that_gives_up_aborts_its_request(server, llm):
    """The client times out long before a 300-token completion would finish; the server notices the closed
    connection while waiting and aborts the request (its pages free, its finish reason "abort"). The engine is held
    (its lock) from the moment the request runs until the client has gone, so the tiny model cannot finish the
    completion first, however fast it steps."""
    import threading

    from inference.entrypoints.openai.serving import DISCONNECT_POLL_S

    before = metric(server, "request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": [9, 8, 7], "max_tokens": 300, "ignore_eos": True}
    timed_out = threading.Event()

    def client() -> None:
        try:
            httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
        except httpx.ReadTimeout:
            timed_out.set()

    thread = threading.Thread(target=client)
    thread.start()
    deadline = time.monotonic() + 30
    while not llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.001)
    with llm.engine._lock:  # no step runs until the client has timed out and the server has had time to see it
        thread.join(30)
        time.sleep(2 * DISCONNECT_POLL_S)
    assert timed_out.is_set()
    deadline = time.monotonic() + 30
    while metric(server, "request_success_total", finished_reason="abort") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "request_success_total", finished_reason="abort") == before + 1
    assert wait_for_kv_usage_zero(server) == 0.0


def test_the_server_benchmark_clients_count_every_token(server):
    """scripts/bench/server_bench.py (benchmark.py --mode=server's clients): every request and token is counted, and
    the latencies it reports are real measurements."""
    from scripts.bench.server_bench import drive

    result = asyncio.run(drive(server, MODEL, prompts(4, seed=5), [0.01] * 4, max_tokens=5))
    assert result["requests"] == 4 and result["output_tokens"] == 20
    assert result["prompt_tokens"] == sum(map(len, prompts(4, seed=5)))
    assert 0 < result["ttft_s"]["p50"] <= result["ttft_s"]["p99"] and result["itl_s"]["p50"] >= 0
