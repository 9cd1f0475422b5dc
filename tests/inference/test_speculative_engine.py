"""Speculative decoding inside the engine (n-gram prompt lookup): exact under greedy and under sampling."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference import LLM, SamplingParams
from inference.engine.llm_engine import Engine
from inference.engine.config import SchedulerConfig
from inference.spec_decode.ngram import NgramProposer, PromptLookupProposer
from tests.llm_configs import TINY_SPEC, engine_swapped, merged_model
from tests.reference_fixtures import load_reference


def sharpened(llm: LLM, factor: float = 10.0) -> LLM:
    """Scale the random model's logits by `factor` (through the final norm) so its distributions have a handful of likely
    tokens: a chi-square test with a few thousand draws then has cells worth testing."""
    params = llm.get_params()
    weight = params["final_norm"]["weight"].get_value()
    if llm.config.norm_style == "gemma":  # the norm scales by (1 + weight): scale that
        params["final_norm"]["weight"].set_value((1.0 + weight) * factor - 1.0)
    else:
        params["final_norm"]["weight"].set_value(weight * factor)
    llm.update_weights(params)
    return llm


def repetitive_prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 60, 8).tolist() * 5 for _ in range(count)]


def test_greedy_speculation_is_token_identical_and_saves_passes(tiny_llama):
    plain = tiny_llama
    plain.engine.reset_stats()  # the shared engine's counters: this test's decode steps only
    spec = TINY_SPEC.build(speculative_method="ngram", num_speculative_tokens=4)
    prompts = repetitive_prompts(6, 0) + [[5, 9, 2]]  # the last one has nothing to look up at first
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    got = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    summary = spec.engine.metrics_summary()
    assert summary["spec_acceptance_rate"] > 0.3 and summary["spec_tokens_per_pass"] > 1.5
    assert spec.engine.stats.decode_steps < plain.engine.stats.decode_steps
    assert spec.engine.block_manager.num_free_pages == spec.runner.num_pages  # rolled-back pages came back


def test_max_tokens_and_stop_tokens_are_respected_inside_accepted_drafts(tiny_llama):
    spec = TINY_SPEC.build(speculative_method="ngram", num_speculative_tokens=5)
    plain = tiny_llama
    prompts = repetitive_prompts(4, 1)
    free = plain.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True))
    for prompt, ref in zip(prompts, free):
        stop = ref.outputs[0].token_ids[17]
        params = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True, stop_token_ids=[stop])
        out = spec.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0]
        expected = ref.outputs[0].token_ids[:23]
        if stop in expected:
            expected = expected[:expected.index(stop) + 1]
        assert out.token_ids == expected


def test_sampling_with_speculation_follows_the_target_distribution():
    """2,000 seeds, one prompt: the second generated token (produced by a verification step) is distributed as the
    target model's softmax given the prompt and the first token (chi-square, p = 0.001)."""
    spec = sharpened(TINY_SPEC.build(speculative_method="ngram", num_speculative_tokens=3))
    # Every vocabulary id occurs in the prompt, so whatever the first token is, prompt lookup finds it and proposes.
    prompt = np.random.default_rng(2).permutation(512).tolist()
    n = 2000
    outs = spec.generate(prompt_token_ids=[prompt] * n, sampling_params=[
        SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)])
    assert spec.engine.stats.spec_passes > n // 2, "the second token should mostly come from speculative steps"
    assert_second_token_follows_target(spec, prompt, outs)


def assert_second_token_follows_target(llm: LLM, prompt: list[int], outs) -> None:
    """Chi-square (p = 0.001) of the second generated token, per first token, against the target's softmax given the
    prompt and that first token (cells with expected count < 5 pooled)."""
    pairs = collections.Counter(tuple(o.outputs[0].token_ids[:2]) for o in outs)
    firsts = collections.Counter(t1 for t1, _ in pairs.elements())
    model = merged_model(llm)
    forward = nnx.jit(lambda m, tokens: m.forward(tokens))  # one compile for every first token (same shape)
    stat, df = 0.0, 0
    for t1, count in firsts.items():
        q = np.asarray(jax.nn.softmax(forward(model, jnp.asarray([prompt + [t1]]))[0, -1]))
        expected = count * q
        observed = np.array([pairs[(t1, t)] for t in range(len(q))], np.float64)
        big = expected >= 5
        if big.sum() < 1:
            continue
        cells_e = np.append(expected[big], expected[~big].sum())
        cells_o = np.append(observed[big], observed[~big].sum())
        keep = cells_e > 0
        stat += float(((cells_o[keep] - cells_e[keep]) ** 2 / cells_e[keep]).sum())
        df += int(keep.sum()) - 1
    assert df > 0, f"no cell to test: first tokens {dict(firsts)}, pairs {dict(pairs)}"
    # Wilson-Hilferty approximation of the chi-square 0.999 quantile (z = 3.09).
    critical = df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3
    assert stat < critical, (stat, critical, df)


def test_smollm2_greedy_speculation_matches_transformers(smollm2):
    """Prompt lookup on SmolLM2: the fixtures' 32-token greedy continuations, token for token. The speculating
    engine runs on the session's SmolLM2 runner, as LLM(speculative_method="ngram", num_speculative_tokens=4) builds
    it (the tiny tests above go through LLM itself)."""
    prompts = load_reference()["prompts"]
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=smollm2.engine.max_model_len)
    engine = Engine(smollm2.runner, smollm2.tokenizer, scheduler, proposer=PromptLookupProposer(NgramProposer(k=4)))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with engine_swapped(smollm2, engine):
        outs = smollm2.generate(prompt_token_ids=[p["prompt_ids"].tolist() for p in prompts], sampling_params=params)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == p["greedy_ids"].tolist(), p["prompt"]
    assert engine.stats.spec_passes > 0
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_a_seeded_request_without_drafts_is_unaffected_by_speculating_batch_mates():
    spec = TINY_SPEC.build(speculative_method="ngram", num_speculative_tokens=3)
    lone = [7, 300, 41, 99]  # no repeats: prompt lookup proposes nothing for it
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    alone = spec.generate(prompt_token_ids=[lone], sampling_params=seeded)[0].outputs[0].token_ids
    mates = repetitive_prompts(3, 5)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 3 + [seeded]
    mixed = spec.generate(prompt_token_ids=mates + [lone], sampling_params=params)
    assert spec.engine.stats.spec_passes > 0
    assert mixed[-1].outputs[0].token_ids == alone
