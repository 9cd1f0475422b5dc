"""SmolLM2-135M-Instruct end to end against transformers' float32 outputs (tests/fixtures, made by
scripts/fixtures/make_reference_fixtures.py): same logits, same teacher-forced logprobs, same greedy continuations."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from inference import LLM, SamplingParams
from tests.llm_configs import merged_model
from tests.reference_fixtures import load_reference

REFERENCE = load_reference()
PROMPTS = REFERENCE["prompts"]


def test_cache_free_forward_logits_match_transformers(smollm2):
    model = merged_model(smollm2)
    for p in PROMPTS[:3]:
        ids = np.concatenate([p["prompt_ids"], p["greedy_ids"]])
        logits = np.asarray(model.forward(jnp.asarray(ids[None])))[0]
        n = len(p["prompt_ids"])
        assert np.abs(logits[n - 1] - p["last_prompt_logits"]).max() <= 1e-3
        assert np.abs(logits[-1] - p["final_logits"]).max() <= 1e-3


def test_paged_teacher_forced_logprobs_match_transformers(smollm2):
    """Prompt + reference continuation through the paged engine (chunked prefill): every next-token logprob."""
    seqs = [np.concatenate([p["prompt_ids"], p["greedy_ids"]]).tolist() for p in PROMPTS]
    outs = smollm2.generate(prompt_token_ids=seqs, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0))
    for p, ids, out in zip(PROMPTS, seqs, outs):
        got = np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
        assert np.abs(got - p["target_logprobs"]).max() <= 1e-3, p["prompt"]


def test_greedy_continuations_identical_to_transformers_in_one_mixed_batch(smollm2):
    """All six prompts (5 to 158 tokens) in one call: each 32-token greedy continuation equals transformers'."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, skip_special_tokens=False)
    outs = smollm2.generate(prompt_token_ids=[p["prompt_ids"].tolist() for p in PROMPTS], sampling_params=params)
    for p, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == p["greedy_ids"].tolist(), p["prompt"]
        assert out.outputs[0].text == p["greedy_text"]


def test_chat_answers_paris(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # the model ends its answer with <|im_end|>
    assert out.prompt_token_ids == PROMPTS[0]["prompt_ids"].tolist()


def test_stop_string_truncates_text(smollm2):
    out = smollm2.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=24, stop=[" 7"]))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == " 7"
    assert out.outputs[0].text.strip().startswith("5, 6") and " 7" not in out.outputs[0].text


def test_prompt_longer_than_context_fails_alone(smollm2):
    too_long = "word " * (smollm2.engine.max_model_len + 10)
    outs = smollm2.generate([too_long, "Hello"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert outs[0].error is not None and "context" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 2


def test_invalid_sampling_params_raise_at_construction():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)


def test_truncated_gguf_is_a_clear_error(tmp_path):
    from tests.reference_fixtures import gguf_path

    broken = tmp_path / "broken.gguf"
    with open(gguf_path(), "rb") as f:
        broken.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match="truncated|not a GGUF"):
        LLM(str(broken), compilation_cache_dir=None)
