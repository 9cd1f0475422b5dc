"""The one interface the engine drives speculative decoding through, and what a proposer hands back.

Two phases per step, because the scheduler must know how many slots (and pages) a sequence verifies before the
batch exists, while a draft model proposes for the whole batch at once:

1. `reserve(seq, k)` at scheduling time: the tokens the scheduler reserves verification slots for (at most k). A
   model-free proposer (prompt lookup) returns its real proposal; a model-backed one returns k placeholders.
2. `propose(seqs, pad_to)` after scheduling, before the target's verification pass: the final draft tokens of the
   step's sequences (exactly `len(seq.spec_tokens)` for those that speculate) and, for a sampled draft, the
   probabilities they came from.

`bind(limits, vary_steps=...)` is called once by the engine that takes the proposer (a draft model runs in the
engine's batch buckets); `forget(seq)` when a sequence is preempted; `on_accepted(seqs, num_accepted)` after each
verification. The engine calls nothing else, so a new proposer needs no change to the engine.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, NamedTuple, Sequence

import jax

if TYPE_CHECKING:
    from inference.runtime.batch import BucketLimits


class DraftProposal(NamedTuple):
    """What `Proposer.propose` returns for a batch of sequences.

    token_ids: per sequence, the proposed tokens (0..k of them; fewer when the sequence is near its token budget).
    draft_probs: f32[S, k, V], the *processed* draft distribution (`probs_from_logits` with the request's
      SamplingTensors) each proposed token was sampled from; row i, position j is meaningful for
      j < len(token_ids[i]), the rest is padding. Greedy rows may hold anything (they are verified by argmax).
      None: deterministic proposals (n-gram, greedy drafts), verified as one-hot distributions.
    """

    token_ids: list[list[int]]
    draft_probs: jax.Array | None


class Proposer(abc.ABC):
    """A speculative-decoding proposer, as the engine sees it (see the module docstring for the two phases).

    `k`: the most drafts it proposes per sequence and step (the engine's num_speculative_tokens).
    """

    k: int

    def reserve(self, seq: object, k: int) -> list[int]:
        """The `k` tokens (k >= 1, already capped by the sequence's budget) the scheduler reserves slots for.
        Default: placeholders, filled by `propose` (a model-backed proposer drafts for the whole batch at once)."""
        return [0] * k

    @abc.abstractmethod
    def propose(self, seqs: Sequence[object], pad_to: int | None = None) -> DraftProposal:
        """Draft tokens for the step's sequences in batch order: exactly `len(seq.spec_tokens)` for each sequence
        that speculates, none for the others; probabilities (if any) in the target's row layout [pad_to, k, V]."""

    def bind(self, limits: BucketLimits, *, vary_steps: bool) -> None:  # noqa: B027
        """Called once by the engine that takes this proposer: its batch buckets (`limits`), and whether the draft
        count varies per sequence (adaptive k). Default: nothing to configure."""

    def num_variants(self) -> int:
        """How many executables the proposer's own steps can compile under the bound limits (0: no device work)."""
        return 0

    def warmup(self) -> int:
        """Compile those executables now (after `bind`); returns how many compiled. Default: nothing to compile."""
        return 0

    def forget(self, seq: object) -> None:  # noqa: B027
        """Hook when `seq` is preempted (its pages released): drop what the draft's cache holds for it."""

    def on_accepted(self, seqs: Sequence[object], num_accepted: Sequence[int]) -> None:  # noqa: B027
        """Hook after verification, with the sequences that speculated and how many drafts of each were accepted
        (e.g. to roll a draft's own KV cache back to the accepted prefix). Default: nothing."""


class DraftModelProposer(Proposer):
    """A model-backed proposer; the implementation is `inference.spec_decode.draft.PagedDraftProposer`.

    The engine calls `propose(seqs, pad_to)` once per step, after scheduling and before the target's verification
    pass, with the step's sequences in batch order (`inference.engine.sequence.Sequence` objects: it reads
    `token_ids`, `params`, `seed`, `pages`). The scheduler has reserved `len(seq.spec_tokens)` draft slots (and their
    pages) for each sequence that speculates (`reserve`'s placeholders); the proposer returns exactly that many tokens
    for those and none for the others. It runs the draft model autoregressively (keeping its own KV cache),
    *sampling* each token from `probs_from_logits(draft_logits, tensors, use_filters)` with the request's own
    sampling parameters (greedy rows take the argmax), and returns the tokens with those probabilities in the
    target's row layout [pad_to, k, V] (None when every speculating row is greedy: they are verified by argmax). The
    runner then calls `rejection_sample(target_probs, proposal.draft_probs, tokens, keys, greedy=..., num_draft=...)`.

    Why the probabilities and not just the tokens: the acceptance test needs p(x) for each draft token and the
    residual needs the whole p at the rejected position; sampling the draft from anything other than the returned p
    breaks exactness. A draft key per (seed, step, position) that differs from the verification key keeps the draft
    and the acceptance test independent, which the proof assumes.
    """


__all__ = ["DraftModelProposer", "DraftProposal", "Proposer"]
