"""`LLM.sleep` / `wake_up`: the KV cache's device buffers (level 1) and the weights (level 2) are really freed, as
`jax.live_arrays()` counts them, come back on wake-up, generation afterwards equals generation before, and
generating while asleep is a clear error."""

from __future__ import annotations

import jax
import pytest

from inference import SamplingParams

PROMPTS = [[5, 17, 300, 42, 9, 11], [7, 8, 9, 10]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)]


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)]


def test_sleep_frees_the_kv_cache_then_the_weights_and_wake_up_restores(tiny_llama):
    llm = tiny_llama
    want = tokens(llm)
    runner = llm.runner
    kv, weights = runner.kv_cache_bytes, sum(x.nbytes for x in runner.param_leaves)
    before = live_bytes()
    llm.sleep(level=1)
    assert llm.is_sleeping and before - live_bytes() == kv
    with pytest.raises(RuntimeError, match="wake_up"):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)
    llm.sleep(level=2)  # deepen: the weights go to host too
    assert before - live_bytes() == kv + weights
    llm.wake_up()
    assert not llm.is_sleeping and live_bytes() == before
    assert tokens(llm) == want


def test_weights_dropped_by_sleep_are_refilled_by_update_weights(tiny_llama):
    llm = tiny_llama
    want = tokens(llm)
    host = jax.device_get(llm.get_params())  # what a trainer would send back (numpy: not live device memory)
    compiles = llm.runner.num_compilations()
    llm.sleep(level=2, keep_weights_on_host=False)
    with pytest.raises(RuntimeError, match="update_weights"):
        llm.wake_up()
    llm.update_weights(host)
    llm.wake_up()
    assert tokens(llm) == want and llm.runner.num_compilations() == compiles


def test_sleep_refuses_in_flight_requests_and_bad_levels(tiny_llama):
    llm = tiny_llama
    with pytest.raises(ValueError, match="sleep level"):
        llm.runner.sleep(level=3)
    llm.engine.add_request("in-flight", PROMPTS[0], PARAMS[0])
    try:
        with pytest.raises(RuntimeError, match="in flight"):
            llm.sleep()
    finally:
        llm.engine.abort("in-flight")
        llm.engine.pop_finished("in-flight")
    assert not llm.is_sleeping
