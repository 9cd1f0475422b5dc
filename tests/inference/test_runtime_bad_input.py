"""Bad input to the runtime and RL APIs: a clear error naming the problem, the engine left running and equal to
itself (a good `generate` after the bad call gives the same tokens), no request left behind, no silent NaN. The
random tiny Llama (tests/llm_configs.py) and the GRPO / logprob functions of inference/rl."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inference import SamplingParams, TokensPrompt
from inference.rl.grpo import GRPOConfig, group_advantages, grpo_loss
from inference.rl.logprobs import log_probs, processed_tensors
from inference.tools.jsonl_io import row_seed

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PROMPT = [5, 6, 7]


def _tokens(llm) -> list[int]:
    [out] = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], GREEDY)
    assert out.error is None, out.error
    return list(out.outputs[0].token_ids)


def test_engine_loop_refuses_a_duplicate_id_a_sleeping_model_and_ends_streams_when_closed(tiny_llama):
    before = _tokens(tiny_llama)
    loop = tiny_llama.background()
    try:
        first = loop.submit(PROMPT, GREEDY, request_id="x")
        with pytest.raises(ValueError, match="request id 'x' is already in use"):
            loop.submit([4, 5], GREEDY, request_id="x")
        assert list(first.result().outputs[0].token_ids) == before  # the first request was not orphaned
    finally:
        loop.close()
    tiny_llama.sleep()
    loop = tiny_llama.background()
    try:
        with pytest.raises(RuntimeError, match="the model is asleep .*call wake_up"):
            loop.submit(PROMPT, GREEDY)
        assert not tiny_llama.engine.requests
    finally:
        loop.close()
        tiny_llama.wake_up()
    loop = tiny_llama.background()
    loop.pause()  # nothing steps: the request is still running when the loop closes
    stream = loop.submit(PROMPT, GREEDY.replace(max_tokens=50))
    loop.close()
    with pytest.raises(RuntimeError, match="engine loop was closed while this request ran"):
        stream.result()
    assert not tiny_llama.engine.requests and not tiny_llama.engine.has_unfinished_requests()
    assert _tokens(tiny_llama) == before


def test_a_stream_closed_early_aborts_its_requests(tiny_llama):
    before, free = _tokens(tiny_llama), tiny_llama.engine.block_manager.num_free_pages
    params = GREEDY.replace(max_tokens=100)
    stream = tiny_llama.stream([TokensPrompt(prompt_token_ids=PROMPT), TokensPrompt(prompt_token_ids=[9, 8])],
                               params)
    next(stream)
    stream.close()
    assert not tiny_llama.engine.requests and tiny_llama.engine.block_manager.num_free_pages == free
    assert _tokens(tiny_llama) == before


def test_update_weights_refuses_nan_and_names_the_parameter(tiny_llama):
    before, params = _tokens(tiny_llama), tiny_llama.get_params()
    leaves, treedef = jax.tree.flatten(params)
    bad = jax.tree.unflatten(treedef, [leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan), *leaves[1:]])
    with pytest.raises(ValueError, match=r"update_weights: .* holds NaN or inf; the weights were not swapped"):
        tiny_llama.update_weights(bad)
    wrong = jax.tree.unflatten(treedef, [leaves[0][:1], *leaves[1:]])
    with pytest.raises(ValueError, match=r"update_weights: \['embed'\]\['embedding'\]\.value must be \(512, 64\) "
                                         r"float32, got \(1, 64\) float32"):
        tiny_llama.update_weights(wrong)
    with pytest.raises(ValueError, match=r"a plain dict of the model's arrays .* nnx\.replace_by_pure_dict"):
        tiny_llama.update_weights(params.to_pure_dict())
    with pytest.raises(ValueError, match=r"1 of the model's parameters are missing \(\['embed'\]\['embedding'\]"
                                         r"\.value\)"):
        tiny_llama.update_weights(nnx.State({k: v for k, v in params.items() if k != "embed"}))
    assert _tokens(tiny_llama) == before
    tiny_llama.update_weights(params)  # the same weights back: accepted, the same tokens
    assert _tokens(tiny_llama) == before


def test_grpo_inputs_are_checked_and_a_dropped_token_gives_no_nan():
    with pytest.raises(ValueError, match=r"rewards\[0, 1\] = nan: a reward must be finite"):
        group_advantages(np.array([[1.0, np.nan]]))
    with pytest.raises(ValueError, match="eps must be > 0"):
        group_advantages(np.ones((2, 2)), eps=0.0)
    with pytest.raises(ValueError, match="both at least 1"):
        group_advantages(np.zeros((0, 4)))
    with pytest.raises(ValueError, match="kl_beta must be a finite number"):
        GRPOConfig(kl_beta=math.nan)
    logp = jnp.array([[-1.0, -jnp.inf]])  # the trainer's filters dropped the second token: ratio 0
    ones = jnp.ones((1, 2))
    for beta in (0.0, 0.02):
        loss, metrics = grpo_loss(logp, -ones, -ones, jnp.array([1.0]), ones, GRPOConfig(kl_beta=beta))
        assert np.isfinite(float(loss)) and np.isfinite(float(metrics["kl"]))
    with pytest.raises(ValueError, match=r"advantages \[B\]"):
        grpo_loss(-ones, -ones, -ones, jnp.ones((1, 2)), ones, GRPOConfig())  # per-token advantages


def test_log_probs_checks_token_ids_and_filters(tiny_llama):
    model = (tiny_llama.runner.graphdef, tiny_llama.get_params())
    vocab = tiny_llama.config.vocab_size
    ids = np.array([[5, 6, 7, 8]], np.int32)
    assert np.isfinite(np.asarray(log_probs(model, ids))).all()
    for bad, where in ((np.array([[5, vocab, 7, 8]]), r"token_ids\[0, 1\] = " + str(vocab)),
                       (np.array([[5, 6, -100, 8]]), r"token_ids\[0, 2\] = -100")):
        with pytest.raises(ValueError, match=where + r" is outside the vocabulary"):
            log_probs(model, bad)
    with pytest.raises(ValueError, match="both at least 1"):
        log_probs(model, np.zeros((1, 0), np.int32))
    sampling, use_filters = processed_tensors(SamplingParams(temperature=1.0, top_k=5), ids, [2])
    assert use_filters
    with pytest.raises(ValueError, match="pass the use_filters that processed_tensors returns"):
        log_probs(model, ids, sampling=sampling)
    filtered = np.asarray(log_probs(model, ids, sampling=sampling, use_filters=True))
    assert not np.isnan(filtered).any() and filtered.shape == ids.shape  # -inf where top-k dropped the token


def test_seeds_outside_64_bits_are_refused_and_row_seeds_stay_inside():
    for seed in (1 << 64, -(1 << 63) - 1):
        with pytest.raises(ValueError, match=r"seed must be in \[-2\*\*63, 2\*\*64\)"):
            SamplingParams(seed=seed)
    SamplingParams(seed=(1 << 64) - 1)
    SamplingParams(seed=-(1 << 63))
    assert 0 <= row_seed((1 << 64) - 1, "row") < 1 << 64
