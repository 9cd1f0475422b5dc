"""The mixture-of-experts feed-forward block of DeepSeek-V2 and Qwen MoE: shared experts plus top-k routed experts.

Routing follows transformers' DeepseekV2TopkRouter exactly: a float32 softmax over the router logits, optionally
limited to the best `topk_group` of `n_group` expert groups (a group scores as its best expert; V2's
device-limited routing), top-k of the remaining scores, weights times `routed_scaling_factor` and not renormalized.
Qwen MoE (Qwen3-Next's Qwen3NextTopKRouter) renormalizes the top-k weights (`norm_topk_prob`) and scales its one
shared expert's output by sigmoid(x @ shared_expert_gate) per token (`shared_expert_gate`).

Dispatch sorts the (token, expert) pairs by expert and runs the experts as grouped matmuls (`jax.lax.ragged_dot`),
MaxText's "sparse" form: on GPU/TPU a grouped GEMM that touches only the chosen experts; XLA CPU lowers it to a
masked dense product, which is the dense dispatch the issue allows.

Under tensor parallelism each expert is split Megatron-style over its width F (sharding/partition.py: gate/up
`[E, D, F]` column parallel, down `[E, F, D]` row parallel) and GSPMD partitions the grouped matmuls along F by
itself: every device runs all experts on 1/TP of their width and one all-reduce sums down_proj's partial outputs;
no sharding constraint is needed here and no expert weight is gathered (tests/sharding/test_sharding.py checks
the compiled step). Routing, the sort and the scatter run replicated. Expert parallelism (the E axis over a mesh
axis) is not done.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import GatedMLP, Linear, activation, normal_init


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        d, e, f = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.router = nnx.Param(normal_init(rngs, (d, e), jnp.float32))  # HF keeps the router in float32
        self.gate_proj = nnx.Param(normal_init(rngs, (e, d, f), dtype))
        self.up_proj = nnx.Param(normal_init(rngs, (e, d, f), dtype))
        self.down_proj = nnx.Param(normal_init(rngs, (e, f, d), dtype))
        self.shared = (GatedMLP(config, intermediate_size=config.shared_expert_width, dtype=dtype, rngs=rngs)
                       if config.shared_expert_width else None)
        self.shared_gate = (Linear(d, 1, dtype=dtype, rngs=rngs) if config.shared_expert_gate else None)
        self.norm_topk_prob = config.norm_topk_prob
        self.num_experts, self.top_k = e, config.num_experts_per_tok
        self.group_limited = config.topk_method == "group_limited_greedy"
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.act = config.hidden_act

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x[T, D] -> (weights f32[T, k], expert ids i32[T, k])."""
        scores = jax.nn.softmax(x.astype(jnp.float32) @ self.router[...], axis=-1)
        if self.group_limited:
            tokens = scores.shape[0]
            grouped = scores.reshape(tokens, self.n_group, -1)
            _, best_groups = jax.lax.top_k(grouped.max(axis=-1), self.topk_group)
            keep = jnp.zeros((tokens, self.n_group), bool).at[jnp.arange(tokens)[:, None], best_groups].set(True)
            scores = jnp.where(keep[:, :, None], grouped, 0.0).reshape(tokens, -1)
        weights, experts = jax.lax.top_k(scores, self.top_k)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights * self.routed_scaling_factor, experts

    def __call__(self, x: jax.Array) -> jax.Array:
        lead, d = x.shape[:-1], x.shape[-1]
        tokens = x.reshape(-1, d)
        weights, experts = self.route(tokens)
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token_of = order // self.top_k
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        xs = tokens[token_of]
        hidden = activation(jax.lax.ragged_dot(xs, self.gate_proj[...], group_sizes), self.act)
        hidden = hidden * jax.lax.ragged_dot(xs, self.up_proj[...], group_sizes)
        ys = jax.lax.ragged_dot(hidden, self.down_proj[...], group_sizes)
        ys = ys * weights.reshape(-1)[order][:, None].astype(ys.dtype)
        out = jnp.zeros_like(tokens).at[token_of].add(ys.astype(tokens.dtype))
        if self.shared is not None:
            shared = self.shared(tokens)
            if self.shared_gate is not None:
                shared = jax.nn.sigmoid(self.shared_gate(tokens)) * shared
            out = out + shared
        return out.reshape(*lead, d)
