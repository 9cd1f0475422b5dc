"""What `Engine.add_request` checks before it queues a request: every reason a request could never run (a bad
token id, a prompt longer than the context or the page pool, a parameter speculation cannot serve yet, a grammar
that does not compile, bad words without a tokenizer), each a ValueError that names the problem and the fix, so the
request fails alone and nothing is queued."""

from __future__ import annotations

from typing import Any

import numpy as np

from inference.sampling.logit_bias import bad_words_token_ids
from inference.sampling.params import SamplingParams

# The functions take the `Engine` (inference/engine/llm_engine.py), which imports this module.
Engine = Any


def validate(engine: Engine, request_id: str, ids: list[int], params: SamplingParams) -> None:
    """Raise ValueError, naming the problem and the fix, for a request the engine can never run."""
    if request_id in engine.requests:
        raise ValueError(f"request id {request_id!r} is already in use")
    if len(ids) == 0:
        raise ValueError(f"request {request_id}: the prompt is empty; give at least one token")
    vocab = engine.runner.config.vocab_size
    for t in ids:  # one pass, stopping at the first bad id
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):  # 5.7 would have run as token 5
            raise ValueError(f"request {request_id}: token ids must be integers, got {t!r}")
        if not 0 <= t < vocab:
            raise ValueError(f"request {request_id}: token id {t} is outside the vocabulary [0, {vocab})")
    if engine.num_spec and params.uses_penalties:
        # Verification would need the counts to grow along each row's draft positions; not built yet.
        raise ValueError(f"request {request_id}: penalties are not supported with speculative decoding yet "
                         "(repetition_penalty, presence_penalty, frequency_penalty)")
    if engine.num_spec and (params.min_tokens or params.bad_words):
        # Both depend on the output length, which grows along a row's draft positions; not built yet.
        raise ValueError(f"request {request_id}: min_tokens and bad_words are not supported with speculative "
                         "decoding yet")
    for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):  # min_tokens masks the stop ids too
        out_of_vocab = [t for t in getattr(params, name) or () if t >= vocab]
        if out_of_vocab:
            raise ValueError(f"request {request_id}: {name} has token id {out_of_vocab[0]} outside the "
                             f"vocabulary [0, {vocab})")
    if len(ids) >= engine.max_model_len:
        raise ValueError(f"request {request_id}: the prompt has {len(ids)} tokens but the model context is "
                         f"{engine.max_model_len}; shorten the prompt or raise max_model_len")
    short = engine.block_manager.shortfall(min(len(ids) + 1, engine.max_model_len),
                                         engine.scheduler.config.max_num_batched_tokens)
    if short is not None:
        raise ValueError(f"request {request_id}: {short}; raise kv_cache_memory_bytes or shorten the prompt")

def compile_grammar(engine: Engine, request_id: str, params: SamplingParams) -> str | None:
    """The request's structured-outputs grammar compiled against the tokenizer (None: unconstrained); a
    ValueError fails this request only."""
    if params.structured_outputs is None:
        return None
    if engine.num_spec:
        raise ValueError(f"request {request_id}: structured outputs are not supported with speculative decoding "
                         "yet; drop structured_outputs or run without speculative_method")
    try:
        return engine.structured.compile(params.structured_outputs)
    except ValueError as exc:
        raise ValueError(f"request {request_id}: {exc}") from None

def bad_words_ids_of(engine: Engine, request_id: str, params: SamplingParams) -> list[list[int]]:
    """`params.bad_words` tokenized (vLLM's two spellings of each), checked against the vocabulary."""
    if not params.bad_words:
        return []
    if engine.tokenizer is None:
        raise ValueError(f"request {request_id}: bad_words need a tokenizer and this model has none; ban token "
                         "ids with logit_bias={id: -100} instead")
    ids = bad_words_token_ids(params.bad_words, engine.tokenizer)
    vocab = engine.runner.config.vocab_size
    bad = [t for word in ids for t in word if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"request {request_id}: bad_words tokenize to id {bad[0]} outside the vocabulary")
    return ids
