"""`StructuredOutputsParams`: what output a request must match (vLLM's current shape), validated at construction.

Why llguidance (and not xgrammar or a hand-written automaton): llguidance ships abi3 wheels with no Python
dependencies for Linux x86-64/aarch64, macOS and Windows, so the default install stays free of torch; xgrammar's
wheels pull torch, transformers and triton. Its masks are computed on demand, walking a token trie with a
derivative-based regex lexer and an Earley parser, so a new schema needs no ahead-of-time automaton over the
vocabulary (xgrammar and Outlines precompile one per grammar) and a request's first mask is as cheap as its later
ones; it covers more of JSON Schema than the other engines vLLM and SGLang ship (JSONSchemaBench), plus regex,
Lark and GBNF grammars; and vLLM, SGLang and llama.cpp all have llguidance backends, so its behaviour is the one
users of those know.

Everything that can be checked without a tokenizer is checked here, so a bad schema, regex or grammar is a
`ValueError` when the `SamplingParams` is built; compiling against a tokenizer happens when the engine accepts the
request (inference/structured/manager.py).
"""

from __future__ import annotations

import dataclasses
import json
from types import ModuleType
from typing import Any

from models.optional_deps import require

#: The kinds of constraint, in the order vLLM's `StructuredOutputsParams` lists them.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """One constraint on a request's output; exactly one of the fields below is set.

    Attributes:
      json: a JSON Schema, as a dict or a JSON string; kept as the JSON string (so the params stay hashable).
      regex: a regular expression the whole output matches (Rust `regex` syntax, anchored at both ends; `\\d` and
        `\\w` are Unicode classes there, so write `[0-9]` for ASCII digits).
      choice: the output is exactly one of these strings.
      grammar: a Lark grammar (llguidance's dialect) or a GBNF / EBNF grammar (llama.cpp's).
      json_object: True: any JSON object (OpenAI's `response_format={"type": "json_object"}`).
      disable_any_whitespace: JSON only: no whitespace between tokens of the JSON (vLLM's flag); by default any
        JSON whitespace is allowed there, as in vLLM.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen dataclass)
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}")
        if self.json is not None:
            set_("json", _schema_text(self.json))
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs.regex must be a string, got {self.regex!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"structured_outputs.grammar must be a string, got {self.grammar!r}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be True or None, got {self.json_object!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got "
                                 f"{self.choice!r}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must hold non-empty strings, got {self.choice!r}")
            set_("choice", tuple(self.choice))
        error = llguidance_module().LLMatcher.validate_grammar(self.grammar_spec())
        if error:
            raise ValueError(f"structured_outputs.{self.kind} is invalid: {error.strip()}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of `KINDS`."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_spec(self) -> str:
        """The llguidance grammar (its JSON form) of the constraint; tokenizer-independent."""
        llguidance = llguidance_module()
        matcher = llguidance.LLMatcher
        if self.kind in ("json", "json_object"):
            schema = self.json if self.json is not None else '{"type": "object"}'
            try:
                return matcher.grammar_from_json_schema(
                    schema, defaults={"whitespace_flexible": not self.disable_any_whitespace})
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not a valid JSON schema: {exc}") from None
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.regex)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", list(self.choice))
        try:
            return llguidance.grammar_from("grammar", self.grammar)  # Lark, or GBNF converted to Lark
        except ValueError as exc:
            raise ValueError(f"structured_outputs.grammar is invalid: {exc}") from None


def llguidance_module(submodule: str = "") -> ModuleType:
    """llguidance (or one of its submodules), imported when a request first asks for structured outputs: `from
    inference import SamplingParams` stays light, and an engine that never sees a constraint never needs it."""
    return require("llguidance" + (f".{submodule}" if submodule else ""), "Structured outputs", "llguidance")


def _schema_text(schema: Any) -> str:
    """A JSON Schema given as a dict or a string -> its JSON text; anything else is a ValueError."""
    if isinstance(schema, dict):
        try:
            return json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"structured_outputs.json must be JSON-serialisable: {exc}") from None
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if not isinstance(parsed, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON Schema object, got {schema[:80]!r}")
        return schema
    raise ValueError(f"structured_outputs.json must be a JSON Schema as a dict or a string, got "
                     f"{type(schema).__name__}")


def from_response_format(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's `response_format` -> the constraint (None for {"type": "text"} or no response_format).

    {"type": "json_object"} is any JSON object; {"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
    "strict": ...}} is that schema (a missing "schema" means any JSON object, as in vLLM). ValueError otherwise.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise ValueError(f"response_format must be an object with a 'type', got {response_format!r}")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format of type 'json_schema' needs a 'json_schema' object with a 'schema'")
        schema = spec.get("schema")
        return StructuredOutputsParams(json_object=True) if schema is None else StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'")
