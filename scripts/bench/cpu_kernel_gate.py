"""The measurement behind `kernels_pallas.native.gate.MEASURED`: each speed-gated C++ CPU kernel beside the pure-JAX
path it replaces, at SmolLM2-135M's shapes, on this machine's CPU.

    python scripts/bench/cpu_kernel_gate.py --out=/tmp/gate.json       # a few minutes on 2 cores

Cases (time = median over rounds of `--calls` back-to-back jitted calls; both paths alternate round by round, so
a machine loaded by other work slows both alike, and the ratio is what counts):
  * int8_matmul: one decoder layer's seven W8A8 linears (q, k, v, o, gate, up, down: 576 -> 576/192/1536 and
    1536 -> 576), per-channel int8 weights, at 1 to 128 rows: the kernel ("native" build, and the scalar "portable"
    build for reference) vs `formats.matmul(method="int8")` with the kernel switched off (XLA's int8 dot), and
    XLA's float32 matmul of the same weights ("f32_xla": what the float32 model runs instead);
  * grouped_matmul: one layer's seven linears with grouped int4 (group 32, zero points) and int8 (group 64) weights
    at 1 and 32 rows: the kernel vs `formats.matmul(method="dequant")` with it switched off (XLA's dot of the
    dequantized weight); the weights are the jitted function's arguments, as a model's are;
  * kv_write: one layer's KV-cache write of a decode step (1 and 32 tokens, 3 KV heads, rows of 2 x 64, a float32
    and an int8 cache of 512 pages of 16), donated so both paths write in place: the kernel vs the in-place
    fori_loop of `kv_cache.writes.write_rows`;
  * rope: one layer's RoPE (`models.layers.apply_rope` of q [T, 9, 64] and k [T, 3, 64]) at 1, 32 and 512 tokens:
    with the tables kernel vs XLA's cos / sin fused into the rotation;
  * few_rows_f32_model: SmolLM2-135M's 210 float32 projections and its tied LM head in sequence at 1, 2, 4 and 8
    rows (a small-batch float32 decode step's matmuls): the few-rows kernel vs XLA's dot;
  * attention: decode over a 256-token context, 9 query / 3 KV heads, head_dim 64, page 16, float32, int8 and fp8
    (float8_e4m3fn) caches, 1 and 32 sequences: the kernel vs `ragged_paged_attention_reference`.
Prints one line per case and writes JSON (date, commit, CPU model, ISA, load average before and after) to `--out`.
A kernel is "faster" on an ISA when its ratio is above 1 at every size measured; a matmul kernel faster at some row
counts only gets those rows (`gate.Rows`) in `gate.MEASURED`. BENCHMARKS.md records the table.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from kernels_pallas.attention.cpu import ragged_paged_attention_cpu  # noqa: E402
from kernels_pallas.attention.reference import ragged_paged_attention_reference  # noqa: E402
from kernels_pallas.kv_cache.layout import kv_cache_spec, scale_rows  # noqa: E402
from kernels_pallas.kv_cache.writes import quantize_cache  # noqa: E402
from kernels_pallas import rope_cpu  # noqa: E402
from kernels_pallas.kv_cache import writes  # noqa: E402
from kernels_pallas.matmul import few_rows_cpu, grouped_cpu, int8_cpu  # noqa: E402
from kernels_pallas.native import gate  # noqa: E402
from models import layers  # noqa: E402
from models.quantization import formats  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "cpu_kernel_gate.json", "Where to write the JSON results.")
flags.DEFINE_integer("rounds", 7, "Timed rounds per path (median reported).")
flags.DEFINE_integer("calls", 20, "Back-to-back calls per timed round.")
flags.DEFINE_string("only", "", "Run only the cases whose name contains this (e.g. float8); all when empty.")

LAYER = ((576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576))  # SmolLM2-135M


def timed_side_by_side(paths: dict, args, rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each path, the paths alternating round by round."""
    for fn in paths.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            start = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / calls)
    return {name: float(np.median(t)) for name, t in times.items()}


def int8_layer(rows: int) -> dict:
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 576)).astype(np.float32))
    weights = [formats.quantize_int8(rng.standard_normal(shape).astype(np.float32)) for shape in LAYER]
    dense = [qw.dequantize() for qw in weights]  # float32 weights, made once as the float32 model holds them

    def layer(path: str):
        def run(x):
            outs = []
            for qw, wf in zip(weights, dense):
                xi = jnp.tile(x, (1, 3))[:, :qw.shape[0]]  # 576 or 1536 input features
                if path == "f32_xla":  # what the float32 model runs instead: is W8A8 worth it on this CPU?
                    outs.append(xi @ wf)
                elif path == "pure_jax":
                    with forced(int8_cpu.KERNEL, False):
                        outs.append(formats.matmul(xi, qw, method="int8"))
                else:
                    outs.append(int8_cpu.int8_matmul_cpu(xi, jnp.asarray(qw.q), jnp.asarray(qw.scale).reshape(-1),
                                                         build=path))
            return outs
        return jax.jit(run)

    builds = ("native", "portable", *(("no_amx",) if gate.host_isa() == "avx512-amx" else ()))  # AMX: VNNI beside
    paths = {name: layer(name) for name in (*builds, "pure_jax", "f32_xla")}
    want = paths["pure_jax"](x)
    for got in (paths[name](x) for name in builds):  # the kernel's contract: the same bits
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return timed_side_by_side(paths, (x,), FLAGS.rounds, FLAGS.calls)


def few_rows_model(rows: int) -> dict:
    """SmolLM2-135M's float32 projections and tied LM head at `rows` rows, one after another as a decode step runs
    them (each output feeds the next input, so XLA cannot overlap them): the few-rows kernel vs XLA's dot."""
    rng = np.random.default_rng(rows)
    layers = [[jnp.asarray(rng.standard_normal(s).astype(np.float32) / np.sqrt(s[0])) for s in LAYER]
              for _ in range(30)]
    embed = jnp.asarray(rng.standard_normal((49152, 576)).astype(np.float32) / 24)
    x = jnp.asarray(rng.standard_normal((rows, 576)).astype(np.float32))

    def model(path: str):
        def mm(a, w, transposed=False):
            if path == "native":
                return few_rows_cpu.few_rows_matmul_cpu(a, w, transposed=transposed)
            return jnp.dot(a, w.T if transposed else w, precision="highest")

        def run(x, layers, embed):
            for layer in layers:
                for w in layer:
                    x = mm(jnp.tile(x, (1, 3))[:, :w.shape[0]], w)[:, :576]
            return mm(x, embed, transposed=True)
        return jax.jit(run)

    paths = {name: model(name) for name in ("native", "pure_jax")}
    np.testing.assert_allclose(np.asarray(paths["native"](x, layers, embed)),
                               np.asarray(paths["pure_jax"](x, layers, embed)), rtol=2e-3, atol=2e-3)
    return timed_side_by_side(paths, (x, layers, embed), FLAGS.rounds, max(1, FLAGS.calls // 10))


def forced(kernel: gate.CpuKernel, runs: bool):
    """While tracing, `gate.runs_here` answers `runs` for `kernel` (whatever `MEASURED` says: both paths are timed)
    and as before for the others."""
    runs_here = gate.runs_here
    if runs:
        gate.require(kernel)
    return mock.patch.object(gate, "runs_here", lambda k, rows=None: runs if k == kernel else runs_here(k, rows))


def grouped_layer(rows: int, bits: int) -> dict:
    rng = np.random.default_rng(rows + bits)
    x = jnp.asarray(rng.standard_normal((rows, 576)).astype(np.float32))
    quantize = functools.partial(formats.quantize_int4, group_size=32) if bits == 4 else functools.partial(
        formats.quantize_int8, group_size=64)
    weights = [jax.tree.map(jnp.asarray, quantize(rng.standard_normal(shape).astype(np.float32))) for shape in LAYER]

    def layer(kernel: bool):
        def run(x, weights):  # weights as arguments, as the model's are: closed over, XLA folds the dequantizing
            outs = []
            for qw in weights:
                xi = jnp.tile(x, (1, 3))[:, :qw.shape[0]]
                with forced(grouped_cpu.KERNEL, kernel):
                    outs.append(formats.matmul(xi, qw, method="dequant"))
            return outs
        return jax.jit(run)

    paths = {"native": layer(True), "pure_jax": layer(False)}
    for a, b in zip(paths["native"](x, weights), paths["pure_jax"](x, weights)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-3)
    return timed_side_by_side(paths, (x, weights), FLAGS.rounds, FLAGS.calls)


def kv_write(tokens: int, dtype) -> dict:
    num_pages, page, kv_heads, dim = 512, 16, 3, 64
    rng = np.random.default_rng(tokens)
    rows = jnp.asarray(rng.standard_normal((tokens, kv_heads, 2 * dim)).astype(np.float32)).astype(dtype)
    offsets = jnp.asarray(rng.choice(num_pages * page, tokens, replace=False).astype(np.int32) * 2 * dim)

    def path(kernel: bool):
        def run(cache, rows, offsets):
            with forced(writes.WRITE_KERNEL, kernel):
                return writes.write_rows([cache], [[(rows, offsets)]])[0]
        return jax.jit(run, donate_argnums=0)

    paths = {"native": path(True), "pure_jax": path(False)}
    caches = {name: jnp.zeros((kv_heads, num_pages, page, 2 * dim), dtype) for name in paths}
    caches = {name: fn(caches[name], rows, offsets) for name, fn in paths.items()}
    np.testing.assert_array_equal(np.asarray(caches["native"]), np.asarray(caches["pure_jax"]))
    times = {name: [] for name in paths}
    for _ in range(FLAGS.rounds):  # as timed_side_by_side, each path writing into its own donated cache
        for name, fn in paths.items():
            start = time.perf_counter()
            for _ in range(FLAGS.calls):
                caches[name] = fn(caches[name], rows, offsets)
            jax.block_until_ready(caches[name])
            times[name].append((time.perf_counter() - start) / FLAGS.calls)
    return {name: float(np.median(t)) for name, t in times.items()}


def rope(tokens: int) -> dict:
    rng = np.random.default_rng(tokens)
    q = jnp.asarray(rng.standard_normal((tokens, 9, 64)).astype(np.float32))
    k = jnp.asarray(rng.standard_normal((tokens, 3, 64)).astype(np.float32))
    positions = jnp.asarray(rng.integers(0, 2048, tokens).astype(np.int32))
    inv_freq = 1.0 / (100000.0 ** (np.arange(0, 64, 2, dtype=np.float64) / 64))

    def path(kernel: bool):
        def run(q, k, positions):
            with forced(rope_cpu.KERNEL, kernel):
                return layers.apply_rope(q, positions, inv_freq), layers.apply_rope(k, positions, inv_freq)
        return jax.jit(run)

    paths = {"native": path(True), "pure_jax": path(False)}
    args = (q, k, positions)
    for a, b in zip(paths["native"](*args), paths["pure_jax"](*args)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    return timed_side_by_side(paths, args, FLAGS.rounds, FLAGS.calls)


def attention(seqs: int, kv_dtype) -> dict:
    heads, kv_heads, dim, page, context = 9, 3, 64, 16, 256
    pages_per_seq = context // page
    num_pages = seqs * pages_per_seq
    key = jax.random.PRNGKey(seqs)
    q = jax.random.normal(key, (seqs, heads, dim), jnp.float32)
    kv = jax.random.normal(jax.random.fold_in(key, 1), kv_cache_spec(num_pages, page, kv_heads, dim).shape)
    scales = None
    if kv_dtype == jnp.int8:
        kv = jnp.clip(jnp.round(kv * 30), -127, 127).astype(jnp.int8)
        scales = jnp.full((kv_heads, scale_rows(num_pages, page), 128), 1 / 30, jnp.float32)
    elif kv_dtype == jnp.float8_e4m3fn:
        kv, scales = quantize_cache(kv, kv_dtype)
    perm = np.random.default_rng(0).permutation(num_pages).reshape(seqs, pages_per_seq).astype(np.int32)
    meta = (jnp.full((seqs,), context, jnp.int32), jnp.asarray(perm), jnp.arange(seqs + 1, dtype=jnp.int32),
            jnp.array([seqs], jnp.int32))
    common = dict(sm_scale=dim ** -0.5, kv_scales=scales)
    paths = {"native": jax.jit(functools.partial(ragged_paged_attention_cpu, **common)),
             "pure_jax": jax.jit(functools.partial(ragged_paged_attention_reference, max_q_len=1, **common))}
    args = (q, kv, *meta)
    np.testing.assert_allclose(np.asarray(paths["native"](*args)), np.asarray(paths["pure_jax"](*args)),
                               rtol=2e-4, atol=2e-4)
    return timed_side_by_side(paths, args, FLAGS.rounds, FLAGS.calls)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main(argv):
    del argv
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
              "cpu": cpu_model(), "isa": gate.host_isa(), "cores": os.cpu_count(), "load_before": os.getloadavg(),
              "cases": {}}
    print(f"{result['cpu']} ({result['isa']}, {result['cores']} cores), load {result['load_before']}", flush=True)
    cases = {f"int8_matmul_layer_m{m}": functools.partial(int8_layer, m) for m in (1, 4, 8, 16, 32, 64, 128)}
    cases.update({f"grouped_matmul_int{b}_layer_m{m}": functools.partial(grouped_layer, m, b)
                  for b in (4, 8) for m in (1, 32)})
    cases.update({f"kv_write_{jnp.dtype(d).name}_t{t}": functools.partial(kv_write, t, d)
                  for d in (jnp.float32, jnp.int8) for t in (1, 32)})
    cases.update({f"rope_t{t}": functools.partial(rope, t) for t in (1, 32, 512)})
    cases.update({f"attention_{jnp.dtype(d).name}_b{s}": functools.partial(attention, s, d)
                  for d in (jnp.float32, jnp.int8, jnp.float8_e4m3fn) for s in (1, 32)})
    cases.update({f"few_rows_f32_model_m{m}": functools.partial(few_rows_model, m) for m in (1, 2, 4, 8)})
    cases = {name: case for name, case in cases.items() if FLAGS.only in name}
    for name, case in cases.items():
        times = case()
        entry = {f"{path}_ms": t * 1e3 for path, t in times.items()}
        entry["kernel_speedup"] = times["pure_jax"] / times["native"]
        result["cases"][name] = entry
        print(f"{name:28s} " + "  ".join(f"{k} {v:8.3f}" for k, v in entry.items()), flush=True)
    result["load_after"] = os.getloadavg()
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"load {result['load_after']}; wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
