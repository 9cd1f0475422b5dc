"""Choose an attention implementation by name or by backend.

`impl="auto"` picks the kernel for the target backend (`kernels_pallas.backend.target_backend`): the Pallas Mosaic
kernel on TPU, the Pallas Triton kernel on GPU (unless page_size or head_dim is not a power of two, which Triton cannot
tile), the C++ FFI kernel on CPU (`attention/cpu.py`, where `native.gate.runs_here` says it runs and it reads the cache
dtype, `cpu.KV_DTYPES`: else the reference, and the gate logs why), the pure-JAX reference on any other backend.
`resolve_impl` is that choice, and the only place it is made: the engine asks it too (whether decode reads padded
pages). `impl="tpu"` / `impl="gpu"` force a kernel; off its hardware it only runs in interpret mode
(`interpret=pltpu.InterpretParams()` for TPU, `interpret=True` for GPU). `impl="cpu"` runs on CPU only, and is not
switched off by PAGEJAX_CPU_KERNELS.

`impl="mosaic_gpu"` forces the Pallas Mosaic GPU kernel (`attention/mosaic_gpu.py`: Hopper only; bf16/f16 queries over a
cache of the same dtype or an int8 / fp8 cache with its scales; head_dim 64/128; no f32, which stays the Triton kernel's
IEEE path; `interpret=True` runs Mosaic GPU's CPU interpreter). "auto" does not pick it: on the one H200 run
(2026-12-04; figures in BENCHMARKS.md) the Triton kernel was faster in decode, with a bf16 and with an int8 cache. Once
`scripts/bench/kernel_bench.py` shows it ahead, "auto" routes to it on Hopper where `mosaic_gpu.supports(...)` holds
(bf16/f16, int8 and fp8 caches), and to the Triton kernel elsewhere (f32, other head dims). MLA's latent cache
(`mla/dispatch.py`) has no Mosaic GPU kernel yet: its score is two parts (latent 512 + rope 64 lanes) and its value is
the latent itself, so a 64-row f32 accumulator of 512 lanes (256 registers a thread) does not fit one warpgroup; it
needs the value split over warpgroups or over passes, to be designed after the GQA kernel's first timings. Every
implementation shares the reference's signature, including `kv_scales` for an int8 cache (see `kv_cache/writes.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.attention import cpu
from kernels_pallas.attention.reference import ragged_paged_attention_reference
from kernels_pallas.backend import target_backend
from kernels_pallas.native import gate

IMPLEMENTATIONS = ("auto", "reference", "cpu", "tpu", "gpu", "mosaic_gpu")


def resolve_impl(impl: str, page_size: int, head_dim: int, kv_dtype=None) -> str:
    """'auto' -> the implementation for the target backend, these shapes and the cache dtype `kv_dtype` (the
    module docstring: the reference where the GPU kernel cannot tile them, or the CPU kernel does not run or does
    not read `kv_dtype`, `cpu.KV_DTYPES`; None: a dtype every kernel reads); other names are checked and returned.
    Needs no arrays, so callers that only know the config (the engine) get the dispatcher's own answer."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLEMENTATIONS}")
    if impl != "auto":
        return impl
    backend = target_backend()
    if backend == "gpu":
        from kernels_pallas.attention.gpu import tiles_ok

        return "gpu" if tiles_ok(page_size, head_dim) else "reference"
    if backend == "cpu":
        reads = kv_dtype is None or jnp.dtype(kv_dtype) in map(jnp.dtype, cpu.KV_DTYPES)
        return "cpu" if reads and gate.runs_here(cpu.KERNEL) else "reference"
    return "tpu" if backend == "tpu" else "reference"


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float = 1.0,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           k_scale: float | None = None, v_scale: float | None = None, impl: str = "auto",
                           interpret=False, max_q_len: int | None = None,
                           kv_scales: jax.Array | None = None) -> jax.Array:
    """See `ragged_paged_attention_reference` for the contract. `interpret` goes to the Pallas kernels only."""
    impl = resolve_impl(impl, kv_pages.shape[2], q.shape[-1], kv_pages.dtype)  # page_size (kv_cache/layout.py)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
              v_scale=v_scale, max_q_len=max_q_len, kv_scales=kv_scales)
    args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if impl == "tpu":
        from kernels_pallas.attention.tpu import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu(*args, interpret=interpret, **kw)
    if impl == "gpu":
        from kernels_pallas.attention.gpu import ragged_paged_attention_gpu

        return ragged_paged_attention_gpu(*args, interpret=interpret, **kw)
    if impl == "mosaic_gpu":
        from kernels_pallas.attention.mosaic_gpu import ragged_paged_attention_mosaic_gpu

        return ragged_paged_attention_mosaic_gpu(*args, interpret=bool(interpret), **kw)
    if impl == "cpu":
        return cpu.ragged_paged_attention_cpu(*args, **kw)
    return ragged_paged_attention_reference(*args, **kw)
