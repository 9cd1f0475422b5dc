"""Prompt-lookup (n-gram) proposals for speculative decoding: no model, the sequence's own tokens."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from inference.engine.config import check_num_drafts
from inference.spec_decode.proposer import DraftProposal, Proposer


class NgramProposer:
    """Prompt-lookup decoding: guess that the text continues as it did after the last time its tail occurred.

    Why: on summarisation, code editing, RAG and chat with quoted context the output often copies spans of the prompt
    (or of itself), and finding them costs no model at all. The proposal is deterministic, so verify it with
    `rejection_sample(..., draft_probs=None, ...)` (p is one-hot on the proposed token).

    `propose(tokens)` takes the sequence's own tokens (prompt + generated so far), looks for the most recent earlier
    occurrence of its last n tokens, longest n first (n_max down to n_min), and returns up to k tokens that followed
    that occurrence; [] if no suffix of length >= n_min occurs earlier. "Earlier" means the occurrence is followed by
    at least one token inside the sequence, so the suffix never matches itself. The continuation stops at the end of
    the sequence, so a match near the end yields fewer than k tokens (with `extend_periodic=True` it is instead
    continued by the same copy rule, i.e. the repetition it found is assumed to keep going, giving k tokens).

    Cost: one vectorised numpy comparison of the last token against the whole sequence, then the candidate set only
    shrinks as the match is extended backwards (O(L + n_max * matches)). Given a Python list instead of a numpy
    array, the conversion dominates; keep an array per sequence if that matters.
    """

    def __init__(self, n_max: int = 3, n_min: int = 1, k: int = 4, *, extend_periodic: bool = False) -> None:
        if not (isinstance(n_min, int) and isinstance(n_max, int) and 1 <= n_min <= n_max):
            raise ValueError(f"need integers 1 <= n_min <= n_max, got n_min={n_min!r}, n_max={n_max!r}")
        check_num_drafts(k, "k")
        self.n_max = n_max
        self.n_min = n_min
        self.k = k
        self.extend_periodic = extend_periodic

    def find_match(self, tokens: Sequence[int] | np.ndarray) -> tuple[int, int] | None:
        """(start, n) of the chosen earlier occurrence of the last n tokens (longest n, then most recent), or None."""
        arr = np.asarray(tokens)
        length = arr.shape[0]
        if length < self.n_min + 1:
            return None
        # Candidate end positions e of an occurrence (e <= L - 2 so a token follows it), matching on the last token.
        ends = np.flatnonzero(arr[: length - 1] == arr[length - 1])
        best: tuple[int, int] | None = None
        n = 1
        while ends.size:
            if n >= self.n_min:
                best = (int(ends[-1]) - n + 1, n)  # ends is ascending: the last one is the most recent
            if n == self.n_max or n == length - 1:
                break
            ends = ends[ends >= n]  # room for one more token before the occurrence
            ends = ends[arr[ends - n] == arr[length - 1 - n]]
            n += 1
        return best

    def propose(self, tokens: Sequence[int] | np.ndarray) -> list[int]:
        """Up to k proposed next tokens for one sequence (possibly [])."""
        match = self.find_match(tokens)
        if match is None:
            return []
        start, n = match
        begin = start + n
        if not self.extend_periodic:
            return [int(t) for t in np.asarray(tokens)[begin : begin + self.k]]
        out = [int(t) for t in np.asarray(tokens)[begin:]]
        length = len(tokens)
        # ext[L + i] = ext[begin + i]; begin + i < L + i, so every copied token already exists.
        while len(out) < self.k:
            i = len(out)
            out.append(int(tokens[begin + i]) if begin + i < length else out[begin + i - length])
        return out[: self.k]

    def propose_batch(self, token_lists: Sequence[Sequence[int] | np.ndarray]) -> list[list[int]]:
        """`propose` for each sequence (e.g. `[seq.token_ids for seq in seqs]`)."""
        return [self.propose(t) for t in token_lists]


class PromptLookupProposer(Proposer):
    """`NgramProposer` behind the engine's `Proposer` interface (`LLM(speculative_method="ngram")`).

    Prompt lookup needs no model, so its proposal is made at scheduling time (`reserve`: the scheduler then reserves
    exactly as many slots as there are tokens, none when nothing matches), and `propose` only hands the step's
    already-placed tokens back, with no probabilities (deterministic drafts).
    """

    def __init__(self, ngram: NgramProposer) -> None:
        self.ngram = ngram
        self.k = ngram.k

    def reserve(self, seq, k: int) -> list[int]:
        return self.ngram.propose(seq.token_ids)[:k]

    def propose(self, seqs: Sequence, pad_to: int | None = None) -> DraftProposal:
        return DraftProposal([list(s.spec_tokens) for s in seqs], None)
