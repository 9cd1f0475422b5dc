"""lm-evaluation-harness as a real client: its `local-completions` model against the server on SmolLM2, offline,
on a small local task (tests/fixtures/lm_eval/: multiple-choice items scored by loglikelihood, and greedy
generate_until items). lm-eval tokenizes through the server's /tokenize (its "remote" tokenizer backend), so it
needs neither transformers nor a download. Its per-item loglikelihoods, answers and scores must equal the ones
computed here from the engine directly (prompt logprobs, `LLM.generate`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inference import SamplingParams
from inference.entrypoints.openai.logprobs import logprob_value
from inference.entrypoints.openai.server import ServerThread

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra")
pytest.importorskip("tenacity", reason="lm-eval's API models need tenacity (lm-eval[api])")

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair` for a causal model: trailing spaces move to the continuation, the pair is encoded
    whole and split at the context's length."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


@pytest.fixture(scope="module")
def results(smollm2, monkeypatch_module):
    monkeypatch_module.chdir(REPO)  # the task files name their data relative to the repository root
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    with ServerThread(smollm2) as url:
        return lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": MODEL, "base_url": f"{url}/v1/completions", "tokenizer_backend": "remote",
                        "num_concurrent": 4, "max_retries": 1},
            tasks=["pagejax_mc", "pagejax_gen"], task_manager=TaskManager(include_path="tests/fixtures/lm_eval"),
            log_samples=True)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_multiple_choice_loglikelihoods_and_accuracy_equal_the_engine(smollm2, results):
    samples = results["samples"]["pagejax_mc"]
    pairs = [encode_pair(smollm2.tokenizer, c, x) for s in samples for c, x in s["arguments"]]
    outs = smollm2.generate(prompt_token_ids=[ctx + cont for ctx, cont in pairs],
                            sampling_params=SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    expected = iter((sum(logprob_value(e[t]) for t, e in zip(o.prompt_token_ids[len(ctx):],
                                                             o.prompt_logprobs[len(ctx):])),
                     all(max(e, key=lambda k: logprob_value(e[k])) == t
                         for t, e in zip(o.prompt_token_ids[len(ctx):], o.prompt_logprobs[len(ctx):])))
                    for (ctx, _), o in zip(pairs, outs))
    acc, acc_norm = [], []
    for s in samples:
        mine = [next(expected) for _ in s["arguments"]]
        served = [r[0] for r in s["resps"]]
        assert [ll for ll, _ in served] == pytest.approx([ll for ll, _ in mine], abs=1e-4)
        assert [g for _, g in served] == [g for _, g in mine]
        lls = np.array([ll for ll, _ in mine])
        lengths = np.array([len(x) for _, x in s["arguments"]], float)
        acc.append(float(np.argmax(lls) == s["target"]))
        acc_norm.append(float(np.argmax(lls / lengths) == s["target"]))
    scores = results["results"]["pagejax_mc"]
    assert len(samples) == 6
    assert scores["acc,none"] == pytest.approx(np.mean(acc))
    assert scores["acc_norm,none"] == pytest.approx(np.mean(acc_norm))


def test_generate_until_answers_and_exact_match_equal_the_engine(smollm2, results):
    samples = results["samples"]["pagejax_gen"]
    contexts = [s["arguments"][0][0] for s in samples]
    until = samples[0]["arguments"][0][1]["until"]
    eos = smollm2.tokenizer.eos_token
    outs = smollm2.generate(contexts, SamplingParams(temperature=0, max_tokens=8, stop=until + [eos]))
    texts = [o.outputs[0].text for o in outs]
    assert [s["resps"][0][0] for s in samples] == texts
    targets = [s["target"] for s in samples]
    assert results["results"]["pagejax_gen"]["exact_match,none"] == pytest.approx(
        np.mean([t == x for t, x in zip(targets, texts)]))
