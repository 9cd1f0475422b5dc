"""Text <-> token ids, chat templates and streaming detokenization on top of Hugging Face `tokenizers`.

Two sources: a GGUF file carries its vocabulary, merges and chat template as metadata (no tokenizer.json), so
`from_gguf` rebuilds the byte-level BPE the model was trained with; a Hugging Face folder has tokenizer.json, which
`from_folder` loads as is. Both must produce the ids the model saw in training, so the GGUF path mirrors the
pre-tokenizer of the original tokenizer.json for each llama.cpp pre-tokenizer name instead of guessing.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from models.loaders.read_errors import named_errors, read_json_object

if TYPE_CHECKING:
    from models.loaders.gguf_file import GGUFInfo

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types that are added tokens, not BPE output
_REPLACEMENT_CHAR = "\ufffd"

# Pre-tokenizer regexes from the original tokenizer.json files (llama.cpp keeps the same ones in llama-vocab.cpp).
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                                    _byte_level(use_regex=False)])


def _gguf_pre_tokenizer(name: str) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None, bool]:
    """(pre-tokenizer, normalizer, BPE ignore_merges) for a llama.cpp `tokenizer.ggml.pre` name."""
    if name == "gpt2":
        return _byte_level(use_regex=True), None, False
    if name in ("smollm", "starcoder", "refact", "codeshell"):
        # StarCoder-family tokenizer.json: single digits first, then the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        _byte_level(use_regex=True)]), None, False
    if name in ("llama-bpe", "llama3", "smaug-bpe"):
        return _split_then_bytes(_LLAMA3_REGEX), None, True
    if name == "qwen2":
        return _split_then_bytes(_QWEN2_REGEX), normalizers.NFC(), False
    raise ValueError(f"GGUF pre-tokenizer {name!r} is not supported; supported: gpt2, smollm, starcoder, llama-bpe, "
                     "qwen2. Load the model's Hugging Face folder (tokenizer.json) instead, or pass prompt_token_ids")


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> Any:
    """Compile like transformers does, so templates written for HF render identically here."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template that tokenizer.json does not carry."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, unk_token: str | None = None, chat_template: str | None = None):
        self._tk = tokenizer
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.chat_template = chat_template
        self._compiled_template: Any = None
        self._token_bytes: dict[bool, list[bytes] | None] = {}  # `token_bytes`, made on first use
        self._plain_texts: dict[bool, dict[int, str]] = {}  # `plain_texts`, made on first use
        self._partial_bytes: dict[bool, dict[int, frozenset[int]]] = {}  # `partial_bytes`, made on first use

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_gguf(cls, info: "GGUFInfo") -> "Tokenizer":
        """Rebuild the byte-level BPE from GGUF vocab + merges; CONTROL/USER_DEFINED tokens become added tokens."""
        if info.hf_tokenizer_json:  # some converters embed the original tokenizer.json: use it verbatim
            try:
                tk = tokenizers.Tokenizer.from_str(info.hf_tokenizer_json)
            except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for what it cannot parse
                raise ValueError(f"the GGUF file's embedded tokenizer.huggingface.json cannot be read ({exc}); "
                                 "convert the model again") from exc
            return cls(tk, **_gguf_special_tokens(info))
        if not info.tokens:
            raise ValueError("the GGUF file has no tokenizer vocabulary; pass prompt_token_ids instead of text")
        if info.tokenizer_model != "gpt2":
            raise ValueError(f"GGUF tokenizer model {info.tokenizer_model!r} is not supported (only byte-level BPE "
                             "'gpt2'); load the model's Hugging Face folder (tokenizer.json) or pass prompt_token_ids")
        pre, normalizer, ignore_merges = _gguf_pre_tokenizer(info.pre_tokenizer)
        vocab = {tok: i for i, tok in enumerate(info.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in info.merges]
        tk = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                                             ignore_merges=ignore_merges))
        if normalizer is not None:
            tk.normalizer = normalizer
        tk.pre_tokenizer = pre
        tk.decoder = decoders.ByteLevel()
        tk.add_tokens([AddedToken(info.tokens[i], special=t == _CONTROL, normalized=False)
                       for i, t in enumerate(info.token_types) if t in (_CONTROL, _USER_DEFINED)])
        bos = _token_at(info.tokens, info.bos_token_id)
        if info.add_bos and bos is not None:
            tk.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                              special_tokens=[(bos, info.bos_token_id)])
        else:
            tk.post_processor = processors.ByteLevel(trim_offsets=False)
        return cls(tk, **_gguf_special_tokens(info))

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> "Tokenizer":
        """Load tokenizer.json, with special tokens and chat template from tokenizer_config.json."""
        folder = os.fspath(folder)
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"{folder} has no tokenizer.json; pass prompt_token_ids instead of text, or add "
                             "tokenizer.json (slow-tokenizer files such as tokenizer.model are not supported)")
        with named_errors(path, "the tokenizer", "copy tokenizer.json from the model's original folder again",
                          also=(Exception,)):
            tk = tokenizers.Tokenizer.from_file(path)
        cfg = _read_json_if_exists(os.path.join(folder, "tokenizer_config.json"))
        tok = cls(tk, bos_token=_token_content(cfg.get("bos_token")), eos_token=_token_content(cfg.get("eos_token")),
                  pad_token=_token_content(cfg.get("pad_token")), unk_token=_token_content(cfg.get("unk_token")),
                  chat_template=_folder_chat_template(folder, cfg))
        if isinstance(cfg.get("add_bos_token"), bool):
            tok._force_bos(cfg["add_bos_token"])
        return tok

    def _force_bos(self, add_bos: bool) -> None:
        """Honor tokenizer_config's add_bos_token where tokenizer.json's post-processor disagrees (as
        LlamaTokenizerFast does on load)."""
        bos_id = self.bos_token_id
        if bos_id is None or (self._tk.encode("a").ids[:1] == [bos_id]) == add_bos:
            return
        if add_bos:
            self._tk.post_processor = processors.TemplateProcessing(
                single=f"{self.bos_token} $A", pair=f"{self.bos_token} $A {self.bos_token} $B",
                special_tokens=[(self.bos_token, bos_id)])
        else:
            self._tk.post_processor = processors.ByteLevel(trim_offsets=False)

    # ---------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special-token strings in `text` (e.g. `<|im_start|>`) map to their single ids, as in HF. A
        ValueError for text no UTF-8 can hold (a lone surrogate: JSON's "\\ud800" escape alone)."""
        try:
            return list(self._tk.encode(text, add_special_tokens=add_special_tokens).ids)
        except TypeError:
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ValueError(f"the text holds {text[exc.start:exc.end]!r} at character {exc.start}, a lone "
                                     "UTF-16 surrogate, which is no character; fix the escapes that made it") from None
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._tk.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._tk.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self._tk.token_to_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tk

    # ---------------------------------------------------------------- chat

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render the model's Jinja chat template with the variables transformers provides."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template; pass a plain prompt string instead of messages")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                     "pad_token": self.pad_token or "", "unk_token": self.unk_token or ""}
        variables.update(kwargs)
        return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              **variables)

    def token_bytes(self, skip_special_tokens: bool) -> list[bytes] | None:
        """Each id's bytes under this tokenizer's decoder when it is byte-level alone (GPT-2's ByteLevel: a decode
        is the ids' bytes joined, decoded as UTF-8 with replacement), b"" for a skipped special token; None for any
        other decoder. Checked once against the library's decode of every id alone; any difference: None."""
        key = bool(skip_special_tokens)
        if key not in self._token_bytes:
            self._token_bytes[key] = _byte_level_table(self._tk, key)
        return self._token_bytes[key]

    def plain_texts(self, skip_special_tokens: bool) -> dict[int, str]:
        """The ids whose bytes alone are whole UTF-8 and give a non-empty text not ending in U+FFFD, each with that
        text: what an incremental detokenizer holding nothing back (`IncrementalDetokenizer.plain`) emits for it.
        Empty for a decoder that is not byte-level. Made once; read-only."""
        key = bool(skip_special_tokens)
        if key not in self._plain_texts:
            table = self.token_bytes(key) or ()
            self._plain_texts[key] = {i: text for i, text in enumerate(map(_whole_text, table)) if text is not None}
        return self._plain_texts[key]

    def partial_bytes(self, skip_special_tokens: bool) -> dict[int, frozenset[int]]:
        """The other ids with bytes (a lone byte of a multi-byte character, an emoji's first half), each with its
        ASCII bytes: what its text can add of a character below 128 once the detokenizer emits it, maybe together
        with a later id's (every other character it adds is non-ASCII: a completed one, or U+FFFD). Empty for a
        decoder that is not byte-level. Made once; read-only."""
        key = bool(skip_special_tokens)
        if key not in self._partial_bytes:
            table, plain = self.token_bytes(key) or (), self.plain_texts(key)
            self._partial_bytes[key] = {i: frozenset(b for b in data if b < 128) for i, data in enumerate(table)
                                        if data and i not in plain}
        return self._partial_bytes[key]

    def detokenizer(self, skip_special_tokens: bool = True,
                    prompt_ids: Sequence[int] = ()) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)


class IncrementalDetokenizer:
    """Turn a growing list of generated ids into text deltas, never splitting a multi-byte character.

    A lone token may hold half of a UTF-8 sequence (emoji, CJK) and SentencePiece decoders drop a leading space at
    the start of a decode, so decoding tokens one at a time is wrong. As in vLLM, we decode a short window
    `ids[prefix:]` and the same window without the unread tokens, and emit the difference only when the window no
    longer ends in U+FFFD (an incomplete character).

    With a byte-level decoder (`Tokenizer.token_bytes`) a decode is the ids' bytes joined and decoded with
    replacement, done here without the library; and while the window's read part is whole UTF-8 its text is a
    prefix of the window's, so the difference is the unread tokens' bytes decoded alone: one small decode a token
    instead of two, with the same deltas (the fold runs this for every sequence at every step).
    """

    _PROMPT_CONTEXT = 5  # prompt tokens kept as left context so the first delta gets its leading space right
    # Slots: the fold reads one detokenizer a decoding row each step, right after the device's step has been through
    # the caches; no instance dict is one object fewer to fetch.
    __slots__ = ("_tokenizer", "_skip", "_bytes", "_ids", "_prefix_offset", "_read_offset", "_whole", "plain",
                 "_deltas")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._bytes = tokenizer.token_bytes(skip_special_tokens)  # None: decode through the library
        self._ids: list[int] = list(prompt_ids)[-self._PROMPT_CONTEXT:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._whole = self._is_whole(self._ids)  # the read part of the window, ids[prefix:read], is whole UTF-8
        # Every id read and the window whole: `add` of an id with a `Tokenizer.plain_texts` text emits just that
        # text (`add_plains`).
        self.plain = self._whole
        self._deltas: list[str] = []

    def _join(self, ids: list[int]) -> bytes | None:
        """The ids' bytes under a byte-level decoder; None without one (or for an id past the table, which the
        library then decodes from here on)."""
        table = self._bytes
        if table is not None:
            try:
                return b"".join([table[i] for i in ids])
            except IndexError:
                self._bytes = None
        return None

    def _is_whole(self, ids: list[int]) -> bool:
        data = self._join(ids)
        if data is None:
            return False
        try:
            data.decode()
        except UnicodeDecodeError:
            return False
        return True

    def _decode(self, ids: list[int]) -> str:
        data = self._join(ids)
        if data is not None:
            return data.decode("utf-8", "replace")
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, new_ids: int | Iterable[int]) -> str:
        """Append generated ids; return the text that became final (possibly "")."""
        ids = self._ids
        if isinstance(new_ids, int):
            ids.append(new_ids)
        else:
            ids.extend(new_ids)
        self.plain = False
        unread = None
        if self._whole:  # the window's text is the read part's, then the unread bytes decoded alone
            read = self._read_offset
            unread = self._join(ids[read:]) if len(ids) - read != 1 or ids[read] >= len(self._bytes) \
                else self._bytes[ids[read]]
        if unread is not None:
            try:
                delta, whole = unread.decode(), True
            except UnicodeDecodeError:
                delta, whole = unread.decode("utf-8", "replace"), False
            if not delta or delta[-1] == _REPLACEMENT_CHAR:
                return ""
        else:
            prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
            new_text = self._decode(ids[self._prefix_offset:])
            if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
                return ""
            delta = new_text[len(prefix_text):]
            whole = self._is_whole(ids[self._read_offset:])
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self._whole = self.plain = whole
        self._deltas.append(delta)
        return delta

    def finish(self) -> str:
        """Flush what is held back at the end of generation (a truncated character comes out as U+FFFD)."""
        ids = self._ids
        unread = self._join(ids[self._read_offset:]) if self._whole else None
        if unread is not None:
            delta = unread.decode("utf-8", "replace")
        else:
            prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
            new_text = self._decode(ids[self._prefix_offset:])
            delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(ids)
        self._whole = self.plain = self._bytes is not None
        self._deltas.append(delta)
        return delta

    def add_plains(self, tokens: int | list[int], texts: str | list[str]) -> None:
        """`add(token)` for each of `tokens` in turn (or one token and its text), for a detokenizer that is `plain`
        and tokens whose `Tokenizer.plain_texts` texts are `texts`: the state those adds leave (it stays plain),
        and `texts` are the deltas they would return (the fold's plain rows, whose text is appended when read: no
        decode)."""
        if isinstance(tokens, int):
            self._ids.append(tokens)
            self._deltas.append(texts)
            self._prefix_offset = self._read_offset
            self._read_offset += 1
        elif tokens:
            self._ids.extend(tokens)
            self._read_offset += len(tokens)
            self._prefix_offset = self._read_offset - 1
            self._deltas.extend(texts)

    @property
    def text(self) -> str:
        """All the text emitted so far (kept as its deltas: appending to a string attribute copies it)."""
        return "".join(self._deltas)


# ---------------------------------------------------------------- helpers


def _whole_text(data: bytes) -> str | None:
    """`Tokenizer.plain_texts`' text of one id's bytes, or None."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return None
    return text if text and text[-1] != _REPLACEMENT_CHAR else None


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return {c: b for b, c in chars.items()}


def _byte_level_table(tk: tokenizers.Tokenizer, skip_special_tokens: bool) -> list[bytes] | None:
    """`Tokenizer.token_bytes`: the library's ByteLevel decoder maps each character of a token to its byte when all
    of them are in the alphabet, else takes the token's UTF-8 bytes; skipped special tokens give nothing. Checked
    against the library's decode of the added tokens and the byte tokens, each alone."""
    if not isinstance(tk.decoder, decoders.ByteLevel):
        return None
    to_byte = _unicode_to_byte()
    added = tk.get_added_tokens_decoder()
    table = [b""] * tk.get_vocab_size(with_added_tokens=True)
    for token, i in tk.get_vocab(with_added_tokens=True).items():
        if skip_special_tokens and i in added and added[i].special:
            continue
        try:
            table[i] = bytes([to_byte[c] for c in token])
        except KeyError:
            table[i] = token.encode()
    checked = sorted({*added, *filter(None, map(tk.token_to_id, to_byte))})
    alone = tk.decode_batch([[i] for i in checked], skip_special_tokens=skip_special_tokens)
    if any(table[i].decode("utf-8", "replace") != text for i, text in zip(checked, alone)):
        return None
    return table


def _token_at(tokens: Sequence[str], token_id: int | None) -> str | None:
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _gguf_special_tokens(info: "GGUFInfo") -> dict[str, Any]:
    return {"bos_token": _token_at(info.tokens, info.bos_token_id),
            "eos_token": _token_at(info.tokens, info.eos_token_id),
            "pad_token": _token_at(info.tokens, info.pad_token_id),
            "unk_token": _token_at(info.tokens, info.unk_token_id), "chat_template": info.chat_template}


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or a serialized AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json_if_exists(path: str) -> dict[str, Any]:
    """The JSON object in `path`, {} where there is no such file, a ValueError naming it where it is no JSON object."""
    if not os.path.isfile(path):
        return {}
    return read_json_object(path)


def _folder_chat_template(folder: str, cfg: dict[str, Any]) -> str | None:
    """chat_template.jinja (newer transformers) > chat_template.json > tokenizer_config.json's chat_template."""
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = _read_json_if_exists(os.path.join(folder, "chat_template.json")).get("chat_template") \
        or cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template
