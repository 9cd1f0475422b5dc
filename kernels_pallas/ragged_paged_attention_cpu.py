"""Ragged paged attention on CPU: a C++ kernel (`csrc/ragged_paged_attention_cpu.cc`) called through XLA's FFI.

XLA:CPU has no Pallas backend, and the pure-JAX reference pays for a gather of every padded page, K/V transposes and
tiny batched dots (97-107 ms of a 175-190 ms SmolLM2 step at batch 32, BENCHMARKS.md). The kernel reads each live
key and value row once, in place, so it is the CPU counterpart of the TPU/GPU kernels, with the reference's
signature and semantics (one difference: `mask_value` is accepted and unused, because masked keys get exactly zero
weight; the two agree whenever a query row sees at least one key, which the contract guarantees).

The library is compiled on first use with the machine's C++ compiler ($CXX, else g++; `-O3 -march=native`) into
$PAGEJAX_KERNEL_DIR (default ~/.cache/pagejax/kernels), keyed by a hash of the source, flags, compiler, jaxlib and
CPU, and reused after that. Without a working compiler `available()` is False and `impl="auto"` falls back to the
reference (dispatch.py logs why once); `impl="cpu"` raises with the compiler's message.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from kernels_pallas.ragged_paged_attention_ref import check_attention_inputs

log = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "ragged_paged_attention_cpu.cc")
TARGET = "pagejax_ragged_paged_attention_cpu"
SYMBOL = "PagejaxRaggedPagedAttentionCpu"
# Reassociation lets g++ vectorize the dot-product reductions; no -ffinite-math-only: masked scores are -inf.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-w")


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be compiled or loaded on this machine."""


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
                               "attn_impl='reference'")
    return cxx


def _build() -> str:
    """Compile the kernel (once per source/flags/compiler/jaxlib/CPU) and return the shared library's path."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(),
                                     jaxlib.__version__.encode(), _cpu_signature().encode()])).hexdigest()[:16]
    directory = os.environ.get("PAGEJAX_KERNEL_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagejax",
                                                                     "kernels")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"ragged_paged_attention_cpu-{key}.so")
    if os.path.exists(path):
        return path
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), SOURCE, "-o", tmp]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        os.unlink(tmp)
        raise KernelBuildError(f"compiling the CPU attention kernel failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}")
    os.replace(tmp, path)  # atomic: a concurrent process sees the old state or the whole library
    return path


@functools.cache
def _register() -> None:
    """Build, load and register the FFI target once per process; raises KernelBuildError if it cannot."""
    try:
        library = ctypes.CDLL(_build())
        handler = getattr(library, SYMBOL)
    except (OSError, AttributeError) as e:
        raise KernelBuildError(f"loading the CPU attention kernel failed: {e}") from e
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernel is built and registered, else why not (a compiler or loader message)."""
    try:
        _register()
    except KernelBuildError as e:
        return str(e)
    return None


def available() -> bool:
    return unavailable_reason() is None


def ragged_paged_attention_cpu(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * Hkv, D]; float32, bfloat16 or int8 (with kv_scales)
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    max_q_len: int | None = None,
    kv_scales: jax.Array | None = None,
) -> jax.Array:
    """The reference's contract (`ragged_paged_attention_reference`), computed by the C++ kernel. `max_q_len` and
    `mask_value` are accepted for signature parity; the kernel needs neither."""
    del mask_value, max_q_len
    check_attention_inputs(q, kv_pages, kv_scales, sliding_window)
    if kv_pages.dtype not in (jnp.float32, jnp.bfloat16, jnp.int8):
        raise ValueError(f"the CPU kernel reads float32, bfloat16 or int8 KV pages, not {kv_pages.dtype}; "
                         "use impl='reference'")
    if kv_pages.dtype == jnp.int8 and kv_scales is None:
        raise ValueError("an int8 KV cache needs kv_scales (see kv_cache.py)")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    _register()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    scales = kv_scales if kv_scales is not None else jnp.zeros((1, 1, 1), jnp.float32)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    out = call(q.astype(jnp.float32), kv_pages, i32(kv_lens), i32(page_indices), i32(cu_q_lens), i32(num_seqs),
               scales.astype(jnp.float32), sm_scale=np.float32(sm_scale),
               soft_cap=np.float32(0.0 if soft_cap is None else soft_cap),
               k_scale=np.float32(1.0 if k_scale is None else k_scale),
               v_scale=np.float32(1.0 if v_scale is None else v_scale),
               sliding_window=np.int64(0 if sliding_window is None else sliding_window))
    return out.astype(q.dtype)
