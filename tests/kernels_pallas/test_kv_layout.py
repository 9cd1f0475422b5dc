"""The cache-layout contract (kernels_pallas/kv_cache/layout.py) and the two ways a cache is written: the in-place loop
(CPU) and the scatters TPU and GPU programs use (run here on CPU inside `compiling_for`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import write_kv
from kernels_pallas.backend import compiling_for, target_backend
from kernels_pallas.kv_cache.layout import kv_cache_spec, scale_rows, scales_by_page, scales_from_pages


def test_spec_is_head_major_lane_dense_and_int8_adds_scale_rows():
    spec = kv_cache_spec(10, 16, 3, 64, jnp.bfloat16)
    assert spec.shape == (3, 10, 16, 128) and spec.dtype == jnp.bfloat16
    pages, scales = kv_cache_spec(10, 16, 3, 64, jnp.int8)
    assert pages.shape == (3, 10, 16, 128) and pages.dtype == jnp.int8
    assert scales.shape == (3, scale_rows(10, 16), 128) and scales.dtype == jnp.float32
    assert scale_rows(10, 16) == 8 and scale_rows(40, 16) == 16  # 320 / 640 scales -> 3 / 5 rows, padded to 8
    with pytest.raises(ValueError, match=">= 1"):
        kv_cache_spec(0, 16, 3, 64)


def test_scales_by_page_round_trips():
    by_page = jnp.arange(2 * 5 * 2 * 8, dtype=jnp.float32).reshape(2, 5, 2, 8)
    stored = scales_from_pages(by_page)
    assert stored.shape == (2, scale_rows(5, 8), 128)
    np.testing.assert_array_equal(scales_by_page(stored, 5, 8), by_page)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_scatter_write_equals_the_loop(kv_dtype, page_size):
    """TPU/GPU programs write the cache with scatters (a loop of dynamic updates made XLA:TPU re-lay the cache out
    and copy it around the attention kernel); both forms place the same values and skip padding and slots past the
    pool."""
    rng = np.random.default_rng(0)
    num_pages, hkv, d = 6, 2, 8
    spec = kv_cache_spec(num_pages, page_size, hkv, d, kv_dtype)
    pages, scales = spec if isinstance(spec, tuple) else (spec, None)
    cache = jnp.asarray(rng.standard_normal(pages.shape), pages.dtype) if kv_dtype != "int8" else \
        jnp.asarray(rng.integers(-100, 100, pages.shape), jnp.int8)
    scale_arr = None if scales is None else jnp.asarray(rng.random(scales.shape), jnp.float32)
    k = jnp.asarray(rng.standard_normal((5, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((5, hkv, d)), jnp.float32)
    slots = jnp.array([3, -1, page_size * 2 + 1, num_pages * page_size, page_size * num_pages - 1], jnp.int32)

    def write(backend):
        with compiling_for(backend):
            assert target_backend() == backend
            return jax.jit(lambda *a: write_kv(*a, sharded=True))(cache, k, v, slots, scale_arr)

    loop, scatter = write("cpu"), write("gpu")
    for a, b in zip(jax.tree.leaves(loop), jax.tree.leaves(scatter)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    changed = np.asarray(jax.tree.leaves(loop)[0] != cache).any(axis=(0, 3)).reshape(-1)
    assert set(np.flatnonzero(changed)) <= {3, page_size * 2 + 1, page_size * num_pages - 1}
