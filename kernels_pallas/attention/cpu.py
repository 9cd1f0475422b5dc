"""Ragged paged attention on CPU: a C++ kernel (`csrc/ragged_paged_attention_cpu.cc`) called through XLA's FFI.

XLA:CPU has no Pallas backend, and the pure-JAX reference pays for a gather of every padded page, K/V transposes and
tiny batched dots (over half of a batch-32 SmolLM2 step: BENCHMARKS.md). The kernel reads each live
key and value row once, in place, so it is the CPU counterpart of the TPU/GPU kernels, with the reference's
signature and semantics (one difference: `mask_value` is accepted and unused, because masked keys get exactly zero
weight; the two agree whenever a query row sees at least one key, which the contract guarantees). The cache is in
`kv_cache/layout.py`'s layout (`[Hkv, num_pages, page_size, 2 * D]`, int8 or fp8 (float8_e4m3fn) scales
`[Hkv, scale_rows, 128]`; fp8 codes are decoded exactly in the inner loop, `csrc/fp8_e4m3.h`); the kernel
reads only keys some query sees, so stale or non-finite data in any other slot (past kv_len, before the sliding
window, pages behind padding entries of page_indices, the scales' padding) changes no output, as in the reference.

The library is compiled on first use by `native/build.py` (g++, cached under ~/.cache/pagejax/kernels). Whether
`impl="auto"` takes this kernel is `native.gate.runs_here(KERNEL)` (the reference runs where it cannot be built or
PAGEJAX_CPU_KERNELS=0, and the gate logs why once); `impl="cpu"` builds it regardless and raises `KernelBuildError`
with the compiler's message.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.attention.reference import check_attention_inputs
from kernels_pallas.kv_cache.layout import has_scales
from kernels_pallas.native import gate
from kernels_pallas.native.build import KernelBuildError  # noqa: F401  (re-exported: what impl="cpu" raises)

KV_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn)  # the cache dtypes the kernel reads
KERNEL = gate.CpuKernel("pagejax_ragged_paged_attention_cpu", "PagejaxRaggedPagedAttentionCpu")


def ragged_paged_attention_cpu(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [Hkv, num_pages, page_size, 2 * D] (kv_cache/layout.py); one of KV_DTYPES
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
    kv_scales: jax.Array | None = None,  # f32[Hkv, scale_rows, 128] for an int8 / fp8 cache (kv_cache/layout.py)
    build: str = "native",
) -> jax.Array:
    """The reference's contract (`ragged_paged_attention_reference`), computed by the C++ kernel. `max_q_len` and
    `mask_value` are accepted for signature parity; the kernel needs neither. `build` names the library build
    (`gate.BUILDS`; tests compare the "portable" scalar loops with the vector paths)."""
    del mask_value, max_q_len
    check_attention_inputs(q, kv_pages, kv_scales, sliding_window)
    if kv_pages.dtype not in KV_DTYPES:
        raise ValueError(f"the CPU kernel reads float32, bfloat16, int8 or float8_e4m3fn KV pages, not "
                         f"{kv_pages.dtype}; use impl='reference'")
    if has_scales(kv_pages.dtype) and kv_scales is None:
        raise ValueError(f"a {kv_pages.dtype} KV cache needs kv_scales (see kv_cache.layout.kv_cache_spec and "
                         "kv_cache.writes.quantize_cache)")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    kernel = KERNEL.build(build)
    gate.require(kernel)
    call = jax.ffi.ffi_call(kernel.target, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    scales = kv_scales if kv_scales is not None else jnp.zeros((1, 1, 1), jnp.float32)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    out = call(q.astype(jnp.float32), kv_pages, i32(kv_lens), i32(page_indices), i32(cu_q_lens), i32(num_seqs),
               scales.astype(jnp.float32), sm_scale=np.float32(sm_scale),
               soft_cap=np.float32(0.0 if soft_cap is None else soft_cap),
               k_scale=np.float32(1.0 if k_scale is None else k_scale),
               v_scale=np.float32(1.0 if v_scale is None else v_scale),
               sliding_window=np.int64(0 if sliding_window is None else sliding_window))
    return out.astype(q.dtype)
