"""`inference/rl/logprobs.py: log_probs` against the engine: the trainer's teacher-forced logprobs of the tokens a
rollout sampled equal the logprobs the engine returned for them, in both logprob modes, greedy and sampled, and they
are differentiable in the parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inference import SamplingParams
from inference.rl.logprobs import log_probs, processed_tensors

PROMPTS = [[5, 17, 300, 42, 9, 11], [7, 8, 9, 10, 100, 200, 3, 4, 5]]
# The tiny model is random, so its distributions are nearly flat: filters at these values keep a real subset.
PROCESSED = dict(logprobs_mode="processed", temperature=0.7, top_k=40, top_p=0.9, min_p=0.02,
                 repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
# float32: XLA:CPU matmuls round a row by the matmul's row count (measured gap on this model 5e-7), and the engine's
# 2-8-row float32 matmuls run the few-rows C++ kernel where the trainer's sequence-long ones run XLA's dot (1.2e-6
# under an adapter, tests/inference/test_rl_lora.py).
TOL = 2e-6


def token_logprob(entry, token: int) -> float:
    value = entry[token]
    return float(getattr(value, "logprob", value))  # a float, or a vLLM-style Logprob object


def rollout(llm, params: list[SamplingParams], lora_request=None):
    """(right-padded ids [B, L], prompt lengths, completion lengths, engine logprobs [B, L] at completion slots)."""
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, lora_request=lora_request)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)]
    length = max(map(len, seqs))
    ids = np.zeros((len(seqs), length), np.int32)
    engine = np.zeros((len(seqs), length), np.float32)
    for b, (p, o, s) in enumerate(zip(PROMPTS, outs, seqs)):
        ids[b, :len(s)] = s
        c = o.outputs[0]
        engine[b, len(p):len(s)] = [token_logprob(e, t) for e, t in zip(c.logprobs, c.token_ids)]
    return ids, [len(p) for p in PROMPTS], [len(s) for s in seqs], engine


def completion_mask(prompt_lens, lengths, width):
    mask = np.zeros((len(lengths), width), bool)
    for b, (n, total) in enumerate(zip(prompt_lens, lengths)):
        mask[b, n:total] = True
    return mask


@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("greedy", [True, False])
def test_log_probs_equal_the_engines_logprobs(tiny_llama, mode, greedy):
    extra = dict(PROCESSED) if mode == "processed" else {}
    if greedy:
        extra["temperature"] = 0.0
    params = [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0, seed=11 + i, **{"temperature": 1.0, **extra})
              for i in range(len(PROMPTS))]
    ids, prompt_lens, lengths, engine = rollout(tiny_llama, params)
    mask = completion_mask(prompt_lens, lengths, ids.shape[1])
    model = (tiny_llama.runner.graphdef, tiny_llama.get_params())
    sampling, use_filters = (None, False) if mode == "raw" else processed_tensors(params, ids, prompt_lens)
    got = np.asarray(jax.jit(log_probs, static_argnames=("use_filters",))(
        model, ids, sampling=sampling, use_filters=use_filters))
    assert got.shape == ids.shape
    assert np.all(np.isfinite(engine[mask])) and np.all(engine[mask] < 0)
    np.testing.assert_allclose(got[mask], engine[mask], rtol=0, atol=TOL)
    if mode == "processed" and not greedy:  # the mode really is another quantity than the raw logprobs
        raw = np.asarray(log_probs(model, ids))
        assert np.abs(raw[mask] - got[mask]).min() > 1e-3


def test_log_probs_are_differentiable_in_both_modes(tiny_llama):
    graphdef, state = tiny_llama.runner.graphdef, tiny_llama.get_params()
    ids = np.asarray([PROMPTS[1] + [1, 2, 3]], np.int32)
    params = SamplingParams(max_tokens=3, **PROCESSED)
    sampling, use_filters = processed_tensors(params, ids, [len(PROMPTS[1])])
    for kwargs in ({}, dict(sampling=sampling, use_filters=use_filters)):
        grads = jax.grad(lambda p: jnp.sum(log_probs((graphdef, p), ids, **kwargs)[:, -3:]))(state)
        norms = [float(jnp.linalg.norm(g)) for g in jax.tree.leaves(grads)]
        assert all(np.isfinite(norms)) and max(norms) > 0
        embed = nnx.to_pure_dict(grads)["embed"]["embedding"]
        assert float(jnp.abs(embed).sum()) > 0


def test_bad_inputs_are_named():
    ids = np.zeros((2, 5), np.int32)
    with pytest.raises(ValueError, match="prompt length"):
        processed_tensors(SamplingParams(), ids, [0, 3])
    with pytest.raises(ValueError, match="2 sequences"):
        processed_tensors([SamplingParams()], ids, [1, 1])
    with pytest.raises(ValueError, match="Decoder or a"):
        log_probs({"not": "a model"}, ids)
