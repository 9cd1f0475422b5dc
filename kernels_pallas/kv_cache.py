"""Writing new keys and values into the paged KV cache, optionally quantized to int8 on write.

The cache of one layer is `[num_pages, page_size, 2 * Hkv, D]` with K at even and V at odd head slots (the layout
of JAX's ragged paged attention op). A token's slot is `page * page_size + offset`; padding tokens carry a negative
slot and leave the cache untouched, so a padded batch never writes outside its own pages.

Why a loop of `dynamic_update_slice` and not one scatter: on XLA CPU a scatter whose result is read again in the
same computation (attention reads the pages right after the write) made XLA copy the whole cache, every layer,
every step (0.2 s per decode step for a 200 MB cache). A while loop with a traced trip count keeps the update in
place, at a few microseconds per token. `write_rows` is that loop for any page-shaped arrays; the KV write, the
int8 scales and the MLA latent write (`mla_attention_ref.write_latent`) all go through it.

int8 KV cache: per-token-per-head symmetric scales. When `kv_scales` is given, the cache is int8 and
`kv_scales[num_pages, page_size, 2 * Hkv]` (float32, the same slot layout as the pages: K scale at even, V scale at
odd head slots) holds, for each token and KV head, `scale = max|x| over D / 127`; the stored value is
`round(x / scale)` clipped to [-127, 127], and every attention impl dequantizes as `int8 * scale`. Why per token
and head rather than the static per-tensor `k_scale`/`v_scale` floats of the op's contract: a new token's range is
known when it is written, so no calibration pass is needed and one outlier token cannot flatten the resolution of
the rest of the cache. Byte cost per token and KV head: D int8 values plus one f32 scale for each of K and V,
i.e. `(D + 4) / (2 * D)` of a bf16 cache (0.516 at D=128, 0.531 at D=64). The static
`k_scale`/`v_scale` floats stay available and compose with the per-token scales (both multiply).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import cpu_build

INT8_MAX = 127.0
WRITE_KERNEL = ("pagejax_write_rows_cpu", "PagejaxWriteRowsCpu")  # FFI target, C symbol (csrc/write_rows_cpu.cc)


def _write_kernel_available() -> bool:
    """On CPU, where the C++ kernel builds (kernels_pallas.cpu_build), cache writes use it; registered on success."""
    return cpu_build.runs_here(*WRITE_KERNEL)


def interleave_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """[T, Hkv, ...] x2 -> [T, 2 * Hkv, ...] with K at even and V at odd slots."""
    num_tokens, num_kv_heads = k.shape[:2]
    return jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, *k.shape[2:])


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 over the last axis: x[..., D] -> (int8[..., D], f32 scale[...]) with x ~= q * scale.

    Zero-safe: an all-zero row gets scale 0 and stores zeros (no division by zero, dequantizes to exactly 0).
    """
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / INT8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x / safe[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def check_kv_scales(kv_pages: jax.Array, kv_scales: jax.Array | None) -> None:
    """Shared validation of the int8-cache scales (every impl calls it)."""
    if kv_scales is None:
        return
    if kv_scales.shape != kv_pages.shape[:3]:
        raise ValueError(f"kv_scales shape {kv_scales.shape} must be kv_pages.shape[:3] = {kv_pages.shape[:3]} "
                         "(one scale per token slot and combined KV head)")
    if kv_pages.dtype != jnp.int8:
        raise ValueError(f"kv_scales given with {kv_pages.dtype} kv_pages; per-token scales are for an int8 cache")


def write_rows(arrays: tuple[jax.Array, ...], rows: tuple[jax.Array, ...], slot_mapping: jax.Array, *,
               sharded: bool = False):
    """Write rows[j][i] into arrays[j] at slot slot_mapping[i] for every j; slots < 0 are padding and are skipped.

    Each array is `[num_pages, page_size, *rest]` and each rows entry `[T, *rest]` (cast to the array's dtype).
    One in-place fori_loop updates all arrays (see the module docstring for why not a scatter); on CPU the C++
    kernel `csrc/write_rows_cpu.cc` does the same with one memcpy per row, in place (~0.1 ms less per layer),
    unless `sharded` (arrays partitioned by GSPMD over a mesh: XLA cannot partition a custom call).
    """
    if not sharded and _write_kernel_available():
        slots = slot_mapping.astype(jnp.int32)
        return tuple(jax.ffi.ffi_call(WRITE_KERNEL[0], jax.ShapeDtypeStruct(a.shape, a.dtype),
                                      input_output_aliases={0: 0})(a, r.astype(a.dtype), slots)
                     for a, r in zip(arrays, rows))
    page_size = arrays[0].shape[1]
    new = tuple(r.astype(a.dtype)[:, None, None] for a, r in zip(arrays, rows))  # [T, 1, 1, *rest]
    # A traced trip count stops XLA from unrolling (and then copying) short loops.
    trip_count = jax.lax.optimization_barrier(jnp.int32(slot_mapping.shape[0]))

    def write_one(i, arrs):
        slot = slot_mapping[i]
        page, offset = jnp.maximum(slot, 0) // page_size, jnp.maximum(slot, 0) % page_size
        out = []
        for arr, n in zip(arrs, new):
            start = (page, offset) + (0,) * (arr.ndim - 2)
            current = jax.lax.dynamic_slice(arr, start, n.shape[1:])
            out.append(jax.lax.dynamic_update_slice(arr, jnp.where(slot >= 0, n[i], current), start))
        return tuple(out)

    return jax.lax.fori_loop(0, trip_count, write_one, tuple(arrays))


def write_kv(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
             kv_scales: jax.Array | None = None, *, sharded: bool = False):
    """Write the new K/V `[T, Hkv, D]` of T tokens into their slots; slots < 0 are padding and are skipped.

    Without `kv_scales` returns the new `kv_pages`. With `kv_scales` (`[num_pages, page_size, 2 * Hkv]` f32, int8
    `kv_pages`) K and V are quantized per token and head on write and `(kv_pages, kv_scales)` is returned.
    `sharded`: the cache is partitioned over a mesh (see `write_rows`).
    """
    if kv_scales is None:
        (kv_pages,) = write_rows((kv_pages,), (interleave_kv(k, v),), slot_mapping, sharded=sharded)
        return kv_pages
    check_kv_scales(kv_pages, kv_scales)
    (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    return write_rows((kv_pages, kv_scales), (interleave_kv(kq, vq), interleave_kv(ks, vs)), slot_mapping,
                      sharded=sharded)


def copy_pages(kv_pages: jax.Array, src: jax.Array, dst: jax.Array, kv_scales: jax.Array | None = None):
    """Copy whole pages src[i] -> dst[i] in order (copy-on-write of shared pages); in place, as in `write_kv`.

    With `kv_scales` (int8 cache) the scales' pages are copied too and `(kv_pages, kv_scales)` is returned.
    """
    arrays = (kv_pages,) if kv_scales is None else (kv_pages, kv_scales)
    trip_count = jax.lax.optimization_barrier(jnp.int32(src.shape[0]))

    def copy_one(i, arrs):
        return tuple(jax.lax.dynamic_update_slice_in_dim(a, jax.lax.dynamic_slice_in_dim(a, src[i], 1, axis=0),
                                                         dst[i], axis=0) for a in arrs)

    out = jax.lax.fori_loop(0, trip_count, copy_one, arrays)
    return out[0] if kv_scales is None else out
