"""When a sequence stops, and what text it shows: EOS, stop token ids, stop strings, length limits.

Order and semantics follow vLLM: EOS (unless `ignore_eos`) and `stop_token_ids` stop with the token kept in
`token_ids`; a stop string truncates the text before it (or after it with `include_stop_str_in_output`);
`max_tokens` and the model context stop with reason "length".
"""

from __future__ import annotations

from inference.sequence import Sequence


class StopChecker:
    @staticmethod
    def check(seq: Sequence, tokenizer, eos_token_ids: set[int],
              max_model_len: int) -> tuple[str | None, int | str | None]:
        """(finish_reason, stop_reason) after `seq` got a new token, or (None, None) to go on."""
        params = seq.params
        token = seq.token_ids[-1]
        if not params.ignore_eos and token in eos_token_ids:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
        if params.stop and tokenizer is not None:
            text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=params.skip_special_tokens)
            # Only the tail can hold a new match: look back as far as the longest stop string plus a token.
            window = max(len(s) for s in params.stop) + 32
            for stop in params.stop:
                at = text.find(stop, max(0, len(seq.output_text) - window))
                if at >= 0:
                    seq.output_text = text[:at + len(stop)] if params.include_stop_str_in_output else text[:at]
                    return "stop", stop
            seq.output_text = text
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return "length", None
        if seq.num_tokens >= max_model_len:
            return "length", None
        return None, None

    @staticmethod
    def visible_text(seq: Sequence, tokenizer) -> str:
        """The completion text as the user sees it (truncated at a stop string when one matched)."""
        if tokenizer is None:
            return ""
        if isinstance(seq.stop_reason, str):
            return seq.output_text
        return tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
