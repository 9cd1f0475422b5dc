"""Reinforcement-learning helpers that need no engine: the trainer-side teacher-forced logprobs (`logprobs.py:
log_probs`, computed with the sampler functions the engine's step uses, so rollout and trainer logprobs mean the same
quantity in both logprob modes), GRPO's advantages and loss (`grpo.py`), and a trainer's FSDP layout of the
engine's parameters (`weight_sync.py`). docs/rl.md shows how they fit an RL loop."""
