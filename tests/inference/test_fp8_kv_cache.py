"""The fp8 (float8_e4m3fn) KV cache: `kv_cache_dtype="fp8"`, per-token-per-head scales as the int8 cache has them
(kernels_pallas/kv_cache/writes.py), read by the reference and the C++ CPU kernel ("auto" on CPU, where the gate lets
it run; its exhaustive tests are in tests/kernels_pallas/test_ragged_paged_attention_cpu.py), and MLA's latent cache
as a saturating cast."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inference import SamplingParams
from kernels_pallas import ragged_paged_attention, write_kv
from kernels_pallas.kv_cache.layout import kv_cache_spec, scales_by_page
from kernels_pallas.kv_cache.writes import quantize_cache, write_latent
from kernels_pallas.attention import cpu
from kernels_pallas.attention.dispatch import resolve_impl
from kernels_pallas.native import gate
from models.attention import QuantizedKV
from tests.kernels_pallas.test_ragged_paged_attention import make_case, naive
from tests.llm_configs import SMALL_POOL

F8 = jnp.float8_e4m3fn
FP8 = SMALL_POOL.replace(kv_cache_dtype="fp8")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_fp8_write_kv_stores_e4m3_with_per_token_scales_and_attention_reads_them():
    rng = np.random.default_rng(5)
    num_pages, page_size, hkv, d = 6, 4, 2, 16
    k = rng.standard_normal((3, hkv, d)).astype(np.float32) * 40  # beyond e4m3's range unscaled at x > 448
    v = rng.standard_normal((3, hkv, d)).astype(np.float32)
    k[1, 0] = 0.0
    slots = jnp.array([0, 5, -1], jnp.int32)
    pages_spec, scales_spec = kv_cache_spec(num_pages, page_size, hkv, d, F8)
    pages, scales = jax.jit(write_kv)(jnp.zeros(pages_spec.shape, F8), k, v, slots,
                                      jnp.zeros(scales_spec.shape, jnp.float32))
    assert pages.dtype == F8
    flat_p = np.asarray(pages).astype(np.float32).reshape(hkv, -1, 2 * d)
    flat_s = np.asarray(scales_by_page(scales, num_pages, page_size)).transpose(0, 1, 3, 2).reshape(hkv, -1, 2)
    for i, slot in enumerate([0, 5]):
        for x, off in ((k[i], 0), (v[i], 1)):
            np.testing.assert_allclose(flat_s[:, slot, off], np.abs(x).max(-1) / 448, rtol=1e-6)
            deq = flat_p[:, slot, off * d:(off + 1) * d] * flat_s[:, slot, off, None]
            # e4m3: 3 mantissa bits, so rounding moves a value by at most 1/16 of its power of two
            assert np.all(np.abs(deq - x) <= np.abs(x) / 16 + np.abs(x).max() / 448 * 2.0 ** -9)
    assert np.all(flat_p[0, 5, :d] == 0) and flat_s[0, 5, 0] == 0  # the all-zero row

    q, kv_f32, *rest = make_case(rng, [2, 1], [7, 12], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                                 pages_per_seq=3, num_pages=8)
    kv_q, kv_s = quantize_cache(jnp.asarray(kv_f32), F8)
    s_by_page = np.asarray(scales_by_page(kv_s, 8, 4))
    k_q, v_q = np.split(np.asarray(kv_q).astype(np.float32), 2, axis=-1)
    deq = np.concatenate([k_q * s_by_page[:, :, 0, :, None], v_q * s_by_page[:, :, 1, :, None]], -1)
    args = (jnp.asarray(q), kv_q, *map(jnp.asarray, rest))
    for impl in ("reference", "auto"):  # "auto" on CPU: the C++ kernel where the gate lets it run
        got = ragged_paged_attention(*args, sm_scale=0.3, kv_scales=kv_s, impl=impl)
        np.testing.assert_allclose(np.asarray(got), naive(q, deq, *rest, sm_scale=0.3), atol=2e-5, rtol=1e-5)
    close = naive(q, kv_f32, *rest, sm_scale=0.3)
    assert np.abs(np.asarray(got) - close).max() < 0.1 * np.abs(close).max()


def test_llm_fp8_cache_pages_scales_and_copy_on_write():
    llm = FP8.build()
    cache = llm.runner.kv_caches[0]
    assert isinstance(cache, QuantizedKV) and cache.pages.dtype == F8 and cache.scales.dtype == jnp.float32
    # The engine's bucket choice asks the dispatcher with the cache dtype: the C++ kernel reads fp8, so where it
    # runs the page and query buckets buy nothing (as for a float cache).
    assert llm.runner.kv_dtype == F8
    runs = resolve_impl("auto", llm.runner.page_size, llm.runner.config.head_dim, F8) == "cpu"
    assert runs == gate.runs_here(cpu.KERNEL) and llm.engine.limits.page_buckets == (not runs)
    prompt = list(range(7, 21))
    alone = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].outputs[0].token_ids
    forked = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, n=3))[0]
    assert [o.token_ids for o in forked.outputs] == [alone] * 3


def test_mla_latent_cache_in_fp8_is_a_saturating_cast():
    pages = jnp.zeros((3, 4, 8), F8)
    latent = jnp.asarray([[1.0, -2.5, 1000.0, -1000.0, 0.1, 3.0, 0.0, 7.0]])
    got = np.asarray(write_latent(pages, latent, jnp.array([5], jnp.int32))).astype(np.float32)
    np.testing.assert_array_equal(got[1, 1], [1.0, -2.5, 448.0, -448.0, np.float32(jnp.asarray(0.1, F8)), 3.0, 0, 7])
    llm = FP8.replace("tiny-deepseek-v2").build()
    assert llm.runner.kv_caches[0].dtype == F8
    out = llm.generate(prompt_token_ids=[[5, 17, 42, 7]], sampling_params=GREEDY)[0].outputs[0].token_ids
    assert len(out) == 8


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_pallas_kernels_read_an_fp8_cache_in_interpret_mode(impl):
    """The Triton and TPU kernels dequantize `pages * scale` whatever the 1-byte dtype (the Mosaic GPU kernel's fp8
    cases are in tests/kernels_pallas/test_ragged_paged_attention_mosaic_gpu.py)."""
    rng = np.random.default_rng(0)
    q, kv, *rest = make_case(rng, [2, 1], [7, 12], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                             pages_per_seq=2, num_pages=8)
    kq, ks = quantize_cache(jnp.asarray(kv), F8)
    args = (jnp.asarray(q, jnp.bfloat16), kq, *map(jnp.asarray, rest))
    want = ragged_paged_attention(*args, sm_scale=0.125, kv_scales=ks, impl="reference")
    if impl == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        interpret = pltpu.InterpretParams()
    else:
        interpret = True
    got = ragged_paged_attention(*args, sm_scale=0.125, kv_scales=ks, impl=impl, interpret=interpret)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


@pytest.mark.parametrize("impl", ["reference", "gpu"])
def test_mla_kernels_read_an_fp8_latent_cache(impl):
    """MLA over fp8 latent pages (bf16 queries): the reference and the Triton kernel (interpret mode) give what the
    reference gives over the same pages converted to float32."""
    from kernels_pallas.mla.dispatch import ragged_paged_mla_attention
    from tests.kernels_pallas.test_mla_attention import mla_case

    rng = np.random.default_rng(1)
    ql, qr, latent, *rest = mla_case(rng, [1, 1], [30, 9], heads=16, latent_dim=128, rope_dim=64, page_size=16,
                                     pages_per_seq=2)
    pages = jnp.asarray(latent).astype(F8)
    q = (jnp.asarray(ql, jnp.bfloat16), jnp.asarray(qr, jnp.bfloat16))
    kw = dict(sm_scale=0.04, max_q_len=1)
    want = ragged_paged_mla_attention(*q, pages.astype(jnp.float32), *map(jnp.asarray, rest), **kw)
    got = ragged_paged_mla_attention(*q, pages, *map(jnp.asarray, rest), impl=impl, interpret=impl == "gpu", **kw)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2)
