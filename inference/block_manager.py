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

from inference.sequence import Sequence


class OutOfPagesError(RuntimeError):
    pass


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Hash of a full page: its parent page's hash (or the chain root) and its token ids."""
    return hashlib.sha256(parent + array.array("q", tokens).tobytes()).digest()


@dataclasses.dataclass
class _Chain:
    """The chain hashes of one sequence's computed full pages: hashes[i] names pages[i]."""
    root: bytes
    generation: int
    hashes: list[bytes] = dataclasses.field(default_factory=list)


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need at least one page of at least one token, got {num_pages} x {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.free_pages: collections.deque[int] = collections.deque(range(num_pages))
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.page_hash: dict[int, bytes] = {}  # registered page -> its chain hash
        self.cached: dict[bytes, int] = {}  # chain hash -> registered page
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) not yet taken by the engine
        self.prefix_hits_tokens = 0
        self.prefix_queries_tokens = 0
        self._generation = 0  # bumped by reset_prefix_cache: older chains never register again
        self._chains: dict[Sequence, _Chain] = {}

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
        return -(-num_tokens // self.page_size)

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
        """Indices into seq.pages (existing ones only) that a step writing [num_computed, num_tokens) touches."""
        if num_tokens <= seq.num_computed_tokens:
            return range(0)
        return range(seq.num_computed_tokens // self.page_size, min(self.pages_needed(num_tokens), len(seq.pages)))

    def _pages_to_take(self, seq: Sequence, num_tokens: int) -> tuple[int, list[int]]:
        new = max(self.pages_needed(num_tokens) - len(seq.pages), 0)
        cow = [i for i in self._written_pages(seq, num_tokens) if self.ref_counts[seq.pages[i]] > 1]
        return new, cow

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `grow(seq, num_tokens)` would succeed: new pages plus copy-on-write copies fit."""
        new, cow = self._pages_to_take(seq, num_tokens)
        return new + len(cow) <= self.num_free_pages

    def grow(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Make `seq.pages` hold `num_tokens` tokens and make every page the next step writes private to `seq`.

        The step writes slots [seq.num_computed_tokens, num_tokens). A written page that other sequences also hold
        is replaced by a fresh one (copy-on-write). Returns the (src, dst) page copies the engine must run on
        device before the step; they are also queued in `pending_copies` (see `take_copies`).
        """
        new, cow = self._pages_to_take(seq, num_tokens)
        if new + len(cow) > self.num_free_pages:
            raise OutOfPagesError(f"need {new + len(cow)} pages, {self.num_free_pages} free")
        for i in self._written_pages(seq, num_tokens):
            if i not in cow and seq.pages[i] in self.page_hash:
                # Only after a fork that recomputes a token of a cached full page whose other holders are gone:
                # nobody else holds it, so forget its hash and write in place rather than spend a copy.
                del self.cached[self.page_hash.pop(seq.pages[i])]
        copies = []
        for i in cow:
            old = seq.pages[i]
            seq.pages[i] = self._allocate()
            self.ref_counts[old] -= 1  # still >= 1: the other holders keep it
            if i * self.page_size < seq.num_computed_tokens:  # it holds KV this sequence still needs
                copies.append((old, seq.pages[i]))
        seq.pages.extend(self._allocate() for _ in range(new))
        self.pending_copies.extend(copies)
        return copies

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copies queued by `grow` since the last call; run them on device before the next step."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references (tail first, so LRU evicts prefix tails before heads)."""
        self._drop(seq.pages)
        seq.pages = []
        self._chains.pop(seq, None)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the pages past the first `num_tokens` tokens (speculative tokens that were rejected)."""
        keep = self.pages_needed(num_tokens)
        self._drop(seq.pages[keep:])
        del seq.pages[keep:]

    def _drop(self, pages: list[int]) -> None:
        for page in reversed(pages):
            self.ref_counts[page] -= 1
            assert self.ref_counts[page] >= 0, f"page {page} released more often than held"
            if self.ref_counts[page] == 0:
                if page in self.page_hash:
                    self.evictable[page] = None
                else:
                    self.free_pages.append(page)

    # ---- sharing ----------------------------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share all of `parent`'s pages (partial last page included).

        `child.num_computed_tokens` becomes the length of the computed prefix both agree on, capped so the child's
        last token is still to be computed (it needs its own logits); later writes copy-on-write the shared page.
        """
        if child.pages or child.num_computed_tokens:
            raise ValueError(f"fork: sequence {child.seq_id} already has pages or computed tokens")
        limit = min(parent.num_computed_tokens, child.num_tokens - 1)
        same = 0
        while same < limit and parent.token_ids[same] == child.token_ids[same]:
            same += 1
        for page in parent.pages:
            self.ref_counts[page] += 1
        child.pages = list(parent.pages)
        child.num_computed_tokens = same
        chain = self._chains.get(parent)
        if chain is not None:
            self._chains[child] = _Chain(chain.root, chain.generation, chain.hashes[:same // self.page_size])

    def _root(self, extra_key: Hashable) -> bytes:
        return hashlib.sha256(repr((self._generation, extra_key)).encode()).digest()

    def match_prefix(self, seq: Sequence, extra_key: Hashable = None) -> int:
        """Attach the longest run of cached full pages that prefixes `seq` and return the tokens they cover.

        Sets `seq.num_computed_tokens` to that count. At most `num_tokens - 1` tokens match. `extra_key` (LoRA id,
        model version, ...) separates caches: pages match only requests with an equal key.
        """
        if seq.pages or seq.num_computed_tokens:
            raise ValueError(f"match_prefix: sequence {seq.seq_id} already has pages or computed tokens")
        chain = self._chains[seq] = _Chain(self._root(extra_key), self._generation)
        self.prefix_queries_tokens += seq.num_tokens
        if not self.enable_prefix_caching:
            return 0
        ps = self.page_size
        for i in range((seq.num_tokens - 1) // ps):
            h = chain_hash(chain.hashes[-1] if chain.hashes else chain.root, seq.token_ids[i * ps:(i + 1) * ps])
            page = self.cached.get(h)
            if page is None:
                break
            if self.ref_counts[page] == 0:
                del self.evictable[page]  # revived
            self.ref_counts[page] += 1
            seq.pages.append(page)
            chain.hashes.append(h)
        seq.num_computed_tokens = len(seq.pages) * ps
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
        ps, registered = self.page_size, 0
        for i in range(len(chain.hashes), min(n // ps, len(seq.pages))):
            h = chain_hash(chain.hashes[-1] if chain.hashes else chain.root, seq.token_ids[i * ps:(i + 1) * ps])
            chain.hashes.append(h)
            page = seq.pages[i]
            if page not in self.page_hash and h not in self.cached:
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
