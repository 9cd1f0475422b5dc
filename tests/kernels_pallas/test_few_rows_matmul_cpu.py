"""The few-rows float32 matmul kernel (`kernels_pallas/matmul/few_rows_cpu.py`) against float64 numpy, for every
library build this CPU runs, both layouts, row counts 0..16 and shapes with K and N tails; and the gate's rule that it
stays off on ISAs it was not measured on."""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import pytest

from kernels_pallas.matmul import few_rows_cpu
from kernels_pallas.native import gate

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None,
                                reason="no C++ compiler: float32 matmuls use XLA's dot (checked below where one is)")

BUILDS = ["native", "portable", *(["avx2"] if gate.host_isa().startswith(("avx2", "avx512")) else [])]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (2, 577, 191), (3, 5, 7), (4, 64, 4), (8, 1536, 576),
                                   (16, 33, 130), (1, 3, 1), (0, 8, 8), (5, 0, 9)])
def test_matches_float64_numpy(build, transposed, m, k, n):
    rng = np.random.default_rng(m * 100 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k) if transposed else (k, n)).astype(np.float32)
    got = jax.jit(lambda a, b: few_rows_cpu.few_rows_matmul_cpu(a, b, transposed=transposed, build=build))(x, w)
    want = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
    assert got.shape == (m, n) and got.dtype == np.float32
    # float32 sums of k products: |error| <= k * eps * sum |x||w| (here far below it)
    bound = k * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w.T if transposed else w)) + 1e-30
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)


def test_rejects_wrong_dtypes_shapes_and_row_counts():
    f32 = np.float32
    with pytest.raises(ValueError, match="float32 x"):
        few_rows_cpu.few_rows_matmul_cpu(np.zeros((2, 4), np.int32), np.zeros((4, 3), f32))
    with pytest.raises(ValueError, match="float32 x"):
        few_rows_cpu.few_rows_matmul_cpu(np.zeros((2, 4), f32), np.zeros((5, 3), f32))
    with pytest.raises(ValueError, match="float32 x"):
        few_rows_cpu.few_rows_matmul_cpu(np.zeros((2, 4), f32), np.zeros((4, 3), f32), transposed=True)
    with pytest.raises(ValueError, match=f"M <= {few_rows_cpu.KERNEL_ROWS}"):
        few_rows_cpu.few_rows_matmul_cpu(np.zeros((few_rows_cpu.KERNEL_ROWS + 1, 4), f32), np.zeros((4, 3), f32))


def test_a_model_takes_it_only_for_few_float32_rows():
    f32 = np.zeros((4, 4), np.float32)
    takes = few_rows_cpu.few_rows_kernel_takes
    served = gate.choice(few_rows_cpu.KERNEL)[0]  # this ISA's measured rows, or None
    for m in range(1, few_rows_cpu.KERNEL_ROWS + 2):
        assert takes(np.zeros((m, 4), np.float32), f32) == (served is not None and m in served), m
    assert served is None or few_rows_cpu.KERNEL_ROWS + 1 not in served  # more than the kernel takes: XLA's dot
    assert not takes(np.zeros((2, 4), np.float16), np.zeros((4, 4), np.float16))


def test_off_on_isas_it_was_not_measured_on():
    """It changes float32 rounding, so an ISA without a measurement keeps XLA's dot; where measured, the rows the
    table names (AVX2: 2-8, not 1, where XLA's dot was faster)."""
    for isa in ("avx512-vnni", "avx512", "neon-dotprod", "neon", "baseline"):
        if few_rows_cpu.KERNEL.target not in gate.MEASURED.get(isa, {}):
            assert gate.measured_choice(few_rows_cpu.KERNEL, isa)[0] is None
    assert gate.measured_choice(few_rows_cpu.KERNEL, "avx2")[0] == gate.Rows(2, 8)
    for isa, measured in gate.MEASURED.items():
        if few_rows_cpu.KERNEL.target in measured:
            rows = gate.measured_choice(few_rows_cpu.KERNEL, isa)[0]
            assert rows is None or rows.hi <= few_rows_cpu.KERNEL_ROWS, isa  # never more than the kernel takes
