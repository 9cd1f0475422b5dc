"""The C++ int8 matmul (XLA FFI) is the exact int32 dot: against numpy for both of its paths (AVX-512 VNNI where the
CPU has it, and the portable one), over row counts on both sides of its row-streaming path (M <= 4) and around its
6-row chunks, K not a multiple of 4 and column counts around its 64-column pieces; and the W8A8 matmul gives the
same bits with the kernel as with XLA's dot."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inference import quantization
from kernels_pallas import int8_matmul_cpu

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None,
                                reason="no C++ compiler: the W8A8 path uses XLA's dot (checked below where one is)")


def test_kernel_builds_where_a_compiler_is():
    assert int8_matmul_cpu.available()


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (2, 6, 63), (3, 37, 130), (4, 9, 1),  # row streaming (M <= 4)
                                   (5, 37, 64), (6, 64, 65), (7, 4, 1), (13, 40, 130), (32, 576, 200), (64, 3, 129)])
def test_exact_int32_dot(portable, m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.integers(-128, 128, (m, k), dtype=np.int8)  # the full int8 range, -128 included
    w = rng.integers(-128, 128, (k, n), dtype=np.int8)
    x[0, :] = -128
    w[:, 0] = -128  # the extreme product, summed K times
    got = jax.jit(lambda a, b: int8_matmul_cpu.int8_matmul_cpu(a, b, portable=portable))(x, w)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), x.astype(np.int32) @ w.astype(np.int32))


def test_rejects_wrong_dtypes_and_shapes():
    with pytest.raises(ValueError, match="expected int8 x"):
        int8_matmul_cpu.int8_matmul_cpu(jnp.zeros((2, 4), jnp.float32), jnp.zeros((4, 3), jnp.int8))
    with pytest.raises(ValueError, match="expected int8 x"):
        int8_matmul_cpu.int8_matmul_cpu(jnp.zeros((2, 4), jnp.int8), jnp.zeros((5, 3), jnp.int8))


@pytest.mark.parametrize("rows", [1, 3, 32])
def test_w8a8_matmul_is_bit_identical_with_and_without_the_kernel(rows, monkeypatch):
    rng = np.random.default_rng(rows)
    qw = quantization.quantize_int8(rng.standard_normal((96, 160)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.float32)
    with_kernel = jax.jit(lambda a: quantization.matmul(a, qw, "int8"))
    text = with_kernel.lower(x).as_text()
    assert int8_matmul_cpu.KERNEL[0] in text
    got = with_kernel(x)
    monkeypatch.setattr(quantization, "_int8_kernel_available", lambda: False)
    without = jax.jit(lambda a: quantization.matmul(a, qw, "int8"))
    assert int8_matmul_cpu.KERNEL[0] not in without.lower(x).as_text()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(without(x)))


def test_concurrent_calls_share_the_workers_safely():
    """Kernels called from several threads at once (as XLA runs device shards): one job owns the worker threads,
    the others run on their calling thread; every result stays exact."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(11)
    cases = [(rng.integers(-128, 128, (m, 300), dtype=np.int8), rng.integers(-128, 128, (300, 700), dtype=np.int8))
             for m in (1, 3, 9, 32)]
    fn = jax.jit(int8_matmul_cpu.int8_matmul_cpu)

    def run(case):
        x, w = case
        return all((np.asarray(fn(x, w)) == x.astype(np.int32) @ w.astype(np.int32)).all() for _ in range(10))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, cases * 2))
