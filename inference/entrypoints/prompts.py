"""The prompt forms `LLM.generate` / `LLM.stream` accept, vLLM's names: text, `TextPrompt`, `TokensPrompt`.

    llm.generate("Hello")                                     # one text
    llm.generate(["Hello", {"prompt": "Hi"}])                 # texts and TextPrompts, mixed
    llm.generate({"prompt_token_ids": [1, 2, 3]})             # a TokensPrompt (token ids go in as they are)
    llm.generate(prompt_token_ids=[[1, 2, 3]])                # the older keyword, kept

Everything becomes a list of `ParsedPrompt` (text and/or ids) here, before any tokenizing, so a shape mistake gets a
message naming the accepted forms instead of an error from deep inside the tokenizer. A prompt whose shape is wrong
comes back as that prompt's ValueError (`ParsedPrompt.error`), so the other prompts of the call still run.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Sequence, TypedDict, Union

import numpy as np


class TextPrompt(TypedDict):
    """A text prompt (vLLM's `TextPrompt`): tokenized with the model's tokenizer."""

    prompt: str


class _TokensPromptBase(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokensPromptBase, total=False):
    """Token ids given directly (vLLM's `TokensPrompt`); an optional `prompt` text is kept on the output only."""

    prompt: str


PromptType = Union[str, TextPrompt, TokensPrompt]

ACCEPTED_FORMS = ('a str, {"prompt": str} (TextPrompt), {"prompt_token_ids": [int, ...]} (TokensPrompt), or a list '
                  'of those')


@dataclasses.dataclass(frozen=True)
class ParsedPrompt:
    """One prompt, normalised: `token_ids` when the caller gave ids, else `text` to tokenize; `error` when its shape
    is not one of the accepted forms (then neither is set)."""

    text: str | None = None
    token_ids: list[int] | None = None
    error: str | None = None


def parse_prompts(prompts: PromptType | Sequence[PromptType] | None,
                  prompt_token_ids: Sequence[Sequence[int]] | None = None) -> list[ParsedPrompt]:
    """`generate`'s prompt arguments as a list, one ParsedPrompt per prompt, in order.

    Raises ValueError only for the call as a whole (neither or both arguments, a value that is no prompt and no
    list of prompts); a bad element of a list is that element's `error`."""
    if (prompts is None) == (prompt_token_ids is None):
        raise ValueError(f"pass exactly one of prompts or prompt_token_ids; prompts may be {ACCEPTED_FORMS}")
    if prompt_token_ids is not None:
        if isinstance(prompt_token_ids, np.ndarray):
            prompt_token_ids = list(prompt_token_ids)
        if isinstance(prompt_token_ids, (str, dict)) or not isinstance(prompt_token_ids, Sequence):
            raise ValueError("prompt_token_ids must be a list of token-id lists, e.g. [[1, 2, 3]]")
        return [_parse_ids(ids, f"prompt_token_ids[{i}]") for i, ids in enumerate(prompt_token_ids)]
    if isinstance(prompts, (str, dict)):
        return [_parse_one(prompts, "the prompt")]
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be {ACCEPTED_FORMS}; got {type(prompts).__name__}")
    if prompts and all(_is_token(t) for t in prompts):
        raise ValueError('prompts is a list of token ids; pass {"prompt_token_ids": [...]} (TokensPrompt) or '
                         "prompt_token_ids=[[...]]")
    return [_parse_one(p, f"prompt {i}") for i, p in enumerate(prompts)]


def _is_token(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _parse_one(prompt: Any, where: str) -> ParsedPrompt:
    if isinstance(prompt, str):
        return ParsedPrompt(text=prompt)
    if isinstance(prompt, dict):
        unknown = sorted(str(k) for k in prompt if k not in ("prompt", "prompt_token_ids"))
        if unknown:
            return ParsedPrompt(error=f"{where} has unsupported keys {unknown}; prompts may be {ACCEPTED_FORMS}")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            return ParsedPrompt(error=f'{where}: "prompt" must be a str, got {type(text).__name__}')
        if "prompt_token_ids" in prompt:
            parsed = _parse_ids(prompt["prompt_token_ids"], f"{where}'s prompt_token_ids")
            return dataclasses.replace(parsed, text=text) if parsed.error is None else parsed
        if text is None:
            return ParsedPrompt(error=f"{where} is a dict with neither \"prompt\" nor \"prompt_token_ids\"; prompts "
                                      f"may be {ACCEPTED_FORMS}")
        return ParsedPrompt(text=text)
    if isinstance(prompt, Sequence) and prompt and all(_is_token(t) for t in prompt):
        return ParsedPrompt(error=f'{where} is a list of token ids; wrap it as {{"prompt_token_ids": [...]}} '
                                  "(TokensPrompt)")
    return ParsedPrompt(error=f"{where} has type {type(prompt).__name__}; prompts may be {ACCEPTED_FORMS}")


def _parse_ids(ids: Any, where: str) -> ParsedPrompt:
    """Token ids must be a list of ints; the engine checks them against the vocabulary."""
    if isinstance(ids, np.ndarray) and ids.ndim == 1:
        ids = ids.tolist()
    if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Sequence):
        return ParsedPrompt(error=f"{where} must be a list of int token ids, got {type(ids).__name__}")
    bad = next((t for t in ids if not _is_token(t)), None)
    if bad is not None:
        return ParsedPrompt(error=f"{where} must hold only int token ids, got {bad!r}")
    return ParsedPrompt(token_ids=[int(t) for t in ids])
