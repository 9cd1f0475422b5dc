"""The C++ CPU kernel (XLA FFI) against the pure-JAX reference: a sweep of ragged batches, head layouts, page sizes,
head dims (the unrolled 64/128 paths and the generic one), KV dtypes (float32, bfloat16, int8 with per-token scales),
sliding window, soft cap and static scales; plus its failure modes (no compiler, out-of-contract indices)."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import ragged_paged_attention, ragged_paged_attention_reference
from kernels_pallas import cpu_build, kv_cache
from kernels_pallas import ragged_paged_attention_cpu as cpu_kernel
from kernels_pallas.kv_cache import quantize_int8
from tests.test_ragged_paged_attention import make_case

# Only a machine without a C++ compiler skips; with one, a build failure fails test_kernel_builds_where_a_compiler_is.
needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None,
                               reason="no C++ compiler: auto dispatch uses the reference (see the missing-compiler test)")


@needs_cxx
def test_kernel_builds_where_a_compiler_is():
    assert cpu_kernel.unavailable_reason() is None

CASES = {
    # name: (q_lens, kv_lens); more query tokens than the kernel's 8-token block in the prefill cases
    "decode": ([1, 1, 1, 1], [1, 16, 33, 70]),
    "prefill": ([7, 19, 3], [7, 19, 3]),
    "mixed": ([1, 12, 1, 0, 4], [20, 12, 1, 0, 30]),
    "chunked_prefill": ([21], [45]),
    "spec_verify": ([4, 4], [30, 9]),
}


def run_both(args, kv_dtype=jnp.float32, q_dtype=jnp.float32, **kw):
    q, kv, *rest = map(jnp.asarray, args)
    q = q.astype(q_dtype)
    scales = None
    if kv_dtype == jnp.int8:
        kv, scales = quantize_int8(kv)
    else:
        kv = kv.astype(kv_dtype)
    call = (q, kv, *rest)
    got = jax.jit(lambda *a: cpu_kernel.ragged_paged_attention_cpu(*a, kv_scales=scales, **kw))(*call)
    want = jax.jit(lambda *a: ragged_paged_attention_reference(*a, kv_scales=scales, **kw))(*call)
    assert got.dtype == q.dtype and got.shape == q.shape
    return np.asarray(got, np.float32), np.asarray(want, np.float32)


@needs_cxx
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim,page_size", [(64, 16), (128, 8), (40, 4)])
def test_kernel_matches_reference(case, heads, head_dim, page_size):
    rng = np.random.default_rng(0)
    q_lens, kv_lens = CASES[case]
    pages_per_seq = -(-max(kv_lens) // page_size) + 1  # one spare page: kv_len below the table's capacity
    args = make_case(rng, q_lens, kv_lens, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                     page_size=page_size, pages_per_seq=pages_per_seq, num_pages=pages_per_seq * len(q_lens) + 2,
                     max_seqs=len(q_lens) + 2)  # two padding sequences beyond num_seqs
    got, want = run_both(args, sm_scale=head_dim ** -0.5)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@needs_cxx
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 5}, {"soft_cap": 3.0, "k_scale": 0.7, "v_scale": 1.3},
                                     {"sliding_window": 1}])
def test_kv_dtypes_and_options(kv_dtype, options):
    rng = np.random.default_rng(1)
    args = make_case(rng, [1, 11, 3], [26, 11, 40], num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=8,
                     pages_per_seq=5, num_pages=18)
    got, want = run_both(args, kv_dtype=kv_dtype, sm_scale=0.125, **options)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@needs_cxx
def test_bfloat16_queries_come_back_in_bfloat16():
    rng = np.random.default_rng(2)
    args = make_case(rng, [1, 5], [9, 5], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4, pages_per_seq=3,
                     num_pages=8)
    got, want = run_both(args, kv_dtype=jnp.bfloat16, q_dtype=jnp.bfloat16, sm_scale=0.125)
    np.testing.assert_allclose(got, want, atol=1e-2, rtol=1e-2)  # both round the f32 result to bf16


@needs_cxx
def test_padding_rows_are_zero_and_rows_of_invalid_sequences_too():
    rng = np.random.default_rng(3)
    q, kv, kv_lens, pages, cu, _ = make_case(rng, [2, 3, 1], [5, 3, 9], num_q_heads=4, num_kv_heads=2, head_dim=64,
                                             page_size=4, pages_per_seq=3, num_pages=10)
    q = np.concatenate([q, rng.standard_normal((2, 4, 64)).astype(np.float32)])  # two padding tokens
    out = np.asarray(cpu_kernel.ragged_paged_attention_cpu(*map(jnp.asarray, (q, kv, kv_lens, pages, cu)),
                                                           jnp.array([2], jnp.int32), sm_scale=0.125))
    want = np.asarray(ragged_paged_attention_reference(*map(jnp.asarray, (q, kv, kv_lens, pages, cu)),
                                                       jnp.array([2], jnp.int32), sm_scale=0.125))
    np.testing.assert_allclose(out[:5], want[:5], atol=2e-5)  # the two valid sequences
    assert np.abs(out[:5]).max() > 0.01
    assert not out[5:].any()  # the third sequence (index >= num_seqs) and the padding tokens


@needs_cxx
def test_auto_dispatch_uses_the_kernel_on_cpu():
    rng = np.random.default_rng(4)
    args = list(map(jnp.asarray, make_case(rng, [1, 1], [7, 12], num_q_heads=4, num_kv_heads=2, head_dim=64,
                                           page_size=4, pages_per_seq=3, num_pages=8)))
    text = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.1, max_q_len=1)).lower(*args).as_text()
    assert cpu_kernel.TARGET in text
    text = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.1, impl="reference")).lower(*args).as_text()
    assert cpu_kernel.TARGET not in text


@needs_cxx
def test_out_of_contract_indices_are_clamped_not_read_out_of_bounds():
    rng = np.random.default_rng(5)
    q, kv, kv_lens, pages, cu, n = make_case(rng, [1, 2], [6, 4], num_q_heads=2, num_kv_heads=1, head_dim=64,
                                             page_size=4, pages_per_seq=2, num_pages=4)
    pages[0, 1] = 10 ** 6  # a page far outside the cache
    pages[1, 0] = -5
    kv_lens[1] = 10 ** 6  # longer than the page table's capacity
    out = cpu_kernel.ragged_paged_attention_cpu(*map(jnp.asarray, (q, kv, kv_lens, pages, cu, n)), sm_scale=0.125)
    assert np.isfinite(np.asarray(out)).all()


@needs_cxx
def test_bad_arguments_are_rejected_by_name():
    rng = np.random.default_rng(6)
    args = list(map(jnp.asarray, make_case(rng, [1], [3], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=4,
                                           pages_per_seq=1, num_pages=2)))
    with pytest.raises(ValueError, match="needs kv_scales"):
        cpu_kernel.ragged_paged_attention_cpu(args[0], args[1].astype(jnp.int8), *args[2:])
    with pytest.raises(ValueError, match="soft_cap"):
        cpu_kernel.ragged_paged_attention_cpu(*args, soft_cap=0.0)
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        cpu_kernel.ragged_paged_attention_cpu(args[0], args[1].astype(jnp.float16), *args[2:])


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-pagejax")
    monkeypatch.setenv("PAGEJAX_KERNEL_DIR", str(tmp_path))
    with pytest.raises(cpu_kernel.KernelBuildError, match="no C\\+\\+ compiler 'no-such-compiler-pagejax'.*"
                       "attn_impl='reference'"):
        cpu_build.build()
    assert not list(tmp_path.iterdir())


@needs_cxx
def test_build_is_cached_by_content(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEJAX_KERNEL_DIR", str(tmp_path))
    first = cpu_build.build()
    mtime = tmp_path.joinpath(first.split("/")[-1]).stat().st_mtime_ns
    assert cpu_build.build() == first  # second call: no recompile
    assert tmp_path.joinpath(first.split("/")[-1]).stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.split("/")[-1]]  # no temporary files left


def test_environment_switch_disables_the_kernels(monkeypatch):
    monkeypatch.setenv("PAGEJAX_CPU_KERNELS", "0")
    reason = cpu_build.unavailable_reason.__wrapped__(*cpu_kernel.KERNEL)  # uncached: the env is read per call
    assert reason is not None and "PAGEJAX_CPU_KERNELS=0" in reason


@needs_cxx
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_cache_write_kernel_equals_the_portable_loop(kv_dtype, monkeypatch):
    """write_kv through csrc/write_rows_cpu.cc (in place, one memcpy per token) gives the loop's bytes exactly,
    padding slots (-1) skipped and a slot written twice keeping the later token; a slot past the cache is skipped."""
    rng = np.random.default_rng(7)
    pages = jnp.asarray(rng.standard_normal((5, 4, 4, 32)), jnp.float32)  # 20 slots
    k, v = (jnp.asarray(rng.standard_normal((6, 2, 32)), jnp.float32) for _ in range(2))
    cache, scales = quantize_int8(pages) if kv_dtype == jnp.int8 else (pages.astype(kv_dtype), None)

    def write(c, s, slots):
        return jax.tree.leaves(kv_cache.write_kv(c, k, v, slots, kv_scales=s))

    slots = jnp.array([3, -1, 17, 0, 3, 19], jnp.int32)
    kernel = jax.jit(write)
    assert kv_cache.WRITE_KERNEL[0] in kernel.lower(cache, scales, slots).as_text()
    got = kernel(cache, scales, slots)
    past_end = kernel(cache, scales, jnp.array([-1, -1, 20, 400, -1, -1], jnp.int32))
    for before, after in zip(jax.tree.leaves((cache, scales)), past_end):
        np.testing.assert_array_equal(np.asarray(after, np.float32), np.asarray(before, np.float32))
    monkeypatch.setattr(kv_cache, "_write_kernel_available", lambda: False)
    portable = jax.jit(lambda c, s, sl: write(c, s, sl))  # a new function: no trace cached with the kernel
    assert kv_cache.WRITE_KERNEL[0] not in portable.lower(cache, scales, slots).as_text()
    for a, b in zip(got, portable(cache, scales, slots)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@needs_cxx
def test_rope_tables_kernel_matches_jnp(monkeypatch):
    """models.layers.rope_tables through csrc/rope_tables_cpu.cc (materialized once, not re-evaluated per head)
    equals XLA's cos/sin to float32 rounding, at positions up to 32k."""
    from models import layers

    positions = jnp.array([0, 1, 7, 128, 4095, 32767], jnp.int32)
    inv_freq = layers.rope_inv_freq(64, 10000.0, None)
    kernel = jax.jit(lambda p: layers.rope_tables(p, inv_freq))
    assert layers.ROPE_KERNEL[0] in kernel.lower(positions).as_text()
    got = kernel(positions)
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "tpu")  # any backend without the kernel
    portable = jax.jit(lambda p: layers.rope_tables(p, inv_freq))
    assert layers.ROPE_KERNEL[0] not in portable.lower(positions).as_text()
    for a, b in zip(got, portable(positions)):
        assert a.shape == (6, 32)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
