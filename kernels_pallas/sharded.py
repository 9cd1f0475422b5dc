"""Run any attention implementation per device under tensor parallelism, with `jax.shard_map`.

Under GSPMD (`jax.jit` with sharded inputs) XLA cannot partition a Pallas custom call: it would gather the whole
KV cache onto every device. Attention is embarrassingly parallel over KV heads, so this wrapper states the split
explicitly: the KV-head axis of `kv_pages` (axis 0, kv_cache/layout.py) and the query-head axis of q are split over
one mesh axis, the page tables and lengths are replicated, and each device runs the unmodified kernel on its
`Hkv / n` KV heads and their `Hq / n` query heads, with no collective. Because the query heads of a KV head are
contiguous, device i's query heads are exactly those of its KV heads. `kv_scales` (int8 cache) is head-major too
and split the same way. The model's heads must divide by the axis size; `sharding/` pads heads to make that so.
MLA (`sharded_ragged_paged_mla_attention`) has one latent cache shared by all heads: query heads are split and
the latent pages replicated.

`check_vma=False`: a pallas_call inside shard_map has no varying-axis annotations on its out_shape in jax 0.10.2.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, PartitionSpec as P

from kernels_pallas.attention.dispatch import ragged_paged_attention
from kernels_pallas.mla.dispatch import ragged_paged_mla_attention


def _axis_size(mesh: Mesh, axis_name: str, **heads: int) -> int:
    if axis_name not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis_name!r}; its axes are {tuple(mesh.shape)}")
    n = mesh.shape[axis_name]
    if any(h % n for h in heads.values()):
        raise ValueError(f"{', '.join(f'{h} {k}' for k, h in heads.items())} must all divide by the {axis_name!r} "
                         f"axis size {n}; pad the heads (sharding/) or use a smaller axis")
    return n


def sharded_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, mesh: Mesh,
                                   axis_name: str = "model", kv_scales: jax.Array | None = None,
                                   **attention_kwargs) -> jax.Array:
    """`ragged_paged_attention` (any `impl`, same keywords) run one KV-head shard per device of `mesh[axis_name]`.

    Returns `[T, Hq, D]` sharded over query heads on `axis_name`.
    """
    _axis_size(mesh, axis_name, KV_heads=kv_pages.shape[0], query_heads=q.shape[1])
    heads = P(None, axis_name, None)
    kv_spec = P(axis_name)
    rep = P()
    in_specs = (heads, kv_spec, rep, rep, rep, rep) + ((kv_spec,) if kv_scales is not None else ())

    def per_device(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *scales):
        return ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                      kv_scales=scales[0] if scales else None, **attention_kwargs)

    fn = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)
    extra = (kv_scales,) if kv_scales is not None else ()
    return fn(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *extra)


def sharded_ragged_paged_mla_attention(q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                                       mesh: Mesh, axis_name: str = "model", **attention_kwargs) -> jax.Array:
    """`ragged_paged_mla_attention` per device: MLA's one latent "KV head" is shared by all query heads, so the
    query heads are split over `axis_name` and the latent cache is replicated (each device reads all of it, as
    under GSPMD). Returns `[T, H, Dl]` sharded over heads."""
    _axis_size(mesh, axis_name, query_heads=q_latent.shape[1])
    heads, rep = P(None, axis_name, None), P()

    def per_device(*args):
        return ragged_paged_mla_attention(*args, **attention_kwargs)

    fn = jax.shard_map(per_device, mesh=mesh, in_specs=(heads, heads) + (rep,) * 5, out_specs=heads,
                       check_vma=False)
    return fn(q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
