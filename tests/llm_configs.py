"""The `LLM` configurations the tests share, each defined once by name, and small helpers around an `LLM`.

The session fixtures in tests/conftest.py build some of these once; a test that needs a variant (another pool size,
policy or speculative setting) builds its own with `CONFIG.build(**overrides)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class LLMConfig:
    """A model and the `LLM` keyword arguments that go with it (always without a compilation cache dir of its own:
    tests/conftest.py sets the project-local one)."""

    model: str
    kwargs: dict[str, Any]

    def replace(self, model: str | None = None, **kwargs: Any) -> "LLMConfig":
        return LLMConfig(model or self.model, {**self.kwargs, **kwargs})

    def build(self, **overrides: Any):
        """A fresh `LLM` of this configuration, `overrides` on its keyword arguments."""
        from inference import LLM

        return LLM(self.model, **{**self.kwargs, "compilation_cache_dir": None, **overrides})


# The default model (SmolLM2-135M-Instruct from its GGUF), float32: the session fixture `smollm2`.
SMOLLM2 = LLMConfig("smollm2-135m", dict(kv_cache_memory_bytes=256 << 20, max_num_seqs=16,
                                          max_num_batched_tokens=256))
# SmolLM2 serving LoRA adapters (2 slots, rank <= 16): the session fixture `smollm2_lora`.
SMOLLM2_LORA = SMOLLM2.replace(enable_lora=True, max_loras=2, max_lora_rank=16)
# The random tiny Llama with 4-token pages and a 1 MiB pool (512 pages): tests/inference/test_engine.py.
TINY_ENGINE = LLMConfig("tiny-llama", dict(kv_cache_memory_bytes=1 << 20, page_size=4, max_num_seqs=8,
                                           max_num_batched_tokens=64))
# 16-token pages, a 4 MiB pool, 16 sequences: the plain target of the speculative tests (session fixture
# `tiny_llama`), and with speculative_method=... their speculating engines.
TINY_SPEC = LLMConfig("tiny-llama", dict(kv_cache_memory_bytes=4 << 20, page_size=16, max_num_seqs=16,
                                         max_num_batched_tokens=256))
# TINY_SPEC serving one LoRA adapter of rank <= 8: the session fixture `tiny_llama_lora` (LoRA-only RL tests).
TINY_LORA = TINY_SPEC.replace(enable_lora=True, max_loras=1, max_lora_rank=8)
# A pool of 1/4 MiB in 4-token pages, 4 sequences, 32-token steps: small engines of the tiny presets (int8 KV cache,
# MLA, CLA) and, with a larger pool, the family fixture folders.
SMALL_POOL = LLMConfig("tiny-llama", dict(kv_cache_memory_bytes=1 << 18, page_size=4, max_num_seqs=4,
                                          max_num_batched_tokens=32))


def merged_model(llm):
    """The engine's decoder as one nnx module (its current weights), for the cache-free forward."""
    from flax import nnx

    return nnx.merge(llm.runner.graphdef, llm.runner.params)


@contextlib.contextmanager
def engine_swapped(llm, engine):
    """Run `llm` on another `Engine` over its own runner (e.g. a speculating one on the session's SmolLM2), then put
    its engine back. The other engine writes KV pages the saved engine's prefix cache may have registered, so that
    cache is dropped afterwards."""
    saved, llm.engine = llm.engine, engine
    try:
        yield engine
    finally:
        llm.engine = saved
        saved.reset_prefix_cache()
