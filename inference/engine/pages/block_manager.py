"""Pages of the KV cache: free list, reference counts, prefix caching, fork and copy-on-write.

A sequence's cache is the list of page ids in `Sequence.pages`; token j lives in page `pages[j // page_size]` at
offset `j % page_size`. Everything here is host-side bookkeeping; the only device work it asks for is page copies.

Why each piece exists:
- Reference counts let several sequences hold one page: the `n` samples of a prompt (`fork`) and requests that
  share a prefix (prefix caching). A page returns to the pool when its count reaches 0.
- Prefix caching: a *full*, computed page is registered under a chain hash, sha256(parent page's hash + this
  page's token ids), rooted in (cache generation, `extra_key`), so a hash names the whole prefix up to the page's
  end, not just its tokens. `match_prefix` attaches the longest run of registered pages to a new sequence; never
  the whole sequence, so its last token is always computed and there are logits to sample from (as in vLLM).
- An unreferenced page that holds a registered hash is not freed but parked in an LRU "evictable" list: it can
  still be hit, yet it is allocatable. Allocation takes truly free pages first, then evicts the least recently
  released cached page (forgetting its hash). `release` parks a sequence's pages tail first, so the tail of a
  prefix is evicted before its head (a chain with a missing head can never be hit).
- Full pages are immutable. A partial page shared after `fork` is copied on write: before a step writes slots of
  a page whose count is > 1, `grow` gives the writer a fresh page and reports (old, new) so the engine copies the
  valid slots on device *before* that step runs. vLLM v1 dropped this; we keep it.

- Sliding windows: one BlockManager serves one KV cache group (`inference/engine/pages/kv_cache_manager.py`), the layers
  that share a window, and reads the sequence's page table of that group (`seq.block_tables[group]`). With a window w,
  a query at position p reads keys > p - w only, so when a step's first query is at c = seq.num_computed_tokens,
  every page wholly before position c - w + 1 is read by no query of this step or any later one (speculative
  rollback never moves c back; preemption recomputes from scratch). `grow` points those table entries at the
  reserved null page 0 (never allocated, never written; attention masks what it holds) and drops its reference:
  a sequence holds at most ceil((w - 1 + chunk) / page_size) + 1 pages of the group. Null entries are always a
  prefix of the table. A released cached page stays hittable in the LRU; a prefix hit of m pages needs only the
  pages the window of position m * page_size reads (`resumable`), the ones before it are attached as null.
  `release` parks a sliding table head first (the head is never needed again by a hit that reaches the tail).

Protocol per step: `match_prefix` (new sequences) or `fork` (samples of a running prompt), then `can_grow`/`grow`
for the slots the step writes, [seq.num_computed_tokens, num_tokens); the engine runs `take_copies()` on device
before the step, and calls `commit_full_pages` after advancing `seq.num_computed_tokens`; `release` at the end.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
from typing import Hashable

from inference.engine.sequence import Sequence


NULL_PAGE = 0  # a sliding group's reserved page: table entries wholly behind the window point here


class OutOfPagesError(RuntimeError):
    pass


def pages_needed(num_tokens: int, page_size: int) -> int:
    """How many pages hold `num_tokens` tokens: ceil(num_tokens / page_size)."""
    return -(-num_tokens // page_size)


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Hash of a full page: its parent page's hash (or the chain root) and its token ids."""
    return hashlib.sha256(parent + array.array("q", tokens).tobytes()).digest()


@dataclasses.dataclass(frozen=True)
class TableChanges:
    """How the sequences' page tables changed since the engine last asked (`BlockManager.take_touched`)."""

    touched: set[Sequence]  # any change but the ones in `appended`: the table must be read again
    appended: list[tuple[Sequence, int, int]]  # (sequence, index, page): one page appended, the rest as it was


@dataclasses.dataclass
class _Chain:
    """The chain hashes of one sequence's computed full pages: hashes[i] names pages[i]."""
    root: bytes
    generation: int
    hashes: list[bytes] = dataclasses.field(default_factory=list)


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True,
                 window: int | None = None, group: int = 0):
        """`num_pages` pages on device; `window`: the group's attention window in tokens (None: full attention;
        with a window page 0 is the reserved null page and `self.num_pages` counts the others); `group`: which of
        the sequence's page tables (`seq.block_tables`) this manager keeps."""
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must be at least one token, got {window}")
        reserved = 0 if window is None else 1
        if num_pages < 1 + reserved or page_size < 1:
            raise ValueError(f"need at least {1 + reserved} page(s) of at least one token, got {num_pages} x "
                             f"{page_size}; raise kv_cache_memory_bytes")
        self.num_pages = num_pages - reserved  # allocatable pages
        self.page_size = page_size
        self.window = window
        self.group = group
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.free_pages: collections.deque[int] = collections.deque(range(reserved, num_pages))
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.page_hash: dict[int, bytes] = {}  # registered page -> its chain hash
        self.cached: dict[bytes, int] = {}  # chain hash -> registered page
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) not yet taken by the engine
        self.prefix_hits_tokens = 0
        self.prefix_queries_tokens = 0
        self._generation = 0  # bumped by reset_prefix_cache: older chains never register again
        self._chains: dict[Sequence, _Chain] = {}
        # How tables changed since the engine last asked (`take_touched`): a page appended at a steady decode row's
        # page boundary (`appended`: the sequence, the page's index, the page), which the engine's persistent
        # decode batch writes as one entry; any other change but the in-place decode write (`touched`), for which
        # it builds the step from the tables again.
        self.touched: set[Sequence] = set()
        self.appended: list[tuple[Sequence, int, int]] = []

    # ---- stats ------------------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Allocatable pages: truly free plus evictable cached ones."""
        return len(self.free_pages) + len(self.evictable)

    @property
    def num_cached_pages(self) -> int:
        """Pages registered in the prefix cache, referenced or evictable."""
        return len(self.page_hash)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0

    def pages_needed(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.page_size)

    # ---- the sequence's table and the window -------------------------------------------------------------------
    def table(self, seq: Sequence) -> list[int]:
        """The sequence's page table of this manager's group (made empty on first use)."""
        tables = seq.block_tables
        if len(tables) > self.group:
            return tables[self.group]
        while len(seq.block_tables) <= self.group:
            seq.block_tables.append([])
        return seq.block_tables[self.group]

    def is_null(self, page: int) -> bool:
        return self.window is not None and page == NULL_PAGE

    def first_needed_page(self, position: int) -> int:
        """Index of the first page a query at `position`, or any later one, reads (0 without a window)."""
        return 0 if self.window is None else max(position - self.window + 1, 0) // self.page_size

    def held_pages(self, seq: Sequence) -> int:
        """Pages of this group the sequence holds (null entries excluded)."""
        return sum(not self.is_null(p) for p in self.table(seq))

    def peak_pages(self, num_tokens: int, max_chunk: int) -> int:
        """The most pages of this group one sequence of `num_tokens` tokens holds at once when each step computes at
        most `max_chunk` of them: a window bounds it by the pages of positions [c - w + 1, c + chunk)."""
        full = self.pages_needed(num_tokens)
        return full if self.window is None else min(full, self.pages_needed(self.window - 1 + max_chunk) + 1)

    def _behind_window(self, seq: Sequence) -> list[int]:
        """Table indices still holding a page that no query from position seq.num_computed_tokens on reads. Null
        entries are a prefix, so walk back from the first needed page to the last null."""
        table = self.table(seq)
        i = min(self.first_needed_page(seq.num_computed_tokens), len(table)) - 1
        behind = []
        while i >= 0 and not self.is_null(table[i]):
            behind.append(i)
            i -= 1
        return behind[::-1]

    # ---- allocation -------------------------------------------------------------------------------------------
    def _allocate(self) -> int:
        if self.free_pages:
            page = self.free_pages.popleft()
        elif self.evictable:
            page, _ = self.evictable.popitem(last=False)
            del self.cached[self.page_hash.pop(page)]
        else:
            raise OutOfPagesError("no free or evictable page")
        self.ref_counts[page] = 1
        return page

    def _written_pages(self, seq: Sequence, num_tokens: int) -> range:
        """Indices into the table (existing ones only) that a step writing [num_computed, num_tokens) touches."""
        if num_tokens <= seq.num_computed_tokens:
            return range(0)
        table = self.table(seq)
        return range(seq.num_computed_tokens // self.page_size, min(self.pages_needed(num_tokens), len(table)))

    def _pages_to_take(self, seq: Sequence, num_tokens: int) -> tuple[int, list[int], list[int]]:
        """(new pages, shared written entries to copy on write, entries behind the window to release)."""
        table = self.table(seq)
        new = max(self.pages_needed(num_tokens) - len(table), 0)
        written = self._written_pages(seq, num_tokens)
        assert not any(self.is_null(table[i]) for i in written), "a step writes behind its own window"
        cow = [i for i in written if self.ref_counts[table[i]] > 1]
        return new, cow, self._behind_window(seq)

    def _room(self, seq: Sequence, behind: list[int]) -> int:
        """Allocatable pages once the entries behind the window are released."""
        table = self.table(seq)
        return self.num_free_pages + sum(self.ref_counts[table[i]] == 1 for i in behind)

    def _in_place(self, seq: Sequence, num_tokens: int) -> bool:
        """The steady-decode case, checked before the general one because it is most steps of most sequences: no
        window, the table already covers `num_tokens`, and every page the step writes is private and unregistered,
        so `grow` has nothing to allocate, copy, release or forget."""
        if self.window is not None:
            return False
        table = self.table(seq)
        if -(-num_tokens // self.page_size) > len(table):
            return False
        for i in self._written_pages(seq, num_tokens):
            if self.ref_counts[table[i]] != 1 or table[i] in self.page_hash:
                return False
        return True

    def decode_in_place(self, seq: Sequence) -> bool:
        """`_in_place(seq, seq.num_computed_tokens + 1)` for a steady decode row, without its general walk: the
        one page written is the one holding the next slot, present, private and unregistered."""
        if self.window is not None:
            return False
        table = self.table(seq)
        k = seq.num_computed_tokens // self.page_size
        return k < len(table) and self.ref_counts[table[k]] == 1 and table[k] not in self.page_hash

    def decode_open_page(self, seq: Sequence) -> bool:
        """For a steady decode row whose next write opens a page, with a page allocatable: append it and return
        True (what `grow(seq, seq.num_computed_tokens + 1)` does then: no window, so nothing to release, and the
        one written page is the fresh one, so nothing to copy or forget); False leaves the general path to it."""
        if self.window is not None or not self.num_free_pages:
            return False
        table = self.table(seq)
        if seq.num_computed_tokens // self.page_size != len(table):
            return False
        page = self._allocate()
        self.appended.append((seq, len(table), page))
        table.append(page)
        return True

    def take_touched(self) -> TableChanges:
        """How the sequences' tables changed since the last call (see `touched`)."""
        changes = TableChanges(self.touched, self.appended)
        self.touched, self.appended = set(), []
        return changes

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `grow(seq, num_tokens)` would succeed: new pages plus copy-on-write copies fit."""
        if self._in_place(seq, num_tokens):
            return True
        new, cow, behind = self._pages_to_take(seq, num_tokens)
        return new + len(cow) <= self._room(seq, behind)

    def grow(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Make the sequence's table hold `num_tokens` tokens and make every page the next step writes private.

        The step writes slots [seq.num_computed_tokens, num_tokens). A written page that other sequences also hold
        is replaced by a fresh one (copy-on-write); with a window, pages wholly behind it are released first and
        their entries point at the null page. Returns the (src, dst) page copies the engine must run on device
        before the step; they are also queued in `pending_copies` (see `take_copies`).
        """
        if self._in_place(seq, num_tokens):
            return []
        new, cow, behind = self._pages_to_take(seq, num_tokens)
        if new + len(cow) > self._room(seq, behind):
            raise OutOfPagesError(f"need {new + len(cow)} pages, {self._room(seq, behind)} free")
        self.touched.add(seq)
        table = self.table(seq)
        self._drop([table[i] for i in behind])
        for i in behind:
            table[i] = NULL_PAGE
        for i in self._written_pages(seq, num_tokens):
            if i not in cow and table[i] in self.page_hash:
                # Only after a fork that recomputes a token of a cached full page whose other holders are gone:
                # nobody else holds it, so forget its hash and write in place rather than spend a copy.
                del self.cached[self.page_hash.pop(table[i])]
        copies = []
        for i in cow:
            old = table[i]
            table[i] = self._allocate()
            self.ref_counts[old] -= 1  # still >= 1: the other holders keep it
            if i * self.page_size < seq.num_computed_tokens:  # it holds KV this sequence still needs
                copies.append((old, table[i]))
        table.extend(self._allocate() for _ in range(new))
        self.pending_copies.extend(copies)
        return copies

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copies queued by `grow` since the last call; run them on device before the next step."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references (full attention: tail first, so LRU evicts prefix tails before heads)."""
        table = self.table(seq)
        self._drop(table)
        table.clear()
        self._chains.pop(seq, None)
        self.touched.add(seq)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the pages past the first `num_tokens` tokens (speculative tokens that were rejected)."""
        table = self.table(seq)
        keep = self.pages_needed(num_tokens)
        self._drop(table[keep:])
        del table[keep:]
        self.touched.add(seq)

    def _drop(self, pages: list[int]) -> None:
        """Release one reference to each page (null entries skipped). Cached pages are parked in the LRU in an
        order that evicts what a prefix hit needs least first: the tail of a full-attention prefix (a chain
        without its head never hits), the head of a windowed one (a hit never reads behind its window)."""
        for page in (pages if self.window is not None else reversed(pages)):
            if self.is_null(page):
                continue
            self.ref_counts[page] -= 1
            assert self.ref_counts[page] >= 0, f"page {page} released more often than held"
            if self.ref_counts[page] == 0:
                if page in self.page_hash:
                    self.evictable[page] = None
                else:
                    self.free_pages.append(page)

    # ---- sharing ----------------------------------------------------------------------------------------------
    def fork_point(self, parent: Sequence, child: Sequence) -> int | None:
        """How many computed tokens `child` can take over from `parent`: their common computed prefix, capped so
        the child's last token is still to be computed (it needs its own logits). None if the window of that point
        reads a page the parent has released (it moved on past its window): the child then computes alone."""
        limit = min(parent.num_computed_tokens, child.num_tokens - 1)
        same = 0
        while same < limit and parent.token_ids[same] == child.token_ids[same]:
            same += 1
        table = self.table(parent)
        if any(self.is_null(table[i]) for i in range(self.first_needed_page(same), self.pages_needed(same))):
            return None
        return same

    def fork(self, parent: Sequence, child: Sequence, same: int | None = None) -> None:
        """Let `child` share all of `parent`'s pages (partial last page included).

        `child.num_computed_tokens` becomes `same` (default: `fork_point`); later writes copy-on-write the shared
        page. When the parent's window has moved past that point, the child gets nothing and computes alone.
        """
        if any(child.block_tables) or child.num_computed_tokens:
            raise ValueError(f"fork: sequence {child.seq_id} already has pages or computed tokens")
        same = self.fork_point(parent, child) if same is None else same
        if same is not None:
            self.share(parent, child, same)

    def share(self, parent: Sequence, child: Sequence, same: int) -> None:
        """`fork` without the checks (a coordinator of several groups checks once)."""
        table = self.table(parent)
        for page in table:
            if not self.is_null(page):
                self.ref_counts[page] += 1
        self.table(child)[:] = table
        self.touched.add(child)
        child.num_computed_tokens = same
        chain = self._chains.get(parent)
        if chain is not None:
            self._chains[child] = _Chain(chain.root, chain.generation, chain.hashes[:same // self.page_size])

    def chain(self, seq: Sequence) -> _Chain | None:
        """The chain hashes of `seq`'s computed full pages, if they count (of the current cache generation)."""
        chain = self._chains.get(seq)
        return chain if chain is not None and chain.generation == self._generation else None

    def _root(self, extra_key: Hashable) -> bytes:
        return hashlib.sha256(repr((self._generation, extra_key)).encode()).digest()

    def match_prefix(self, seq: Sequence, extra_key: Hashable = None) -> int:
        """Attach the longest run of cached full pages that prefixes `seq` and return the tokens they cover.

        Sets `seq.num_computed_tokens` to that count. At most `num_tokens - 1` tokens match. `extra_key` (LoRA id,
        model version, ...) separates caches: pages match only requests with an equal key. With a window only the
        pages the window reads must be cached (see the module docstring).
        """
        hashes, found = self.lookup(seq, extra_key)
        ok = self.resumable(found)
        return self.attach(seq, hashes, found, max(m for m, good in enumerate(ok) if good))

    def lookup(self, seq: Sequence, extra_key: Hashable = None) -> tuple[list[bytes], list[int | None]]:
        """Start `seq`'s hash chain; return the chain hashes of its full pages (all but its last token) and the
        cached page of each (None: not cached). Without a window hashing stops at the first miss."""
        if any(seq.block_tables) or seq.num_computed_tokens:
            raise ValueError(f"match_prefix: sequence {seq.seq_id} already has pages or computed tokens")
        chain = self._chains[seq] = _Chain(self._root(extra_key), self._generation)
        self.prefix_queries_tokens += seq.num_tokens
        hashes: list[bytes] = []
        found: list[int | None] = []
        if not self.enable_prefix_caching:
            return hashes, found
        ps = self.page_size
        for i in range((seq.num_tokens - 1) // ps):
            hashes.append(chain_hash(hashes[-1] if hashes else chain.root, seq.token_ids[i * ps:(i + 1) * ps]))
            found.append(self.cached.get(hashes[-1]))
            if found[-1] is None and self.window is None:
                break
        return hashes, found

    def resumable(self, found: list[int | None]) -> list[bool]:
        """ok[m]: whether a sequence whose first m full pages are `found[:m]` can resume at token m * page_size,
        i.e. every page the window of that position reads is cached (all m of them without a window)."""
        ok, run = [True], 0
        for m in range(1, len(found) + 1):
            run = run + 1 if found[m - 1] is not None else 0
            ok.append(m - self.first_needed_page(m * self.page_size) <= run)
        return ok

    def attach(self, seq: Sequence, hashes: list[bytes], found: list[int | None], m: int) -> int:
        """Give `seq` its first m pages from the cache (null before the window) and return the tokens they cover."""
        table, chain = self.table(seq), self._chains[seq]
        self.touched.add(seq)
        first = self.first_needed_page(m * self.page_size)
        for i in range(m):
            page = found[i]
            if i < first:
                table.append(NULL_PAGE)
                continue
            if self.ref_counts[page] == 0:
                del self.evictable[page]  # revived
            self.ref_counts[page] += 1
            table.append(page)
        chain.hashes.extend(hashes[:m])
        seq.num_computed_tokens = m * self.page_size
        self.prefix_hits_tokens += seq.num_computed_tokens
        return seq.num_computed_tokens

    def commit_full_pages(self, seq: Sequence, num_computed_tokens: int | None = None) -> int:
        """Register the sequence's newly computed full pages so later requests can hit them; returns how many.

        Call after the step, once `seq.num_computed_tokens` counts the tokens it wrote. A page whose hash is
        already cached on another page (two requests computed it concurrently) stays unregistered.
        """
        n = seq.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        chain = self._chains.get(seq)
        if chain is None:
            chain = self._chains[seq] = _Chain(self._root(None), self._generation)
        if not self.enable_prefix_caching or chain.generation != self._generation:
            return 0
        ps, registered, table = self.page_size, 0, self.table(seq)
        for i in range(len(chain.hashes), min(n // ps, len(table))):
            h = chain_hash(chain.hashes[-1] if chain.hashes else chain.root, seq.token_ids[i * ps:(i + 1) * ps])
            chain.hashes.append(h)
            page = table[i]
            if not self.is_null(page) and page not in self.page_hash and h not in self.cached:
                self.page_hash[page], self.cached[h] = h, page
                registered += 1
        return registered

    def reset_prefix_cache(self) -> int:
        """Forget every hash (after a weight update): evictable pages become free, and running sequences' chains
        never register again. Returns how many evictable pages were freed."""
        freed = len(self.evictable)
        self.free_pages.extend(self.evictable)
        self.evictable.clear()
        self.page_hash.clear()
        self.cached.clear()
        self._generation += 1
        return freed
