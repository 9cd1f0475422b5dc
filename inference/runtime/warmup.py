"""Which step shapes a serving workload can compile, so warm-up can compile them all before traffic.

A decode step's shape is (sequences, pages per sequence): a small grid (`decode_shapes`). A prefill
step (any step where some sequence computes more than one token) has four bucketed sizes, (tokens, sequences,
pages per sequence, longest query), and most of their product is unreachable: a step of T tokens has at most T
sequences, at least T/2 real tokens (above the smallest token bucket) spread over them, none longer than the
longest query, and its longest sequence holds at least that query's pages. `prefill_shapes` keeps exactly the
combinations `inference/runtime/batch.py: build_model_input` can produce, so warm-up compiles no shape that
serving never asks for. Speculative verification steps (`verify_shapes`) and the draft model's proposal step
(`propose_shapes`) have their own, smaller sets. Where `BucketLimits` cuts an axis (`query_buckets`,
`page_buckets`) the sets shrink with it. Which static flags multiply each shape is
`inference/engine/compile_budget.py`'s part.
"""

from __future__ import annotations

import dataclasses

from inference.runtime.batch import BucketLimits, bucket, bucket_ladder


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """The static sizes of one compiled step (`ModelInput.empty`'s arguments); a decode step has tokens = sequences
    and longest query 1."""

    num_tokens: int
    num_seqs: int
    pages_per_seq: int
    max_q_len: int


def _ranges(ladder: list[int], lowest: int = 1) -> list[tuple[int, int, int]]:
    """(bucket, smallest n, largest n) for each bucket of a ladder: n in [lo, hi] rounds up to that bucket."""
    out, prev = [], lowest - 1
    for size in ladder:
        out.append((size, prev + 1, size))
        prev = size
    return out


def page_ladder(limits: BucketLimits) -> list[int]:
    """The page-table widths a step can take: one (the longest) when `page_buckets` is off."""
    if not limits.page_buckets:
        return [limits.max_pages_per_seq]
    return bucket_ladder(limits.min_pages_per_seq, limits.max_pages_per_seq, limits.fine_pages)


def decode_shapes(limits: BucketLimits) -> list[StepShape]:
    """Every (sequences, pages per sequence) bucket of a decode step (every sequence computes one token)."""
    return [StepShape(s, s, p, 1) for s in bucket_ladder(limits.min_seqs, limits.max_seqs) for p in page_ladder(limits)]


def prefill_shapes(limits: BucketLimits, page_size: int, max_chunk: int | None = None) -> list[StepShape]:
    """Every (tokens, sequences, pages per sequence, longest query) bucket of a non-decode step that
    `build_model_input` can give under `limits`, when no sequence computes more than `max_chunk` tokens in one
    step (default: the token budget). Speculative verification steps are not included (they carry drafts)."""
    max_chunk = limits.max_tokens if max_chunk is None else min(max_chunk, limits.max_tokens)
    seq_ranges = _ranges(bucket_ladder(1, limits.max_seqs))
    token_ranges = _ranges(bucket_ladder(limits.min_tokens, limits.max_tokens))
    token_ranges[0] = (token_ranges[0][0], 1, token_ranges[0][2])  # bucket(n, min_tokens) for every n below it
    page_ranges = _ranges(page_ladder(limits))
    page_ranges[0] = (page_ranges[0][0], 1, page_ranges[0][2])
    shapes = set()
    for q, q_lo, q_hi in _ranges(bucket_ladder(1, bucket(max_chunk))):
        q_lo, q_hi = max(q_lo, 2), min(q_hi, max_chunk)  # a step whose chunks are all 1 token is a decode step
        if q_lo > q_hi:
            continue
        for s, s_lo, s_hi in seq_ranges:
            for t_tok, n_lo, n_hi in token_ranges:
                # tokens = max(bucket(real tokens), bucket(longest)): either the tokens or the longest query set it.
                t = max(t_tok, q)
                # real tokens n: at least the longest chunk plus one token per other sequence, at most every
                # sequence at the longest chunk, within the budget and within this token bucket.
                lo = max(n_lo, q_lo + s_lo - 1)
                hi = min(n_hi, s_hi * q_hi, limits.max_tokens)
                if lo > hi:
                    continue
                # The longest table holds at least the longest chunk's pages; prefix hits and earlier chunks make
                # any longer table possible, up to the context.
                fewest_pages = -(-q_lo // page_size)
                for p, p_lo, p_hi in page_ranges:
                    if p_hi >= fewest_pages:
                        shapes.add(StepShape(t, s, p, q if limits.query_buckets else t))
    return sorted(shapes)


def verify_shapes(limits: BucketLimits, page_size: int, num_spec: int, mixed: bool = False) -> list[StepShape]:
    """Every bucket of a speculative verification step with drafts of up to `num_spec` tokens: each decoding
    sequence runs its last token and 0..num_spec drafts, some sequence at least one. With `mixed` scheduling prompt
    chunks may share the step, so every prefill shape whose longest query holds num_spec + 1 tokens counts too."""
    q = bucket(num_spec + 1)
    pages = page_ladder(limits)
    fewest_pages = -(-(num_spec + 1) // page_size)
    shapes = set()
    for n_seqs in range(1, limits.max_seqs + 1):
        s = bucket(n_seqs, limits.min_seqs, limits.max_seqs)
        for n in range(n_seqs + 1, min(n_seqs * (num_spec + 1), limits.max_tokens) + 1):
            t = max(bucket(n, limits.min_tokens, limits.max_tokens), q)
            shapes.update(StepShape(t, s, p, q if limits.query_buckets else t) for p in pages if p >= fewest_pages)
    if mixed:
        shapes.update(x for x in prefill_shapes(limits, page_size) if x.max_q_len >= q or not limits.query_buckets)
    return sorted(shapes)


def propose_shapes(limits: BucketLimits) -> list[StepShape]:
    """The draft model's proposal step (`inference/spec_decode/draft.py`): two tokens per sequence, padded to the
    target step's sequence bucket, so one shape per (sequence bucket, page width)."""
    shapes = []
    for s in bucket_ladder(limits.min_seqs, limits.max_seqs):
        t = propose_limits(limits, s).min_tokens
        shapes += [StepShape(t, s, p, 2 if limits.query_buckets else t) for p in page_ladder(limits)]
    return shapes


def propose_limits(limits: BucketLimits, pad_to: int) -> BucketLimits:
    """The engine's limits as the draft's proposal step uses them for a target step of `pad_to` rows: every
    sequence bucket is the target's and the token bucket is two tokens a row, so the step's shape follows the
    target's row count alone (not also how many of those rows speculate)."""
    tokens = bucket(max(2 * pad_to, limits.min_tokens))
    return dataclasses.replace(limits, max_tokens=max(limits.max_tokens, tokens), min_tokens=tokens, min_seqs=pad_to)
