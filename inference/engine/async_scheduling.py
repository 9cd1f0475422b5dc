"""Async scheduling: step N+1 is dispatched before step N's sampled tokens reach the host (vLLM V1's async
scheduling, SGLang's overlap scheduler).

A step's host work (scheduling, pages, the ragged batch, stop checks, detokenizing, outputs) otherwise runs while
the device waits. With it on (`SchedulerConfig.async_scheduling`, the default), one `Engine.step` does:

1. schedule step N+1: the scheduler sees step N's sequences already advanced (computed tokens, pages), each token N
   samples standing in `Sequence.token_ids` as a placeholder (`PLACEHOLDER`);
2. dispatch N+1 (JAX dispatch returns at once): its placeholder input tokens are gathered inside the step, on the
   device, from N's sampled-token array, by row (`feed_pending_tokens`, `TokenFeed`); every other input token is
   known on the host;
3. fold N while N+1 computes: fetch its tokens (the copy started when N was dispatched), put them in place of the
   placeholders, run the stop checks, detokenize, build the outputs;
4. advance N+1's bookkeeping without its tokens (`advance`) and leave it in flight.

Why the outputs are the synchronous engine's: a sequence's tokens depend only on its own history (its sampling key
is (seed, index of the generated token), its KV only its own tokens), and every row of N+1 runs on the same tokens
and positions a synchronous N+1 would give it. What differs is only when things happen: a sequence that step N's
token finishes (EOS, a stop string) already has a row in N+1, whose token is discarded (at most one wasted slot per
finished sequence; its pages are freed when N is folded, and any step that reuses them is ordered after N+1 on the
device; one that N's token surely ends by length gets no row, `finishes_in_flight`); pages freed by N's finished
sequences reach waiting requests one step later, so admission and preemption may come a step earlier or later,
which moves no token (a preempted sequence recomputes the same tokens). "The same" is bit for bit in batch-invariant
mode (`LLM(batch_invariant=True)`, tested); otherwise a row's float rounding depends on the batch it runs in, so
logprobs agree to rounding and a near-tie token can differ, exactly as between two batchings of the synchronous
engine.

The rule (`sync_reasons`): a step runs synchronously, after the in-flight step is folded, when one of its rows needs
a token of the in-flight step on the host, or its own outputs are needed before the next step can be built:
structured outputs (the mask of the next token depends on this one), penalties (the token counts go to the device)
and bad_words (matched against the last tokens), prompt logprobs (recorded at this step's position), speculative
decoding (drafts are proposed from the tokens; an engine with a proposer never overlaps), and a sequence whose
placeholder is not a plain decode row of the step (recomputed after a preemption). The rule is per step, so a mixed
workload overlaps its other steps and every step is exact. `Engine.drain` folds the in-flight step (sleep, and the
engine loop's pause, call it); an abort drops the sequence's placeholder at once.
"""

from __future__ import annotations

import dataclasses
import collections
import itertools
import logging
import operator
import time
from typing import Any

import numpy as np

from inference.engine.outputs import RequestOutput
from inference.engine.scheduled_batch import ScheduledBatch, token_limit
from inference.engine.sequence import Sequence, SequenceStatus
from inference.runtime.batch import ModelInput, TokenFeed
from inference.runtime.runner import PendingStep
from inference.sampling.params import some_set
from inference.sampling.sampler import needs_penalties

# The functions below take the `Engine` (inference/engine/llm_engine.py), which imports this module: typed `Engine`
# here it would be an import cycle, so the alias only names it.
Engine = Any

log = logging.getLogger(__name__)

_token_ids = operator.attrgetter("token_ids")
_request_id = operator.attrgetter("request_id")
_status = operator.attrgetter("status")
_params = operator.attrgetter("params")
_bad_words = operator.attrgetter("bad_words")
FINISHED = SequenceStatus.FINISHED

PLACEHOLDER = -1  # a token id no vocabulary has: the in-flight step's sampled token, until it is folded


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step whose tokens the host has not seen yet."""

    pending: PendingStep
    rows: dict[Sequence, int]  # sequences this step samples a token for -> their row; PLACEHOLDER ends token_ids
    request_ids: list[str]  # requests the step advanced: their outputs are built when it is folded
    _rows_of: tuple[list[Sequence], np.ndarray] | None = None  # the last `rows_of` answer, for that list
    # Each sampled row's token count (its placeholder included), in `rows`' order, where the advance knew them
    # (`ScheduledBatch.lengths`); None once `rows` changed. The fold's plain-row split takes them.
    lengths: np.ndarray | None = None

    def rows_of(self, seqs: list[Sequence]) -> np.ndarray:
        """Each of `seqs`' row in this step, -1 where it samples none (i32, a C loop). The next step's checks and
        its token feed both ask it for that step's rows: the answer is kept for the same list (`rows` changes
        only at a fold or an abort, which drop it)."""
        kept = self._rows_of
        if kept is None or kept[0] is not seqs:
            kept = self._rows_of = (seqs, np.fromiter(map(self.rows.get, seqs, itertools.repeat(-1)), np.int32,
                                                      len(seqs)))
        return kept[1]


@dataclasses.dataclass
class AsyncStats:
    """What async scheduling did, for tests and benchmarks."""

    overlapped_steps: int = 0  # dispatched while the previous step's tokens were still on the device
    sync_steps: dict[str, int] = dataclasses.field(default_factory=dict)  # run synchronously, by reason
    wasted_rows: int = 0  # rows of sequences that the previous step's token had finished


@dataclasses.dataclass
class ParamsChecked:
    """Sequences whose parameters were found to need no synchronous step, now or later (`sync_reasons`): a step
    checks only its other rows, so under continuous batching the checks follow the joins, not the batch."""

    seqs: set[Sequence] = dataclasses.field(default_factory=set)

    def unchecked(self, seqs: list[Sequence]) -> list[Sequence]:
        """The rows not found clean yet (a C loop over the rows); forgets sequences that left, now and then."""
        if len(self.seqs) > 2 * len(seqs) + 64:
            self.seqs.intersection_update(seqs)
        return list(itertools.filterfalse(self.seqs.__contains__, seqs))


def _params_reasons(seqs: list[Sequence]) -> tuple[set[str], bool]:
    """The reasons that follow from the rows' sampling parameters (a row's prompt logprobs only while it still
    predicts a prompt position), and whether they hold for every later step of these rows (no prompt logprobs).
    Each is a C loop over the rows' parameters (their flags are cached properties)."""
    params = list(map(_params, seqs))
    reasons, lasting = set(), True
    if some_set(params, "structured_outputs"):
        reasons.add("structured_outputs")
    if needs_penalties(params):
        reasons.add("penalties")
    if any(map(_bad_words, params)):
        reasons.add("bad_words")
    if some_set(params, "prompt_logprobs"):
        lasting = False
        if any(seq.predicts_prompt for seq in seqs if seq.params.prompt_logprobs is not None):
            reasons.add("prompt_logprobs")
    return reasons, lasting


def sync_reasons(batch: ScheduledBatch, in_flight: InFlightStep | None,
                 checked: ParamsChecked | None = None) -> set[str]:
    """Why `batch` must run synchronously (the in-flight step folded first); empty: it may overlap. `checked`: kept
    across steps, so the parameter checks run only for rows not checked before; the rest are array operations over
    the batch."""
    seqs = batch.seqs
    fresh = seqs if checked is None else checked.unchecked(seqs)
    reasons, lasting = _params_reasons(fresh) if fresh else (set(), True)
    if checked is not None and lasting and not reasons:
        checked.seqs.update(fresh)
    if batch.computed is not None:  # the steady decode pass's rows: plain decode rows, no drafts
        return reasons
    if batch.speculative:
        reasons.add("speculative")
    if in_flight is not None and in_flight.rows:
        # A sequence whose placeholder is not its only uncomputed token, computed by this step as a plain decode row.
        fed = in_flight.rows_of(seqs) >= 0
        if fed.any():
            starts, lengths = batch.counts()
            left = lengths - starts
            plain = (np.fromiter(batch.num_new_tokens, np.int64, len(seqs)) == 1) & (left == 1)
            if (fed & ~plain).any():
                reasons.add("recompute")
    return reasons


def fed_in_order(batch: ScheduledBatch, in_flight: InFlightStep | None) -> bool:
    """Whether `batch`'s rows are exactly the in-flight step's sampled rows, in its order (the steady decode state:
    every input token is a placeholder, fed from that step)."""
    return in_flight is not None and len(in_flight.rows) == len(batch.seqs) and list(in_flight.rows) == batch.seqs


def feed_pending_tokens(inp: ModelInput, batch: ScheduledBatch, in_flight: InFlightStep | None,
                        in_order: bool = False) -> ModelInput:
    """`inp` with a `TokenFeed`: each placeholder input token is replaced, inside the step on the device, by the
    in-flight step's sampled token of that sequence (the placeholder is a decode row's only token: `sync_reasons`
    holds every other case back). Unchanged (the runner adds a no-op feed) when nothing is in flight. `in_order`:
    `fed_in_order` holds (then no sequence is looked up)."""
    if in_flight is None or not in_flight.rows or in_flight.pending.feed is None:
        return inp
    prev_row = np.fromiter(in_flight.rows.values(), np.int32, len(batch.seqs)) if in_order else \
        in_flight.rows_of(batch.seqs)
    fed = prev_row >= 0
    count = int(fed.sum())
    if not count:
        return inp
    size = inp.logits_indices.shape[0]  # one gather shape per sequence bucket
    dst = np.full(size, inp.tokens.shape[0], np.int32)
    src = np.zeros(size, np.int32)
    dst[:count] = inp.logits_indices[:len(batch.seqs)][fed]
    src[:count] = prev_row[fed]
    return inp.replace(feed=TokenFeed(prev=in_flight.pending.feed, dst=dst, src=src))


def advance(engine: Engine, batch: ScheduledBatch, pending: PendingStep, none_finished: bool = False
            ) -> InFlightStep:
    """The host bookkeeping of a dispatched step that needs no token (`Engine._advance`, as the synchronous
    `Engine._process` does before it appends a token), and a placeholder for each token the step samples.
    `none_finished`: no sequence was finished since `batch` was scheduled (then no row needs to be checked)."""
    seqs = batch.seqs
    if engine.state is None and not engine.scheduler.awaiting_fork and not batch.speculative \
            and (none_finished or not operator.countOf(map(_status, seqs), FINISHED)):
        return _advance_rows(engine, batch, pending)
    rows: dict[Sequence, int] = {}
    request_ids: dict[str, None] = {}
    for i, (seq, count) in enumerate(zip(seqs, batch.num_new_tokens)):
        if seq.is_finished:  # the previous step's token (or an abort) ended it: this row's token is discarded
            engine.async_stats.wasted_rows += 1
            continue
        request_ids[seq.request_id] = None
        try:
            if engine._advance(seq, count):
                seq.token_ids.append(PLACEHOLDER)
                rows[seq] = i
        except Exception as exc:  # noqa: BLE001 - one request's failure must not take the batch down
            engine._fail(seq, exc)
    return InFlightStep(pending, rows, list(request_ids))


def _advance_rows(engine: Engine, batch: ScheduledBatch, pending: PendingStep) -> InFlightStep:
    """`advance` of a step without drafts, none of its rows finished, with no state layers and no samples waiting
    to fork: `Engine._advance`'s bookkeeping as array operations and C loops over the rows, with per-row Python
    only where a row completes a page (its chain hash is registered). The rows' counts come from the scheduler
    (`ScheduledBatch.starts`, `lengths`) where it read them; a steady decode pass's rows (`ScheduledBatch.computed`)
    each computed their one uncomputed token: every row samples."""
    seqs, computed, n = batch.seqs, batch.computed, len(batch.seqs)
    before, lengths = batch.counts()
    after = before + np.asarray(batch.num_new_tokens, np.int64)
    collections.deque(map(setattr, seqs, itertools.repeat("num_computed_tokens"), after.tolist()), 0)
    sampled = np.ones(n, bool) if computed is not None else after >= lengths
    # A row's first step starts its chain; a step that completes a page registers it (`fold.advance`).
    ps = engine.page_size
    for i in np.flatnonzero((before == 0) | (before // ps != after // ps)).tolist():
        try:
            engine.block_manager.commit_full_pages(seqs[i])
        except Exception as exc:  # noqa: BLE001 - one request's failure must not take the batch down
            engine._fail(seqs[i], exc)
            sampled[i] = False
    if sampled.all():
        rows = dict(zip(seqs, range(n)))
    else:
        rows = dict(zip(itertools.compress(seqs, sampled.tolist()), np.flatnonzero(sampled).tolist()))
        lengths = lengths[sampled]
    collections.deque(map(list.append, map(_token_ids, rows), itertools.repeat(PLACEHOLDER)), 0)
    if computed is not None and len(rows) == n:
        engine.scheduler.advanced(seqs, after)
    last = engine.advanced_requests
    if last is None or last[0] != seqs:  # the same rows as the last advance (identities compared in C): its requests
        last = engine.advanced_requests = (seqs, list(dict.fromkeys(map(_request_id, seqs))))
    return InFlightStep(pending, rows, last[1], lengths=lengths + 1)


def fold(engine: Engine, in_flight: InFlightStep) -> list[RequestOutput]:
    """Fetch the in-flight step's tokens and fold them in: each replaces its placeholder, then logprobs, stop checks
    and detokenizing run as in the synchronous engine. Returns the outputs of the requests the step advanced. If the
    fetch fails (the device step raised), the sequences waiting on it fail with that error, and no other."""
    rows, lengths = in_flight.rows, in_flight.lengths
    in_flight.rows, in_flight._rows_of, in_flight.lengths = {}, None, None
    try:
        out = engine.runner.fetch(in_flight.pending)
    except Exception as exc:  # noqa: BLE001 - the step's requests fail; no placeholder is left to feed a step
        for seq in rows:
            seq.token_ids.pop()
            engine._fail(seq, exc)
        return engine._outputs(in_flight.request_ids)
    now = time.perf_counter()
    tokens = out.tokens.tolist()  # Python ints, converted once for the whole batch
    # Each in place of its placeholder (an aborted sequence is no longer in `rows`), in C loops over the rows.
    collections.deque(map(operator.setitem, map(_token_ids, rows), itertools.repeat(-1),
                          map(tokens.__getitem__, rows.values())), 0)
    engine._fold_tokens(list(rows), list(rows.values()), out, now, lengths)
    return engine._outputs(in_flight.request_ids)


def finishes_in_flight(engine: Engine, seq: Sequence) -> bool:
    """Whether `seq`'s in-flight token surely ends it by length (max_tokens, the context): then the next step
    need not give it a row that would be wasted."""
    if engine.in_flight is None or seq not in engine.in_flight.rows:
        return False
    return seq.num_tokens >= token_limit(seq, engine.max_model_len)


def fold_in_flight(engine: Engine, only_if_idle: bool = False) -> list[RequestOutput]:
    """Fold the engine's in-flight step, if any (its outputs); `only_if_idle`: only when it has only wasted rows and
    nothing else runs (an idle engine holds no step on the device)."""
    in_flight = engine.in_flight
    if in_flight is None or only_if_idle and (in_flight.rows or engine.scheduler.has_work()):
        return []
    engine.in_flight = None
    return fold(engine, in_flight)


def drop_placeholder(in_flight: InFlightStep | None, seq: Sequence) -> None:
    """A sequence that finishes before its in-flight token is folded (an abort) keeps only its real tokens."""
    if in_flight is not None and in_flight.rows.pop(seq, None) is not None:
        in_flight._rows_of = in_flight.lengths = None
        seq.token_ids.pop()


def merge_outputs(*groups: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request, the latest (outputs are cumulative), in first-seen order. Each group holds one output
    per request (a step's), so a lone non-empty group is the answer as it is."""
    filled = [group for group in groups if group]
    if len(filled) <= 1:
        return list(filled[0]) if filled else []
    latest: dict[str, RequestOutput] = {}
    for group in groups:
        for out in group:
            latest[out.request_id] = out
    return list(latest.values())


def async_step(engine: Engine, batch: ScheduledBatch) -> list[RequestOutput]:
    """One step of the async engine for a scheduled `batch` (under the engine's lock); see the module docstring."""
    prev = engine.in_flight
    reasons = sync_reasons(batch, prev, engine.params_checked)
    if not reasons:
        pending = engine._execute(batch, prev, fetch=False)
        if prev is not None:
            engine.async_stats.overlapped_steps += 1
        engine.in_flight = None
        removed = engine.scheduler.num_removed
        outputs = fold(engine, prev) if prev is not None else []
        engine.in_flight = advance(engine, batch, pending, none_finished=engine.scheduler.num_removed == removed)
        return merge_outputs(outputs, fold_in_flight(engine, only_if_idle=True))
    for reason in reasons:
        engine.async_stats.sync_steps[reason] = engine.async_stats.sync_steps.get(reason, 0) + 1
    folded = fold_in_flight(engine)
    live = [(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens) if not s.is_finished]
    if len(live) < len(batch.seqs):  # finished by the folded step's tokens: a synchronous engine never ran them
        if not live:
            return folded
        batch = ScheduledBatch([s for s, _ in live], [n for _, n in live])
    return merge_outputs(folded, engine._process(batch, engine._execute(batch)))
