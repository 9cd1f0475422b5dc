"""The aarch64 build of the C++ CPU kernels, on an x86 host: the whole library cross-compiles for ARMv8.2-A with the
dot-product extension (Debian's g++-aarch64-linux-gnu), and the W8A8 kernel -- its NEON sdot path and its portable
loop -- gives, under qemu-aarch64 (Debian's qemu-user), the same bits as the numpy model of the JAX W8A8 path that
test_int8_matmul_cpu.py checks the x86 builds against. No aarch64 jaxlib runs under emulation, so a small driver
(`int8_matmul_driver.cc`) calls the kernel without XLA's FFI; the same driver also runs natively here (no qemu), a
check of the driver itself. Skipped where the cross compiler or qemu is missing (.ci/run installs both)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import jax
import numpy as np
import pytest

from kernels_pallas.native import build
from tests.kernels_pallas.test_int8_matmul_cpu import w8a8_numpy

CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"  # Debian's aarch64 libraries, where qemu-aarch64 finds the loader
MARCH = "armv8.2-a+dotprod"
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "int8_matmul_driver.cc")
needs_cross = pytest.mark.skipif(shutil.which(CROSS) is None or shutil.which(QEMU) is None,
                                 reason=f"needs {CROSS} and {QEMU} (apt-get install g++-aarch64-linux-gnu qemu-user)")
# Rows on both sides of the row-streaming path (M <= 4) and around the NEON path's 6-row chunks; K not a multiple
# of 4; columns around its 16-column pieces. Small: qemu runs a few hundred times slower than the host.
SHAPES = [(1, 576, 96), (2, 6, 63), (3, 37, 17), (4, 9, 1), (5, 37, 16), (7, 64, 33), (13, 40, 130), (32, 64, 48)]


def compile_flags() -> list[str]:
    return [*build.FLAGS, "-pthread", "-I", jax.ffi.include_dir(), "-I", build.CSRC]


def write_cases(path: str) -> None:
    with open(path, "wb") as f:
        for m, k, n in SHAPES:
            rng = np.random.default_rng(m * 1000 + k + n)
            x = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.1, 10, (m, 1)).astype(np.float32)
            x[0, :] = 0  # an all-zero row
            x[-1, 0] = np.abs(x[-1]).max() * 2  # +127 and -127 after quantizing
            x[-1, -1] = -x[-1, 0]
            w = rng.integers(-128, 128, (k, n), dtype=np.int8)
            w[:, 0] = -128  # the extreme product, summed K times
            scale = rng.uniform(1e-3, 1e-1, n).astype(np.float32)
            f.write(np.array([m, k, n], np.int64).tobytes())
            for a in (x, w, scale, w8a8_numpy(x, w, scale).astype(np.float32)):
                f.write(np.ascontiguousarray(a).tobytes())


def run_driver(tmp_path, cxx: str, flags: list[str], runner: list[str]) -> str:
    cases, exe = str(tmp_path / "cases.bin"), str(tmp_path / f"driver-{len(os.listdir(tmp_path))}")
    if not os.path.exists(cases):
        write_cases(cases)
    shared = [f for f in compile_flags() if f not in ("-shared", "-fPIC")]
    compiled = subprocess.run([cxx, *shared, *flags, DRIVER, "-o", exe], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    ran = subprocess.run([*runner, exe, cases], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PAGEJAX_CPU_THREADS": "2"})
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert f"{len(SHAPES)} cases, 0 failed" in ran.stdout, ran.stdout
    return ran.stdout


@needs_cross
@pytest.mark.parametrize("portable", [False, True])
def test_aarch64_int8_matmul_matches_the_w8a8_model_under_qemu(tmp_path, portable):
    out = run_driver(tmp_path, CROSS, [f"-march={MARCH}", *(["-DPAGEJAX_PORTABLE"] if portable else [])],
                     [QEMU, "-L", SYSROOT])
    assert out.rstrip().endswith("isa portable" if portable else "isa neon-dotprod"), out


@needs_cross
def test_aarch64_library_compiles_and_uses_sdot(tmp_path):
    library = str(tmp_path / "libkernels.so")
    compiled = subprocess.run([CROSS, *compile_flags(), f"-march={MARCH}",
                               *sorted(glob.glob(os.path.join(build.CSRC, "*.cc"))), "-o", library],
                              capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    disassembly = subprocess.run(["aarch64-linux-gnu-objdump", "-d", library], capture_output=True, text=True).stdout
    assert "sdot" in disassembly


@pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None, reason="no C++ compiler")
def test_driver_natively(tmp_path):
    out = run_driver(tmp_path, os.environ.get("CXX") or "g++", ["-march=native"], [])
    assert "0 failed" in out
