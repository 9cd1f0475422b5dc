"""scripts/serve.py as a subprocess on the tiny model: the key from $PAGEJAX_API_KEY, and SIGTERM drains the
in-flight streams (each gets every token and [DONE]) before the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from inference.entrypoints.openai.server import free_port

REPO = Path(__file__).resolve().parents[2]
KEY = "drain-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOKENS = 300


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("scripts/serve.py did not become healthy")


SIGNALLED = threading.Event()


def stream(url: str, prompt: list[int], first_chunk: threading.Event, result: dict) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    tokens, lines = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line)
            result["after_sigterm"] = result.get("after_sigterm", 0) + SIGNALLED.is_set()
            if line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                tokens += choice["token_ids"]
                result["finish_reason"] = choice["finish_reason"] or result.get("finish_reason")
            first_chunk.set()
    result.update(tokens=tokens, last=lines[-1] if lines else None)


def test_sigterm_drains_in_flight_streams_then_exits(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, str(REPO / "scripts" / "serve.py"), "--model=tiny-llama", f"--port={port}",
           "--served_model_name=tiny", "--kv_cache_memory_bytes=4194304", "--max_num_seqs=4",
           "--max_num_batched_tokens=64", f"--compilation_cache_dir={REPO}/.jax_cache", "--log_level=warning"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PAGEJAX_API_KEY": KEY}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(url, proc)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny"
        events = [threading.Event() for _ in range(2)]
        results: list[dict] = [{}, {}]
        threads = [threading.Thread(target=stream, args=(url, [1 + i, 2, 3], e, r))
                   for i, (e, r) in enumerate(zip(events, results))]
        for t in threads:
            t.start()
        assert all(e.wait(120) for e in events)
        proc.send_signal(signal.SIGTERM)
        SIGNALLED.set()
        for t in threads:
            t.join(120)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    for r in results:
        assert len(r["tokens"]) == TOKENS and r["finish_reason"] == "length" and r["last"] == "data: [DONE]"
    assert max(r["after_sigterm"] for r in results) > 1  # chunks still came after the signal: it drained them
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


def test_lora_flags_reach_the_server(monkeypatch, tmp_path):
    """--lora NAME=PATH becomes build_app's lora_modules (ids 1, 2, ... in flag order), --allow_runtime_lora turns
    LoRA on without --lora; an adapter the loader rejects stops the launcher with its message before it binds."""
    from absl import flags

    from inference.entrypoints.openai import server
    from inference.lora.request import LoRARequest
    from scripts import serve
    from tests.llm_configs import TINY_ENGINE

    FLAGS = flags.FLAGS
    seen: dict = {}
    monkeypatch.setattr(serve, "build_llm", lambda **kw: seen.update(build=kw) or "llm")
    monkeypatch.setattr(server, "serve", lambda llm, **kw: seen.update(serve=kw))
    FLAGS.unparse_flags()
    try:
        FLAGS(["serve.py", "--lora=a=/adapters/a", "--lora=b=/adapters/b"])
        serve.main(["serve.py"])
        assert seen["build"] == {"enable_lora": False}
        assert seen["serve"]["lora_modules"] == [LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")]
        assert seen["serve"]["allow_runtime_lora"] is False
        FLAGS.unparse_flags()
        FLAGS(["serve.py", "--allow_runtime_lora"])
        serve.main(["serve.py"])
        assert seen["build"] == {"enable_lora": True} and seen["serve"]["allow_runtime_lora"] is True

        monkeypatch.undo()  # the real serve(): build_app loads the adapter before uvicorn starts
        llm = TINY_ENGINE.build(enable_lora=True, max_loras=1, max_lora_rank=8)
        monkeypatch.setattr(serve, "build_llm", lambda **kw: llm)
        FLAGS.unparse_flags()
        FLAGS(["serve.py", f"--lora=a={tmp_path / 'missing'}"])
        with pytest.raises(SystemExit, match="error: LoRA adapter 'a'.*is not a folder"):
            serve.main(["serve.py"])
    finally:
        FLAGS.unparse_flags()


def test_warmup_flag_warms_the_engine_before_serving(monkeypatch, capsys):
    """--warmup calls LLM.warmup() once, before the server starts; without it the launcher compiles nothing."""
    from absl import flags

    from inference.entrypoints.openai import server
    from scripts import serve

    calls: list[str] = []

    class FakeLLM:
        def warmup(self):
            calls.append("warmup")
            return 7

    FLAGS = flags.FLAGS
    monkeypatch.setattr(serve, "build_llm", lambda **kw: FakeLLM())
    monkeypatch.setattr(server, "serve", lambda llm, **kw: calls.append("serve"))
    FLAGS.unparse_flags()
    try:
        FLAGS(["serve.py", "--warmup"])
        serve.main(["serve.py"])
        assert calls == ["warmup", "serve"]
        assert "warm-up: 7 step variants compiled" in capsys.readouterr().out
        FLAGS.unparse_flags()
        FLAGS(["serve.py"])
        serve.main(["serve.py"])
        assert calls == ["warmup", "serve", "serve"]
    finally:
        FLAGS.unparse_flags()
