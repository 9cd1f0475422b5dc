"""The W8A8 matmul on CPU: a C++ kernel (`csrc/int8_matmul_cpu.cc`) through XLA's FFI.

The W8A8 path (`models.quantization.formats.matmul(method="int8")`) quantizes activations per row, multiplies int8 by
int8 into int32 and rescales; XLA:CPU runs that dot through YNNPACK slowly for one or two rows (BENCHMARKS.md),
which makes batch-1 int8 decode slower than the float32 GEMVs it should beat, and runs the quantizing and rescaling
as separate fusions around each dot. This kernel does all three with the JAX path's float operations in the same
order (the result is bit-identical), reading each weight byte once for all rows. Its int8 dots are vpdpbusd on
AVX-512 VNNI (AMX tiles for more than 4 rows where the CPU has AMX-INT8: `csrc/int8_amx.h`), vpmaddubsw + vpmaddwd
on AVX2 and sdot on ARMv8.2 dotprod (`csrc/int8_dot.h`), a scalar loop elsewhere. Built on first use by
`native/build.py`; whether the W8A8 path takes it is `native.gate.runs_here(KERNEL, rows=M)`: on this CPU's ISA, at
the rows it was measured faster at (every row count on AVX2, 1-8 on AVX-512 VNNI, 1-32 with AMX).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.native import gate

KERNEL = gate.CpuKernel("pagejax_int8_matmul_cpu", "PagejaxInt8MatmulCpu")
MAX_K = 65535  # input features at most: the kernel's int32 sums stay exact


def int8_matmul_cpu(x: jax.Array, w: jax.Array, w_scale: jax.Array, *, build: str = "native") -> jax.Array:
    """float32 x [M, K] @ (int8 w [K, N] * w_scale [N]) -> float32 [M, N], as W8A8: each row of x quantized to int8
    with scale max|x| / 127 (round half to even), the exact int32 dot, then (dot * x_scale) * w_scale. CPU only.
    `build` names the library build (`gate.BUILDS`: "native", the scalar "portable" loop, "avx2", "avx_vnni" or
    "no_amx"; tests compare them)."""
    if (x.dtype != jnp.float32 or w.dtype != jnp.int8 or x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]
            or w_scale.shape != (w.shape[1],) or x.shape[1] > MAX_K):
        raise ValueError(f"expected float32 x [M, K], int8 w [K, N] and w_scale [N] with K <= {MAX_K}, got "
                         f"{x.dtype}{list(x.shape)}, {w.dtype}{list(w.shape)} and {list(w_scale.shape)}")
    kernel = KERNEL.build(build)
    gate.require(kernel)
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(kernel.target, out, vmap_method="sequential")(x, w, w_scale.astype(jnp.float32))
