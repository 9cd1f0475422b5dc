"""The target backend every kernel choice reads (kernels_pallas/backend.py), and what follows from it."""

from __future__ import annotations

import pytest

from kernels_pallas.backend import compiling_for, target_backend


def test_target_backend_follows_compiling_for():
    assert target_backend() == "cpu"
    with compiling_for("tpu"):
        assert target_backend() == "tpu"
        with compiling_for("gpu"):
            assert target_backend() == "gpu"
        assert target_backend() == "tpu"
    assert target_backend() == "cpu"


def test_compiling_for_rejects_unknown_backends():
    with pytest.raises(ValueError, match="unknown backend"):
        with compiling_for("metal"):
            pass


def test_dtype_auto_is_bfloat16_on_accelerators_and_float32_on_cpu():
    from inference.entrypoints.llm import resolve_dtype

    assert resolve_dtype("auto") == "float32"  # this suite runs on CPU
    for backend, want in (("tpu", "bfloat16"), ("gpu", "bfloat16"), ("cpu", "float32")):
        with compiling_for(backend):
            assert resolve_dtype("auto") == want
    assert resolve_dtype("float16") == "float16"
    with pytest.raises(ValueError, match="'auto'"):
        resolve_dtype("float64")


@pytest.mark.parametrize("backend,module,name", [
    ("gpu", "kernels_pallas.attention.gpu", "ragged_paged_attention_gpu"),
    ("tpu", "kernels_pallas.attention.tpu", "ragged_paged_attention_tpu"),
])
def test_auto_dispatch_picks_the_target_backends_kernel(backend, module, name, monkeypatch):
    """impl="auto" reads the page size (axis 2 of the cache) and the target backend: a pool of 10 pages of 16
    tokens takes the GPU / TPU kernel, not the reference."""
    import importlib

    import jax.numpy as jnp

    from kernels_pallas import ragged_paged_attention
    from kernels_pallas.kv_cache.layout import kv_cache_spec

    calls = []
    monkeypatch.setattr(importlib.import_module(module), name, lambda q, *a, **k: calls.append(k) or q)
    spec = kv_cache_spec(10, 16, 2, 64, jnp.bfloat16)
    q = jnp.zeros((4, 4, 64), jnp.bfloat16)
    meta = (jnp.ones(2, jnp.int32), jnp.zeros((2, 1), jnp.int32), jnp.array([0, 1, 2], jnp.int32),
            jnp.array([2], jnp.int32))
    with compiling_for(backend):
        ragged_paged_attention(q, jnp.zeros(spec.shape, spec.dtype), *meta)
    assert len(calls) == 1
