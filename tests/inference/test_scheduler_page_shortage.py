"""The scheduler when the page pool runs short, host side only (no model runs; a step's bookkeeping is the
engine's, simulated): prompts part-way through their chunks that hold every page do not wait on each other forever
(the newest gives its pages back), and a sequence that alone outgrows the cache fails by itself (`on_fail`), with
the fix named, instead of raising out of the step."""

from __future__ import annotations

import dataclasses

import pytest

from inference.engine.config import SchedulerConfig
from inference.engine.pages.kv_cache_manager import KVCacheManager
from inference.engine.scheduler import Scheduler
from inference.engine.sequence import Sequence, SequenceStatus
from inference.sampling.params import SamplingParams
from tests.inference.test_state_scheduling import make, request, run

PAGE = 8


def _seq(i: int, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=list(range(1 + 100 * i, 1 + 100 * i + prompt_len)),
                    num_prompt_tokens=prompt_len, params=SamplingParams(max_tokens=max_tokens), seed=0,
                    arrival_order=i)


def _drive(scheduler: Scheduler, max_steps: int = 500) -> list[list[tuple[int, int]]]:
    """Step until idle (a hang fails at `max_steps`); every step's (sequence, tokens) rows."""
    log = []
    for _ in range(max_steps):
        if not scheduler.has_work():
            return log
        batch = scheduler.schedule()
        if batch is None:  # the pass that failed a sequence may have scheduled nothing else
            continue
        log.append([(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)])
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert seq.status is SequenceStatus.RUNNING
            seq.num_computed_tokens += n
            scheduler.block_manager.commit_full_pages(seq)
            if seq.num_computed_tokens >= seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    seq.status = SequenceStatus.FINISHED
                    scheduler.remove(seq)
    raise AssertionError(f"still busy after {max_steps} steps")


def _hybrid(policy: str) -> tuple[Scheduler, object, object]:
    """The scheduler of a model with state layers (`test_state_scheduling`'s fake device checks every state read),
    8 pages of 8 tokens, 32-token steps, prefix caching on: a prompt chunk is cut where a state checkpoint is worth
    keeping, so the rest of a step's budget starts the next prompt and two prompts can be part-way at once (a
    model without state layers has at most one: only the budget cuts its chunks)."""
    sched, state, dev = make(num_pages=8, num_slots=8, budget=32)
    sched.config = dataclasses.replace(sched.config, policy=policy)
    return sched, state, dev


@pytest.mark.parametrize("policy", ["prefill_first", "mixed"])
def test_prompts_holding_every_page_part_way_do_not_deadlock(policy):
    """A 53- and a 51-token prompt: after two steps the older holds 6 pages, the newer 2, neither has its prompt
    computed and no page is free. The older's next chunk needs a page: the newer is preempted and both finish, each
    reading the right state at every step."""
    sched, state, dev = _hybrid(policy)
    (a,), (b,) = request(list(range(1, 54)), max_tokens=4), request(list(range(101, 152)), max_tokens=4)
    sched.add(a)
    sched.add(b)
    run(sched, state, dev)  # asserts a batch at every step while work is left
    assert a.is_finished and b.is_finished
    assert sched.num_preemptions >= 1


def test_a_prompt_stalled_beside_a_decoding_row_waits_for_it():
    """A prompt part-way that finds no page while an older sequence decodes is no deadlock (the decoding one
    finishes and frees its pages): it waits, and nobody is preempted for it."""
    sched, state, dev = _hybrid("mixed")
    # a (29 tokens, 3 more) stays within its 4 pages; b takes the other 4 and stalls part-way until a finishes.
    (a,), (b,) = request(list(range(1, 30)), max_tokens=3), request(list(range(101, 152)), max_tokens=2)
    sched.add(a)
    sched.add(b)
    stalled = []
    schedule = sched._schedule

    def spy(throughput_first):
        batch = schedule(throughput_first)
        stalled.append(sched._stalled and batch is not None)
        return batch

    sched._schedule = spy
    run(sched, state, dev)
    assert a.is_finished and b.is_finished
    assert any(stalled)  # the case arose: b stalled in a step a decoded in
    assert sched.num_preemptions == 0


def _outgrowing() -> tuple[Scheduler, Sequence, Sequence, list]:
    """A sequence allowed past the pool (max_model_len above it, as an engine built by hand may be) beside one that
    fits; `failed` collects `on_fail`'s calls."""
    failed = []

    def on_fail(seq, exc):
        failed.append((seq, exc))
        seq.status = SequenceStatus.FINISHED
        scheduler.remove(seq)

    manager = KVCacheManager(4, PAGE)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, async_scheduling=False)
    scheduler = Scheduler(config, manager, max_model_len=512, on_fail=on_fail)
    long, short = _seq(0, 20, 100), _seq(1, 5, 3)
    return scheduler, long, short, failed


def test_a_sequence_that_alone_outgrows_the_cache_fails_alone():
    scheduler, long, short, failed = _outgrowing()
    scheduler.add(long)
    scheduler.add(short)
    _drive(scheduler)
    assert [seq for seq, _ in failed] == [long]
    message = str(failed[0][1])
    assert "r0" in message and "needs 5 KV pages but the cache has 4" in message
    assert "kv_cache_memory_bytes" in message and "max_tokens" in message
    assert short.num_output_tokens == 3  # the other request ran to its end
    assert long.num_computed_tokens == 4 * PAGE  # it ran until the cache was full


def test_without_on_fail_the_step_raises_with_the_fix():
    scheduler, long, _, _ = _outgrowing()
    scheduler.on_fail = None
    scheduler.add(long)
    with pytest.raises(RuntimeError, match="needs 5 KV pages but the cache has 4.*kv_cache_memory_bytes"):
        _drive(scheduler)
