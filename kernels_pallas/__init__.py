"""Ragged paged attention: the pure-JAX reference and the dispatcher the model calls."""

from kernels_pallas.kv_cache import copy_pages, write_kv
from kernels_pallas.ragged_paged_attention_ref import ragged_paged_attention_reference
from kernels_pallas.dispatch import ragged_paged_attention

__all__ = ["copy_pages", "ragged_paged_attention", "ragged_paged_attention_reference", "write_kv"]
