"""One sequence being generated: its tokens, its pages, and how far its KV cache is computed.

A request with `n` samples owns `n` sequences. All mutable per-sequence state lives here so the scheduler, the
block manager and the engine share one record instead of parallel dicts.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from inference.engine.outputs import LogprobsDict
from inference.sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # sample index within the request
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    arrival_order: int
    priority: int = 0  # lower runs sooner (vLLM's convention)
    lora_id: int = 0  # the LoRA adapter's id (inference/lora/), 0: the base model
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # One page table per KV cache group (inference/engine/pages/kv_cache_manager.py); a model without windows has one.
    block_tables: list[list[int]] = dataclasses.field(default_factory=lambda: [[]])
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    state_slot: int = 0  # a hybrid model's state-cache slot (inference/engine/pages/state_slots.py); 0: none
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_logprobs: list[LogprobsDict] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[LogprobsDict | None] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0  # sum of the sampled tokens' logprobs (filled only when logprobs are asked)
    # The output text as the pieces it grew by (`append_text`): `text += piece` on an attribute copies the whole text,
    # a cost per token that grows with the text. `output_text` joins them when read.
    text_parts: list[str] = dataclasses.field(default_factory=list, repr=False)
    _text_len: int = 0  # len(output_text), less the deferred plain tokens' text
    # token_ids[deferred_from:] were folded as plain tokens (inference/engine/plain_rows.py) whose text is not
    # appended yet; every reader of the text appends it first (`settle_text`). None: no text is deferred.
    deferred_from: int | None = None
    spec_tokens: list[int] = dataclasses.field(default_factory=list)  # proposed for this step, not yet verified
    detokenizer: Any = None  # the tokenizer's IncrementalDetokenizer, made at the first generated token
    fast_row: Any = None  # the fold's per-sequence constants (inference/engine/fold.py), made after its first token

    @property
    def pages(self) -> list[int]:
        """The page table of KV cache group 0 (the only one of a model without sliding windows)."""
        return self.block_tables[0]

    @pages.setter
    def pages(self, pages: list[int]) -> None:
        self.block_tables[0] = pages

    def settle_text(self, end: int | None = None) -> None:
        """Append the deferred plain tokens' text. A token with a `fast_row.plain` text, while the detokenizer holds
        nothing back, adds just that text (it is told of the token too); from a token without one (a part of a
        multi-byte character: `PlainRows.table`), the detokenizer adds each token as the fold's per-row path would.
        `end`: the tokens before that index, and the plain run ends (the fold, before a token that is not plain);
        None: every folded token (an in-flight placeholder, a negative id, is not one), and the run goes on (a
        reader of the text)."""
        start = self.deferred_from
        if start is None:
            return
        ids = self.token_ids
        if end is None:
            end = len(ids)
            if ids[-1] < 0:
                end -= 1
            self.deferred_from = end
        else:
            self.deferred_from = None
        plain, detokenizer = self.fast_row.plain, self.detokenizer
        if end - start == 1:  # a reader at every step (streaming): one token, no lists
            token = ids[start]
            text = plain.get(token)
            if text is not None and detokenizer.plain:
                detokenizer.add_plains(token, text)
            else:
                text = detokenizer.add(token)
        elif end > start:
            tokens = ids[start:end]
            texts = list(map(plain.get, tokens)) if detokenizer.plain else [None]
            whole = len(tokens) if None not in texts else texts.index(None)  # the run's plain head
            detokenizer.add_plains(tokens[:whole], texts[:whole])
            text = "".join(texts[:whole])
            if whole < len(tokens):
                text += "".join(map(detokenizer.add, tokens[whole:]))
        else:
            return
        if text:
            self.text_parts.append(text)
            self._text_len += len(text)

    @property
    def text_len(self) -> int:
        self.settle_text()
        return self._text_len

    @property
    def output_text(self) -> str:
        self.settle_text()
        parts = self.text_parts
        if len(parts) > 1:  # joined once; a new list, so a `text_snapshot` of the old one still reads as it was
            self.text_parts = parts = ["".join(parts)]
        return parts[0] if parts else ""

    @output_text.setter
    def output_text(self, text: str) -> None:
        self.settle_text()
        self.text_parts = [text] if text else []
        self._text_len = len(text)

    def append_text(self, text: str) -> None:
        """Append a token's text (after `settle_text`: its callers, the fold and the stop checks, settle first)."""
        if text:
            self.text_parts.append(text)
            self._text_len += len(text)

    def text_from(self, start: int) -> str:
        """output_text[start:], joining only the last pieces it spans (a stop string's look-back)."""
        self.settle_text()
        parts, need = self.text_parts, self._text_len - max(start, 0)
        i, got = len(parts), 0
        while i > 0 and got < need:
            i -= 1
            got += len(parts[i])
        return "".join(parts[i:])[got - need:] if need > 0 else ""

    def text_snapshot(self) -> tuple[list[str], int]:
        """The text now, without joining it: its pieces are only appended to (a cut or a join makes a new list), so
        "".join(parts[:count]) is the text at this moment whatever happens to the sequence later."""
        self.settle_text()
        return self.text_parts, len(self.text_parts)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model; 1 for a sequence in steady decode."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def predicts_prompt(self) -> bool:
        """Whether its next step predicts a prompt position (where prompt logprobs are recorded): the first token
        it computes is not the prompt's last (`build_model_input`'s target_ids)."""
        return self.num_computed_tokens + 1 < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
