"""The RoPE cos/sin tables on CPU: a C++ kernel (`csrc/rope_tables_cpu.cc`) through XLA's FFI.

`models.layers.rope_tables` computes cos and sin of positions x inverse frequencies; fused into the rotation,
XLA:CPU re-evaluated those transcendentals per head and output element. The kernel materializes the [T, D/2]
tables once, so the rotation reads them. Built on first use by `native/build.py`; whether `rope_tables` takes it
is `native.gate.runs_here(KERNEL)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.native import gate

KERNEL = gate.CpuKernel("pagejax_rope_tables_cpu", "PagejaxRopeTablesCpu")


def rope_tables_cpu(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin of positions[T] x inv_freq[D/2], float32 [T, D/2], computed by the C++ kernel. CPU only; raises
    `KernelBuildError` where the kernel cannot be built."""
    gate.require(KERNEL)
    table = jax.ShapeDtypeStruct((positions.shape[0], len(inv_freq)), jnp.float32)
    return jax.ffi.ffi_call(KERNEL.target, (table, table), vmap_method="sequential")(
        positions.astype(jnp.int32), jnp.asarray(inv_freq, jnp.float32))
