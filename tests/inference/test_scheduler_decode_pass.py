"""The scheduler's steady decode pass (`Scheduler._schedule_decode_steady`: per-row work only for rows that open a
page, joined the decode rows, or reach their length limit) schedules exactly what the general pass (every row
checked) schedules, step for step, under arrivals, finishes, aborts, page crossings, prefix hits, forks and
preemption; the queue order it keeps through finishes and admissions is the one a rebuild gives. Host-only: no
model runs; a step's bookkeeping is simulated as the engine does it."""

from __future__ import annotations

import numpy as np
import pytest

from inference.engine.config import SchedulerConfig
from inference.engine.pages.kv_cache_manager import KVCacheManager
from inference.engine.scheduled_batch import token_limit
from inference.engine.scheduler import Scheduler
from inference.engine.sequence import Sequence, SequenceStatus
from inference.sampling.params import SamplingParams

MAX_LEN = 96


def _requests(rng: np.random.Generator, count: int) -> list[tuple]:
    shared = rng.integers(1, 500, 16).tolist()  # two pages a prefix hit can attach
    out = []
    for i in range(count):
        prompt = rng.integers(1, 500, int(rng.integers(1, 30))).tolist()
        if i % 3 == 0:
            prompt = shared + prompt
        n = 2 if i % 11 == 0 else 1
        out.append((prompt, SamplingParams(max_tokens=int(rng.integers(1, 40)), n=n), int(rng.integers(0, 2))))
    return out


def _run(policy: str, steady: bool, num_pages: int, finishing: bool, seed: int) -> list:
    """Drive one scheduler over a random workload; returns every step's (request, sample, tokens) rows and the
    preemption count. `finishing`: async scheduling's rule (every decoded row has a token in flight). The steady
    pass is told of each of its batches' advance (`Scheduler.advanced`), as the async engine does."""
    rng = np.random.default_rng(seed)
    requests = _requests(rng, 120)
    arrivals = rng.poisson(3, 400).tolist()
    finish_at = rng.random(1000)
    manager = KVCacheManager(num_pages, 8)
    config = SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=64, policy=policy, async_scheduling=False)
    in_flight: set = set()
    scheduler = Scheduler(config, manager, max_model_len=MAX_LEN,
                          finishing=(lambda s: s in in_flight and s.num_tokens >= token_limit(s, MAX_LEN))
                          if finishing else None)
    scheduler._steady_pages = steady
    log, next_id, step, hints, kept = [], 0, 0, 0, 0

    def finish(seq):
        seq.status = SequenceStatus.FINISHED
        scheduler.remove(seq)

    while requests or scheduler.has_work():
        for _ in range(arrivals[step] if step < len(arrivals) else len(requests)):
            if requests:
                prompt, params, priority = requests.pop(0)
                for index in range(params.n):
                    scheduler.add(Sequence(seq_id=next_id, request_id=f"r{next_id - index}", index=index,
                                           token_ids=list(prompt), num_prompt_tokens=len(prompt), params=params,
                                           seed=0, arrival_order=next_id, priority=priority))
                    next_id += 1
        step += 1
        batch = scheduler.schedule()
        if scheduler._order is not None:  # kept through finishes and admissions: the order a rebuild would give
            order, limits = scheduler._order
            assert order == sorted(scheduler.running, key=lambda s: (s.priority, s.arrival_order))
            assert limits is None or limits.tolist() == [token_limit(s, MAX_LEN) for s in order]
            kept += 1
        if batch is None:
            continue
        log.append([(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)])
        if batch.computed is not None:  # the steady pass read its rows: what the engine's async advance tells it
            hints += 1
            assert batch.computed.tolist() == [s.num_computed_tokens for s in batch.seqs]
            scheduler.advanced(batch.seqs, batch.computed + 1)  # a finish below makes the next pass read the rows
        in_flight = set()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):  # the engine's `_advance`, then the token
            seq.num_computed_tokens += n
            manager.commit_full_pages(seq)
            if scheduler.fork_due(seq):
                scheduler.fork_samples(seq)
            if seq.num_computed_tokens >= seq.num_tokens:
                seq.token_ids.append(int(seq.seq_id * 7 + seq.num_tokens) % 500 + 1)
                in_flight.add(seq)
                if seq.num_tokens >= token_limit(seq, MAX_LEN) or finish_at[(seq.seq_id * 31 + seq.num_tokens)
                                                                             % 1000] < 0.01:
                    finish(seq)
        if step % 17 == 0 and scheduler.running:  # an abort of a running sequence
            finish(scheduler.running[len(scheduler.running) // 2])
    assert hints > 0 if steady else hints == 0
    assert kept > 0 if steady else kept == 0
    return [log, scheduler.num_preemptions]


@pytest.mark.parametrize("policy", ["prefill_first", "mixed"])
@pytest.mark.parametrize("num_pages,finishing", [(400, False), (400, True), (60, False), (60, True)])
def test_steady_decode_pass_equals_the_general_pass(policy, num_pages, finishing):
    """Same rows, same order, same token counts, same preemptions, at every step (60 pages: preemption mid-batch)."""
    for seed in range(3):
        steady = _run(policy, True, num_pages, finishing, seed)
        general = _run(policy, False, num_pages, finishing, seed)
        assert steady == general
        assert sum(len(rows) for rows in steady[0]) > 500
        if num_pages == 60:
            assert steady[1] > 0  # the pool is short: the comparison covers preemption

