"""The aarch64 build of the C++ CPU kernels, on an x86 host: the whole library cross-compiles for ARMv8.2-A with the
dot-product extension (Debian's g++-aarch64-linux-gnu), and the W8A8 kernel -- its NEON sdot path and its portable
loop -- gives, under qemu-aarch64 (Debian's qemu-user), the same bits as the numpy model of the JAX W8A8 path that
test_int8_matmul_cpu.py checks the x86 builds against. No aarch64 jaxlib runs under emulation, so a small driver
(`int8_matmul_driver.cc`) calls the kernel without XLA's FFI; the same driver also runs natively here (no qemu), a
check of the driver itself. The attention kernel's NEON build (its 8-float vector passes) is checked the same way, by
`attention_driver.cc`, against the JAX reference's outputs. Skipped where the cross compiler or qemu is missing
(.ci/run installs both)."""

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
ATTENTION_DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_driver.cc")
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


# The attention driver's cases: (q_lens, kv_lens, cache dtype, sliding window, soft cap, head_dim), 6 query / 2 KV
# heads, pages of 8: decode rows, a prefill past the 8-token block, last 8-key groups of 1-7 keys; its 8-float vector
# passes at head_dim 64 and 128 (compiled for them) and 40 (known at run time), its loops at 36.
ATTENTION_CASES = [([1, 11, 3, 1], [26, 11, 40, 3], np.float32, None, None, 64),
                   ([1, 11, 3, 1], [26, 11, 40, 3], np.int8, None, None, 64),
                   ([2, 1, 9], [17, 33, 9], np.int8, 5, 3.0, 64),
                   ([1, 1], [61, 7], np.float32, 12, None, 64),
                   ([1, 11, 3], [26, 11, 40], np.int8, 7, None, 128),
                   ([1, 11, 3], [26, 11, 40], np.float32, None, 3.0, 40),
                   ([1, 11, 3], [26, 11, 40], np.int8, 5, None, 40),
                   ([1, 9], [20, 9], np.float32, None, None, 36)]


def write_attention_cases(path: str) -> None:
    import jax.numpy as jnp

    from kernels_pallas.attention.reference import ragged_paged_attention_reference
    from kernels_pallas.kv_cache.writes import quantize_cache
    from tests.kernels_pallas.test_ragged_paged_attention import make_case

    with open(path, "wb") as f:
        for i, (q_lens, kv_lens, dtype, window, cap, head_dim) in enumerate(ATTENTION_CASES):
            rng = np.random.default_rng(i)
            pages_per_seq = -(-max(kv_lens) // 8) + 1
            q, kv, lens, pages, cu, n = make_case(rng, q_lens, kv_lens, num_q_heads=6, num_kv_heads=2,
                                                  head_dim=head_dim, page_size=8, pages_per_seq=pages_per_seq,
                                                  num_pages=pages_per_seq * len(q_lens) + 1)
            scales = None
            if dtype == np.int8:
                kv, scales = (np.asarray(a) for a in quantize_cache(jnp.asarray(kv), jnp.int8))
            opts = dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap, k_scale=0.7 if cap else 1.0,
                        v_scale=1.3 if cap else 1.0)
            want = np.asarray(ragged_paged_attention_reference(
                *map(jnp.asarray, (q, kv, lens, pages, cu, n)),
                kv_scales=None if scales is None else jnp.asarray(scales), **opts), np.float32)
            stride = 0 if scales is None else scales.shape[1] * scales.shape[2]
            f.write(np.array([q.shape[0], 6, head_dim, 2, kv.shape[1], 8, len(q_lens), pages_per_seq, len(q_lens),
                              dtype == np.int8, stride, window or 0], np.int64).tobytes())
            f.write(np.array([opts["sm_scale"], cap or 0.0, opts["k_scale"], opts["v_scale"]], np.float32).tobytes())
            for a in (q, kv, *([] if scales is None else [scales.astype(np.float32)]), lens, pages, cu, want):
                f.write(np.ascontiguousarray(a).tobytes())


def run_driver(tmp_path, cxx: str, flags: list[str], runner: list[str], driver: str = DRIVER) -> str:
    """Compile `driver` with `cxx`, run it on its cases under `runner` (qemu, or nothing); its output."""
    attention = driver == ATTENTION_DRIVER
    cases = str(tmp_path / ("attention_cases.bin" if attention else "cases.bin"))
    exe = str(tmp_path / f"driver-{len(os.listdir(tmp_path))}")
    if not os.path.exists(cases):
        (write_attention_cases if attention else write_cases)(cases)
    shared = [f for f in compile_flags() if f not in ("-shared", "-fPIC")]
    compiled = subprocess.run([cxx, *shared, *flags, driver, "-o", exe], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    ran = subprocess.run([*runner, exe, cases], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PAGEJAX_CPU_THREADS": "2"})
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    count = len(ATTENTION_CASES) if attention else len(SHAPES)
    assert f"{count} cases, 0 failed" in ran.stdout, ran.stdout
    return ran.stdout


@needs_cross
@pytest.mark.parametrize("portable", [False, True])
def test_aarch64_int8_matmul_matches_the_w8a8_model_under_qemu(tmp_path, portable):
    out = run_driver(tmp_path, CROSS, [f"-march={MARCH}", *(["-DPAGEJAX_PORTABLE"] if portable else [])],
                     [QEMU, "-L", SYSROOT])
    assert out.rstrip().endswith("isa portable" if portable else "isa neon-dotprod"), out


@needs_cross
def test_aarch64_attention_matches_the_reference_under_qemu(tmp_path):
    """The attention kernel's NEON build (its 8-float vector passes: no AVX-512 path there; its loops at head_dim 36)
    against the JAX reference's outputs, float32 and int8 caches, a sliding window and a soft cap."""
    out = run_driver(tmp_path, CROSS, [f"-march={MARCH}"], [QEMU, "-L", SYSROOT], driver=ATTENTION_DRIVER)
    assert out.count(": ok (") == len(ATTENTION_CASES), out


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
@pytest.mark.parametrize("driver", [DRIVER, ATTENTION_DRIVER], ids=["int8_matmul", "attention"])
def test_driver_natively(tmp_path, driver):
    out = run_driver(tmp_path, os.environ.get("CXX") or "g++", ["-march=native"], [], driver=driver)
    assert "0 failed" in out
