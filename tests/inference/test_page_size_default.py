"""The KV page size per backend (`inference/engine/config.py: default_page_size`), and the engine's page-size
dependent paths (prefix cache, copy-on-write of a forked partial page, an int8 cache's scale rows) at the size a TPU
picks for a 2048-token model: 128 tokens, where a page's scales fill two 128-lane rows."""

from __future__ import annotations

import pytest

from inference import SamplingParams
from inference.engine.config import CacheConfig, default_page_size
from tests.llm_configs import SMALL_POOL

TPU_PAGE = default_page_size("tpu", 2048)


def test_default_page_size_per_backend():
    """TPU: next_pow2(max_model_len) / 16 clamped to 16-256 (JAX's in-tree RPA and tpu-inference); elsewhere 16."""
    assert TPU_PAGE == 128
    got = {n: default_page_size("tpu", n) for n in (1, 100, 256, 257, 1024, 1500, 4096, 8192, 131072)}
    assert got == {1: 16, 100: 16, 256: 16, 257: 32, 1024: 64, 1500: 128, 4096: 256, 8192: 256, 131072: 256}
    assert default_page_size("gpu", 131072) == default_page_size("cpu", 2048) == 16
    assert CacheConfig().page_size is None  # LLM resolves it once it knows the backend and the model length
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 1"):
        default_page_size("tpu", 0)


def test_llm_resolves_the_page_size_on_this_backend():
    llm = SMALL_POOL.build(page_size=None, kv_cache_memory_bytes=1 << 20)
    assert llm.engine.page_size == default_page_size("cpu", llm.config.max_position_embeddings) == 16


def test_prefix_cache_and_copy_on_write_on_an_int8_cache_at_the_tpu_page_size():
    """At 128-token pages on an int8 cache: a 300-token prompt (two full pages and a partial one) forked n=3 shares
    its pages and copies the partial one with its two scale rows; each greedy sample equals the single generation,
    and the repeated prompt hits the prefix cache for its full pages."""
    prompt = [(7 * i) % 500 + 1 for i in range(300)]
    llm = SMALL_POOL.build(page_size=TPU_PAGE, kv_cache_dtype="int8", kv_cache_memory_bytes=1 << 20,
                           max_num_batched_tokens=128)
    assert llm.engine.page_size == TPU_PAGE
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)[0].outputs[0].token_ids
    forked = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, n=3))[0]
    assert [o.token_ids for o in forked.outputs] == [alone] * 3
    assert forked.metrics.num_cached_tokens == 300 // TPU_PAGE * TPU_PAGE
