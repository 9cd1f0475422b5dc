"""Choose an attention implementation by name or by backend.

`impl="auto"` picks the kernel for the default backend: the Pallas Mosaic kernel on TPU, the pure-JAX reference on
CPU (and any backend without a kernel yet). `impl="tpu"` forces the Mosaic kernel; off TPU it only runs with
`interpret=pltpu.InterpretParams()` (or `interpret=True`). Every implementation shares the reference's signature.
"""

from __future__ import annotations

import jax

from kernels_pallas.ragged_paged_attention_ref import ragged_paged_attention_reference

IMPLEMENTATIONS = ("auto", "reference", "tpu")


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float = 1.0,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           k_scale: float | None = None, v_scale: float | None = None, impl: str = "auto",
                           interpret=False, max_q_len: int | None = None) -> jax.Array:
    """See `ragged_paged_attention_reference` for the contract. `interpret` goes to the Pallas kernels only."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLEMENTATIONS}")
    if impl == "auto":
        impl = "tpu" if jax.default_backend() == "tpu" else "reference"
    if impl == "tpu":
        from kernels_pallas.ragged_paged_attention_tpu import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, max_q_len=max_q_len,
            interpret=interpret)
    return ragged_paged_attention_reference(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, max_q_len=max_q_len)
