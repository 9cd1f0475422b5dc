"""Device bytes around `LLM.sleep` / `wake_up`, as `jax.live_arrays()` counts them, and the seconds each takes.

    python scripts/bench/rl_sleep_benchmark.py --model=smollm2-135m

Live bytes before, asleep at level 1 (KV cache freed), asleep at level 2 (weights on host too), and after
wake-up; greedy tokens of a few prompts before and after must be equal (checked, reported). The last line printed
is one JSON object.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from inference import LLM, SamplingParams  # noqa: E402

flags.DEFINE_string("model", "smollm2-135m", "model name or path")
flags.DEFINE_integer("kv_cache_memory_bytes", 256 << 20, "KV cache budget")
FLAGS = flags.FLAGS
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


def main(argv) -> None:
    del argv
    llm = LLM(FLAGS.model, kv_cache_memory_bytes=FLAGS.kv_cache_memory_bytes)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    before_tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    out = {"model": FLAGS.model, "kv_cache_bytes": llm.runner.kv_cache_bytes,
           "param_bytes": sum(x.nbytes for x in llm.runner.param_leaves), "live_before": live_bytes()}
    for level in (1, 2):
        t = time.perf_counter()
        llm.sleep(level=level)
        out[f"sleep{level}_s"] = time.perf_counter() - t
        out[f"live_level{level}"] = live_bytes()
    t = time.perf_counter()
    llm.wake_up()
    out["wake_up_s"] = time.perf_counter() - t
    out["live_after"] = live_bytes()
    out["tokens_equal_after_wake_up"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)] == \
        before_tokens
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    out.update(date=time.strftime("%Y-%m-%d"), commit=commit, machine=platform.machine(), cpus=os.cpu_count(),
               jax=jax.__version__)
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
