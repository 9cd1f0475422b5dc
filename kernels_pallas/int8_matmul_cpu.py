"""int8 x int8 -> int32 matmul on CPU: a C++ kernel (`csrc/int8_matmul_cpu.cc`) through XLA's FFI.

The W8A8 path (`inference.quantization.matmul(method="int8")`) quantizes activations per row and multiplies int8 by
int8 into int32; XLA:CPU runs that dot through YNNPACK at 8-12 GB/s of weights for one or two rows, which makes
batch-1 int8 decode slower than the float32 GEMVs it should beat. This kernel returns the same exact int32 dot
(so results are bit-identical), reading each weight byte once for all rows. Built on first use by `cpu_build`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import cpu_build

KERNEL = ("pagejax_int8_matmul_cpu", "PagejaxInt8MatmulCpu")  # FFI target, C symbol


def available() -> bool:
    return cpu_build.unavailable_reason(*KERNEL) is None


def int8_matmul_cpu(x: jax.Array, w: jax.Array, *, portable: bool = False) -> jax.Array:
    """x int8 [M, K] @ w int8 [K, N] -> int32 [M, N], exact; CPU only. `portable` builds the path without AVX-512
    VNNI (what a CPU without it runs; tests compare both)."""
    if x.dtype != jnp.int8 or w.dtype != jnp.int8 or x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"expected int8 x [M, K] and int8 w [K, N], got {x.dtype}{list(x.shape)} and "
                         f"{w.dtype}{list(w.shape)}")
    target, symbol = KERNEL
    target += "_portable" if portable else ""
    cpu_build.register(target, symbol, ("PAGEJAX_PORTABLE",) if portable else ())
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.int32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x, w)
