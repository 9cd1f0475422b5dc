"""The state cache in the engine (a hybrid model: Gated DeltaNet layers beside gated attention, tiny-qwen3-next):
batched == solo, chunked prefill == unchunked, a prefix hit restored from a state checkpoint == the cold run,
preemption recomputes right, n=2 forks copy the state, and speculative verification keeps the accepted prefix's
state (greedy speculative == plain greedy).

Float32, async scheduling on (the default). The reference for each prompt is that prompt run alone, unchunked
(one chunk up to the last full page, then the rest) and without prefix caching. Greedy tokens must be identical;
logprobs equal within float32 rounding (rows run in other batches and chunkings round differently outside
batch-invariant mode).
"""

from __future__ import annotations

import numpy as np
import pytest

from configs.presets import MODEL_PRESETS
from inference import SamplingParams
from inference.entrypoints.llm import num_state_slots
from tests.inference.test_speculative_engine import assert_second_token_follows_target, repetitive_prompts, sharpened
from tests.llm_configs import LLMConfig

MODEL = "tiny-qwen3-next"
HYBRID = LLMConfig(MODEL, dict(kv_cache_memory_bytes=1 << 20, page_size=8, max_num_seqs=4,
                               max_num_batched_tokens=64, dtype="float32"))
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def prompts(count: int, seed: int, low: int = 18, high: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 512, int(rng.integers(low, high))).tolist() for _ in range(count)]


def tokens_and_logprobs(outs) -> list[tuple[list[int], np.ndarray]]:
    return [(o.outputs[0].token_ids, np.array([next(iter(d.values())).logprob for d in o.outputs[0].logprobs]))
            for o in outs]


def assert_same(got, want) -> None:
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        np.testing.assert_allclose(lps, ref_lps, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def solo():
    """Each prompt alone, one chunk, no prefix cache: the reference (and the cold run of other prompts)."""
    llm = HYBRID.build(enable_prefix_caching=False, max_num_batched_tokens=256)
    data = prompts(6, seed=0)
    want = [tokens_and_logprobs(llm.generate(prompt_token_ids=[p], sampling_params=GREEDY))[0] for p in data]
    return llm, data, want


@pytest.fixture(scope="module")
def chunked():
    """Prefix caching on, 16-token steps: every prompt is chunked."""
    return HYBRID.build(max_num_batched_tokens=16)


def test_batched_chunked_and_prefix_hits_equal_solo(solo, chunked):
    cold_llm, data, want = solo
    llm = chunked
    assert_same(tokens_and_logprobs(llm.generate(prompt_token_ids=data, sampling_params=GREEDY)), want)
    assert llm.engine.async_stats.overlapped_steps > 0
    # Two prompts cold (their checkpoints fit the 4 checkpoint slots), then again: each resumes from the state
    # checkpoint at its last full page.
    llm.engine.reset_prefix_cache()
    assert_same(tokens_and_logprobs(llm.generate(prompt_token_ids=data[:2], sampling_params=GREEDY)), want[:2])
    hits = llm.engine.state.checkpoint_hits
    outs = llm.generate(prompt_token_ids=data[:2], sampling_params=GREEDY)
    assert [o.metrics.num_cached_tokens for o in outs] == [(len(p) - 1) // 8 * 8 for p in data[:2]]
    assert llm.engine.state.checkpoint_hits - hits == 2
    assert_same(tokens_and_logprobs(outs), want[:2])
    # A longer prompt sharing the first one's prefix resumes there too, and equals its own cold run.
    longer = data[0] + [7, 8, 9, 10, 11, 12, 13, 14, 15]
    (hit,) = llm.generate(prompt_token_ids=[longer], sampling_params=GREEDY)
    assert hit.metrics.num_cached_tokens == (len(data[0]) - 1) // 8 * 8
    assert_same(tokens_and_logprobs([hit]),
                tokens_and_logprobs(cold_llm.generate(prompt_token_ids=[longer], sampling_params=GREEDY)))


def test_n_samples_fork_the_state(chunked):
    """A request with n=2 and seed s samples as two requests with seeds s and s+1 (a sample's key is its seed and
    token index), so the forked sample's tokens equal the lone request's: its state was copied right."""
    llm = chunked
    prompt = prompts(1, seed=3)[0]
    params = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    (both,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(n=2, seed=11, **params))
    llm.engine.reset_prefix_cache()
    alone = llm.generate(prompt_token_ids=[prompt, prompt], sampling_params=[
        SamplingParams(seed=11, **params), SamplingParams(seed=12, **params)])
    assert [c.token_ids for c in both.outputs] == [alone[0].outputs[0].token_ids, alone[1].outputs[0].token_ids]


def test_preemption_recomputes_right(solo):
    _, data, want = solo
    config = MODEL_PRESETS[MODEL]
    # Five state slots (the null slot and four sequences; no room for checkpoints) and 12 KV pages.
    budget = 5 * config.state_bytes_per_sequence("float32") + 12 * 8 * int(config.kv_bytes_per_token(4))
    llm = HYBRID.build(kv_cache_memory_bytes=budget, max_num_batched_tokens=32)
    assert llm.runner.num_pages == 12 and llm.runner.num_state_slots == 5
    assert_same(tokens_and_logprobs(llm.generate(prompt_token_ids=data, sampling_params=GREEDY)), want)
    assert llm.engine.scheduler.num_preemptions > 0


def test_prompts_part_way_in_a_full_pool_go_on(solo):
    """Eight prompts of up to 55 tokens over 8 KV pages of 8, 32-token steps (the pool holds one such sequence):
    chunks cut at page boundaries leave two prompts part-way holding every page; the newer is preempted so the
    older goes on (this hung before). Every request equals its run alone."""
    cold_llm = solo[0]
    config = MODEL_PRESETS[MODEL]
    budget = 5 * config.state_bytes_per_sequence("float32") + 8 * 8 * int(config.kv_bytes_per_token(4))
    llm = HYBRID.build(kv_cache_memory_bytes=budget, max_num_batched_tokens=32)
    assert llm.runner.num_pages == 8
    data = prompts(8, seed=0, high=56)
    want = [tokens_and_logprobs(cold_llm.generate(prompt_token_ids=[p], sampling_params=GREEDY))[0] for p in data]
    engine, done = llm.engine, {}
    for i, prompt in enumerate(data):
        engine.add_request(f"p{i}", prompt, GREEDY)
    for _ in range(500):  # stepped by hand: a hang fails here instead of running on
        for out in engine.step(finished_only=True):
            done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert len(done) == len(data), f"{len(data) - len(done)} requests unfinished after 500 steps"
    assert_same(tokens_and_logprobs([done[f"p{i}"] for i in range(len(data))]), want)
    assert engine.scheduler.num_preemptions > 0


SPEC = HYBRID.replace(max_num_seqs=16, max_num_batched_tokens=256, kv_cache_memory_bytes=4 << 20)


def test_greedy_speculation_equals_plain_greedy():
    """Drafts accepted and rejected, so the state at each accepted prefix comes from the per-position slots."""
    plain, spec = SPEC.build(), SPEC.build(speculative_method="ngram", num_speculative_tokens=3)
    repetitive = repetitive_prompts(4, 0)  # greedy random models fall into loops prompt lookup then predicts
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=repetitive, sampling_params=params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompt_token_ids=repetitive, sampling_params=params)] == want
    stats = spec.engine.stats
    assert 0 < stats.spec_accepted < stats.spec_proposed  # some drafts kept, some rejected


def test_sampling_with_speculation_follows_the_target_distribution():
    """1,000 seeded samples' second token (from a verification step, whose rejected drafts' states are discarded)
    follow the hybrid target's distribution (chi-square, tests/inference/test_speculative_engine.py); every request
    after the first resumes from a state checkpoint."""
    spec = sharpened(SPEC.build(speculative_method="ngram", num_speculative_tokens=3),
                     factor=100.0)  # the tiny hybrid's logits are small: x10 leaves its first token near uniform
    prompt = np.random.default_rng(2).permutation(512).tolist()  # every id: prompt lookup always proposes
    n = 1000  # half the tiny Llama test's draws: each hybrid step costs more on CPU
    outs = spec.generate(prompt_token_ids=[prompt] * n, sampling_params=[
        SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)])
    assert spec.engine.stats.spec_passes > n // 2
    assert spec.engine.state.checkpoint_hits > 0
    assert_second_token_follows_target(spec, prompt, outs)


def test_budget_sizes_the_state_slots_and_refuses_too_small(chunked):
    llm = chunked
    per_seq = llm.config.state_bytes_per_sequence("float32")
    slots = llm.runner.num_state_slots
    assert slots == num_state_slots(llm.config, 1 << 20, 4, "float32", True) == 1 + 4 + 4
    assert llm.runner.state_cache_bytes == slots * per_seq
    assert llm.runner.state_cache_bytes + llm.runner.kv_cache_bytes <= 1 << 20
    with pytest.raises(ValueError, match="cannot hold the state of max_num_seqs=4"):
        HYBRID.build(kv_cache_memory_bytes=5 * per_seq)
    with pytest.raises(ValueError, match="speculative_method='ngram'"):
        HYBRID.build(speculative_method="draft", speculative_model="tiny-qwen3-next")


def test_batch_invariant_chunked_and_prefix_hits_are_bitwise_the_cold_run():
    """Batch-invariant mode (the hybrid's dense preset: the invariant kernels refuse MoE): a prompt prefilled in
    page-sized chunks, each chunk's state carried in its slot, and the same prompt again resuming from its state
    checkpoint give bit-identical logprobs to its unchunked cold run (the state layers' invariant forms:
    kernels_pallas/recurrent/ordered_sum.py says why a reduce is not enough)."""
    config = HYBRID.replace("tiny-qwen3-next-dense", batch_invariant=True)
    data = prompts(3, seed=7)
    cold = config.build(enable_prefix_caching=False, max_num_batched_tokens=256)
    want = [tokens_and_logprobs(cold.generate(prompt_token_ids=[p], sampling_params=GREEDY))[0] for p in data]
    llm = config.build(max_num_batched_tokens=8)
    for p, (ref_tokens, ref_lps) in zip(data, want):
        for _ in range(2):  # chunked, then again from the checkpoint at its last full page
            ((tokens, lps),) = tokens_and_logprobs(llm.generate(prompt_token_ids=[p], sampling_params=GREEDY))
            assert tokens == ref_tokens and np.array_equal(lps, ref_lps)
    assert llm.engine.state.checkpoint_hits == len(data)


@pytest.mark.parametrize("model", ["tiny-qwen3-next-dense", "tiny-granite-hybrid"])
def test_batch_invariant_hybrid_batched_equals_each_prompt_alone(model):
    """Batch-invariant mode, Gated DeltaNet and Mamba2 hybrids: prompts generated together give each the same tokens
    and logprob bits as generated alone. The recurrent forms' reduces made a sequence's bits depend on how many
    shared its steps (the last place of a logprob), and which splits of a prompt agreed changed with the jax
    release (0.12.1 broke the test above)."""
    llm = HYBRID.replace(model, batch_invariant=True).build()
    data = prompts(4, seed=7)
    alone = [tokens_and_logprobs(llm.generate(prompt_token_ids=[p], sampling_params=GREEDY))[0] for p in data]
    together = tokens_and_logprobs(llm.generate(prompt_token_ids=data, sampling_params=GREEDY))
    for (tokens, lps), (ref_tokens, ref_lps) in zip(together, alone):
        assert tokens == ref_tokens and np.array_equal(lps, ref_lps)
