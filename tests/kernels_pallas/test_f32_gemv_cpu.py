"""The C++ few-row float32 matmul (XLA FFI) against a float64 product, for each build this CPU runs (native, the
baseline-ISA "portable" build, and the AVX2 build on any AVX2 / AVX-512 CPU), both layouts (w [K, N]; the tied
head's E [N, K]), 1 to 4 rows, K not a multiple of 4 or 16 and cut into several parts, N around its 8-float vectors,
its 2048-column blocks and the head's 128-row items; its input checks; and where the model's linears take it."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.matmul import f32_gemv_cpu as gemv
from kernels_pallas.native import gate
from models import layers

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None,
                                reason="no C++ compiler: float32 linears use XLA's dot")

BUILDS = ["native", "portable", *(["avx2"] if gate.host_isa().startswith(("avx2", "avx512")) else [])]
SHAPES = [(1, 576, 1536), (1, 1536, 576), (1, 7, 5), (2, 130, 2100), (3, 37, 17), (4, 576, 192), (1, 1, 9)]


def product(x: np.ndarray, w: np.ndarray, transposed: bool) -> np.ndarray:
    return x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_matches_the_float64_product(build, transposed, m, k, n):
    rng = np.random.default_rng(m * 10000 + k * 10 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k) if transposed else (k, n)).astype(np.float32)
    got = np.asarray(jax.jit(lambda a, b: gemv.f32_gemv_cpu(a, b, transposed=transposed, build=build))(x, w))
    assert got.shape == (m, n) and got.dtype == np.float32
    want = product(x, w, transposed)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.sqrt(k) * np.abs(want).max())


def test_leading_axes_and_the_same_result_every_call():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 1, 576)).astype(np.float32)
    w = rng.standard_normal((576, 1536)).astype(np.float32)
    fn = jax.jit(lambda a, b: gemv.f32_gemv_cpu(a, b))
    first = np.asarray(fn(x, w))
    assert first.shape == (1, 1, 1536)
    for _ in range(3):  # items run on whichever thread takes them; their sums are added in a fixed order
        np.testing.assert_array_equal(np.asarray(fn(x, w)), first)


def test_zero_sized_inputs():
    fn = jax.jit(lambda a, b: gemv.f32_gemv_cpu(a, b))
    np.testing.assert_array_equal(np.asarray(fn(np.zeros((2, 0), np.float32), np.zeros((0, 3), np.float32))),
                                  np.zeros((2, 3), np.float32))
    assert np.asarray(fn(np.ones((1, 4), np.float32), np.ones((4, 0), np.float32))).shape == (1, 0)


def test_rejects_what_it_cannot_run():
    w = jnp.ones((8, 3), jnp.float32)
    with pytest.raises(ValueError, match="at most 4 rows"):
        gemv.f32_gemv_cpu(jnp.ones((5, 8), jnp.float32), w)
    with pytest.raises(ValueError, match="float32 x"):
        gemv.f32_gemv_cpu(jnp.ones((1, 8), jnp.bfloat16), w)
    with pytest.raises(ValueError, match=r"w \[N, K\]"):
        gemv.f32_gemv_cpu(jnp.ones((1, 8), jnp.float32), w, transposed=True)


def kernels_in(fn, *args) -> bool:
    return gemv.KERNEL.target in jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("gate_says", [True, False])
def test_linears_take_it_at_one_row_only_where_the_gate_says(monkeypatch, gate_says):
    """Whatever `gate.MEASURED` has for this CPU: with the gate answering yes a 1-row float32 linear (and tied head)
    calls the kernel, with the right values; more rows or bf16 never do; with the gate answering no, nothing does."""
    monkeypatch.setattr(gate, "runs_here", lambda kernel: gate_says and kernel == gemv.KERNEL)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((64, 48)).astype(np.float32))
    one = jnp.ones((1, 64), jnp.float32)
    assert kernels_in(lambda a: layers.dense_matmul(a, w), one) == gate_says
    assert kernels_in(lambda a: layers.dense_matmul(a, w.T, True), one) == gate_says
    assert not kernels_in(lambda a: layers.dense_matmul(a, w), jnp.ones((gemv.MAX_ROWS + 1, 64), jnp.float32))
    assert not kernels_in(lambda a: layers.dense_matmul(a, w.astype(jnp.bfloat16)), one.astype(jnp.bfloat16))
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    want = x.astype(np.float64) @ np.asarray(w, np.float64)
    for fn in (lambda a: layers.dense_matmul(a, w), lambda a: layers.dense_matmul(a, w.T, True)):
        got = jax.jit(fn)(x)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
