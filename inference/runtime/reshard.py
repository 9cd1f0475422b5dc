"""Move arrays onto target shardings device to device, whatever mesh or device set they live on now.

Why not just `jax.device_put(x, sharding)`: between shardings over the *same* devices it is a device-to-device
reshard (one XLA program), but between different device sets (a trainer's FSDP-8 mesh -> an engine replica's two
devices) JAX 0.10 routes it through the host (a transfer guard shows the host-to-device leg). Here each target shard is
assembled on its device from the overlapping pieces of the source shards, each piece sliced on its source device
and copied device to device: every byte moves once, no host copy exists, no collective runs. The cost is one small
dispatch per piece (BENCHMARKS.md, weight sync: on CPU, where "host" is the same memory, JAX's host route is
faster; the point of this one is accelerators, where the host route crosses PCIe twice). An embedding of the target
layout into a sharding over the source devices (one XLA transfer per leaf) was tried: it copies every byte to every
source-device row and its collectives timed out on 8 virtual devices over 2 cores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Bounds = tuple[tuple[int, int], ...]


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> Bounds:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _overlap(a: Bounds, b: Bounds) -> Bounds | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


@functools.lru_cache(maxsize=None)
def _assembler(shape: tuple[int, ...], dtype: np.dtype, offsets: tuple[tuple[int, ...], ...]):
    """A jitted `parts -> block` that writes each part at its offset (constants in the program, so no index array
    crosses from the host); compiled once per layout and reused by every later sync."""
    def assemble(*parts):
        out = jnp.zeros(shape, dtype)
        for part, offset in zip(parts, offsets):
            out = lax.dynamic_update_slice(out, part, offset)
        return out
    return jax.jit(assemble)


@functools.lru_cache(maxsize=None)
def _slicer(start: tuple[int, ...], limit: tuple[int, ...]):
    """A jitted static slice (eager `lax.slice` would send its bounds from the host as index arrays)."""
    return jax.jit(lambda a: lax.slice(a, start, limit))


def reshard_all(xs: list, dsts: list) -> list[jax.Array]:
    """Each `xs[i]` (host array, or a jax.Array on any sharding) placed as `dsts[i]`, device to device for arrays
    on devices. Arrays from the host, already in place, or on the target's own devices go through one batched
    `device_put` (XLA reshards among the same devices); the rest piece by piece (`_reshard_pieces`)."""
    out: list = [None] * len(xs)
    direct = []
    for i, (x, dst) in enumerate(zip(xs, dsts)):
        if not isinstance(x, jax.Array) or x.sharding == dst or x.sharding.device_set == dst.device_set:
            direct.append(i)
        else:
            out[i] = _reshard_pieces(x, dst)
    if direct:
        for i, y in zip(direct, jax.device_put([xs[i] for i in direct], [dsts[i] for i in direct])):
            out[i] = y
    return out


def reshard(x, dst: jax.sharding.Sharding) -> jax.Array:
    """One array: `reshard_all([x], [dst])[0]`."""
    return reshard_all([x], [dst])[0]


def _reshard_pieces(x: jax.Array, dst: jax.sharding.Sharding) -> jax.Array:
    """Each target shard assembled on its device from the overlapping pieces of `x`'s shards."""
    shape = x.shape
    sources: dict[Bounds, list] = {}  # unique source block -> its copies (replicated shards repeat a block)
    for shard in x.addressable_shards:
        sources.setdefault(_bounds(shard.index, shape), []).append(shard.data)
    pieces = []
    for device, index in dst.addressable_devices_indices_map(shape).items():
        block = _bounds(index, shape)
        parts, offsets = [], []
        for src, copies in sources.items():
            ov = _overlap(block, src)
            if ov is None:
                continue
            data = next((c for c in copies if device in c.devices()), copies[0])  # a copy already there, if any
            if ov != src:  # only part of this source shard: slice it on its own device
                data = _slicer(tuple(lo - s0 for (lo, _), (s0, _) in zip(ov, src)),
                               tuple(hi - s0 for (_, hi), (s0, _) in zip(ov, src)))(data)
            parts.append(jax.device_put(data, device))
            offsets.append(tuple(lo - b0 for (lo, _), (b0, _) in zip(ov, block)))
        if len(parts) == 1 and offsets[0] == (0,) * len(shape) and parts[0].shape == tuple(hi - lo for lo, hi in block):
            pieces.append(parts[0])
        else:
            size = tuple(hi - lo for lo, hi in block)
            pieces.append(_assembler(size, np.dtype(x.dtype), tuple(offsets))(*parts))
    return jax.make_array_from_single_device_arrays(shape, dst, pieces)


__all__ = ["reshard", "reshard_all"]
