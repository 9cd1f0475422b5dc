"""Writing new keys and values into the paged KV cache (layout: `layout.py`), optionally quantized to int8 on
write, and copying pages (copy-on-write).

A token's slot is `page * page_size + offset`; padding tokens carry a negative slot and leave the cache untouched,
so a padded batch never writes outside its own pages.

`write_rows` writes any cache array `[H, ...]`; the KV write, the int8 scales and the MLA latent write
(`write_latent`, below) all go through it, in the form each backend keeps in place:
  * CPU: a loop of `dynamic_update_slice`, not one scatter: on XLA CPU a scatter whose result is read again in the
    same computation (attention reads the pages right after the write) made XLA copy the whole cache, every
    layer, every step (BENCHMARKS_HISTORY.md); a while loop with a traced trip count updates in place, at a small cost
    per token (and the C++ kernel below does it with one memcpy per token and head).
  * TPU and GPU: scatters, one index per (head, token). The loop made XLA:TPU lay the cache out heads-minor and
    copy it whole around the attention kernel in every layer (deviceless compiles, `scripts/tools/aot_compile.py`).
Each update addresses the array in its own shape, so no reshape of a tiled TPU array (which would copy it) occurs.

int8 KV cache: per-token-per-head symmetric scales. With `kv_scales` the cache is int8 and each token's K and V
of each KV head get `scale = max|x| over D / 127` (float32, stored as `layout.py` says); the stored value is
`round(x / scale)` clipped to [-127, 127], and every attention impl dequantizes as `int8 * scale`. Why per token
and head rather than the static per-tensor `k_scale`/`v_scale` floats of the op's contract: a new token's range is
known when it is written, so no calibration pass is needed and one outlier token cannot flatten the resolution of
the rest of the cache. Byte cost per token and KV head: D int8 values plus one f32 scale for each of K and V,
i.e. `(D + 4) / (2 * D)` of a bf16 cache (0.516 at D=128, 0.531 at D=64). The static
`k_scale`/`v_scale` floats stay available and compose with the per-token scales (both multiply).

fp8 KV cache (float8_e4m3fn pages, vLLM's `kv_cache_dtype="fp8"`): the same per-token-per-head scales and layout,
`scale = max|x| / 448`, the stored value `x / scale` rounded to e4m3 (`quantize_kv`), read as `fp8 * scale`: every
reader's int8 dequantization (`pages.astype(f32) * scale`) reads it unchanged. MLA's latent cache has no scales: an
fp8 latent cache is a saturating cast (per-tensor scale 1, vLLM's default), in `write_latent`.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from kernels_pallas.backend import target_backend
from kernels_pallas.kv_cache.layout import (SCALE_LANES, cache_dims, check_kv_scales, pack_kv, scales_from_pages,
                                            split_kv)
from kernels_pallas.kv_cache.latent_layout import latent_page_size
from kernels_pallas.native import gate

INT8_MAX = 127.0
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
WRITE_KERNEL = gate.CpuKernel("pagejax_write_rows_cpu", "PagejaxWriteRowsCpu")  # csrc/write_rows_cpu.cc

Write = tuple[jax.Array, jax.Array]  # (rows [T, H, W], offsets i32[T]): see write_rows


def quantize_kv(x: jax.Array, dtype=jnp.int8) -> tuple[jax.Array, jax.Array]:
    """Symmetric over the last axis: x[..., D] -> (codes[..., D] of `dtype`, f32 scale[...]) with x ~= q * scale.
    int8: round to [-127, 127]; float8_e4m3fn: round to e4m3 in [-448, 448].

    Zero-safe: an all-zero row gets scale 0 and stores zeros (no division by zero, dequantizes to exactly 0).
    """
    fp8 = jnp.dtype(dtype) == jnp.float8_e4m3fn
    qmax = FP8_MAX if fp8 else INT8_MAX
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / qmax
    safe = jnp.where(scale > 0, scale, 1.0)
    y = jnp.clip(x / safe[..., None], -qmax, qmax)
    return (y if fp8 else jnp.round(y)).astype(dtype), scale


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`quantize_kv` to int8."""
    return quantize_kv(x, jnp.int8)


def to_cache_dtype(rows: jax.Array, dtype) -> jax.Array:
    """Rows cast to a cache's dtype; to float8_e4m3fn saturating (a plain cast makes |x| > 448 NaN)."""
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        rows = jnp.clip(rows.astype(jnp.float32), -FP8_MAX, FP8_MAX)
    return rows.astype(dtype)


def _block_start(offset: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """Element `offset` of one head's slab (`shape` = the array's shape past the head axis) as start indices."""
    idx = []
    for d in reversed(shape):
        idx.append(offset % d)
        offset = offset // d
    return (0, *reversed(idx))


def write_rows(arrays: Sequence[jax.Array], writes: Sequence[Sequence[Write]], *, sharded: bool = False):
    """Apply `writes[j]` to `arrays[j]` (`[H, ...]`) and return the new arrays.

    Each write is `(rows [T, H, W], offsets i32[T])`: token t's W elements of head h land at elements
    `[offsets[t], offsets[t] + W)` of head h's slab (the array past its head axis, row-major; a W-wide run never
    crosses the last axis). Offsets outside the slab (negative: padding) write nothing. On CPU one in-place
    fori_loop does every write, or the C++ kernel `csrc/write_rows_cpu.cc` where `native.gate.runs_here` says it
    runs, unless `sharded` (arrays partitioned by GSPMD over a mesh: XLA cannot partition a custom call); on TPU
    and GPU, scatters (module docstring).
    """
    if not sharded and gate.runs_here(WRITE_KERNEL):
        out = []
        for array, array_writes in zip(arrays, writes):
            for rows, offsets in array_writes:
                array = jax.ffi.ffi_call(WRITE_KERNEL.target, jax.ShapeDtypeStruct(array.shape, array.dtype),
                                         input_output_aliases={0: 0})(array, rows.astype(array.dtype),
                                                                      offsets.astype(jnp.int32))
            out.append(array)
        return tuple(out)
    if target_backend() != "cpu":
        return tuple(_scatter_rows(a, w) for a, w in zip(arrays, writes))
    count = writes[0][0][1].shape[0]
    # A traced trip count stops XLA from unrolling (and then copying) short loops.
    trip_count = jax.lax.optimization_barrier(jnp.int32(count))

    def write_one(i, arrs):
        out = []
        for arr, array_writes in zip(arrs, writes):
            for rows, offsets in array_writes:
                offset = offsets[i]
                heads, width = rows.shape[1:]
                inside = (offset >= 0) & (offset <= math.prod(arr.shape[1:]) - width)
                new = rows[i].astype(arr.dtype).reshape(heads, *(1,) * (arr.ndim - 2), width)
                start = _block_start(jnp.where(inside, offset, 0), arr.shape[1:])
                current = jax.lax.dynamic_slice(arr, start, new.shape)
                arr = jax.lax.dynamic_update_slice(arr, jnp.where(inside, new, current), start)
            out.append(arr)
        return tuple(out)

    return jax.lax.fori_loop(0, trip_count, write_one, tuple(arrays))


def _scatter_rows(array: jax.Array, writes: Sequence[Write]) -> jax.Array:
    """`write_rows` for one array as scatters (TPU, GPU): each write's runs fill the last axis whole (W = its
    size), tile it (its size a multiple of W, offsets multiples of W: a flat latent page) or are single elements
    (W = 1). Offsets outside the slab index past axis 1 and are dropped.

    One index per (head, token), so a scatter's window is at most the last axis: with a `[heads, W]` window
    XLA:TPU laid a prefill's cache out heads-minor and copied it whole before and after the scatter."""
    heads, slab = array.shape[0], math.prod(array.shape[1:])
    for rows, offsets in writes:
        count, width = rows.shape[0], rows.shape[2]
        inside = (offsets >= 0) & (offsets <= slab - width)
        idx = list(_block_start(jnp.where(inside, offsets, 0), array.shape[1:])[1:])
        idx[0] = jnp.where(inside, idx[0], array.shape[1])  # out of bounds: dropped
        head = jnp.repeat(jnp.arange(heads, dtype=jnp.int32), count)  # head-major, as `values`
        idx = [jnp.tile(i, heads) for i in idx]
        # The rows arrive computed: nothing that makes them (a projection XLA:GPU strength-reduced to a reduce,
        # RoPE, int8 quantization) may fuse into the scatter, whose threads each write one element and would each
        # redo that work (issue 33; `scripts/tools/hlo_checks.py` and tests/scripts/test_step_hlo.py check it).
        values = jax.lax.optimization_barrier(rows).astype(array.dtype).swapaxes(0, 1).reshape(heads * count, width)
        if width == array.shape[-1]:
            array = array.at[(head, *idx[:-1])].set(values, mode="drop")
        elif width == 1:
            array = array.at[(head, *idx)].set(values[:, 0], mode="drop")
        elif array.shape[-1] % width == 0:  # runs of a flat TPU latent page (kv_cache/latent_layout.py): a window of W
            dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,),
                                                   inserted_window_dims=tuple(range(array.ndim - 1)),
                                                   scatter_dims_to_operand_dims=tuple(range(array.ndim)))
            array = jax.lax.scatter(array, jnp.stack([head, *idx], axis=-1), values, dims,
                                    mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
        else:
            raise ValueError(f"rows of width {width} neither fill the last axis ({array.shape[-1]}), tile it nor are "
                             "single elements")
    return array


def _scale_offsets(slots: jax.Array, valid: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Where a token's K and V scales sit in its head's flattened scales (layout.py); -1 where not `valid`."""
    k = slots // page_size * 2 * page_size + slots % page_size
    return jnp.where(valid, k, -1), jnp.where(valid, k + page_size, -1)


def write_kv(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
             kv_scales: jax.Array | None = None, *, sharded: bool = False):
    """Write the new K/V `[T, Hkv, D]` of T tokens into their slots; slots < 0 are padding and are skipped.

    Without `kv_scales` returns the new `kv_pages`. With `kv_scales` (int8 or fp8 `kv_pages`, both from
    `layout.kv_cache_spec`) K and V are quantized per token and head on write and `(kv_pages, kv_scales)` is
    returned. `sharded`: the cache is partitioned over a mesh (see `write_rows`).
    """
    _, num_pages, page_size, head_dim = cache_dims(kv_pages)
    slots = slot_mapping.astype(jnp.int32)
    valid = (slots >= 0) & (slots < num_pages * page_size)  # padding (and anything past the pool) is skipped
    row_offsets = jnp.where(valid, slots * 2 * head_dim, -1)
    if kv_scales is None:
        (kv_pages,) = write_rows((kv_pages,), (((pack_kv(k, v), row_offsets),),), sharded=sharded)
        return kv_pages
    check_kv_scales(kv_pages, kv_scales)
    (kq, ks), (vq, vs) = quantize_kv(k, kv_pages.dtype), quantize_kv(v, kv_pages.dtype)
    k_at, v_at = _scale_offsets(slots, valid, page_size)
    return write_rows((kv_pages, kv_scales),
                      (((pack_kv(kq, vq), row_offsets),), ((ks[..., None], k_at), (vs[..., None], v_at))),
                      sharded=sharded)


def copy_pages(kv_pages: jax.Array, src: jax.Array, dst: jax.Array, kv_scales: jax.Array | None = None):
    """Copy whole pages src[i] -> dst[i] of every head in order (copy-on-write of shared pages); in place, as in
    `write_kv`. With `kv_scales` (int8 cache) the pages' scales are copied too and `(kv_pages, kv_scales)` is
    returned."""
    page_size = kv_pages.shape[2]
    # A page's 2 * page_size scales, in runs of `chunk` that each stay inside one 128-lane row.
    chunk = math.gcd(2 * page_size, SCALE_LANES)
    trip_count = jax.lax.optimization_barrier(jnp.int32(src.shape[0]))

    def copy_one(i, arrs):
        pages = jax.lax.dynamic_update_slice_in_dim(arrs[0], jax.lax.dynamic_slice_in_dim(arrs[0], src[i], 1, axis=1),
                                                    dst[i], axis=1)
        if kv_scales is None:
            return (pages,)
        scales = arrs[1]
        heads = scales.shape[0]
        for c in range(0, 2 * page_size, chunk):
            s_start = _block_start(src[i] * 2 * page_size + c, scales.shape[1:])
            d_start = _block_start(dst[i] * 2 * page_size + c, scales.shape[1:])
            scales = jax.lax.dynamic_update_slice(scales, jax.lax.dynamic_slice(scales, s_start, (heads, 1, chunk)),
                                                  d_start)
        return pages, scales

    out = jax.lax.fori_loop(0, trip_count, copy_one, (kv_pages,) if kv_scales is None else (kv_pages, kv_scales))
    return out[0] if kv_scales is None else out


def quantize_cache(kv_pages: jax.Array, dtype=jnp.int8) -> tuple[jax.Array, jax.Array]:
    """A float cache quantized whole, as `write_kv` would have stored its tokens: `(int8 or fp8 pages, scales)`
    (tests, benchmarks and tools that build a quantized cache from random data)."""
    (kq, ks), (vq, vs) = (quantize_kv(x, dtype) for x in split_kv(kv_pages))
    return pack_kv(kq, vq), scales_from_pages(jnp.stack([ks, vs], axis=2))


def copy_latent_pages(latent_pages: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """`copy_pages` for an MLA latent cache, whose pages are its leading axis in either form
    (`[num_pages, page_size, Dl + Dr]`, or flat `[num_pages, page_size * (Dl + Dr)]` on TPU: latent_layout.py);
    a per-head cache's pages are axis 1, so the two cannot share one copy."""
    trip_count = jax.lax.optimization_barrier(jnp.int32(src.shape[0]))

    def copy_one(i, pages):
        page = jax.lax.dynamic_slice_in_dim(pages, src[i], 1, axis=0)
        return jax.lax.dynamic_update_slice_in_dim(pages, page, dst[i], axis=0)

    return jax.lax.fori_loop(0, trip_count, copy_one, latent_pages)


def write_latent(latent_pages: jax.Array, latent: jax.Array, slot_mapping: jax.Array, *,
                 sharded: bool = False) -> jax.Array:
    """Write the new latent rows `[T, Dl + Dr]` of T tokens into their slots; slots < 0 are padding and skipped.
    `latent_pages` in either form of `kv_cache/latent_layout.py` (a slot's row is at `slot * (Dl + Dr)` of both).
    `sharded`: the pages are partitioned over a mesh (see `kv_cache.write_rows`)."""
    try:
        latent_page_size(latent_pages.shape, latent.shape[-1])
    except ValueError as e:
        raise ValueError(f"latent rows of width {latent.shape[-1]} do not fit: {e}") from None
    slots = slot_mapping.astype(jnp.int32)
    offsets = jnp.where(slots >= 0, slots * latent.shape[-1], -1)
    # The latent has no head axis: one "head" (a leading axis of 1 is free on every backend).
    rows = to_cache_dtype(latent[:, None], latent_pages.dtype)
    (latent_pages,) = write_rows((latent_pages[None],), (((rows, offsets),),), sharded=sharded)
    return latent_pages[0]
