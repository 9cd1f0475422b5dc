"""Weight-only quantized matmul for grouped int8 / int4 weights on CPU: a C++ kernel (`csrc/grouped_matmul_cpu.cc`)
through XLA's FFI.

`models.quantization.formats.matmul(method="dequant")` is `x @ qw.dequantize()`: exact, but XLA:CPU writes a float32
copy of the weight on every call and reads it back, so a batch-1 step with SmolLM2's 4-bit (or GGUF Q4_1 / Q8_0)
weights was far slower than int8. The kernel computes the same product group by group from the codes (float32
activations, float32 accumulation; the order of additions differs from XLA's dot, so results agree to float
rounding, not bit for bit): AVX-512 intrinsics where the CPU has them, else (AVX2, NEON) one vector-extension
source. Built on first use by `native/build.py`; whether "dequant" takes it is `native.gate.runs_here(KERNEL, rows=M)`
(`models.quantization.formats.grouped_kernel_runs`), where measured faster (not on AVX2), up to 32 rows: beyond,
XLA's float32 dot of the dequantized weight is about as fast or faster for the layer linears (per-shape timings, the
LM head's included: BENCHMARKS.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.native import gate

KERNEL = gate.CpuKernel("pagejax_grouped_matmul_cpu", "PagejaxGroupedMatmulCpu", rows=gate.Rows(1, 32))


def grouped_matmul_cpu(x: jax.Array, q: jax.Array, scale: jax.Array, *, bits: int, group_size: int,
                       zero_point: jax.Array | None = None, offset: jax.Array | None = None,
                       build: str = "native") -> jax.Array:
    """float32 x [M, K] @ W -> float32 [M, N] for W given as `QuantizedWeight` fields: codes `q` (int8 [K, N] for
    8 bits; uint8 [K/2, N] for 4, two codes a byte as `quantization.pack_int4` packs them), `scale` [K/g, N] and
    at most one of `zero_point` (int8) / `offset` (float32) [K/g, N]. CPU only. `build` names the library build
    (`gate.BUILDS`: "native"; "portable", the scalar loop; "avx2", the vector-extension path an AVX-512 CPU does not
    run natively; tests compare them)."""
    if x.ndim != 2 or q.ndim != 2:
        raise ValueError(f"expected x [M, K] and codes [rows, N], got shapes {list(x.shape)} and {list(q.shape)}")
    m, k = x.shape
    rows = k // 2 if bits == 4 else k
    n = q.shape[1]
    groups = (k // group_size, n) if isinstance(group_size, (int, np.integer)) and group_size > 0 else None
    if (x.dtype != jnp.float32 or bits not in (4, 8) or groups is None or group_size % 2 or k % group_size
            or q.shape != (rows, n) or np.dtype(q.dtype) != np.dtype(jnp.uint8 if bits == 4 else jnp.int8)
            or scale.shape != groups or (zero_point is not None and offset is not None)
            or (zero_point is not None and (zero_point.shape != groups or zero_point.dtype != jnp.int8))
            or (offset is not None and offset.shape != groups)):
        raise ValueError(f"expected float32 x [M, K], {bits}-bit codes [{rows}, N], scales and at most one of int8 "
                         f"zero points / float offsets [K/{group_size}, N] (an even group size dividing K), got x "
                         f"{x.dtype}{list(x.shape)}, q {q.dtype}{list(q.shape)}, scale {list(scale.shape)}, "
                         f"zero_point {None if zero_point is None else list(zero_point.shape)}, offset "
                         f"{None if offset is None else list(offset.shape)}")
    kernel = KERNEL.build(build)
    gate.require(kernel)
    unused = jnp.zeros((1, 1), jnp.float32)
    zero = zero_point if zero_point is not None else jnp.zeros((1, 1), jnp.int8)
    off = offset.astype(jnp.float32) if offset is not None else unused
    call = jax.ffi.ffi_call(kernel.target, jax.ShapeDtypeStruct((m, n), jnp.float32), vmap_method="sequential")
    return call(x, q, scale.astype(jnp.float32), zero, off, bits=np.int64(bits), group_size=np.int64(group_size),
                has_zero=zero_point is not None, has_offset=offset is not None)
