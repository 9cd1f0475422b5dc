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
"""

from __future__ import annotations

import numpy as np

from models.config import ModelConfig


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight name the config needs, with its shape."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, d), "final_norm": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn_norm": (d,), p + "q_proj": (d, q), p + "k_proj": (d, kv), p + "v_proj": (d, kv),
            p + "o_proj": (q, d), p + "mlp_norm": (d,), p + "gate_proj": (d, f), p + "up_proj": (d, f),
            p + "down_proj": (f, d),
        })
        if config.attention_bias:
            shapes.update({p + "q_bias": (q,), p + "k_bias": (kv,), p + "v_bias": (kv,)})
        if config.qk_norm:
            shapes.update({p + "q_norm": (config.head_dim,), p + "k_norm": (config.head_dim,)})
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
