"""The load generator of `scripts/bench/benchmark.py --mode=server`: Poisson arrivals of streaming completion requests,
each its own concurrent client, against a running server; per-request TTFT and inter-token latency as the client
sees them, and output throughput.

Run by benchmark.py as a child process (so the clients' Python does not share the server's GIL and cores more
than a real client would), with a workload file of {"prompts": [[ids]], "gaps_s": [...], "max_tokens": n}:

    python scripts/bench/server_bench.py --server_url=http://127.0.0.1:8000 --served_model=smollm2-135m --workload=w.json

The last line printed is one JSON object, in `inference.engine.metrics.summarize_requests`'s shape.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import numpy as np
from absl import app, flags

from inference.engine.metrics import percentiles

# Names that no other launcher defines, so tests can import this module beside them.
_URL = flags.DEFINE_string("server_url", None, "The server's base URL.")
_MODEL = flags.DEFINE_string("served_model", None, "The served model name.")
_WORKLOAD = flags.DEFINE_string("workload", None, "JSON file: prompts, gaps_s, max_tokens.")


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                      sent: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.perf_counter()
                for choice in json.loads(line[6:])["choices"]:
                    times += [now] * len(choice.get("token_ids", []))
    return {"ttft": times[0] - sent if times else None, "itl": list(np.diff(times)), "tokens": len(times),
            "prompt_tokens": len(prompt)}


async def drive(url: str, model: str, prompts: list[list[int]], gaps_s: list[float], max_tokens: int) -> dict:
    """Send prompt i at sum(gaps_s[:i+1]) seconds after the start, each on its own task; wait for all."""
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        arrivals = start + np.cumsum(gaps_s)
        tasks = []
        for prompt, at in zip(prompts, arrivals):
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(client, url, model, prompt, max_tokens, float(at))))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    out_tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "prompt_tokens": sum(r["prompt_tokens"] for r in results),
            "output_tokens": out_tokens, "wall_s": wall, "output_tok_s": out_tokens / wall,
            "ttft_s": percentiles([r["ttft"] for r in results if r["ttft"] is not None]),
            "itl_s": percentiles([x for r in results for x in r["itl"]])}


def main(argv) -> None:
    del argv
    missing = [f"--{f.name}" for f in (_URL, _MODEL, _WORKLOAD) if not f.value]
    if missing:  # checked here, not as required flags: tests import this module beside other launchers
        raise app.UsageError(f"pass {', '.join(missing)}")
    with open(_WORKLOAD.value) as f:
        w = json.load(f)
    result = asyncio.run(drive(_URL.value, _MODEL.value, w["prompts"], w["gaps_s"], w["max_tokens"]))
    print(json.dumps(result), file=sys.stdout)


if __name__ == "__main__":
    app.run(main)
