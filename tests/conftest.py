"""Shared test setup: a project-local persistent compilation cache, and the default model loaded once."""

from __future__ import annotations

import os

# The suite runs on CPU (Pallas kernels interpreted, real TPU/GPU compilers deviceless). Where jax-cuda13-plugin is
# installed for those compiles, jax would otherwise try to load cuDNN at start-up and fail without a GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from inference.runtime.compile_cache import enable_compilation_cache  # noqa: E402

enable_compilation_cache(os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"))


@pytest.fixture(scope="session")
def smollm2():
    """The default model (SmolLM2-135M-Instruct from its GGUF), float32, shared by the tests that need it."""
    from inference import LLM

    return LLM("smollm2-135m", kv_cache_memory_bytes=256 << 20, max_num_seqs=16, max_num_batched_tokens=256,
               compilation_cache_dir=None)
