"""vLLM's logprob dicts from the sampler's arrays: one `Logprob(logprob, rank, decoded_token)` per token of a position.

A position's dict holds the sampled (or prompt) token with its vocabulary rank from the jitted sampler, then the
top-k alternatives ranked 1..k in descending order; a token that is both keeps the top-k entry, as vLLM V1's
dictionary insert does. Decoded tokens are each token decoded on its own, which vLLM does too (special tokens kept);
the texts are cached per token id since the same few ids recur at every position.
"""

from __future__ import annotations

from typing import Sequence

from inference.engine.outputs import Logprob, LogprobsDict


class TokenTexts:
    """Token id -> its text decoded alone (`tokenizer.decode([id], skip_special_tokens=False)`), cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def logprobs_dict(token: int, logprob: float, rank: int | None, top_ids: Sequence[int], top_logprobs: Sequence[float],
                  texts: TokenTexts | None) -> LogprobsDict:
    """The dict of one position: `token` first (with its rank), then the top alternatives ranked 1..k.

    `texts` None: no decoded tokens (the request set detokenize=False, or the model has no tokenizer)."""
    decode = texts if texts is not None else (lambda _: None)
    entry = {int(token): Logprob(float(logprob), None if rank is None else int(rank), decode(int(token)))}
    for i, (t, lp) in enumerate(zip(top_ids, top_logprobs)):
        entry[int(t)] = Logprob(float(lp), i + 1, decode(int(t)))
    return entry
