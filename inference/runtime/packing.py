"""A step's host arrays in one buffer: one host -> device transfer per step instead of one per array.

A steady decode step hands the jitted step about twenty small numpy arrays (the ragged batch, the token feed's
indices, the sampling rows); passed as they are, each is its own host -> device copy. `pack` lays every numpy leaf
of a pytree whose items are 4 bytes wide (int32, uint32, float32) or bool into one int32 buffer, and `Packing`
records where each one lies (static: the step's bucket shapes fix it, so a packing adds no compiled variant);
`unpack`, traced inside the step, slices them back out (a bitcast for float32 / uint32, `!= 0` for bool). Leaves
that are already device arrays (the previous step's tokens, the extras kept on the device) or of another width pass
through as they are.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_BOOL = np.dtype(bool)


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each leaf of a packed pytree lies: `slots[i]` is (offset, shape, dtype) in the buffer, or None for a
    leaf passed through (the next item of the pass-through list)."""

    treedef: jax.tree_util.PyTreeDef
    slots: tuple[tuple[int, tuple[int, ...], str] | None, ...]
    size: int


def _packable(leaf) -> bool:
    return isinstance(leaf, np.ndarray) and (leaf.dtype.itemsize == 4 and leaf.dtype.kind in "iuf"
                                             or leaf.dtype == _BOOL)


def pack(tree) -> tuple[Packing, np.ndarray, list]:
    """(the packing, the int32 buffer, the leaves passed through) of `tree`."""
    leaves, treedef = jax.tree.flatten(tree)
    slots, parts, passed, offset = [], [], [], 0
    for leaf in leaves:
        if not _packable(leaf):
            slots.append(None)
            passed.append(leaf)
            continue
        flat = leaf.reshape(-1)
        parts.append(flat.astype(np.int32) if leaf.dtype == _BOOL else flat.view(np.int32))
        slots.append((offset, leaf.shape, leaf.dtype.str))
        offset += flat.size
    buffer = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return Packing(treedef, tuple(slots), offset), buffer, passed


def unpack(packing: Packing, buffer: jax.Array, passed: list):
    """The pytree `pack` packed (traced inside the jitted step: static slices of the buffer)."""
    leaves, rest = [], iter(passed)
    for slot in packing.slots:
        if slot is None:
            leaves.append(next(rest))
            continue
        offset, shape, dtype = slot
        part = buffer[offset:offset + int(np.prod(shape, dtype=np.int64))].reshape(shape)
        dtype = np.dtype(dtype)
        if dtype == _BOOL:
            part = part != 0
        elif dtype != np.int32:
            part = jax.lax.bitcast_convert_type(part, jnp.dtype(dtype))
        leaves.append(part)
    return jax.tree.unflatten(packing.treedef, leaves)
