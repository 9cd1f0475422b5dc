"""Reinforcement-learning helpers that need no engine: the trainer-side teacher-forced logprobs (`log_probs`),
computed with the same sampler functions the engine's step uses, so rollout and trainer logprobs mean the same
quantity in both logprob modes."""
