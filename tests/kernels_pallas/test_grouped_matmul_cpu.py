"""The C++ grouped-weight matmul (XLA FFI) against `x @ qw.dequantize()`, for each build this CPU runs (AVX-512 or
the vector-extension path, the AVX2 build, the scalar loop): 8-bit groups (GGUF Q8_0), 4-bit with an integer zero point
(`quantize_int4`, GGUF Q4_0) and with a float minimum (the "int4" mode, GGUF Q4_1); row counts on both sides of its
2-row register blocks, column counts around its 16- and 64-column vectors and 1024-column items, K cut into several
parts; and where `matmul(method="dequant")` and `pick_method` send what."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.matmul import grouped_cpu
from kernels_pallas.native import gate
from models.quantization import formats, modes

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None,
                                reason="no C++ compiler: grouped weights use XLA's dot (checked below where one is)")

FORMS = {
    "int8-groups": lambda w, g: formats.quantize_int8(w, g),
    "int4-zero-point": lambda w, g: formats.quantize_int4(w, g),
    "int4-min": lambda w, g: modes.quantize_int4_minmax(w, g),
}


# The builds this CPU can run: native (AVX-512, or the vector-extension path on AVX2 / NEON), the scalar loop, and the
# AVX2 build wherever the CPU has AVX2 (so an AVX-512 machine tests the vector-extension path too).
BUILDS = ["native", "portable", *(["avx2"] if gate.host_isa().startswith(("avx2", "avx512")) else [])]


def run_kernel(x, qw, build="native"):
    fn = lambda a: grouped_cpu.grouped_matmul_cpu(  # noqa: E731
        a, jnp.asarray(qw.q), jnp.asarray(qw.scale), bits=qw.bits, group_size=qw.group_size,
        zero_point=None if qw.zero_point is None else jnp.asarray(qw.zero_point),
        offset=None if qw.offset is None else jnp.asarray(qw.offset), build=build)
    return np.asarray(jax.jit(fn)(x))


def test_kernel_builds_where_a_compiler_is():
    assert gate.unavailable_reason(grouped_cpu.KERNEL) is None


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("m,k,n,g", [(1, 576, 192, 32), (2, 64, 70, 32), (3, 128, 5, 64), (5, 256, 1100, 128),
                                     (1, 1536, 33, 32)])
def test_matches_the_dequantized_product(build, form, m, k, n, g):
    rng = np.random.default_rng(m * 100 + k + n)
    qw = FORMS[form](rng.standard_normal((k, n)).astype(np.float32), g)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = x.astype(np.float64) @ np.asarray(qw.dequantize(), np.float64)
    got = run_kernel(x, qw, build)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_rejects_inconsistent_inputs():
    qw = formats.quantize_int4(np.ones((64, 8), np.float32), 32)
    x = jnp.ones((1, 64), jnp.float32)
    call = grouped_cpu.grouped_matmul_cpu
    with pytest.raises(ValueError, match="expected float32 x"):
        call(x.astype(jnp.bfloat16), qw.q, qw.scale, bits=4, group_size=32, zero_point=qw.zero_point)
    with pytest.raises(ValueError, match="expected float32 x"):
        call(x, qw.q, qw.scale, bits=8, group_size=32)  # 4-bit codes called 8-bit
    with pytest.raises(ValueError, match="expected float32 x"):
        call(x, qw.q, qw.scale, bits=4, group_size=64)  # scales of 32-row groups
    with pytest.raises(ValueError, match="expected float32 x"):
        call(x, qw.q, qw.scale, bits=4, group_size=32, zero_point=qw.zero_point, offset=qw.scale)
    with pytest.raises(ValueError, match="expected float32 x"):
        call(x, qw.q, qw.scale, bits=4, group_size=32, zero_point=qw.zero_point.astype(jnp.int32))
    with pytest.raises(ValueError, match="expected x"):
        call(x[0], qw.q, qw.scale, bits=4, group_size=32)


@pytest.mark.parametrize("build", BUILDS)
def test_empty_k_gives_zeros(build):
    fn = jax.jit(lambda a, q, s: grouped_cpu.grouped_matmul_cpu(a, q, s, bits=8, group_size=32,
                                                                build=build))
    got = fn(np.zeros((2, 0), np.float32), np.zeros((0, 7), np.int8), np.zeros((0, 7), np.float32))
    np.testing.assert_array_equal(np.asarray(got), np.zeros((2, 7), np.float32))


def force_the_kernel_on(monkeypatch) -> None:
    """`gate.runs_here` takes the grouped kernel at the rows it serves (`KERNEL.rows`) whatever `gate.MEASURED` says
    of this CPU's ISA (AVX2: slower), and answers as before for the others."""
    runs_here = gate.runs_here

    def forced(kernel, rows=None):
        if kernel == grouped_cpu.KERNEL:
            return rows is None or rows in kernel.rows
        return runs_here(kernel, rows)
    monkeypatch.setattr(gate, "runs_here", forced)


@pytest.mark.parametrize("rows", [1, 32, 33])
def test_dequant_matmul_takes_the_kernel_up_to_its_row_limit(rows, monkeypatch):
    force_the_kernel_on(monkeypatch)  # the row limit, whatever gate.MEASURED says of this CPU's ISA
    rng = np.random.default_rng(rows)
    qw = modes.quantize_int4_minmax(rng.standard_normal((96, 80)).astype(np.float32), 32)
    x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.float32)
    fn = jax.jit(lambda a: formats.matmul(a, qw, "dequant"))
    assert (grouped_cpu.KERNEL.target in fn.lower(x).as_text()) == (rows in grouped_cpu.KERNEL.rows)
    np.testing.assert_allclose(np.asarray(fn(x)), np.asarray(x) @ np.asarray(qw.dequantize()), rtol=1e-5, atol=1e-4)


def test_dequant_of_a_weight_the_kernel_does_not_read_takes_xla():
    """Zero points stored wider than int8 are outside the kernel's contract: XLA's dot, the same product."""
    rng = np.random.default_rng(3)
    qw = formats.quantize_int4(rng.standard_normal((64, 20)).astype(np.float32), 32)
    qw = qw.replace(zero_point=jnp.asarray(qw.zero_point, jnp.int32))
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    fn = jax.jit(lambda a: formats.matmul(a, qw, "dequant"))
    assert grouped_cpu.KERNEL.target not in fn.lower(x).as_text()
    np.testing.assert_allclose(np.asarray(fn(x)), np.asarray(x) @ np.asarray(qw.dequantize()), rtol=1e-5, atol=1e-4)


def test_pick_method_keeps_a_large_grouped_matrix_on_the_kernel(monkeypatch):
    force_the_kernel_on(monkeypatch)  # where it runs (gate.MEASURED has it slower on AVX2: see the last lines)
    big = formats.QuantizedWeight(q=np.zeros((576, 49152), np.int8), scale=np.ones((18, 49152), np.float32),
                                  bits=8, group_size=32, shape=(576, 49152))
    assert modes.pick_method(big, 1) == "dequant"  # the kernel reads the codes in place
    assert modes.pick_method(big, 64) == "int8"  # XLA would write a float copy for "dequant"
    monkeypatch.setattr(modes, "grouped_kernel_runs", lambda rows: False)  # no compiler, or not on CPU
    assert modes.pick_method(big, 1) == "int8"
