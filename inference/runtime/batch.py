"""Turn a scheduled batch into flat ragged arrays padded to static buckets.

Shapes are rounded up to powers of two (tokens, sequences, pages per sequence, longest query), so the number of
distinct compiled step functions stays small and decode stops compiling once its buckets are warm. With
`BucketLimits.fine_pages` pages per sequence use a finer ladder (powers of two and 1.5x powers of two: 4, 6, 8, 12,
16, 24, ...): the pure-JAX reference attention reads every padded page, so a context of 129-192 tokens then
reads 192 positions instead of 256 (a small saving expected from attention's share of a step; BENCHMARKS.md's
A/B pairs stayed within noise), for one more compiled shape per doubling; the C++ CPU kernel and the Pallas
kernels stop at each sequence's length, where finer buckets would only add compiles
(`compile_budget.reads_padded_pages`). All of this is numpy on the host; one `device_put` per step moves it.

Buckets that buy nothing are cut (`BucketLimits.query_buckets`, `page_buckets`): the C++ CPU kernel ignores the
longest-query bound and reads no page past a sequence's length, so under it a prefill step's longest query is its
token bucket and every page table has the longest width; each cut axis stops multiplying the compiled variants
(`inference/engine/compile_budget.py` counts them; BENCHMARKS.md, compile budget, measures the padding's cost).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import NamedTuple

import jax
import numpy as np
from flax import struct

from inference.engine.scheduled_batch import ScheduledBatch
from models.attention import AttentionMetadata

_block_tables = operator.attrgetter("block_tables")
_token_ids = operator.attrgetter("token_ids")
_num_prompt_tokens = operator.attrgetter("num_prompt_tokens")


def bucket(n: int, minimum: int = 1, maximum: int | None = None, fine: bool = False) -> int:
    """Smallest power of two >= max(n, minimum), capped at `maximum` (which must then hold n). With `fine`, 1.5x
    powers of two (6, 12, 24, ...) are buckets too."""
    target = max(int(n), minimum, 1)
    size = 1 << (target - 1).bit_length()
    if fine and size >= 4 and size * 3 // 4 >= target:
        size = size * 3 // 4
    if maximum is not None:
        size = min(size, maximum)
        if size < n:
            raise ValueError(f"{n} exceeds the largest bucket {maximum}")
    return size


def bucket_ladder(minimum: int, maximum: int, fine: bool = False) -> list[int]:
    """Every bucket size `bucket` can return between the two bounds."""
    sizes = [bucket(minimum, fine=fine)]
    while sizes[-1] < maximum:
        sizes.append(min(bucket(sizes[-1] + 1, fine=fine), maximum))
    return sizes


@struct.dataclass
class SpecInput:
    """Speculative verification: every sequence's last token and its k drafts run as one chunk; the target's
    distributions at those k+1 positions decide what is accepted (inference/sampling/rejection.py)."""

    logits_indices: jax.Array  # i32[S, k+1]: token rows of the last token and each draft (clipped to the chunk)
    draft_tokens: jax.Array  # i32[S, k]
    num_draft: jax.Array  # i32[S]: real drafts per sequence (0 = a plain decode)
    draft_probs: jax.Array | None = None  # f32[S, k, V]: the distributions a draft model sampled from; None: one-hot


@struct.dataclass
class TokenFeed:
    """Async scheduling's token feed, done inside the step: `tokens[dst] = prev[src]` before the model reads them
    (inference/engine/async_scheduling.py). `prev` is the in-flight step's sampled tokens as the step returned them,
    widened to a fixed width (`ModelRunner.feed_width`), so the gather adds no compiled shape; every step carries a
    feed (a no-op one drops every write at the token bucket), so it adds no variant either."""

    prev: jax.Array  # i32[W]: the previous step's sampled tokens, on the device
    dst: jax.Array  # i32[S]: the token rows to fill; the token bucket (out of range: dropped) for unused entries
    src: jax.Array  # i32[S]: the row of `prev` each one takes


@struct.dataclass
class ModelInput:
    tokens: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    attn: AttentionMetadata
    logits_indices: jax.Array  # i32[S]: the last token of each sequence's chunk
    target_ids: jax.Array  # i32[T]: the next prompt token of each token (for prompt logprobs); -1 where none
    spec: SpecInput | None = None  # draft tokens to verify (speculative steps only)
    lora_slots: jax.Array | None = None  # i32[T]: each token's LoRA slot (models/lora.py; 0: none); None: no LoRA
    feed: TokenFeed | None = None  # the previous step's tokens gathered into `tokens` on the device (runner fills it)

    @classmethod
    def empty(cls, num_tokens: int, num_seqs: int, pages_per_seq: int, max_q_len: int,
              num_groups: int = 1) -> "ModelInput":
        """An input of the given bucket shape that reads and writes nothing (num_seqs = 0): for warm-up.
        `num_groups` > 1: stacked per-group slots and page tables, as `build_model_input` makes them."""
        lead = () if num_groups == 1 else (num_groups,)
        attn = AttentionMetadata(slot_mapping=np.full((*lead, num_tokens), -1, np.int32),
                                 kv_lens=np.zeros(num_seqs, np.int32),
                                 page_indices=np.zeros((*lead, num_seqs, pages_per_seq), np.int32),
                                 cu_q_lens=np.zeros(num_seqs + 1, np.int32), num_seqs=np.zeros(1, np.int32),
                                 max_q_len=max_q_len)
        return cls(tokens=np.zeros(num_tokens, np.int32), positions=np.zeros(num_tokens, np.int32), attn=attn,
                   logits_indices=np.zeros(num_seqs, np.int32), target_ids=np.full(num_tokens, -1, np.int32))


class KeptTables(NamedTuple):
    """The batch's page tables and prompt lengths as rows of arrays kept across steps (the engine's `InputRows`),
    instead of read from the sequences: `tables[g, rows[i]]` is row i's table of group g, zero past its length;
    `lens[i]` is its group-0 length; `prompt_lens[i]` its sequence's prompt length."""

    tables: np.ndarray  # i32[G, R, P]
    rows: np.ndarray  # i64[S]
    lens: np.ndarray  # i64[S]
    prompt_lens: np.ndarray  # i64[S]


@dataclasses.dataclass(frozen=True)
class BucketLimits:
    max_tokens: int
    max_seqs: int
    max_pages_per_seq: int
    min_tokens: int = 8
    min_pages_per_seq: int = 4
    fine_pages: bool = False  # pages per sequence on the 1.5x ladder (see the module docstring)
    query_buckets: bool = True  # False: a prefill step's longest-query bucket is its token bucket
    page_buckets: bool = True  # False: every page table is max_pages_per_seq wide
    min_seqs: int = 1  # the smallest sequence bucket (the draft's proposal step: the target step's rows)

    def __post_init__(self):
        if not 1 <= self.min_seqs <= self.max_seqs:
            raise ValueError(f"BucketLimits: min_seqs={self.min_seqs} must be in [1, max_seqs={self.max_seqs}]")


def build_model_input(batch: ScheduledBatch, page_size: int, limits: BucketLimits,
                      num_spec: int = 0, lora_slots: list[int] | None = None,
                      state_slots: bool = False, spec_slot=None, kept_tables: KeptTables | None = None
                      ) -> tuple[ModelInput, int]:
    """Numpy `ModelInput` for the batch, and the number of real (unpadded) tokens. A speculative batch carries
    `num_spec` (the static draft length) draft slots per sequence. With several KV cache groups
    (`Sequence.block_tables`) the slots and page tables are stacked per group: [G, T] and [G, S, P].
    `lora_slots`: each sequence's LoRA slot, spread over its tokens (padding tokens get slot 0). `state_slots`: the
    model has state layers; `attn.state_slots` carries each sequence's `Sequence.state_slot` (padding rows: 0), and
    in a speculative batch `attn.state_spec_slots[i, j]` = `spec_slot(i, j)` for each draft position j of row i
    (StateSlotManager.spec_slot; -1 elsewhere: the last position's state is the sequence's own slot).
    `kept_tables`: the rows' page tables, gathered from arrays kept across steps instead of read from the sequences."""
    num_groups = len(batch.seqs[0].block_tables)
    num_seqs = len(batch.seqs)
    num_tokens = batch.num_tokens
    padded_seqs = bucket(num_seqs, limits.min_seqs, maximum=limits.max_seqs)
    decode, speculative = batch.is_decode, batch.speculative
    if decode:
        padded_tokens, max_q = padded_seqs, 1
    else:
        padded_tokens = bucket(num_tokens, limits.min_tokens, limits.max_tokens)
        longest = max(batch.num_new_tokens)
        if speculative:  # one shape for every verification step, however many drafts each sequence got
            longest = max(longest, num_spec + 1)
        padded_tokens = max(padded_tokens, bucket(longest))
        max_q = bucket(longest, maximum=padded_tokens) if limits.query_buckets else padded_tokens
    seqs = batch.seqs
    if kept_tables is None:
        tables = [list(map(operator.itemgetter(g), map(_block_tables, seqs))) for g in range(num_groups)]
        table_lens = [np.fromiter(map(len, t), np.int64, num_seqs) for t in tables]
        max_pages = int(table_lens[0].max())
    else:
        max_pages = int(kept_tables.lens.max())
    padded_pages = bucket(max_pages, limits.min_pages_per_seq if limits.page_buckets else limits.max_pages_per_seq,
                          limits.max_pages_per_seq, fine=limits.fine_pages)

    tokens = np.zeros(padded_tokens, np.int32)
    positions = np.zeros(padded_tokens, np.int32)
    slot_mapping = np.full((num_groups, padded_tokens), -1, np.int32)
    target_ids = np.full(padded_tokens, -1, np.int32)
    kv_lens = np.zeros(padded_seqs, np.int32)
    page_indices = np.zeros((num_groups, padded_seqs, padded_pages), np.int32)
    cu_q_lens = np.zeros(padded_seqs + 1, np.int32)
    logits_indices = np.zeros(padded_seqs, np.int32)
    token_slots = None if lora_slots is None else np.zeros(padded_tokens, np.int32)

    # Vectorized over the batch: each sequence's scalars, token slice and page table are read in C loops (`map`
    # over the rows), numpy does the rest, so a 256-sequence step costs no per-sequence Python or numpy calls.
    counts = np.asarray(batch.num_new_tokens, np.int64)
    starts = batch.counts()[0]
    ends = np.cumsum(counts)
    cu_q_lens[1:num_seqs + 1] = ends
    cu_q_lens[num_seqs + 1:] = num_tokens
    logits_indices[:num_seqs] = ends - 1
    kv_lens[:num_seqs] = starts + counts
    row = np.repeat(np.arange(num_seqs), counts)  # each real token's sequence
    pos = np.arange(num_tokens) - np.repeat(ends - counts - starts, counts)
    positions[:num_tokens] = pos
    # Each row's first token in one C loop; the rest of a longer chunk (prompt chunks, drafts) row by row.
    firsts = ends - counts
    token_lists = list(map(_token_ids, seqs))
    tokens[firsts] = np.fromiter(map(operator.getitem, token_lists, starts.tolist()), np.int32, num_seqs)
    if not decode:
        for i in np.flatnonzero(counts > 1).tolist():
            c, n, first = int(starts[i]), int(counts[i]), int(firsts[i])
            ids = token_lists[i]
            if c + n > len(ids):  # verified drafts follow the sequence's tokens
                ids = ids + seqs[i].spec_tokens
            tokens[first:first + n] = ids[c:c + n]
    for g in range(num_groups):
        if kept_tables is None:
            lens = table_lens[g]
            flat = np.fromiter(itertools.chain.from_iterable(tables[g]), np.int32, int(lens.sum()))
            page_indices[g, np.repeat(np.arange(num_seqs), lens),
                         np.arange(flat.size) - np.repeat(np.cumsum(lens) - lens, lens)] = flat
        else:
            page_indices[g, :num_seqs] = kept_tables.tables[g, kept_tables.rows, :padded_pages]
        slot_mapping[g, :num_tokens] = page_indices[g, row, pos // page_size] * page_size + pos % page_size
    prompt_rows = starts + 1 < (kept_tables.prompt_lens if kept_tables is not None else
                                np.fromiter(map(_num_prompt_tokens, seqs), np.int64, num_seqs))
    for i in np.flatnonzero(prompt_rows).tolist():  # a prompt chunk: its tokens' next prompt tokens (prompt logprobs)
        seq, c, n = seqs[i], int(starts[i]), int(counts[i])
        nxt = seq.token_ids[c + 1:min(c + n + 1, seq.num_prompt_tokens)]
        target_ids[ends[i] - n:ends[i] - n + len(nxt)] = nxt
    if token_slots is not None:
        token_slots[:num_tokens] = np.repeat(np.asarray(lora_slots, np.int32), counts)
    if num_groups == 1:  # one group: the plain [T] and [S, P] layout every kernel and test knows
        slot_mapping, page_indices = slot_mapping[0], page_indices[0]

    attn = AttentionMetadata(slot_mapping=slot_mapping, kv_lens=kv_lens, page_indices=page_indices,
                             cu_q_lens=cu_q_lens, num_seqs=np.array([num_seqs], np.int32), max_q_len=max_q)
    if state_slots:
        slots = np.zeros(padded_seqs, np.int32)
        slots[:num_seqs] = [s.state_slot for s in seqs]
        attn = attn.replace(state_slots=slots)
        if speculative:
            spec = np.full((padded_seqs, num_spec + 1), -1, np.int32)
            for i, seq in enumerate(seqs):
                spec[i, :len(seq.spec_tokens)] = [spec_slot(i, j) for j in range(len(seq.spec_tokens))]
            attn = attn.replace(state_spec_slots=spec)
    spec = _spec_input(batch, cu_q_lens, padded_seqs, num_spec) if speculative else None
    return ModelInput(tokens=tokens, positions=positions, attn=attn, logits_indices=logits_indices,
                      target_ids=target_ids, spec=spec, lora_slots=token_slots), num_tokens


def _spec_input(batch: ScheduledBatch, cu_q_lens: np.ndarray, padded_seqs: int, num_spec: int) -> SpecInput:
    logits_indices = np.zeros((padded_seqs, num_spec + 1), np.int32)
    draft_tokens = np.zeros((padded_seqs, num_spec), np.int32)
    num_draft = np.zeros(padded_seqs, np.int32)
    for i, seq in enumerate(batch.seqs):
        n = len(seq.spec_tokens)
        first = cu_q_lens[i + 1] - 1 - n  # the row of the sequence's last verified token
        logits_indices[i] = first + np.minimum(np.arange(num_spec + 1), n)
        draft_tokens[i, :n] = seq.spec_tokens
        num_draft[i] = n
    return SpecInput(logits_indices=logits_indices, draft_tokens=draft_tokens, num_draft=num_draft)
