"""The MLA latent cache's shape at rest, per backend.

A latent row is `Dl + Dr` wide (576 for DeepSeek-V2), not a multiple of TPU's 128 lanes. For a
`[num_pages, page_size, Dl + Dr]` array XLA:TPU's default layout is the one that pads least: rows minor
(576 -> 640 lanes, 11%) while the page count pads more than that, else pages minor (e.g. 8193 -> 8320, 1.5%). A
pages-minor cache has to be transposed before any page can be read or written, so past a few thousand pages every
layer's whole cache was copied in and out of every step (docs/accelerators.md). On TPU the cache is therefore kept
as `[num_pages, page_size * (Dl + Dr)]`, one flat page per row: `page_size * 576` is a multiple of 128 for any even
page size, so rows-minor pads nothing and stays the default at every page count. CPU and GPU keep
`[num_pages, page_size, Dl + Dr]` (their layouts are row-major whatever the shape). The MLA kernels, `write_latent`
and `ModelConfig.kv_cache_page_size` take either form.
"""

from __future__ import annotations

from kernels_pallas.backend import target_backend


def latent_cache_shape(num_pages: int, page_size: int, width: int) -> tuple[int, ...]:
    """The latent cache's shape for the backend being compiled for: flat pages on TPU (module docstring)."""
    if target_backend() == "tpu":
        return (num_pages, page_size * width)
    return (num_pages, page_size, width)


def latent_page_size(shape: tuple[int, ...], width: int) -> int:
    """Tokens per page of a latent cache of `shape` (either form) whose rows are `width` wide."""
    if len(shape) == 3 and shape[-1] == width:
        return shape[1]
    if len(shape) == 2 and shape[-1] % width == 0:
        return shape[-1] // width
    raise ValueError(f"latent_pages {tuple(shape)} must be [num_pages, page_size, {width}] or "
                     f"[num_pages, page_size * {width}]")
