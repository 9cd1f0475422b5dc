"""Repetition, presence and frequency penalties: vLLM's formula against a numpy reference, the engine's greedy
tokens against the cache-free forward with the same formula, the no-penalty path left as it was, validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inference import SamplingParams
from inference.sampling.sampler import SamplingTensors, process_logits, sample_with_logprobs
from tests.llm_configs import TINY_ENGINE, TINY_SPEC, merged_model


def reference(logits: np.ndarray, prompt: list[int], output: list[int], r: float, p: float, f: float) -> np.ndarray:
    """vLLM's apply_penalties for one row, written out loop by loop."""
    x = logits.astype(np.float32).copy()
    for tok in set(prompt) | set(output):
        x[tok] = x[tok] / np.float32(r) if x[tok] > 0 else x[tok] * np.float32(r)
    for tok in set(output):
        x[tok] -= np.float32(f) * output.count(tok) + np.float32(p)
    return x


def penalised(logits: np.ndarray, params: list[SamplingParams], prompts: list[list[int]],
              outputs: list[list[int]]) -> np.ndarray:
    t = SamplingTensors.from_params(params, [0] * len(params), [len(o) for o in outputs], pad_to=len(params),
                                    prompt_token_ids=prompts, output_token_ids=outputs)
    return np.asarray(jax.jit(lambda x, t: process_logits(x, t, use_filters=False))(jnp.asarray(logits), t))


def test_worked_example():
    """Token 1 positive in the prompt: divided; token 2 negative in the output twice: multiplied, then -2f - p."""
    logits = np.array([[1.0, 2.0, -1.0, 0.5, -0.5]], np.float32)
    got = penalised(logits, [SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.25,
                                            frequency_penalty=0.5)], [[1]], [[2, 2]])
    np.testing.assert_allclose(got[0], [1.0, 1.0, -2.0 - 1.0 - 0.25, 0.5, -0.5])


def test_matches_numpy_reference_per_row():
    rng = np.random.default_rng(0)
    v = 50
    logits = rng.normal(0, 3, (4, v)).astype(np.float32)
    params = [SamplingParams(temperature=0, repetition_penalty=1.7),
              SamplingParams(temperature=0, presence_penalty=-1.5, frequency_penalty=0.7),
              SamplingParams(temperature=0),  # no penalty: this row must come back untouched
              SamplingParams(temperature=0, repetition_penalty=0.5, presence_penalty=2.0, frequency_penalty=-2.0)]
    prompts = [rng.integers(0, v, n).tolist() for n in (5, 20, 3, 17)]
    outputs = [rng.integers(0, v, n).tolist() for n in (0, 30, 4, 9)]
    got = penalised(logits, params, prompts, outputs)
    for i, p in enumerate(params):
        want = reference(logits[i], prompts[i], outputs[i], p.repetition_penalty, p.presence_penalty,
                         p.frequency_penalty)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[2], logits[2])


def test_penalties_come_before_temperature_and_raw_logprobs_exclude_them():
    logits = np.array([[3.0, 1.0, 0.0]], np.float32)
    p = SamplingParams(temperature=0.5, repetition_penalty=3.0, logprobs_mode="processed")
    got = penalised(logits, [p], [[0]], [[]])
    np.testing.assert_allclose(got[0], np.array([1.0, 1.0, 0.0]) / 0.5)
    t = SamplingTensors.from_params([p.replace(logprobs_mode="raw")], [0], [0], 1, [[0]], [[]])
    out = sample_with_logprobs(jnp.asarray(logits), t, use_filters=False, num_top=3)
    np.testing.assert_allclose(np.asarray(out.top_logprobs[0]), np.sort(jax.nn.log_softmax(logits[0]))[::-1],
                               rtol=1e-6)


def test_no_penalty_leaves_the_sampling_tensors_as_before():
    """Defaults (and explicit no-op values) build no penalty tensors: the step's pytree, so its compiled program, is
    the one without penalties."""
    for p in (SamplingParams(), SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)):
        assert not p.uses_penalties
        assert SamplingTensors.from_params([p], [0], [0], pad_to=2).penalties is None
    with pytest.raises(ValueError, match="prompt_token_ids"):
        SamplingTensors.from_params([SamplingParams(presence_penalty=1.0)], [0], [0], pad_to=1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(repetition_penalty="2"), "repetition_penalty"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(frequency_penalty=3), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=True), "frequency_penalty"),
])
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_range_ends_are_accepted():
    p = SamplingParams(repetition_penalty=1e-3, presence_penalty=-2, frequency_penalty=2)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1e-3, -2.0, 2.0)


@pytest.fixture(scope="module")
def llm():
    return TINY_ENGINE.build()


def test_strong_repetition_penalty_never_repeats(llm):
    prompt = list(range(10, 30))
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=plain.replace(repetition_penalty=1e4))
    tokens = out[0].outputs[0].token_ids
    assert len(tokens) == 24 and len(set(tokens)) == 24 and not set(tokens) & set(prompt)
    base = llm.generate(prompt_token_ids=[prompt], sampling_params=plain)[0].outputs[0].token_ids
    assert len(set(base)) < len(base)  # the random model repeats itself without the penalty: the test has teeth


@pytest.mark.parametrize("prompt", [[5, 9, 5, 77, 3, 9, 120, 8], np.random.default_rng(3).integers(1, 60, 90).tolist()],
                         ids=["short", "chunked-prefill"])
def test_greedy_tokens_follow_the_cache_free_forward_with_penalties(llm, prompt):
    """Every generated token is the argmax of the dense forward's logits after the reference penalties (the long
    prompt is prefilled over two steps of at most 64 tokens and pads its token ids past one bucket)."""
    p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3,
                       presence_penalty=0.4, frequency_penalty=0.6)
    tokens = llm.generate(prompt_token_ids=[prompt], sampling_params=p)[0].outputs[0].token_ids
    logits = np.asarray(merged_model(llm).forward(jnp.asarray([prompt + tokens]))[0], np.float32)
    for j, tok in enumerate(tokens):
        x = reference(logits[len(prompt) - 1 + j], prompt, tokens[:j], 1.3, 0.4, 0.6)
        assert tok == int(np.argmax(x)), j


def test_seeded_sampling_with_penalties_and_filters_is_reproducible(llm):
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, max_tokens=10, ignore_eos=True,
                       presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.1)
    first, again = (llm.generate(prompt_token_ids=[[3, 1, 4, 1, 5]], sampling_params=p)[0].outputs[0].token_ids
                    for _ in range(2))
    assert first == again and len(first) == 10


def test_plain_rows_are_unchanged_next_to_a_penalised_row(llm):
    prompts = [[4, 8, 15, 16, 23, 42], [7, 7, 7, 1]]
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=plain)]
    mixed = llm.generate(prompt_token_ids=prompts, sampling_params=[plain, plain.replace(frequency_penalty=2.0)])
    assert mixed[0].outputs[0].token_ids == alone[0]


def test_speculative_decoding_rejects_penalties():
    spec = TINY_SPEC.build(speculative_method="ngram", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="penalties are not supported with speculative decoding yet"):
        spec.engine.add_request("r", [1, 2, 3], SamplingParams(repetition_penalty=1.2))
    # LLM.generate reports it as that prompt's error, as for any rejected prompt.
    out = spec.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(presence_penalty=0.5))[0]
    assert "penalties are not supported with speculative decoding yet" in out.error
    assert out.outputs[0].finish_reason == "error"
