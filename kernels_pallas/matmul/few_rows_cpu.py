"""The float32 matmul of a few rows on CPU: a C++ kernel (`csrc/few_rows_matmul_cpu.cc`) through XLA's FFI.

At a few rows (a decode step at small batch) a float32 matmul is a stream of its weight from memory; XLA:CPU's dot
slows as rows are added long before the arithmetic should matter (BENCHMARKS.md, issue 38's round 6). The kernel
reads each weight once for all rows. Its sums are ordered differently from XLA's, so results agree to float32
rounding, not bitwise; batch-invariant mode keeps its own kernel (`invariant_cpu.py`). Whether a float32 `Linear` or
tied LM head takes it is `few_rows_kernel_takes`: CPU, float32, and the rows `native.gate.MEASURED` has it faster at
on this CPU's ISA (2-8 on AVX2, where XLA's dot of one row keeps batch-1 float32 decoding as it was; 1-4 on AVX-512
VNNI); off on an ISA where it was not measured.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.native import gate

KERNEL_ROWS = 16  # the most rows the kernel takes (csrc: kMaxRows)
KERNEL = gate.CpuKernel("pagejax_few_rows_matmul_cpu", "PagejaxFewRowsMatmulCpu", rows=gate.Rows(1, KERNEL_ROWS))


def few_rows_kernel_takes(x: jax.Array, w: jax.Array) -> bool:
    """Whether a model's x [M, K] @ w runs on the kernel: both float32, traced for a CPU where it runs at M rows."""
    return (x.ndim == 2 and x.dtype == jnp.float32 and w.dtype == jnp.float32
            and gate.runs_here(KERNEL, rows=x.shape[0]))


def few_rows_matmul_cpu(x: jax.Array, w: jax.Array, *, transposed: bool = False, build: str = "native") -> jax.Array:
    """float32 x [M, K] @ w [K, N] (or @ w.T for w [N, K] with `transposed`, a tied LM head) -> float32 [M, N], for
    M <= KERNEL_ROWS. CPU only. `build` names the library build (`gate.BUILDS`)."""
    k_w = w.shape[1] if transposed else w.shape[0] if w.ndim == 2 else None
    if (x.dtype != jnp.float32 or w.dtype != jnp.float32 or x.ndim != 2 or w.ndim != 2 or x.shape[1] != k_w
            or x.shape[0] > KERNEL_ROWS):
        layout = "[N, K]" if transposed else "[K, N]"
        raise ValueError(f"few_rows_matmul_cpu takes float32 x [M, K] with M <= {KERNEL_ROWS} and w {layout}, got "
                         f"{x.dtype}{list(x.shape)} and {w.dtype}{list(w.shape)}")
    kernel = KERNEL.build(build)
    gate.require(kernel)
    n = w.shape[0] if transposed else w.shape[1]
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(kernel.target, out, vmap_method="sequential")(x, w, transposed=transposed)
