"""The canonical flat weight layout every loader produces and the decoder consumes.

Loaders (GGUF, HF safetensors, orbax) return `dict[str, np.ndarray]` with these names, linear weights in
`[in, out]` layout (so `x @ w`), and Q/K projection rows in the Hugging Face "rotate half" RoPE order (llama.cpp's
interleaved permutation already undone). Keeping one layout means a new format needs only a name map. Norm weights
are stored as the checkpoint's model applies them: with `norm_style="gemma"` that is the offset w of (1 + w), as in
Hugging Face Gemma checkpoints (llama.cpp's Gemma GGUFs store 1 + w and would need 1 subtracted).

    embed                      [vocab, hidden]
    layers.{i}.attn_norm       [hidden]
    layers.{i}.q_proj          [hidden, num_heads * head_dim]      (+ layers.{i}.q_bias when attention_bias)
    layers.{i}.k_proj          [hidden, num_kv_heads * head_dim]   (+ layers.{i}.k_bias)
    layers.{i}.v_proj          [hidden, num_kv_heads * head_dim]   (+ layers.{i}.v_bias)
    layers.{i}.o_proj          [num_heads * head_dim, hidden]
    layers.{i}.q_norm          [head_dim]                          (q_norm / k_norm only when qk_norm)
    layers.{i}.k_norm          [head_dim]
    layers.{i}.post_attn_norm  [hidden]                            (post_attn_norm / post_mlp_norm only when
    layers.{i}.post_mlp_norm   [hidden]                             post_norms; Gemma 2/3)
    layers.{i}.mlp_norm        [hidden]                            (Gemma: pre_feedforward_layernorm)
    layers.{i}.gate_proj       [hidden, intermediate]
    layers.{i}.up_proj         [hidden, intermediate]
    layers.{i}.down_proj       [intermediate, hidden]
    final_norm                 [hidden]
    lm_head                    [hidden, vocab]                     (absent when tie_word_embeddings)

Multi-head latent attention (kv_lora_rank set; n, r, v = qk_nope / qk_rope / v head dims, C = kv_lora_rank)
replaces q/k/v_proj (o_proj stays, [num_heads * v, hidden]):

    layers.{i}.q_proj          [hidden, num_heads * (n + r)]       (without q_lora_rank), or
    layers.{i}.q_a_proj        [hidden, q_lora_rank]  + q_a_norm [q_lora_rank] + q_b_proj [q_lora_rank, heads*(n+r)]
    layers.{i}.kv_a_proj       [hidden, C + r]                     (the latent, then the shared RoPE key)
    layers.{i}.kv_a_norm       [C]
    layers.{i}.kv_b_proj       [C, num_heads * (n + v)]            (per head: the key's no-RoPE part, then the value)

A mixture-of-experts layer (E experts of width I, S shared) replaces gate/up/down_proj:

    layers.{i}.router          [hidden, E]
    layers.{i}.experts.gate_proj [E, hidden, I]  experts.up_proj [E, hidden, I]  experts.down_proj [E, I, hidden]
    layers.{i}.shared.gate_proj  [hidden, S * I] shared.up_proj  [hidden, S * I] shared.down_proj  [S * I, hidden]
    layers.{i}.shared_expert_gate [hidden, 1]                      (Qwen MoE; S * I is then shared_expert_width)

With attn_output_gate, q_proj is [hidden, num_heads * 2 * head_dim]: per head the query's columns, then its gate's.

With cross-layer attention (cla_factor > 1) only the first layer of each run has k_proj / v_proj (and their biases
and k_norm).

A Gated DeltaNet layer ("linear_attention"; Hk key heads of Dk, Hv value heads of Dv, conv kernel K, conv channels
C = 2·Hk·Dk + Hv·Dv) replaces the attention's weights, in transformers' Qwen3-Next layouts (the projections' output
columns grouped per key head: q, k, then the group's Hv/Hk value heads' v and z; b then a likewise):

    layers.{i}.in_proj_qkvz    [hidden, 2·Hk·Dk + 2·Hv·Dv]
    layers.{i}.in_proj_ba      [hidden, 2·Hv]
    layers.{i}.conv1d          [C, K]                              (depthwise, no bias)
    layers.{i}.dt_bias         [Hv]
    layers.{i}.A_log           [Hv]
    layers.{i}.linear_norm     [Dv]                                (the gated RMSNorm's weight)
    layers.{i}.out_proj        [Hv·Dv, hidden]
"""

from __future__ import annotations

import math

import numpy as np

from models.config import ModelConfig


def _attention_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    d, heads = config.hidden_size, config.num_heads
    if config.is_mla:
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        c = config.kv_lora_rank
        shapes = {"kv_a_proj": (d, c + config.qk_rope_head_dim), "kv_a_norm": (c,),
                  "kv_b_proj": (c, heads * (config.qk_nope_head_dim + config.v_head_dim)),
                  "o_proj": (heads * config.v_head_dim, d)}
        if config.q_lora_rank is None:
            shapes["q_proj"] = (d, heads * qk)
        else:
            shapes.update({"q_a_proj": (d, config.q_lora_rank), "q_a_norm": (config.q_lora_rank,),
                           "q_b_proj": (config.q_lora_rank, heads * qk)})
        return shapes
    q, kv = heads * config.head_dim, config.num_kv_heads * config.head_dim
    owns_kv = config.owns_kv(layer)
    q_out = 2 * q if config.attn_output_gate else q  # per head [q | gate]
    shapes = {"q_proj": (d, q_out), "o_proj": (q, d)}
    if owns_kv:
        shapes.update({"k_proj": (d, kv), "v_proj": (d, kv)})
    if config.attention_bias:
        shapes.update({"q_bias": (q_out,), **({"k_bias": (kv,), "v_bias": (kv,)} if owns_kv else {})})
    if config.qk_norm:
        shapes.update({"q_norm": (config.head_dim,), **({"k_norm": (config.head_dim,)} if owns_kv else {})})
    return shapes


def _state_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    kind = config.layer_types[layer]
    d = config.hidden_size
    if kind == "linear_attention":
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        return {"in_proj_qkvz": (d, 2 * hk * dk + 2 * hv * dv), "in_proj_ba": (d, 2 * hv),
                "conv1d": (config.linear_conv_dim, config.linear_conv_kernel_dim), "dt_bias": (hv,), "A_log": (hv,),
                "linear_norm": (dv,), "out_proj": (hv * dv, d)}
    raise ValueError(f"layer {layer}: no weight layout for {kind!r} layers in models/weights.py")


def _mixer_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The token mixer's weights: a state layer's, or the attention's."""
    return _state_shapes(config, layer) if config.is_state_layer(layer) else _attention_shapes(config, layer)


def _ffn_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    d = config.hidden_size
    if not config.is_moe(layer):
        f = config.intermediate_size
        return {"gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    e, f = config.num_experts, config.moe_intermediate_size
    shapes = {"router": (d, e), "experts.gate_proj": (e, d, f), "experts.up_proj": (e, d, f),
              "experts.down_proj": (e, f, d)}
    if config.shared_expert_width:
        fs = config.shared_expert_width
        shapes.update({"shared.gate_proj": (d, fs), "shared.up_proj": (d, fs), "shared.down_proj": (fs, d)})
    if config.shared_expert_gate:
        shapes["shared_expert_gate"] = (d, 1)
    return shapes


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight name the config needs, with its shape."""
    d, v = config.hidden_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, d), "final_norm": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "attn_norm": (d,), p + "mlp_norm": (d,)})
        shapes.update({p + k: v for k, v in _mixer_shapes(config, i).items()})
        shapes.update({p + k: v for k, v in _ffn_shapes(config, i).items()})
        if config.post_norms:
            shapes.update({p + "post_attn_norm": (d,), p + "post_mlp_norm": (d,)})
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, np.ndarray], source: str) -> None:
    """Raise ValueError naming the first missing, unexpected or mis-shaped tensor."""
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(weights))
    if missing:
        raise ValueError(f"{source}: checkpoint lacks tensor {missing[0]!r} (and {len(missing) - 1} more); "
                         "is it a complete checkpoint of this architecture?")
    extra = sorted(set(weights) - set(shapes))
    if extra:
        raise ValueError(f"{source}: unexpected tensor {extra[0]!r} for this config; the checkpoint and config.json "
                         "disagree")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape} "
                             "from the model config; the checkpoint and its config disagree")


def num_params(config: ModelConfig) -> int:
    """Every parameter the layout above holds for `config` (all experts counted)."""
    return sum(math.prod(shape) for shape in expected_shapes(config).values())
