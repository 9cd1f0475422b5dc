"""TPU A/B of ragged paged attention: pagejax's Mosaic kernel (`attention/tpu.py`) beside JAX's in-tree kernel
(`jax.experimental.pallas.ops.tpu.ragged_paged_attention`) on the same inputs, in one run, as fractions of HBM
bandwidth. `scripts/bench/kernel_bench.py` runs it on a TPU (or with `--tpu --smoke` in interpret mode on CPU).

Both kernels read the same K/V values: the in-tree kernel's cache layout (`[pages, page_size, 2*Hkv, D]`, K of head h
at combined head 2h, V at 2h + 1) is built from pagejax's (`[Hkv, pages, page_size, 2D]`) once, before timing, so
the timed region holds only the kernel. Each kernel's output is checked against pagejax's f32 reference; time is
the median of rounds of back-to-back calls; bandwidth = bytes the batch must read (`kernel_bench.bytes_read`) /
time, also as a fraction of the measured device copy bandwidth (the HBM roofline a kernel can reach). Cases: the
Llama-3-8B decode at 64 x 2048 (bf16 cache, page 16, and again at the engine's TPU page for a 2048-token context,
128), and a mixed batch (16 decodes at 2048 + 2 prefill chunks of 512). The in-tree kernel has no int8 cache path, so int8 is pagejax's alone (kernel_bench's decode_int8 case).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from inference.engine.config import default_page_size


def jax_layout(kv_pages: jax.Array) -> jax.Array:
    """pagejax's `[Hkv, P, page_size, 2D]` (K lanes, then V lanes) as the in-tree kernel's `[P, page_size, 2*Hkv, D]`
    (K and V of head h at combined heads 2h and 2h + 1)."""
    num_kv_heads, num_pages, page_size, width = kv_pages.shape
    head_dim = width // 2
    kv = kv_pages.reshape(num_kv_heads, num_pages, page_size, 2, head_dim)
    return kv.transpose(1, 2, 0, 3, 4).reshape(num_pages, page_size, 2 * num_kv_heads, head_dim)


def variants(*, smoke: bool) -> dict:
    """name -> (fn(q, kv_pages_in_its_layout, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, max_q_len),
    the layout conversion it needs (None: pagejax's), whether it jits)."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as jax_rpa

    from kernels_pallas.attention.tpu import ragged_paged_attention_tpu

    ours = functools.partial(ragged_paged_attention_tpu, interpret=pltpu.InterpretParams() if smoke else False)
    if smoke:
        # The TPU interpreter (jax 0.10.2 and 0.12) cannot run the in-tree kernel (its ref reshapes raise
        # "'ReshapeTransform' object has no attribute 'indices'"), so on CPU the in-tree *reference* stands in for
        # it: that checks the layout conversion, the part of the A/B this file owns. It loops over num_seqs in
        # Python: no jit.
        def in_tree(q, kv, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, max_q_len):
            del max_q_len
            return jax_rpa.ref_ragged_paged_attention(q, kv, kv_lens, page_indices, cu_q_lens, num_seqs,
                                                      sm_scale=sm_scale)

        return {"pagejax_tpu": (ours, None, True), "jax_in_tree_reference": (in_tree, jax_layout, False)}

    def in_tree(q, kv, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, max_q_len):
        del max_q_len  # the in-tree kernel has no static query-length bound
        return jax_rpa.ragged_paged_attention(q, kv, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale)

    return {"pagejax_tpu": (ours, None, True), "jax_in_tree_rpa": (in_tree, jax_layout, True)}


def run_ab(bench, name, batch, *, max_q_len, copy_bw, rounds, calls, tol, smoke) -> dict:
    """Check and time each variant on `batch` (kernel_bench.make_batch's output). `bench`: the kernel_bench
    module (its helpers; passed in, since importing the running script again would register its flags twice)."""
    from kernels_pallas.attention.reference import ragged_paged_attention_reference

    q, kv, meta = batch
    sm_scale = q.shape[-1] ** -0.5
    with jax.default_matmul_precision("highest"):
        want = np.asarray(jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=sm_scale,
                                                    max_q_len=max_q_len))(
            q.astype(jnp.float32), kv.astype(jnp.float32), *meta), np.float32)
    nbytes = bench.bytes_read(q, np.asarray(meta[0]), kv)
    result = {"num_seqs": int(meta[3][0]), "num_tokens": int(q.shape[0]), "max_q_len": max_q_len,
              "bytes_read": nbytes, "variants": {}}
    for vname, (fn, convert, jits) in variants(smoke=smoke).items():
        kv_in = jax.block_until_ready(jax.jit(convert)(kv)) if convert else kv  # outside the timed region
        call = functools.partial(fn, sm_scale=sm_scale, max_q_len=max_q_len)
        result["variants"][vname] = bench.check_and_time(
            f"{name:12s} {vname:16s}", jax.jit(call) if jits else call, (q, kv_in, *meta), want, nbytes=nbytes,
            copy_bw=copy_bw, rounds=rounds, calls=calls, tol=tol)
    times = {k: v.get("time_ms") for k, v in result["variants"].items()}
    if times.get("pagejax_tpu") and times.get("jax_in_tree_rpa"):
        result["pagejax_speedup_vs_in_tree"] = times["jax_in_tree_rpa"] / times["pagejax_tpu"]
    return result


def run(bench, *, smoke: bool, rounds: int, calls: int) -> dict:
    """The A/B's cases; kernel_bench (`bench`) writes the JSON."""
    if smoke:  # tiny f32 shapes the interpreter runs in seconds; in-tree blocks need 2*Hkv heads fully tiled
        dims = dict(num_q_heads=8, num_kv_heads=4, head_dim=128, page_size=16, dtype=jnp.float32)
        decode, mixed = ([1] * 3, [40, 64, 17]), ([1, 1, 8], [64, 30, 20])
        tol, copy_bytes = 2e-5, 1 << 20
    else:
        dims = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=jnp.bfloat16)
        decode, mixed = ([1] * 64, [2048] * 64), ([1] * 16 + [512, 512], [2048] * 16 + [1024, 2048])
        tol, copy_bytes = 2e-2, 1 << 30
    copy_bw = bench.copy_bandwidth(copy_bytes, rounds, calls)
    print(f"device copy bandwidth: {copy_bw / 1e9:.1f} GB/s", flush=True)
    common = dict(copy_bw=copy_bw, rounds=rounds, calls=calls, tol=tol, smoke=smoke)
    key = jax.random.PRNGKey(0)
    # The decode again at the page size the engine picks on TPU for the case's context (engine/config.py:
    # default_page_size: 128 for 2048 tokens): larger pages are larger DMAs for both kernels.
    # (The smoke's short contexts get page 16 there: no second case.)
    big_page = dict(dims, page_size=default_page_size("tpu", max(decode[1])))
    cases = {"tpu_ab_decode": run_ab(bench, "decode", bench.make_batch(key, *decode, **dims), max_q_len=1,
                                     **common)}
    if big_page["page_size"] != dims["page_size"]:
        cases[f"tpu_ab_decode_page{big_page['page_size']}"] = run_ab(
            bench, f"decode p{big_page['page_size']}", bench.make_batch(key, *decode, **big_page), max_q_len=1,
            **common)
    cases["tpu_ab_mixed"] = run_ab(bench, "mixed", bench.make_batch(key, *mixed, **dims), max_q_len=max(mixed[0]),
                                   **common)
    return {"copy_bandwidth_GBps": copy_bw / 1e9, "shapes": {k: str(v) for k, v in dims.items()}, "cases": cases}
