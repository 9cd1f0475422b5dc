"""Ragged paged attention (pure-JAX reference, Pallas TPU and GPU kernels, a C++ CPU kernel through XLA's FFI, a
dispatcher by backend), its MLA variant over a latent cache, the paged KV-cache writes (int8 with per-token scales
optional), a shard_map wrapper, and the other C++ CPU kernels' wrappers (quantized matmuls in `matmul`, the RoPE
tables in `rope_cpu`), all switched by `native.gate`."""

from kernels_pallas.kv_cache.writes import copy_pages, quantize_int8, write_kv
from kernels_pallas.attention.reference import ragged_paged_attention_reference
from kernels_pallas.attention.dispatch import ragged_paged_attention
from kernels_pallas.kv_cache.writes import write_latent
from kernels_pallas.mla.dispatch import ragged_paged_mla_attention
from kernels_pallas.sharded import sharded_ragged_paged_attention, sharded_ragged_paged_mla_attention

__all__ = ["copy_pages", "quantize_int8", "ragged_paged_attention", "ragged_paged_attention_reference",
           "ragged_paged_mla_attention", "sharded_ragged_paged_attention", "sharded_ragged_paged_mla_attention",
           "write_kv", "write_latent"]
