"""Tensor parallelism (GSPMD): a ("data", "model") mesh, partition rules over the model's parameters and KV cache,
load-time padding of head counts / vocab / MLP width to multiples of the model axis; data-parallel replica meshes;
multi-process start-up (`sharding.distributed`). See docs/sharding.md."""

from sharding.mesh import make_mesh, replica_meshes
from sharding.partition import (bytes_per_device, checkpoint_shardings, kv_cache_sharding, pad_heads, padding_report,
                                param_shardings, replicated, shard_decoder)

__all__ = ["bytes_per_device", "checkpoint_shardings", "kv_cache_sharding", "make_mesh", "pad_heads",
           "padding_report", "param_shardings", "replica_meshes", "replicated", "shard_decoder"]
