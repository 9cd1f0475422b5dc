"""Block manager: allocation, prefix caching, LRU eviction, fork + copy-on-write, and a stateful property test.

The tests keep a fake device KV store: slot (page, offset) holds the tuple of token ids up to and including the
token written there (the KV of a token depends on its whole prefix) and the oldest weights version that KV depends
on. Page copies reported by `grow` are applied to it, so "every sequence reads back exactly its own prefix" checks
prefix hits, forks and copy-on-write together, and "every cached page is of the current weights" checks resets.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inference.engine.pages.block_manager import BlockManager, OutOfPagesError, TableChanges, chain_hash
from inference.sampling.params import SamplingParams
from inference.engine.sequence import Sequence

_ids = iter(range(1 << 30))


def make_seq(tokens: list[int]) -> Sequence:
    i = next(_ids)
    return Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=list(tokens), num_prompt_tokens=len(tokens),
                    params=SamplingParams(), seed=0, arrival_order=i)


class FakeKV:
    """Host stand-in for the paged KV cache."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.weights = 0  # bumped by update_weights
        self.slots: list[list[tuple[tuple[int, ...], int] | None]] = [[None] * bm.page_size
                                                                     for _ in range(bm.num_pages)]

    def update_weights(self) -> None:
        self.weights += 1
        self.bm.reset_prefix_cache()

    def copy(self, copies: list[tuple[int, int]]) -> None:
        saved = [list(self.slots[src]) for src, _ in copies]  # gather, then scatter (as on device)
        for (_, dst), content in zip(copies, saved):
            self.slots[dst] = content

    def step(self, seq: Sequence, num_new: int) -> list[tuple[int, int]]:
        """What scheduler + engine do for one step of `seq`: grow, copy, write (asserting privacy), commit."""
        bm, ps = self.bm, self.bm.page_size
        end = seq.num_computed_tokens + num_new
        copies = bm.grow(seq, end)
        assert bm.take_copies() == copies
        self.copy(copies)
        for j in range(seq.num_computed_tokens, end):
            page = seq.pages[j // ps]
            assert bm.ref_counts[page] == 1, f"page {page} is shared ({bm.ref_counts[page]}) but written in place"
            prev = self.slots[seq.pages[(j - 1) // ps]][(j - 1) % ps] if j else None
            weights = min(self.weights, prev[1]) if prev else self.weights
            self.slots[page][j % ps] = (tuple(seq.token_ids[:j + 1]), weights)
        seq.num_computed_tokens = end
        bm.commit_full_pages(seq)
        return copies

    def check(self, seq: Sequence) -> None:
        ps = self.bm.page_size
        for j in range(seq.num_computed_tokens):
            slot = self.slots[seq.pages[j // ps]][j % ps]
            assert slot is not None and slot[0] == tuple(seq.token_ids[:j + 1]), f"slot {j} of {seq}"


# ---- unit tests ----------------------------------------------------------------------------------------------
def test_allocate_and_release():
    bm = BlockManager(8, 4)
    seq = make_seq(list(range(10)))
    assert bm.pages_needed(10) == 3 and bm.can_grow(seq, 10)
    assert bm.grow(seq, 10) == []
    assert len(seq.pages) == 3 and len(set(seq.pages)) == 3 and all(bm.ref_counts[p] == 1 for p in seq.pages)
    assert bm.num_free_pages == 5
    assert bm.grow(seq, 12) == [] and len(seq.pages) == 3  # still fits
    assert not bm.can_grow(seq, 33)
    with pytest.raises(OutOfPagesError):
        bm.grow(seq, 33)
    assert len(seq.pages) == 3 and bm.num_free_pages == 5  # a failed grow changes nothing
    bm.release(seq)
    assert seq.pages == [] and bm.num_free_pages == 8 and bm.ref_counts == [0] * 8
    with pytest.raises(ValueError):
        BlockManager(0, 16)


def test_decode_open_page_is_grow_at_a_page_boundary():
    """The scheduler's shortcut for a decode row whose next write opens a page (`decode_open_page`) leaves the
    manager as `grow` of one more token does (table, free list), and reports the one entry it appended where `grow`
    reports the table changed (`take_touched`); it declines everywhere else (mid-page,
    a window, nothing allocatable) without changing anything."""
    states = []
    for fast in (True, False):
        bm = BlockManager(6, 4, enable_prefix_caching=True)
        seq = make_seq(list(range(9)))
        bm.grow(seq, 8)
        seq.num_computed_tokens = 8  # 2 full pages computed; token 8 opens page 2
        bm.commit_full_pages(seq)
        bm.take_touched()
        if fast:
            assert bm.decode_open_page(seq)
        else:
            assert bm.grow(seq, 9) == []
        changes = bm.take_touched()
        # grow marks the table changed; the shortcut names the one entry it appended
        assert (changes.touched, changes.appended) == (set(), [(seq, 2, seq.pages[2])]) if fast else \
            (changes.touched, changes.appended) == ({seq}, [])
        states.append((list(seq.pages), list(bm.free_pages), list(bm.ref_counts)))
    assert states[0] == states[1]
    seq.num_computed_tokens = 9  # mid-page: nothing to open
    assert not bm.decode_open_page(seq) and len(seq.pages) == 3
    windowed = BlockManager(6, 4, window=4)
    other = make_seq(list(range(5)))
    windowed.grow(other, 4)
    other.num_computed_tokens = 4
    assert not windowed.decode_open_page(other) and len(other.pages) == 1
    full = BlockManager(1, 4)
    last = make_seq(list(range(5)))
    full.grow(last, 4)
    last.num_computed_tokens = 4
    full.take_touched()
    assert not full.decode_open_page(last) and len(last.pages) == 1
    assert full.take_touched() == TableChanges(set(), [])  # nothing changed


def test_prefix_hit_200_token_system_prompt():
    bm = BlockManager(64, 16)
    kv = FakeKV(bm)
    system = [(7 * i + 3) % 1000 for i in range(200)]
    first = make_seq(system + [1, 2, 3])
    assert bm.match_prefix(first) == 0
    kv.step(first, first.num_tokens)
    assert bm.num_cached_pages == 203 // 16  # 12 full pages registered

    second = make_seq(system + [9, 9, 9, 9, 9])
    cached = bm.match_prefix(second)
    assert cached == 192 >= 192 and second.num_computed_tokens == 192
    assert second.pages == first.pages[:12]  # stored once
    assert all(bm.ref_counts[p] == 2 for p in first.pages[:12])
    kv.step(second, second.num_uncomputed_tokens)  # computes only the 13 new tokens
    assert second.pages[12] != first.pages[12]  # the partial page of the system prompt is not shared
    kv.check(first)
    kv.check(second)
    assert bm.prefix_hits_tokens == 192 and bm.prefix_queries_tokens == 203 + 205
    assert bm.prefix_hit_rate == pytest.approx(192 / 408)

    # The same prompt again never matches itself whole: the last token must be computed for logits.
    exact = make_seq(system[:192])
    assert bm.match_prefix(exact) == 176
    for s in (first, second, exact):
        bm.release(s)
    assert bm.num_free_pages == 64 and all(r == 0 for r in bm.ref_counts)


def test_extra_key_separates_caches():
    bm = BlockManager(16, 4)
    kv = FakeKV(bm)
    a = make_seq(list(range(9)))
    bm.match_prefix(a, extra_key="lora-1")
    kv.step(a, 9)
    assert bm.match_prefix(make_seq(list(range(9))), extra_key="lora-2") == 0
    assert bm.match_prefix(make_seq(list(range(9))), extra_key="lora-1") == 8


def test_lru_eviction_order_and_revival():
    bm = BlockManager(5, 4)
    kv = FakeKV(bm)
    x, y = make_seq(list(range(8)) + [0]), make_seq(list(range(100, 108)) + [0])
    for s in (x, y):
        bm.match_prefix(s)
        kv.step(s, 8)  # two full registered pages each; the 9th token is not computed
    x0, x1 = x.pages
    y0, y1 = y.pages
    bm.release(x)
    bm.release(y)
    assert list(bm.evictable) == [x1, x0, y1, y0]  # released tail first, x before y
    assert bm.num_free_pages == 5 and bm.num_cached_pages == 4 and len(bm.free_pages) == 1

    # A hit revives an evictable page: it leaves the LRU list and is no longer counted as allocatable.
    z = make_seq(list(range(100, 108)) + [5])
    assert bm.match_prefix(z) == 8 and z.pages == [y0, y1]
    assert list(bm.evictable) == [x1, x0] and bm.num_free_pages == 3

    # Allocation takes the free page first, then evicts least recently used: x's tail before x's head.
    w = make_seq(list(range(200, 212)))
    bm.grow(w, 8)
    assert x1 not in bm.page_hash and x0 in bm.page_hash
    probe = make_seq(list(range(9)))
    assert bm.match_prefix(probe) == 4 and probe.pages == [x0]  # x's head still hits
    bm.release(probe)  # x0 goes back to the LRU list, now as its most recent entry
    assert list(bm.evictable) == [x0]
    bm.grow(w, 12)
    assert bm.num_cached_pages == 2 and x0 not in bm.page_hash  # only y0, y1 (held by z) remain
    assert w.pages[1:] == [x1, x0]


def test_fork_mid_page_copy_on_write():
    bm = BlockManager(16, 4)
    kv = FakeKV(bm)
    parent = make_seq(list(range(10)))
    bm.match_prefix(parent)
    kv.step(parent, 10)
    parent.token_ids.append(100)  # sampled; pages: [full, full, partial with 2 slots]
    child = make_seq(list(range(10)) + [200])
    bm.fork(parent, child)
    assert child.pages == parent.pages and child.num_computed_tokens == 10
    assert [bm.ref_counts[p] for p in parent.pages] == [2, 2, 2]
    shared_partial = parent.pages[2]

    copies = kv.step(parent, 1)  # first writer into the shared partial page gets a private copy
    assert copies == [(shared_partial, parent.pages[2])] and parent.pages[2] != shared_partial
    assert kv.step(child, 1) == []  # the page is now the child's alone: written in place
    assert child.pages[2] == shared_partial
    for seq, tok in ((parent, 101), (child, 201), (parent, 102), (child, 202)):
        seq.token_ids.append(tok)
        kv.step(seq, 1)
    kv.check(parent)
    kv.check(child)
    assert parent.pages[:2] == child.pages[:2] and [bm.ref_counts[p] for p in parent.pages[:2]] == [2, 2]
    assert len(set(parent.pages) | set(child.pages)) == 2 + 2 + 2  # shared full pages stored once
    bm.release(parent)
    bm.release(child)
    assert bm.num_free_pages == 16


def test_fork_recomputes_last_token_in_cached_full_page():
    """A child forked after the parent sampled recomputes its own last prompt token; that page is full and cached,
    so it is copied, never written in place."""
    bm = BlockManager(8, 4)
    kv = FakeKV(bm)
    parent = make_seq(list(range(8)))
    bm.match_prefix(parent)
    kv.step(parent, 8)
    parent.token_ids.append(50)
    child = make_seq(list(range(8)))
    bm.fork(parent, child)
    assert child.num_computed_tokens == 7
    copies = kv.step(child, 1)
    assert copies == [(parent.pages[1], child.pages[1])] and child.pages[0] == parent.pages[0]
    kv.check(parent)
    kv.check(child)


def test_fork_diverging_child_builds_its_own_hash_chain():
    """A child that diverges inside the parent's cached pages must not inherit the hashes of the pages it rewrites,
    and must never write a cached page in place, even once the parent is gone."""
    bm = BlockManager(16, 4)
    kv = FakeKV(bm)
    parent = make_seq(list(range(8)) + [50])
    bm.match_prefix(parent)
    kv.step(parent, 9)  # pages 0 and 1 cached
    child = make_seq(list(range(5)) + [90, 91, 92, 93, 94, 95, 96, 97])
    bm.fork(parent, child)
    assert child.num_computed_tokens == 5
    bm.release(parent)  # the parent's cached page 1 is now held by the child alone
    cached_page1 = child.pages[1]
    kv.step(child, 8)
    kv.check(child)
    assert bm.num_cached_pages == 3  # parent's page 0, and the child's pages 1 and 2
    for page, h in bm.page_hash.items():  # every cached page holds the prefix its hash names
        prefix, _ = kv.slots[page][-1]
        expect = bm._root(None)
        for i in range(0, len(prefix), 4):
            expect = chain_hash(expect, list(prefix[i:i + 4]))
        assert expect == h
    assert child.pages[1] == cached_page1  # written in place (held by nobody else) after forgetting its old hash
    again = make_seq(list(range(8)) + [50])
    assert bm.match_prefix(again) == 4  # the parent's page 1 was rewritten: only page 0 still matches
    kv.step(again, again.num_uncomputed_tokens)
    kv.check(again)


def test_can_grow_counts_copy_on_write_pages():
    bm = BlockManager(3, 4)
    parent = make_seq(list(range(6)))
    bm.grow(parent, 6)
    parent.num_computed_tokens = 6
    child = make_seq(list(range(6)) + [1])
    parent.token_ids.append(0)
    bm.fork(parent, child)
    bm.grow(make_seq([0]), 1)  # take the last free page
    assert not bm.can_grow(parent, 7)  # no new page, but one copy is needed and no page is free
    with pytest.raises(OutOfPagesError):
        bm.grow(parent, 7)


def test_reset_prefix_cache():
    bm = BlockManager(8, 4)
    kv = FakeKV(bm)
    done, running = make_seq(list(range(9))), make_seq(list(range(50, 59)))
    for s in (done, running):
        bm.match_prefix(s)
        kv.step(s, 5)
    bm.release(done)
    assert len(bm.evictable) == 1 and bm.num_cached_pages == 2
    assert bm.reset_prefix_cache() == 1
    assert not bm.evictable and bm.num_cached_pages == 0 and not bm.cached and bm.num_free_pages == 6
    assert bm.match_prefix(make_seq(list(range(9)))) == 0
    kv.step(running, 4)  # computed with the new weights on top of stale KV: must not be registered
    assert bm.num_cached_pages == 0


# ---- stateful property test ----------------------------------------------------------------------------------
PS, NUM_PAGES, VOCAB = 4, 8, 2
SYSTEM = [2, 0, 1, 1, 0, 2, 2, 1, 0, 0, 1, 2]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_PAGES, PS)
        self.kv = FakeKV(self.bm)
        self.live: list[Sequence] = []

    def _pick(self, data, seqs: list[Sequence]) -> Sequence:
        return data.draw(st.sampled_from(seqs))

    @rule(shared=st.sampled_from([0, 3, 8, 10, 12]), tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
    def add(self, shared: int, tail: list[int]) -> None:
        seq = make_seq(SYSTEM[:shared] + tail)
        matched = self.bm.match_prefix(seq)
        assert matched % PS == 0 and matched < seq.num_tokens and seq.num_computed_tokens == matched
        assert len(seq.pages) == matched // PS
        self.live.append(seq)

    @precondition(lambda self: any(s.num_uncomputed_tokens for s in self.live))
    @rule(data=st.data())
    def compute(self, data) -> None:
        seq = self._pick(data, [s for s in self.live if s.num_uncomputed_tokens])
        chunk = data.draw(st.integers(1, seq.num_uncomputed_tokens))
        end = seq.num_computed_tokens + chunk
        if self.bm.can_grow(seq, end):
            self.kv.step(seq, chunk)
        else:  # allocation pressure: grow must refuse and change nothing
            before = (list(seq.pages), list(self.bm.ref_counts), self.bm.num_free_pages)
            with pytest.raises(OutOfPagesError):
                self.bm.grow(seq, end)
            assert before == (seq.pages, self.bm.ref_counts, self.bm.num_free_pages)

    @precondition(lambda self: any(s.num_uncomputed_tokens for s in self.live))
    @rule(data=st.data())
    def run_to_end(self, data) -> None:
        """Compute a sequence's remaining tokens and sample one more (a prefill followed by its first token)."""
        seq = self._pick(data, [s for s in self.live if s.num_uncomputed_tokens])
        if self.bm.can_grow(seq, seq.num_tokens):
            self.kv.step(seq, seq.num_uncomputed_tokens)
            seq.token_ids.append(data.draw(st.integers(0, VOCAB - 1)))

    @precondition(lambda self: any(not s.num_uncomputed_tokens for s in self.live))
    @rule(data=st.data(), token=st.integers(0, VOCAB - 1))
    def append(self, data, token: int) -> None:
        seq = self._pick(data, [s for s in self.live if not s.num_uncomputed_tokens])
        seq.token_ids.append(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.lists(st.integers(0, VOCAB - 1), max_size=3))
    def fork(self, data, extra: list[int]) -> None:
        """Usually an exact copy (n samples of one prompt); sometimes a child that diverges from its parent."""
        parent = self._pick(data, self.live)
        cut = data.draw(st.integers(1, parent.num_tokens)) if extra else parent.num_tokens
        child = make_seq(parent.token_ids[:cut] + extra)
        self.bm.fork(parent, child)
        assert child.pages == parent.pages
        same = 0
        while same < min(parent.num_tokens, child.num_tokens) and parent.token_ids[same] == child.token_ids[same]:
            same += 1
        assert child.num_computed_tokens == min(parent.num_computed_tokens, child.num_tokens - 1, same)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data) -> None:
        seq = self._pick(data, self.live)
        self.bm.release(seq)
        self.live.remove(seq)
        assert seq.pages == []

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        seq = self._pick(data, self.live)
        self.bm.release(seq)
        seq.num_computed_tokens = 0
        self.bm.match_prefix(seq)  # recomputation starts from whatever is still cached

    @precondition(lambda self: len(self.bm.evictable) >= 2)
    @rule()
    def update_weights(self) -> None:
        self.kv.update_weights()
        assert not self.bm.evictable and not self.bm.page_hash

    @invariant()
    def pages_are_consistent(self) -> None:
        bm = self.bm
        holders = collections.Counter(p for s in self.live for p in s.pages)
        for s in self.live:
            assert len(set(s.pages)) == len(s.pages)
            assert len(s.pages) >= bm.pages_needed(s.num_computed_tokens)
        assert all(r >= 0 for r in bm.ref_counts)
        assert [bm.ref_counts[p] for p in range(NUM_PAGES)] == [holders[p] for p in range(NUM_PAGES)]
        free, evictable = set(bm.free_pages), set(bm.evictable)
        used = {p for p in range(NUM_PAGES) if bm.ref_counts[p] > 0}
        assert len(free) == len(bm.free_pages)
        assert not (free & used) and not (free & evictable) and not (evictable & used)
        assert free | evictable | used == set(range(NUM_PAGES))
        assert bm.num_free_pages == len(free) + len(evictable)
        assert evictable <= set(bm.page_hash) and not (free & set(bm.page_hash))
        assert {page: h for h, page in bm.cached.items()} == bm.page_hash
        if not self.live:
            assert used == set()

    @invariant()
    def contents_are_right(self) -> None:
        for s in self.live:
            self.kv.check(s)  # prefix hits, forks and copies give every sequence exactly its own KV
        root = self.bm._root(None)
        for page, h in self.bm.page_hash.items():  # a cached page holds exactly the prefix its hash names
            assert self.kv.slots[page][-1] is not None
            prefix, weights = self.kv.slots[page][-1]
            assert len(prefix) % PS == 0 and weights == self.kv.weights
            expect = root
            for i in range(0, len(prefix), PS):
                expect = chain_hash(expect, list(prefix[i:i + PS]))
            assert expect == h

    def teardown(self) -> None:
        for s in self.live:
            self.bm.release(s)
        assert all(r == 0 for r in self.bm.ref_counts)
        assert len(self.bm.free_pages) + len(self.bm.evictable) == NUM_PAGES


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerMachine = BlockManagerMachine.TestCase
