"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Every step is either a prefill step (prompt chunks, packed up to a token budget) or a decode step (one token for
every running sequence). Prefill goes first when there is prefill work, so new requests join at the next step
boundary (Orca); long prompts are cut into chunks of at most `max_num_batched_tokens`. When a decode step cannot
get a page for every sequence, the newest sequences are preempted: their pages are freed and they go back to the
front of the queue to be recomputed later.
"""

from __future__ import annotations

import collections
import dataclasses

from inference.block_manager import BlockManager
from inference.sequence import Sequence, SequenceStatus


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclasses.dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens of each sequence computed this step
    is_decode: bool

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished or aborted) and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.release(seq)

    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch is None and self.running:
            batch = self._schedule_decode()
        return batch

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        seqs, counts = [], []
        candidates = [s for s in self.running if s.num_uncomputed_tokens > 1] + list(self.waiting)
        for seq in candidates:
            if budget == 0 or len(seqs) == self.config.max_num_seqs:
                break
            is_new = seq.status is SequenceStatus.WAITING
            if is_new and len(self.running) >= self.config.max_num_seqs:
                break
            chunk = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_grow(seq, seq.num_computed_tokens + chunk):
                break
            self.block_manager.grow(seq, seq.num_computed_tokens + chunk)
            if is_new:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            seqs.append(seq)
            counts.append(chunk)
            budget -= chunk
        if seqs:
            return ScheduledBatch(seqs, counts, is_decode=False)
        if self.waiting and not self.running:
            head = self.waiting[0]
            raise RuntimeError(f"request {head.request_id} cannot be scheduled with an empty engine; it should have "
                               "been rejected when it was added")
        return None

    def _schedule_decode(self) -> ScheduledBatch:
        scheduled: list[Sequence] = []
        for seq in sorted(self.running, key=lambda s: s.arrival_order):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below while making room for an older sequence
            while not self.block_manager.can_grow(seq, seq.num_tokens):
                victim = max(self.running, key=lambda s: s.arrival_order)
                if victim is seq and len(self.running) == 1:
                    raise RuntimeError(f"sequence {seq.request_id} alone needs more pages than the cache holds")
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.block_manager.grow(seq, seq.num_tokens)
            scheduled.append(seq)
            if len(scheduled) == self.config.max_num_seqs:
                break
        return ScheduledBatch(scheduled, [1] * len(scheduled), is_decode=True)

    def _preempt(self, seq: Sequence) -> None:
        """Free a sequence's pages and queue it for recomputation, ahead of requests that never started."""
        self.running.remove(seq)
        self.block_manager.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
