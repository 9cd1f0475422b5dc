"""The persistent decode batch (inference/engine/persistent_batch.py): steps derived from the last decode step's
arrays give exactly the outputs of steps built from the sequences, under random arrivals, aborts and stop strings,
and the derived inputs equal the general path's array for array."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from inference import SamplingParams
from inference.engine.llm_engine import Engine
from inference.engine.persistent_batch import PersistentDecodeBatch
from inference.runtime.batch import build_model_input


class _NeverReuse(PersistentDecodeBatch):
    """The general path for every step: each step's input built from the sequences (the engine before the kept
    batch)."""

    def next_step(self, batch, changes, last_token=None):
        return None


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """The tiny random Llama with SmolLM2's tokenizer and its first 4096 ids (so stop strings see real text, and
    byte tokens that are not whole UTF-8 alone come up; the sampler's work over the full 49,152 ids took much of
    these tests' time)."""
    from inference import LLM
    from scripts.bench.overhead_bench import tiny_model_folder

    folder = tiny_model_folder(os.path.join(tmp_path_factory.mktemp("tiny"), "tiny"), vocab=4096)
    return LLM(folder, dtype="float32", max_num_seqs=32, max_num_batched_tokens=256, page_size=8,
               kv_cache_memory_bytes=1 << 22, max_model_len=256, seed=0, compilation_cache_dir=None)


def _workload(rng: np.random.Generator, vocab: int, count: int):
    requests = []
    for i in range(count):
        prompt = rng.integers(1, vocab, int(rng.integers(3, 40))).tolist()
        stop = [["e"], ["the", " a"], []][i % 3]
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=int(rng.integers(2, 20)),
                                stop=stop, include_stop_str_in_output=i % 5 == 0, ignore_eos=i % 7 != 0)
        requests.append((f"r{i}", prompt, params))
    return requests


def drive(engine: Engine, requests, arrivals: list[int], aborts: dict[str, int], seen: list | None = None,
          finished_only: bool = False) -> dict:
    """Step to the end: `arrivals[k]` requests join before step k (the rest after the last), a request in `aborts`
    is aborted once it has reported that many tokens; `seen` gets every step's outputs' (request, text, tokens,
    reasons); `finished_only`: the steps `LLM.generate` takes (only finished outputs come back)."""
    pending, finals, step = list(requests), {}, 0
    while pending or engine.has_unfinished_requests():
        for _ in range(arrivals[step] if step < len(arrivals) else len(pending)):
            if pending:
                engine.add_request(*pending.pop(0))
        step += 1
        for out in engine.step(finished_only=finished_only):
            rid = out.request_id
            if seen is not None:
                c = out.outputs[0]
                seen.append((rid, c.text, tuple(c.token_ids), c.finish_reason, c.stop_reason))
            if out.finished:
                finals[rid] = out
                engine.pop_finished(rid)
            elif rid in aborts and len(out.outputs[0].token_ids) >= aborts[rid]:
                engine.abort(rid)
                finals[rid] = engine.output_of(rid)
                engine.pop_finished(rid)
    return finals


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_kept_batch_gives_the_general_paths_outputs(llm, async_scheduling):
    """256 requests arriving at random steps (a Poisson count per step), a tenth aborted mid-generation, stop strings
    on two thirds: every output (tokens, text, finish and stop reason) equals the general path's, and most decode
    steps were derived from the kept batch."""
    rng = np.random.default_rng(0)
    requests = _workload(rng, llm.runner.config.vocab_size, 256)
    arrivals = rng.poisson(6, 200).tolist()
    aborts = {rid: int(rng.integers(1, 6)) for rid, _, _ in requests if rng.random() < 0.1}
    config = dataclasses.replace(llm.engine.scheduler.config, async_scheduling=async_scheduling)
    results = []
    for persistent in (PersistentDecodeBatch, _NeverReuse):
        llm.engine.reset_prefix_cache()
        engine = Engine(llm.runner, llm.tokenizer, config)
        engine.persistent = persistent(engine.page_size)
        results.append((drive(engine, requests, arrivals, dict(aborts)), engine))
    (got, kept), (want, general) = results
    assert got.keys() == want.keys() == {rid for rid, _, _ in requests}
    for rid in want:
        a, b = got[rid].outputs[0], want[rid].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
            (b.token_ids, b.text, b.finish_reason, b.stop_reason), rid
    reasons = {out.outputs[0].finish_reason for out in want.values()}
    assert {"stop", "length", "abort"} <= reasons  # the workload exercised every way to finish
    assert any(isinstance(out.outputs[0].stop_reason, str) for out in want.values())
    assert kept.persistent.reused_steps > 0 and general.persistent.reused_steps == 0
    for engine in (kept, general):
        assert not engine.requests
        assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_derived_step_equals_the_built_one(llm, async_scheduling):
    """Each derived decode input equals what `build_model_input` makes from the sequences, across page boundaries
    (a new page written as one entry); with async scheduling, also where every row's token is the
    in-flight placeholder (not read: `last_token`)."""
    engine = Engine(llm.runner, llm.tokenizer, dataclasses.replace(llm.engine.scheduler.config,
                                                                   async_scheduling=async_scheduling))
    rng = np.random.default_rng(1)
    for i in range(12):
        engine.add_request(f"d{i}", rng.integers(1, 500, int(rng.integers(3, 20))).tolist(),
                           SamplingParams(temperature=0.8, seed=i, max_tokens=30, ignore_eos=True))
    checked, unread, appended = 0, 0, 0
    original = engine.persistent.next_step

    def checking(batch, changes, last_token=None):
        nonlocal checked, unread, appended
        unread += last_token is not None
        derived = original(batch, changes, last_token)
        if derived is not None:
            appended += len(changes.appended)  # pages opened at page boundaries, written as single entries
            inp, sampling, _ = derived
            built, _ = build_model_input(batch, engine.page_size, engine.limits)
            for name in ("tokens", "positions", "logits_indices", "target_ids"):
                np.testing.assert_array_equal(getattr(inp, name), getattr(built, name), err_msg=name)
            for name in ("slot_mapping", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"):
                np.testing.assert_array_equal(getattr(inp.attn, name), getattr(built.attn, name), err_msg=name)
            assert inp.attn.max_q_len == built.attn.max_q_len
            np.testing.assert_array_equal(sampling.step[:len(batch.seqs)], [s.num_output_tokens for s in batch.seqs])
            checked += 1
        return derived

    engine.persistent.next_step = checking
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                engine.pop_finished(out.request_id)
    assert checked >= 20 and appended >= 12  # every row crossed at least one page boundary in a derived step
    assert (unread >= 20) if async_scheduling else not unread


def test_async_folds_equal_sync_on_256_requests_and_prefill_steps_overlap(llm):
    """The one fold of both engines (`Engine._fold_tokens`): 256 requests arriving at random steps, aborts and stop
    strings give the async engine exactly the synchronous engine's outputs; every request got its first-scheduled
    time (set only for the sequences a step admits) before its first token; async prefill steps are dispatched
    before the previous step's tokens are fetched, like decode steps; a step derived from the kept batch compiles
    nothing (no retracing in the steady state)."""
    rng = np.random.default_rng(2)
    requests = _workload(rng, llm.runner.config.vocab_size, 256)
    arrivals = rng.poisson(8, 200).tolist()
    aborts = {rid: int(rng.integers(1, 6)) for rid, _, _ in requests if rng.random() < 0.1}
    runner = llm.runner
    dispatches = []  # (prefill step, dispatched with the previous step unfetched, derived, compiled during it)
    execute = runner.execute

    def traced(inp, sampling, *, is_decode, fetch=True, **kwargs):
        derived = engine.persistent.reused_steps != derived_before[0]
        derived_before[0] = engine.persistent.reused_steps
        compiled = sum(runner.num_compilations().values())
        in_flight = engine.in_flight is not None
        result = execute(inp, sampling, is_decode=is_decode, fetch=fetch, **kwargs)
        dispatches.append((not is_decode, in_flight, derived, sum(runner.num_compilations().values()) - compiled))
        return result

    runner.execute = traced
    try:
        results = {}
        for flag in (True, False):
            llm.engine.reset_prefix_cache()
            engine = Engine(runner, llm.tokenizer, dataclasses.replace(llm.engine.scheduler.config,
                                                                       async_scheduling=flag))
            derived_before = [0]
            results[flag] = drive(engine, requests, arrivals, dict(aborts))
            if flag:
                async_dispatches, dispatches = dispatches, []
    finally:
        del runner.execute
    got, want = results[True], results[False]
    assert got.keys() == want.keys() == {rid for rid, _, _ in requests}
    for rid in want:
        a, b = got[rid].outputs[0], want[rid].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
            (b.token_ids, b.text, b.finish_reason, b.stop_reason), rid
    assert {"stop", "length", "abort"} <= {out.outputs[0].finish_reason for out in want.values()}
    for out in (*got.values(), *want.values()):
        m = out.metrics
        assert m.first_scheduled_time is not None and m.arrival_time <= m.first_scheduled_time
        assert m.first_token_time is None or m.first_scheduled_time <= m.first_token_time
    assert any(prefill and in_flight for prefill, in_flight, _, _ in async_dispatches)
    derived = [compiled for *_, was_derived, compiled in async_dispatches + dispatches if was_derived]
    assert derived and not any(derived)


@pytest.mark.parametrize("policy", ["prefill_first", "mixed"])
def test_recompute_mid_decode_under_async_scheduling(llm, policy):
    """Every running sequence preempted and recomputed mid-decode (`recompute_running`, what a weight update does)
    under async scheduling: the rows come back as the same rows in the same order, and the steady pass must read
    them again (`Scheduler.advanced`'s hint from before the preemption is stale): greedy tokens equal the
    synchronous engine's without a recompute, and no decode row is left behind its tokens."""
    rng = np.random.default_rng(0)
    requests = [(f"r{i}", rng.integers(1, 500, 10 + i).tolist(),
                 SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)) for i in range(12)]
    finals = {}
    for async_scheduling, recompute_at in ((False, None), (True, 7)):
        llm.engine.reset_prefix_cache()
        engine = Engine(llm.runner, llm.tokenizer, dataclasses.replace(
            llm.engine.scheduler.config, async_scheduling=async_scheduling, policy=policy))
        for request in requests:
            engine.add_request(*request)
        tokens, step, behind = {}, 0, 0
        while engine.has_unfinished_requests():
            step += 1
            if step == recompute_at:
                assert engine.recompute_running() == len(requests)
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
                    engine.pop_finished(out.request_id)
            behind += sum(s.num_tokens - s.num_computed_tokens > 2 for s in engine.scheduler.running
                          if s.num_computed_tokens >= s.num_prompt_tokens)
        finals[async_scheduling] = tokens
        assert behind == 0
    assert finals[True] == finals[False]


@pytest.mark.parametrize("policy", ["prefill_first", "mixed"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_schedulers_counts_are_the_rows_counts_where_they_are_read(llm, async_scheduling, policy, monkeypatch):
    """`ScheduledBatch.starts` / `lengths` (read once by the scheduler, then taken by the build, async scheduling's
    checks and its advance instead of walking the rows again) equal each row's computed tokens and token count
    where the step is built and where it is advanced, and the advance's counts equal the rows' where the fold of
    that step reads them (`InFlightStep.lengths`), with prompts sharing prefixes (prefix hits), `n=2` forks,
    arrivals, aborts, stop strings and a recompute of every running sequence mid-way."""
    from inference.engine import async_scheduling as async_module

    rng = np.random.default_rng(5)
    shared = rng.integers(1, 500, 20).tolist()
    requests = []
    for i, (rid, prompt, params) in enumerate(_workload(rng, llm.runner.config.vocab_size, 96)):
        requests.append((rid, shared + prompt if i % 2 else prompt,
                         dataclasses.replace(params, n=2, seed=i) if i % 9 == 0 else params))
    engine = Engine(llm.runner, llm.tokenizer, dataclasses.replace(
        llm.engine.scheduler.config, async_scheduling=async_scheduling, policy=policy))
    seen = {"execute": 0, "advance": 0, "split": 0}

    def check(batch, where: str) -> None:
        if batch.starts is None:
            return
        seen[where] += 1
        np.testing.assert_array_equal(batch.starts, [s.num_computed_tokens for s in batch.seqs], err_msg=where)
        np.testing.assert_array_equal(batch.lengths, [len(s.token_ids) for s in batch.seqs], err_msg=where)

    execute, advance_rows = engine._execute, async_module._advance_rows

    def checked_execute(batch, *args, **kwargs):
        check(batch, "execute")
        return execute(batch, *args, **kwargs)

    def checked_advance(eng, batch, pending):
        check(batch, "advance")
        return advance_rows(eng, batch, pending)

    split = engine.plain_rows.split

    def checked_split(seqs, tokens, now, lengths=None):
        if lengths is not None:  # the advance's counts, carried to the fold of its step
            seen["split"] += 1
            np.testing.assert_array_equal(lengths, [len(s.token_ids) for s in seqs], err_msg="split")
        return split(seqs, tokens, now, lengths)

    engine._execute = checked_execute
    engine.plain_rows.split = checked_split
    monkeypatch.setattr(async_module, "_advance_rows", checked_advance)
    arrivals = rng.poisson(4, 60).tolist()
    aborts = {rid: int(rng.integers(1, 6)) for rid, _, _ in requests if rng.random() < 0.1}
    recompute, recomputed = engine.step, []

    def step(finished_only=False):
        if seen["execute"] == 15:
            recomputed.append(engine.recompute_running())
        return recompute(finished_only)

    engine.step = step
    finals = drive(engine, requests, arrivals, aborts)
    assert finals.keys() == {rid for rid, _, _ in requests}
    assert recomputed and recomputed[0] > 0
    assert seen["execute"] > 30
    assert (seen["advance"] > 10 and seen["split"] > 10) if async_scheduling else not (seen["advance"] or seen["split"])
    assert not engine.requests and engine.block_manager.num_free_pages == engine.block_manager.num_pages
