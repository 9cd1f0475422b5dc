"""The fold's plain rows, found with array operations over the batch (`fold.fold_tokens`).

Why: at a few hundred decoding sequences the host's step was bounded by per-row Python in the fold: for every row,
its length against the limits, its token against the stop ids and its text against the stop strings' last
characters, then one detokenizer update and one text append. Most rows of a steady decode step need nothing else
(`fold.FastRow`). Here each row's constants are kept as arrays, carried from one fold to the next by row when rows
join or leave (only a new row, or one whose constants changed, is read: continuous batching changes rows most
steps), and whether a sampled token keeps its row plain is one lookup in a table over the vocabulary, one table
for each kind of row (its stop ids, whether it detokenizes, its stop strings). A plain row's text
is deferred: the sequence appends it when its text is read, or before its next token that is not plain
(`Sequence.settle_text`), as the per-token updates would have. What is left per plain row is in C loops (its length
and last token read, its token time appended).

A token keeps its row plain when the row has fast-path constants, its length is below the row's limit, the token is
not one of the row's stop ids, and, for a row that detokenizes, its detokenizer held nothing back when the plain run
began, the stop strings were checked at the row's last token, and either the token's text is whole UTF-8 alone and
no stop string can end in it, whatever text came before (`can_end_stop`), or the token is a part of a multi-byte
character (`Tokenizer.partial_bytes`: text in CJK scripts, emoji), every stop string ends in an ASCII character, and
none of those is among its bytes. Every other row takes the fold's per-row path.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
from collections.abc import Callable

import numpy as np

from inference.engine.sequence import Sequence

_token_ids = operator.attrgetter("token_ids")
_fast_row = operator.attrgetter("fast_row")
_table = operator.attrgetter("table")
_length_limit = operator.attrgetter("length_limit")
_plain_from = operator.attrgetter("plain_from")
_text = operator.attrgetter("text")
_token_times = operator.attrgetter("token_times")
_detokenizer = operator.attrgetter("detokenizer")
_deferred_from = operator.attrgetter("deferred_from")
_MAX_TABLES = 64  # distinct kinds of rows kept; past it the tables are made again as rows need them


@dataclasses.dataclass
class _Rows:
    """The constants of the last fold's rows, by row."""

    seqs: list[Sequence]
    limit: np.ndarray  # i64: FastRow.length_limit; 0 for a row without fast-path constants (never plain)
    plain_from: np.ndarray  # i64: FastRow.plain_from (rows that detokenize)
    text: np.ndarray  # bool: FastRow.text
    table_of: np.ndarray  # i64: the row's table in `tables`
    tables: np.ndarray  # bool[kinds, vocab + 1]: a token keeps a row of that kind plain
    times: list[list[float] | None]  # FastRow.token_times
    timed: np.ndarray  # bool: times[i] is not None
    # bool: a plain run may go on or begin: the row's detokenizer holds nothing back (IncrementalDetokenizer.plain),
    # or its plain run goes on (after a reader settled it part-way, the detokenizer may hold a character's bytes)
    plain_state: np.ndarray
    deferring: np.ndarray  # bool: the row's text is deferred (Sequence.deferred_from is set)
    # The tables stacked in `tables`, as the rows' `FastRow.table` objects: a row carried into the next fold's rows
    # finds its kind by identity (held here, so no id is reused while these rows live).
    kinds: list[np.ndarray]


def stop_end_test(stop: str) -> Callable[[str], bool]:
    """Whether `stop` can end inside a text appended to some text: the text holds it whole, or starts with one of its
    proper suffixes (the rest of it then ends the text before). Either way the text holds its last character, the
    cheap test that goes first. A test of one stop string, applied to many tokens' texts."""
    last, suffixes = stop[-1], tuple(stop[-k:] for k in range(1, len(stop)))
    return lambda text: last in text and (stop in text or text.startswith(suffixes))


def can_end_stop(text: str, stop: str) -> bool:
    """`stop_end_test(stop)(text)`."""
    return stop_end_test(stop)(text)


class PlainRows:
    """One engine's token tables and the kept constants of its last fold's rows."""

    def __init__(self, vocab_size: int, keep_base: bool = True):
        """`keep_base`: keep the last large fold's rows to carry from (`_base`); False for an engine with speculative
        decoding, whose verifying rows fold their tokens outside the plain rows (`fold.accept_speculation`) while
        such rows are set aside."""
        self.vocab_size = vocab_size  # the logits' width: no sampled token is past it
        self.keep_base = keep_base
        self._tables: dict[tuple, np.ndarray] = {}
        # The plain tokens' ids (under the vocabulary) by skip_special_tokens, and by (skip_special_tokens, a
        # character) those whose text holds it: a new kind of row looks only at the tokens its stop strings' last
        # characters pick out (the fold makes a row's table at its first token, on the step's path).
        self._plain_ids: dict[bool, np.ndarray] = {}
        self._holding: dict[tuple[bool, str], list[int]] = {}
        self._no_row = _NoRow(np.zeros(vocab_size + 1, bool))  # what a row without fast-path constants reads as
        self._rows: _Rows | None = None
        self._stale: set[Sequence] = set()  # rows whose constants changed since the last fold (`refresh`)
        # The offline policy alternates a prefill step's few new rows with the decode rows: the last large fold's
        # rows are kept to carry from (`_base`), less the sequences folded since (`_since`), whose state moved on.
        self._base: _Rows | None = None
        self._since: set[Sequence] = set()

    def table(self, stop_ids: frozenset[int], text: bool, skip_special_tokens: bool, plain: dict[int, str],
              stops: frozenset[str], partial: dict[int, frozenset[int]] | None = None) -> np.ndarray:
        """The table of a kind of row: True at the tokens that keep it plain, False past the vocabulary (the last
        entry, where an out-of-range token is looked up). `plain`: the tokenizer's `plain_texts` for
        `skip_special_tokens` (one tokenizer an engine); `stops`: the row's stop strings; `partial`: the tokenizer's
        `partial_bytes` (None: no such token keeps a row plain)."""
        key = (stop_ids, text, skip_special_tokens, stops, partial is not None)
        table = self._tables.get(key)
        if table is None:
            size = self.vocab_size
            table = np.zeros(size + 1, bool)
            if text:
                ids = self._plain_ids.get(skip_special_tokens)
                if ids is None:
                    ids = self._plain_ids[skip_special_tokens] = np.fromiter(
                        (i for i in plain if i < size), np.int64)
                table[ids] = True
                for stop in stops:  # only the tokens holding its last character can end it
                    ends = stop_end_test(stop)
                    table[[i for i in self._holding_char(skip_special_tokens, plain, stop[-1])
                           if ends(plain[i])]] = False
                last = {ord(stop[-1]) for stop in stops}
                if partial and max(last, default=0) < 128:
                    # Whenever the text of a part of a character comes out (at its own add or at a later token's),
                    # it is U+FFFD, non-ASCII characters and its own ASCII bytes: with every stop string ending in an
                    # ASCII character, a match can end there only at one of those bytes. The run's text from such a
                    # token on is settled through the detokenizer (`Sequence.settle_text`).
                    table[[i for i, ascii in partial.items() if i < size and not ascii & last]] = True
            else:
                table[:size] = True
            table[[i for i in stop_ids if 0 <= i < size]] = False
            if len(self._tables) >= _MAX_TABLES:
                self._tables.clear()
            self._tables[key] = table
        return table

    def _holding_char(self, skip_special_tokens: bool, plain: dict[int, str], char: str) -> list[int]:
        """The plain tokens (under the vocabulary) whose text holds `char`."""
        key = (skip_special_tokens, char)
        ids = self._holding.get(key)
        if ids is None:
            if len(self._holding) >= _MAX_TABLES:
                self._holding.clear()
            size = self.vocab_size
            ids = self._holding[key] = [i for i, s in plain.items() if i < size and char in s]
        return ids

    def refresh(self, seq: Sequence) -> None:
        """`seq`'s constants changed (it got its fast-path constants): the next fold reads its row again."""
        self._stale.add(seq)

    def split(self, seqs: list[Sequence], tokens: np.ndarray, now: float, lengths: np.ndarray | None = None
              ) -> np.ndarray:
        """Which of `seqs` (each with its new token, `tokens[i]`, last in `token_ids`) are plain, as a bool array;
        their fold is done here: the token's time for a timed row, and the text deferred for a row that
        detokenizes. `lengths`: each row's token count where the caller knows it (else read from the rows)."""
        rows = self._rows
        if rows is None:
            rows = self._rows = self._build(seqs)
        elif self._stale or rows.seqs != seqs:  # identities compared in C
            rows = self._rows = self._carry(rows, seqs)
        elif self._base is not None:  # the same rows again: no alternation to bridge
            self._base, self._since = None, set()
        self._stale.clear()
        if self._base is not None:
            self._since.update(seqs)
        n = len(seqs)
        if lengths is None:
            lengths = np.fromiter(map(len, map(_token_ids, seqs)), np.int64, n)
        tokens = np.minimum(tokens, self.vocab_size)
        plain = rows.tables[rows.table_of, tokens]
        plain &= lengths < rows.limit
        plain &= ~rows.text | (rows.plain_state & (lengths >= rows.plain_from))
        timed = plain & rows.timed
        if timed.any():
            collections.deque(map(list.append, itertools.compress(rows.times, timed.tolist()),
                                  itertools.repeat(now)), 0)
        start = plain & rows.text & ~rows.deferring  # a plain run starts at this token
        for i in np.flatnonzero(start).tolist():
            seqs[i].deferred_from = int(lengths[i]) - 1
        rows.deferring |= start
        return plain

    def update(self, i: int, seq: Sequence) -> None:
        """After row `i`'s token took the per-row path: its text is settled, and its detokenizer's state read."""
        rows = self._rows
        if rows is not None and i < len(rows.seqs) and rows.seqs[i] is seq:
            rows.deferring[i], rows.plain_state[i] = _run_state(seq)

    def _build(self, seqs: list[Sequence]) -> _Rows:
        """The rows' constants, read in C loops (`map` over the rows): a row without fast-path constants reads as
        one that is never plain (`_NoRow`)."""
        n = len(seqs)
        rows = list(map(_fast_row, seqs))
        for i in np.flatnonzero(np.fromiter(map(operator.is_, rows, itertools.repeat(None)), bool, n)).tolist():
            rows[i] = self._no_row
        tables = list(map(_table, rows))
        ids = np.fromiter(map(id, tables), np.int64, n)
        kinds, table_of = np.unique(ids, return_inverse=True)  # each distinct table once, by identity
        by_id = dict(zip(ids.tolist(), tables))
        kind_tables = [by_id[k] for k in kinds.tolist()] or [self._no_row.table]
        times = list(map(_token_times, rows))
        deferring = np.fromiter(map(operator.is_not, map(_deferred_from, seqs), itertools.repeat(None)), bool, n)
        return _Rows(list(seqs), np.fromiter(map(_length_limit, rows), np.int64, n),
                     np.fromiter(map(_plain_from, rows), np.int64, n), np.fromiter(map(_text, rows), bool, n),
                     table_of.reshape(-1).astype(np.int64), np.stack(kind_tables), times,
                     np.fromiter(map(operator.is_not, times, itertools.repeat(None)), bool, n),
                     deferring | np.fromiter(map(getattr, map(_detokenizer, seqs), itertools.repeat("plain"),
                                                 itertools.repeat(False)), bool, n),
                     deferring, kind_tables)

    def _carry(self, old: _Rows, seqs: list[Sequence]) -> _Rows:
        """The rows of `seqs` from the last fold's (`old`): a row that was there keeps its constants and state,
        gathered by row (no sequence read); only the rows new to the fold are read, one by one. Why the state is still
        right: between two folds a row is in, only its token's fold changes it, through `split` and `update`, and a
        row that gets its fast-path constants is read again (`refresh`)."""
        n = len(seqs)
        src = _sources(old, seqs, self._stale)
        base = self._base
        if base is not None and 2 * int((src < 0).sum()) > n:  # back from folds of other rows: the fold before them
            from_base = _sources(base, seqs, self._stale | self._since)
            if (from_base < 0).sum() < (src < 0).sum():
                old, src = base, from_base
                self._base, self._since = None, set()
        new = np.flatnonzero(src < 0).tolist()
        if old is self._rows and self._base is not None and 2 * len(new) <= n:  # carried from the last fold
            self._base, self._since = None, set()
        if 2 * len(new) > n:
            # Mostly rows the last fold did not have: read them all. When the last fold was the larger (the offline
            # policy's decode rows, before a prefill step's few new rows), keep it to carry from when they return.
            if self.keep_base and len(old.seqs) > n and (base is None or len(old.seqs) >= len(base.seqs)) \
                    and old is not base:
                self._base, self._since = old, set(self._stale)  # a row refreshed in its fold is stale there
            elif base is not None and len(self._since) > 4 * len(base.seqs):  # its rows are long gone
                self._base, self._since = None, set()
            return self._build(seqs)
        take = np.maximum(src, 0)  # a new row's entries are overwritten below
        rows = _Rows(list(seqs), old.limit[take], old.plain_from[take], old.text[take], old.table_of[take],
                     old.tables, list(map(old.times.__getitem__, take.tolist())), old.timed[take],
                     old.plain_state[take], old.deferring[take], list(old.kinds))
        kind_of = None
        for i in new:  # few: a Python loop costs less than the C loops' set-up
            seq = seqs[i]
            row = seq.fast_row or self._no_row
            if kind_of is None:
                kind_of = {id(t): k for k, t in enumerate(rows.kinds)}
            k = kind_of.setdefault(id(row.table), len(rows.kinds))
            if k == len(rows.kinds):
                rows.kinds.append(row.table)
            rows.table_of[i], rows.limit[i], rows.plain_from[i], rows.text[i] = \
                k, row.length_limit, row.plain_from, row.text
            rows.times[i] = row.token_times
            rows.timed[i] = row.token_times is not None
            rows.deferring[i], rows.plain_state[i] = _run_state(seq)
        if len(rows.kinds) > len(old.kinds):
            if len(rows.kinds) > _MAX_TABLES:  # kinds of rows long gone pile up: read every row again
                return self._build(seqs)
            rows.tables = np.concatenate([old.tables, np.stack(rows.kinds[len(old.kinds):])])
        return rows


def _run_state(seq: Sequence) -> tuple[bool, bool]:
    """A row's `_Rows.deferring` and `_Rows.plain_state`, read from its sequence."""
    deferring = seq.deferred_from is not None
    return deferring, deferring or getattr(seq.detokenizer, "plain", False)


def _sources(old: _Rows, seqs: list[Sequence], excluded: set[Sequence]) -> np.ndarray:
    """Each of `seqs`' row in `old` (-1: not there, or in `excluded`), by identity: no sequence is read."""
    where = dict(zip(old.seqs, range(len(old.seqs))))
    for seq in excluded:
        where.pop(seq, None)
    return np.fromiter(map(where.get, seqs, itertools.repeat(-1)), np.int64, len(seqs))


@dataclasses.dataclass(frozen=True)
class _NoRow:
    """What `_Rows` reads of a row without fast-path constants (`FastRow`'s fields): never plain."""

    table: np.ndarray
    length_limit: int = 0
    plain_from: int = 0
    text: bool = False
    token_times: None = None
