"""The float32 matmul of a few activation rows on CPU (batch-1 decode's linears and tied LM head): a C++ kernel
(`csrc/f32_gemv_cpu.cc`) through XLA's FFI.

Why: at one row a linear reads each weight once for 2 flops per 4 bytes, so it runs at the memory bandwidth it
reaches, and XLA:CPU runs a [1, K] x [K, N] dot on one thread. The kernel streams the weight in contiguous runs on
all cores, which pays where more cores read more bandwidth (`gate.MEASURED`, BENCHMARKS.md "C++ CPU kernels per
ISA"). Results agree with XLA's dot to
float32 rounding, not bit for bit (another order of additions). Not batch invariant: `LLM(batch_invariant=True)`
runs `invariant_cpu` instead. Whether a Linear takes it is `gemv_runs(rows)` (`native.gate.runs_here(KERNEL)` and at
most MAX_ROWS rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.native import gate

KERNEL = gate.CpuKernel("pagejax_f32_gemv_cpu", "PagejaxF32GemvCpu")
KERNEL_ROWS = 4  # what the kernel takes at most (csrc kMaxRows)
#: Up to this many rows the model's float32 linears take the kernel (where the gate lets it run); above, XLA's dot.
MAX_ROWS = 1


def gemv_runs(rows: int, w: jax.Array) -> bool:
    """Whether a float32 `x [rows, K] @ w` should run the kernel here: float32 weights, at most MAX_ROWS rows, and
    the gate (CPU target, built, measured faster on this ISA)."""
    return 1 <= rows <= MAX_ROWS and w.dtype == jnp.float32 and w.ndim == 2 and gate.runs_here(KERNEL)


def f32_gemv_cpu(x: jax.Array, w: jax.Array, *, transposed: bool = False, build: str = "native") -> jax.Array:
    """float32 x [..., K] (at most KERNEL_ROWS rows in all) @ w [K, N] (or @ w.T for w [N, K], `transposed`: a tied
    LM head) -> float32 [..., N]. CPU only. `build` names the library build (`gate.BUILDS`: "native", "portable" for
    the baseline ISA, or "avx2"; one vector source serves them all, tests compare them)."""
    k_w = (w.shape[1] if transposed else w.shape[0]) if w.ndim == 2 else None
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    if (x.dtype != jnp.float32 or w.dtype != jnp.float32 or x.ndim < 1 or x.shape[-1] != k_w
            or rows > KERNEL_ROWS):
        layout = "[N, K]" if transposed else "[K, N]"
        raise ValueError(f"f32_gemv_cpu takes float32 x [..., K] with at most {KERNEL_ROWS} rows and float32 w "
                         f"{layout}, got x {x.dtype}{list(x.shape)} and w {w.dtype}{list(w.shape)}; use XLA's dot "
                         "(x @ w) for more rows or other dtypes")
    kernel = KERNEL.build(build)
    gate.require(kernel)
    n = w.shape[0] if transposed else w.shape[1]
    out = jax.ShapeDtypeStruct((rows, n), jnp.float32)
    y = jax.ffi.ffi_call(kernel.target, out, vmap_method="sequential")(x.reshape(rows, x.shape[-1]), w,
                                                                      transposed=transposed)
    return y.reshape(*x.shape[:-1], n)


__all__ = ["KERNEL", "KERNEL_ROWS", "MAX_ROWS", "f32_gemv_cpu", "gemv_runs"]
