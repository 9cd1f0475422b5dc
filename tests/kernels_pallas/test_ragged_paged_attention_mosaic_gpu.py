"""The Mosaic GPU (Hopper) ragged paged attention kernel, run in Mosaic GPU's interpret mode on CPU against the
pure-JAX reference and an independent numpy loop; a pool poisoned with NaN/Inf wherever no query may look.

Interpreted cases cost several seconds each (the interpreter simulates every thread, barrier and TMA), so the
sweep is pairwise: each value of each factor (decode / prefill / mixed / chunked prefill, page size 16/32/64, GQA
ratio 1/3/8, head_dim 64/128, window, soft cap, split-KV, fewer stages than KV blocks, bf16 / f16 / an int8
or fp8 (float8_e4m3fn) cache with its scales under bf16 queries, empty /
one-page / page-crossing sequences, num_seqs below the array size, garbage page-table tails) appears, not every
combination. Padded metadata (slots past num_seqs zero-padded, as JAX's tests pad them) is in
test_padded_metadata.py with every other impl; the deviceless sm_90a compile is in
tests/scripts/test_aot_compile.py (`test_mosaic_gpu_compiles_for_hopper_without_spills`). On jax 0.10 the
interpreter cannot run a transposed wgmma operand, so there the two products are `dot_general`s on the same
shared-memory tiles (see the kernel's `OLD_INTERPRETER`); jax >= 0.11 interprets the wgmmas themselves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.attention.mosaic_gpu import is_hopper, ragged_paged_attention_mosaic_gpu, supports
from kernels_pallas.kv_cache.writes import quantize_cache
from tests.kernels_pallas.test_ragged_paged_attention import make_case, naive
from tests.kernels_pallas.test_ragged_paged_attention_gpu import build as build_case, dequantize, poisoned_int8_pools
from tests.kernels_pallas.test_ragged_paged_attention_cpu import poison, poisoned_pool_case
from tests.kernels_pallas.test_ragged_paged_attention_tpu import assert_close, run_reference

BF16_TOL = 2e-2

# name: q_lens, kv_lens, (Hq, Hkv), head_dim, page_size, pages_per_seq, max_seqs, dtype, kw
CASES = {
    # decode: kv 16 = exactly one page, 21 crosses a page, 0 = an empty sequence, 40 spans 3 pages; 2 padding
    # sequences beyond num_seqs, padding tokens, page-table tails pointing far out of the pool, a NaN page
    "decode_g3_p16_d64": ([1, 1, 0, 1], [16, 21, 0, 40], (9, 3), 64, 16, 4, 6, "bfloat16", {}),
    # prefill only, MHA, 32-token pages, f16
    "prefill_g1_p32_d128_f16": ([32, 11, 3], [32, 11, 3], (2, 2), 128, 32, 1, 3, "float16", {}),
    # mixed, 8 query heads per KV head, 64-token pages, window + soft cap, 2 KV splits
    "mixed_g8_p64_window_softcap_split2": ([1, 9, 1, 4], [100, 9, 1, 70], (8, 1), 64, 64, 2, 4, "bfloat16",
                                           dict(sliding_window=40, soft_cap=3.0, num_kv_splits=2)),
    # chunked prefill: 30 queries = 2 tiles of 21 tokens at group 3, 4 KV blocks through a 2-stage pipeline
    "chunked_prefill_g3_p16_d128_2stages": ([30, 2], [200, 2], (6, 2), 128, 16, 13, 2, "bfloat16",
                                            dict(num_stages=2, num_kv_splits=1)),
    # long-ish decode split 4 ways (one split of the 1-token sequence is empty), window
    "decode_g8_p16_d128_split4_window": ([1, 1, 1], [130, 1, 40], (8, 1), 128, 16, 9, 3, "bfloat16",
                                         dict(num_kv_splits=4, sliding_window=50)),
    # int8 cache + per-token scales, bf16 queries: decode at group 3 (one page, page-crossing, num_seqs below the
    # array size), a mixed batch at MHA with window + soft cap, a GQA-8 prefill over 64-token pages split 2 ways
    "decode_g3_p16_d128_int8": ([1, 1, 1], [16, 40, 5], (6, 2), 128, 16, 3, 4, "int8", {}),
    "mixed_g1_p32_d64_int8_window_softcap": ([1, 9, 3], [50, 9, 33], (2, 2), 64, 32, 2, 3, "int8",
                                             dict(sliding_window=20, soft_cap=5.0)),
    "prefill_g8_p64_d128_int8_split2": ([20, 1], [70, 65], (8, 1), 128, 64, 2, 2, "int8",
                                        dict(num_kv_splits=2)),
    # fp8 (e4m3) cache + per-token scales, bf16 queries: the int8 path's stages with e4m3 codes
    "decode_g3_p16_d128_fp8": ([1, 1, 1], [16, 40, 5], (6, 2), 128, 16, 3, 4, "float8_e4m3fn", {}),
}
CODES = ("int8", "float8_e4m3fn")  # caches of 1-byte codes with per-token scales


def build(name):
    """`test_ragged_paged_attention_gpu.build` over this module's CASES."""
    return build_case(name, CASES, garbage_case="decode_g3_p16_d64")


def run_mosaic(args, kv_scales=None, **kw):
    fn = jax.jit(lambda *a, s: ragged_paged_attention_mosaic_gpu(*a, kv_scales=s, interpret=True, **kw))
    return fn(*map(jnp.asarray, args), s=kv_scales)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name):
    q, kv, rest, dtype, kw, safe = build(name)
    q_dtype = jnp.bfloat16 if dtype in CODES else dtype
    q16 = jnp.asarray(q, q_dtype)
    if dtype in CODES:  # both sides read the same codes and scales; the loop reads them dequantized
        kv16, scales = quantize_cache(jnp.asarray(kv), dtype)
        kv32 = dequantize(kv16, scales)
    else:
        kv16, scales = jnp.asarray(kv, dtype), None
        kv32 = np.asarray(kv16.astype(jnp.float32))
    got = run_mosaic((q16, kv16, *rest), kv_scales=scales, sm_scale=0.125, **kw)
    assert got.dtype == jnp.dtype(q_dtype)
    got = np.asarray(got.astype(jnp.float32))
    q32 = np.asarray(q16.astype(jnp.float32))
    ref_kw = {k: v for k, v in kw.items() if k not in ("num_kv_splits", "num_stages")} | {"sm_scale": 0.125}
    num_real = int(rest[2][-1])
    assert_close(got[:num_real], naive(q32[:num_real], kv32, rest[0], safe, *rest[2:], **ref_kw), tol=BF16_TOL)
    assert np.all(got[num_real:] == 0), "padding tokens must come back as zeros"
    if (safe == rest[1]).all():
        assert_close(got, run_reference((q32, kv16 if dtype in CODES else kv32, *rest), kv_scales=scales,
                                        **ref_kw), tol=BF16_TOL)


def poisoned_case(rng, *, sliding_window):
    """`poisoned_pool_case` with 16-token pages (the kernel's TMA needs page_size a multiple of 8) and a 40-token
    prefill (two tiles at group 2, different window starts)."""
    return poisoned_pool_case(rng, head_dim=64, sliding_window=sliding_window, q_lens=(1, 40, 3, 0, 2),
                              kv_lens=(21, 40, 80, 12, 6), page_size=16, pages_per_seq=6, num_pages=16)


@pytest.mark.parametrize("kv_dtype,options", [
    ("bfloat16", {}),
    ("bfloat16", {"sliding_window": 5, "soft_cap": 3.0, "num_kv_splits": 2}),
    ("int8", {"sliding_window": 5, "soft_cap": 3.0}),
    ("float8_e4m3fn", {"sliding_window": 5}),
])
def test_stale_non_finite_slots_change_no_output(kv_dtype, options):
    """NaN/Inf in every slot no query may see (past kv_len, before the window, unused pages, the page padding
    entries point at, the keys of a sequence without queries; for an int8 / fp8 cache random bytes there (fp8 NaN
    codes among them) and
    NaN/Inf in their scales and the scales' padding tail) leave the output bit-identical to the clean pool's and
    finite; 64-token KV blocks of 16-token pages put stale slots inside blocks the kernel loads."""
    rng = np.random.default_rng(8)
    (q, clean, *rest), seen = poisoned_case(rng, sliding_window=options.get("sliding_window"))
    if kv_dtype in CODES:
        pools = poisoned_int8_pools(rng, clean, seen, kv_dtype)
    else:
        pools = {name: (jnp.asarray(x, jnp.bfloat16), None)
                 for name, x in (("clean", clean), ("dirty", poison(clean, seen[None, :, :, None])))}
    kw = dict(sm_scale=0.125) | options
    q16 = jnp.asarray(q, jnp.bfloat16)
    out = {name: np.asarray(run_mosaic((q16, kv, *rest), kv_scales=None if s is None else jnp.asarray(s),
                                       **kw).astype(jnp.float32))
           for name, (kv, s) in pools.items()}
    assert np.isfinite(out["dirty"]).all()
    np.testing.assert_array_equal(out["dirty"], out["clean"])
    kv, s = pools["clean"]
    kv = kv if kv_dtype in CODES else np.asarray(kv.astype(jnp.float32))
    want = run_reference((np.asarray(q16.astype(jnp.float32)), kv, *rest), kv_scales=s,
                         **{k: v for k, v in kw.items() if k != "num_kv_splits"})
    assert_close(out["clean"], want, tol=BF16_TOL)


def test_supports_and_rejects():
    """`supports` is the rule for impl="auto"; what it refuses, the entry point refuses with a clear error."""
    assert supports(jnp.bfloat16, jnp.bfloat16, 128, 16, 4)
    assert supports(jnp.float16, jnp.float16, 64, 64, 8)
    assert not supports(jnp.float32, jnp.float32, 128, 16, 4)  # f32: Triton kernel (IEEE f32 dots)
    assert supports(jnp.bfloat16, jnp.int8, 128, 16, 4, kv_scales=True)  # int8 cache + scales, bf16 queries
    assert supports(jnp.float16, jnp.int8, 64, 8, 3, kv_scales=True)
    assert not supports(jnp.bfloat16, jnp.int8, 128, 16, 4)  # an int8 cache needs its scales
    assert supports(jnp.bfloat16, jnp.float8_e4m3fn, 128, 16, 4, kv_scales=True)  # fp8 cache + scales
    assert not supports(jnp.bfloat16, jnp.float8_e4m3fn, 64, 16, 4)  # so does an fp8 one
    assert not supports(jnp.float32, jnp.int8, 128, 16, 4, kv_scales=True)  # f32 queries: Triton kernel
    assert not supports(jnp.bfloat16, jnp.float16, 128, 16, 4)  # mixed float dtypes
    assert not supports(jnp.bfloat16, jnp.bfloat16, 80, 16, 4)  # head_dim not a multiple of 64
    assert not supports(jnp.bfloat16, jnp.bfloat16, 128, 12, 4)  # page not a multiple of 8 rows
    assert not supports(jnp.bfloat16, jnp.bfloat16, 128, 48, 4)  # 48 does not divide the 64-token block
    assert not supports(jnp.bfloat16, jnp.bfloat16, 128, 16, 65)  # more query heads per KV head than tile rows
    assert is_hopper("NVIDIA H100 80GB HBM3") and is_hopper("NVIDIA H200") and not is_hopper("NVIDIA A100-SXM4-80GB")
    assert not is_hopper("NVIDIA B200") and not is_hopper(None)
    rng = np.random.default_rng(4)
    args = tuple(map(jnp.asarray, make_case(rng, [1], [5], num_q_heads=2, num_kv_heads=1, head_dim=64,
                                            page_size=16, pages_per_seq=1, num_pages=2)))
    with pytest.raises(NotImplementedError, match="Mosaic GPU kernel does not support q float32.*impl='gpu'"):
        ragged_paged_attention_mosaic_gpu(*args, interpret=True)  # f32
    q, kv = args[0].astype(jnp.bfloat16), quantize_cache(args[1])[0]
    with pytest.raises(NotImplementedError, match="cache int8"):  # an int8 cache without its scales
        ragged_paged_attention_mosaic_gpu(q, kv, *args[2:], interpret=True)


def test_dispatcher_routes_mosaic_gpu():
    """impl="mosaic_gpu" reaches this kernel through `ragged_paged_attention` (the same numbers as calling it), and
    impl="auto" does not pick it (see the dispatcher's docstring for why not yet)."""
    from kernels_pallas import ragged_paged_attention
    from kernels_pallas.attention.dispatch import resolve_impl

    rng = np.random.default_rng(5)
    q, kv, lens, pages, cu, ns = make_case(rng, [1, 3], [5, 20], num_q_heads=4, num_kv_heads=2, head_dim=64,
                                           page_size=16, pages_per_seq=2, num_pages=5)
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16), *map(jnp.asarray, (lens, pages, cu, ns)))
    via = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.125, impl="mosaic_gpu", interpret=True))(*args)
    direct = run_mosaic(args, sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(via, np.float32), np.asarray(direct, np.float32))
    assert resolve_impl("mosaic_gpu", 16, 64) == "mosaic_gpu"
    assert resolve_impl("auto", 16, 64) != "mosaic_gpu"
