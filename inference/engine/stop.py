"""When a sequence stops, and what text it shows: EOS, stop token ids, stop strings, length limits.

Order and semantics follow vLLM: EOS (unless `ignore_eos`) and `stop_token_ids` stop with the token kept in
`token_ids`; a stop string truncates the text before it (or after it with `include_stop_str_in_output`);
`max_tokens` and the model context stop with reason "length". Below `min_tokens` generated tokens only the length
limits apply, and stop strings count only once more than `min_tokens` tokens exist (vLLM V1's detokenizer);
`detokenize=False` keeps no text. Text grows incrementally, one token at a time,
through the tokenizer's incremental detokenizer, so a long generation costs O(1) decode work per token. (Decoding all
of a step's rows in one batched `decode_batch` call was tried: on a CPU shared with the device's step, the tokenizer's
thread pool made the fold slower; BENCHMARKS.md, host overhead.)
"""

from __future__ import annotations

import functools

from inference.engine.sequence import Sequence


@functools.lru_cache(maxsize=1024)
def longest_stop(stop: tuple[str, ...]) -> int:
    """The longest stop string's length (a request's stop strings are a tuple, checked at every token)."""
    return max(map(len, stop))


def _append_text(seq: Sequence, tokenizer) -> None:
    if seq.detokenizer is None:
        seq.detokenizer = tokenizer.detokenizer(skip_special_tokens=seq.params.skip_special_tokens,
                                                prompt_ids=seq.token_ids[:seq.num_prompt_tokens])
        seq.output_text = seq.detokenizer.add(seq.output_token_ids)  # all of them (several after a preemption)
    else:
        seq.append_text(seq.detokenizer.add(seq.token_ids[-1]))


def check_stop(seq: Sequence, tokenizer, eos_token_ids: set[int],
               max_model_len: int) -> tuple[str | None, int | str | None]:
    """(finish_reason, stop_reason) after `seq` got a new token, or (None, None) to go on."""
    params = seq.params
    token = seq.token_ids[-1]
    # vLLM: below min_tokens only the length limits end a sequence (the sampler banned EOS and stop_token_ids).
    below_min = seq.num_output_tokens < params.min_tokens
    if tokenizer is not None and params.detokenize:
        before = seq.text_len
        _append_text(seq, tokenizer)
        if params.stop and seq.num_output_tokens > params.min_tokens:
            # A new match can only end in the new text: look back by the longest stop string.
            stop = match_stop_string(seq, max(0, before - longest_stop(params.stop) + 1), params.stop)
            if stop is not None:
                return "stop", stop
    if not below_min and not params.ignore_eos and token in eos_token_ids:
        return "stop", None
    if not below_min and token in params.stop_token_ids:
        return "stop", token
    if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
        return "length", None
    if seq.num_tokens >= max_model_len:
        return "length", None
    return None, None


def match_stop_string(seq: Sequence, start: int, stops: tuple[str, ...]) -> str | None:
    """The first of `stops` found in the text from `start` on (then the text is cut at it, or after it with
    `include_stop_str_in_output`), or None."""
    start = max(start, 0)
    text = seq.text_from(start)  # only the look-back: the whole text is joined only to cut it
    for stop in stops:
        at = text.find(stop)
        if at >= 0:
            end = start + at + (len(stop) if seq.params.include_stop_str_in_output else 0)
            seq.output_text = seq.output_text[:end]
            return stop
    return None


def flush_text(seq: Sequence) -> None:
    """At the end of a sequence (not cut by a stop string): emit what the detokenizer held back."""
    if seq.detokenizer is not None and not isinstance(seq.stop_reason, str):
        seq.append_text(seq.detokenizer.finish())
