"""A bounded KV cache for sliding-window layers: KV cache groups, pages released behind the window, null pages.

Block-manager tests keep a fake device store per group (slot -> the token prefix whose KV it holds), so "every
sequence reads back its own prefix wherever its window reaches" checks release, prefix hits, forks, copy-on-write
and speculative rollback together. Engine tests run the tiny Mistral (every layer slides) and Gemma 2 (alternating)
fixtures past several windows and compare with the cache-free forward while counting the pages each group holds.
"""

from __future__ import annotations

import collections

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from configs import get_model_config
from inference.engine.pages.block_manager import NULL_PAGE, BlockManager, OutOfPagesError
from inference.engine.pages.kv_cache_manager import KVCacheManager
from inference.sampling.params import SamplingParams
from models.attention import AttentionMetadata
from tests.inference.test_block_manager import make_seq
from tests.models.test_families import FIXTURES, _forward, _load, _model


class FakeGroupedKV:
    """Host stand-in for the per-group paged caches: slot -> the token prefix its KV depends on."""

    def __init__(self, mgr: KVCacheManager, num_pages: int):
        self.mgr = mgr
        self.slots = [[[None] * mgr.page_size for _ in range(num_pages)] for _ in mgr.groups]

    def step(self, seq, num_new: int, written: list[int] | None = None) -> None:
        """What scheduler + engine do for one step: grow, copy, write [num_computed, num_computed + num_new)
        (`written`: draft tokens past the sequence's own); the caller advances num_computed_tokens and commits."""
        ps, start = self.mgr.page_size, seq.num_computed_tokens
        tokens = seq.token_ids + (written or [])
        end = start + num_new
        copies = self.mgr.grow(seq, end)
        assert self.mgr.take_copies() == copies  # queued for the engine exactly as returned
        for g, group_copies in zip(self.mgr.groups, copies):
            saved = [list(self.slots[g.group][src]) for src, _ in group_copies]  # gather, then scatter
            for (_, dst), content in zip(group_copies, saved):
                self.slots[g.group][dst] = content
        for g in self.mgr.groups:
            table = g.table(seq)
            for j in range(start, end):
                page = table[j // ps]
                assert not g.is_null(page) and g.ref_counts[page] == 1, f"group {g.group} writes shared {page}"
                self.slots[g.group][page][j % ps] = tuple(tokens[:j + 1])

    def check(self, seq) -> None:
        """Every slot a query at position num_computed (or later) reads holds the sequence's own prefix."""
        ps, c = self.mgr.page_size, seq.num_computed_tokens
        for g in self.mgr.groups:
            table = g.table(seq)
            nulls = next((i for i, p in enumerate(table) if not g.is_null(p)), len(table))
            assert nulls <= g.first_needed_page(c) and not any(g.is_null(p) for p in table[nulls:])
            for j in range(0 if g.window is None else max(c - g.window + 1, 0), c):
                assert self.slots[g.group][table[j // ps]][j % ps] == tuple(seq.token_ids[:j + 1]), (g.group, j)


# ---- the block manager's window -----------------------------------------------------------------------------
def test_decode_holds_at_most_window_pages_plus_one_and_recycles_them():
    ps, window = 4, 6
    mgr = KVCacheManager(4, ps, (window,))  # page 0 is the null page: 3 allocatable pages for a 40-token sequence
    g = mgr.groups[0]
    kv = FakeGroupedKV(mgr, 4)
    seq = make_seq(list(range(5)))
    assert mgr.match_prefix(seq) == 0 and mgr.num_pages == 3
    kv.step(seq, 5)
    seq.num_computed_tokens = 5
    for token in range(5, 40):  # decode 35 tokens: 10 pages of tokens through a pool of 3
        seq.token_ids.append(token)
        kv.step(seq, 1)
        assert g.held_pages(seq) <= -(-window // ps) + 1
        seq.num_computed_tokens += 1
        kv.check(seq)
    table = g.table(seq)
    assert len(table) == 10 and table[:g.first_needed_page(39)] == [NULL_PAGE] * g.first_needed_page(39)
    assert NULL_PAGE not in g.free_pages and g.ref_counts[NULL_PAGE] == 0
    mgr.release(seq)
    assert mgr.num_free_pages == 3


def test_can_grow_counts_the_pages_the_window_releases():
    bm = BlockManager(3, 4, window=4)  # 2 allocatable pages
    seq = make_seq(list(range(9)))
    bm.grow(seq, 8)
    seq.num_computed_tokens = 8
    assert bm.num_free_pages == 0 and not bm.can_grow(make_seq([1]), 1)
    assert bm.can_grow(seq, 9)  # the query at 8 reads keys 5..8: page 0 goes back and page 2 takes its place
    bm.grow(seq, 9)
    assert seq.pages[0] == NULL_PAGE and bm.held_pages(seq) == 2
    with pytest.raises(ValueError, match="at least 2 page"):
        BlockManager(1, 4, window=4)


def test_prefill_chunk_keeps_what_its_first_query_reads():
    bm = BlockManager(16, 4, window=6)
    seq = make_seq(list(range(30)))
    bm.grow(seq, 12)
    seq.num_computed_tokens = 12
    bm.grow(seq, 20)  # queries 12..19; the first reads keys 7..12, so pages 0 (0-3) goes, page 1 (4-7) stays
    assert seq.pages[0] == NULL_PAGE and seq.pages[1] != NULL_PAGE
    assert bm.held_pages(seq) == 4 <= bm.peak_pages(30, 8)
    assert bm.peak_pages(30, 8) == 5 and bm.peak_pages(10, 8) == 3 and BlockManager(4, 4).peak_pages(30, 8) == 8


def test_prefix_hit_needs_only_the_pages_inside_the_window():
    ps = 4
    mgr = KVCacheManager(32, ps, (None, 6))
    kv = FakeGroupedKV(mgr, 32)
    first = make_seq(list(range(30)))
    mgr.match_prefix(first)
    kv.step(first, 30)
    first.num_computed_tokens = 30
    mgr.commit_full_pages(first)
    first.token_ids.append(99)
    kv.step(first, 1)  # the query at 30 reads keys 25..30: sliding pages 0..5 are released, still cached
    first.num_computed_tokens = 31
    full, sliding = mgr.groups
    assert sliding.held_pages(first) < full.held_pages(first) == 8
    mgr.release(first)
    # Take every free page and three more: the sliding group evicts the head of the prefix (pages 0..2) first.
    hog = make_seq(list(range(500, 500 + 4 * (len(sliding.free_pages) + 3))))
    sliding.grow(hog, hog.num_tokens)
    assert sliding.num_cached_pages == 4
    second = make_seq(list(range(30)) + [7, 7])
    assert mgr.match_prefix(second) == 28  # 7 full pages; the sliding group attaches only pages 5 and 6
    assert sliding.table(second)[:5] == [NULL_PAGE] * 5 and sliding.held_pages(second) == 2
    assert full.held_pages(second) == 7
    kv.check(second)
    kv.step(second, second.num_uncomputed_tokens)
    second.num_computed_tokens = second.num_tokens
    kv.check(second)


def test_fork_past_the_window_falls_back_to_recomputation():
    mgr = KVCacheManager(16, 4, (None, 4))
    kv = FakeGroupedKV(mgr, 16)
    parent = make_seq(list(range(10)))
    mgr.match_prefix(parent)
    kv.step(parent, 10)
    parent.num_computed_tokens = 10
    parent.token_ids += [50, 51, 52, 53]
    for _ in range(4):
        kv.step(parent, 1)
        parent.num_computed_tokens += 1
    assert mgr.groups[1].table(parent)[:2] == [NULL_PAGE] * 2  # the query at 13 reads keys 10..13
    recent = make_seq(parent.token_ids[:13] + [7])  # resumes at 13: its window is still held
    mgr.fork(parent, recent)
    assert recent.num_computed_tokens == 13 and recent.block_tables == parent.block_tables
    late = make_seq(list(range(10)))  # resumes at 9, whose window reads page 1: released, so nothing is shared
    mgr.fork(parent, late)
    assert late.num_computed_tokens == 0 and not any(late.block_tables)
    for seq in (recent, late):
        kv.step(seq, seq.num_uncomputed_tokens)
        seq.num_computed_tokens = seq.num_tokens
        kv.check(seq)
    kv.check(parent)


def test_shortfall_names_the_group_that_is_too_small():
    mgr = KVCacheManager(5, 4, (None, 8))
    assert mgr.shortfall(16, 8) is None
    assert mgr.shortfall(24, 8) == "needs 6 KV pages but the cache of full-attention layers has 5"
    sliding_only = KVCacheManager(5, 4, (8,))
    assert sliding_only.shortfall(1000, 4) is None  # a window bounds what one sequence ever holds
    assert "window-8" in KVCacheManager([40, 5], 4, (None, 8)).shortfall(100, 32)
    assert KVCacheManager(5, 4).shortfall(24, 8) == "needs 6 KV pages but the cache has 5"


def test_groups_follow_the_layer_windows():
    assert get_model_config("tiny-llama").kv_group_windows == (None,)
    mistral, gemma2, gemma3 = (get_model_config(n) for n in ("tiny-mistral", "tiny-gemma2", "tiny-gemma3"))
    assert mistral.kv_group_windows == (6,) and [mistral.kv_group(i) for i in range(2)] == [0, 0]
    assert gemma2.kv_group_windows == (None, 6) and [gemma2.kv_group(i) for i in range(2)] == [1, 0]
    assert [gemma3.kv_group(i) for i in range(3)] == [1, 1, 0]
    cla = gemma3.replace(cla_factor=2)  # layers 2 reads layer 2's cache, layer 1 layer 0's: both windowed
    assert cla.kv_group_windows == (None, 6) and [cla.kv_group(i) for i in range(3)] == [1, 1, 0]
    mixed = gemma2.replace(cla_factor=2)  # one cache read by a sliding and a full layer: it keeps everything
    assert mixed.kv_group_windows == (None,)
    meta = AttentionMetadata(slot_mapping=jnp.arange(6).reshape(2, 3), kv_lens=jnp.ones(1, jnp.int32),
                             page_indices=jnp.arange(8).reshape(2, 1, 4), cu_q_lens=jnp.zeros(2, jnp.int32),
                             num_seqs=jnp.ones(1, jnp.int32))
    assert meta.for_group(1).page_indices.tolist() == [[4, 5, 6, 7]] and meta.for_group(1).slot_mapping.tolist() == [
        3, 4, 5]


# ---- stateful property test over two groups -------------------------------------------------------------------
PS, PAGES, WINDOW, VOCAB = 4, 10, 6, 2
SYSTEM = [2, 0, 1, 1, 0, 2, 2, 1, 0, 0, 1, 2, 1, 0]


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(PAGES, PS, (None, WINDOW))
        self.kv = FakeGroupedKV(self.mgr, PAGES)
        self.live = []

    @rule(shared=st.sampled_from([0, 4, 9, 14]), tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
    def add(self, shared, tail):
        seq = make_seq(SYSTEM[:shared] + tail)
        matched = self.mgr.match_prefix(seq)
        assert matched % PS == 0 and matched < seq.num_tokens == len(seq.token_ids)
        self.live.append(seq)

    def _step(self, seq, n) -> None:
        if not self.mgr.can_grow(seq, seq.num_computed_tokens + n):
            before = [list(t) for t in seq.block_tables], self.mgr.num_free_pages
            with pytest.raises(OutOfPagesError):
                self.mgr.grow(seq, seq.num_computed_tokens + n)
            assert before == ([list(t) for t in seq.block_tables], self.mgr.num_free_pages)
            return
        self.kv.step(seq, n)
        seq.num_computed_tokens += n
        self.mgr.commit_full_pages(seq)

    @precondition(lambda self: any(s.num_uncomputed_tokens for s in self.live))
    @rule(data=st.data())
    def compute(self, data):
        seq = data.draw(st.sampled_from([s for s in self.live if s.num_uncomputed_tokens]))
        self._step(seq, data.draw(st.integers(1, seq.num_uncomputed_tokens)))

    @precondition(lambda self: any(not s.num_uncomputed_tokens for s in self.live))
    @rule(data=st.data(), token=st.integers(0, VOCAB - 1))
    def append(self, data, token):
        data.draw(st.sampled_from([s for s in self.live if not s.num_uncomputed_tokens])).token_ids.append(token)

    @precondition(lambda self: any(s.num_uncomputed_tokens == 1 for s in self.live))
    @rule(data=st.data(), drafts=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3))
    def speculate(self, data, drafts):
        """Verify drafts in one step, accept some, roll the rest back (engine._accept_speculation)."""
        seq = data.draw(st.sampled_from([s for s in self.live if s.num_uncomputed_tokens == 1]))
        if not self.mgr.can_grow(seq, seq.num_tokens + len(drafts)):
            return
        self.kv.step(seq, 1 + len(drafts), written=drafts)
        accepted = data.draw(st.integers(0, len(drafts)))
        seq.token_ids += drafts[:accepted]
        seq.num_computed_tokens += 1 + accepted
        self.mgr.commit_full_pages(seq)
        seq.token_ids.append(data.draw(st.integers(0, VOCAB - 1)))
        self.mgr.truncate(seq, seq.num_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.lists(st.integers(0, VOCAB - 1), max_size=3))
    def fork(self, data, extra):
        parent = data.draw(st.sampled_from(self.live))
        cut = data.draw(st.integers(1, parent.num_tokens)) if extra else parent.num_tokens
        child = make_seq(parent.token_ids[:cut] + extra)
        self.mgr.fork(parent, child)
        assert child.block_tables == parent.block_tables or (
            not any(child.block_tables) and child.num_computed_tokens == 0)  # past the parent's window
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def finish_or_preempt(self, data, preempt):
        seq = data.draw(st.sampled_from(self.live))
        self.mgr.release(seq)
        self.live.remove(seq)
        if preempt:
            seq.num_computed_tokens = 0
            self.mgr.match_prefix(seq)
            self.live.append(seq)

    @invariant()
    def consistent(self):
        for g in self.mgr.groups:
            holders = collections.Counter(p for s in self.live for p in g.table(s) if not g.is_null(p))
            assert [g.ref_counts[p] for p in range(PAGES)] == [holders[p] for p in range(PAGES)]
            free, evictable = set(g.free_pages), set(g.evictable)
            used = {p for p in range(PAGES) if g.ref_counts[p]}
            assert not (free & used) and not (free & evictable) and not (evictable & used)
            reserved = {NULL_PAGE} if g.window else set()
            assert free | evictable | used | reserved == set(range(PAGES)) and not (reserved & (free | evictable))
            assert {page: h for h, page in g.cached.items()} == g.page_hash
        for s in self.live:
            assert len({len(t) for t in s.block_tables}) == 1  # every group's table has the same length
            self.kv.check(s)

    def teardown(self):
        for s in self.live:
            self.mgr.release(s)
        assert self.mgr.num_free_pages == self.mgr.num_pages


HybridMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
TestHybridMachine = HybridMachine.TestCase


# ---- through the engine ---------------------------------------------------------------------------------------
PAGE, BUDGET_TOKENS = 4, 32


@pytest.fixture(scope="module", params=["mistral", "gemma2"])
def family_llm(request):
    """The tiny fixture model (window 8) with pools that run short: Mistral gets 8 pages (one is the null page),
    fewer than one of its 32-token sequences needs; Gemma 2 gets 16, two thirds of what three of them need in its
    full-attention layers (while its sliding group has room to spare)."""
    from inference import LLM

    family = request.param
    config = _load(family)[0]
    pages = 8 if family == "mistral" else 16
    llm = LLM(str(FIXTURES / family), kv_cache_memory_bytes=pages * PAGE * config.kv_bytes_per_token(4),
              page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=BUDGET_TOKENS, compilation_cache_dir=None)
    assert llm.runner.num_pages == pages
    return family, llm


def _reference(family, prompt, out):
    """Greedy continuation check: the cache-free forward's argmax after every prefix of prompt + out."""
    argmax = _forward(_model(family), np.array([prompt + out])).argmax(-1)
    return argmax[len(prompt) - 1:-1].tolist()


def test_engine_equals_cache_free_forward_while_sliding_pages_stay_bounded(family_llm):
    family, llm = family_llm
    engine, mgr = llm.engine, llm.engine.block_manager
    window = _load(family)[0].sliding_window
    sliding = mgr.groups[mgr.windows.index(window)]
    ids = _load(family)[2][0].tolist()
    prompts = [ids[:20], ids[3:16], ids[10:17]]
    total = 4 * window  # each sequence ends four windows long
    for i, p in enumerate(prompts):
        engine.add_request(f"w{i}", p, SamplingParams(temperature=0.0, max_tokens=total - len(p), ignore_eos=True))
    last_chunk, decode_peak = {}, 0
    while engine.has_unfinished_requests():
        before = {seq: seq.num_computed_tokens for seq in engine.scheduler.running}
        engine.step()
        for seq in engine.scheduler.running:
            if seq.num_computed_tokens > before.get(seq, 0):
                last_chunk[seq] = seq.num_computed_tokens - before.get(seq, 0)
            held = sliding.held_pages(seq)
            # the pages of positions [c - window + 1, c + chunk) of its last step: ceil(window / page) + 1 in decode
            assert held <= sliding.peak_pages(seq.num_tokens, last_chunk[seq])
            if last_chunk[seq] == 1:
                decode_peak = max(decode_peak, held)
            if None in mgr.windows:  # the full-attention group keeps every page
                assert mgr.groups[0].held_pages(seq) == mgr.pages_needed(seq.num_computed_tokens)
    for i, p in enumerate(prompts):
        out = engine.output_of(f"w{i}").outputs[0].token_ids
        assert len(p) + len(out) == total and out == _reference(family, p, out)
        engine.pop_finished(f"w{i}")
    assert decode_peak == -(-window // PAGE) + 1 < mgr.pages_needed(total)
    assert engine.scheduler.num_preemptions > 0  # the short pool preempted (and recomputed) with every group freed
    if family == "mistral":
        assert mgr.pages_needed(total) > mgr.num_pages  # each sequence is longer than the whole pool
    assert mgr.num_free_pages == mgr.num_pages


def test_prefix_hit_and_fork_on_the_bounded_cache(family_llm):
    """A repeated prompt hits the prefix cache in every group (the sliding group attaches only its window's
    pages); its n=2 samples fork the pages and copy on write per group; both equal the cache-free forward."""
    family, llm = family_llm
    prompt = _load(family)[2][0, :22].tolist()
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=2, **greedy))
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=10, n=2, **greedy))[0]
    assert again.metrics.num_cached_tokens == 20  # 5 full pages
    first = again.outputs[0].token_ids
    assert first == _reference(family, prompt, first) and again.outputs[1].token_ids == first
    assert llm.engine.block_manager.num_free_pages == llm.engine.block_manager.num_pages
