"""Structured outputs (llguidance): the params' validation, the jitted mask, the tokenizer bridge, and SmolLM2
constrained through the engine (schemas validated with `jsonschema`, regex / choice exact, batch invariance, seeds,
preemption, chunked prefill, compiles)."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import jsonschema
import llguidance.numpy as llg_numpy
import numpy as np
import pytest

from inference import SamplingParams, StructuredOutputsParams
from inference.engine.config import CacheConfig, SchedulerConfig
from inference.engine.llm_engine import Engine
from inference.sampling.sampler import SamplingTensors, sample_with_logprobs
from inference.sampling.token_mask import all_allowed, apply_token_mask, mask_words
from inference.spec_decode.ngram import NgramProposer, PromptLookupProposer
from inference.structured.params import from_response_format
from inference.structured.tokenizer import ll_tokenizer
from tests.llm_configs import engine_swapped


def constrained(max_tokens: int = 24, **kwargs) -> SamplingParams:
    """Greedy with a constraint; JSON without free whitespace (a 135M model otherwise pads with newlines)."""
    sampling = {k: kwargs.pop(k) for k in ("temperature", "seed", "n", "stop", "logprobs") if k in kwargs}
    sampling.setdefault("temperature", 0.0)
    if "json" in kwargs:
        kwargs.setdefault("disable_any_whitespace", True)
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kwargs), **sampling)


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


# ---- parameters -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(regex="a(b"), "(?s)structured_outputs.regex is invalid: .*unclosed group"),
    (dict(json={"type": "foo"}), "structured_outputs.json is invalid: Invalid type: foo"),
    (dict(json={"type": "integer", "minimum": "x"}), "structured_outputs.json is invalid: .*minimum"),
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json=["a"]), "must be a JSON Schema as a dict or a string"),
    (dict(grammar="start: undefined_rule"), "(?s)structured_outputs.grammar is invalid: .*unknown name"),
    (dict(choice=[]), "choice must be a non-empty list of strings"),
    (dict(choice="yes"), "choice must be a non-empty list of strings"),
    (dict(choice=["yes", ""]), "choice must hold non-empty strings"),
    (dict(), "needs exactly one of json, regex, choice, grammar, json_object; got none"),
    (dict(regex="a", choice=["a"]), "needs exactly one of .*; got regex, choice"),
    (dict(json_object=False), "needs exactly one of"),
])
def test_bad_constraints_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_params_normalise_and_map_from_openai():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    by_dict, by_text = StructuredOutputsParams(json=schema), StructuredOutputsParams(json=json.dumps(schema))
    assert by_dict == by_text and hash(SamplingParams(structured_outputs=by_dict)) is not None
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    assert StructuredOutputsParams(grammar='root ::= "a" | "b"').kind == "grammar"  # GBNF is converted to Lark
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": schema})
    assert from_response_format(None) is None and from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    assert from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}) == by_dict
    with pytest.raises(ValueError, match="type 'xml' is not supported"):
        from_response_format({"type": "xml"})
    with pytest.raises(ValueError, match="needs a 'json_schema' object"):
        from_response_format({"type": "json_schema"})


# ---- the mask in the sampler ----------------------------------------------------------------------------------

def test_mask_matches_llguidance_reference_and_all_ones_is_exact():
    rng = np.random.default_rng(0)
    vocab = 100  # not a multiple of 32: the last word's high bits are past the vocabulary
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    mask = rng.integers(-2**31, 2**31, size=(3, mask_words(vocab)), dtype=np.int64).astype(np.int32)
    want = logits.copy()
    llg_numpy.apply_token_bitmask_inplace(want, mask)
    np.testing.assert_array_equal(np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(mask))), want)
    ones = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(all_allowed(3, vocab))))
    np.testing.assert_array_equal(ones, logits)
    with pytest.raises(ValueError, match="covers 64 tokens, fewer than the vocabulary"):
        apply_token_mask(jnp.asarray(logits), jnp.asarray(mask[:, :2]))


def test_sampler_draws_only_allowed_tokens_and_logprobs_are_of_the_masked_distribution():
    rng = np.random.default_rng(1)
    vocab, rows = 64, 4
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32))
    allowed = [[3, 40], [63], [0, 1, 2, 33], list(range(vocab))]  # the last row is unconstrained
    mask = np.zeros((rows, mask_words(vocab)), np.uint32)
    for r, ids in enumerate(allowed):
        for t in ids:
            mask[r, t // 32] |= np.uint32(1 << (t % 32))
    mask = mask.view(np.int32)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0)]
    for step in range(5):
        t = SamplingTensors.from_params(params, [7] * rows, [step] * rows, pad_to=rows, token_mask=mask)
        out = sample_with_logprobs(logits, t, use_filters=False, num_top=4)
        tokens = np.asarray(out.tokens)
        assert all(int(tok) in ids for tok, ids in zip(tokens, allowed))
        assert tokens[0] == max(allowed[0], key=lambda i: float(logits[0, i]))  # greedy: argmax among allowed
        # raw logprobs: log-softmax over the allowed tokens only
        for r, ids in enumerate(allowed[:3]):
            want = jnp.log(jnp.exp(logits[r, tokens[r]]) / jnp.sum(jnp.exp(logits[r, jnp.asarray(ids)])))
            np.testing.assert_allclose(float(out.logprob[r]), float(want), rtol=1e-5, atol=1e-6)
        free = SamplingTensors.from_params(params[3:], [7], [step], pad_to=1)
        assert int(sample_with_logprobs(logits[3:], free, use_filters=False, num_top=0).tokens[0]) == tokens[3]


# ---- the tokenizer bridge -------------------------------------------------------------------------------------

def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable alphabet for the 256 bytes (what byte-level BPE vocabularies are written in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def test_llguidance_tokenizer_has_smollm2_bytes_exactly(smollm2):
    tok = smollm2.tokenizer
    ll = ll_tokenizer(tok, smollm2.config.vocab_size, [tok.eos_token_id])
    decoder = _gpt2_byte_decoder()
    special = 0
    for i in range(smollm2.config.vocab_size):
        piece = tok.id_to_token(i)
        if ll.is_special_token(i):
            special += 1
            continue
        assert ll.decode_bytes([i]) == bytes(decoder[c] for c in piece), (i, piece)
    assert 0 < special < 100  # <|im_start|>, <|endoftext|>, ... are known as special, not text
    for text in ['{"name": "Ava", "age": 25}', "  two  spaces\n\n12345", "héllo ☃ 日本語"]:
        assert ll.tokenize_str(text) == tok.encode(text, add_special_tokens=False)
    assert ll.eos_tokens == [tok.eos_token_id]


# ---- SmolLM2 through the engine -------------------------------------------------------------------------------

SCHEMAS = {
    "object": ("Describe a person with a name and an age as JSON.",
               {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                 "age": {"type": "integer"}},
                "required": ["name", "age"], "additionalProperties": False}),
    "array": ("List three prime numbers as a JSON array.",
              {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}),
    "enum": ("Pick a primary color. Answer in JSON.",
             {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
              "additionalProperties": False}),
    "nested": ("Give a city with its location as JSON.",
               {"type": "object", "properties": {
                   "city": {"type": "string", "maxLength": 12},
                   "location": {"type": "object", "properties": {
                       "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                       "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
                                "required": ["lat", "lon"], "additionalProperties": False}},
                "required": ["city", "location"], "additionalProperties": False}),
    "bounded numbers": ("Rate a movie from 1 to 5 and give a price as JSON.",
                        {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                                          "price": {"type": "number", "exclusiveMinimum": 0,
                                                                    "maximum": 100}},
                         "required": ["stars", "price"], "additionalProperties": False}),
    "patterned string": ("Give a product code like AB-123 as JSON.",
                         {"type": "object", "properties": {"code": {"type": "string",
                                                                    "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
                          "required": ["code"], "additionalProperties": False}),
}


def test_smollm2_outputs_parse_and_validate_under_six_schemas(smollm2):
    questions = [chat(q) for q, _ in SCHEMAS.values()]
    outs = smollm2.chat(questions, [constrained(32, json=schema) for _, schema in SCHEMAS.values()])
    for name, (_, schema), out in zip(SCHEMAS, SCHEMAS.values(), outs):
        completion = out.outputs[0]
        assert out.error is None and completion.finish_reason == "stop", (name, completion)
        jsonschema.validate(json.loads(completion.text), schema)  # parses and validates
    # The same schema with free whitespace: still valid, whatever whitespace the model chose.
    _, schema = SCHEMAS["enum"]
    out = smollm2.chat([chat("Pick a primary color. Answer in JSON.")],
                       constrained(24, json=schema, disable_any_whitespace=False))[0].outputs[0]
    jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_stop_strings_logprobs_and_length(smollm2):
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    params = [constrained(16, regex=date), constrained(8, choice=["yes", "no", "maybe"]),
              constrained(8, choice=["hello world"], stop=["world"]),
              constrained(3, json=SCHEMAS["nested"][1]),  # cannot finish in 3 tokens
              constrained(8, choice=["yes", "no"], logprobs=20),
              constrained(8, grammar='start: "The answer is " ANSWER\nANSWER: "yes" | "no"'),
              constrained(24, json_object=True, disable_any_whitespace=True)]
    questions = ["When did the Apollo 11 landing happen? Give the date.", "Is water wet?", "Say hello.",
                 "Give a city with its location as JSON.", "Is the sky green?", "Is fire hot?",
                 "Give your name and age as a JSON object."]
    outs = [o.outputs[0] for o in smollm2.chat([chat(q) for q in questions], params)]
    assert re.fullmatch(date, outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[1].text in ("yes", "no", "maybe") and outs[1].finish_reason == "stop"
    assert (outs[2].text, outs[2].finish_reason, outs[2].stop_reason) == ("hello ", "stop", "world")
    assert outs[3].finish_reason == "length" and len(outs[3].token_ids) == 3
    assert outs[3].text.startswith('{"city"')  # the text so far, cut short
    with pytest.raises(json.JSONDecodeError):
        json.loads(outs[3].text)
    # Logprobs are of the constrained distribution: the first token's alternatives are only allowed prefixes of
    # "yes" / "no", and their probabilities sum to one.
    assert outs[4].text in ("yes", "no")
    first = outs[4].logprobs[0]
    finite = {t: lp.logprob for t, lp in first.items() if np.isfinite(lp.logprob)}
    pieces = [smollm2.tokenizer.decode([t]) for t in finite]
    assert all("yes".startswith(p) or "no".startswith(p) for p in pieces), pieces
    assert sum(np.exp(list(finite.values()))) == pytest.approx(1.0, abs=1e-4)
    assert outs[5].text in ("The answer is yes", "The answer is no") and outs[5].finish_reason == "stop"
    assert isinstance(json.loads(outs[6].text), dict) and outs[6].finish_reason == "stop", outs[6]


def test_mixed_batch_equals_each_alone_seeds_reproduce_and_preemption_recomputes(smollm2):
    questions = [chat("Pick a primary color. Answer in JSON."), chat("Tell me a fun fact."),
                 chat("Is water wet?"), chat("Name a fruit.")]
    params = [constrained(12, json=SCHEMAS["enum"][1]), SamplingParams(temperature=0.0, max_tokens=12),
              constrained(12, choice=["yes", "no"], temperature=0.9, seed=5, n=2),
              SamplingParams(temperature=0.9, seed=3, max_tokens=12)]
    mixed = smollm2.chat(questions, params)
    alone = [smollm2.chat([q], p)[0] for q, p in zip(questions, params)]
    for m, a in zip(mixed, alone):
        assert [c.token_ids for c in m.outputs] == [c.token_ids for c in a.outputs]
    # The seeded rows (a constrained n=2 and a free one) reproduced their samples in another batch just above.
    assert all(c.text in ("yes", "no") for c in mixed[2].outputs)

    # Preempted after three tokens, recomputed, and finished: the same tokens (the matcher kept its state).
    engine = smollm2.engine
    engine.add_request("preempted", smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(questions[0])),
                       params[0])
    seq = engine.requests["preempted"].seqs[0]
    while seq.num_output_tokens < 3:
        engine.step()
    engine.scheduler.preempt(seq)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_preemptions >= 1
    assert seq.output_token_ids == mixed[0].outputs[0].token_ids
    engine.pop_finished("preempted")


def test_no_decode_compiles_after_structured_warmup_and_chunked_prefill(smollm2):
    """A small engine over the session's runner: warm-up with the mask variants, then constrained and free requests
    of several kinds compile no decode step; its 32-token budget prefills the prompts in chunks, and the constrained
    outputs equal the session engine's."""
    scheduler = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)
    # No prefix cache: every prompt (34-39 tokens, the system prompt included) is prefilled in two chunks.
    engine = Engine(smollm2.runner, smollm2.tokenizer, scheduler, cache_config=CacheConfig(enable_prefix_caching=False))
    questions = [chat("Is water wet?"), chat("Pick a primary color. Answer in JSON."), chat("Tell me a fun fact.")]
    params = [constrained(6, choice=["yes", "no"]), constrained(10, json=SCHEMAS["enum"][1]),
              SamplingParams(temperature=0.8, top_k=20, seed=1, max_tokens=6)]
    want = smollm2.chat(questions[:2], params[:2])
    with engine_swapped(smollm2, engine):
        engine.warmup(prefill=False)  # what it compiles depends on what earlier tests compiled
        compiled = smollm2.runner.num_compilations()["decode"]
        got = smollm2.chat(questions, params)
        assert smollm2.runner.num_compilations()["decode"] == compiled
    assert [o.outputs[0].token_ids for o in got[:2]] == [o.outputs[0].token_ids for o in want]
    assert all(len(o.prompt_token_ids) > scheduler.max_num_batched_tokens for o in got)
    assert engine.stats.summary()["prefill_steps"] > len(questions)  # the prompts came in chunks


def test_request_errors_fail_that_request_only(smollm2):
    outs = smollm2.generate(["Say hi.", "Say hi."], [constrained(4, grammar="start: <[60000]>"),
                                                      SamplingParams(temperature=0.0, max_tokens=2)])
    assert outs[0].outputs[0].finish_reason == "error" and "does not compile" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 2
    scheduler = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)
    spec = Engine(smollm2.runner, smollm2.tokenizer, scheduler, proposer=PromptLookupProposer(NgramProposer(k=2)))
    with pytest.raises(ValueError, match="structured outputs are not supported with speculative decoding yet"):
        spec.add_request("r", [1, 2, 3], constrained(4, regex="[a-z]+"))
    no_tokenizer = Engine(smollm2.runner, None, scheduler)
    with pytest.raises(ValueError, match="structured outputs need the model's tokenizer"):
        no_tokenizer.add_request("r", [1, 2, 3], constrained(4, regex="[a-z]+"))


def test_matcher_follows_the_sequence_tokens_forward_and_back(smollm2):
    """`sync` replays tokens the matcher has not seen and rolls back ones the sequence dropped; the mask then is the
    mask of the sequence's real state."""
    import dataclasses

    from inference.structured.manager import StructuredOutputManager

    @dataclasses.dataclass
    class Seq:  # the two fields of engine.sequence.Sequence that the manager reads
        seq_id: int
        output_token_ids: list[int]

    tok = smollm2.tokenizer
    manager = StructuredOutputManager(tok, smollm2.config.vocab_size, [tok.eos_token_id])
    choice = StructuredOutputsParams(choice=["red apple", "green pear"])
    manager.add([0], manager.compile(choice))
    seq = Seq(0, tok.encode("red apple", add_special_tokens=False))
    assert manager.sync(seq)  # replayed from nothing: complete
    seq.output_token_ids = seq.output_token_ids[:1]  # dropped back to "red"
    assert not manager.sync(seq)
    mask = manager.fill([(0, seq)], pad_to=2)
    allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))
    assert tok.encode(" apple", add_special_tokens=False)[0] in allowed
    assert (mask[1] == -1).all()  # the row without a constraint allows everything
    seq.output_token_ids = tok.encode("red pear", add_special_tokens=False)
    with pytest.raises(ValueError, match="the grammar rejected token"):
        manager.sync(seq)
