"""`EngineLoop.pause` / `resume` with requests in flight: no step runs while paused, a weight update in the pause
reaches the rest of every request (with `recompute=True` exactly as if the new weights had computed their whole
KV), tokens generated before the pause are kept, and every request ends."""

from __future__ import annotations

import jax
import numpy as np

from inference import SamplingParams

PROMPTS = [[5, 17, 300, 42, 9, 11], [7, 8, 9, 10], [100, 200, 300]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def scaled(params, factor: float):
    """Every weight scaled: another model of the same shapes."""
    return jax.tree.map(lambda x: x * factor, params)


def num_steps(llm) -> int:
    return llm.engine.stats.prefill_steps + llm.engine.stats.decode_steps


def paused_mid_flight(llm):
    """A background loop paused after the first request produced a token; (loop, streams, tokens so far)."""
    loop = llm.background()
    streams = [loop.submit(p, GREEDY) for p in PROMPTS]
    next(iter(streams[0]))  # some tokens exist
    loop.pause()
    steps = num_steps(llm)
    so_far = {s.request_id: list(llm.engine.requests[s.request_id].seqs[0].output_token_ids) for s in streams}
    assert any(0 < len(t) < GREEDY.max_tokens for t in so_far.values())
    return loop, streams, so_far, steps


def test_pause_update_weights_resume_with_recompute(tiny_llama):
    llm = tiny_llama
    old = llm.get_params()
    new = scaled(old, 1.5)
    loop, streams, so_far, steps = paused_mid_flight(llm)
    try:
        assert loop.paused and num_steps(llm) == steps  # nothing stepped since pause() returned
        llm.update_weights(new)
        loop.resume(recompute=True)
        outs = [s.result() for s in streams]
    finally:
        loop.close()
        llm.update_weights(old)
    # The reference: each request's kept tokens, then the new weights' greedy continuation from scratch.
    llm.update_weights(new)
    try:
        for s, out in zip(streams, outs):
            tokens = out.outputs[0].token_ids
            kept = so_far[s.request_id]
            assert len(tokens) == GREEDY.max_tokens and tokens[:len(kept)] == kept
            prompt = out.prompt_token_ids + kept
            rest = GREEDY.replace(max_tokens=GREEDY.max_tokens - len(kept))
            want = llm.generate(prompt_token_ids=[prompt], sampling_params=rest)[0].outputs[0].token_ids
            assert tokens[len(kept):] == want
    finally:
        llm.update_weights(old)
    plain = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert any(p.outputs[0].token_ids != o.outputs[0].token_ids for p, o in zip(plain, outs))  # the update mattered


def test_resume_without_recompute_and_abort_while_paused_end_every_request(tiny_llama):
    llm = tiny_llama
    loop, streams, so_far, _ = paused_mid_flight(llm)
    try:
        unfinished = [s for s in streams if len(so_far[s.request_id]) < GREEDY.max_tokens]
        loop.abort(unfinished[-1].request_id)
        aborted = unfinished[-1].result()  # published while still paused
        assert aborted.outputs[0].finish_reason == "abort"
        extra = loop.submit([1, 2, 3], GREEDY.replace(max_tokens=5))  # queued while paused
        loop.resume()
        outs = [s.result() for s in streams if s is not unfinished[-1]] + [extra.result()]
    finally:
        loop.close()
    assert all(o.finished for o in outs)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths[-1] == 5 and all(n == GREEDY.max_tokens for n in lengths[:-1])
    assert np.all([o.outputs[0].token_ids[:len(so_far.get(o.request_id, []))] == so_far.get(o.request_id, [])
                   for o in outs])
