"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Requests join and leave at every step (Orca). Each step has a token budget (`max_num_batched_tokens`) and a cap on
running sequences (`max_num_seqs`); prompts are prefilled in chunks that fit the budget. How prefill competes with
decode is a policy:

- "mixed" (vLLM v1): every running sequence decodes one token, and prompt chunks fill the rest of the budget in
  the same step. Decode is never starved; the step's longest query is the longest chunk.
- "prefill_first": a step is either prefill or decode; prefill goes first, but after `max_prefill_streak`
  prefill steps in a row with sequences waiting to decode, a decode step runs. Where attention is the
  pure-JAX reference, which pays for the longest query in every sequence of the step, separate steps are cheaper.

Waiting sequences are served by (priority, arrival): FCFS unless a request sets a lower `priority`. New sequences
first look up the prefix cache. When pages run out, the lowest-priority newest sequence is preempted: its pages
are freed and it goes back to the queue to be recomputed (its cached full pages usually make that cheap).
The `n` samples of a request wait until the first sample has computed the prompt, then fork its pages.

A hybrid model's state layers (`state`, inference/engine/pages/state_slots.py) add three rules: a sequence gets a
state slot at admission and gives it back at finish and preemption; a prompt's chunks end on page boundaries, and
one ends at the last full page a later request can hit, so the state there is checkpointed (vLLM's "align" mode); a
prefix hit ends where a checkpoint exists; and the `n` samples fork one token before the prompt's end (sample 0 stops
there for one step), since every sample computes the last prompt token itself from the state before it.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from typing import Callable

import numpy as np

from inference.engine.config import SchedulerConfig
from inference.engine.pages.kv_cache_manager import KVCacheManager
from inference.engine.pages.state_slots import StateSlotManager
from inference.engine.scheduled_batch import ScheduledBatch, token_limit, uncomputed
from inference.engine.sequence import Sequence, SequenceStatus


#: The waiting order (priority, arrival), as a C-level key: the decode pass's order of the running sequences.
_queue_key = operator.attrgetter("priority", "arrival_order")
_computed = operator.attrgetter("num_computed_tokens")
RUNNING = SequenceStatus.RUNNING


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: KVCacheManager,
                 proposer: Callable[[Sequence], list[int]] | None = None,
                 on_preempt: Callable[[Sequence], None] | None = None,
                 admit: Callable[[Sequence, list[Sequence]], bool] | None = None,
                 finishing: Callable[[Sequence], bool] | None = None, state: StateSlotManager | None = None,
                 max_model_len: int | None = None, on_fail: Callable[[Sequence, Exception], None] | None = None):
        """`proposer` (speculative decoding) gives a decoding sequence draft tokens to verify in its step;
        `on_preempt` is told when a sequence loses its pages (a draft model's own KV of it is gone too); `admit`
        says whether a waiting sequence may join the running ones (LoRA: no more adapters than device slots);
        `finishing` names decoding sequences not to schedule: async scheduling's, whose in-flight token ends them;
        `state`: the state slots of a hybrid model's state layers (None: the model has none). `max_model_len`: the
        engine's context; with `finishing`, only a sequence at its `token_limit` is asked (None: every one is).
        `on_fail` fails one sequence that cannot go on (alone, it needs more pages than the cache holds), no other,
        or puts that off (the sequence is then not scheduled this step); None: the step raises."""
        self.config = config
        self.proposer = proposer
        self.on_preempt = on_preempt
        self.admit = admit
        self.finishing = finishing
        self.on_fail = on_fail
        self.block_manager = block_manager
        self.state = state
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []
        self.awaiting_fork: list[Sequence] = []  # samples 1..n-1 of a request, until sample 0 has the prompt
        self.max_model_len = max_model_len
        self.num_preemptions = 0
        self._prefill_streak = 0
        # The decode pass's state between steps (`_schedule_decode`): the running sequences in queue order with
        # their length limits, kept through a finish and an admission (`_order_drop`, `_order_add`), None after any
        # other change to `running` (rebuilt then); the rows the last pass checked
        # (their next page is known to be private, so a row needs a page test only when it crosses a boundary).
        self._order: tuple[list[Sequence], np.ndarray | None] | None = None
        self._checked: set[Sequence] = set()
        # The last steady decode pass found no running row prefilling (None: a mixed step's pass did not run it).
        self._no_partial: bool | None = False
        self._advanced: tuple[tuple, list[Sequence], np.ndarray] | None = None  # see `advanced`
        self.num_removed = 0  # sequences taken out by `remove` so far (finished or aborted)
        self._stalled = False  # this step's prompt pass met a running prompt whose next chunk finds no page
        # That pass applies without drafts and with one KV cache group without a window (the page test's premise).
        self._steady_pages = proposer is None and all(g.window is None for g in block_manager.groups) \
            and block_manager.num_groups == 1

    def add(self, seq: Sequence) -> None:
        # With state layers a sample forks one token before the prompt's end: a 1-token prompt has nothing to share.
        if seq.index > 0 and seq.num_output_tokens == 0 and not seq.pages and (
                self.state is None or seq.num_prompt_tokens > 1):
            self.awaiting_fork.append(seq)
        else:
            bisect.insort(self.waiting, seq, key=_queue_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.awaiting_fork)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished or aborted) and free its pages. Siblings still waiting to
        fork from it are queued to compute the prompt themselves."""
        if seq in self.running:
            self.running.remove(seq)
            self._order_drop(seq)
        for queue in (self.waiting, self.awaiting_fork):
            if seq in queue:
                queue.remove(seq)
        self.num_removed += 1
        self._checked.discard(seq)
        self.block_manager.release(seq)
        if self.state is not None:
            self.state.release(seq)
        for sibling in [s for s in self.awaiting_fork if s.request_id == seq.request_id]:
            self.awaiting_fork.remove(sibling)
            bisect.insort(self.waiting, sibling, key=_queue_key)

    def _order_drop(self, seq: Sequence) -> None:
        """`seq` left `running`: the kept queue order (`_schedule_decode_steady`) without it. A new tuple, so the
        advance hint made from the old one (`advanced`) no longer applies."""
        if self._order is not None:
            order, limits = self._order
            i = order.index(seq)  # identities compared in C
            self._order = (order[:i] + order[i + 1:],
                           None if limits is None else np.concatenate((limits[:i], limits[i + 1:])))

    def _order_add(self, seq: Sequence) -> None:
        """`seq` joined `running` (appended): the kept queue order with it, where `sorted(running)` puts it (after
        the rows with its key: the sort is stable and it came last)."""
        if self._order is not None:
            order, limits = self._order
            i = bisect.bisect_right(order, _queue_key(seq), key=_queue_key)
            self._order = (order[:i] + [seq] + order[i:], None if limits is None else np.concatenate(
                (limits[:i], np.array([token_limit(seq, self.max_model_len)], np.int64), limits[i:])))

    def advanced(self, seqs: list[Sequence], computed: np.ndarray) -> None:
        """Told by the engine after it advanced a steady decode batch (`seqs`, the last pass's rows in its order)
        without its tokens: each row now has `computed` tokens computed and one token more (its placeholder). The
        next steady pass takes that instead of reading the rows only if its queue order is still the one it
        scheduled them from: anything that changes `running` (a finish, an abort, a preemption, an admission, a
        fork) drops that order, so a row preempted and admitted again is read, even when the rows end up the same."""
        self._advanced = (self._order, seqs, computed)

    def fork_due(self, parent: Sequence) -> bool:
        """Whether `parent`'s siblings fork now: sample 0 has computed its prompt (with state layers: all of it but
        the last token, whose state every sample then computes from its own copy)."""
        if parent.index or not self.awaiting_fork:
            return False
        return parent.num_computed_tokens >= parent.num_prompt_tokens - (self.state is not None)

    def _fork_cut(self, seq: Sequence) -> int | None:
        """Where sample 0's prompt chunk must end so its siblings can fork (state layers only), or None."""
        if self.state is None or seq.index or not any(s.request_id == seq.request_id for s in self.awaiting_fork):
            return None
        return seq.num_prompt_tokens - 1

    def fork_samples(self, parent: Sequence) -> list[Sequence]:
        """After `parent` (sample 0) computed its prompt: its siblings share its pages and start decoding. With
        state layers each also needs a slot holding a copy of the parent's state; a sibling that cannot have one,
        or cannot take over exactly the parent's computed tokens, is queued to compute alone."""
        children = [s for s in self.awaiting_fork if s.request_id == parent.request_id]
        forked = []
        for child in children:
            self.awaiting_fork.remove(child)
            if self.state is not None and not self.state.can_allocate():
                bisect.insort(self.waiting, child, key=_queue_key)
                continue
            self.block_manager.fork(parent, child)
            if self.state is not None:
                if child.num_computed_tokens != parent.num_computed_tokens:
                    self.block_manager.release(child)
                    child.num_computed_tokens = 0
                    bisect.insort(self.waiting, child, key=_queue_key)
                    continue
                self.state.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
            self._order = None
            forked.append(child)
        return forked

    # ---- the step ---------------------------------------------------------------------------------------------
    def schedule(self, throughput_first: bool = False) -> ScheduledBatch | None:
        """The next step's batch under the configured policy; `throughput_first` runs a mixed policy's step as
        prefill_first (the engine asks for it where nobody reads tokens between steps: see `Engine._step`)."""
        while True:
            self._stalled = False
            batch = self._schedule(throughput_first)
            if batch is not None or not self._stalled or len(self.running) < 2 \
                    or (uncomputed(self.running)[1] <= 1).any():
                return batch
            # Every running sequence is a prompt part-way through, and the first in line finds no page for its
            # next chunk: nothing would ever free one. The newest gives its pages back (vLLM's victim), so the
            # older ones go on; it is recomputed later (its full pages stay in the prefix cache).
            self.preempt(max(self.running, key=_queue_key))

    def _schedule(self, throughput_first: bool) -> ScheduledBatch | None:
        if self.config.policy == "mixed" and not throughput_first:
            return self._schedule_mixed()
        prefill_due = self._prefill_streak < self.config.max_prefill_streak or not any(
            len(s.token_ids) - s.num_computed_tokens == 1 for s in self.running)
        batch = self._schedule_prefill(self.config.max_num_batched_tokens, []) if prefill_due else None
        if batch is not None:
            self._prefill_streak += 1
            return batch
        self._prefill_streak = 0
        return self._schedule_decode()  # None when no sequence decodes

    def _schedule_mixed(self) -> ScheduledBatch | None:
        self._no_partial = None
        decode = self._schedule_decode()
        no_partial = self._no_partial is True  # the steady pass ran now and found no running row prefilling
        if decode is not None and decode.computed is not None and no_partial and not self.waiting:
            return decode  # the steady decode state, known from the decode pass: nothing to prefill
        budget = self.config.max_num_batched_tokens - (decode.num_tokens if decode else 0)
        if decode is None:
            return self._schedule_prefill(budget, [], [], no_partial)
        return self._schedule_prefill(budget, decode.seqs, decode.num_new_tokens, no_partial, decode.starts,
                                      decode.lengths)

    def _schedule_prefill(self, budget: int, seqs: list[Sequence], counts: list[int] | None = None,
                          no_partial: bool = False, starts: np.ndarray | None = None,
                          lengths: np.ndarray | None = None) -> ScheduledBatch | None:
        """Prompt chunks after the decode rows `seqs` (`counts`; their `ScheduledBatch.starts` and `lengths`),
        within `budget` tokens: the running rows still prefilling first, then the waiting queue. `no_partial`: this
        step's steady decode pass found no running row prefilling (then `running` is not read again)."""
        if starts is None:
            starts = lengths = np.zeros(0, np.int64) if not seqs else None
        counts = [] if counts is None else counts
        running = self.running
        partial = [] if no_partial else \
            [running[i] for i in np.flatnonzero(uncomputed(running)[1] > 1).tolist() if running[i] not in seqs]
        if not partial and not self.waiting:  # the steady decode state: nothing to prefill
            return ScheduledBatch(seqs, counts, may_draft=self.proposer is not None, starts=starts,
                                  lengths=lengths) if seqs else None
        admitted = []
        chunk_starts: list[int] = []  # the prompt rows' computed tokens and token counts, beside `starts`, `lengths`
        chunk_lengths: list[int] = []
        for seq in partial + list(self.waiting):
            if budget <= 0 or len(seqs) == self.config.max_num_seqs:
                break
            is_new = seq.status is SequenceStatus.WAITING
            if is_new and len(self.running) >= self.config.max_num_seqs:
                break
            if is_new and self.admit is not None and not self.admit(seq, self.running):
                continue
            if is_new and self.state is not None:  # a slot first: taking it may evict a checkpoint
                if not self.state.can_allocate():
                    break
                self.state.allocate(seq)
            if is_new and not seq.pages and seq.params.prompt_logprobs is None:  # those need every position
                self._match_prefix(seq)
            chunk = min(seq.num_uncomputed_tokens, budget)
            if self.state is not None and chunk > 1:
                chunk = self._state_chunk(seq, chunk)
            if not self.block_manager.can_grow(seq, seq.num_computed_tokens + chunk):
                if is_new:  # give back the prefix pages it just took; it stays queued
                    self.block_manager.release(seq)
                    seq.num_computed_tokens = 0
                    if self.state is not None:
                        self.state.release(seq)
                else:
                    self._stalled = True
                break
            self.block_manager.grow(seq, seq.num_computed_tokens + chunk)
            if is_new:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                self._order_add(seq)
                admitted.append(seq)
            seqs.append(seq)
            counts.append(chunk)
            chunk_starts.append(seq.num_computed_tokens)
            chunk_lengths.append(len(seq.token_ids))
            budget -= chunk
        if seqs:
            if starts is not None:
                starts = np.concatenate((starts, np.asarray(chunk_starts, np.int64)))
                lengths = np.concatenate((lengths, np.asarray(chunk_lengths, np.int64)))
            return ScheduledBatch(seqs, counts, admitted, may_draft=self.proposer is not None, starts=starts,
                                  lengths=lengths)
        if self.waiting and not self.running:
            head = self.waiting[0]
            raise RuntimeError(f"request {head.request_id} cannot be scheduled with an empty engine; it should have "
                               "been rejected when it was added")
        return None

    def _match_prefix(self, seq: Sequence) -> None:
        """Attach the longest cached prefix (no hits across adapters); with state layers, one that ends at a state
        checkpoint, restored into the sequence's slot."""
        state = self.state
        state_ok = state.has_checkpoint if state is not None else None
        self.block_manager.match_prefix(seq, seq.lora_id or None, state_ok=state_ok)
        seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed_tokens)
        if state is None or not seq.num_computed_tokens:
            return
        state.restore(seq, self.block_manager.prefix_key(seq, seq.num_computed_tokens // self.block_manager.page_size))
        if self._fork_cut(seq) == seq.num_computed_tokens:  # the hit reaches where the samples fork
            self.fork_samples(seq)

    def _state_chunk(self, seq: Sequence, chunk: int) -> int:
        """A prompt chunk of a hybrid model, shortened to end where a state is worth keeping: on a page boundary
        (a checkpoint a later prefix hit resumes from), at the last full page before the sequence's last token (the
        longest hit a request with this prefix can have), and where the samples of `n` fork."""
        start, ps = seq.num_computed_tokens, self.block_manager.page_size
        end = start + chunk
        if self.state.enable_prefix_caching:
            last = (seq.num_tokens - 1) // ps * ps
            if start < last < end:
                end = last
            elif end < seq.num_tokens and end // ps * ps > start:
                end = end // ps * ps
        cut = self._fork_cut(seq)
        if cut is not None and start < cut < end:
            end = cut
        return end - start

    def checkpoint_state(self, seq: Sequence) -> None:
        """After a step of `seq` (its computed tokens advanced, its full pages committed): when they end on a page
        boundary within the prompt, keep the state there under the page's chain hash, so a later request whose
        prefix hit reaches that page resumes from it. The copy runs before the next step overwrites the slot."""
        n, ps = seq.num_computed_tokens, self.block_manager.page_size
        if self.state is None or n % ps or not 0 < n <= seq.num_prompt_tokens:
            return
        key = self.block_manager.prefix_key(seq, n // ps)
        if key is not None:
            self.state.save_checkpoint(seq, key)

    def _schedule_decode(self) -> ScheduledBatch | None:
        if self._steady_pages:
            return self._schedule_decode_steady()
        return self._schedule_decode_general()

    def _schedule_decode_steady(self) -> ScheduledBatch | None:
        """The decode pass without drafts and with one KV cache group without a window: the general pass's result,
        with per-row work only for the rows that need it. The queue order is kept while `running` does not change;
        a row's computed and total tokens are read in C loops; only a row that joined the decode rows since the last
        pass, opens a page now (its computed tokens a multiple of the page size), or reaches its length limit (when
        `finishing` is set) goes through the general row logic. Every other row's next write lands in the page the
        last pass made private for it, which nothing has shared or registered since (a fork or a preemption changes
        `running`; only full pages are registered), so it is scheduled with no page work."""
        if self._order is None:
            order = sorted(self.running, key=_queue_key)
            limit = self.max_model_len if self.finishing is not None else None
            # Rebuilt only after a preemption or a fork: a finish or an admission keeps the order (`_order_drop`,
            # `_order_add`).
            limits = np.fromiter((token_limit(s, limit) for s in order), np.int64, len(order)) \
                if limit is not None else None
            self._order = (order, limits)
        order, limits = self._order
        advanced, self._advanced = self._advanced, None
        if advanced is not None and advanced[0] is self._order and advanced[1] == order:  # identities, in C
            computed, left = advanced[2], np.ones(len(order), np.int64)
        else:
            computed, left = uncomputed(order)
        decoding = left == 1
        self._no_partial = not (left > 1).any()  # no running row is prefilling (a preemption's victim leaves them)
        if int(decoding.sum()) > self.config.max_num_seqs:  # the cap cuts the pass short: the general pass's order
            self._checked = set()
            return self._schedule_decode_general()
        special = decoding & (computed % self.block_manager.page_size == 0)
        checked = self._checked
        if len(checked) < len(order):  # some rows have not been checked by an earlier pass
            special |= decoding & ~np.fromiter(map(checked.__contains__, order), bool, len(order))
        if self.finishing is not None:
            special |= decoding & (computed + 1 >= limits) if limits is not None else decoding
        rows = np.flatnonzero(special).tolist()
        num_running = len(self.running)
        for i in rows:
            seq = order[i]
            if seq.status is not RUNNING or (self.finishing is not None and self.finishing(seq)) \
                    or not self._grow_decode_row(seq):
                decoding[i] = False
        if len(self.running) != num_running:  # preemptions: their victims leave the batch (the next pass reorders)
            decoding &= np.fromiter((s.status is RUNNING for s in order), bool, len(order))
        scheduled = order if decoding.all() else list(itertools.compress(order, decoding.tolist()))
        self._checked = set(scheduled) if rows or len(checked) != len(scheduled) else checked
        if not scheduled:
            return None
        if len(scheduled) != len(order):
            computed = computed[decoding]
        return ScheduledBatch(list(scheduled), [1] * len(scheduled), may_draft=False, computed=computed,
                              starts=computed, lengths=computed + 1)

    def _schedule_decode_general(self) -> ScheduledBatch | None:
        """Every decoding row in queue order, each checked for drafts, pages and preemption (`_grow_decode_row`)."""
        scheduled: list[Sequence] = []
        for seq in sorted(self.running, key=_queue_key):
            if seq.status is not RUNNING or len(seq.token_ids) - seq.num_computed_tokens != 1:
                continue  # preempted below while making room for an older sequence, or still prefilling
            if self.finishing is not None and self.finishing(seq):
                continue
            if self._grow_decode_row(seq):
                scheduled.append(seq)
                if len(scheduled) == self.config.max_num_seqs:
                    break
        if not scheduled:
            return None
        counts = [1 + len(s.spec_tokens) for s in scheduled] if self.proposer is not None else [1] * len(scheduled)
        starts = np.fromiter(map(_computed, scheduled), np.int64, len(scheduled))  # each has one uncomputed token
        return ScheduledBatch(scheduled, counts, may_draft=self.proposer is not None, starts=starts,
                              lengths=starts + 1)

    def _grow_decode_row(self, seq: Sequence) -> bool:
        """Give a decoding row its drafts and the pages of its next write, preempting the newest sequences while
        pages are short; whether the row still runs (it may have been the one preempted)."""
        if self.proposer is None and (self.block_manager.decode_in_place(seq)
                                      or self.block_manager.decode_open_page(seq)):
            return True  # steady decode: nothing to copy or preempt, at most one fresh page to append
        seq.spec_tokens = self.proposer(seq) if self.proposer is not None else []
        if seq.spec_tokens and not self.block_manager.can_grow(seq, seq.num_tokens + len(seq.spec_tokens)):
            seq.spec_tokens = []  # short of pages: verify nothing rather than preempt anyone
        while not self.block_manager.can_grow(seq, seq.num_tokens):
            victim = max(self.running, key=_queue_key)
            if victim is seq and len(self.running) == 1:
                self._fail_alone(seq)
                return False
            self.preempt(victim)
            if victim is seq:
                break
        if seq.status is not RUNNING:
            return False
        self.block_manager.grow(seq, seq.num_tokens + len(seq.spec_tokens))
        return True

    def _fail_alone(self, seq: Sequence) -> None:
        """`seq`, the only running sequence, needs a page more than the whole cache holds: it fails, no other."""
        need = seq.num_tokens + len(seq.spec_tokens)
        short = self.block_manager.shortfall(need, 1) or "needs more KV pages than the cache has free"
        error = RuntimeError(f"request {seq.request_id} at {need} tokens {short}; raise kv_cache_memory_bytes or "
                             "lower max_tokens")
        if self.on_fail is None:
            raise error
        self.on_fail(seq, error)

    def preempt(self, seq: Sequence, *, count: bool = True) -> None:
        """Free a sequence's pages and queue it for recomputation; `count=False` for a recompute the caller
        asked for (not a shortage of pages), which `num_preemptions` does not count."""
        self.running.remove(seq)
        self._order = None
        self._checked.discard(seq)
        self.block_manager.release(seq)
        if self.state is not None:
            self.state.release(seq)
        seq.num_computed_tokens = 0
        seq.spec_tokens = []
        if self.on_preempt is not None:
            self.on_preempt(seq)
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_queue_key)
        self.num_preemptions += count
