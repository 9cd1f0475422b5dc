"""The prompt forms of `LLM.generate` (inference/entrypoints/prompts.py): str, TextPrompt, TokensPrompt, lists
mixing them, the older prompt_token_ids keyword, and one clear error per malformed prompt."""

from __future__ import annotations

import numpy as np
import pytest

from inference import SamplingParams, TextPrompt, TokensPrompt
from inference.entrypoints.prompts import ACCEPTED_FORMS, ParsedPrompt, parse_prompts


def test_each_form_parses():
    ids = TokensPrompt(prompt_token_ids=[1, 2])
    assert parse_prompts("hi") == [ParsedPrompt(text="hi")]
    assert parse_prompts(["a", TextPrompt(prompt="b"), ids, {"prompt_token_ids": np.array([3]), "prompt": "c"}]) == [
        ParsedPrompt(text="a"), ParsedPrompt(text="b"), ParsedPrompt(token_ids=[1, 2]),
        ParsedPrompt(text="c", token_ids=[3])]
    assert parse_prompts(None, prompt_token_ids=[[4, 5], np.array([6])]) == [
        ParsedPrompt(token_ids=[4, 5]), ParsedPrompt(token_ids=[6])]


def test_malformed_prompts_get_their_own_error():
    parsed = parse_prompts([{"text": "x"}, {}, [1, 2], {"prompt_token_ids": [1, "2"]}, 7, {"prompt": 3}])
    errors = [p.error for p in parsed]
    assert "unsupported keys ['text']" in errors[0] and ACCEPTED_FORMS in errors[0]
    assert "neither \"prompt\" nor \"prompt_token_ids\"" in errors[1]
    assert "list of token ids; wrap it as {\"prompt_token_ids\"" in errors[2]
    assert "only int token ids, got '2'" in errors[3]
    assert "has type int" in errors[4] and '"prompt" must be a str' in errors[5]


@pytest.mark.parametrize("args, message", [((None,), "exactly one of"), (([1, 2, 3],), "list of token ids"),
                                           ((3.5,), "prompts must be")])
def test_a_call_that_is_no_prompt_at_all_raises(args, message):
    with pytest.raises(ValueError, match=message):
        parse_prompts(*args)


def test_generate_mixes_forms_and_a_bad_one_fails_alone(tiny_llama):
    """The random tiny Llama has no tokenizer: a text prompt fails on its own, with the fix in the message, and the
    TokensPrompt, the keyword spelling and an out-of-vocabulary TokensPrompt each get their own result."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = [3, 1, 4, 1, 5]
    dict_out, text_out, bad_vocab = tiny_llama.generate(
        [{"prompt_token_ids": ids}, "text", {"prompt_token_ids": [tiny_llama.config.vocab_size]}], params)
    [keyword_out] = tiny_llama.generate(prompt_token_ids=[ids], sampling_params=params)
    assert dict_out.error is None and dict_out.outputs[0].token_ids == keyword_out.outputs[0].token_ids
    assert len(dict_out.outputs[0].token_ids) == 3
    assert "has no tokenizer" in text_out.error and "prompt_token_ids" in text_out.error
    assert "outside the vocabulary" in bad_vocab.error and bad_vocab.outputs[0].finish_reason == "error"


def test_sampling_params_and_lora_requests_of_the_wrong_type_raise_before_any_prompt_is_queued(tiny_llama):
    """A dict or None where a SamplingParams belongs (or a string where a LoRARequest does) is a TypeError naming
    its position, raised before the first prompt is queued: no request is left behind in the engine."""
    good = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    calls = [
        (dict(sampling_params=[good, {"temperature": 0}]), r"sampling_params\[1\] is a dict"),
        (dict(sampling_params=[good, None]), r"sampling_params\[1\] is a NoneType"),
        (dict(sampling_params={"temperature": 0}), "must be a SamplingParams or a list of them"),
        (dict(sampling_params=good, lora_request=["adapter", None]), r"lora_request\[0\] is a str"),
    ]
    for kwargs, message in calls:
        with pytest.raises(TypeError, match=message):
            tiny_llama.generate([TokensPrompt(prompt_token_ids=[5, 6, 7]), TokensPrompt(prompt_token_ids=[5, 6])],
                                **kwargs)
        assert not tiny_llama.engine.requests and not tiny_llama.engine.has_unfinished_requests()
    [out] = tiny_llama.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], good)
    assert out.error is None and len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("messages, message", [
    (["hi"], "conversation 0 must be a non-empty list"),
    ([[{"content": "hi"}]], "message 0 of conversation 0 must be a dict with a string 'role'"),
    ("hi", "chat\\(\\) takes a conversation"),
    ([], "chat\\(\\) takes a conversation"),
])
def test_chat_names_the_malformed_message(messages, message):
    """`LLM.chat`'s conversations (`_conversations`, read before the chat template renders anything)."""
    from inference.entrypoints.llm import _conversations

    with pytest.raises(TypeError, match=message):
        _conversations(messages)
    one = [{"role": "user", "content": "hi"}]
    assert _conversations(one) == [one] and _conversations([one, one]) == [one, one]


def test_stop_token_ids_outside_the_vocabulary_fail_their_request_alone(tiny_llama):
    """min_tokens masks a request's stop ids: one past the vocabulary would overflow the step's edit arrays, so it
    is refused when the request is added, and the others run."""
    good = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    bad = good.replace(stop_token_ids=[10 ** 9], min_tokens=1)
    bad_out, good_out = tiny_llama.generate([TokensPrompt(prompt_token_ids=[5, 6])] * 2, [bad, good])
    assert "stop_token_ids has token id 1000000000 outside the vocabulary" in bad_out.error
    assert good_out.error is None and len(good_out.outputs[0].token_ids) == 2


def test_float_token_ids_are_refused_not_truncated(tiny_llama):
    """A float id would have run as its integer part (5.7 as token 5): the request fails alone, naming it."""
    loop = tiny_llama.background()
    try:
        with pytest.raises(ValueError, match="token ids must be integers, got 5.7"):
            loop.submit([5.7, 6], SamplingParams(max_tokens=2))
        assert not tiny_llama.engine.requests
    finally:
        loop.close()
    with pytest.raises(ValueError, match="sleep level must be 1 .* or 2 .*, got True"):
        tiny_llama.sleep(True)
