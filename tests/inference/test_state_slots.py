"""State slots (inference/engine/pages/state_slots.py): allocation, release, forks, prefix checkpoints, and the queued
copies' batch semantics.

A fake device store holds, per slot, the tuple of tokens its state summarizes; the queued copies are applied as the
device applies them (every source gathered, then every destination scattered), so "each sequence's slot holds
exactly its own prefix" checks forks, checkpoints and restores together.
"""

from __future__ import annotations

import random

import pytest

from inference.engine.pages.state_slots import NULL_SLOT, OutOfStateSlotsError, StateSlotManager
from inference.engine.sequence import Sequence
from tests.inference.test_block_manager import make_seq


class FakeStates:
    def __init__(self, num_slots: int):
        self.slots: list[tuple | None] = [None] * num_slots

    def run_copies(self, copies):
        saved = [self.slots[src] for src, _ in copies]  # gather, then scatter
        assert len({d for _, d in copies}) == len(copies), "two copies into one slot in one batch"
        for (_, dst), content in zip(copies, saved):
            self.slots[dst] = content

    def step(self, mgr: StateSlotManager, seq: Sequence, end: int) -> None:
        """Copies first, then the step: a sequence with no context starts from zeros (the empty prefix)."""
        self.run_copies(mgr.take_copies())
        start = seq.num_computed_tokens
        prev = () if start == 0 else self.slots[seq.state_slot]
        assert prev == tuple(seq.token_ids[:start]), f"slot of {seq.seq_id} holds {prev}"
        self.slots[seq.state_slot] = tuple(seq.token_ids[:end])
        seq.num_computed_tokens = end


def test_allocate_release_and_exhaustion():
    mgr = StateSlotManager(3)
    a, b, c = make_seq([1]), make_seq([2]), make_seq([3])
    assert mgr.allocate(a) == 1 and mgr.allocate(b) == 2 and mgr.allocate(a) == 1  # idempotent
    assert not mgr.can_allocate()
    with pytest.raises(OutOfStateSlotsError, match="max_num_seqs"):
        mgr.allocate(c)
    mgr.release(a)
    assert a.state_slot == NULL_SLOT and mgr.allocate(c) == 1
    with pytest.raises(ValueError, match="null slot"):
        StateSlotManager(1)


def test_fork_copies_the_parent_state():
    mgr, dev = StateSlotManager(4), FakeStates(4)
    parent = make_seq([5, 6, 7, 8])
    mgr.allocate(parent)
    dev.step(mgr, parent, 3)
    child = make_seq([5, 6, 7, 8])
    mgr.fork(parent, child)
    child.num_computed_tokens = 3
    assert child.state_slot not in (NULL_SLOT, parent.state_slot)
    dev.step(mgr, child, 4)  # reads the copy: the assert inside checks it
    dev.step(mgr, parent, 4)
    assert dev.slots[child.state_slot] == dev.slots[parent.state_slot] == (5, 6, 7, 8)


def test_checkpoint_restore_and_lru_eviction():
    mgr, dev = StateSlotManager(5, max_checkpoints=2), FakeStates(5)
    a = make_seq([1, 2, 3, 4, 9])
    mgr.allocate(a)
    dev.step(mgr, a, 2)
    assert mgr.save_checkpoint(a, b"p1")
    dev.step(mgr, a, 4)  # the checkpoint copy runs before this step overwrites a's slot
    assert mgr.save_checkpoint(a, b"p2")
    assert not mgr.save_checkpoint(a, b"p2")  # already there: only refreshed
    b = make_seq([1, 2, 7])
    mgr.allocate(b)  # takes the last free slot (the engine allocates before it looks for a checkpoint)
    mgr.restore(b, b"p1")
    b.num_computed_tokens = 2
    dev.step(mgr, b, 3)
    assert mgr.checkpoint_hits == 1
    # A third checkpoint beyond max_checkpoints evicts the least recently used one (p2: p1 was just restored).
    assert mgr.save_checkpoint(b, b"p3")
    assert set(mgr.checkpoints) == {b"p1", b"p3"}
    # Sequences needing slots evict checkpoints rather than fail.
    mgr.release(a)
    c, d = make_seq([4]), make_seq([5])
    mgr.allocate(c)  # a's slot
    mgr.allocate(d)  # p1's slot, the least recently used
    assert set(mgr.checkpoints) == {b"p3"} and mgr.num_free_slots == 1
    assert mgr.reset_prefix_cache() == 1 and not mgr.checkpoints


def test_no_checkpoints_without_prefix_caching():
    mgr = StateSlotManager(4, enable_prefix_caching=False)
    a = make_seq([1, 2])
    mgr.allocate(a)
    assert not mgr.save_checkpoint(a, b"k") and not mgr.take_copies()


def test_queued_copies_equal_sequential_copies():
    """Random copy sequences: the manager's batch (gather-then-scatter) equals applying them one by one."""
    rng = random.Random(0)
    for _ in range(300):
        mgr = StateSlotManager(6)
        start = [(i,) for i in range(6)]
        sequential = list(start)
        for _ in range(rng.randint(1, 8)):
            src, dst = rng.randrange(6), rng.randrange(6)
            mgr._queue(src, dst)
            sequential[dst] = sequential[src]
        dev = FakeStates(6)
        dev.slots = list(start)
        dev.run_copies(mgr.take_copies())
        assert dev.slots == sequential


def test_a_sequences_newer_checkpoint_sends_its_previous_one_to_the_front():
    mgr = StateSlotManager(5)  # four usable slots
    a, b = make_seq([1] * 24), make_seq([2] * 24)
    mgr.allocate(a)
    mgr.allocate(b)
    mgr.save_checkpoint(b, b"b8")
    mgr.save_checkpoint(a, b"a8")
    mgr.save_checkpoint(a, b"a16")  # full: evicts a8 (sent to the front), not the older b8
    assert list(mgr.checkpoints) == [b"b8", b"a16"]
    mgr.release(a)
    mgr.save_checkpoint(b, b"b16")  # a's slot is free again
    assert list(mgr.checkpoints) == [b"b8", b"a16", b"b16"]
