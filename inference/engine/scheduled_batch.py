"""One step's batch as the scheduler hands it on: its rows, their token counts, and the counts read once.

Its own module because every layer after the scheduler reads it (the engine, async scheduling, the fold, the kept
decode batch, the runtime's batch build, the draft model): they depend on this, not on the scheduler's policies.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import numpy as np

from inference.engine.sequence import Sequence

_computed = operator.attrgetter("num_computed_tokens")
_token_ids = operator.attrgetter("token_ids")
_spec_tokens = operator.attrgetter("spec_tokens")


@dataclasses.dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens of each sequence computed this step
    admitted: list[Sequence] = dataclasses.field(default_factory=list)  # taken from the waiting queue this step
    # Each row's computed tokens as the steady decode pass read them (`Scheduler._schedule_decode_steady`), set only
    # for its batches: every row computes its one uncomputed token, with no drafts. The passes after it take that as
    # a sign (async scheduling's checks skip the rows, its advance samples every row and hints the next pass).
    computed: np.ndarray | None = None
    # False where the scheduler that made the batch has no proposer (the steady pass runs only then): no row holds
    # drafts, and `speculative` need not look at the rows.
    may_draft: bool = True
    # Each row's computed tokens and token count (drafts not counted) as the scheduler read them, for every batch it
    # makes (None from other makers): the build, async scheduling's checks and advance, and the kept decode batch
    # take them from here instead of each walking the rows again. Nothing changes them before the step's advance:
    # folding an in-flight token replaces its placeholder in place, and a row that finishes leaves the batch.
    # Read-only: a steady pass's `starts` is its `computed`, which may be the last advance's array (`advanced`) and
    # is kept by the persistent batch; every reader makes new arrays from it, none changes it in place.
    starts: np.ndarray | None = None
    lengths: np.ndarray | None = None

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """`starts` and `lengths`; read from the rows (C loops) and kept where the batch's maker did not set them (a
        batch made outside the scheduler: tests, the draft model's, async scheduling's rebuilt synchronous one)."""
        if self.starts is None or self.lengths is None:
            starts, left = uncomputed(self.seqs)
            self.starts, self.lengths = starts, starts + left
        return self.starts, self.lengths

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes exactly one token (the decode-shaped compiled step); each computes at least one,
        so the sum says it without a walk in Python."""
        return sum(self.num_new_tokens) == len(self.num_new_tokens)

    @property
    def is_decode_phase(self) -> bool:
        """Every sequence is decoding (one token, plus any drafts it verifies): for step statistics."""
        if not self.speculative:
            return self.is_decode
        return all(n == 1 + len(s.spec_tokens) for s, n in zip(self.seqs, self.num_new_tokens))

    @functools.cached_property
    def speculative(self) -> bool:
        """Some row verifies drafts. Read once (the fold clears the drafts): the batch's rows and their drafts are
        fixed when the scheduler makes it."""
        return self.may_draft and any(map(_spec_tokens, self.seqs))



def token_limit(seq: Sequence, max_model_len: int) -> int:
    """The token count at which `seq` surely finishes by length: its max_tokens, or the context."""
    limit = seq.params.max_tokens
    return max_model_len if limit is None else min(max_model_len, seq.num_prompt_tokens + limit)


def uncomputed(seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's computed tokens and tokens still to compute, read in C loops (no per-row Python)."""
    n = len(seqs)
    computed = np.fromiter(map(_computed, seqs), np.int64, n)
    return computed, np.fromiter(map(len, map(_token_ids, seqs)), np.int64, n) - computed
