"""The engine on a tiny random model: exactness under batching, chunking and preemption; sampling contracts;
compile counts; per-request errors."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inference import LLM, SamplingParams
from inference.runtime.batch import bucket, bucket_ladder
from kernels_pallas.attention.dispatch import resolve_impl
from tests.llm_configs import TINY_ENGINE, merged_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
tiny_llm = TINY_ENGINE.build


@pytest.fixture(scope="module")
def llm() -> LLM:
    """Shared by this module's tests; test_update_weights_changes_outputs_without_compiling puts its weights back."""
    return tiny_llm()


def prompts(seed: int, count: int, low: int = 1, high: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 512, int(rng.integers(low, high))).tolist() for _ in range(count)]


def dense_logprobs(llm: LLM, ids: list[int]) -> np.ndarray:
    model = merged_model(llm)
    return np.asarray(jax.nn.log_softmax(model.forward(jnp.asarray([ids]))[0], axis=-1))


def test_batch_of_mixed_lengths_equals_each_alone(llm):
    batch = prompts(0, 7)
    together = llm.generate(prompt_token_ids=batch, sampling_params=GREEDY)
    for ids, out in zip(batch, together):
        alone = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"


def test_greedy_tokens_follow_the_cache_free_forward(llm):
    """Teacher forcing the generated continuation through the dense forward gives the same argmax every step."""
    ids = prompts(1, 1, 20, 30)[0]
    out = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)[0].outputs[0].token_ids
    logprobs = dense_logprobs(llm, ids + out)
    np.testing.assert_array_equal(logprobs[len(ids) - 1:-1].argmax(-1), out)


def test_prompt_logprobs_equal_cache_free_forward_across_prefill_chunks():
    llm = tiny_llm(max_num_batched_tokens=16)  # a 45-token prompt is prefilled in three chunks
    ids = prompts(2, 1, 45, 46)[0]
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    reference = dense_logprobs(llm, ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[ids[pos]].logprob - reference[pos - 1, ids[pos]]) < 1e-5
        top = np.argsort(-reference[pos - 1])[:3]
        assert set(top.tolist()) <= set(entry)
        assert_rank(entry[ids[pos]].rank, reference[pos - 1], ids[pos])
        assert {1, 2, 3} <= {e.rank for e in entry.values()}  # the top-3 alternatives, ranked 1..3
    # A last chunk of one token, and a one-token prompt, predict no prompt position: nothing is lost, position 0
    # is None, and no step runs the prompt-logprob pass for them.
    short, single = llm.generate(prompt_token_ids=[ids[:33], ids[:1]],
                                 sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert len(short.prompt_logprobs) == 33
    assert abs(short.prompt_logprobs[32][ids[32]].logprob - reference[31, ids[32]]) < 1e-5
    assert single.prompt_logprobs == [None]


def assert_rank(rank: int, logprobs: np.ndarray, token: int, tol: float = 1e-4) -> None:
    """vLLM's rank (tokens whose logprob is >= the token's, itself included), allowing for float noise between the
    paged step and the cache-free forward around the token's value."""
    lp = logprobs[token]
    assert int(np.sum(logprobs > lp + tol)) + 1 <= rank <= int(np.sum(logprobs >= lp - tol)), (rank, token)


def test_sample_logprobs_and_mode(llm):
    ids = prompts(3, 1, 10, 11)[0]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=4, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0].outputs[0]
    assert out.logprobs_mode == "raw" and len(out.logprobs) == 3
    reference = dense_logprobs(llm, ids + out.token_ids)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert len(entry) >= 4 and token in entry
        assert abs(entry[token].logprob - reference[len(ids) - 1 + step, token]) < 1e-5
        assert entry[token].rank == 1  # greedy: the argmax
        assert sorted(e.rank for e in entry.values()) == [1, 2, 3, 4]
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids)))


def test_seed_gives_the_same_tokens_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    target = prompts(4, 1, 8, 9)[0]
    alone = llm.generate(prompt_token_ids=[target], sampling_params=seeded)[0].outputs[0].token_ids
    others = prompts(5, 4)
    mixed_params = [SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True)] * 4 + [seeded]
    mixed = llm.generate(prompt_token_ids=others + [target], sampling_params=mixed_params)
    assert mixed[-1].outputs[0].token_ids == alone
    other_seed = llm.generate(prompt_token_ids=[target], sampling_params=seeded.replace(seed=99))[0]
    assert other_seed.outputs[0].token_ids != alone


def test_n_samples_stop_tokens_and_max_tokens(llm):
    ids = prompts(6, 1, 5, 6)[0]
    outs = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True))[0].outputs
    assert [o.index for o in outs] == [0, 1, 2] and all(len(o.token_ids) == 6 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1, "samples of one request should differ"
    free_run = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)[0].outputs[0].token_ids
    stop_at = free_run[4]
    stopped = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY.replace(stop_token_ids=[stop_at]))[0]
    first = free_run.index(stop_at)
    assert stopped.outputs[0].token_ids == free_run[:first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_at


def test_preemption_under_a_small_page_pool_keeps_outputs_exact(llm):
    small = tiny_llm(kv_cache_memory_bytes=40 * 4 * 2 * 2 * 2 * 16 * 4, max_num_seqs=8)  # 40 pages of 4 tokens
    assert small.runner.num_pages == 40
    batch = prompts(7, 8, 10, 30)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    constrained = small.generate(prompt_token_ids=batch, sampling_params=params)
    assert small.engine.scheduler.num_preemptions > 0, "the pool should have been too small for all at once"
    free = llm.generate(prompt_token_ids=batch, sampling_params=params)  # a 1 MiB pool: room for all eight at once
    for a, b in zip(constrained, free):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert small.engine.block_manager.num_free_pages == small.runner.num_pages


def test_a_sequence_outgrowing_the_pool_fails_alone(llm):
    """A request that alone needs more pages than the pool holds fails by itself, with the fix named; the others
    finish as they would in a big pool. (`LLM` caps the context at the pool, so only an engine whose context passes
    it, as one built by hand may, reaches this: the context is raised here after the build.)"""
    batch = prompts(9, 3, 10, 20)
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    free = llm.generate(prompt_token_ids=batch[1:], sampling_params=short)
    runs = []
    for async_scheduling in (True, False):
        small = tiny_llm(kv_cache_memory_bytes=16 * 4 * 2 * 2 * 2 * 16 * 4, max_num_seqs=4,  # 16 pages of 4 tokens
                         async_scheduling=async_scheduling)
        assert small.runner.num_pages == 16
        engine = small.engine
        engine.max_model_len = engine.scheduler.max_model_len = 4 * 16 + 64
        outs = small.generate(prompt_token_ids=batch, sampling_params=[long, short, short])
        assert outs[0].outputs[0].finish_reason == "error"
        assert "needs 17 KV pages but the cache has 16" in outs[0].error and "kv_cache_memory_bytes" in outs[0].error
        # It computed every token the pool holds, and its token sampled from the last one is kept (the async
        # engine folds it before failing the request, as the synchronous one does).
        assert len(batch[0]) + len(outs[0].outputs[0].token_ids) == 4 * 16 + 1
        assert [o.outputs[0].token_ids for o in outs[1:]] == [o.outputs[0].token_ids for o in free]
        assert engine.block_manager.num_free_pages == 16
        runs.append(outs[0].outputs[0].token_ids)
    assert runs[0] == runs[1]


def test_bucket_ladders():
    assert [bucket(n) for n in (1, 2, 3, 5, 9, 17)] == [1, 2, 4, 8, 16, 32]
    # pages per sequence: 1.5x steps between powers of two, never below the minimum, capped at the maximum
    assert [bucket(n, 4, fine=True) for n in (1, 4, 5, 6, 7, 9, 12, 13, 17, 25)] == [4, 4, 6, 6, 8, 12, 12, 16, 24, 32]
    assert bucket_ladder(4, 100, fine=True) == [4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert bucket(100, 4, 100, fine=True) == 100
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        bucket(101, 4, 100, fine=True)
    ladder = bucket_ladder(4, 512, fine=True)
    assert all(bucket(n, 4, 512, fine=True) in ladder for n in range(1, 513))


def test_decode_never_compiles_after_warmup():
    llm = tiny_llm(max_num_seqs=4, max_model_len=64)
    compiled = llm.warmup(prefill=False, extras=False)
    # seq buckets 1, 2, 4 x pages per seq 4, 8, 16 (64 tokens; 4, 6, 8, 12, 16 where the reference attention runs and
    # reads padded pages; one width, 16, under the C++ kernel, which reads no padded page) x filters on/off
    impl = resolve_impl("auto", llm.engine.page_size, llm.runner.config.head_dim)
    assert llm.engine.limits.fine_pages == (jax.default_backend() == "cpu" and impl == "reference")
    assert llm.engine.limits.page_buckets == (impl != "cpu")
    widths = 1 if impl == "cpu" else 5 if llm.engine.limits.fine_pages else 3
    counts = llm.runner.num_compilations()
    assert counts["decode"] == 3 * widths * 2
    # async scheduling's token feed runs inside the step (`TokenFeed`): no executable of its own
    assert compiled == counts["decode"] and "token_feed" not in counts
    before = llm.runner.num_compilations()["decode"]
    for i, count in enumerate((1, 3, 4, 2)):
        llm.generate(prompt_token_ids=prompts(10 + i, count, 2, 40),
                     sampling_params=SamplingParams(temperature=0.8, top_k=5, max_tokens=20, ignore_eos=True))
        llm.generate(prompt_token_ids=prompts(20 + i, count), sampling_params=GREEDY)
    assert llm.runner.num_compilations()["decode"] == before
    # Warm-up leaves the collector alone (the server and the launcher freeze their heap: `freeze_heap`), so a dropped
    # warmed-up LLM is freed, its weights and compiled steps with it.
    runner = weakref.ref(llm.runner)
    del llm
    gc.collect()
    assert runner() is None


def test_freeze_heap_keeps_frozen_garbage_only_until_the_next_call():
    """`freeze_heap`'s bound: a cycle frozen alive and dropped later survives full collections (they do not walk
    the frozen heap) only until the next `freeze_heap`, which unfreezes and collects first."""
    from inference.engine.llm_engine import freeze_heap

    class Node:
        pass

    node = Node()
    node.self = node  # a reference cycle: only the cyclic collector frees it
    ref = weakref.ref(node)
    assert freeze_heap() == gc.get_freeze_count() > 0
    del node
    gc.collect()
    assert ref() is not None  # frozen: not walked
    try:
        freeze_heap()
        assert ref() is None
    finally:
        gc.unfreeze()  # the rest of this process's tests: nothing frozen


def test_update_weights_changes_outputs_without_compiling(llm):
    ids = prompts(8, 3)
    before = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)
    compiles = llm.runner.num_compilations()
    old = llm.get_params()
    llm.update_weights(jax.tree.map(lambda x: x * 1.5, old))
    after = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)
    assert llm.runner.num_compilations() == compiles
    assert any(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(before, after))
    expected = np.argmax(dense_logprobs(llm, ids[0])[-1])
    assert after[0].outputs[0].token_ids[0] == expected
    llm.update_weights(old)
    with pytest.raises(ValueError, match="shapes and dtypes must match"):
        llm.update_weights(jax.tree.map(lambda x: x[..., :1], old))


def test_bad_prompts_fail_alone(llm):
    good = prompts(9, 2)
    outs = llm.generate(prompt_token_ids=[good[0], [], [5] * 5000, [1, 2, 99999], good[1]], sampling_params=GREEDY)
    assert [o.error is None for o in outs] == [True, False, False, False, True]
    assert "prompt is empty" in outs[1].error
    assert "context" in outs[2].error and "shorten the prompt" in outs[2].error
    assert "outside the vocabulary" in outs[3].error
    assert outs[1].outputs[0].finish_reason == "error"
    assert len(outs[0].outputs[0].token_ids) == 12 and len(outs[4].outputs[0].token_ids) == 12


def test_text_input_without_tokenizer_is_a_clear_error(llm):
    outs = llm.generate(["hello"], GREEDY)
    assert "no tokenizer" in outs[0].error and "prompt_token_ids" in outs[0].error


def test_abort_frees_pages(llm):
    engine = llm.engine
    engine.add_request("a", prompts(11, 1, 30, 31)[0], GREEDY.replace(max_tokens=50))
    engine.step()
    assert engine.block_manager.num_free_pages < llm.runner.num_pages
    engine.abort("a")
    assert engine.block_manager.num_free_pages == llm.runner.num_pages
    assert not engine.has_unfinished_requests()
    engine.pop_finished("a")


def test_unknown_model_lists_presets():
    with pytest.raises(ValueError, match="unknown model preset 'no-such-model'.*smollm2-135m"):
        LLM("no-such-model")


def test_llm_touches_jax_compilation_cache_only_as_documented(tmp_path, monkeypatch):
    """None leaves jax.config alone; "default" keeps a cache already configured (conftest.py's) and enables
    $PAGEJAX_CACHE_DIR only where none is; an explicit path always wins."""
    from inference.runtime.compile_cache import CACHE_OPTIONS, apply_cache_setting

    def options() -> dict:
        return {name: getattr(jax.config, name) for name in CACHE_OPTIONS}

    before = options()
    tiny_llm(compilation_cache_dir=None)
    assert options() == before
    if before["jax_compilation_cache_dir"]:
        tiny_llm(compilation_cache_dir="default")
        assert options() == before
    try:
        assert apply_cache_setting(str(tmp_path / "explicit")) == str(tmp_path / "explicit")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "explicit")
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv("PAGEJAX_CACHE_DIR", str(tmp_path / "default"))
        assert apply_cache_setting("default") == str(tmp_path / "default")
        assert apply_cache_setting(None) is None
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "default")
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


def test_engine_and_data_parallel_engine_are_engine_clients(llm):
    """LLM and EngineLoop type against EngineClient; both engines must keep every member of it."""
    from inference.engine.client import EngineClient
    from inference.engine.data_parallel import DataParallelEngine

    assert isinstance(llm.engine, EngineClient)
    assert isinstance(DataParallelEngine([llm.engine]), EngineClient)
