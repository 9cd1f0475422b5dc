"""Ragged paged attention on a GPU: check the Pallas Triton and Mosaic GPU kernels against the XLA reference, then
time them side by side.

    python scripts/bench/kernel_bench.py --out=kernel_bench.json            # on a GPU; one run, a few minutes
    python scripts/bench/kernel_bench.py --smoke --out=/tmp/smoke.json      # anywhere: tiny shapes, interpret mode
    python scripts/bench/kernel_bench.py --sweep --out=sweep.json           # + the Triton tuning sweep (gpu_tuning.py)
    python scripts/bench/kernel_bench.py --out=tpu_ab.json                  # on a TPU: the A/B of tpu_kernel_ab.py

Cases (bf16 on the device; `--smoke` shrinks every dimension and uses f32 with `interpret=True`):
  * decode: 64 sequences x 2048 cached tokens, 32 query / 8 KV heads, head_dim 128, page 16 (512 MiB of KV),
    the kernel with several split-KV counts, and the same with an int8 cache (per-token scales);
  * mixed: 16 decode sequences at 2048 tokens + 2 prefill chunks of 512 queries (contexts 1024 and 2048);
  * basic_padded: JAX's `basic` RPA case (q 192 / 128 / 64 over kv 328 / 180 / 255) with metadata for 8 sequence
    slots, the 5 past num_seqs zero-padded as JAX's tests pad them (the engine repeats the last offset instead);
  * the Mosaic GPU kernel (`attention/mosaic_gpu.py`, Hopper, bf16 queries over a bf16 or int8 cache) beside the
    Triton one in decode (same split counts), decode_int8 and mixed; `--smoke` runs it on small bf16 decode cases
    ("decode_bf16", and "decode_bf16_int8" over an int8 cache) in its interpreter.
For each variant: the max abs error against the reference computed in f32 at `Precision.HIGHEST` (so TF32 cannot
blur the check), the time (median over rounds of `--calls` back-to-back calls, so dispatch overlaps), and the
achieved bandwidth = (KV bytes the batch must read, scales included, + q bytes) / time, also as a fraction of the
measured device copy bandwidth (`x * 2` over a 1 GiB array, read + write bytes / time), and the speedup over the
XLA reference. The goal is >= 80% of copy bandwidth in decode. A variant that fails to compile or run is
recorded with its error and the others still run. JSON (with date, commit, device) goes to `--out`; the exit status
is 1 if any check fails.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from kernels_pallas.kv_cache.writes import quantize_cache  # noqa: E402
from kernels_pallas.kv_cache.layout import kv_cache_spec  # noqa: E402
from kernels_pallas.attention.gpu import ragged_paged_attention_gpu  # noqa: E402
from kernels_pallas.attention.mosaic_gpu import ragged_paged_attention_mosaic_gpu  # noqa: E402
from kernels_pallas.attention.reference import ragged_paged_attention_reference  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "kernel_bench.json", "Where to write the JSON results.")
flags.DEFINE_bool("smoke", False, "Tiny shapes in interpret mode (runs on CPU; checks the script, not speed).")
flags.DEFINE_integer("rounds", 5, "Timed rounds per variant (median reported).")
flags.DEFINE_integer("calls", 10, "Back-to-back calls per timed round.")
flags.DEFINE_list("splits", ["1", "4", "8"], "Split-KV counts to time for decode.")
flags.DEFINE_bool("sweep", False, "Also time the Triton kernel over `sweep_variants` in decode, decode_int8 and "
                  "mixed: the runs that tune kernels_pallas/attention/gpu_tuning.py's entries.")
flags.DEFINE_bool("tpu", False, "The TPU A/B (scripts/bench/tpu_kernel_ab.py): pagejax's TPU kernel beside JAX's "
                  "in-tree one; the default on a TPU; with --smoke, in interpret mode on CPU.")


def make_batch(key, q_lens, kv_lens, *, num_q_heads, num_kv_heads, head_dim, page_size, dtype):
    """Packed queries and a page pool holding exactly the batch's pages, each sequence on shuffled pages."""
    pages_per_seq = max(-(-k // page_size) for k in kv_lens)
    num_pages = pages_per_seq * len(q_lens)
    kq, kkv = jax.random.split(key)
    q = jax.random.normal(kq, (sum(q_lens), num_q_heads, head_dim), jnp.float32).astype(dtype)
    kv = jax.random.normal(kkv, kv_cache_spec(num_pages, page_size, num_kv_heads, head_dim).shape,
                           jnp.float32).astype(dtype)
    perm = np.random.default_rng(0).permutation(num_pages).reshape(len(q_lens), pages_per_seq).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = tuple(map(jnp.asarray, (np.array(kv_lens, np.int32), perm, cu, np.array([len(q_lens)], np.int32))))
    return q, kv, meta


def pad_slots(batch, slots: int):
    """`batch` with metadata for `slots` sequence slots: kv_lens, page-table rows and cu_q_lens zero-padded."""
    q, kv, (kv_lens, pages, cu, num_seqs) = batch
    extra = slots - kv_lens.shape[0]
    return q, kv, (jnp.pad(kv_lens, (0, extra)), jnp.pad(pages, ((0, extra), (0, 0))), jnp.pad(cu, (0, extra)),
                   num_seqs)


def bytes_read(q, kv_lens, kv_pages, kv_scales=None) -> int:
    """Bytes the batch must read: every cached token's K and V (and their scales) plus q."""
    tokens = int(np.sum(kv_lens))
    num_kv_heads, _, _, width = kv_pages.shape  # kv_cache/layout.py: [Hkv, pages, page_size, 2D]
    per_token = num_kv_heads * width * kv_pages.dtype.itemsize
    if kv_scales is not None:  # one K and one V scale per token and KV head
        per_token += num_kv_heads * 2 * kv_scales.dtype.itemsize
    return tokens * per_token + q.size * q.dtype.itemsize


def timed(fn, args, rounds: int, calls: int) -> float:
    """Median seconds per call; `calls` calls are queued back to back per round so host dispatch overlaps."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times))


def copy_bandwidth(num_bytes: int, rounds: int, calls: int) -> float:
    """Device copy bandwidth in bytes/s: read + write of `x * 2` over a bf16 array of `num_bytes`."""
    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    return 2 * num_bytes / timed(jax.jit(lambda x: x * 2), (x,), rounds, calls)


def check_and_time(label, fn, args, want, *, nbytes, copy_bw, rounds, calls, tol) -> dict:
    """One variant's row: max abs error against `want`, median time, bandwidth, and its fraction of copy_bw."""
    try:  # one failing variant (e.g. a compile error) must not cost the rest of a single device run
        got = np.asarray(fn(*args), np.float32)
        err = float(np.max(np.abs(got - want)))
        seconds = timed(fn, args, rounds, calls)
    except Exception as e:  # noqa: BLE001 - recorded in the JSON and fails the run's exit status
        print(f"{label} FAILED: {type(e).__name__}: {str(e)[:500]}", flush=True)
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000]}
    print(f"{label} err {err:.2e}  {seconds * 1e3:8.3f} ms  {nbytes / seconds / 1e9:8.1f} GB/s "
          f"({nbytes / seconds / copy_bw:.0%} of copy)", flush=True)
    return {"max_err": err, "tol": tol, "ok": bool(err <= tol), "time_ms": seconds * 1e3,
            "GBps": nbytes / seconds / 1e9, "fraction_of_copy_bw": nbytes / seconds / copy_bw}


def run_case(name, batch, variants, *, kv_scales, max_q_len, copy_bw, rounds, calls, tol) -> dict:
    q, kv, (kv_lens, page_indices, cu, num_seqs) = batch
    args = (q, kv, kv_lens, page_indices, cu, num_seqs)
    sm_scale = q.shape[-1] ** -0.5
    with jax.default_matmul_precision("highest"):
        want = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=sm_scale, max_q_len=max_q_len))(
            q.astype(jnp.float32), kv if kv_scales is not None else kv.astype(jnp.float32), *args[2:],
            kv_scales=kv_scales)
    want = np.asarray(want, np.float32)
    nbytes = bytes_read(q, np.asarray(kv_lens), kv, kv_scales)
    result = {"num_seqs": int(num_seqs[0]), "num_tokens": int(q.shape[0]), "max_q_len": max_q_len,
              "kv_dtype": str(kv.dtype), "q_dtype": str(q.dtype), "bytes_read": nbytes, "variants": {}}
    for vname, fn in variants.items():
        jitted = jax.jit(functools.partial(fn, sm_scale=sm_scale, max_q_len=max_q_len, kv_scales=kv_scales))
        result["variants"][vname] = check_and_time(f"{name:12s} {vname:16s}", jitted, args, want, nbytes=nbytes,
                                                   copy_bw=copy_bw, rounds=rounds, calls=calls, tol=tol)
    ref_time = result["variants"].get("xla_reference", {}).get("time_ms")
    for v in result["variants"].values():
        if ref_time and "time_ms" in v:
            v["speedup_vs_xla_reference"] = ref_time / v["time_ms"]
    return result


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


CASES = ("decode", "decode_bf16", "decode_bf16_int8", "decode_int8", "mixed", "basic_padded")


def sweep_variants(gpu, case: str, smoke: bool) -> dict:
    """Triton kernel variants around its tuning entries (`gpu_tuning.py`): KV block (pages per block), warps and
    pipeline depth for decode and int8 decode; query rows (block_q at group 4) and KV block for mixed batches.
    --smoke: one variant each (the flow, not a sweep)."""
    import itertools

    if case == "mixed":
        grid = [(4, 4), (16, 4), (32, 8)] if not smoke else [(8, 2)]
        return {f"pallas_bq{q}_ppb{p}": functools.partial(gpu, block_q=q, pages_per_block=p) for q, p in grid}
    grid = list(itertools.product((4, 8, 16), (4, 8), (2, 3))) if not smoke else [(2, 4, 2)]
    return {f"pallas_ppb{p}_w{w}_s{s}": functools.partial(gpu, pages_per_block=p, num_warps=w, num_stages=s)
            for p, w, s in grid}


def bench(smoke: bool, splits: list[int], rounds: int, calls: int, only: tuple[str, ...] = CASES,
          sweep: bool = False) -> dict:
    """The checks and timings of the cases in `only` (the module docstring; decode_bf16 and decode_bf16_int8 are
    --smoke's); `scripts/bench/gpu_report.py` runs this too."""
    if smoke:  # tiny and f32 so the interpreter is quick; the checks use the f32 tolerance
        dims = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.float32)
        decode_lens, mixed = ([1] * 3, [40, 64, 17]), ([1, 1, 8], [64, 30, 20])
        splits, rounds, calls, tol, copy_bytes = [2], 1, 1, 2e-5, 1 << 20
    else:
        dims = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=jnp.bfloat16)
        decode_lens, mixed = ([1] * 64, [2048] * 64), ([1] * 16 + [512, 512], [2048] * 16 + [1024, 2048])
        tol, copy_bytes = 2e-2, 1 << 30
    copy_bw = copy_bandwidth(copy_bytes, rounds, calls)
    print(f"device copy bandwidth: {copy_bw / 1e9:.1f} GB/s", flush=True)
    gpu = functools.partial(ragged_paged_attention_gpu, interpret=smoke)
    mosaic = functools.partial(ragged_paged_attention_mosaic_gpu, interpret=smoke)
    # The Mosaic GPU kernel takes bf16/f16 only: on the device it runs in every bf16 case; --smoke (f32) gives it a
    # bf16 decode case of its own.
    with_mosaic = not smoke
    reference = ragged_paged_attention_reference
    key = jax.random.PRNGKey(0)
    common = dict(copy_bw=copy_bw, rounds=rounds, calls=calls, tol=tol)

    cases = {}
    decode = make_batch(key, *decode_lens, **dims)
    if "decode" in only:
        cases["decode"] = run_case("decode", decode, {"xla_reference": reference} | {
            f"pallas_splits{s}": functools.partial(gpu, num_kv_splits=s) for s in splits} | ({
            f"mosaic_splits{s}": functools.partial(mosaic, num_kv_splits=s) for s in splits} if with_mosaic else {})
            | (sweep_variants(gpu, "decode", smoke) if sweep else {}), kv_scales=None, max_q_len=1, **common)
    if smoke and "decode_bf16" in only:
        bf16 = make_batch(key, *decode_lens, **(dims | dict(dtype=jnp.bfloat16)))
        cases["decode_bf16"] = run_case("decode_bf16", bf16, {"xla_reference": reference, "pallas": gpu,
                                                              "mosaic": mosaic},
                                        kv_scales=None, max_q_len=1, **(common | dict(tol=2e-2)))
        bf16_int8, bf16_scales = quantize_cache(bf16[1])
        cases["decode_bf16_int8"] = run_case("decode_bf16_int8", (bf16[0], bf16_int8, bf16[2]), {
            "xla_reference": reference, "pallas": gpu, "mosaic": mosaic}, kv_scales=bf16_scales, max_q_len=1,
            **(common | dict(tol=2e-2)))
    if "decode_int8" in only:
        kv_int8, scales = quantize_cache(decode[1])
        last = splits[-1]
        cases["decode_int8"] = run_case("decode_int8", (decode[0], kv_int8, decode[2]), {
            "xla_reference": reference, f"pallas_splits{last}": functools.partial(gpu, num_kv_splits=last)} | ({
            f"mosaic_splits{last}": functools.partial(mosaic, num_kv_splits=last)} if with_mosaic else {})
            | (sweep_variants(gpu, "decode_int8", smoke) if sweep else {}), kv_scales=scales, max_q_len=1, **common)
        del kv_int8, scales
    del decode
    if "mixed" in only:
        cases["mixed"] = run_case("mixed", make_batch(key, *mixed, **dims), {"xla_reference": reference,
                                                                             "pallas": gpu} | (
            {"mosaic": mosaic} if with_mosaic else {}) | (sweep_variants(gpu, "mixed", smoke) if sweep else {}),
            kv_scales=None, max_q_len=max(mixed[0]), **common)
    if "basic_padded" in only:
        basic = pad_slots(make_batch(key, [192, 128, 64], [328, 180, 255], **dims), 8)
        cases["basic_padded"] = run_case("basic_padded", basic, {"xla_reference": reference, "pallas": gpu} | (
            {"mosaic": mosaic} if with_mosaic else {}), kv_scales=None, max_q_len=192, **common)

    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "smoke": smoke, "shapes": {k: str(v) for k, v in dims.items()},
              "copy_bandwidth_GBps": copy_bw / 1e9, "cases": cases}
    result["all_ok"] = all(v["ok"] for c in cases.values() for v in c["variants"].values())
    return result


def main(argv):
    del argv
    if FLAGS.tpu or (not FLAGS.smoke and jax.default_backend() == "tpu"):
        return tpu_main(FLAGS.smoke)
    if not FLAGS.smoke and jax.default_backend() != "gpu":
        raise app.UsageError(f"no GPU (backend {jax.default_backend()!r}); use --smoke to check the script on CPU")
    result = bench(FLAGS.smoke, [int(s) for s in FLAGS.splits], FLAGS.rounds, FLAGS.calls, sweep=FLAGS.sweep)
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {FLAGS.out}; all checks ok: {result['all_ok']}")
    if not result["all_ok"]:
        sys.exit(1)


def tpu_main(smoke: bool) -> None:
    """The TPU A/B (`tpu_kernel_ab.py`), written like the GPU run: JSON with date, commit, device."""
    from scripts.bench import tpu_kernel_ab

    if not smoke and jax.default_backend() != "tpu":
        raise app.UsageError(f"no TPU (backend {jax.default_backend()!r}); use --tpu --smoke to check it on CPU")
    rounds, calls = (1, 1) if smoke else (FLAGS.rounds, FLAGS.calls)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "smoke": smoke,
              **tpu_kernel_ab.run(sys.modules[__name__], smoke=smoke, rounds=rounds, calls=calls)}
    result["all_ok"] = all(v["ok"] for c in result["cases"].values() for v in c["variants"].values())
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {FLAGS.out}; all checks ok: {result['all_ok']}")
    if not result["all_ok"]:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
