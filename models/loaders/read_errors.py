"""What a corrupt checkpoint makes the reading code raise, as one ValueError that names the file.

Why: a byte flipped in a GGUF header, a `null` where config.json has a number or a tokenizer.json that is not JSON
surface deep in a library as a KeyError, a TypeError or a bare `Exception` that names neither the file nor the fix.
Each loader wraps the reading of one file in `named_errors(path, what)`; an error that already names the file is
left as it is. `read_json_object` is the loaders' one reader of a JSON settings file.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterator
from typing import Any

# What reading code raises on data it did not expect (a ValueError is one too, and UnicodeDecodeError is a
# ValueError); MemoryError and KeyboardInterrupt are not the file's fault and pass through.
_READ_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, struct.error, OverflowError,
                ZeroDivisionError)


@contextlib.contextmanager
def named_errors(path: str, what: str, fix: str, also: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Inside the block, a read error becomes `ValueError("{path}: cannot read {what} (...); {fix}")` unless it is
    a ValueError whose message already names `path`. `also`: further exception types to read as the file's fault
    (tokenizers raises a bare `Exception` for a tokenizer.json it cannot parse)."""
    try:
        yield
    except _READ_ERRORS + also as exc:
        if isinstance(exc, MemoryError) or isinstance(exc, ValueError) and path in str(exc):
            raise
        raise ValueError(f"{path}: cannot read {what} ({type(exc).__name__}: {exc}); {fix}") from exc


def read_json_object(path: str) -> dict[str, Any]:
    """The JSON object in `path`; a ValueError naming the file where it is not UTF-8 JSON or not an object (a list,
    a null: a download cut short, a hand edit)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object; is the download complete?")
    return data
