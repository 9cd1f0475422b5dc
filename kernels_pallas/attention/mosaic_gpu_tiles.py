"""The Mosaic GPU attention kernel's wrapper-side bookkeeping, in plain XLA around the kernel (`mosaic_gpu.py`):
the tile grid's per-tile scalars, the sanitized page table, an int8 cache's scales gathered per sequence, the
tiles' row layout of q and the output, and the split-KV combine. Kept apart from the kernel so that each file
holds one concern: these are ordinary jnp functions of the ragged batch, with no Pallas in them.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.kv_cache.layout import scales_by_page

ROWS = 64  # query rows per tile: the M of one warpgroup MMA
NUM_INFO = 8  # int32 scalars per (split, tile): see `tile_info`


def clean_metadata(kv_lens, cu_q_lens, num_seqs):
    """The ragged metadata with every slot past `num_seqs` made empty: `kv_lens` 0 and `cu_q_lens` held at
    `cu_q_lens[num_seqs]`. Callers pad those slots as they like (the engine repeats the last offset, JAX's own RPA
    tests pad `cu_q_lens` with zeros); the tile bookkeeping below binary-searches `cu_q_lens`, which must then be
    non-decreasing over all slots, and a zero-padded one is not."""
    num_slots = kv_lens.shape[0]
    n = num_seqs[0]
    kv_lens = jnp.where(jnp.arange(num_slots) < n, kv_lens, 0)
    cu_q_lens = jnp.where(jnp.arange(num_slots + 1) <= n, cu_q_lens, cu_q_lens[n])
    return kv_lens, cu_q_lens


def default_block_kv(page_size: int) -> int:
    return max(64, page_size)


def default_kv_splits(num_programs: int, num_kv_blocks: int, target_programs: int = 512) -> int:
    """Enough splits for ~`target_programs` programs (about 4 per SM of a 132-SM H100/H200), a power of two, at most
    16 and at most the KV blocks of the longest sequence. Untuned (no GPU here)."""
    want = -(-target_programs // max(num_programs, 1))
    return max(1, min(16, 1 << max(0, want - 1).bit_length(), num_kv_blocks))


def tile_info(kv_lens, cu_q_lens, num_seqs, *, num_tokens, block_q, block_kv, num_tiles, num_splits,
              sliding_window):
    """int32 [splits, tiles, NUM_INFO]: (seq or -1, first packed token (for debugging; unused), first query
    position, kv_lo, kv_hi, first KV block, end KV block, tile) per KV split and tile; and each sequence's first
    tile."""
    max_seqs = kv_lens.shape[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    seq_valid = jnp.arange(max_seqs) < num_seqs[0]
    n_tiles = jnp.where(seq_valid, -(-q_lens // block_q), 0)
    tile_end = jnp.cumsum(n_tiles)
    tile_start = tile_end - n_tiles
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), max_seqs - 1).astype(jnp.int32)
    valid = t < tile_end[-1]
    tok0 = (t - tile_start[seq]) * block_q
    q_len, kv_len = q_lens[seq], kv_lens[seq]
    n_valid = jnp.minimum(block_q, q_len - tok0)
    first_pos = kv_len - q_len + tok0
    kv_hi = first_pos + n_valid
    kv_lo = jnp.zeros_like(kv_hi) if sliding_window is None else jnp.maximum(0, first_pos - sliding_window + 1)
    b_lo = kv_lo // block_kv
    b_hi = -(-kv_hi // block_kv)
    chunk = -(-(b_hi - b_lo) // num_splits)
    split = jnp.arange(num_splits, dtype=jnp.int32)[:, None]
    lo = jnp.minimum(b_lo[None] + split * chunk[None], b_hi[None])
    hi = jnp.minimum(lo + chunk[None], b_hi[None])
    fields = [jnp.where(valid, seq, -1), cu_q_lens[seq] + tok0, first_pos, kv_lo, kv_hi]
    fields = [jnp.broadcast_to(f[None], lo.shape) for f in fields]
    fields += [jnp.where(valid[None], lo, 0), jnp.where(valid[None], hi, 0), jnp.broadcast_to(t[None], lo.shape)]
    return jnp.stack(fields, axis=-1).astype(jnp.int32), tile_start


def sanitize_pages(page_indices, kv_lens, page_size, width):
    """Entries past each sequence's last page -> page 0 (never follow a garbage entry), padded to `width`."""
    max_seqs, pages_per_seq = page_indices.shape
    last = -(-kv_lens // page_size)
    col = jnp.arange(width)[None, :]
    padded = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, width - pages_per_seq)))
    return jnp.where(col < jnp.minimum(last, pages_per_seq)[:, None], padded, 0)


def scales_by_sequence(kv_scales, pages, num_pages, page_size):
    """An int8 cache's scales `[Hkv, scale_rows, 128]` -> `[Hkv, S, 2, W * page_size]`: each sequence's K scales
    (row 0) and V scales (row 1) token after token over its `W` (sanitized) page-table entries, so one TMA copy
    brings a KV block's scales as two contiguous rows. Why a gather here rather than one TMA per page in the
    kernel: a page's K scales are `page_size * 4` bytes (64 at page 16), below the 128-byte alignment a TMA's
    shared-memory destination needs, and the row-broadcast of the dequantization wants each block's scales as one
    contiguous vector. Its cost is 8 bytes per (token, KV head) gathered and re-read, 2 * D bytes being the int8
    cache's own (3% at D 128)."""
    by_page = scales_by_page(kv_scales.astype(jnp.float32), num_pages, page_size)  # [Hkv, P, 2, ps]
    num_kv_heads = by_page.shape[0]
    max_seqs, width = pages.shape
    seq = by_page[:, pages]  # [Hkv, S, W, 2, ps]
    return seq.transpose(0, 1, 3, 2, 4).reshape(num_kv_heads, max_seqs, 2, width * page_size)


def combine_splits(o, lse):
    """o f32 [K, ..., D] normalized per split, lse f32 [K, ...] -> the softmax over all splits."""
    top = jnp.max(lse, axis=0)
    w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0)[None]), 0.0)
    total = jnp.sum(w, axis=0)
    return jnp.sum(w[..., None] * o, axis=0) / jnp.where(total > 0, total, 1.0)[..., None]


def token_rows_of(cu_q_lens, num_seqs, tile_start, num_tokens, block_q, group):
    """int32 [T, group]: the tile rows of each token's query heads (token `within` of its sequence is row
    `(within % block_q) * group + g` of the sequence's tile `within // block_q`); tokens of no valid sequence
    get an out-of-range row (dropped by the scatter, clipped and zeroed by the gather)."""
    max_seqs = tile_start.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], t, side="right"), 0, max_seqs - 1)
    within = t - cu_q_lens[seq]
    row = (tile_start[seq] + within // block_q) * ROWS + (within % block_q) * group
    row = jnp.where(t < cu_q_lens[num_seqs[0]], row, jnp.iinfo(jnp.int32).max // 2)
    return row[:, None] + jnp.arange(group, dtype=jnp.int32)[None, :]
