"""Compile the C++ kernels in `csrc/` on first use and register their XLA FFI handlers for the CPU platform.

All sources are built into one library (so the kernels share one set of worker threads, `csrc/parallel_for.h`) with
the machine's compiler ($CXX, else g++; `-O3 -march=native`) into $PAGEJAX_KERNEL_DIR (default
~/.cache/pagejax/kernels), under a name keyed by a hash of the sources, flags, compiler version, jaxlib version and
the CPU's feature flags, so a rebuilt jaxlib, a new compiler or a
different machine sharing the home directory gets its own library, and a second process reuses the first one's.
The library is written to a temporary name and renamed, so concurrent builds (pytest-xdist, two engines) are safe.

Why build at run time rather than at install: the package stays pure Python (a plain `pip install -e .`), and
`-march=native` is only right on the machine that runs the code. Whether a call site takes a kernel (the target
backend, PAGEJAX_CPU_KERNELS, a failed build) is decided in `gate.py`; this module only compiles, loads and
registers, raising `KernelBuildError` when it cannot.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jaxlib

CSRC = os.path.join(os.path.dirname(__file__), "csrc")
# Reassociation lets g++ vectorize reductions; no -ffinite-math-only: masked attention scores are -inf.
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-w")


class KernelBuildError(RuntimeError):
    """A C++ kernel could not be compiled or loaded on this machine."""


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise KernelBuildError(f"no C++ compiler {cxx!r} on PATH; install g++ (or set $CXX), or pass "
                               "attn_impl='reference' / leave the pure-JAX paths in charge")
    return cxx


def build(defines: tuple[str, ...] = (), march: str = "native") -> str:
    """Compile `csrc/*.cc` into one library (once per content, flags, compiler, jaxlib and CPU); return its path.
    `defines` (e.g. ("PAGEJAX_PORTABLE",), how tests build the path without ISA extensions) become -D flags;
    `march` is the -march target ("native": this CPU; "x86-64-v3": the AVX2 build, which tests run on AVX-512
    machines too)."""
    flags = (*FLAGS, f"-march={march}", "-pthread", *(f"-D{d}" for d in defines))
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cc")))
    inputs = [*sources, *sorted(glob.glob(os.path.join(CSRC, "*.h")))]
    parts = [open(p, "rb").read() for p in inputs]
    key = hashlib.sha256(b"\0".join([*parts, " ".join(flags).encode(), version.encode(),
                                     jaxlib.__version__.encode(), _cpu_signature().encode()])).hexdigest()[:16]
    directory = os.environ.get("PAGEJAX_KERNEL_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagejax",
                                                                     "kernels")
    os.makedirs(directory, exist_ok=True)
    library = os.path.join(directory, f"pagejax_cpu_kernels-{key}.so")
    if os.path.exists(library):
        return library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    cmd = [cxx, *flags, "-I", jax.ffi.include_dir(), "-I", CSRC, *sources, "-o", tmp]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        os.unlink(tmp)
        raise KernelBuildError(f"compiling the CPU kernels failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}")
    os.replace(tmp, library)  # atomic: a concurrent process sees no library or the whole one
    return library


@functools.cache
def _load(defines: tuple[str, ...], march: str) -> ctypes.CDLL:
    return ctypes.CDLL(build(defines, march))


@functools.cache
def register(target: str, symbol: str, defines: tuple[str, ...] = (), march: str = "native") -> None:
    """Build the library, load it and register its handler `symbol` as FFI target `target` (once per process)."""
    try:
        handler = getattr(_load(defines, march), symbol)
    except (OSError, AttributeError) as e:
        raise KernelBuildError(f"loading {symbol} from the CPU kernel library failed: {e}") from e
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
