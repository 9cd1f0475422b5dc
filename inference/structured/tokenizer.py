"""pagejax's tokenizer as llguidance's `LLTokenizer`.

llguidance needs each token's bytes (to walk its token trie against the grammar's lexer) and the EOS ids. Both
tokenizer sources of inference/loading/tokenizer.py end up as a Hugging Face `tokenizers.Tokenizer` (GGUF metadata
rebuilt into one, or tokenizer.json as is), so the bridge hands llguidance that tokenizer's JSON, which its Rust side
reads with the same `tokenizers` library: byte-level BPE vocabularies (SmolLM2's GPT-2 byte alphabet) map to their
exact bytes, and added / special tokens are known as such. No vocabulary is re-encoded here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from inference.structured.params import llguidance_module

if TYPE_CHECKING:
    import llguidance


def ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> llguidance.LLTokenizer:
    """An `LLTokenizer` over `tokenizer` (inference/loading/tokenizer.py: Tokenizer) for a model of `vocab_size`
    logits; ids the tokenizer does not define (a vocabulary padded to a round size) are never allowed.

    Building it walks the whole vocabulary, so the engine builds it once, at the first constrained request (and
    not at all for engines that never see one).
    """
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {vocab_size} logits; "
                         "structured outputs need a tokenizer that matches the model")
    eos = sorted({int(t) for t in eos_token_ids})
    if not eos:
        raise ValueError("structured outputs need an EOS token (the tokenizer and the model config name none)")
    return llguidance_module().LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
