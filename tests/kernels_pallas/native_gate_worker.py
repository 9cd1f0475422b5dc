"""Run by test_native_gate.py in a fresh process, because the gate decides once per process: trace every call site
that can take a C++ CPU kernel (twice) and print, as one JSON line, which kernels each program calls, what the gate
logged, and what the engine and the dispatcher say "auto" attention runs."""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np

from configs.presets import get_model_config
from inference.engine.compile_budget import reads_padded_pages
from kernels_pallas import ragged_paged_attention, rope_cpu, write_kv
from kernels_pallas.attention import cpu
from kernels_pallas.attention.dispatch import resolve_impl
from kernels_pallas.kv_cache.layout import kv_cache_spec
from kernels_pallas.kv_cache.writes import WRITE_KERNEL
from kernels_pallas.matmul import grouped_cpu, int8_cpu
from kernels_pallas.native.build import KernelBuildError
from models import layers
from models.quantization import formats
from tests.kernels_pallas.test_ragged_paged_attention import make_case

KERNELS = {"attention": cpu.KERNEL, "kv_write": WRITE_KERNEL, "rope": rope_cpu.KERNEL, "int8_matmul": int8_cpu.KERNEL,
           "grouped_matmul": grouped_cpu.KERNEL}


class Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(f"{record.levelname} {record.getMessage()}")


def kernels_called(fn, *args) -> list[str]:
    text = jax.jit(fn).lower(*args).as_text()
    return sorted(name for name, kernel in KERNELS.items() if kernel.target in text)


def main():
    keep = Keep()
    logging.getLogger("kernels_pallas.native.gate").addHandler(keep)
    logging.getLogger("kernels_pallas.native.gate").setLevel(logging.INFO)  # the choices taken are INFO lines
    rng = np.random.default_rng(0)
    attention_args = list(map(jnp.asarray, make_case(rng, [1, 1], [7, 12], num_q_heads=4, num_kv_heads=2,
                                                     head_dim=64, page_size=4, pages_per_seq=3, num_pages=8)))
    pages = jnp.zeros(kv_cache_spec(4, 4, 2, 32).shape, jnp.float32)
    k = v = jnp.ones((3, 2, 32), jnp.float32)
    slots = jnp.array([0, 5, -1], jnp.int32)
    inv_freq = layers.rope_inv_freq(16, 10000.0, None)
    positions = jnp.arange(5, dtype=jnp.int32)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    per_channel, grouped = formats.quantize_int8(w), formats.quantize_int4(w, 32)
    x = jnp.ones((2, 64), jnp.float32)
    sites = {
        "attention": lambda: kernels_called(lambda *a: ragged_paged_attention(*a, sm_scale=0.1, max_q_len=1),
                                            *attention_args),
        "kv_write": lambda: kernels_called(lambda p: write_kv(p, k, v, slots), pages),
        "rope": lambda: kernels_called(lambda p: layers.rope_tables(p, inv_freq), positions),
        "int8_matmul": lambda: kernels_called(lambda a: formats.matmul(a, per_channel, "int8"), x),
        "grouped_matmul": lambda: kernels_called(lambda a: formats.matmul(a, grouped, "dequant"), x),
    }
    first = {name: site() for name, site in sites.items()}
    second = {name: site() for name, site in sites.items()}
    try:  # an explicit impl="cpu" is not switched off by the environment
        explicit = kernels_called(lambda *a: ragged_paged_attention(*a, sm_scale=0.1, impl="cpu"), *attention_args)
    except KernelBuildError:
        explicit = None
    dense, mla = get_model_config("tiny-llama"), get_model_config("tiny-deepseek-v2")
    print(json.dumps({"sites": first, "sites_again": second, "log": keep.messages, "explicit_cpu": explicit,
                      "auto": resolve_impl("auto", 4, dense.head_dim), "fine_pages": reads_padded_pages(dense, 4),
                      "mla_fine_pages": reads_padded_pages(mla, 4),
                      "targets": {name: kernel.target for name, kernel in KERNELS.items()}}))


if __name__ == "__main__":
    main()
