"""Where a generation's time goes: host work around each step vs the jitted step, and inside the step attention,
the KV-cache write and the rest (matmuls, norms, RoPE, LM head, sampling).

    python scripts/tools/profile_step.py --batch=1,32 --input_len=128 --output_len=128 --json

For each batch size: one full generation to compile every shape, then a measured generation driven step by step
through the engine, with `ModelRunner.execute` and its jitted decode step wrapped in timers. Per decode step:

* host: `Engine.step` minus `runner.execute` (scheduling, page bookkeeping, batch building, sampling tensors,
  appending tokens, stop checks);
* dispatch: the jitted call until it returns (pytree flattening, host-to-device copies of the numpy inputs, launch);
* wait + readback: the rest of `execute` (the step's compute, then the sampled tokens to the host).

Then one decode step from the middle of the run is replayed in isolation (median of --repeats, variants
interleaved so a busy machine slows them alike): the runner's own compiled step with numpy inputs, the same with
inputs already on the device, and two re-traced variants: attention replaced by its query (no page gather, no
softmax; the KV write kept), and attention and the KV write both removed. Differences give attention's and the
KV write's share; what remains is the dense part, compared with the model's matmuls alone (same weights, replayed
beside it), with a 1024^3 float32 matmul timed in the same run, and with this machine's idle ceilings (--flops,
--bandwidth; issue 9's measured 210 GFLOP/s and 50 GB/s). Recompiles during the measured run
and host-to-device transfers per step (jax's transfer guard log) are counted too. With --ops the isolated step is
also traced with jax's profiler (XLA CPU thunk events) and the top XLA ops by time are listed, grouped by kind
(`copy_gather_fusion.17` counts as `copy_gather_fusion`).

The machine may be shared: compare rows of one run, as ratios; absolute milliseconds move with the load.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
import tempfile
import time

from absl import app, flags

if "--ops" in sys.argv and "xla_cpu_enable_xprof_traceme" not in os.environ.get("XLA_FLAGS", ""):
    # XLA CPU emits per-op trace events only with this flag, read when jax initializes its backend.
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import models.attention as attention_module
from inference import LLM, SamplingParams
from inference.tools.model_bytes import param_count

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset name, .gguf file or HF folder.")
flags.DEFINE_list("batch", ["1", "32"], "Batch sizes to profile.")
flags.DEFINE_integer("input_len", 128, "Prompt tokens per request.")
flags.DEFINE_integer("output_len", 128, "Generated tokens per request.")
flags.DEFINE_string("dtype", "float32", "Weight and KV dtype.")
flags.DEFINE_string("quantization", None, "Weights: None (--dtype), int8, int4, gguf (as LLM(quantization=)); the "
                    "matmul-alone replay is float-only and is skipped then.")
flags.DEFINE_integer("repeats", 25, "Timed replays of the isolated step per variant.")
flags.DEFINE_float("flops", 210e9, "The machine's float32 matmul FLOP/s, for the dense-part floor.")
flags.DEFINE_float("bandwidth", 50e9, "The machine's memory bandwidth in B/s, for the dense-part floor.")
flags.DEFINE_string("kv_cache_dtype", None, "KV cache dtype: None (the model dtype), float32, bfloat16, int8.")
flags.DEFINE_string("attn_impl", "auto", "Attention implementation (LLM(attn_impl=)): auto, reference, cpu, ...")
flags.DEFINE_boolean("json", False, "Print one JSON object as the last line.")
flags.DEFINE_integer("seed", 0, "Seed for the random prompts.")
flags.DEFINE_boolean("ops", False, "Also trace the isolated step and list the top XLA ops by time.")
flags.DEFINE_integer("ops_top", 12, "How many op kinds --ops lists, most expensive first (0: all of them).")


class StepTimer:
    """Wraps `runner.execute` and the runner's jitted decode step; records per-step times of decode steps and
    keeps the arguments of one mid-run decode step for replay."""

    def __init__(self, runner, capture_at: int):
        self.runner, self.capture_at = runner, capture_at
        self.execute_s: list[float] = []
        self.dispatch_s: list[float] = []
        self.captured = None
        self._execute, self._decode = runner.execute, runner.packed_decode_step  # the one `execute` runs
        runner.execute = self._timed_execute
        runner.packed_decode_step = self._timed_decode

    def _timed_decode(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self._decode(*args, **kwargs)
        self.dispatch_s.append(time.perf_counter() - t0)
        return out

    def _timed_execute(self, inp, sampling, *, is_decode: bool, **kwargs):
        if is_decode and len(self.execute_s) == self.capture_at:
            self.captured = (inp, sampling, {k: v for k, v in kwargs.items() if k != "fetch"})  # the step's own
        t0 = time.perf_counter()
        out = self._execute(inp, sampling, is_decode=is_decode, **kwargs)
        if is_decode:
            self.execute_s.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        self.runner.execute, self.runner.packed_decode_step = self._execute, self._decode


@contextlib.contextmanager
def stderr_to(path: str):
    """Redirect file descriptor 2 (where jax's C++ transfer-guard log goes) into `path`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def measured_generation(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    """Drive the engine step by step; per-decode-step host / dispatch / wait split, recompiles, transfers."""
    engine, runner = llm.engine, llm.runner
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.reset_prefix_cache()
    engine.reset_stats()
    compiled_before = runner.num_compilations()
    timer = StepTimer(runner, capture_at=output_len // 2)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    step_s = []
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            n_before = len(timer.execute_s)
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            if len(timer.execute_s) > n_before:  # a decode step
                step_s.append(dt)
            for out in outs:
                if out.finished:
                    engine.pop_finished(out.request_id)
    finally:
        timer.close()
    wall = time.perf_counter() - start
    # Means, so the parts add up to the whole step (medians of parts do not).
    execute = np.asarray(timer.execute_s)
    dispatch = np.asarray(timer.dispatch_s)
    steps = np.asarray(step_s)
    return {
        "wall_s": wall, "decode_steps": len(steps), "output_tok_s": len(prompts) * output_len / wall,
        "decode_wall_share": float(steps.sum() / wall),
        "step_ms": float(steps.mean() * 1e3), "step_p50_ms": float(np.median(steps) * 1e3),
        "host_ms": float((steps - execute).mean() * 1e3), "dispatch_ms": float(dispatch.mean() * 1e3),
        "wait_readback_ms": float((execute - dispatch).mean() * 1e3),
        "recompiles": {k: runner.num_compilations()[k] - v for k, v in compiled_before.items()},
        "captured": timer.captured,
    }


def count_transfers(llm: LLM, captured) -> int:
    """Host-to-device transfers of one decode step through `runner.execute`, explicit ones (the packed buffer's
    `device_put`) included, from jax's transfer-guard log (a separate replay: the guard slows dispatch, so it stays
    off in the timed run)."""
    inp, sampling, kwargs = captured
    log = tempfile.NamedTemporaryFile(suffix=".log", delete=False).name
    try:
        with stderr_to(log), jax.transfer_guard("log_explicit"):
            llm.runner.execute(inp, sampling, is_decode=True, **kwargs)
        with open(log) as f:
            return len(re.findall(r"host-to-device transfer", f.read()))
    finally:
        os.unlink(log)


@contextlib.contextmanager
def patched_attention(mode: str):
    """mode "full": unchanged; "no_attention": attention returns its query (the KV write stays);
    "no_attention_no_write": the KV write is skipped too. Patches `models.attention`'s names while a new jit traces."""
    saved = attention_module.ragged_paged_attention, attention_module.write_kv
    if mode in ("no_attention", "no_attention_no_write"):
        attention_module.ragged_paged_attention = lambda q, *args, **kwargs: q
    if mode == "no_attention_no_write":
        attention_module.write_kv = lambda pages, *args, kv_scales=None, **kwargs: (  # noqa: E731
            pages if kv_scales is None else (pages, kv_scales))
    try:
        yield
    finally:
        attention_module.ragged_paged_attention, attention_module.write_kv = saved


def replay(llm: LLM, captured, repeats: int) -> dict[str, float]:
    """Median ms of the captured decode step: the runner's compiled step (numpy inputs / device inputs) and the
    re-traced variants, interleaved."""
    runner = llm.runner
    inp, sampling, kwargs = captured
    dev_inp, dev_sampling = jax.device_put((inp, sampling))
    base = runner.decode_step.__wrapped__  # the partial over _step that both entry points jit
    variants = {"step_numpy_inputs": (runner.decode_step, inp, sampling), "step": (runner.decode_step, dev_inp,
                                                                                     dev_sampling)}
    for mode in ("no_attention", "no_attention_no_write"):
        fn = jax.jit(functools.partial(base), static_argnames=("use_filters", "logprobs", "prompt_logprobs"),
                     donate_argnums=(1,))
        with patched_attention(mode):  # trace and compile now, while the names are patched
            sampled, _, runner.kv_caches = fn(runner.param_leaves, runner.kv_caches, dev_inp, dev_sampling, **kwargs)
            jax.block_until_ready(sampled)
        variants[mode] = (fn, dev_inp, dev_sampling)
    float_weights = all(jax.numpy.issubdtype(w.dtype, jax.numpy.floating) for w in runner.param_leaves)
    matmuls = matmul_chain(runner.param_leaves, int(np.asarray(inp.logits_indices).shape[0])) if float_weights else None
    times: dict[str, list[float]] = {k: [] for k in [*variants, "execute", *(["matmuls_only"] if matmuls else [])]}
    for _ in range(repeats + 1):  # the first round warms caches and is dropped
        t0 = time.perf_counter()  # the engine's own call: the packed step and the readback of its tokens
        runner.execute(inp, sampling, is_decode=True, **kwargs)
        times["execute"].append(time.perf_counter() - t0)
        for name, (fn, a, s) in variants.items():
            t0 = time.perf_counter()
            sampled, _, runner.kv_caches = fn(runner.param_leaves, runner.kv_caches, a, s, **kwargs)
            np.asarray(sampled.tokens)
            times[name].append(time.perf_counter() - t0)
        if matmuls is not None:
            t0 = time.perf_counter()
            np.asarray(matmuls())
            times["matmuls_only"].append(time.perf_counter() - t0)
    return {k: float(np.median(v[1:]) * 1e3) for k, v in times.items()}


def matmul_chain(param_leaves: list[jax.Array], rows: int):
    """A jitted function doing only the model's matmuls, on its own weights, for `rows` tokens: every 2-D parameter
    once (the [V, D] embedding as the tied LM head, transposed), each input depending on the previous output so
    they run one after another as in the model. What XLA CPU achieves on these exact shapes, in this run."""
    weights = [w for w in param_leaves if w.ndim == 2]
    width = max(max(w.shape) for w in weights if max(w.shape) < 8192)

    @jax.jit
    def chain(ws, x):
        acc = jax.numpy.zeros((), x.dtype)
        for w in ws:
            if w.shape[0] <= width:
                y = (x[:, :w.shape[0]] + acc) @ w
            else:  # the embedding / LM head, [V, D]
                y = (x[:, :w.shape[1]] + acc) @ w.T
            acc = y[0, 0] * 1e-6
        return acc

    x = jax.numpy.ones((rows, width), weights[0].dtype)
    return functools.partial(chain, weights, x)


def op_profile(llm: LLM, captured, repeats: int = 5, top: int = 12) -> list[dict]:
    """The captured decode step traced `repeats` times with jax's profiler: ms per step of each kind of XLA op
    (thunk events named after the op, numeric suffix stripped), most expensive first. Parallel partitions of one
    op are separate events, so a kind's total can exceed its wall time; read the shares, not the sum."""
    from jax._src.lib import _profile_data

    inp, sampling, kwargs = captured
    inp, sampling = jax.device_put((inp, sampling))
    runner = llm.runner
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(repeats):
                sampled, _, runner.kv_caches, *_ = runner.decode_step(runner.param_leaves, runner.kv_caches, inp,
                                                                      sampling, **kwargs)  # + the feed's tokens
                np.asarray(sampled.tokens)
        (path,) = [os.path.join(d, f) for d, _, fs in os.walk(trace_dir) for f in fs if f.endswith(".xplane.pb")]
        data = _profile_data.ProfileData.from_file(path)
    totals: dict[str, list[float]] = {}
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue  # not one of XLA's threads (the python thread: frames, argument handling, the call)
            for event in line.events:
                kind = re.sub(r"\.\d+$", "", event.name)
                if kind.startswith("end: ") or "::" in kind:
                    continue  # runtime bookkeeping around the ops
                entry = totals.setdefault(kind, [0.0, 0])
                entry[0] += event.duration_ns / 1e6 / repeats
                entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top or None]
    return [{"op": k, "ms_per_step": v[0], "events_per_step": v[1] / repeats} for k, v in ranked]


def machine_rates(repeats: int = 5) -> dict[str, float]:
    """This run's float32 matmul rate (best of a few 1024^3 products), measured next to the step: on a shared
    machine the ceiling moves with the load. (No bandwidth probe: an XLA reduction over a large array ran well
    below the rate the GEMVs of a batch-1 step reach, so it would not be a floor.)"""
    a = jax.numpy.ones((1024, 1024), jax.numpy.float32)
    matmul = jax.jit(lambda x: x @ x)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        jax.block_until_ready(matmul(a))
        best = min(best, time.perf_counter() - t0)
    return {"flops_per_s": 2 * 1024 ** 3 / best}


def dense_floor_ms(llm: LLM, batch: int, rates: dict[str, float]) -> dict[str, float]:
    """The dense part's floor: the stored weight bytes over bandwidth, matmul FLOPs over the matmul rate; with issue 9's
    figures for this machine (--flops, --bandwidth) and with the rates measured in this run."""
    config = llm.config
    flops = 2 * param_count(config).matrices * batch  # embeddings counted: the tied LM head is a matmul
    wbytes = sum(leaf.nbytes for leaf in llm.runner.param_leaves)  # as stored: float or quantized codes + scales
    return {"weights_read_ms": wbytes / FLAGS.bandwidth * 1e3, "matmul_ms": flops / FLAGS.flops * 1e3,
            "matmul_ms_now": flops / rates["flops_per_s"] * 1e3, **rates}


def profile_batch(llm: LLM, batch: int) -> dict:
    rng = np.random.default_rng(FLAGS.seed)
    vocab = llm.config.vocab_size
    prompts = rng.integers(100, vocab - 100, size=(batch, FLAGS.input_len)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=FLAGS.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params)  # compile every shape of the run
    warmup_s = time.perf_counter() - t0
    run = measured_generation(llm, prompts, FLAGS.output_len)
    captured = run.pop("captured")
    run["host_to_device_transfers_per_step"] = count_transfers(llm, captured)
    isolated = replay(llm, captured, FLAGS.repeats)
    rates = machine_rates()
    ops = op_profile(llm, captured, top=FLAGS.ops_top) if FLAGS.ops else None
    row = {"batch": batch, "warmup_s": warmup_s, **run, "isolated_ms": isolated,
           "context_at_replay": int(np.asarray(captured[0].attn.kv_lens).max()),
           "floor_ms": dense_floor_ms(llm, batch, rates), **({"ops": ops} if ops else {})}
    iso = isolated
    row["split_ms"] = {"attention": iso["step"] - iso["no_attention"],
                       "kv_write": iso["no_attention"] - iso["no_attention_no_write"],
                       "dense_and_sampling": iso["no_attention_no_write"],
                       "input_transfer": iso["step_numpy_inputs"] - iso["step"]}
    return row


def format_table(rows: list[dict]) -> str:
    header = ["", *[f"batch {r['batch']}" for r in rows]]
    lines = []

    def add(name, fn, fmt="{:.1f}"):
        lines.append([name, *[fmt.format(fn(r)) for r in rows]])

    add("engine decode step, mean ms", lambda r: r["step_ms"])
    add("  host outside execute (sched, batch, process) ms", lambda r: r["host_ms"], "{:.2f}")
    add("  dispatch (flatten, host->device, launch) ms", lambda r: r["dispatch_ms"], "{:.2f}")
    add("  wait + readback ms", lambda r: r["wait_readback_ms"])
    add("isolated step, numpy inputs ms", lambda r: r["isolated_ms"]["step_numpy_inputs"])
    add("isolated step, the engine's packed call ms", lambda r: r["isolated_ms"]["execute"])
    add("isolated step, device inputs ms", lambda r: r["isolated_ms"]["step"])
    add("  attention (page gather + softmax) ms", lambda r: r["split_ms"]["attention"])
    add("  KV write ms", lambda r: r["split_ms"]["kv_write"])
    add("  dense + LM head + sampling ms", lambda r: r["split_ms"]["dense_and_sampling"])
    add("  the same matmuls alone (same weights, same run) ms",
        lambda r: r["isolated_ms"].get("matmuls_only", float("nan")))
    add("  floor: weights / --bandwidth ms", lambda r: r["floor_ms"]["weights_read_ms"])
    add("  floor: matmul FLOPs / --flops ms", lambda r: r["floor_ms"]["matmul_ms"])
    add("  floor: FLOPs / 1024^3 matmul rate measured now ms", lambda r: r["floor_ms"]["matmul_ms_now"])
    add("measured now: f32 matmul GFLOP/s", lambda r: r["floor_ms"]["flops_per_s"] / 1e9, "{:.0f}")
    add("host share of the engine step (host + dispatch)", lambda r: (r["host_ms"] + r["dispatch_ms"]) / r["step_ms"],
        "{:.0%}")
    add("attention share of the isolated step", lambda r: r["split_ms"]["attention"] / r["isolated_ms"]["step"],
        "{:.0%}")
    add("recompiles in the measured run", lambda r: sum(r["recompiles"].values()), "{}")
    add("host->device transfers per decode step", lambda r: r["host_to_device_transfers_per_step"], "{}")
    add("decode steps' share of the run's wall time", lambda r: r["decode_wall_share"], "{:.0%}")
    add("end-to-end output tok/s", lambda r: r["output_tok_s"])
    width = max(len(line[0]) for line in lines)
    out = [" | ".join([header[0].ljust(width), *[h.rjust(9) for h in header[1:]]])]
    out += [" | ".join([line[0].ljust(width), *[c.rjust(9) for c in line[1:]]]) for line in lines]
    return "\n".join(out)


def main(argv: list[str]) -> None:
    del argv
    batches = [int(b) for b in FLAGS.batch]
    llm = LLM(FLAGS.model, dtype=FLAGS.dtype, quantization=FLAGS.quantization, kv_cache_dtype=FLAGS.kv_cache_dtype,
              max_num_seqs=max(batches), attn_impl=FLAGS.attn_impl,
              max_num_batched_tokens=max(512, FLAGS.input_len),
              async_scheduling=False)  # each step's execute is its whole device time (scripts/bench/overhead_bench.py: both)
    rows = [profile_batch(llm, b) for b in batches]
    print(format_table(rows), file=sys.stderr)
    for row in rows:
        for op in row.get("ops", []):
            print(f"batch {row['batch']}: {op['ms_per_step']:8.2f} ms/step  x{op['events_per_step']:5.0f}  {op['op']}",
                  file=sys.stderr)
    if FLAGS.json:
        print(json.dumps({"config": {"model": FLAGS.model, "input_len": FLAGS.input_len,
                                     "output_len": FLAGS.output_len, "dtype": FLAGS.dtype,
                                     "quantization": FLAGS.quantization, "kv_cache_dtype": FLAGS.kv_cache_dtype},
                          "rows": rows}))


if __name__ == "__main__":
    app.run(main)
