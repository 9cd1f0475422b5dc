"""Choose an attention implementation by name or by backend.

`impl="auto"` picks the kernel for the default backend: the Pallas Mosaic kernel on TPU, the Pallas Triton kernel
on GPU (unless page_size or head_dim is not a power of two, which Triton cannot tile), the C++ FFI kernel on CPU
(`attention/cpu.py`; the reference where it cannot be compiled), the pure-JAX reference on any other
backend. `impl="tpu"` / `impl="gpu"` force a kernel; off its hardware it only runs in interpret mode
(`interpret=pltpu.InterpretParams()` for TPU, `interpret=True` for GPU). `impl="cpu"` runs on CPU only.
Every implementation shares the reference's signature, including `kv_scales` for an int8 cache (see
`kv_cache/writes.py`).
"""

from __future__ import annotations

import functools
import logging

import jax

from kernels_pallas.attention import cpu as cpu_kernel
from kernels_pallas.backend import target_backend
from kernels_pallas.attention.reference import ragged_paged_attention_reference

IMPLEMENTATIONS = ("auto", "reference", "cpu", "tpu", "gpu")
log = logging.getLogger(__name__)


@functools.cache
def _cpu_kernel_or_reference() -> str:
    reason = cpu_kernel.unavailable_reason()
    if reason is not None:
        log.warning("CPU attention kernel unavailable, using the pure-JAX reference: %s", reason)
        return "reference"
    return "cpu"


def resolve_impl(impl: str, page_size: int, head_dim: int) -> str:
    """'auto' -> the implementation for the default backend (the reference where the GPU kernel cannot tile the
    shapes: page_size or head_dim not a power of two); other names are checked and returned."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLEMENTATIONS}")
    if impl != "auto":
        return impl
    backend = target_backend()
    if backend == "gpu":
        from kernels_pallas.attention.gpu import tiles_ok

        return "gpu" if tiles_ok(page_size, head_dim) else "reference"
    if backend == "cpu":
        return _cpu_kernel_or_reference()
    return "tpu" if backend == "tpu" else "reference"


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float = 1.0,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           k_scale: float | None = None, v_scale: float | None = None, impl: str = "auto",
                           interpret=False, max_q_len: int | None = None,
                           kv_scales: jax.Array | None = None) -> jax.Array:
    """See `ragged_paged_attention_reference` for the contract. `interpret` goes to the Pallas kernels only."""
    impl = resolve_impl(impl, kv_pages.shape[2], q.shape[-1])  # page_size (kv_cache/layout.py)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
              v_scale=v_scale, max_q_len=max_q_len, kv_scales=kv_scales)
    args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if impl == "tpu":
        from kernels_pallas.attention.tpu import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu(*args, interpret=interpret, **kw)
    if impl == "gpu":
        from kernels_pallas.attention.gpu import ragged_paged_attention_gpu

        return ragged_paged_attention_gpu(*args, interpret=interpret, **kw)
    if impl == "cpu":
        return cpu_kernel.ragged_paged_attention_cpu(*args, **kw)
    return ragged_paged_attention_reference(*args, **kw)
