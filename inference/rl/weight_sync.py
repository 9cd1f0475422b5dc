"""A trainer's FSDP layout of the engine's parameters, for moving weights between a JAX trainer and the engine.

`LLM.update_weights` takes parameters on any sharding (the runner `device_put`s each leaf into its own); what a
trainer holds is usually fully sharded data parallel: every parameter split along one axis over all its devices.
`fsdp_shardings` builds that layout for the engine's parameter tree, so the GRPO example, the weight-sync test and
the benchmark all start from the same trainer-side placement.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def fsdp_shardings(params, mesh: Mesh, axis: str | None = None) -> list[NamedSharding]:
    """One NamedSharding per leaf of `params` (in `jax.tree.leaves` order): split along the leaf's largest dimension
    that the mesh axis divides, replicated when none does (norm scales of odd sizes). `axis` defaults to the mesh's
    only axis."""
    if axis is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(f"the mesh has axes {mesh.axis_names}; name the one to shard over with axis=")
        axis = mesh.axis_names[0]
    size = mesh.shape[axis]
    out = []
    for leaf in jax.tree.leaves(params):
        dims = sorted(range(leaf.ndim), key=lambda d: -leaf.shape[d])
        split = next((d for d in dims if leaf.shape[d] % size == 0), None)
        spec = [None] * leaf.ndim
        if split is not None:
            spec[split] = axis
        out.append(NamedSharding(mesh, P(*spec)))
    return out


def to_fsdp(params, mesh: Mesh, axis: str | None = None):
    """`params` (any placement) laid out as `fsdp_shardings` says: the same tree, leaves split over `mesh`."""
    leaves, treedef = jax.tree.flatten(params)
    placed = [jax.device_put(x, s) for x, s in zip(leaves, fsdp_shardings(params, mesh, axis))]
    return jax.tree.unflatten(treedef, placed)


__all__ = ["fsdp_shardings", "to_fsdp"]
