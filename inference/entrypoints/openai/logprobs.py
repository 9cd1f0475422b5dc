"""Logprobs in OpenAI's two shapes: the legacy completions one (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`) and the chat one (`content: [{token, logprob, bytes, top_logprobs}]`).

The engine gives, per position, a dict from token id to its logprob: the chosen token first, then the top k.
`logprob_value` is the one place that reads a value, so it takes both a float and an object with `.logprob` (vLLM's
`Logprob`). Token strings are decoded here, one token at a time, without skipping special tokens (each position
names its token); a model without a tokenizer shows "token_id:N" (vLLM's `return_tokens_as_token_ids` form).
"""

from __future__ import annotations

import math
from typing import Any, Mapping


def logprob_value(entry: Any) -> float:
    """The logprob in an engine logprob entry: a float, or an object with `.logprob`."""
    return float(getattr(entry, "logprob", entry))


def _finite(x: float) -> float | None:
    """JSON has no -inf: a filtered-out token (processed logprobs) becomes the most negative float."""
    return x if math.isfinite(x) else -3.4028234663852886e38


def token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[Mapping[int, Any] | None],
                        text_offset: int = 0) -> dict:
    """The legacy shape for `token_ids` with one entry per token (None: no logprob, as for a prompt's first token).
    `text_offset` counts each token's decoded length from where the choice's text starts."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(logprob_value(entry[token])))
        out["top_logprobs"].append({token_text(tokenizer, t): _finite(logprob_value(v)) for t, v in entry.items()})
    return out


def _chat_entry(tokenizer, token_id: int, value: Any) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": _finite(logprob_value(value)), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[Mapping[int, Any]], top_k: int) -> dict:
    """The chat shape: each token with its `top_k` most likely alternatives."""
    content = []
    for token, entry in zip(token_ids, entries):
        item = _chat_entry(tokenizer, token, entry[token])
        ranked = sorted(entry.items(), key=lambda kv: -logprob_value(kv[1]))[:top_k]
        item["top_logprobs"] = [_chat_entry(tokenizer, t, v) for t, v in ranked]
        content.append(item)
    return {"content": content}
