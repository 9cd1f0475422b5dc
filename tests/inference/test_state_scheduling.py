"""The scheduler's state-slot rules (inference/engine/scheduler.py with a StateSlotManager), host side only.

A fake device holds per state slot the tuple of tokens its state summarizes. Every step checks that each scheduled
sequence reads exactly the state of its computed tokens (zeros when it has none), so prefix hits restored from
checkpoints, forks of `n` samples, preemption and chunked prompts are checked together; the bookkeeping after a
step is the engine's (`Engine._advance`: computed tokens, full pages, state checkpoint, forks).
"""

from __future__ import annotations

import pytest

from inference.engine.config import SchedulerConfig
from inference.engine.pages.kv_cache_manager import KVCacheManager
from inference.engine.pages.state_slots import StateSlotManager
from inference.engine.scheduler import Scheduler
from inference.engine.sequence import Sequence, SequenceStatus
from inference.sampling.params import SamplingParams
from tests.inference.test_state_slots import FakeStates

PAGE = 8
_ids = iter(range(1 << 30))


def request(prompt: list[int], n: int = 1, max_tokens: int = 3) -> list[Sequence]:
    rid = f"r{next(_ids)}"
    params = SamplingParams(n=n, max_tokens=max_tokens)
    return [Sequence(seq_id=next(_ids), request_id=rid, index=i, token_ids=list(prompt),
                     num_prompt_tokens=len(prompt), params=params, seed=i, arrival_order=next(_ids))
            for i in range(n)]


def make(num_pages: int = 64, num_slots: int = 16, budget: int = 64, max_num_seqs: int = 4, prefix: bool = True):
    state = StateSlotManager(num_slots, enable_prefix_caching=prefix)
    kv = KVCacheManager(num_pages, PAGE, enable_prefix_caching=prefix)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, async_scheduling=False)
    return Scheduler(config, kv, state=state), state, FakeStates(num_slots)


def run(sched: Scheduler, state: StateSlotManager, dev: FakeStates, chunks: list | None = None) -> None:
    """Step until idle; `chunks` collects (sequence, start, end) of every prompt chunk."""
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None
        sched.block_manager.take_copies()  # KV page copies: not modelled here
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert seq.state_slot != 0 and seq.status is SequenceStatus.RUNNING
            if chunks is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                chunks.append((seq, seq.num_computed_tokens, seq.num_computed_tokens + n))
        dev.run_copies(state.take_copies())
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            prev = () if start == 0 else dev.slots[seq.state_slot]
            assert prev == tuple(seq.token_ids[:start]), f"sequence {seq.seq_id} read the state of {prev}"
            dev.slots[seq.state_slot] = tuple(seq.token_ids[:start + n])
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += n
            sched.block_manager.commit_full_pages(seq)
            sched.checkpoint_state(seq)
            if sched.fork_due(seq):
                sched.fork_samples(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(1000 + 10 * seq.index + seq.num_output_tokens)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    seq.status = SequenceStatus.FINISHED
                    sched.remove(seq)


def test_prompt_chunks_end_on_pages_and_a_later_prefix_hits_the_checkpoint():
    sched, state, dev = make(budget=20)
    prompt = list(range(1, 38))  # 37 tokens: the last full page before the last token ends at 32
    (a,) = request(prompt)
    sched.add(a)
    chunks = []
    run(sched, state, dev, chunks)
    ends = [end for _, _, end in chunks]
    assert ends == [16, 32, 37], ends  # budget 20 rounded down to pages; cut at 32 (the last full page)
    assert state.checkpoints and state.checkpoint_hits == 0
    (b,) = request(prompt[:33] + [99, 98, 97])  # shares 33 tokens: 4 full pages
    sched.add(b)
    run(sched, state, dev)
    assert b.num_cached_tokens == 32 and state.checkpoint_hits == 1
    assert not sched.running and len(state.free_slots) + len(state.checkpoints) == state.num_slots - 1


def test_prefix_hit_only_where_a_checkpoint_is():
    sched, state, dev = make(budget=64)
    prompt = list(range(1, 30))  # one chunk would cover it: cut at 24 (the last full page) only
    (a,) = request(prompt)
    sched.add(a)
    chunks = []
    run(sched, state, dev, chunks)
    assert [end for _, _, end in chunks] == [24, 29]
    (b,) = request(prompt + [5, 6])
    sched.add(b)
    run(sched, state, dev)
    assert b.num_cached_tokens == 24  # pages 1-2 are cached KV too, but only 24 has a state


def test_n_samples_fork_before_the_last_prompt_token():
    sched, state, dev = make()
    seqs = request(list(range(1, 12)), n=3)
    for s in seqs:
        sched.add(s)
    chunks = []
    run(sched, state, dev, chunks)
    # Sample 0 stops one token short of its prompt; every sample then computes token 10 from its own copy.
    assert [(start, end) for s, start, end in chunks if not s.index] == [(0, 8), (8, 10), (10, 11)]
    assert [(start, end) for s, start, end in chunks if s.index] == [(10, 11)] * 2  # forked at 10, no hit needed
    assert state.checkpoint_hits == 0
    assert all(s.num_output_tokens == 3 and s.output_token_ids[0] == 1000 + 10 * s.index for s in seqs)


def test_one_token_prompt_samples_compute_alone():
    sched, state, dev = make()
    seqs = request([7], n=2)
    for s in seqs:
        sched.add(s)
    assert not sched.awaiting_fork
    run(sched, state, dev)
    assert all(s.is_finished for s in seqs)


@pytest.mark.parametrize("prefix", [True, False])
def test_preemption_recomputes_from_zeros_or_a_checkpoint(prefix):
    sched, state, dev = make(num_pages=7, budget=24, prefix=prefix)
    seqs = [s for p in ([1] * 20, [2] * 19, [3] * 21) for s in request(p, max_tokens=10)]
    for s in seqs:
        sched.add(s)
    run(sched, state, dev)
    assert sched.num_preemptions > 0
    assert all(s.num_output_tokens == 10 for s in seqs)
    assert len(state.free_slots) + len(state.checkpoints) == state.num_slots - 1


def test_admission_waits_for_a_state_slot():
    sched, state, dev = make(num_slots=3, max_num_seqs=4, prefix=False)  # 2 sequence slots
    seqs = [s for p in ([1, 2, 3], [4, 5, 6], [7, 8, 9]) for s in request(p)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert len(batch.seqs) == 2 and len(sched.waiting) == 1
    run(sched, state, dev)
    assert all(s.is_finished for s in seqs)
