"""Which MLA implementation runs: the Pallas GPU kernel on the gpu backend where its tiles fit, else the reference
(there is no TPU MLA kernel yet). Kept apart from the reference so that the reference imports no kernel."""

from __future__ import annotations

import jax

from kernels_pallas.attention.gpu import tiles_ok
from kernels_pallas.backend import target_backend
from kernels_pallas.mla.gpu import ragged_paged_mla_attention_gpu
from kernels_pallas.kv_cache.latent_layout import latent_page_size
from kernels_pallas.mla.reference import ragged_paged_mla_attention_reference

MLA_IMPLEMENTATIONS = ("auto", "reference", "gpu")


def resolve_mla_impl(impl: str, page_size: int, latent_dim: int, rope_dim: int) -> str:
    """'auto' -> "gpu" on the gpu backend when page_size, the latent width and the RoPE width are powers of two
    (Triton tiles) and the RoPE part is no wider than the latent, else "reference" (no TPU or CPU MLA kernel yet);
    other names are checked and returned. Needs no arrays, so the engine asks it with the config's sizes."""
    if impl not in MLA_IMPLEMENTATIONS:
        raise ValueError(f"unknown MLA attention impl {impl!r}; expected one of {MLA_IMPLEMENTATIONS}")
    if impl != "auto":
        return impl
    on_gpu = target_backend() == "gpu" and tiles_ok(page_size, latent_dim, rope_dim) and rope_dim <= latent_dim
    return "gpu" if on_gpu else "reference"


def ragged_paged_mla_attention(q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                               impl: str = "auto", interpret=False, max_q_len: int | None = None) -> jax.Array:
    """MLA over a paged latent cache (see the module docstring). `impl`: "reference", "gpu" (Pallas Triton; off
    GPU only with interpret=True) or "auto" (the GPU kernel on the gpu backend when the sizes are powers of two,
    else the reference: there is no TPU MLA kernel yet)."""
    page_size = latent_page_size(latent_pages.shape, q_latent.shape[-1] + q_rope.shape[-1])
    impl = resolve_mla_impl(impl, page_size, q_latent.shape[-1], q_rope.shape[-1])
    args = (q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, max_q_len=max_q_len)
    if impl == "gpu":
        return ragged_paged_mla_attention_gpu(*args, interpret=interpret, **kw)
    return ragged_paged_mla_attention_reference(*args, **kw)
