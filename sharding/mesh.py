"""The device mesh: axes ("data", "model"), both `AxisType.Auto`.

Auto axes let XLA's GSPMD partitioner choose the collectives for a contraction whose contracting dimension is
sharded (row-parallel o_proj / down_proj): with `jax.make_mesh`'s default Explicit axes in JAX 0.10.2 such a matmul
raises `ShardingTypeError` and `with_sharding_constraint` refuses the mesh.

Data parallelism does not shard one model over the "data" axis: each row of a `data x model` mesh is an independent
replica (its own weights, pages and scheduler; `inference/engine/data_parallel.py`), so `replica_meshes` splits the mesh
into `data` meshes of shape `1 x model`. Replicas never talk to each other, so no collective crosses the data axis.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "model")


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `data x model` mesh over the first data*model of `devices` (default: `jax.devices()`)."""
    if data < 1 or model < 1:
        raise ValueError(f"mesh axis sizes must be positive, got data={data} model={model}")
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < data * model:
        raise ValueError(f"a {data}x{model} mesh needs {data * model} devices, but only {len(devices)} are "
                         "available (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before "
                         "importing jax)")
    grid = np.array(devices[:data * model], dtype=object).reshape(data, model)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One `1 x model` mesh per row of `mesh`'s data axis: the devices of each data-parallel replica."""
    return [Mesh(mesh.devices[i:i + 1], AXES, axis_types=(AxisType.Auto,) * len(AXES))
            for i in range(mesh.shape["data"])]
