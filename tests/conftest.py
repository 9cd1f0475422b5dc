"""Shared test setup: a project-local persistent compilation cache, and the common `LLM`s built once a session."""

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
    """The default model (SmolLM2-135M-Instruct from its GGUF), float32, shared by the tests that need it
    (tests/llm_configs.py: SMOLLM2). Tests must leave its weights as they found them."""
    from tests.llm_configs import SMOLLM2

    return SMOLLM2.build()


@pytest.fixture(scope="session")
def smollm2_lora():
    """SmolLM2 with LoRA enabled (tests/llm_configs.py: SMOLLM2_LORA), shared by the LoRA reference and launcher
    tests. Tests leave its base weights alone; adapters they load stay registered under their own names."""
    from tests.llm_configs import SMOLLM2_LORA

    return SMOLLM2_LORA.build()


@pytest.fixture(scope="session")
def tiny_llama():
    """The random tiny Llama (tests/llm_configs.py: TINY_SPEC, no speculation), shared by the tests that only
    generate with it. Tests must not change its weights, and call `engine.reset_stats()` before reading its counters."""
    from tests.llm_configs import TINY_SPEC

    return TINY_SPEC.build()


@pytest.fixture(scope="session")
def tiny_llama_lora():
    """The random tiny Llama serving one LoRA adapter (tests/llm_configs.py: TINY_LORA), shared by the LoRA-only RL
    tests. Tests leave its base weights alone; each registers its adapter under its own name."""
    from tests.llm_configs import TINY_LORA

    return TINY_LORA.build()
