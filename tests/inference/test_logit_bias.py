"""logit_bias, allowed_token_ids, bad_words, min_tokens (inference/sampling/logit_bias.py) and the vocabulary rank:
worked examples of vLLM V1's semantics on small logits, then through the engine on the tiny random Llama."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inference import SamplingParams
from inference.sampling.logit_bias import (LogitBiasTensors, bad_words_token_ids, banned_by_bad_words, row_edits)
from inference.sampling.sampler import SamplingTensors, process_logits, sample_with_logprobs, token_rank
from inference.sampling.token_mask import allowed_row, restrict_rows

_process = jax.jit(lambda x, t: process_logits(x, t, use_filters=False))


def tensors(params: list[SamplingParams], outputs: list[list[int]], bad_words=None, stop_ids=(),
            prompts=None) -> SamplingTensors:
    bad_words = bad_words or [[] for _ in params]
    edits = [row_edits(p, o, b, set(p.stop_token_ids) | set(stop_ids)) if p.uses_logit_rules else []
             for p, o, b in zip(params, outputs, bad_words)]
    bias = LogitBiasTensors.from_rows(edits, pad_to=len(params))
    vocab = 16  # the worked examples' logits are narrower; bits past them are ignored
    mask, in_raw = restrict_rows(None, [(i, allowed_row(p.allowed_token_ids, vocab), False)
                                        for i, p in enumerate(params) if p.allowed_token_ids is not None],
                                 len(params), vocab)
    pen = any(p.uses_penalties for p in params)
    return SamplingTensors.from_params(params, [0] * len(params), [len(o) for o in outputs], pad_to=len(params),
                                       prompt_token_ids=prompts if pen else None,
                                       output_token_ids=outputs if pen else None, logit_bias=bias, token_mask=mask,
                                       mask_in_raw=in_raw)


def test_bias_is_clamped_to_100_and_added_to_the_raw_logits():
    logits = np.array([[1.0, 2.0, 0.0, -1.0]], np.float32)
    p = SamplingParams(temperature=0, logit_bias={"2": 2.5, 3: 500.0})  # digit-string keys, as OpenAI sends them
    assert dict(p.logit_bias) == {2: 2.5, 3: 100.0}
    got = np.asarray(_process(jnp.asarray(logits), tensors([p], [[]])))
    np.testing.assert_allclose(got[0], [1.0, 2.0, 2.5, 99.0])


def test_params_with_a_bias_stay_frozen_hashable_and_picklable():
    import pickle

    p = SamplingParams(logit_bias={1: 2.0}, allowed_token_ids=[1, 2], bad_words="x")
    assert hash(p) == hash(p.replace()) and pickle.loads(pickle.dumps(p)) == p
    assert p.allowed_token_ids == (1, 2) and p.bad_words == ("x",)
    with pytest.raises(TypeError, match="read-only"):
        p.logit_bias[3] = 1.0


def test_allowed_list_keeps_only_its_tokens_and_a_bias_cannot_revive_a_disallowed_one():
    logits = np.array([[1.0, 2.0, 0.5, 4.0], [1.0, 2.0, 0.5, 4.0]], np.float32)
    rows = [SamplingParams(temperature=0, allowed_token_ids=[0, 2], logit_bias={3: 10.0, 2: 1.0}),
            SamplingParams(temperature=0)]  # a row without edits in the same batch: untouched
    got = np.asarray(_process(jnp.asarray(logits), tensors(rows, [[], []])))
    np.testing.assert_allclose(got[0], [1.0, -np.inf, 1.5, -np.inf])
    np.testing.assert_array_equal(got[1], logits[1])


def test_an_allowed_row_sets_exactly_its_bits():
    """`allowed_row` packs a list the way the sampler unpacks the mask (bit t % 32 of word t // 32), and ANDs into
    a grammar's row: both restrictions hold."""
    from inference.sampling.token_mask import allowed_tokens

    ids = [0, 31, 32, 63, 70]
    row = allowed_row(ids, vocab_size=71)
    assert row.dtype == np.int32 and row.shape == (3,)
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(allowed_tokens(row[None], 71))[0]), ids)
    grammar = np.zeros((2, 3), np.int32)
    grammar[0, 1] = -1  # the grammar allows tokens 32..63
    got, in_raw = restrict_rows(grammar, [(0, row, True)], 2, 71)
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(allowed_tokens(got, 71))[0]), [32, 63])
    assert in_raw.tolist() == [True, True]  # a grammar row: its raw logprobs see the whole mask
    assert restrict_rows(None, [(1, row, False)], 2, 71)[1].tolist() == [True, False]
    assert restrict_rows(None, [], 2, 71) == (None, None)


def test_bias_comes_before_the_repetition_penalty():
    """vLLM V1: logit processors (logit_bias) run before the penalties: (2 + 2) / 2 = 2, not 2 / 2 + 2 = 3."""
    logits = np.array([[2.0, 0.0, -5.0]], np.float32)
    p = SamplingParams(temperature=0, logit_bias={0: 2.0}, repetition_penalty=2.0)
    got = np.asarray(_process(jnp.asarray(logits), tensors([p], [[0]], prompts=[[1]])))
    np.testing.assert_allclose(got[0], [2.0, 0.0, -5.0])


def test_min_tokens_bans_the_stop_ids_until_reached():
    p = SamplingParams(min_tokens=2, stop_token_ids=[5])
    assert row_edits(p, [7], [], {5, 0}) == [(0, -np.inf), (5, -np.inf)]
    assert row_edits(p, [7, 8], [], {5, 0}) == []


def test_bad_words_ban_the_last_token_after_a_matching_prefix():
    """vLLM's apply_bad_words: a one-token word is always banned; a longer one only when the output ends with the
    rest of it (the prompt does not count)."""
    words = [[9], [1, 2, 3]]
    assert banned_by_bad_words(words, []) == [9]
    assert banned_by_bad_words(words, [4, 1, 2]) == [9, 3]
    assert banned_by_bad_words(words, [1, 2, 4]) == [9]
    logits = np.zeros((1, 10), np.float32)
    p = SamplingParams(temperature=0, bad_words=["x"])
    got = np.asarray(_process(jnp.asarray(logits), tensors([p], [[1, 2]], bad_words=[words])))
    assert np.isneginf(got[0, [3, 9]]).all() and np.isfinite(np.delete(got[0], [3, 9])).all()


def test_bad_words_are_tokenized_with_and_without_a_leading_space():
    class Tok:  # a word-level tokenizer: "a b" -> [1, 2], " a b" -> [11, 2]; "c" and " c" -> [3]
        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            ids = {"a": 1, "b": 2, "c": 3}
            out = [ids[w] for w in text.split()]
            return [out[0] + 10 if text.startswith(" ") and text.split()[0] == "a" else out[0]] + out[1:]

    # " c" tokenizes like "c": vLLM keeps the spaced variant only when its first token differs.
    assert bad_words_token_ids(["a b", " c"], Tok()) == [[1, 2], [11, 2], [3]]


def test_rows_without_edits_build_no_tensors():
    """The static flag: nothing to apply (min_tokens already reached) leaves `logit_bias` None, so the batch runs
    the sampler exactly as before these parameters existed."""
    p = SamplingParams(min_tokens=1)
    assert p.uses_logit_rules
    assert LogitBiasTensors.from_rows([row_edits(p, [3], [], {0})], pad_to=4) is None


def test_processed_logprobs_include_the_edits_raw_ones_do_not():
    logits = np.array([[3.0, 1.0, 0.0]], np.float32)
    for mode, want in (("raw", jax.nn.log_softmax(logits[0])), ("processed", [-np.inf, 0.0, -np.inf])):
        p = SamplingParams(temperature=0, allowed_token_ids=[1], logprobs=3, logprobs_mode=mode)
        out = sample_with_logprobs(jnp.asarray(logits), tensors([p], [[]]), use_filters=False, num_top=3)
        assert int(out.tokens[0]) == 1
        np.testing.assert_allclose(np.sort(np.asarray(out.top_logprobs[0]))[::-1], np.sort(want)[::-1], atol=1e-6)
        assert int(out.rank[0]) == (2 if mode == "raw" else 1)


def test_rank_counts_logprobs_at_least_the_tokens_own():
    """vLLM's batched_count_greater_than: (x >= x[token]).sum(), so tied tokens share the larger rank."""
    logits = jnp.asarray([[1.0, 3.0, 3.0, 0.0]] * 3)
    np.testing.assert_array_equal(np.asarray(token_rank(logits, jnp.asarray([2, 0, 3]))), [2, 3, 4])


@pytest.mark.parametrize("kwargs, message", [
    (dict(logit_bias={-1: 1.0}), "logit_bias keys"), (dict(logit_bias={1: float("nan")}), "logit_bias values"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(bad_words=[""]), "bad_words"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens must be <= max_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(detokenize=False, stop="x"), "detokenize"),
])
def test_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_engine_applies_the_edits_and_rejects_out_of_vocabulary_ids(tiny_llama):
    """min_tokens against the greedy run's own first token as a stop id; an allowed list; a +100 bias; truncation;
    an out-of-vocabulary bias id fails its own prompt only."""
    llm, prompt = tiny_llama, [5, 17, 33, 2, 90, 11]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)[0].outputs[0].token_ids[0]
    outs = llm.generate(prompt_token_ids=[prompt] * 5, sampling_params=[
        greedy.replace(stop_token_ids=[first]),
        greedy.replace(stop_token_ids=[first], min_tokens=3),
        greedy.replace(allowed_token_ids=[7, 8]),
        greedy.replace(logit_bias={42: 100.0}, truncate_prompt_tokens=4),
        greedy.replace(logit_bias={llm.config.vocab_size: 1.0})])
    stopped, delayed, allowed, biased, bad = (o.outputs[0] for o in outs)
    assert stopped.token_ids == [first] and stopped.stop_reason == first
    assert first not in delayed.token_ids[:3] and len(delayed.token_ids) >= 3
    assert set(allowed.token_ids) <= {7, 8} and len(allowed.token_ids) == 6
    assert biased.token_ids == [42] * 6 and outs[3].prompt_token_ids == prompt[-4:]
    assert bad.finish_reason == "error" and "outside the vocabulary" in outs[4].error


def test_speculative_engine_verifies_bias_and_allowed_lists_and_refuses_the_rest(tiny_llama):
    """Prompt lookup drafts from a repetitive prompt; the rejection sampler reads the same edited logits, so greedy
    output is token for token the plain engine's. min_tokens / bad_words depend on the position inside a draft:
    refused with a clear error, the other prompts of the call unaffected."""
    from tests.llm_configs import TINY_SPEC

    spec = TINY_SPEC.build(speculative_method="ngram", num_speculative_tokens=3)
    prompt = [7, 8, 9] * 6
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=[7, 8, 9],
                            logit_bias={9: 2.0, 7: 1.0})
    want = tiny_llama.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
    got, refused = spec.generate(prompt_token_ids=[prompt, prompt],
                                 sampling_params=[params, params.replace(min_tokens=2)])
    assert got.outputs[0].token_ids == want and spec.engine.stats.spec_proposed > 0
    assert "not supported with speculative decoding" in refused.error
