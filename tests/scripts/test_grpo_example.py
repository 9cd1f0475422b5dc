"""scripts/grpo_example.py's mechanics on the tiny random model, two steps: the rollout's shapes and masks, the
importance ratio on the first inner step (the trainer's `log_probs` against the engine's logprobs, same weights),
the KL against the starting weights, and that the update really reaches the next rollout's engine; the same for
LoRA-only training (--lora_rank: the adapter moves, the base weights do not)."""

from __future__ import annotations

import jax
import numpy as np

from inference import LoRARequest, SamplingParams
from scripts.grpo_example import CharCodec, make_problems, reward, rollout, run


def test_problems_are_deterministic_and_rewards_check_the_sum():
    assert make_problems(3, seed=7) == make_problems(3, seed=7) != make_problems(3, seed=8)
    p = make_problems(1, seed=7)[0]
    assert p.prompt.endswith("=") and reward(f" {p.answer}\n", p.answer) == 1.0 + 0.1 * 2 / 3
    assert reward("x", p.answer) == 0.0 and reward(str(p.answer + 1), p.answer) < 1


def test_two_grpo_steps_on_the_tiny_model(tiny_llama):
    llm = tiny_llama
    codec = CharCodec(llm.config.vocab_size)
    probe = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True)
    prompt = codec.encode(make_problems(1, seed=99)[0].prompt)

    def probe_logprobs():
        c = llm.generate(prompt_token_ids=[prompt], sampling_params=probe)[0].outputs[0]
        return [float(getattr(e[t], "logprob", e[t])) for e, t in zip(c.logprobs, c.token_ids)]

    old = llm.get_params()
    before = probe_logprobs()
    try:
        ro = rollout(llm, codec, make_problems(2, seed=1), SamplingParams(n=3, max_tokens=4, logprobs=0,
                                                                          ignore_eos=True, seed=5), pad_to=32)
        assert ro.token_ids.shape == (6, 32) and ro.rewards.shape == (2, 3)
        assert (ro.mask.sum(axis=1) == 4).all() and (ro.rollout_logp[ro.mask] < 0).all()
        assert not ro.rollout_logp[~ro.mask].any()
        records = run(llm, steps=2, problems_per_step=2, group=4, max_tokens=4, inner_steps=2, learning_rate=1e-3,
                      temperature=1.0, seed=0)
        after = probe_logprobs()
    finally:
        llm.update_weights(old)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:  # first inner step: trainer and engine saw the same weights
        assert r["ratio_max_dev"] < 1e-5 and r["completion_tokens"] == 2 * 4 * 4
        assert np.isfinite(r["loss"]) and 0 <= r["reward"] <= 1.1
    assert records[0]["kl"] < 1e-6 < records[1]["kl"]  # step 0 starts at the reference, step 1 has moved
    assert np.abs(np.subtract(after, before)).max() > 1e-4  # update_weights changed the engine's policy


def test_lora_only_grpo_moves_the_adapter_and_leaves_the_base_alone(tiny_llama_lora):
    """--lora_rank: rollouts with the adapter's lora_request, gradients in A/B only, update_lora each step: the
    ratio is 1 on the first inner step, nothing recompiles after the first step, the next rollout's policy moves,
    and the base weights stay bitwise as they were."""
    llm = tiny_llama_lora
    codec = CharCodec(llm.config.vocab_size)
    probe = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True)
    prompt = codec.encode(make_problems(1, seed=99)[0].prompt)

    def probe_logprobs(lora_request=None):
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=probe, lora_request=lora_request)[0]
        c = out.outputs[0]
        return [float(getattr(e[t], "logprob", e[t])) for e, t in zip(c.logprobs, c.token_ids)]

    base = jax.tree.map(np.asarray, llm.get_params())
    before = probe_logprobs()
    slot_writes = llm.runner.lora.num_compilations()  # the session fixture may have written other adapters
    records = run(llm, steps=3, problems_per_step=2, group=4, max_tokens=4, inner_steps=2, learning_rate=1e-2,
                  temperature=1.0, seed=0, lora_rank=4, lora_alpha=8.0)
    after = probe_logprobs(LoRARequest("grpo", 1, ""))  # registered by run(): the path is not read again
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["ratio_max_dev"] < 1e-5 and r["completion_tokens"] == 2 * 4 * 4  # the full-weight path's bound
        assert np.isfinite(r["loss"]) and r["sync_s"] > 0
    assert records[0]["kl"] == 0 < records[1]["kl"]  # a fresh adapter (B = 0) is exactly the base model
    assert len({r["compilations"] for r in records}) == 1  # all compiled in step 0: no recompile across steps
    assert llm.runner.lora.num_compilations() - slot_writes <= 1  # at most this adapter's one slot-write variant
    assert np.abs(np.subtract(after, before)).max() > 1e-4  # update_lora changed the adapter's policy
    for old, new in zip(jax.tree.leaves(base), jax.tree.leaves(llm.get_params())):
        np.testing.assert_array_equal(old, np.asarray(new))  # the base weights were never written
    assert probe_logprobs() == before  # the base model (no lora_request) is unchanged
