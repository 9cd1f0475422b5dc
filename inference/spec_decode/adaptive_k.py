"""Adaptive draft length: how many tokens to propose per sequence, from its recent acceptance rate."""

from __future__ import annotations

import math
import weakref

from inference.engine.config import check_num_drafts


class AdaptiveK:
    """Per-sequence draft length from an exponential moving average of the sequence's acceptance rate.

    Why: a draft token costs a proposal (a draft-model step, or nothing for prompt lookup) and a verification slot,
    and it pays only when accepted. With per-token acceptance rate a, the expected run of accepted drafts (with no
    cap) is a / (1 - a); proposing about that many (`k_for_rate`: ceil(a / (1 - a)), clipped to [1, k_max]) keeps k
    near where the next draft is still more likely than not to be used. So k shrinks while drafts are rejected and
    grows back when they are accepted. Each verification adds the observation accepted / trials, with trials =
    accepted + 1 at a rejection and = accepted when every draft survived; the EMA keeps `decay` of the old estimate.
    A new sequence starts at k_max (rate k_max / (k_max + 1)). State is kept per sequence object (weakly: finished
    sequences drop out).
    """

    def __init__(self, k_max: int, *, decay: float = 0.5) -> None:
        check_num_drafts(k_max, "k_max")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.k_max = k_max
        self.decay = decay
        self._rate: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @staticmethod
    def k_for_rate(rate: float, k_max: int) -> int:
        if rate >= 1.0:
            return k_max
        return max(1, min(k_max, math.ceil(rate / (1.0 - rate) - 1e-9)))

    def rate(self, seq: object) -> float:
        return self._rate.get(seq, self.k_max / (self.k_max + 1.0))

    def k(self, seq: object) -> int:
        """The number of drafts `seq` should get this step."""
        return self.k_for_rate(self.rate(seq), self.k_max)

    def update(self, seq: object, proposed: int, accepted: int) -> None:
        """Fold one verification (`accepted` of `proposed` drafts kept) into the sequence's rate."""
        if proposed <= 0:
            return
        trials = accepted + (1 if accepted < proposed else 0)
        self._rate[seq] = self.decay * self.rate(seq) + (1.0 - self.decay) * accepted / trials
