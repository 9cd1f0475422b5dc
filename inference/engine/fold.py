"""Folding a step's sampled tokens back into the sequences, and the outputs a step returns.

The functions here are the `Engine`'s methods (bound in its class body: `_process = fold.process`, ...), kept in
their own module because they are one concept: after the device step, per sequence, the computed tokens and full
pages (`advance`), the sampled token's metrics, logprobs, stop checks and text (`after_token`), and the request's
output (`request_output`).

Why a fast path (`fold_tokens`): at a few hundred decoding sequences the host's step is bounded by per-sequence
Python, and most rows of a steady decode step need nothing of the general path: no logprobs, no grammar, a token
that is neither EOS nor a stop token, a length below the limits, and (when it detokenizes) a token whose text is
plain and can end no stop string (`plain_rows.can_end_stop`). Such rows are found with array operations over the
batch and their text is deferred (inference/engine/plain_rows.py: `FastRow` holds a row's constants). A row that
is not plain but has none of the general path's needs appends its token's text with one detokenizer `add` and looks
back for the stop strings; every other row (a token in the stop set, a length at a limit, logprobs, structured outputs,
the first token) takes `after_token`, the general path, whose checks (`stop.check_stop`) decide in the same order,
so the results are the same.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from inference.engine.async_scheduling import drop_placeholder
from inference.engine.logprobs import TokenTexts, logprobs_dict
from inference.engine.outputs import CompletionOutput, DeferredRequestOutput, RequestOutput
from inference.engine.scheduled_batch import ScheduledBatch, token_limit
from inference.engine.sequence import Sequence, SequenceStatus
from inference.engine.stop import check_stop, flush_text, longest_stop, match_stop_string
from inference.runtime.runner import StepOutput
from inference.sampling.params import SamplingParams

# The functions below are methods of the `Engine` (inference/engine/llm_engine.py), which imports this module: typed
# `Engine` here it would be an import cycle, so the aliases only name it and its `Request`.
Engine = Any
Request = Any

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class FastRow:
    """A sequence's constants for the fold's fast path (`fold_tokens`): with its last token not in `stop_ids` and
    fewer than `length_limit` tokens, `check_stop` can end it only by a stop string."""

    length_limit: int  # len(token_ids) at which max_tokens or the context ends it
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids: they end it once min_tokens are out
    text: bool  # it detokenizes (a tokenizer, detokenize=True): one detokenizer add a token
    stop: tuple[str, ...]  # stop strings, matched once more than min_tokens tokens exist
    lookback: int  # the longest stop string's length - 1: a new match starts at most this far before the new text
    stop_ends: tuple[str, ...]  # the stop strings' last characters: a new match ends in a new text holding one
    min_tokens: int
    token_times: list[float] | None  # its request's metrics.token_times when it is sample 0 (its tokens are timed)
    # Plain tokens -> their text (`Tokenizer.plain_texts`: whole UTF-8 alone): with its detokenizer holding nothing
    # back, a plain token adds just that text (`Sequence.settle_text`).
    plain: dict[int, str]
    table: np.ndarray  # the tokens that keep it plain (`PlainRows.table`)
    plain_from: int = 0  # len(token_ids) from which its last token's stop strings were checked (past min_tokens)


def fast_row(engine: Engine, seq: Sequence) -> FastRow | None:
    """`seq`'s fast-path constants, or None when its every token takes the general path (logprobs, structured
    outputs). Made after its first token, when its request's first-token metrics and its detokenizer exist."""
    params = seq.params
    if params.logprobs is not None or params.structured_outputs is not None:
        return None
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids |= engine.eos_token_ids
    text = engine.tokenizer is not None and params.detokenize
    times = engine.requests[seq.request_id].metrics.token_times if seq.index == 0 else None
    stop = params.stop if text else ()
    plain = engine.tokenizer.plain_texts(params.skip_special_tokens) if text else {}
    partial = engine.tokenizer.partial_bytes(params.skip_special_tokens) if text else None
    stop_ids = frozenset(stop_ids)
    table = engine.plain_rows.table(stop_ids, text, params.skip_special_tokens, plain, frozenset(stop), partial)
    return FastRow(token_limit(seq, engine.max_model_len), stop_ids, text, stop,
                   longest_stop(stop) - 1 if stop else 0, tuple({s[-1] for s in stop}), params.min_tokens, times,
                   plain, table,
                   seq.num_prompt_tokens + params.min_tokens + 2 if stop else 0)


def process(engine: Engine, batch: ScheduledBatch, out: StepOutput) -> list[RequestOutput]:
    """Fold a synchronous step's results into its sequences; the outputs of the requests it advanced."""
    now = time.perf_counter()
    touched: dict[str, Request] = {}
    verified: list[tuple[Sequence, int]] = []  # (sequence, drafts accepted) for the proposer's hook
    sampled: list[Sequence] = []  # sequences that got a token, and their rows: folded together below
    sampled_rows: list[int] = []
    tokens = out.tokens.tolist()  # Python ints, converted once for the whole batch
    requests = engine.requests
    offset = 0
    for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        request = requests[seq.request_id]
        touched[seq.request_id] = request
        first_row, offset = offset, offset + count
        try:
            if seq.spec_tokens:
                verified.append((seq, int(out.num_accepted[i])))
                accept_speculation(engine, seq, request, out, i, now)
                continue
            if out.prompt_logprob is not None and seq.params.prompt_logprobs is not None:
                record_prompt_logprobs(engine, seq, out, first_row, count)
            if advance(engine, seq, count):  # else a prefill chunk that does not reach the end: nothing sampled
                seq.token_ids.append(tokens[i])
                sampled.append(seq)
                sampled_rows.append(i)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not take the batch down
            fail(engine, seq, exc)
    fold_tokens(engine, sampled, sampled_rows, out, now)
    if verified:
        engine.proposer.on_accepted([seq for seq, _ in verified], [n for _, n in verified])
    return outputs(engine, touched)


def fold_tokens(engine: Engine, seqs: list[Sequence], rows: list[int], out: StepOutput, now: float,
                lengths: np.ndarray | None = None) -> None:
    """Fold a step's sampled tokens, each already the last of its sequence's `token_ids` (`rows`: each one's row of
    `out`; `lengths`: each one's token count, where the caller knows it): metrics, logprobs, stop checks, text. Plain
    rows are found and folded over the batch (`PlainRows.split`); of the rest, rows with fast-path constants and
    neither a stop id nor a limit reached take the text-only path (the module docstring), the others `after_token`.
    One request's failure fails only it."""
    plain = engine.plain_rows.split(seqs, out.tokens[np.fromiter(rows, np.int64, len(rows))], now, lengths)
    if plain.all():
        return
    requests, kept = engine.requests, engine.plain_rows
    for i in np.flatnonzero(~plain).tolist():
        seq, out_row = seqs[i], rows[i]
        try:
            ids = seq.token_ids
            length = len(ids)
            seq.settle_text(length - 1)  # the plain run's text, before this token's
            row = seq.fast_row
            if row is None or length >= row.length_limit or ids[-1] in row.stop_ids:
                after_token(engine, seq, requests[seq.request_id], out, out_row, now)
                if seq.fast_row is None and not seq.is_finished:
                    seq.fast_row = fast_row(engine, seq)
                    kept.refresh(seq)
            else:
                if row.token_times is not None:
                    row.token_times.append(now)
                if row.text:
                    before = seq.text_len
                    piece = seq.detokenizer.add(ids[-1])
                    seq.append_text(piece)
                    generated = length - seq.num_prompt_tokens
                    # Once the previous token's text was checked too (past min_tokens), the look-back holds no
                    # match that ends before the new text: without a stop's last character in it, none is found.
                    if row.stop and generated > row.min_tokens and (
                            generated - 1 == row.min_tokens or any(map(piece.__contains__, row.stop_ends))):
                        stop = match_stop_string(seq, max(0, before - row.lookback), row.stop)
                        if stop is not None:
                            seq.stop_reason = stop  # the text is cut at the stop string: nothing to flush
                            finish(engine, seq, "stop")
            kept.update(i, seq)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not take the batch down
            fail(engine, seq, exc)


def advance(engine: Engine, seq: Sequence, count: int) -> bool:
    """The bookkeeping of a step that computed `count` tokens of `seq` and needs none of its outputs (computed
    tokens, full pages into the prefix cache, forks of `n` samples); whether the step sampled a token for it."""
    before = seq.num_computed_tokens
    seq.num_computed_tokens = after = before + count
    # A sequence's registered chain always ends at its last full computed page, so only a step that completes
    # a page (or the first, which starts the chain) has anything to register.
    if before == 0 or before // engine.page_size != after // engine.page_size:
        engine.block_manager.commit_full_pages(seq)
        if engine.state is not None:
            engine.scheduler.checkpoint_state(seq)
    scheduler = engine.scheduler
    if scheduler.awaiting_fork and scheduler.fork_due(seq):
        scheduler.fork_samples(seq)
    return after >= len(seq.token_ids)


def accept_speculation(engine: Engine, seq: Sequence, request: Request, out: StepOutput, row: int,
                       now: float) -> None:
    """Keep the accepted drafts and the one token after them; roll back the rest (KV past the accepted
    tokens is never read again, and whole pages past them go back to the pool)."""
    proposed, accepted = len(seq.spec_tokens), int(out.num_accepted[row])
    seq.spec_tokens = []
    if engine.state is not None and accepted < proposed:  # its slot holds the state after the last draft
        engine.state.keep_spec_state(seq, row, accepted)
    seq.num_computed_tokens += 1 + accepted
    engine.block_manager.commit_full_pages(seq)
    engine.stats.record_speculation(proposed, accepted)
    if engine.adaptive_k is not None:
        engine.adaptive_k.update(seq, proposed, accepted)
    for token in out.emitted[row][:accepted + 1]:
        seq.token_ids.append(int(token))
        after_token(engine, seq, request, out, row, now)
        if seq.is_finished:
            return
    engine.block_manager.truncate(seq, seq.num_tokens)


def record_prompt_logprobs(engine: Engine, seq: Sequence, out: StepOutput, offset: int, count: int) -> None:
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)  # position 0 has no logprob
    start = seq.num_computed_tokens
    for j in range(count):
        pos = start + j + 1  # the prompt position this row predicts
        if pos >= seq.num_prompt_tokens:
            break
        if pos < len(seq.prompt_logprobs):
            continue  # recomputed after a preemption: already recorded
        row, k = offset + j, seq.params.prompt_logprobs
        seq.prompt_logprobs.append(logprobs_dict(
            seq.token_ids[pos], out.prompt_logprob[row], out.prompt_rank[row], out.prompt_top_ids[row][:k],
            out.prompt_top_logprobs[row][:k], texts(engine, seq.params)))


def after_token(engine: Engine, seq: Sequence, request: Request, out: StepOutput, row: int, now: float) -> None:
    """The general path for the token that ends `seq.token_ids`: metrics, logprobs, stop checks and text."""
    token = seq.token_ids[-1]
    seq.settle_text(len(seq.token_ids) - 1)  # a plain run's text, before this token's
    metrics = request.metrics
    if seq.index == 0:
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            metrics.num_cached_tokens = seq.num_cached_tokens
            engine.stats.cached_prompt_tokens += seq.num_cached_tokens
        metrics.token_times.append(now)
    if seq.params.logprobs is not None:
        k = seq.params.logprobs
        seq.output_logprobs.append(logprobs_dict(token, out.logprob[row], out.rank[row], out.top_ids[row][:k],
                                                 out.top_logprobs[row][:k], texts(engine, seq.params)))
        seq.cumulative_logprob += float(out.logprob[row])
    reason, stop_reason = check_stop(seq, engine.tokenizer, engine.eos_token_ids, engine.max_model_len)
    if reason is None and seq.params.structured_outputs is not None and engine.structured.sync(seq):
        reason = "stop"  # the grammar is complete: nothing but EOS could follow
    if reason is not None:
        seq.stop_reason = stop_reason
        flush_text(seq)
        finish(engine, seq, reason)


def texts(engine: Engine, params: SamplingParams) -> TokenTexts | None:
    """Decoded tokens for logprob entries; none when the request set detokenize=False (vLLM's)."""
    return engine._token_texts if params.detokenize else None


def fail(engine: Engine, seq: Sequence, exc: Exception) -> None:
    """Finish `seq` with "error" after an exception while folding its step: its request fails, no other."""
    log.exception("request %s failed", seq.request_id, exc_info=exc)
    engine.requests[seq.request_id].error = f"{type(exc).__name__}: {exc}"
    finish(engine, seq, "error")


def finish(engine: Engine, seq: Sequence, reason: str) -> None:
    drop_placeholder(engine.in_flight, seq)
    seq.finish_reason = reason
    seq.status = SequenceStatus.FINISHED
    engine.scheduler.remove(seq)
    engine.structured.release(seq.seq_id)
    request = engine.requests[seq.request_id]
    if request.finished:
        request.metrics.finished_time = time.perf_counter()
        engine.finished_ids.add(seq.request_id)


def outputs(engine: Engine, request_ids: Iterable[str]) -> list[RequestOutput]:
    """The outputs of the (not popped) requests a step advanced, in order; during a `step(finished_only=True)` only
    those of finished requests (`Engine.finished_ids`), the others not built at all."""
    requests, output = engine.requests, engine._output
    if engine.finished_only:
        done = engine.finished_ids
        if not done:
            return []
        return [output(requests[rid]) for rid in request_ids if rid in done and rid in requests]
    return [output(requests[rid]) for rid in request_ids if rid in requests]


def request_output(engine: Engine, request: Request) -> RequestOutput:
    """The request's output now. What later steps change of its sequences (token count, text, reasons, logprob
    count and sum) is captured (the text as a `Sequence.text_snapshot`, joined when read); the completions are built
    only when read (`DeferredRequestOutput`)."""
    pending = engine.in_flight.rows if engine.in_flight is not None else ()
    states = [(seq, len(seq.token_ids) - (seq in pending), seq.text_snapshot(), seq.finish_reason, seq.stop_reason,
               len(seq.output_logprobs), seq.cumulative_logprob) for seq in request.seqs]
    # Position 0 has no logprob: [None] also for a one-token prompt, whose steps predict no prompt position.
    prompt_lp = (list(request.seqs[0].prompt_logprobs) or [None]) if request.params.prompt_logprobs is not None \
        else None
    return DeferredRequestOutput.of(states, _completions, request.request_id, request.prompt,
                                    request.prompt_token_ids, prompt_lp, None not in [state[3] for state in states],
                                    request.metrics, request.error)


def _completions(states: list[tuple]) -> list[CompletionOutput]:
    """The completions of `request_output`'s captured states (the placeholder of an in-flight token excluded)."""
    out = []
    for seq, end, (parts, count), finish_reason, stop_reason, num_logprobs, cumulative in states:
        asked = seq.params.logprobs is not None
        out.append(CompletionOutput(
            index=seq.index, text="".join(parts[:count]), token_ids=seq.token_ids[seq.num_prompt_tokens:end],
            logprobs=seq.output_logprobs[:num_logprobs] if asked else None, finish_reason=finish_reason,
            stop_reason=stop_reason, logprobs_mode=seq.params.logprobs_mode if asked else None,
            cumulative_logprob=cumulative if asked else None))
    return out
