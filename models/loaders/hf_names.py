"""Hugging Face tensor names <-> the canonical names of `models.weights`, per family: which checkpoint tensor is
which weight of the decoder (the same HF name can mean another weight in another family), and which tensors are
linears (stored [out, in] by transformers, transposed to [in, out] on load)."""

from __future__ import annotations

import re

_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q_proj", "self_attn.k_proj.weight": "k_proj", "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj", "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias", "mlp.gate_proj.weight": "gate_proj", "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj", "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
}
# Gemma 2/3 norm the attention output with `post_attention_layernorm` and have a separate pre-MLP norm, so the same
# HF name means something else there than in Llama.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES, "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm", "post_feedforward_layernorm.weight": "post_mlp_norm",
}
_DEEPSEEK_LAYER_NAMES = {
    **_LAYER_NAMES, "self_attn.q_a_proj.weight": "q_a_proj", "self_attn.q_a_layernorm.weight": "q_a_norm",
    "self_attn.q_b_proj.weight": "q_b_proj", "self_attn.kv_a_proj_with_mqa.weight": "kv_a_proj",
    "self_attn.kv_a_layernorm.weight": "kv_a_norm", "self_attn.kv_b_proj.weight": "kv_b_proj",
    "mlp.gate.weight": "router", "mlp.shared_experts.gate_proj.weight": "shared.gate_proj",
    "mlp.shared_experts.up_proj.weight": "shared.up_proj", "mlp.shared_experts.down_proj.weight": "shared.down_proj",
    # transformers >= 5 in memory (and checkpoints saved from it unconverted): experts fused into 3-D tensors.
    "mlp.experts.gate_up_proj": "experts.gate_up_proj", "mlp.experts.down_proj": "experts.down_proj_fused",
}
_QWEN3_NEXT_LAYER_NAMES = {
    **_LAYER_NAMES, **{f"linear_attn.{n}.weight": n for n in ("in_proj_qkvz", "in_proj_ba", "out_proj", "conv1d")},
    "linear_attn.dt_bias": "dt_bias", "linear_attn.A_log": "A_log", "linear_attn.norm.weight": "linear_norm",
    "mlp.gate.weight": "router", "mlp.shared_expert_gate.weight": "shared_expert_gate",
    **{f"mlp.shared_expert.{n}.weight": f"shared.{n}" for n in ("gate_proj", "up_proj", "down_proj")},
    "mlp.experts.gate_up_proj": "experts.gate_up_proj", "mlp.experts.down_proj": "experts.down_proj_fused",
}
_GRANITE_LAYER_NAMES = {  # the attention and norms as Llama's; the MLP is Granite's fused shared_mlp
    **{k: v for k, v in _LAYER_NAMES.items() if not k.startswith("mlp.")}, "shared_mlp.input_linear.weight": "gate_up_fused", "shared_mlp.output_linear.weight": "down_proj",
    "mamba.in_proj.weight": "in_proj", "mamba.conv1d.weight": "conv1d", "mamba.conv1d.bias": "conv1d_bias",
    "mamba.dt_bias": "dt_bias", "mamba.A_log": "A_log", "mamba.D": "D", "mamba.norm.weight": "mamba_norm",
    "mamba.out_proj.weight": "out_proj",
}
_EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "q_a_proj",
            "q_b_proj", "kv_a_proj", "kv_b_proj", "router", "in_proj_qkvz", "in_proj_ba", "out_proj",
            "shared_expert_gate", "gate_up_fused", "in_proj"}
# What an FP8 checkpoint's codes stay as (the projections `quantize_decoder` quantizes); other FP8 tensors (routed
# experts, MLA's low-rank projections) the model keeps float, so they are dequantized on load.
FP8_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# A buffer old checkpoints saved (recomputed from config); Qwen3-Next's multi-token-prediction head (unused).
_IGNORED_RE = re.compile(r".*rotary_emb\.inv_freq$|mtp\..*")


def _layer_names(model_type: str) -> dict[str, str]:
    if model_type == "deepseek_v2":
        return _DEEPSEEK_LAYER_NAMES
    if model_type == "qwen3_next":
        return _QWEN3_NEXT_LAYER_NAMES
    if model_type == "granitemoehybrid":
        return _GRANITE_LAYER_NAMES
    return _GEMMA_LAYER_NAMES if model_type in ("gemma2", "gemma3_text") else _LAYER_NAMES


def canonical_name(hf_name: str, model_type: str = "llama") -> str | None:
    """`model.layers.3.self_attn.q_proj.weight` -> `layers.3.q_proj`; None for tensors to skip."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _LAYER_RE.fullmatch(hf_name)
    names = _layer_names(model_type)
    if m and m.group(2) in names:
        return f"layers.{m.group(1)}.{names[m.group(2)]}"
    expert = _EXPERT_RE.fullmatch(m.group(2)) if m and model_type in ("deepseek_v2", "qwen3_next") else None
    if expert:  # one expert's linear of the hub layout: stacked into experts.* by `_stack_experts`
        return f"layers.{m.group(1)}.experts.{expert.group(1)}.{expert.group(2)}"
    if _IGNORED_RE.fullmatch(hf_name):
        return None
    raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the {model_type} decoder layout")


def hf_name(canonical: str, model_type: str = "llama") -> str:
    """Inverse of `canonical_name`, for error messages that point at what the checkpoint should contain."""
    for k, v in _GLOBAL_NAMES.items():
        if v == canonical:
            return k
    _, i, leaf = canonical.split(".", 2)
    inverse = {v: k for k, v in _layer_names(model_type).items()}
    if leaf not in inverse and leaf in ("gate_proj", "up_proj") and "gate_up_fused" in inverse:
        leaf = "gate_up_fused"  # one fused tensor in the checkpoint (Granite's shared_mlp.input_linear)
    return f"model.layers.{i}.{inverse[leaf]}"
