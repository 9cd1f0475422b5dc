"""Tokenizer built from GGUF metadata must tokenize exactly like the model's Hugging Face tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from inference.loading.tokenizer import IncrementalDetokenizer, Tokenizer
from models.loaders.gguf_file import load_gguf_info
from tests.reference_fixtures import gguf_path

SYSTEM_PROMPT = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
ROUND_TRIP_TEXTS = [
    "Hello, world! What is the capital of France?",
    "line one\nline two\n\n    indented\ttabbed\r\nend",
    "digits 0 12 345 6789 3.14159 1e-5 2025-01-31",
    "accents é à ü ñ, CJK 中文字符, emoji 😀👍🏽🇫🇷 and ZWJ 👩\u200d💻",
    "  leading and trailing spaces  ",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n",
]
# llama.cpp's convert_hf_to_gguf.py hashes HF tokenizer output on this string to pick `tokenizer.ggml.pre`; its hash
# for HuggingFaceTB/SmolLM is 855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249.
LLAMA_CPP_CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 "
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL")
SMOLLM_CHKHSH = "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"


@pytest.fixture(scope="module")
def info():
    return load_gguf_info(gguf_path())


@pytest.fixture(scope="module")
def tok(info):
    return Tokenizer.from_gguf(info)


def test_known_ids(tok):
    assert tok.encode("Hello, world! What is the capital of France?") == [
        19556, 28, 905, 17, 1812, 314, 260, 3575, 282, 4649, 47]
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]


def test_matches_llama_cpp_pretokenizer_hash(tok):
    assert hashlib.sha256(str(tok.encode(LLAMA_CPP_CHKTXT)).encode()).hexdigest() == SMOLLM_CHKHSH


def test_digits_split_before_the_gpt2_regex(tok):
    # StarCoder-style `Digits(individual_digits=True)` runs first, so whitespace before a digit stays one piece
    # ("  " -> 'ĠĠ' 256) instead of GPT-2's ' ' + ' 3'. llama.cpp's "smollm" regex list does the same.
    assert tok.encode("a  3") == [81, 256, 35]
    assert tok.encode("12") == [33, 34]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS + [LLAMA_CPP_CHKTXT])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_special_tokens_and_properties(tok):
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 49152)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # SmolLM2 adds no BOS
    assert tok.decode([1, 4093, 198, 6004, 2]) == "user\nhi"
    assert tok.decode([1, 4093, 2], skip_special_tokens=False) == "<|im_start|>user<|im_end|>"


def test_chat_template(tok):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(messages) == (
        SYSTEM_PROMPT + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."}] + messages,
                                        add_generation_prompt=False)
    assert no_prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and no_prompt.endswith("<|im_end|>\n")


def test_chat_template_helpers_and_sandbox():
    from jinja2.exceptions import SecurityError, TemplateError
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('bad role') }}"
                "{% endif %}{{ m | tojson }}{% endfor %}{{ eos_token }}")
    t = Tokenizer(backend, bos_token="<s>", eos_token="</s>", chat_template=template)
    assert t.apply_chat_template([{"role": "user", "content": "é"}]) == '<s>{"role": "user", "content": "é"}</s>'
    with pytest.raises(TemplateError, match="bad role"):
        t.apply_chat_template([{"role": "bad", "content": ""}])
    evil = Tokenizer(backend, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(SecurityError):
        evil.apply_chat_template([])
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer(backend).apply_chat_template([])


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_incremental_detokenizer_streams_whole_characters(tok, text):
    ids = tok.encode(text)
    detok = tok.detokenizer(skip_special_tokens=False)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.finish())
    assert "".join(deltas) == text == detok.text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_holds_partial_utf8(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # one emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "😀"
    cut = IncrementalDetokenizer(tok)
    cut.add(ids[:-1])
    assert cut.finish() == "\ufffd"  # generation stopped mid-character: flushed, not lost


def test_incremental_detokenizer_with_prompt_context(tok):
    prompt = tok.encode("The capital of France is")
    completion = tok.encode(" Paris, of course.")
    detok = tok.detokenizer(prompt_ids=prompt)
    assert "".join(detok.add(i) for i in completion) + detok.finish() == " Paris, of course."


class _LibraryDetokenizer(IncrementalDetokenizer):
    """The detokenizer with every decode through the library (`tokenizers`), as before the byte-level path."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._bytes, self._whole = None, False


def test_byte_level_detokenizer_equals_the_library_decodes(tok):
    """The byte-level path (`Tokenizer.token_bytes`: one small decode a token, no library call) gives the deltas of
    the library's two decodes a token, on random ids: multi-byte characters cut across tokens, single-byte tokens
    that make invalid UTF-8, special tokens kept or skipped, ids past the vocabulary (the library drops them),
    prompt context, several ids an add, and the flush."""
    import random

    vocab = tok.backend.get_vocab_size()
    assert tok.token_bytes(True) is not None and tok.token_bytes(False) is not None
    rng = random.Random(0)
    common = tok.encode("Hello wörld 😀 日本語 ça va?\n\n def f(x): return x**2 🎉🇫🇷 ") + list(range(17))
    byte_tokens = [i for i in map(tok.token_to_id, "ĠâĤ¬ðŁĺĢÃ©íłĢ¿") if i is not None]  # bytes of €, 😀, é, ...
    assert len(byte_tokens) >= 10
    for trial in range(300):
        pool = [common, byte_tokens, range(vocab), range(vocab, vocab + 64)][rng.choice([0, 0, 1, 2, 3])]
        ids = [rng.choice(pool) if rng.random() < 0.8 else rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        skip = trial % 2 == 0
        fast = tok.detokenizer(skip_special_tokens=skip, prompt_ids=prompt)
        library = _LibraryDetokenizer(tok, skip_special_tokens=skip, prompt_ids=prompt)
        i = 0
        while i < len(ids):
            chunk = ids[i:i + rng.choice([1, 1, 2, 3])]
            i += len(chunk)
            arg = chunk[0] if len(chunk) == 1 else chunk
            assert fast.add(arg) == library.add(arg), (trial, ids, prompt)
        assert fast.finish() == library.finish() and fast.text == library.text, (trial, ids, prompt)


def test_token_bytes_only_for_a_byte_level_decoder(tok):
    from tokenizers import Tokenizer as Backend, decoders, models

    metaspace = Backend(models.BPE({"▁a": 0, "b": 1}, []))
    metaspace.decoder = decoders.Metaspace()
    assert Tokenizer(metaspace).token_bytes(True) is None
    detok = Tokenizer(metaspace).detokenizer()
    assert detok.add([0, 1]) + detok.finish() == metaspace.decode([0, 1])
    table = tok.token_bytes(True)
    assert table[tok.eos_token_id] == b"" and tok.token_bytes(False)[tok.eos_token_id] == tok.eos_token.encode()


def test_from_folder_matches_from_gguf(tmp_path, tok, info):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", "special": True}, "eos_token": "<|im_end|>",
        "chat_template": info.chat_template}))
    folder_tok = Tokenizer.from_folder(tmp_path)
    for text in ROUND_TRIP_TEXTS:
        assert folder_tok.encode(text) == tok.encode(text)
    assert (folder_tok.bos_token_id, folder_tok.eos_token_id) == (1, 2)
    messages = [{"role": "user", "content": "hi"}]
    assert folder_tok.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_from_folder_add_bos_token_and_jinja_file(tmp_path, tok):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": True}))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    folder_tok = Tokenizer.from_folder(tmp_path)
    assert folder_tok.encode("hi") == [0] + tok.encode("hi")
    assert folder_tok.encode("hi", add_special_tokens=False) == tok.encode("hi")
    assert folder_tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|endoftext|>x"


def test_from_gguf_prefers_embedded_tokenizer_json(tok, info):
    import dataclasses

    embedded = Tokenizer.from_gguf(dataclasses.replace(info, hf_tokenizer_json=tok.backend.to_str(), merges=()))
    assert embedded.encode(ROUND_TRIP_TEXTS[3]) == tok.encode(ROUND_TRIP_TEXTS[3])
    assert (embedded.bos_token_id, embedded.eos_token_id) == (1, 2) and embedded.chat_template == info.chat_template


def test_from_folder_without_tokenizer_files(tmp_path):
    with pytest.raises(ValueError, match="pass prompt_token_ids instead of text, or add tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


def test_unsupported_gguf_tokenizers(info):
    import dataclasses

    with pytest.raises(ValueError, match="pre-tokenizer 'mystery' is not supported"):
        Tokenizer.from_gguf(dataclasses.replace(info, pre_tokenizer="mystery"))
    with pytest.raises(ValueError, match="tokenizer model 'llama' is not supported"):
        Tokenizer.from_gguf(dataclasses.replace(info, tokenizer_model="llama"))
    with pytest.raises(ValueError, match="no tokenizer vocabulary"):
        Tokenizer.from_gguf(dataclasses.replace(info, tokens=()))


def test_matches_transformers_reference_fixture(tok):
    """Prompt ids and chat rendering recorded from transformers (scripts/fixtures/make_reference_fixtures.py)."""
    path = Path(__file__).parent.parent / "fixtures" / "smollm2_reference.json"
    if not path.is_file():
        pytest.skip(f"{path} missing")
    for p in json.loads(path.read_text())["prompts"]:
        rendered = tok.apply_chat_template(p["messages"]) if p["kind"] == "chat" else p["prompt"]
        assert rendered == p["rendered_prompt"]
        assert tok.encode(rendered) == p["prompt_ids"], p["prompt"]
        assert tok.decode(p["greedy_ids"], skip_special_tokens=False) == p["greedy_text"]


@pytest.mark.reference
def test_matches_transformers_gguf_tokenizer(tok):
    """transformers' own GGUF tokenizer conversion; it ignores `tokenizer.ggml.pre` (plain GPT-2 ByteLevel), so
    texts with whitespace runs before digits are left out: there it differs from the real SmolLM2 tokenizer."""
    transformers = pytest.importorskip("transformers")
    path = gguf_path()
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ROUND_TRIP_TEXTS[:2] + ROUND_TRIP_TEXTS[3:] + [LLAMA_CPP_CHKTXT]:
        assert tok.encode(text) == hf.encode(text), text
        ids = tok.encode(text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=True)
