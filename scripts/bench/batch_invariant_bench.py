"""The cost of `LLM(batch_invariant=True)`: throughput against the default mode in one run, same workload.

    python scripts/bench/batch_invariant_bench.py --models=smollm2-135m,tiny-llama --batch=1,8,32 --baseline=7bdff85 \
        --json=bi.json

For each model both engines are built side by side (same weights, seed and budgets); for each batch size they run
the same random prompts (greedy, EOS ignored, --output_len tokens each) alternately, --repeats times after one
warm-up run each (compiles), so load from other processes hits both modes alike; the median wall time is reported
as output tokens per second, and the ratio default / invariant (> 1: the invariant mode is slower by that factor).
Also the matmul alone at SmolLM2's shapes: the C++ invariant kernel against XLA's dot, per row count, and against
the same kernel's source at --baseline (a git commit; its csrc/ built with the same flags into a second library), so
a kernel change is measured side by side in one run. The last line printed is one JSON object (also written to
--json when given).
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from inference import LLM, SamplingParams  # noqa: E402
from kernels_pallas.matmul.invariant_cpu import KERNEL, invariant_matmul  # noqa: E402
from kernels_pallas.native import build  # noqa: E402

flags.DEFINE_list("models", ["smollm2-135m", "tiny-llama"], "models to measure")
flags.DEFINE_list("batch", ["1", "8", "32"], "batch sizes")
flags.DEFINE_integer("input_len", 64, "prompt tokens per request")
flags.DEFINE_integer("output_len", 32, "generated tokens per request")
flags.DEFINE_integer("repeats", 3, "measured runs per mode and batch size (median reported)")
flags.DEFINE_string("json", None, "also write the result here")
flags.DEFINE_integer("matmul_rounds", 7, "timed rounds per kernel in the matmul table (fastest reported)")
flags.DEFINE_string("baseline", None, "git commit whose invariant kernel the matmul table also times (none: skipped)")
FLAGS = flags.FLAGS


def _run(llm: LLM, prompts: list[list[int]]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=FLAGS.output_len, ignore_eos=True)
    llm.engine.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return time.perf_counter() - start


def _engines(model: str) -> dict[str, dict]:
    batches = [int(b) for b in FLAGS.batch]
    kwargs = dict(max_num_seqs=max(batches), max_num_batched_tokens=512, kv_cache_memory_bytes=256 << 20,
                  compilation_cache_dir=None)
    llms = {"default": LLM(model, **kwargs), "invariant": LLM(model, batch_invariant=True, **kwargs)}
    rng = np.random.default_rng(0)
    out: dict[str, dict] = {}
    for b in batches:
        prompts = [rng.integers(1, llms["default"].config.vocab_size, FLAGS.input_len).tolist() for _ in range(b)]
        for llm in llms.values():
            _run(llm, prompts)  # compiles
        times: dict[str, list[float]] = {name: [] for name in llms}
        for _ in range(FLAGS.repeats):
            for name, llm in llms.items():
                times[name].append(_run(llm, prompts))
        row = {name: {"wall_s": statistics.median(t), "output_tok_s": b * FLAGS.output_len / statistics.median(t)}
               for name, t in times.items()}
        row["slowdown"] = row["invariant"]["wall_s"] / row["default"]["wall_s"]
        out[str(b)] = row
        print(model, b, json.dumps(row), flush=True)
    return out


def _baseline_kernel(commit: str):
    """The invariant kernel as it was at `commit`: that commit's csrc/ compiled (build.FLAGS) into a second library,
    registered under its own target name; returns f(x, w, transposed) calling it."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    csrc = os.path.relpath(build.CSRC, repo)
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{commit}:{csrc}"], capture_output=True, text=True,
                           cwd=repo, check=True).stdout.split()
    directory = tempfile.mkdtemp(prefix="invariant_baseline_")
    for name in names:
        with open(os.path.join(directory, name), "wb") as f:
            f.write(subprocess.run(["git", "show", f"{commit}:{csrc}/{name}"], capture_output=True, cwd=repo,
                                   check=True).stdout)
    library = os.path.join(directory, "baseline.so")
    sources = [os.path.join(directory, n) for n in names if n.endswith(".cc")]
    subprocess.run(["g++", *build.FLAGS, "-pthread", "-I", jax.ffi.include_dir(), "-I", directory, *sources, "-o",
                    library], check=True)
    target = f"{KERNEL.target}_baseline"
    handler = getattr(ctypes.CDLL(library), KERNEL.symbol)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")

    def call(x: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
        n = w.shape[0] if transposed else w.shape[1]
        out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
        return jax.ffi.ffi_call(target, out)(x, w, transposed=transposed)

    return call


def _matmul_rows() -> dict[str, dict]:
    """The invariant kernel against XLA's dot (and the --baseline kernel) at SmolLM2's widest projection
    (576 -> 1536) and tied LM head. Each is timed in rounds of repeated calls, the rounds alternating between the
    kernels (load from other processes hits all alike); the fastest round is reported."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((576, 1536)), jnp.float32)
    emb = jnp.asarray(rng.standard_normal((49152, 576)), jnp.float32)
    base = _baseline_kernel(FLAGS.baseline) if FLAGS.baseline else None
    cases = {"mlp_576x1536": (w, False, lambda x: x @ w), "lm_head_576x49152": (emb, True, lambda x: x @ emb.T)}
    out = {}
    for name, (wt, transposed, xla) in cases.items():
        fns = {"xla": jax.jit(xla), "invariant": jax.jit(lambda x, wt=wt, t=transposed: invariant_matmul(
            x, wt, transposed=t))}
        if base is not None:
            fns["baseline"] = jax.jit(lambda x, wt=wt, t=transposed: base(x, wt, t))
        for m in (1, 8, 32, 256):
            x = jnp.asarray(rng.standard_normal((m, 576)), jnp.float32)
            ys = {label: np.asarray(f(x)) for label, f in fns.items()}
            reps = 10 if m < 256 else 2
            best = {label: float("inf") for label in fns}
            for round_ in range(FLAGS.matmul_rounds):
                labels = list(fns)[round_ % len(fns):] + list(fns)[:round_ % len(fns)]  # no kernel always second
                for label in labels:
                    f = fns[label]
                    time.sleep(0.02)  # the previous kernel's spinning workers (XLA's, the C++ pools) gone to sleep
                    start = time.perf_counter()
                    for _ in range(reps):
                        f(x).block_until_ready()
                    best[label] = min(best[label], (time.perf_counter() - start) / reps)
            row = {f"{label}_ms": t * 1e3 for label, t in best.items()}
            row["slowdown"] = row["invariant_ms"] / row["xla_ms"]
            if base is not None:
                row["new_over_baseline"] = row["invariant_ms"] / row["baseline_ms"]
                row["baseline_bits_equal"] = bool(np.array_equal(ys["baseline"], ys["invariant"]))
            out[f"{name}_m{m}"] = row
            print(name, m, json.dumps(row), flush=True)
    return out


def main(argv) -> None:
    del argv
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), "commit": commit,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "load_average_start": os.getloadavg(), "baseline": FLAGS.baseline,
              "input_len": FLAGS.input_len, "output_len": FLAGS.output_len, "repeats": FLAGS.repeats,
              "matmul": _matmul_rows(), "engines": {m: _engines(m) for m in FLAGS.models}}
    result["load_average_end"] = os.getloadavg()
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
