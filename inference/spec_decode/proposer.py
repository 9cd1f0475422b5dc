"""What a proposer hands the engine: the draft tokens and, for a sampled draft, the probabilities they came from."""

from __future__ import annotations

import abc
from typing import NamedTuple, Sequence

import jax


class DraftProposal(NamedTuple):
    """What a model-backed proposer returns for a batch of sequences.

    token_ids: per sequence, the proposed tokens (0..k of them; fewer when the sequence is near its token budget).
    draft_probs: f32[S, k, V], the *processed* draft distribution (`probs_from_logits` with the request's
      SamplingTensors) each proposed token was sampled from; row i, position j is meaningful for
      j < len(token_ids[i]), the rest is padding. Greedy rows may hold anything (they are verified by argmax).
    """

    token_ids: list[list[int]]
    draft_probs: jax.Array | None


class DraftModelProposer(abc.ABC):
    """Interface of a draft-model proposer; the implementation is `inference.spec_decode.draft.PagedDraftProposer`.

    The engine calls `propose(seqs, pad_to)` once per step, after scheduling and before the target's verification
    pass, with the step's sequences in batch order (`inference.engine.sequence.Sequence` objects: it reads `token_ids`,
    `params`, `seed`, `pages`). The scheduler has reserved `len(seq.spec_tokens)` draft slots (and their pages) for
    each sequence that speculates; the proposer returns exactly that many tokens for those and none for the others.
    It runs the draft model autoregressively (keeping its own KV cache), *sampling* each token from
    `probs_from_logits(draft_logits, tensors, use_filters)` with the request's own sampling parameters (greedy rows
    take the argmax), and returns the tokens with those probabilities in the target's row layout [pad_to, k, V]
    (None when every speculating row is greedy: they are verified by argmax). The runner then calls
    `rejection_sample(target_probs, proposal.draft_probs, tokens, keys, greedy=..., num_draft=...)`.

    Why the probabilities and not just the tokens: the acceptance test needs p(x) for each draft token and the
    residual needs the whole p at the rejected position; sampling the draft from anything other than the returned p
    breaks exactness. A draft key per (seed, step, position) that differs from the verification key keeps the draft
    and the acceptance test independent, which the proof assumes.
    """

    k: int

    @abc.abstractmethod
    def propose(self, seqs: Sequence[object]) -> DraftProposal:
        """Propose up to `k` tokens per sequence; see the class docstring for the contract."""

    def forget(self, seq: object) -> None:  # noqa: B027
        """Hook when `seq` is preempted (its pages released): drop what the draft's cache holds for it."""

    def on_accepted(self, seqs: Sequence[object], num_accepted: Sequence[int]) -> None:  # noqa: B027
        """Hook after verification: roll the draft's own KV cache back to the accepted prefix. Default: nothing."""
