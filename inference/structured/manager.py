"""One llguidance matcher per constrained sequence, host side: compiled at add_request, advanced on the tokens a
sequence keeps, and asked for the next step's token bitmask.

Where the masks are computed: the engine runs one step at a time, and the mask of step t + 1 depends on the token
step t samples, so the masks of a step are filled on the host after the previous step's tokens came back and before
the step is dispatched (not while the device runs). The rows are filled in parallel by llguidance's native thread
pool (`LLExecutor`, GIL released), straight into the numpy bitmask the step sends to the device; rows without a
constraint and padding rows stay all ones. The time spent is counted (`mask_seconds`) and reported by the
benchmark.

The matcher follows the sequence's tokens rather than the other way round: before a mask is filled and after a
token is appended, `sync` consumes the output tokens the matcher has not seen and rolls back any it saw that the
sequence no longer has. Preemption here is recompute with the generated tokens kept, so a preempted sequence's
matcher is already right and nothing is replayed; a sequence whose matcher would be re-created (or that dropped
tokens) is replayed from its own token ids.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from inference.sampling.token_mask import all_allowed
from inference.structured.params import StructuredOutputsParams, llguidance_module
from inference.structured.tokenizer import ll_tokenizer

if TYPE_CHECKING:
    import llguidance


@dataclasses.dataclass
class SequenceGrammar:
    """A sequence's matcher and how many of the sequence's output tokens it has consumed."""

    matcher: llguidance.LLMatcher
    num_consumed: int = 0


class StructuredOutputManager:
    """The engine's structured-outputs state: the llguidance tokenizer (built at the first constrained request),
    the thread pool that fills masks, and a `SequenceGrammar` per constrained sequence (keyed by `seq_id`)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = set(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._grammars: dict[int, SequenceGrammar] = {}
        self.mask_seconds = 0.0  # host time spent filling masks
        self.masked_steps = 0  # steps that carried a mask

    def _ll(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this model has none; load a model "
                             "with a tokenizer (GGUF metadata or tokenizer.json)")
        if self._ll_tokenizer is None:
            self._ll_tokenizer = ll_tokenizer(self._tokenizer, self.vocab_size, self._eos)
            self._executor = llguidance_module().LLExecutor()
        return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The grammar of `params`, checked against the tokenizer; ValueError naming the problem if it fails."""
        spec = params.grammar_spec()
        error = llguidance_module().LLMatcher.validate_grammar(spec, self._ll())
        if error:
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {error.strip()}")
        return spec

    def add(self, seq_ids: Sequence[int], grammar: str) -> None:
        """A fresh matcher for each sequence of a request (its `n` samples advance independently)."""
        for seq_id in seq_ids:
            matcher = llguidance_module().LLMatcher(self._ll(), grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(f"the structured-outputs grammar failed to start: {matcher.get_error()}")
            self._grammars[seq_id] = SequenceGrammar(matcher)

    def release(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence's matcher."""
        self._grammars.pop(seq_id, None)

    @property
    def active(self) -> bool:
        """Whether any sequence has a grammar (else no step needs a mask from here)."""
        return bool(self._grammars)

    def is_constrained(self, seq_id: int) -> bool:
        return seq_id in self._grammars

    def sync(self, seq) -> bool:
        """Bring the sequence's matcher to its output tokens (consume new ones, roll back dropped ones); True when
        the grammar is complete (the matcher is stopped: nothing but EOS could follow). A sequence without a
        constraint: False. Raises ValueError when the grammar rejects a token (the engine fails that sequence)."""
        state = self._grammars.get(seq.seq_id)
        if state is None:
            return False
        output = seq.output_token_ids
        if state.num_consumed > len(output):
            if not state.matcher.rollback(state.num_consumed - len(output)):
                raise ValueError(f"structured outputs: rolling back the grammar failed: {state.matcher.get_error()}")
            state.num_consumed = len(output)
        for token in output[state.num_consumed:]:
            if not state.matcher.consume_token(int(token)):
                raise ValueError(f"structured outputs: the grammar rejected token {token}: "
                                 f"{state.matcher.get_error()}")
            state.num_consumed += 1
        return state.matcher.is_stopped()

    def fill(self, rows: Sequence[tuple[int, object]], pad_to: int) -> np.ndarray | None:
        """The step's int32 bitmask [pad_to, ceil(V / 32)] for `rows` (batch row, sequence) that sample this step, or
        None when none of them is constrained (the step then carries no mask at all)."""
        constrained = [(row, seq) for row, seq in rows if seq.seq_id in self._grammars]
        if not constrained:
            return None
        start = time.perf_counter()
        mask = all_allowed(pad_to, self.vocab_size)
        matchers = []
        for row, seq in constrained:
            self.sync(seq)
            matchers.append((self._grammars[seq.seq_id].matcher, row))
        llguidance_module("numpy").fill_next_token_bitmask_par(self._executor, matchers, mask)
        self.mask_seconds += time.perf_counter() - start
        self.masked_steps += 1
        return mask
