"""GRPO's pieces that are plain functions of arrays: group-normalised advantages and the clipped surrogate loss
with a KL penalty, over the teacher-forced logprobs of `inference/rl/logprobs.py`.

GRPO (DeepSeekMath): sample a group of n completions per prompt (the engine's `SamplingParams(n=...)`, which share
the prompt's KV pages), score each, and use the reward's deviation from its group's mean, divided by the group's
standard deviation, as every token's advantage, so no value model is needed. The loss per completion token is
PPO's clipped surrogate on the importance ratio pi_theta / pi_rollout (rollout logprobs from the engine, in the
same logprobs mode `log_probs` computes), plus beta times the k3 estimate of KL(pi_theta || pi_ref).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def group_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """f32[P, n] rewards of n samples for each of P prompts -> (r - group mean) / (group std + eps). A group whose
    rewards are all equal gets advantage 0 (it carries no signal)."""
    r = np.asarray(rewards, np.float32)
    if r.ndim != 2 or 0 in r.shape:
        raise ValueError(f"rewards must be [prompts, samples per prompt], both at least 1, got shape {r.shape}")
    if not np.isfinite(r).all():
        p, i = np.argwhere(~np.isfinite(r))[0]
        raise ValueError(f"rewards[{p}, {i}] = {r[p, i]}: a reward must be finite (it would make its group's "
                         "advantages NaN, and the weights after the update)")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps equal rewards at advantage 0), got {eps}")
    return (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + eps)


KL_LOG_RATIO_BOUND = 20.0  # |log(pi_ref / pi_theta)| in the k3 KL estimate, clamped (verl's low_var_kl)


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    clip_eps: float = 0.2  # ratio clipped to [1 - eps, 1 + eps]
    kl_beta: float = 0.02  # weight of the KL(pi_theta || pi_ref) penalty

    def __post_init__(self) -> None:
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if not (self.kl_beta >= 0 and math.isfinite(self.kl_beta)):
            raise ValueError(f"kl_beta must be a finite number >= 0, got {self.kl_beta}")


def grpo_loss(logp: jax.Array, rollout_logp: jax.Array, ref_logp: jax.Array, advantages: jax.Array,
              mask: jax.Array, config: GRPOConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Scalar loss (mean over masked completion tokens) and metrics; all inputs [B, L] except advantages [B].

    `logp`: the trainer's logprobs (differentiated); `rollout_logp`: the engine's for the same tokens;
    `ref_logp`: the reference policy's (no gradient). Metrics: the ratio's largest deviation from 1, the mean KL
    estimate, the clipped fraction. The KL's log-ratio is clamped to +-`KL_LOG_RATIO_BOUND` (as verl's low-variance
    KL is): a token the trainer's processed logprobs drop (logp -inf, ratio 0) adds a large finite KL, not NaN.
    """
    shape = jnp.shape(logp)
    if len(shape) != 2 or any(jnp.shape(x) != shape for x in (rollout_logp, ref_logp, mask)) or \
            jnp.shape(advantages) != shape[:1]:
        raise ValueError(f"grpo_loss takes logp, rollout_logp, ref_logp and mask of one shape [B, L] and advantages "
                         f"[B] (one per sequence: group_advantages(...).reshape(-1)); got {shape}, "
                         f"{jnp.shape(rollout_logp)}, {jnp.shape(ref_logp)}, {jnp.shape(mask)} and "
                         f"{jnp.shape(advantages)}")
    mask = mask.astype(jnp.float32)
    count = jnp.maximum(mask.sum(), 1.0)
    ratio = jnp.exp(jnp.where(mask > 0, logp - rollout_logp, 0.0))
    adv = advantages[:, None]
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - config.clip_eps, 1 + config.clip_eps) * adv)
    log_ref_ratio = jnp.clip(jnp.where(mask > 0, jax.lax.stop_gradient(ref_logp) - logp, 0.0),
                             -KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
    kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0  # k3: unbiased, >= 0
    loss = -(surrogate * mask).sum() / count + config.kl_beta * (kl * mask).sum() / count
    metrics = {"ratio_max_dev": jnp.max(jnp.abs(ratio - 1.0) * mask), "kl": (kl * mask).sum() / count,
               "clipped": (((ratio < 1 - config.clip_eps) | (ratio > 1 + config.clip_eps)) * mask).sum() / count}
    return loss, metrics


__all__ = ["GRPOConfig", "group_advantages", "grpo_loss"]
