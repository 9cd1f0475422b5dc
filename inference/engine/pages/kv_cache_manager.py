"""KV cache groups: one page pool and one page table per sequence for each attention kind (vLLM's hybrid KV cache
manager).

Why groups: a sliding-window layer never reads keys behind its window, so its pages can be released as a sequence
moves on, while a full-attention layer needs every page it wrote. Layers with the same window share a group
(`ModelConfig.kv_group_windows`, `ModelConfig.kv_group`); each group has its own `BlockManager` (pool, reference
counts, prefix cache, and a null page when it slides) and its own table in `seq.block_tables`, and each attention
layer reads its group's table and slots (`AttentionMetadata.for_group`). A model without windows has one group and
behaves exactly as one BlockManager.

Pool sizes: the byte budget is split in proportion to the layers of each group. A page of group g costs
page_size * (KV bytes per token and layer) * (layers in g), so every group gets the same number of pages,
`budget // (kv_bytes_per_token * page_size)`: the runner's `num_pages`, one cache array per layer as before. A
sliding group reserves its page 0 as the null page, so it allocates one page fewer.

Every operation spans all groups, so a sequence's tables always have the same length: `can_grow`/`grow` succeed
only if every group has room (admission control and preemption see the tightest group), a prefix hit is the
longest one every group can resume from, a fork shares from the point every group agrees on.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence as Seq

from inference.engine.pages.block_manager import BlockManager, OutOfPagesError, TableChanges, pages_needed
from inference.engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, num_pages: int | Seq[int], page_size: int, windows: Seq[int | None] = (None,), *,
                 enable_prefix_caching: bool = True):
        """`windows`: one entry per group, None for full attention (`ModelConfig.kv_group_windows`); `num_pages`:
        pages per group (an int: the same for every group)."""
        windows = tuple(windows)
        sizes = [num_pages] * len(windows) if isinstance(num_pages, int) else list(num_pages)
        if not windows or len(sizes) != len(windows):
            raise ValueError(f"need one page count per KV cache group: {len(sizes)} for windows {windows}")
        self.page_size = page_size
        self.windows = windows
        self.groups = [BlockManager(n, page_size, enable_prefix_caching=enable_prefix_caching, window=w, group=g)
                       for g, (n, w) in enumerate(zip(sizes, windows))]

    # ---- stats ------------------------------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_pages(self) -> int:
        """Allocatable pages, summed over groups (null pages excluded)."""
        return sum(g.num_pages for g in self.groups)

    @property
    def num_free_pages(self) -> int:
        return sum(g.num_free_pages for g in self.groups)

    @property
    def num_cached_pages(self) -> int:
        return sum(g.num_cached_pages for g in self.groups)

    @property
    def prefix_hits_tokens(self) -> int:
        return self.groups[0].prefix_hits_tokens  # every group attaches the same hit length

    @property
    def prefix_hit_rate(self) -> float:
        return self.groups[0].prefix_hit_rate

    def pages_needed(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.page_size)

    def held_pages(self, seq: Sequence) -> list[int]:
        """Pages the sequence holds in each group (null entries excluded)."""
        return [g.held_pages(seq) for g in self.groups]

    def shortfall(self, num_tokens: int, max_chunk: int) -> str | None:
        """Why one sequence of `num_tokens` tokens, computed `max_chunk` tokens per step at most, can never fit
        alone (None if it can): the first group whose pool is smaller than what the sequence holds at its peak."""
        for g in self.groups:
            needed = g.peak_pages(num_tokens, max_chunk)
            if needed > g.num_pages:
                where = "" if self.num_groups == 1 else (
                    " of full-attention layers" if g.window is None else f" of window-{g.window} layers")
                return f"needs {needed} KV pages but the cache{where} has {g.num_pages}"
        return None

    # ---- allocation -------------------------------------------------------------------------------------------
    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return all(g.can_grow(seq, num_tokens) for g in self.groups)

    def grow(self, seq: Sequence, num_tokens: int) -> list[list[tuple[int, int]]]:
        """`BlockManager.grow` in every group, or in none: returns each group's (src, dst) page copies. One group
        needs no separate check (its `grow` checks before it changes anything), which spares the hot decode path one
        page check per sequence."""
        for g in self.groups if len(self.groups) > 1 else ():
            if not g.can_grow(seq, num_tokens):
                raise OutOfPagesError(f"KV cache group {g.group} (window {g.window}) has no room for "
                                      f"{num_tokens} tokens of sequence {seq.seq_id}")
        return [g.grow(seq, num_tokens) for g in self.groups]

    def decode_open_page(self, seq: Sequence) -> bool:
        """A steady decode row's next write opens a page and one was appended (`BlockManager.decode_open_page`);
        False: nothing changed, the general `can_grow` / `grow` decide."""
        return len(self.groups) == 1 and self.groups[0].decode_open_page(seq)

    def decode_in_place(self, seq: Sequence) -> bool:
        """Whether a steady decode row's next write needs no page work (`BlockManager.decode_in_place`): then
        `can_grow` and `grow` of `seq.num_computed_tokens + 1` tokens would do nothing."""
        return len(self.groups) == 1 and self.groups[0].decode_in_place(seq)

    def take_touched(self) -> TableChanges:
        """How the sequences' page tables changed since the last call (any group)."""
        if len(self.groups) == 1:
            return self.groups[0].take_touched()
        changes = [g.take_touched() for g in self.groups]
        return TableChanges(set().union(*(c.touched for c in changes)), [a for c in changes for a in c.appended])

    def take_copies(self) -> list[list[tuple[int, int]]]:
        """Each group's queued page copies; run them on device (on that group's layers) before the next step."""
        return [g.take_copies() for g in self.groups]

    def release(self, seq: Sequence) -> None:
        for g in self.groups:
            g.release(seq)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        for g in self.groups:
            g.truncate(seq, num_tokens)

    # ---- sharing ----------------------------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's pages in every group from their common computed prefix; nothing (the child computes
        alone) if a window needs KV the parent already released. The engine forks right after the prompt, so
        only direct callers meet that case."""
        if any(child.block_tables) or child.num_computed_tokens:
            raise ValueError(f"fork: sequence {child.seq_id} already has pages or computed tokens")
        points = [g.fork_point(parent, child) for g in self.groups]
        if None not in points:
            for g in self.groups:
                g.share(parent, child, points[0])

    def match_prefix(self, seq: Sequence, extra_key: Hashable = None,
                     state_ok: Callable[[bytes], bool] | None = None) -> int:
        """Attach the longest cached prefix every group can resume from; returns the tokens it covers. `state_ok`
        (a hybrid model's state layers, inference/engine/pages/state_slots.py): whether the state after the page
        of a chain hash is checkpointed; a hit must also end at such a page."""
        looked = [g.lookup(seq, extra_key) for g in self.groups]
        oks = [g.resumable(found) for g, (_, found) in zip(self.groups, looked)]
        if state_ok is not None:
            oks.append([True] + [state_ok(h) for h in looked[0][0]])
        m = max(i for i in range(min(map(len, oks))) if all(ok[i] for ok in oks))
        for g, (hashes, found) in zip(self.groups, looked):
            g.attach(seq, hashes, found, m)
        return seq.num_computed_tokens

    def prefix_key(self, seq: Sequence, num_pages: int) -> bytes | None:
        """The chain hash naming `seq`'s first `num_pages` pages (group 0's; every group roots its chain alike), or
        None when it is not hashed (prefix caching off, or after a cache reset): a state checkpoint's key."""
        chain = self.groups[0].chain(seq)
        return chain.hashes[num_pages - 1] if chain is not None and 0 < num_pages <= len(chain.hashes) else None

    def commit_full_pages(self, seq: Sequence) -> int:
        if len(self.groups) == 1:  # called for every row that fills a page: no generator for the common case
            return self.groups[0].commit_full_pages(seq)
        return sum(g.commit_full_pages(seq) for g in self.groups)

    def reset_prefix_cache(self) -> int:
        return sum(g.reset_prefix_cache() for g in self.groups)
