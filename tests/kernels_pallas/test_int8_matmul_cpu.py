"""The C++ W8A8 matmul (XLA FFI) quantizes x's rows, takes the exact int32 dot and rescales: against a numpy model of
those steps, bit for bit, for each build this CPU runs (`BUILDS`: AMX, VNNI, AVX2, NEON dotprod, the scalar loop),
over row counts on both sides of its row-streaming path (M <= 4), around its 6-row chunks and its 16-row AMX tiles,
K not a multiple of 4, 16 or 64, column counts around its 64-column pieces and an N wide enough for its multi-strip
items; and the W8A8 matmul gives the same bits with the kernel as without."""

from __future__ import annotations

import ctypes
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.matmul import int8_cpu
from kernels_pallas.native import build, gate
from models.quantization import formats

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None,
                                reason="no C++ compiler: the W8A8 path uses XLA's dot (checked below where one is)")


# The builds this CPU can run: native (AMX tiles, AVX-512 VNNI, AVX2 or NEON dotprod where the CPU has it), the scalar
# loop, the AVX2 build wherever the CPU has AVX2 (so an AVX-512 machine tests the AVX2 path too), its AVX-VNNI variant
# wherever the CPU has AVX-VNNI, and the VNNI loops without the tiles on an AMX machine.
AVX_VNNI = gate.host_isa().startswith(("avx2", "avx512")) and "avx_vnni" in gate._cpu_flags()
BUILDS = ["native", "portable", *(["avx2"] if gate.host_isa().startswith(("avx2", "avx512")) else []),
          *(["avx_vnni"] if AVX_VNNI else []), *(["no_amx"] if gate.host_isa() == "avx512-amx" else [])]


def test_kernel_builds_where_a_compiler_is():
    assert gate.unavailable_reason(int8_cpu.KERNEL) is None


def w8a8_numpy(x: np.ndarray, w: np.ndarray, w_scale: np.ndarray) -> np.ndarray:
    """The W8A8 product in float32 numpy, in the operations XLA:CPU compiles formats._matmul_int8 to."""
    amax = np.abs(x).max(axis=1, keepdims=True)
    sx = np.where(amax > 0, amax * np.float32(1 / 127), np.float32(1)).astype(np.float32)
    xq = np.rint(x * (np.float32(1) / sx)).astype(np.int64)
    dot = (xq @ w.astype(np.int64)).astype(np.float32)  # exact: |dot| < 2**24 for these K
    return (dot * sx) * w_scale


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (2, 6, 63), (3, 37, 130), (4, 9, 1),  # row streaming (M <= 4)
                                   (5, 37, 64), (6, 64, 65), (7, 4, 1), (13, 40, 130), (32, 576, 200), (64, 3, 129),
                                   (60, 600, 70),  # M * K past the size quantized on the worker threads
                                   (9, 200, 8250),  # N wide enough for several strips an item (the LM head's)
                                   (17, 129, 70), (33, 1540, 130)])  # past a 16-row tile; K past 64-byte tiles
def test_matches_the_w8a8_model_bit_for_bit(build, m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.1, 10, (m, 1)).astype(np.float32)
    x[0, :] = 0  # an all-zero row: scale 1, not 0 / 0
    x[-1, 0] = np.abs(x[-1]).max() * 2  # +127 after quantizing...
    x[-1, -1] = -x[-1, 0]  # ... and -127
    w = rng.integers(-128, 128, (k, n), dtype=np.int8)
    w[:, 0] = -128  # the extreme product, summed K times
    w_scale = rng.uniform(1e-3, 1e-1, n).astype(np.float32)
    got = jax.jit(lambda a, b, c: int8_cpu.int8_matmul_cpu(a, b, c, build=build))(x, w, w_scale)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), w8a8_numpy(x, w, w_scale))


@pytest.mark.parametrize("build", BUILDS)
def test_empty_k_and_non_finite_rows(build):
    """K = 0 gives zeros; a row with a NaN or an inf gives garbage for that row only (as the JAX path does), without
    undefined behaviour in the kernel (NaN is quantized to 0): the other rows stay exact."""
    fn = jax.jit(lambda a, b, c: int8_cpu.int8_matmul_cpu(a, b, c, build=build))
    got = fn(np.zeros((3, 0), np.float32), np.zeros((0, 5), np.int8), np.ones(5, np.float32))
    np.testing.assert_array_equal(np.asarray(got), np.zeros((3, 5), np.float32))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 40)).astype(np.float32)
    x[1, 3], x[2, 7] = np.nan, np.inf
    w = rng.integers(-128, 128, (40, 70), dtype=np.int8)
    s = rng.uniform(1e-3, 1e-1, 70).astype(np.float32)
    got = np.asarray(fn(x, w, s))
    np.testing.assert_array_equal(got[[0, 3]], w8a8_numpy(x[[0, 3]], w, s))


def test_rejects_wrong_dtypes_and_shapes():
    f32, i8 = jnp.float32, jnp.int8
    with pytest.raises(ValueError, match="expected float32 x"):
        int8_cpu.int8_matmul_cpu(jnp.zeros((2, 4), i8), jnp.zeros((4, 3), i8), jnp.ones(3, f32))
    with pytest.raises(ValueError, match="expected float32 x"):
        int8_cpu.int8_matmul_cpu(jnp.zeros((2, 4), f32), jnp.zeros((5, 3), i8), jnp.ones(3, f32))
    with pytest.raises(ValueError, match="w_scale"):
        int8_cpu.int8_matmul_cpu(jnp.zeros((2, 4), f32), jnp.zeros((4, 3), i8), jnp.ones(4, f32))
    k = int8_cpu.MAX_K + 1  # int32 sums could overflow: the W8A8 matmul takes XLA's dot instead
    with pytest.raises(ValueError, match="K <= 65535"):
        int8_cpu.int8_matmul_cpu(jnp.zeros((1, k), f32), jnp.zeros((k, 1), i8), jnp.ones(1, f32))


@pytest.mark.parametrize("rows", [1, 3, 32, 100])
def test_w8a8_matmul_is_bit_identical_with_and_without_the_kernel(rows, monkeypatch):
    rng = np.random.default_rng(rows)
    qw = formats.quantize_int8(rng.standard_normal((96, 160)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.float32)
    by_default = jax.jit(lambda a: formats.matmul(a, qw, "int8")).lower(x).as_text()  # as gate.MEASURED says
    assert (int8_cpu.KERNEL.target in by_default) == gate.runs_here(int8_cpu.KERNEL, rows=rows)
    monkeypatch.setattr(gate, "runs_here", lambda kernel, rows=None: kernel == int8_cpu.KERNEL)
    with_kernel = jax.jit(lambda a: formats.matmul(a, qw, "int8"))
    assert int8_cpu.KERNEL.target in with_kernel.lower(x).as_text()
    got = with_kernel(x)
    monkeypatch.setattr(gate, "runs_here", lambda kernel, rows=None: False)  # as without a compiler
    without = jax.jit(lambda a: formats.matmul(a, qw, "int8"))
    assert int8_cpu.KERNEL.target not in without.lower(x).as_text()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(without(x)))


def test_concurrent_calls_share_the_workers_safely():
    """Kernels called from several threads at once (as XLA runs device shards): one job owns the worker threads,
    the others run on their calling thread; every result stays exact."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(11)
    cases = [(rng.standard_normal((m, 300)).astype(np.float32), rng.integers(-128, 128, (300, 700), dtype=np.int8),
              rng.uniform(1e-3, 1e-1, 700).astype(np.float32)) for m in (1, 3, 9, 32)]
    fn = jax.jit(int8_cpu.int8_matmul_cpu)

    def run(case):
        return all((np.asarray(fn(*case)) == w8a8_numpy(*case)).all() for _ in range(10))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, cases * 2))


@pytest.mark.parametrize("build_name", BUILDS)
def test_each_build_takes_the_int8_dot_its_target_promises(build_name):
    """The int8 dot each build compiled (`pagejax_int8_matmul_dot_isa`): the portable loop, AVX2's vpmaddubsw,
    AVX-VNNI's 256-bit vpdpbusd, or the native build's widest (here the CPU's)."""
    defines, march = gate._BUILD_FLAGS[build_name]
    library = ctypes.CDLL(build.build(defines, march))
    library.pagejax_int8_matmul_dot_isa.restype = ctypes.c_char_p
    isa = library.pagejax_int8_matmul_dot_isa().decode()
    native = {"avx512-amx": "avx512-vnni", "avx512-vnni": "avx512-vnni", "avx512": "avx2", "avx2": "avx2",
              "neon-dotprod": "neon-dotprod"}.get(gate.host_isa(), "portable")
    if native == "avx2" and "avx_vnni" in gate._cpu_flags():
        native = "avx-vnni"
    want = {"portable": "portable", "avx2": "avx2", "avx_vnni": "avx-vnni"}.get(build_name, native)
    assert isa == want


def test_the_many_row_loop_runs_on_amx_tiles_exactly_where_the_cpu_has_them():
    """The native build's AMX path (int8_amx.h) is compiled in and granted by the OS on an AMX CPU, and absent
    elsewhere; on an AMX CPU the no_amx build (elsewhere the same library as native, not built again) leaves it out."""
    native = ctypes.CDLL(build.build())
    native.pagejax_int8_matmul_amx.restype = ctypes.c_bool
    amx = gate.host_isa() == "avx512-amx"
    assert native.pagejax_int8_matmul_amx() == amx
    if amx:
        no_amx = ctypes.CDLL(build.build(("PAGEJAX_NO_AMX",)))
        no_amx.pagejax_int8_matmul_amx.restype = ctypes.c_bool
        assert not no_amx.pagejax_int8_matmul_amx()
