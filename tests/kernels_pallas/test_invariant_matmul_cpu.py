"""The batch-invariant matmul (C++, XLA FFI): a row's bits do not depend on the row count M, on the row's position
(permutations), on the thread count or on the build (AVX-512 vs portable std::fma), for the plain and the transposed
(tied LM head) layout, column counts around its 64-column strips and row counts around its 6-row blocks (one row of
the LM head is packed inside the k loop, more rows once per strip: both paths meet in these tests); its values
are XLA's x @ w to rounding and its gradient is XLA's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.matmul.invariant_cpu import invariant_matmul, invariant_matmul_reference

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None,
                                reason="no C++ compiler: the invariant matmul is a C++ kernel")

ROWS = (1, 3, 5, 6, 7, 8, 13, 16, 64, 257)


def _inputs(k: int, n: int, m: int = 257, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("k,n", [(576, 130), (37, 64), (5, 1)])
def test_rows_do_not_depend_on_the_batch(k, n, transposed):
    x, w = _inputs(k, n)
    wk = jnp.asarray(w.T if transposed else w)
    full = np.asarray(invariant_matmul(jnp.asarray(x), wk, transposed=transposed))
    for m in ROWS:
        np.testing.assert_array_equal(np.asarray(invariant_matmul(jnp.asarray(x[:m]), wk, transposed=transposed)),
                                      full[:m], err_msg=f"M={m}")
    perm = np.random.default_rng(1).permutation(len(x))
    np.testing.assert_array_equal(np.asarray(invariant_matmul(jnp.asarray(x[perm]), wk, transposed=transposed)),
                                  full[perm])
    # The last row alone, and inside a batch of 3 at each position.
    for pos in range(3):
        batch = np.stack([x[5], x[7], x[9]])
        batch[pos] = x[-1]
        np.testing.assert_array_equal(np.asarray(invariant_matmul(jnp.asarray(batch), wk,
                                                                  transposed=transposed))[pos], full[-1])
    np.testing.assert_array_equal(np.asarray(invariant_matmul(jnp.asarray(x), wk, transposed=transposed,
                                                              portable=True)), full)
    np.testing.assert_allclose(full, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_leading_dims_and_reference():
    x, w = _inputs(48, 70, m=24)
    y = invariant_matmul(jnp.asarray(x.reshape(2, 12, 48)), jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(y).reshape(24, 70), np.asarray(invariant_matmul(jnp.asarray(x),
                                                                                             jnp.asarray(w))))
    ref = np.asarray(invariant_matmul_reference(jnp.asarray(x), jnp.asarray(w)))
    # Both sum 48 float32 products, in different orders (and the reference with or without fused multiply-adds, as
    # XLA's optimization level decides): each differs from the exact sum by at most K roundings of |x| @ |w|.
    bound = 48 * 2.0 ** -23 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
    assert np.all(np.abs(np.asarray(y).reshape(24, 70) - ref) <= bound)


def test_gradient_is_xlas():
    x, w = _inputs(40, 30, m=9)
    x, w = jnp.asarray(x), jnp.asarray(w)
    for transposed in (False, True):
        wk = w.T if transposed else w

        def loss(x, wk, f):
            return jnp.sum(jnp.sin(f(x, wk)))

        ours = jax.grad(loss, argnums=(0, 1))(x, wk, lambda a, b: invariant_matmul(a, b, transposed=transposed))
        xla = jax.grad(loss, argnums=(0, 1))(x, wk, lambda a, b: a @ (b.T if transposed else b))
        for a, b in zip(ours, xla):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    jitted = jax.jit(jax.grad(lambda x: jnp.sum(invariant_matmul(x, w))))(x)
    np.testing.assert_allclose(np.asarray(jitted), np.broadcast_to(np.asarray(w.sum(1)), x.shape), rtol=1e-5)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="float32"):
        invariant_matmul(jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4)))
    with pytest.raises(ValueError, match=r"\[K, N\]"):
        invariant_matmul(jnp.ones((2, 3)), jnp.ones((4, 4)))


_THREADS_SCRIPT = """
import numpy as np, jax.numpy as jnp, sys
from kernels_pallas.matmul.invariant_cpu import invariant_matmul
rng = np.random.default_rng(0)
x, w = rng.standard_normal((70, 300)).astype(np.float32), rng.standard_normal((300, 200)).astype(np.float32)
np.save(sys.argv[1], np.asarray(invariant_matmul(jnp.asarray(x), jnp.asarray(w))))
"""


def test_thread_count_does_not_change_bits(tmp_path):
    outs = []
    for threads in ("1", "3"):
        path = tmp_path / f"y{threads}.npy"
        env = {**os.environ, "PAGEJAX_CPU_THREADS": threads, "JAX_PLATFORMS": "cpu"}
        subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(path)], check=True, env=env, timeout=300)
        outs.append(np.load(path))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("n", [64, 100, 49152])
def test_row_sum_is_the_in_order_sum_of_64_element_chunks(n):
    """invariant_row_sum = numpy's sequential float32 sums (cumsum) of each 64-element chunk, then of the chunk sums:
    bit for bit, for every row count."""
    from kernels_pallas.matmul.invariant_cpu import invariant_row_sum

    x = np.random.default_rng(n).standard_normal((5, n)).astype(np.float32)
    chunks = -(-n // 64)
    padded = np.pad(x, ((0, 0), (0, chunks * 64 - n))).reshape(5, chunks, 64)
    want = np.cumsum(np.cumsum(padded, axis=2, dtype=np.float32)[:, :, -1], axis=1, dtype=np.float32)[:, -1]
    np.testing.assert_array_equal(np.asarray(invariant_row_sum(jnp.asarray(x))), want)
    np.testing.assert_array_equal(np.asarray(invariant_row_sum(jnp.asarray(x[2:3]))), want[2:3])


def test_invariant_rsqrt_is_the_correctly_rounded_one_over_sqrt_at_every_shape():
    """numpy's float32 1 / sqrt(x) (both operations correctly rounded) bit for bit, for one row and for 300, as a
    column (an RMSNorm's per-row factor) and as rows: XLA's own rsqrt gave one row other bits (jax 0.12.0.1, -O0)."""
    from kernels_pallas.matmul.invariant_cpu import invariant_rsqrt

    x = np.abs(np.random.default_rng(3).standard_normal((300, 100))).astype(np.float32) * 7 + 1e-5
    want = np.float32(1) / np.sqrt(x)
    run = jax.jit(invariant_rsqrt)
    for rows in (1, 2, 5, 17, 300):
        np.testing.assert_array_equal(np.asarray(run(x[:rows])), want[:rows])
        np.testing.assert_array_equal(np.asarray(run(x[:rows, :1])), want[:rows, :1])
