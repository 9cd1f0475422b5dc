"""inference/engine/config.py: LLM's keywords map onto the config parts, and each part rejects a bad value by name."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from inference import LLM
from inference.engine.config import (CacheConfig, EngineConfig, ParallelConfig, QuantizationConfig, SchedulerConfig,
                                     SpeculativeConfig)


def test_every_llm_keyword_maps_onto_the_config():
    names = [n for n in inspect.signature(LLM.__init__).parameters if n != "self"]
    defaults = {n: p.default for n, p in inspect.signature(LLM.__init__).parameters.items() if n != "self"}
    config = EngineConfig.from_kwargs(**defaults)
    assert config == EngineConfig()  # LLM's defaults are the configs' defaults
    config = EngineConfig.from_kwargs(page_size=4, scheduling_policy="mixed", speculative_method="ngram",
                                      num_speculative_tokens=2, quantization="int4", quantization_group_size=64,
                                      tensor_parallel_size=1, max_model_len=99)
    assert config.cache.page_size == 4 and config.scheduler.policy == "mixed" and config.scheduler.max_model_len == 99
    assert config.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert config.quantization == QuantizationConfig("int4", 64)
    assert len(names) == len(set(names))
    with pytest.raises(TypeError, match="unknown engine argument 'pagesize'"):
        EngineConfig.from_kwargs(pagesize=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1


@pytest.mark.parametrize("make, match", [
    (lambda: CacheConfig(page_size=0), "page_size must be an integer >= 1"),
    (lambda: CacheConfig(kv_cache_dtype="fp4"), "kv_cache_dtype 'fp4' is not supported"),
    (lambda: CacheConfig(kv_cache_memory_bytes=-1), "kv_cache_memory_bytes must be an integer >= 1"),
    (lambda: CacheConfig(memory_fraction=1.5), r"memory_fraction must be in \(0, 1\]"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
    (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1"),
    (lambda: SchedulerConfig(policy="fifo"), "unknown scheduling policy 'fifo'"),
    (lambda: SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4, policy="mixed"), "at least max_num_seqs"),
    (lambda: SpeculativeConfig(method="eagle"), "unknown speculative_method 'eagle'"),
    (lambda: SpeculativeConfig(method="ngram", num_speculative_tokens=0), "num_speculative_tokens must be an integer"),
    (lambda: SpeculativeConfig(method="draft"), "needs speculative_model"),
    (lambda: SpeculativeConfig(model="x"), "speculative_method is not"),
    (lambda: SpeculativeConfig(method="ngram", model="x"), "only used with speculative_method='draft'"),
    (lambda: QuantizationConfig("int3"), "quantization must be one of"),
    (lambda: QuantizationConfig("int8", 64), "quantization_group_size applies to"),
    (lambda: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (lambda: ParallelConfig(data_parallel_size=0), "data_parallel_size must be an integer >= 1"),
    (lambda: EngineConfig(dtype="fp8"), "dtype 'fp8' is not supported"),
    (lambda: EngineConfig(attn_impl="cuda-magic"), "unknown attn_impl 'cuda-magic'"),
    (lambda: EngineConfig(quantization=QuantizationConfig("int8"), parallel=ParallelConfig(2)),
     "with quantization=.int8. is not supported yet .quantization=.fp8. is."),
    (lambda: EngineConfig(speculative=SpeculativeConfig("draft", model="m"), parallel=ParallelConfig(1, 2)),
     "draft model with tensor_parallel_size"),
    (lambda: EngineConfig(speculative=SpeculativeConfig("ngram"), scheduler=SchedulerConfig(max_num_seqs=128)),
     "max_num_batched_tokens=512"),
])
def test_each_config_names_the_bad_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_llm_rejects_bad_arguments_before_loading_the_model():
    """A bad value fails in the config, even with a model name that would not load."""
    with pytest.raises(ValueError, match="page_size"):
        LLM("no-such-model", page_size=0, compilation_cache_dir=None)


def test_auto_policy_is_mixed_under_ragged_kernels_and_prefill_first_under_the_reference():
    """`SchedulerConfig(policy="auto")`, the default: mixed steps where attention is a ragged kernel (each sequence
    pays for its own query), prefill-first under the pure-JAX reference (every sequence pays for the longest query),
    where the token budget cannot hold a decode token per sequence, or when speculating; an explicit policy is
    kept."""
    from configs.presets import get_model_config
    from inference.engine.compile_budget import scheduling_policy

    config = get_model_config("tiny-llama")
    auto = SchedulerConfig()
    assert auto.policy == "auto"
    assert scheduling_policy(config, 16, "cpu", None, auto) == "mixed"
    assert scheduling_policy(config, 16, "tpu", None, auto) == "mixed"
    assert scheduling_policy(config, 16, "reference", None, auto) == "prefill_first"
    small_budget = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32)
    assert scheduling_policy(config, 16, "cpu", None, small_budget) == "prefill_first"
    assert scheduling_policy(config, 16, "cpu", None, auto, num_spec=4) == "prefill_first"  # the verify family
    for policy in ("mixed", "prefill_first"):
        assert scheduling_policy(config, 16, "reference", None, SchedulerConfig(policy=policy)) == policy
