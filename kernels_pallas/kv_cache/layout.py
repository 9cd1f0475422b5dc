"""The paged KV cache's layout: the one place that spells it. Every impl (reference, cpu, tpu, gpu), the cache
writes, the model, the runner, the cost model and the tools build caches through `kv_cache_spec` and read them
through the helpers here, so a cache written by one impl is read by all.

One caching layer's cache is `[num_kv_heads, num_pages, page_size, 2 * head_dim]`: head-major pages, each token's
K in lanes `[0, D)` and its V in lanes `[D, 2D)` of one row. Why this layout (measured with the real Mosaic
compiler, deviceless, `scripts/tools/aot_compile.py`):
  * The KV head is the leading axis, never one of the two tiled (last) axes. Mosaic tiles the last two axes of
    every HBM array ((8, 128) words; bf16 and int8 pack 2 and 4 rows per word), and a DMA may only start a tiled
    axis at a tile boundary; the old `[pages, page_size, 2 * Hkv, D]` layout put the head on the second-minor
    axis, so slicing one head of a bf16 or int8 cache did not compile.
  * K and V share a row, so the minor axis is `2 * D`: 128 lanes for head_dim 64, where a `[..., 64]` array would
    be half padding on TPU and XLA chose to lay it out pages-fastest and copy the whole cache around every kernel
    call. head_dim 128 and 256 give 256 and 512 lanes; K and V start on lane-tile boundaries.
  * One (head, page) is one contiguous `[page_size, 2 * D]` block: one DMA per page on TPU/GPU, one contiguous
    read on CPU. Tensor parallelism splits axis 0, whole KV heads per device.

An int8 or fp8 cache (`dtype=int8` or `float8_e4m3fn`: `SCALED_DTYPES`) also has per-token float32 scales (see `writes.py` for the quantization):
`[num_kv_heads, scale_rows, 128]`, where head h's scales flattened are, page after page, the page's `page_size`
K scales then its `page_size` V scales (`scale_rows`: ceil(num_pages * 2 * page_size / 128) rounded up to 8;
the tail is padding). Why not `[..., page_size, 2]`: a minor axis of 2 (or of page_size) is 64x (or 8x) padding
on TPU, and XLA picked a pages-fastest layout that Mosaic cannot read; lane-dense 128-wide rows cost at most 8
padded rows per head. A page's scales start at lane `(page * 2 * page_size) % 128` of row `page * 2 * page_size // 128`.

MLA's latent cache (`mla/reference.py`) has no head axis and keeps `[num_pages, page_size, width]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SCALE_LANES = 128  # the width of an int8 / fp8 cache's scale rows (one TPU lane tile of float32)
#: Cache dtypes stored as codes with per-token-per-head scales (writes.py): int8 and float8_e4m3fn.
SCALED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def has_scales(dtype) -> bool:
    """Whether a cache of `dtype` keeps per-token scales beside its pages (int8, fp8)."""
    return jnp.dtype(dtype) in SCALED_DTYPES


def scale_rows(num_pages: int, page_size: int) -> int:
    """Rows of 128 scales per KV head that hold `num_pages` pages' K and V scales, rounded up to a multiple of 8
    (one float32 sublane tile: a ragged row count made XLA lay the array out differently and copy it)."""
    rows = -(-num_pages * 2 * page_size // SCALE_LANES)
    return -(-rows // 8) * 8


def kv_cache_spec(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32):
    """The `ShapeDtypeStruct` of one layer's paged KV cache, or `(cache, scales)` for an int8 or fp8 cache."""
    if min(num_pages, page_size, num_kv_heads, head_dim) < 1:
        raise ValueError(f"every KV cache dimension must be >= 1, got num_pages={num_pages}, page_size={page_size}, "
                         f"num_kv_heads={num_kv_heads}, head_dim={head_dim}")
    dtype = jnp.dtype(dtype)
    cache = jax.ShapeDtypeStruct((num_kv_heads, num_pages, page_size, 2 * head_dim), dtype)
    if not has_scales(dtype):
        return cache
    return cache, jax.ShapeDtypeStruct((num_kv_heads, scale_rows(num_pages, page_size), SCALE_LANES), jnp.float32)


def cache_dims(kv_pages: jax.Array) -> tuple[int, int, int, int]:
    """(num_kv_heads, num_pages, page_size, head_dim) of a cache in this layout."""
    if kv_pages.ndim != 4 or kv_pages.shape[3] % 2:
        raise ValueError(f"KV cache shape {kv_pages.shape} is not [num_kv_heads, num_pages, page_size, 2 * head_dim] "
                         "(build caches with kernels_pallas.kv_cache_spec)")
    num_kv_heads, num_pages, page_size, width = kv_pages.shape
    return num_kv_heads, num_pages, page_size, width // 2


def check_kv_scales(kv_pages: jax.Array, kv_scales: jax.Array | None) -> None:
    """Shared validation of an int8 / fp8 cache's scales (every impl calls it)."""
    if kv_scales is None:
        return
    num_kv_heads, num_pages, page_size, _ = cache_dims(kv_pages)
    want = (num_kv_heads, scale_rows(num_pages, page_size), SCALE_LANES)
    if tuple(kv_scales.shape) != want:
        raise ValueError(f"kv_scales shape {kv_scales.shape} must be {want} for a cache of shape {kv_pages.shape} "
                         "(build caches with kernels_pallas.kv_cache_spec)")
    if not has_scales(kv_pages.dtype):
        raise ValueError(f"kv_scales given with {kv_pages.dtype} kv_pages; per-token scales are for an int8 or "
                         "float8_e4m3fn cache")


def scales_by_page(kv_scales: jax.Array, num_pages: int, page_size: int) -> jax.Array:
    """The scales as `[num_kv_heads, num_pages, 2, page_size]` (K scales, then V scales, of each page's tokens)."""
    num_kv_heads = kv_scales.shape[0]
    flat = kv_scales.reshape(num_kv_heads, -1)[:, :num_pages * 2 * page_size]
    return flat.reshape(num_kv_heads, num_pages, 2, page_size)


def scales_from_pages(by_page: jax.Array) -> jax.Array:
    """Inverse of `scales_by_page`: `[Hkv, num_pages, 2, page_size]` -> the stored `[Hkv, scale_rows, 128]`."""
    num_kv_heads, num_pages, _, page_size = by_page.shape
    flat = by_page.reshape(num_kv_heads, -1)
    pad = scale_rows(num_pages, page_size) * SCALE_LANES - flat.shape[1]
    return jnp.pad(flat, ((0, 0), (0, pad))).reshape(num_kv_heads, -1, SCALE_LANES)


def pack_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """New tokens' K and V `[T, Hkv, D]` -> their cache rows `[T, Hkv, 2D]` (K lanes first)."""
    return jnp.concatenate([k, v], axis=-1)


def split_kv(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Cache rows `[..., 2D]` -> (K `[..., D]`, V `[..., D]`)."""
    head_dim = rows.shape[-1] // 2
    return rows[..., :head_dim], rows[..., head_dim:]
