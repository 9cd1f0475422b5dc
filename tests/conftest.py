"""Shared test setup: a project-local persistent compilation cache, and the common `LLM`s built once a session."""

from __future__ import annotations

import gc
import os

# The suite runs on CPU (Pallas kernels interpreted, real TPU/GPU compilers deviceless). Where jax-cuda13-plugin is
# installed for those compiles, jax would otherwise try to load cuDNN at start-up and fail without a GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Before JAX starts its backend, which reads XLA_FLAGS once (tests/xla_test_flags.py says why).
from tests.xla_test_flags import with_test_flags  # noqa: E402

os.environ["XLA_FLAGS"] = with_test_flags(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
import pytest  # noqa: E402

from inference.runtime.compile_cache import enable_compilation_cache  # noqa: E402

enable_compilation_cache(os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"))


#: The files whose tests take longest (minutes each, on CI's 2 cores), longest first, run before all others. Under
#: `--dist loadfile` a file is one unit of work handed to whichever worker is free, in collection order, which puts
#: tests/sharding and tests/scripts near the end: one of these started last leaves the other worker idle for its
#: length. Longest first, the short files fill in at the end instead. Measured: BENCHMARKS.md, "Test suite and CI
#: time".
LONGEST_FILES = ("tests/scripts/test_aot_compile.py", "tests/sharding/test_sharding.py",
                 "tests/inference/test_state_cache_engine.py", "tests/models/test_quantized_model.py",
                 "tests/inference/test_warmup.py", "tests/models/test_families.py",
                 "tests/kernels_pallas/test_cpu_kernels_aarch64.py", "tests/inference/test_input_rows.py",
                 "tests/inference/test_structured_outputs.py", "tests/inference/test_server_lora.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`LONGEST_FILES` first, in their order; every other file after them in collection order (a stable sort: the
    tests of a file keep theirs)."""
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(autouse=True, scope="module")
def _release_what_the_module_compiled():
    """After each test module: collect what it dropped (a test that froze the heap unfrozen first) and empty JAX's
    in-memory compile caches.

    Why: a pytest-xdist worker runs about a hundred modules in one process, and every executable JAX keeps is
    LLVM-jitted code in memory mappings of its own (three each). Kept, with the warmed-up engines that froze the heap,
    they grew a worker to gigabytes and tens of thousands of mappings (BENCHMARKS.md, "Test suite and CI time"); the
    suite's segfaults, in `executable.serialize()`, came late in such a worker's life. The session's shared `LLM`s
    reload their steps from the persistent cache when next used."""
    yield
    gc.unfreeze()
    jax.clear_caches()
    gc.collect()


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
