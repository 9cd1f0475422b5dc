"""Every attention impl with padded metadata: more sequence slots than `num_seqs`, the slots past it filled the way
callers fill them. The engine repeats the last query offset (`cu_q_lens` stays non-decreasing); JAX's own RPA tests
pad `cu_q_lens` and `kv_lens` with zeros; a caller may leave anything there. The contract
(`ragged_paged_attention_reference`) reads only the first `num_seqs` slots, so all three give the same output,
bit for bit, and that output is the numpy loop's.

The cases are JAX's `basic` RPA case (3 sequences, q 192/128/64, kv 328/180/255, metadata for 8 slots) and three
decode rows in 8 slots with padding tokens after them: the two on which the Mosaic GPU kernel gave non-finite rows
(its tile bookkeeping binary-searched a zero-padded `cu_q_lens`), run for the reference, the C++ CPU kernel, and
the Triton, Mosaic GPU and TPU kernels in their CPU interpreters. Heads are few (Hq 2 / Hkv 1, D 64), and the
interpreted kernels run the zero padding only (the engine's is in each kernel's own tests; the junk padding reaches
the Mosaic GPU kernel's bookkeeping, plain jnp, in `test_mosaic_gpu_tiles_ignore_padded_slots`), the Mosaic GPU
kernel without split-KV: an interpreted run costs 5-20 s.
"""

from __future__ import annotations

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import ragged_paged_attention
from tests.kernels_pallas.test_ragged_paged_attention import make_case, naive

# name: q_lens, kv_lens, slots, padding tokens after the last sequence's
CASES = {
    "jax_basic_3_of_8": ([192, 128, 64], [328, 180, 255], 8, 0),
    "decode_3_of_8": ([1, 1, 1], [40, 17, 5], 8, 5),
}
PADDINGS = ("engine", "zeros", "junk")
# impl: (query / cache dtype, tolerance against the f32 loop on the same rounded inputs, paddings run)
IMPLS = {
    "reference": ("float32", 2e-5, PADDINGS),
    "cpu": ("float32", 2e-5, PADDINGS),
    "gpu": ("float32", 2e-5, ("zeros",)),  # Triton, Pallas' generic interpreter
    "tpu": ("float32", 2e-5, ("zeros",)),
    "mosaic_gpu": ("bfloat16", 2e-2, ("zeros",)),  # bf16 / f16 only (mosaic_gpu.supports)
}
NEEDS_CXX = shutil.which(os.environ.get("CXX") or "g++") is None


def padded(cu_q_lens, kv_lens, num_seqs, how, rng):
    """The metadata with slots past num_seqs filled `how`: 'engine' (cu_q_lens repeats its last offset, kv_lens 0,
    as `make_case` builds it), 'zeros' (JAX's tests) or 'junk' (random values, including offsets past T)."""
    cu, kv = cu_q_lens.copy(), kv_lens.copy()
    n = int(num_seqs[0])
    if how == "zeros":
        cu[n + 1:], kv[n:] = 0, 0
    elif how == "junk":
        cu[n + 1:] = rng.integers(0, 2 * int(cu[n]) + 7, size=cu.size - n - 1)
        kv[n:] = rng.integers(0, 4096, size=kv.size - n)
    return cu, kv


def build(name):
    q_lens, kv_lens, slots, extra_tokens = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    page_size = 16
    pps = -(-max(kv_lens) // page_size)
    q, kv, lens, pages, cu, ns = make_case(rng, q_lens, kv_lens, num_q_heads=2, num_kv_heads=1, head_dim=64,
                                           page_size=page_size, pages_per_seq=pps, num_pages=pps * len(q_lens) + 2,
                                           max_seqs=slots)
    q = np.concatenate([q, rng.standard_normal((extra_tokens, *q.shape[1:])).astype(np.float32)])
    return rng, q, kv, lens, pages, cu, ns, max(q_lens)


def run(impl, args, max_q_len):
    interpret = False
    if impl == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        interpret = pltpu.InterpretParams()
    elif impl in ("gpu", "mosaic_gpu"):
        interpret = True
    if impl == "mosaic_gpu":  # one KV split: a sixth of the interpreted programs (splits have their own tests)
        from kernels_pallas.attention.mosaic_gpu import ragged_paged_attention_mosaic_gpu

        call = functools.partial(ragged_paged_attention_mosaic_gpu, num_kv_splits=1)
    else:
        call = functools.partial(ragged_paged_attention, impl=impl)
    fn = jax.jit(lambda *a: call(*a, sm_scale=0.125, interpret=interpret, max_q_len=max_q_len))
    try:
        return np.asarray(fn(*args).astype(jnp.float32))
    finally:
        if impl == "tpu":
            pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_padded_slots_change_no_output(impl, name):
    if impl == "cpu" and NEEDS_CXX:
        pytest.skip("no C++ compiler for the CPU kernel (test_ragged_paged_attention_cpu says why that is fine)")
    dtype, tol, paddings = IMPLS[impl]
    rng, q, kv, lens, pages, cu, ns, max_q_len = build(name)
    q = np.asarray(jnp.asarray(q, dtype).astype(jnp.float32))  # what the impl reads, for the f32 loop
    kv = np.asarray(jnp.asarray(kv, dtype).astype(jnp.float32))
    num_real = int(cu[int(ns[0])])
    want = naive(q[:num_real], kv, lens, pages, cu, ns, sm_scale=0.125)
    outs = {}
    for how in paddings:
        cu_p, lens_p = padded(cu, lens, ns, how, rng)
        args = (jnp.asarray(q, dtype), jnp.asarray(kv, dtype), *map(jnp.asarray, (lens_p, pages, cu_p, ns)))
        outs[how] = got = run(impl, args, max_q_len)
        assert np.isfinite(got).all(), f"{impl}, {how} padding: non-finite rows {np.unique(np.where(~np.isfinite(got))[0])}"
        err = float(np.max(np.abs(got[:num_real] - want)))
        assert err <= tol, f"{impl}, {how} padding: max abs error {err} > {tol}"
        assert np.all(got[num_real:] == 0), f"{impl}, {how} padding: padding tokens must come back as zeros"
    for how in paddings[1:]:
        np.testing.assert_array_equal(outs[how], outs["engine"], err_msg=f"{impl}: {how} vs engine padding")


def test_mosaic_gpu_tiles_ignore_padded_slots():
    """The Mosaic GPU kernel's wrapper bookkeeping (`mosaic_gpu_tiles`: per-tile scalars, the tiles' row of each
    token, the sanitized page table) is the same for every padding of the slots past num_seqs: where the
    non-finite rows came from (a binary search over a zero-padded `cu_q_lens` sent tokens to rows no tile owns)."""
    from kernels_pallas.attention import mosaic_gpu_tiles as tiles

    for name in CASES:
        rng, q, _, lens, pages, cu, ns, _ = build(name)
        num_tokens, block_q, block_kv, group = q.shape[0], 32, 64, 2
        num_tiles = -(-num_tokens // block_q) + lens.shape[0]

        @jax.jit
        def bookkeeping(lens_p, cu_p, ns):
            kv_lens, cu_q_lens = tiles.clean_metadata(lens_p, cu_p, ns)
            info, start = tiles.tile_info(kv_lens, cu_q_lens, ns, num_tokens=num_tokens, block_q=block_q,
                                          block_kv=block_kv, num_tiles=num_tiles, num_splits=2, sliding_window=None)
            rows = tiles.token_rows_of(cu_q_lens, ns, start, num_tokens, block_q, group)
            return info, rows, tiles.sanitize_pages(jnp.asarray(pages), kv_lens, 16, pages.shape[1])

        got = {}
        for how in PADDINGS:
            cu_p, lens_p = padded(cu, lens, ns, how, rng)
            got[how] = [np.asarray(x) for x in bookkeeping(*map(jnp.asarray, (lens_p, cu_p, ns)))]
        for how in PADDINGS[1:]:
            for a, b, what in zip(got[how], got["engine"], ("tile info", "token rows", "page table")):
                np.testing.assert_array_equal(a, b, err_msg=f"{name}: {what}, {how} vs engine padding")
