"""Ragged paged MLA attention as a Pallas GPU kernel (Triton lowering): the GQA kernel with two score parts.

MLA in latent space is multi-query attention with one shared "KV head" whose key is the whole latent row
`[c | k_rope]` and whose value is `c` (see `mla/reference.py`). `attention/gpu.py: paged_flash_attention`
already takes its score as a sum of per-part dots, so this wrapper passes two parts, `(q_latent, c)` and
`(q_rope, k_rope)`, and says the value is key part 0: each page block of latent rows is loaded once and used for
both the scores and `p @ c`, which is MLA's bandwidth saving (576 values per token instead of 2 * H * D). The
two parts stay separate because Triton tiles must be powers of two and Dl + Dr = 576 is not; c and k_rope are two
BlockSpecs over the same `[num_pages, page_size, Dl + Dr]` pool (column blocks 0 and Dl / Dr), so nothing is
copied. All H query heads form the rows of one tile (H=16 for DeepSeek-V2-Lite: one decode token fills the 16 rows).
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl

from kernels_pallas.kv_cache.latent_layout import latent_page_size
from kernels_pallas.mla.reference import check_mla_shapes
from kernels_pallas.attention.gpu import paged_flash_attention


def ragged_paged_mla_attention_gpu(
    q_latent: jax.Array,  # [T, H, Dl]
    q_rope: jax.Array,  # [T, H, Dr]
    latent_pages: jax.Array,  # [num_pages, page_size, Dl + Dr] (or flat pages: kv_cache/latent_layout.py)
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = None,
    max_q_len: int | None = None,
    interpret: bool = False,
    num_kv_splits: int | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """Same contract as `ragged_paged_mla_attention_reference`; Dl and Dr must be powers of two with Dr <= Dl.
    The keyword tuning knobs mean what they mean for `ragged_paged_attention_gpu` (None: its `gpu_tuning` entry; for
    DeepSeek-V2-Lite shapes in bf16 that is 8 warps: 195 / 211 registers for decode / prefill on sm_90a, no
    spills, where the former fixed 4 warps took 250 / 255 and spilled in prefill)."""
    latent_dim, rope_dim = check_mla_shapes(q_latent, q_rope, latent_pages)
    if rope_dim > latent_dim:
        raise ValueError(f"the GPU MLA kernel needs Dr <= Dl (k_rope is read as column block Dl / Dr), got "
                         f"Dl={latent_dim}, Dr={rope_dim}")
    page_size = latent_page_size(latent_pages.shape, latent_dim + rope_dim)
    num_pages = latent_pages.shape[0]
    latent_pages = latent_pages.reshape(num_pages, page_size, latent_dim + rope_dim)  # row-major on GPU: free
    num_tokens, num_heads, _ = q_latent.shape
    c_spec = pl.BlockSpec((num_pages, page_size, latent_dim), lambda s, h, j: (0, 0, 0))
    rope_spec = pl.BlockSpec((num_pages, page_size, rope_dim), lambda s, h, j: (0, 0, latent_dim // rope_dim))
    parts = [x.reshape(num_tokens, 1, num_heads, x.shape[-1]) for x in (q_latent, q_rope.astype(q_latent.dtype))]
    return paged_flash_attention(
        parts, [(latent_pages, c_spec), (latent_pages, rope_spec)], None, [], page_indices, kv_lens, cu_q_lens,
        num_seqs, page_size=page_size, value_dim=latent_dim, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, mask_value=mask_value, v_scale=None, max_q_len=max_q_len, interpret=interpret,
        num_kv_splits=num_kv_splits, block_q=block_q, pages_per_block=pages_per_block, num_warps=num_warps,
        num_stages=num_stages)
