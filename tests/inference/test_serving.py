"""Continuous batching under live traffic: random arrivals, prefix caching, fork + copy-on-write, priorities,
policies, streaming from several threads, and faults that stay with one request."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inference import LLM, SamplingParams
from tests.llm_configs import TINY_SPEC, merged_model

MAX_LEN = 384
SERVING = TINY_SPEC.replace(kv_cache_memory_bytes=2 << 20, max_model_len=MAX_LEN)


def make_llm(**kw) -> LLM:
    llm = SERVING.build(**kw)
    # Sharpen the random model's logits (x8 on the LM head) so greedy choices are far from ties.
    params = llm.get_params()
    params["embed"]["embedding"].set_value(params["embed"]["embedding"].get_value() * 8.0)
    llm.update_weights(params)
    return llm


@pytest.fixture(scope="module")
def llm() -> LLM:
    """Shared by this module's tests (the default policy, prefix caching on); they leave its weights as they were."""
    return make_llm()


def dense_greedy_next(llm: LLM, sequences: list[list[int]]) -> list[list[int]]:
    """Each sequence's greedy next token at every position, from one cache-free forward over it (padded to one
    shape; causal, so padding after a sequence cannot change its logits). An output is the greedy continuation of
    its prompt exactly when each of its tokens is the argmax after the tokens before it (teacher forcing): one
    forward per request instead of one per generated token."""
    model = merged_model(llm)
    forward = jax.jit(lambda t: jnp.argmax(model.forward(t), axis=-1))
    results = []
    for ids in sequences:
        buf = np.zeros((1, MAX_LEN), np.int32)
        buf[0, :len(ids)] = ids
        results.append(np.asarray(forward(jnp.asarray(buf)))[0, :len(ids)].tolist())
    return results


def test_random_arrivals_match_the_cache_free_model(llm):
    """200 requests (prompts 1-300 tokens, 1-64 new tokens) joining at random steps; each output is what the
    model gives that request alone."""
    rng = np.random.default_rng(0)
    n = 200
    prompts = [rng.integers(1, 512, int(rng.integers(1, 301))).tolist() for _ in range(n)]
    lengths = [int(x) for x in rng.integers(1, 65, n)]
    arrivals = np.sort(rng.integers(0, 150, n))
    engine, outputs, step, nxt = llm.engine, {}, 0, 0
    while nxt < n or engine.has_unfinished_requests():
        while nxt < n and arrivals[nxt] <= step:
            engine.add_request(f"r{nxt}", prompts[nxt], SamplingParams(temperature=0.0, max_tokens=lengths[nxt],
                                                                       ignore_eos=True))
            nxt += 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
                engine.pop_finished(out.request_id)
        step += 1
    assert len(outputs) == n
    got = [outputs[f"r{i}"] for i in range(n)]
    assert [len(o) for o in got] == lengths
    nxt = dense_greedy_next(llm, [p + o for p, o in zip(prompts, got)])
    for i, (prompt, out) in enumerate(zip(prompts, got)):
        assert out == nxt[i][len(prompt) - 1:len(prompt) - 1 + len(out)], f"request {i}"
    assert engine.block_manager.num_free_pages == llm.runner.num_pages


def test_prefix_cache_serves_a_shared_system_prompt(llm):
    rng = np.random.default_rng(1)
    system = rng.integers(1, 512, 200).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompt_token_ids=[system + [7, 8, 9]], sampling_params=params)[0]
    second = llm.generate(prompt_token_ids=[system + [10, 11]], sampling_params=params)[0]
    assert second.metrics.num_cached_tokens >= 192
    cold = make_llm(enable_prefix_caching=False)
    want = cold.generate(prompt_token_ids=[system + [7, 8, 9], system + [10, 11]], sampling_params=params)
    assert first.outputs[0].token_ids == want[0].outputs[0].token_ids
    assert second.outputs[0].token_ids == want[1].outputs[0].token_ids
    assert llm.engine.metrics_summary()["prefix_cache_hit_rate"] > 0


def test_forked_samples_share_the_prompt_and_copy_on_write(llm):
    """n=2 forks mid-page: each sample equals a lone request with its seed; full prompt pages are held once."""
    prompt = np.random.default_rng(2).integers(1, 512, 40).tolist()  # two full pages + 8 tokens of a third
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    engine = llm.engine
    engine.add_request("fork", prompt, params)
    seen_shared = False
    while engine.has_unfinished_requests():
        engine.step()
        seqs = engine.requests["fork"].seqs
        written = all(s.num_computed_tokens > len(prompt) for s in seqs)  # both wrote past the fork point
        if written and not any(s.is_finished for s in seqs):
            a, b = seqs[0].pages, seqs[1].pages
            assert a[:2] == b[:2], "the full prompt pages must be shared, not copied"
            assert a[2] != b[2], "the partial page must have been copied on write"
            seen_shared = True
    assert seen_shared
    forked = engine.output_of("fork")
    engine.pop_finished("fork")
    for index in range(2):
        alone = llm.generate(prompt_token_ids=[prompt], sampling_params=params.replace(n=1, seed=5 + index))[0]
        assert forked.outputs[index].token_ids == alone.outputs[0].token_ids
    assert forked.outputs[0].token_ids != forked.outputs[1].token_ids


def test_mixed_policy_gives_the_same_outputs():
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 512, int(rng.integers(5, 200))).tolist() for _ in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    mixed = make_llm(scheduling_policy="mixed", max_num_batched_tokens=64)
    first = make_llm(scheduling_policy="prefill_first")
    a = mixed.generate(prompt_token_ids=prompts, sampling_params=params)
    b = first.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert mixed.engine.stats.decode_steps < first.engine.stats.decode_steps  # decodes rode along with prefills


def test_auto_runs_generate_prefill_first_and_streams_mixed():
    """scheduling_policy="auto" (mixed under the C++ kernel): `generate`, which reads only final outputs, runs no step
    that mixes decode rows with prompt chunks (prefill-first steps gave more throughput on a whole batch); a caller
    stepping for every output (streaming, the server) gets mixed steps; the tokens are the same."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 512, int(rng.integers(5, 200))).tolist() for _ in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = make_llm(scheduling_policy="auto", max_num_batched_tokens=64)
    assert llm.engine.scheduler.config.policy == "mixed" and llm.engine.throughput_first_offline
    steps = []
    schedule = llm.engine.scheduler.schedule

    def recorded(**kw):
        batch = schedule(**kw)
        if batch is not None:
            steps.append(sorted(set(batch.num_new_tokens) - {0}))
        return batch

    llm.engine.scheduler.schedule = recorded
    offline = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    mixes = sum(1 for sizes in steps if 1 in sizes and max(sizes) > 1)
    assert steps and mixes == 0
    steps.clear()
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"s{i}", prompt, params)
    streamed = {}
    while llm.engine.has_unfinished_requests():
        streamed |= {o.request_id: o.outputs[0].token_ids for o in llm.engine.step() if o.finished}
    assert any(1 in sizes and max(sizes) > 1 for sizes in steps)  # decode rows rode along with prompt chunks
    assert [streamed[f"s{i}"] for i in range(len(prompts))] == [o.outputs[0].token_ids for o in offline]


def test_priority_jumps_the_queue():
    llm = make_llm(max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for rid, prio in (("low-a", 0), ("low-b", 0), ("urgent", -1)):
        llm.engine.add_request(rid, [1, 2, 3], params, priority=prio)
    order = []
    while llm.engine.has_unfinished_requests():
        order += [o.request_id for o in llm.engine.step() if o.finished]
    assert order == ["urgent", "low-a", "low-b"]


def test_stream_deltas_add_up_to_the_final_output(llm):
    prompts = [[5, 6, 7], [9] * 30]
    params = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=9, ignore_eos=True)
    final = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    tokens: dict[tuple[str, int], list[int]] = {}
    finals = {}
    for delta in llm.stream(prompt_token_ids=prompts, sampling_params=params):
        tokens.setdefault((delta.request_id, delta.index), []).extend(delta.token_ids)
        if delta.output is not None:
            finals[delta.request_id] = delta.output
    assert len(finals) == 2
    for want, got in zip(final, sorted(finals.values(), key=lambda o: int(o.request_id))):
        for completion in got.outputs:
            assert tokens[(got.request_id, completion.index)] == completion.token_ids
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]


def test_background_loop_takes_requests_from_many_threads(llm):
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 512, int(rng.integers(3, 60))).tolist() for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    loop = llm.background()
    results: dict[int, list[int]] = {}

    def worker(ids: list[int]) -> None:
        for i in ids:
            results[i] = loop.submit(prompts[i], params).result().outputs[0].token_ids

    threads = [threading.Thread(target=worker, args=(list(range(k, 12, 4)),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    with pytest.raises(ValueError, match="prompt is empty"):
        loop.submit([], params)
    loop.close()
    assert [results[i] for i in range(12)] == [o.outputs[0].token_ids for o in want]


def test_a_failing_detokenizer_fails_only_its_request(llm, monkeypatch):
    """The fake tokenizer's detokenizer explodes for requests with skip_special_tokens=False."""

    class Detok:
        def __init__(self, explode: bool):
            self.explode = explode

        def add(self, ids):
            if self.explode:
                raise UnicodeDecodeError("utf-8", b"", 0, 1, "synthetic failure")
            return "x"

        def finish(self):
            return ""

    class FakeTokenizer:
        def detokenizer(self, skip_special_tokens=True, prompt_ids=()):
            return Detok(explode=not skip_special_tokens)

        def plain_texts(self, skip_special_tokens):
            return {}  # no token skips the detokenizer: every one goes through Detok.add

        def partial_bytes(self, skip_special_tokens):
            return {}

    monkeypatch.setattr(llm.engine, "tokenizer", FakeTokenizer())
    good = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    bad = good.replace(skip_special_tokens=False)
    outs = llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5, 6], [7, 8]], sampling_params=[good, bad, good])
    assert outs[1].error is not None and "synthetic failure" in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error"
    for out in (outs[0], outs[2]):
        assert out.error is None and out.outputs[0].text == "xxxxx" and len(out.outputs[0].token_ids) == 5
    assert llm.engine.block_manager.num_free_pages == llm.runner.num_pages


def test_update_weights_drops_the_prefix_cache(llm):
    prompt = list(range(1, 120))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt], sampling_params=params)
    assert llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].metrics.num_cached_tokens >= 112
    llm.update_weights(llm.get_params())
    assert llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].metrics.num_cached_tokens == 0


def test_prompt_logprobs_bypass_the_prefix_cache(llm):
    prompt = list(range(200, 260))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    first, second = (llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0] for _ in range(2))
    assert second.metrics.num_cached_tokens == 0 and len(second.prompt_logprobs) == len(prompt)
    assert second.prompt_logprobs == first.prompt_logprobs


def test_prefill_first_never_starves_decode():
    """A stream of long prompts: at most max_prefill_streak prefill steps run while a sequence waits to decode."""
    llm = make_llm(max_num_batched_tokens=32, max_num_seqs=16, scheduling_policy="prefill_first")
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(10):
        engine.add_request(f"long{i}", list(range(1 + i, 100 + i)), params)  # distinct: no prefix hits
    streak, worst = 0, 0
    while engine.has_unfinished_requests():
        decode_ready = any(s.num_uncomputed_tokens == 1 for s in engine.scheduler.running)
        batch_before = engine.stats.prefill_steps
        engine.step()
        prefilled = engine.stats.prefill_steps > batch_before
        streak = streak + 1 if (prefilled and decode_ready) else 0
        worst = max(worst, streak)
    assert worst == engine.scheduler.config.max_prefill_streak
