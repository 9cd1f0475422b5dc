"""The steady decode batch kept across steps (vLLM V1's persistent `InputBatch`, in pagejax's layers).

Most steps of a busy engine are the same sequences decoding one token each, in the same order, as the step
before. Rebuilding their ragged input from the `Sequence` objects (`build_model_input`) and their sampling rows
from the `SamplingParams` (`SamplingTensors.from_params`) every step is per-sequence Python that grows with the
batch. Here the last decode step's arrays are kept, and the next step's are derived from them with array
operations: every position and KV length moves on by one, the step index of every row too, and the page a row
appended at its page boundary is written as one entry of the page table (`KVCacheManager.take_touched`), its row
found through an index kept with the batch. Any other change of a row's table (a copy on write, a release) takes
the general path. Each sequence's
computed-token count (to check that every row really moved on by one) comes with the batch (`ScheduledBatch.starts`,
the scheduler's read) and its last token is read in a C loop (`map` over the rows), with no per-row Python.

Anything else (a sequence joins, leaves or is reordered, a prompt chunk, drafts, LoRA, more than one KV cache
group, or a row that needs a mask, penalties, sparse edits or logprobs, whose arrays depend on more than the
row's parameters) takes the general path, whose result becomes the new kept batch when it qualifies. The arrays
handed to a step are fresh each step: a dispatched step may still read the previous ones (async scheduling).
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from inference.engine.pages.block_manager import TableChanges
from inference.engine.scheduled_batch import ScheduledBatch
from inference.engine.sequence import Sequence
from inference.runtime.batch import ModelInput
from inference.runtime.step_variants import StepFlags
from inference.sampling.sampler import SamplingTensors

_token_ids = operator.attrgetter("token_ids")
_last = operator.itemgetter(-1)


@dataclasses.dataclass
class _Kept:
    seqs: list[Sequence]
    inp: ModelInput
    sampling: SamplingTensors
    flags: StepFlags
    starts: np.ndarray  # i64[n]: each row's computed tokens when the kept step was built
    steps: np.ndarray  # i32[n]: each row's generated-token index in that step
    row_of: dict[Sequence, int]  # each sequence's row, so a changed page table is found without a walk


class PersistentDecodeBatch:
    """The kept decode batch of one engine; `next_step` derives a step from it, `keep` replaces it."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._kept: _Kept | None = None
        self.reused_steps = 0  # steps derived from the kept batch (tests and benchmarks)

    def forget(self) -> None:
        self._kept = None

    def next_step(self, batch: ScheduledBatch, changes: TableChanges, last_token: int | None = None
                  ) -> tuple[ModelInput, SamplingTensors, StepFlags] | None:
        """The step of `batch` derived from the kept one, or None (then build it in general and `keep` it).
        `last_token`: every row's last token (async scheduling's placeholder, fed on the device), not read."""
        kept = self._kept
        # The same rows (an identity compare, in C), each computing one token (no prompt chunk, no drafts).
        if kept is None or batch.seqs != kept.seqs or sum(batch.num_new_tokens) != len(batch.seqs):
            self._kept = None
            return None
        seqs, n = batch.seqs, len(batch.seqs)
        starts = batch.counts()[0]
        if not np.array_equal(starts, kept.starts + 1):  # not every row moved on by exactly one token
            self._kept = None
            return None
        ps, inp = self.page_size, kept.inp
        pages = inp.attn.page_indices
        padded_pages = pages.shape[1]
        row_of = kept.row_of
        if any(map(row_of.__contains__, changes.touched)):  # a row's table changed otherwise (rare): rebuild
            self._kept = None
            return None
        appended = [(row_of[s], i, page) for s, i, page in changes.appended if s in row_of]
        if appended:  # the pages rows opened at their page boundaries: one entry each
            rows, index, page = (np.fromiter(x, np.int64, len(appended)) for x in zip(*appended))
            if int(index.max()) >= padded_pages:  # a wider page bucket
                self._kept = None
                return None
            pages = pages.copy()
            pages[rows, index] = page
        if int(starts.max()) // ps >= padded_pages:
            self._kept = None
            return None
        size = inp.tokens.shape[0]
        tokens = np.zeros(size, np.int32)
        tokens[:n] = np.fromiter(map(_last, map(_token_ids, seqs)), np.int32, n) if last_token is None \
            else last_token  # C loops over the rows
        positions = np.zeros(size, np.int32)
        positions[:n] = starts
        kv_lens = np.zeros(inp.attn.kv_lens.shape[0], np.int32)
        kv_lens[:n] = starts + 1
        slots = np.full(size, -1, np.int32)
        slots[:n] = pages[np.arange(n), starts // ps] * ps + starts % ps
        attn = inp.attn.replace(slot_mapping=slots, kv_lens=kv_lens, page_indices=pages)
        new_inp = inp.replace(tokens=tokens, positions=positions, attn=attn)
        steps = kept.steps + 1
        step = np.zeros(size, np.int32)
        step[:n] = steps
        sampling = kept.sampling.replace(step=step)
        self._kept = dataclasses.replace(kept, inp=new_inp, sampling=sampling, starts=starts, steps=steps)
        self.reused_steps += 1
        return new_inp, sampling, kept.flags

    def keep(self, batch: ScheduledBatch, inp: ModelInput, sampling: SamplingTensors, flags: StepFlags,
             lora: bool, num_groups: int, prompt_lens: np.ndarray) -> None:
        """Keep a generally built step when the next one can be derived from it: a plain decode of sequences in
        steady decode (their only uncomputed token is a generated one), one KV cache group, no LoRA, no drafts, and
        no sampling part that changes with the tokens (extras: a mask, penalties, sparse edits, logprobs).
        `prompt_lens`: each row's prompt length."""
        self._kept = None
        if (not batch.is_decode or batch.speculative or lora or num_groups != 1 or flags.extras
                or inp.spec is not None):
            return
        seqs, n = batch.seqs, len(batch.seqs)
        starts, lengths = batch.counts()
        if not (np.array_equal(lengths, starts + 1) and (starts >= prompt_lens).all()):
            return
        steps = np.asarray(sampling.step[:len(seqs)]).copy()
        self._kept = _Kept(list(seqs), inp, sampling, flags, starts, steps, dict(zip(seqs, range(n))))
