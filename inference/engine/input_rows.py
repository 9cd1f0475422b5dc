"""Each running sequence's page tables, sampling row and prompt length, kept across steps (vLLM V1's `InputBatch`
rows).

Why: continuous batching changes a step's rows almost every step (a request finishes, another joins, a prompt chunk
runs beside the decode rows), so the kept decode batch (`persistent_batch.py`), which needs the same rows as the last
step, rarely applies, and the general build read every row's page tables and sampling parameters from the
`Sequence` objects: work that grows with the batch, not with what changed. Here a sequence gets a row of preallocated
arrays the first time a step takes it, and the row is written again only when its table changes: one entry for a page
appended at a decode row's page boundary, the whole table for any other change the KV cache manager reports
(`TableChanges.touched`: a prefill chunk's pages, a copy on write, a release, a truncation, a fork). A step then
gathers its rows' tables and sampling rows with a few array operations (`build_model_input`'s `KeptTables`,
`SamplingTensors.from_params`' `rows`), and only a sequence new to the rows is read.

Every table change must reach `apply` (the engine passes each step's `take_touched` before it builds the step); a
sequence that finished leaves at its release, and rows of sequences that left otherwise (preempted and never
rescheduled, or finished without pages) are dropped when the rows run out.
"""

from __future__ import annotations

import itertools
import operator

import numpy as np

from inference.engine.pages.block_manager import TableChanges
from inference.engine.sequence import Sequence
from inference.runtime.batch import KeptTables
from inference.sampling.sampler import sampling_rows

_params = operator.attrgetter("params")
_seed = operator.attrgetter("seed")
_needs = operator.attrgetter("needs")
_num_prompt_tokens = operator.attrgetter("num_prompt_tokens")


class InputRows:
    """Rows of page tables ([groups, rows, max_pages]) and sampling rows, one per sequence a step took."""

    def __init__(self, max_seqs: int, max_pages: int, num_groups: int):
        self.capacity = 2 * max_seqs  # room for a full batch beside rows of sequences that left unnoticed
        self.tables = np.zeros((num_groups, self.capacity, max_pages), np.int32)
        self.table_lens = np.zeros(self.capacity, np.int64)  # group 0's table length (the widest table)
        self.sampling = np.zeros((self.capacity, 5), np.float64)  # `sampler.sampling_rows`' values
        self.seed_key = np.zeros((self.capacity, 2), np.uint32)
        self.needs = np.zeros(self.capacity, np.int64)  # `SamplingParams.needs`: the step parts the row needs
        self.prompt_lens = np.zeros(self.capacity, np.int64)  # `Sequence.num_prompt_tokens` (fixed for its life)
        self._row: dict[Sequence, int] = {}
        self._free = list(range(self.capacity - 1, -1, -1))
        self.rows_read = 0  # sequences read into a row (tests and benchmarks)

    def __len__(self) -> int:
        return len(self._row)

    def apply(self, changes: TableChanges) -> None:
        """Bring the rows up to date with the tables' changes since the last step (`KVCacheManager.take_touched`)."""
        row_of = self._row
        appended = [(row_of[s], i, page) for s, i, page in changes.appended if s in row_of]
        if appended:  # pages opened at decode rows' page boundaries (one group only): one entry each
            rows, index, page = (np.fromiter(x, np.int64, len(appended)) for x in zip(*appended))
            self.tables[0, rows, index] = page
            self.table_lens[rows] = index + 1
        for seq in changes.touched:  # after the appends: a table changed again since is read whole
            row = row_of.get(seq)
            if row is None:
                continue
            if seq.is_finished:  # released at its finish: the row is free again
                self._release(seq)
            else:
                self._write_tables(row, seq)

    def rows(self, seqs: list[Sequence]) -> np.ndarray:
        """Each sequence's row (i64[n]), reading the sequences new to the rows."""
        n = len(seqs)
        rows = np.fromiter(map(self._row.get, seqs, itertools.repeat(-1)), np.int64, n)  # a C loop over the rows
        new = np.flatnonzero(rows < 0)
        if new.size:
            if new.size > len(self._free):
                self._drop_absent(seqs)
            new_seqs = [seqs[i] for i in new.tolist()]
            rows[new] = added = [self._free.pop() for _ in new_seqs]
            for row, seq in zip(added, new_seqs):
                self._row[seq] = row
                self._write_tables(row, seq)
            params = list(map(_params, new_seqs))
            self.sampling[added], self.seed_key[added] = sampling_rows(params, list(map(_seed, new_seqs)))
            self.needs[added] = list(map(_needs, params))
            self.prompt_lens[added] = list(map(_num_prompt_tokens, new_seqs))
            self.rows_read += len(new_seqs)
        return rows

    def needs_of(self, rows: np.ndarray) -> int:
        """The `SamplingParams.needs` bits of a step of these rows (their OR)."""
        return int(np.bitwise_or.reduce(self.needs[rows])) if rows.size else 0

    def kept_tables(self, rows: np.ndarray) -> KeptTables:
        return KeptTables(self.tables, rows, self.table_lens[rows], self.prompt_lens[rows])

    def check(self, seqs: list[Sequence]) -> None:
        """Raise if a kept row differs from its sequence's tables (tests)."""
        for seq in seqs:
            row = self._row.get(seq)
            if row is None:
                continue
            for g, table in enumerate(seq.block_tables):
                kept = self.tables[g, row]
                if kept[:len(table)].tolist() != table or kept[len(table):].any():
                    raise AssertionError(f"sequence {seq.seq_id}: kept table {kept[:len(table) + 2].tolist()} of "
                                         f"group {g}, its table {table}")

    def _write_tables(self, row: int, seq: Sequence) -> None:
        for g, table in enumerate(seq.block_tables):
            self.tables[g, row] = 0
            self.tables[g, row, :len(table)] = table
        self.table_lens[row] = len(seq.block_tables[0])

    def _release(self, seq: Sequence) -> None:
        self._free.append(self._row.pop(seq))

    def _drop_absent(self, seqs: list[Sequence]) -> None:
        """Free the rows of sequences that are not in this step (rare: finished ones leave at their release)."""
        present = set(seqs)
        for seq in [s for s in self._row if s not in present]:
            self._release(seq)
