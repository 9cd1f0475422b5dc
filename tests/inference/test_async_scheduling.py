"""Async scheduling (inference/engine/async_scheduling.py): the outputs of the synchronous engine, with steps really
dispatched before the previous step's tokens are fetched; the synchronous fallback for what cannot overlap, and the
drain hooks (sleep, the engine loop's pause)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from inference import SamplingParams
from inference.engine.config import EngineConfig, SchedulerConfig
from inference.engine.llm_engine import Engine
from inference.structured.params import StructuredOutputsParams


def engines(llm, **scheduler) -> tuple[Engine, Engine]:
    """A fresh async engine and a fresh synchronous one over `llm`'s runner (its compiled steps), `scheduler`
    changed in their SchedulerConfig. Each is run to the end before the other starts, so neither's prefix cache
    sees pages the other rewrote."""
    config = dataclasses.replace(llm.engine.scheduler.config, **scheduler)
    llm.engine.reset_prefix_cache()  # the session engine's cached pages are rewritten below
    return tuple(Engine(llm.runner, llm.tokenizer, dataclasses.replace(config, async_scheduling=flag))
                 for flag in (True, False))


def drive(engine: Engine, requests: dict, later: dict, abort_at: dict, preempt_at: dict) -> dict:
    """Step `engine` to the end. `later`: requests added once a named request reported a token; `abort_at` /
    `preempt_at`: request -> reported output tokens after which it is aborted / preempted (once). The hooks key on
    reported outputs, so both engines apply them at the same point of each request."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    finals, reported = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            reported[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finals[out.request_id] = out
                engine.pop_finished(out.request_id)
        for trigger, (rid, ids, params) in list(later.items()):
            if reported.get(trigger, 0) >= 1:
                engine.add_request(rid, ids, params)
                del later[trigger]
        for rid, count in list(abort_at.items()):
            if reported.get(rid, 0) >= count:
                engine.abort(rid)
                finals[rid] = engine.output_of(rid)  # no step reports an abort between steps
                engine.pop_finished(rid)
                del abort_at[rid]
        for rid, count in list(preempt_at.items()):
            seq = engine.requests[rid].seqs[0] if rid in engine.requests else None
            if seq is not None and reported.get(rid, 0) >= count and seq in engine.scheduler.running:
                in_flight = engine.in_flight is not None and seq in engine.in_flight.rows
                finals.setdefault("_preempted_in_flight", []).append(in_flight)
                engine.scheduler.preempt(seq)
                del preempt_at[rid]
    return finals


def overlaps(events: list[tuple[str, int]]) -> int:
    """Steps whose dispatch returned before the previous step's tokens were fetched."""
    order = {key: i for i, key in enumerate(events)}
    steps = [step for kind, step in events if kind == "dispatch"]
    return sum(order[("dispatch", b)] < order.get(("fetch", a), -1) for a, b in zip(steps, steps[1:]))


def assert_same(a, b) -> None:
    assert a.keys() == b.keys()
    for rid in b:
        assert len(a[rid].outputs) == len(b[rid].outputs), rid
        for x, y in zip(a[rid].outputs, b[rid].outputs):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == \
                (y.token_ids, y.text, y.finish_reason, y.stop_reason), rid
            assert (x.logprobs is None) == (y.logprobs is None), rid
            for lx, ly in zip(x.logprobs or [], y.logprobs or []):
                assert lx.keys() == ly.keys(), rid
                for t in ly:
                    assert (lx[t].rank, lx[t].decoded_token) == (ly[t].rank, ly[t].decoded_token), rid
                    # Batches differ in composition between the two (finished rows linger a step), so the float
                    # sums may round differently; the tokens and ranks above are exact.
                    assert lx[t].logprob == pytest.approx(ly[t].logprob, abs=1e-4), rid


def test_async_equals_sync_on_a_mixed_workload_and_really_overlaps(smollm2, monkeypatch):
    tok = smollm2.tokenizer
    chat = lambda q: tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))  # noqa: E731
    shared = tok.encode("The committee met on a grey morning to read the long report on the river, the bridge, "
                        "the mill and the harbour, and to decide which of the four should be repaired first.")
    greedy = dict(temperature=0.0)
    requests = {
        "eos": (chat("Say hello in three words."), SamplingParams(max_tokens=40, **greedy)),
        "seeded-n2": (chat("Tell me a story."), SamplingParams(temperature=0.9, seed=7, max_tokens=14, n=2)),
        "stop-string": (chat("Count from one to ten."), SamplingParams(max_tokens=30, stop=["5", "five"], **greedy)),
        "logprobs": (chat("Name a colour."), SamplingParams(temperature=0.8, seed=3, max_tokens=10, logprobs=3)),
        "prefix-a": (shared + tok.encode(" The bridge"), SamplingParams(max_tokens=8, **greedy)),
        "min-tokens": (chat("Hi"), SamplingParams(max_tokens=9, min_tokens=6, logit_bias={11: 1.5}, **greedy)),
        "abort": (chat("Describe the sea."), SamplingParams(temperature=0.7, seed=11, max_tokens=40)),
        "preempt": (chat("Name three trees."), SamplingParams(max_tokens=16, **greedy)),
        "penalty": (chat("List fruits."), SamplingParams(max_tokens=4, repetition_penalty=1.3, **greedy)),
        "structured": (chat("Is water wet? Answer yes or no."),
                       SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
                                      **greedy)),
    }
    later = {"prefix-a": ("prefix-b", shared + tok.encode(" The mill"), SamplingParams(max_tokens=8, **greedy))}
    async_engine, sync_engine = engines(smollm2)
    assert async_engine.async_scheduling and not sync_engine.async_scheduling

    events, alive = [], []  # (kind, step id): the order of dispatches and fetches; the steps kept (ids stay unique)
    runner = smollm2.runner
    execute, fetch = runner.execute, runner.fetch

    def traced_execute(*args, **kwargs):
        pending = execute(*args, **kwargs)
        alive.append(pending)
        events.append(("dispatch", id(pending)))
        return pending

    def traced_fetch(pending):
        events.append(("fetch", id(pending)))
        return fetch(pending)

    monkeypatch.setattr(runner, "execute", traced_execute)
    monkeypatch.setattr(runner, "fetch", traced_fetch)
    got = drive(async_engine, requests, dict(later), {"abort": 4}, {"preempt": 8})
    async_events, events[:] = list(events), []
    want = drive(sync_engine, requests, dict(later), {"abort": 4}, {"preempt": 8})
    # The async preemption hit a sequence whose token was still on the device (the "recompute" fallback below).
    assert got.pop("_preempted_in_flight") == [True] and want.pop("_preempted_in_flight") == [False]
    assert_same(got, want)

    # The workload covers what it claims: EOS, a stop string, lengths, an abort, a prefix hit, a preemption.
    assert want["eos"].outputs[0].finish_reason == "stop" and want["eos"].outputs[0].stop_reason is None
    assert want["stop-string"].outputs[0].stop_reason in ("5", "five")
    assert want["seeded-n2"].outputs[0].token_ids != want["seeded-n2"].outputs[1].token_ids
    assert want["abort"].outputs[0].finish_reason == "abort" and len(want["abort"].outputs[0].token_ids) == 4
    assert got["prefix-b"].metrics.num_cached_tokens > 0 and want["prefix-b"].metrics.num_cached_tokens > 0
    assert async_engine.scheduler.num_preemptions >= 1 and sync_engine.scheduler.num_preemptions >= 1
    assert got["structured"].outputs[0].text in ("yes", "no")

    # Overlap happened: steps were dispatched before the previous step's tokens were fetched (never when sync).
    stats = async_engine.async_stats
    assert overlaps(async_events) > 0 and stats.overlapped_steps == overlaps(async_events)
    assert overlaps(events) == 0 and sync_engine.async_stats.overlapped_steps == 0
    # The synchronous fallback ran for what cannot overlap, and the engine left nothing behind.
    assert {"structured_outputs", "penalties", "recompute"} <= stats.sync_steps.keys(), stats
    assert stats.wasted_rows > 0
    for engine in (async_engine, sync_engine):  # a last step of wasted rows may stay in flight: drain folds it
        assert not engine.has_unfinished_requests() and engine.drain() == [] and engine.in_flight is None
        assert not engine.requests
        assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


@pytest.fixture(scope="module")
def starved():
    """The tiny Llama with a pool too small for its batch (preemptions come from the scheduler)."""
    from tests.llm_configs import SMALL_POOL

    return SMALL_POOL.build(kv_cache_memory_bytes=1 << 15, max_num_seqs=6, max_num_batched_tokens=64)


@pytest.mark.parametrize("policy", ["prefill_first", "mixed"])
def test_async_equals_sync_under_page_pressure(starved, policy):
    """Preemptions from page pressure (async ones may come a step earlier or later, from pages a finished sequence
    frees one step later), and with the mixed policy decode rows fed from the device beside prompt chunks (and
    preempted sequences recomputed in the same step): every sequence still gets the same tokens."""
    llm = starved
    rng = np.random.default_rng(0)
    requests = {f"r{i}": (rng.integers(1, 200, int(rng.integers(4, 20))).tolist(),
                          SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=int(rng.integers(8, 24)),
                                         logprobs=1 if i % 3 == 0 else None, ignore_eos=True))
                for i in range(10)}
    async_engine, sync_engine = engines(llm, policy=policy)
    got = drive(async_engine, requests, {}, {}, {})
    want = drive(sync_engine, requests, {}, {}, {})
    assert_same(got, want)
    assert sync_engine.scheduler.num_preemptions > 0 and async_engine.scheduler.num_preemptions > 0
    assert async_engine.async_stats.overlapped_steps > 0


def test_drain_hooks_pause_and_sleep(tiny_llama):
    llm = tiny_llama
    engine = llm.engine
    assert engine.async_scheduling
    # The step dispatched beside a request's last one has only its wasted row: folded at once, so an idle engine
    # has nothing on the device and sleep may free the cache. An abort that leaves nothing running does the same.
    engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.add_request("aborted", [5, 6], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    overlapped = engine.async_stats.overlapped_steps
    while not engine.requests["short"].finished:
        engine.step()
    assert engine.async_stats.overlapped_steps > overlapped and engine.in_flight is not None
    engine.abort("aborted")
    assert engine.in_flight is None and not engine.has_unfinished_requests()
    for rid in ("short", "aborted"):
        engine.pop_finished(rid)
    llm.sleep(1)
    assert llm.is_sleeping
    llm.wake_up()
    # A request whose last token is still in flight: sleep folds it, and the next step reports the final output.
    engine.add_request("last", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step(), engine.step()
    assert engine.in_flight is not None and not engine.requests["last"].finished
    llm.sleep(1)
    llm.wake_up()
    [final] = engine.step()
    assert final.request_id == "last" and final.finished and len(final.outputs[0].token_ids) == 2
    engine.pop_finished("last")

    want = llm.generate(prompt_token_ids=[[9, 8, 7, 6]], sampling_params=SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    loop = llm.background()
    try:
        stream = loop.submit([9, 8, 7, 6], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        tokens = []
        for delta in stream:
            tokens += delta.token_ids
            if len(tokens) >= 3:
                break
        loop.pause()  # returns with the in-flight step folded and its delta queued
        assert engine.in_flight is None
        seq = engine.requests[stream.request_id].seqs[0]
        assert seq.output_token_ids == want[:seq.num_output_tokens]
        loop.resume()
        assert stream.result().outputs[0].token_ids == want
    finally:
        loop.close()


def test_the_switch():
    assert SchedulerConfig().async_scheduling is True
    assert EngineConfig.from_kwargs(async_scheduling=False).scheduler.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        SchedulerConfig(async_scheduling="yes")


def test_a_step_that_fails_on_the_device_fails_its_requests_only(tiny_llama, monkeypatch):
    """The in-flight step's fetch raises (a device error surfacing late): the sequences waiting on its tokens fail
    with that error and keep no placeholder; a request added afterwards runs normally."""
    engine, _ = engines(tiny_llama)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [8, 9], params)
    engine.step()  # the prefill, now in flight
    assert engine.in_flight is not None and len(engine.in_flight.rows) == 2
    real_fetch = engine.runner.fetch

    def broken(pending):
        monkeypatch.setattr(engine.runner, "fetch", real_fetch)  # only this once
        raise RuntimeError("XLA runtime error: the device went away")

    monkeypatch.setattr(engine.runner, "fetch", broken)
    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == {"a", "b"} and all(o.finished for o in outs.values())
    assert all("device went away" in o.error and o.outputs[0].finish_reason == "error" for o in outs.values())
    assert all(-1 not in s.token_ids for r in engine.requests.values() for s in r.seqs)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("c", [5, 6, 7], params)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    final = final or engine.output_of("c")
    assert final.error is None and len(final.outputs[0].token_ids) == 6


def test_the_early_readback_is_started_off_the_cpu_only(tiny_llama, monkeypatch):
    """A dispatched step's tokens start their copy to the host at dispatch on an accelerator; on a CPU device the
    buffer is host memory already and no copy is started. Either way the async engine's tokens are the same."""
    runner = tiny_llama.runner
    assert runner.copies_early is False  # the CPU the tests run on
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=7, ignore_eos=True)
    runs = []
    for early in (False, True):
        monkeypatch.setattr(runner, "copies_early", early)
        engine, _ = engines(tiny_llama)
        finals = drive(engine, {f"r{i}": ([5 + i, 6, 7], params) for i in range(4)}, {}, {}, {})
        runs.append({rid: out.outputs[0].token_ids for rid, out in finals.items()})
    assert runs[0] == runs[1] and all(len(t) == 7 for t in runs[0].values())


def test_a_narrower_engine_over_the_same_runner_keeps_the_token_feed_wide_enough(tiny_llama):
    """Engines built over one runner share its feed width: an engine of 2 sequences built after this LLM's must not
    narrow the tokens its steps return, or the LLM's next async step of more rows could not widen the feed (a
    server test failed so after a structured-outputs test built a 2-sequence engine over the shared model)."""
    llm = tiny_llama
    narrow = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)
    Engine(llm.runner, llm.tokenizer, narrow)
    assert llm.runner.feed_width >= llm.engine.limits.max_seqs
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 6, 7] for i in range(6)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0].outputs[0].token_ids for p in prompts[:2]]
    assert [len(t) for t in together] == [6] * 6 and list(together[:2]) == list(alone)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_finished_only_steps_return_the_finished_outputs_of_full_steps(tiny_llama, async_scheduling):
    """`Engine.step(finished_only=True)` (what `LLM.generate` steps with) returns, step for step, exactly the
    outputs of `step()` that are finished, in the same order, across arrivals, an abort, a stop string and a
    `settle` between steps; the not-finished ones are never built."""
    config = dataclasses.replace(tiny_llama.engine.scheduler.config, async_scheduling=async_scheduling)
    rng = np.random.default_rng(3)
    requests = [(f"q{i}", rng.integers(1, 200, int(rng.integers(2, 12))).tolist(),
                 SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=int(rng.integers(1, 9)),
                                ignore_eos=True, stop_token_ids=[7] if i % 3 == 0 else None)) for i in range(12)]
    per_step, built = [], []
    for finished_only in (False, True):
        tiny_llama.engine.reset_prefix_cache()
        engine = Engine(tiny_llama.runner, tiny_llama.tokenizer, config)
        output = engine._output
        engine._output = lambda request: built.append(finished_only) or output(request)
        steps, step = [], 0
        pending = list(requests)
        while pending or engine.has_unfinished_requests():
            for _ in range(2 if step % 3 == 0 else 0):
                if pending:
                    engine.add_request(*pending.pop(0))
            if step == 4:
                engine.abort("q1")
                engine.pop_finished("q1")  # the caller has it: no later step reports it
            if step == 6:
                engine.settle()
            outs = engine.step(finished_only=finished_only)
            steps.append([(o.request_id, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                          for o in outs if o.finished])
            for o in outs:
                if o.finished:
                    engine.pop_finished(o.request_id)
            step += 1
        assert not engine.finished_ids and not engine.requests
        per_step.append(steps)
    assert per_step[0] == per_step[1]
    reported = [rid for step in per_step[1] for rid, _, _ in step]
    assert len(reported) == len(set(reported)) and set(reported) | {"q1"} == {rid for rid, _, _ in requests}
    assert built.count(True) < built.count(False)  # unfinished outputs were not built


def test_parameter_checks_follow_the_joins():
    """`sync_reasons` checks a row's parameters until it is found clean, then never again: a penalty row makes every
    step it is in synchronous, and the steps after it left overlap; the clean rows are checked once."""
    from inference.engine.async_scheduling import ParamsChecked, sync_reasons
    from inference.engine.scheduled_batch import ScheduledBatch
    from inference.engine.sequence import Sequence

    def seq(i: int, **params) -> Sequence:
        s = Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=[1, 2, 3], num_prompt_tokens=3,
                     params=SamplingParams(**params), seed=i, arrival_order=i)
        s.num_computed_tokens = 2
        return s

    clean = [seq(i) for i in range(4)]
    penalty = seq(9, repetition_penalty=1.2)
    checked = ParamsChecked()
    assert sync_reasons(ScheduledBatch(clean, [1] * 4), None, checked) == set()
    assert checked.seqs == set(clean) and checked.unchecked(clean) == []
    for _ in range(2):  # the penalty row is checked, and found, at every step it is in
        assert sync_reasons(ScheduledBatch(clean[:2] + [penalty], [1] * 3), None, checked) == {"penalties"}
        assert checked.unchecked(clean[:2] + [penalty]) == [penalty]
    assert sync_reasons(ScheduledBatch(clean[1:], [1] * 3), None, checked) == set()
