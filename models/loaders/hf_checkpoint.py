"""Load a Hugging Face model folder (config.json + safetensors) into a `ModelConfig` and the canonical weights.

Only safetensors is read (never pickle: a `.bin` checkpoint can execute code on load). Tensors are renamed to the
layout in `models.weights` (each family's names: `hf_names.py`) and linears transposed to `[in, out]`; HF checkpoints
already use rotate-half Q/K order.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

from models.config import ModelConfig, RopeScaling
from models.loaders.fp8_checkpoint import COMPRESSED_TENSORS_FP8, fp8_hf_tensors, fp8_layout, take_fp8_weights
from models.loaders.hf_names import FP8_LINEARS, LINEARS, canonical_name, hf_name
from models.loaders.read_errors import named_errors, read_json_object
from models.optional_deps import require
from models.quantization.formats import QuantizedWeight
from models.weights import check_weights, expected_shapes

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "deepseek_v2", "qwen3_next",
                         "granitemoehybrid")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

# --------------------------------------------------------------------------------------------------------------------
# config.json


def _rope_scaling(cfg: dict[str, Any], max_pos: int) -> RopeScaling | None:
    """HF `rope_scaling` (or transformers v5 `rope_parameters`) -> RopeScaling; 'default' means none."""
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    factor = float(rs.get("factor", 1.0))
    orig = int(rs.get("original_max_position_embeddings") or max_pos)
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor, original_max_position_embeddings=orig)
    if kind == "llama3":
        return RopeScaling(kind="llama3", factor=factor, low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                           high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                           original_max_position_embeddings=orig)
    if kind == "yarn":
        return RopeScaling(kind="yarn", factor=factor, original_max_position_embeddings=orig,
                           beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0),
                           mscale=_opt_float(rs.get("mscale")), mscale_all_dim=_opt_float(rs.get("mscale_all_dim")),
                           attention_factor=_opt_float(rs.get("attention_factor")),
                           truncate=bool(rs.get("truncate", True)))
    raise ValueError(f"unsupported rope_scaling type {kind!r} in config.json; supported: default, linear, llama3, yarn")


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def _json_float(value: Any) -> float:
    """A float of config.json, where transformers 5 writes non-finite ones as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


_DEFAULT_HEAD_DIM = {"qwen3": 128, "gemma2": 256, "gemma3_text": 256, "qwen3_next": 256}  # transformers' defaults; others hidden/heads


def _layer_types(model_type: str, cfg: dict[str, Any], layers: int, window: int | None) -> tuple[str, ...] | None:
    """Per-layer attention kinds as transformers' config classes derive them when config.json has no `layer_types`."""
    # Mistral windows every layer and ignores layer_types.
    if window is None or model_type in ("llama", "mistral", "deepseek_v2"):
        return None
    if cfg.get("layer_types") is not None:
        return tuple(cfg["layer_types"])
    if model_type in ("qwen2", "qwen3"):  # Qwen2Config: layers at index >= max_window_layers slide
        first = int(cfg.get("max_window_layers", 28))
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    # Gemma2Config: every second layer global; Gemma3TextConfig: every `sliding_window_pattern`-th (default 6).
    period = 2 if model_type == "gemma2" else int(cfg.get("sliding_window_pattern", 6))
    return tuple("sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers))


def _window(model_type: str, cfg: dict[str, Any]) -> int | None:
    """The sliding window transformers uses; its config classes default a missing key to 4096."""
    if model_type in ("llama", "deepseek_v2", "qwen3_next"):  # no sliding window in these
        return None
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None  # Qwen2Config.__post_init__: sliding_window = None unless use_sliding_window
    window = cfg.get("sliding_window", 4096)
    return None if window is None else int(window)


def _gemma3_rope(cfg: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling | None, float]:
    """(global theta, global scaling, local theta) of gemma3_text: transformers v5 `rope_parameters` keyed by layer
    type, or the older `rope_theta` / `rope_scaling` (global layers) / `rope_local_base_freq` (local layers)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        full, local = {**params, **(cfg.get("rope_scaling") or {})}, {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling on gemma3 sliding layers ({local.get('rope_type')!r}) is not supported")
    theta = full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local_theta = local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    return float(theta), _rope_scaling({"rope_scaling": full}, max_pos), float(local_theta)


def _deepseek_v2_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """MLA and MoE fields of a deepseek_v2 config.json, with DeepseekV2Config's defaults."""
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError(f"{source}: attention_bias / mlp_bias on deepseek_v2 are not supported")
    rope = int(cfg.get("qk_rope_head_dim", 64))
    experts = int(cfg.get("n_routed_experts", 64) or 0)
    top_k = cfg.get("num_experts_per_tok")
    if experts and not top_k:
        raise ValueError(f"{source}: n_routed_experts={experts} but num_experts_per_tok is not set")
    q_lora = cfg.get("q_lora_rank", 1536)
    return dict(
        num_kv_heads=1, head_dim=rope, rope_interleaved=True,
        q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)), qk_rope_head_dim=rope,
        v_head_dim=int(cfg.get("v_head_dim", 128)), num_experts=experts, num_experts_per_tok=int(top_k or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 1407)),
        num_shared_experts=int(cfg.get("n_shared_experts", 2) or 0),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace", 0)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        topk_method=cfg.get("topk_method") or "greedy", n_group=int(cfg.get("n_group") or 1),
        topk_group=int(cfg.get("topk_group") or 1))


def _qwen3_next_fields(cfg: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """Gated DeltaNet, gated attention and MoE fields of a qwen3_next config.json, with Qwen3NextConfig's defaults
    (its layer_types: every `full_attention_interval`-th layer full attention, the others linear_attention)."""
    if cfg.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true on qwen3_next also puts a bias on o_proj, which pagejax "
                         "does not support")
    experts = int(cfg.get("num_experts", 512) or 0)
    if experts and (int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers")):
        raise ValueError(f"{source}: decoder_sparse_step != 1 or mlp_only_layers (dense MLPs between MoE layers) "
                         "are not supported on qwen3_next; every layer must be MoE")
    kinds = cfg.get("layer_types")
    if kinds is None:
        interval = int(cfg.get("full_attention_interval", 4))
        kinds = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    rope = cfg.get("rope_parameters") or {}
    return dict(
        norm_style="gemma", qk_norm=True, attn_output_gate=True, layer_types=tuple(kinds),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
        linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        num_experts=experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok", 10)) if experts else 0,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 512)) if experts else 0,
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 512)) if experts else 0,
        shared_expert_gate=bool(experts), norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
# Granite-4.0-H's layer kinds, in config.json's legacy names or transformers 5's (where "linear_attention" is Mamba2).
_GRANITE_LAYER_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention",
                        "full_attention": "full_attention"}


def _granite_hybrid_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Mamba2 layers, multipliers and layer kinds of a granitemoehybrid config.json, with GraniteMoeHybridConfig's
    defaults. Dense only: the feed-forward block is the shared MLP (shared_intermediate_size)."""
    if int(cfg.get("num_local_experts", 8) or 0):
        raise ValueError(f"{source}: granitemoehybrid with num_local_experts > 0 (Granite-4.0-H-Tiny / -Small: "
                         "top-k-softmax routing over fused experts) is not supported; dense ones (num_local_experts=0, "
                         "e.g. granite-4.0-h-micro) are")
    if cfg.get("attention_bias") or cfg.get("mamba_proj_bias"):
        raise ValueError(f"{source}: attention_bias / mamba_proj_bias on granitemoehybrid (biases on o_proj / the "
                         "Mamba2 projections) are not supported")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"{source}: granitemoehybrid's Mamba2 conv uses hidden_act; only silu is supported")
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads = int(cfg.get("mamba_n_heads", 128))
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = int(cfg.get("mamba_expand", 2)) * hidden // heads if head_dim in (None, "auto") else int(head_dim)
    kinds = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * layers
    unknown = sorted(set(kinds) - set(_GRANITE_LAYER_TYPES))
    if unknown:
        raise ValueError(f"{source}: unknown granitemoehybrid layer type {unknown[0]!r}; expected one of "
                         f"{sorted(_GRANITE_LAYER_TYPES)}")
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    embed = float(cfg.get("embedding_multiplier", 1.0) or 1.0)
    return dict(
        intermediate_size=int(cfg.get("shared_intermediate_size", 1024)),
        layer_types=tuple(_GRANITE_LAYER_TYPES[k] for k in kinds), use_rope=cfg.get("position_embedding_type") == "rope",
        query_pre_attn_scalar=float(cfg.get("attention_multiplier", 1.0)) ** -2,
        embed_scale=None if embed == 1.0 else embed,
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        mamba_num_heads=heads, mamba_head_dim=head_dim, ssm_state_size=int(cfg.get("mamba_d_state", 256)),
        mamba_n_groups=int(cfg.get("mamba_n_groups", 1)), mamba_d_conv=int(cfg.get("mamba_d_conv", 4)),
        mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)), mamba_chunk_size=int(cfg.get("mamba_chunk_size", 256)),
        mamba_time_step_limit=(_json_float(limit[0]), _json_float(limit[1])))


def config_from_hf(cfg: dict[str, Any], source: str = "config.json", name: str = "") -> ModelConfig:
    """Translate a transformers config dict (llama / mistral / qwen2 / qwen3 / gemma2 / gemma3_text) into ModelConfig.

    Missing keys take the defaults of transformers' own config class for that model_type.
    """
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    gemma = model_type in ("gemma2", "gemma3_text")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        layers, inter, vocab = int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    except KeyError as exc:
        raise ValueError(f"{source}: missing required key {exc.args[0]!r}") from None
    # Gemma's MLP reads `hidden_activation` (its configs may also carry an unused `hidden_act`).
    act = (cfg.get("hidden_activation") or "gelu_pytorch_tanh") if gemma else cfg.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"{source}: unsupported hidden_act {act!r}; supported: {', '.join(_ACTIVATIONS)}")
    if model_type in ("qwen3", "gemma2", "gemma3_text") and cfg.get("attention_bias", False):
        raise ValueError(f"{source}: attention_bias=true on {model_type} also puts a bias on o_proj, which pagejax "
                         "does not support")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention=true (an encoder variant) is not supported")
    max_pos = int(cfg.get("max_position_embeddings") or 4096)
    if model_type == "gemma3_text":
        theta, scaling, local_theta = _gemma3_rope(cfg, max_pos)
    else:
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        scaling, local_theta = _rope_scaling(cfg, max_pos), None
    window = _window(model_type, cfg)
    bos = cfg.get("bos_token_id")
    family: dict[str, Any] = {}
    if gemma:  # Gemma2Config / Gemma3TextConfig defaults: soft caps 50 / 30 on Gemma 2, none on Gemma 3
        family = dict(
            norm_style="gemma", post_norms=True, embed_scale=hidden ** 0.5,
            query_pre_attn_scalar=_opt_float(cfg.get("query_pre_attn_scalar", 256)),
            attn_logit_softcap=_opt_float(cfg.get("attn_logit_softcapping", 50.0 if model_type == "gemma2" else None)),
            final_logit_softcap=_opt_float(cfg.get("final_logit_softcapping",
                                                   30.0 if model_type == "gemma2" else None)))
    if model_type == "deepseek_v2":
        family = _deepseek_v2_fields(cfg, source)
    if model_type == "qwen3_next":
        family = _qwen3_next_fields(cfg, layers, source)
    if model_type == "granitemoehybrid":
        family = _granite_hybrid_fields(cfg, source)
    return ModelConfig(**{**dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or _DEFAULT_HEAD_DIM.get(model_type, hidden // heads)),
        rope_theta=float(theta),
        rope_scaling=scaling, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)), max_position_embeddings=max_pos,
        # Qwen2 hard-codes q/k/v biases; Llama exposes the switch as `attention_bias`.
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        hidden_act=_ACTIVATIONS[act], bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_token_ids(cfg.get("eos_token_id")), family=model_type, name=name,
        sliding_window=window, layer_types=_layer_types(model_type, cfg, layers, window),
        qk_norm=model_type in ("qwen3", "gemma3_text"), rope_local_theta=local_theta), **family})


# --------------------------------------------------------------------------------------------------------------------
# safetensors reading.

_RAW_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
               "F8_E4M3": ml_dtypes.float8_e4m3fn}


def read_safetensors_raw(path: str, name: str) -> np.ndarray:
    """Read one tensor straight from the file layout (8-byte header size, JSON header, raw little-endian data).

    A fallback for safetensors versions whose numpy backend rejects bf16; never unpickles anything.
    """
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        entry = header[name]
        if entry["dtype"] not in _RAW_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']}; supported: {', '.join(_RAW_DTYPES)}")
        start, end = entry["data_offsets"]
        f.seek(8 + header_len + start)
        buf = f.read(end - start)
    return np.frombuffer(buf, dtype=np.dtype(_RAW_DTYPES[entry["dtype"]]).newbyteorder("<")).reshape(entry["shape"])


def _read_file(path: str, names: list[str] | None = None) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    safe_open = require("safetensors", "reading a Hugging Face folder's weights").safe_open
    try:
        f_ctx = safe_open(path, framework="np")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{path}: cannot read safetensors file ({exc}); is it truncated?") from exc
    with f_ctx as f:
        if names is not None:
            lacking = sorted(set(names) - set(f.keys()))
            if lacking:
                raise ValueError(f"{path} lacks {lacking[0]!r} ({len(lacking)} in all), which "
                                 "model.safetensors.index.json places there; is the download complete?")
        for name in names if names is not None else list(f.keys()):
            try:
                out[name] = f.get_tensor(name)
            except (TypeError, ValueError, AttributeError):  # no numpy bf16 (older safetensors) or fp8 (numpy)
                out[name] = read_safetensors_raw(path, name)
    return out


def _read_tensors(folder: str) -> dict[str, np.ndarray]:
    """All tensors of `model.safetensors` or of the shards listed in `model.safetensors.index.json`."""
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        return _read_file(single)
    if os.path.isfile(index):
        weight_map: dict[str, str] = read_json_object(index).get("weight_map", {})
        by_file: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_file.setdefault(shard, []).append(name)
        tensors: dict[str, np.ndarray] = {}
        for shard, names in by_file.items():
            shard_path = os.path.join(folder, shard)
            if not os.path.isfile(shard_path):
                raise ValueError(f"{index} lists shard {shard!r}, which is missing from {folder}")
            tensors.update(_read_file(shard_path, names))
        return tensors
    if any(f.endswith(".bin") for f in os.listdir(folder)):
        raise ValueError(f"{folder} has only PyTorch .bin weights; pagejax reads safetensors only (pickle can run "
                         "code). Convert with transformers: model.save_pretrained(folder, safe_serialization=True)")
    raise ValueError(f"{folder} has no model.safetensors or model.safetensors.index.json")


def _stack_experts(weights: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """Per-expert `layers.{i}.experts.{e}.{proj}` (the hub layout, already transposed to [in, out]) or transformers'
    fused 3-D tensors -> the canonical stacked `layers.{i}.experts.{proj}`: gate/up [E, hidden, I], down
    [E, I, hidden]."""
    out: dict[str, np.ndarray] = {}
    per_expert: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, w in weights.items():
        parts = name.split(".")
        if len(parts) == 5 and parts[2] == "experts":  # layers.i.experts.e.proj
            per_expert.setdefault((f"layers.{parts[1]}.", parts[4]), {})[int(parts[3])] = w
        elif name.endswith(".experts.gate_up_proj"):  # [E, 2I, hidden]: gate rows first, then up
            half = w.shape[1] // 2
            prefix = name[:-len("gate_up_proj")]
            out[prefix + "gate_proj"] = np.ascontiguousarray(np.swapaxes(w[:, :half], 1, 2))
            out[prefix + "up_proj"] = np.ascontiguousarray(np.swapaxes(w[:, half:], 1, 2))
        elif name.endswith(".experts.down_proj_fused"):  # [E, hidden, I]
            out[name[:-len("_fused")]] = np.ascontiguousarray(np.swapaxes(w, 1, 2))
        else:
            out[name] = w
    for (prefix, proj), by_index in per_expert.items():
        if sorted(by_index) != list(range(config.num_experts)):
            missing = sorted(set(range(config.num_experts)) - set(by_index))
            raise ValueError(f"{prefix}experts: the checkpoint lacks {proj} of expert(s) {missing[:4]} of "
                             f"{config.num_experts}; is it complete and does config.json match?")
        out[f"{prefix}experts.{proj}"] = np.stack([by_index[e] for e in range(config.num_experts)])  # [in, out] already
    return out


def _split_gate_up(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A fused `layers.{i}.gate_up_fused` [hidden, 2I] (Granite's shared_mlp.input_linear, transposed) -> gate_proj
    (the first I columns: transformers chunks them first) and up_proj."""
    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        if name.endswith(".gate_up_fused"):
            half = w.shape[1] // 2
            out[name[:-len("gate_up_fused")] + "gate_proj"] = np.ascontiguousarray(w[:, :half])
            out[name[:-len("gate_up_fused")] + "up_proj"] = np.ascontiguousarray(w[:, half:])
        else:
            out[name] = w
    return out


# --------------------------------------------------------------------------------------------------------------------
# Public entry point.

def load_hf_folder(folder: str | os.PathLike[str], dtype: Any = np.float32
                   ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a llama/mistral/qwen2/qwen3/gemma2/gemma3_text HF folder. `dtype=None` keeps the stored dtype (e.g.
    bf16) instead of float32. An FP8 checkpoint (models/loaders/fp8_checkpoint.py) gives its projections as
    float8_e4m3fn `QuantizedWeight`s ([in, out], never a float copy), which `load_weights` keeps."""
    folder = os.fspath(folder)
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{folder} has no config.json; expected a Hugging Face model folder")
    with named_errors(cfg_path, "the model config", "compare it with the model's original config.json"):
        cfg = read_json_object(cfg_path)
        config = config_from_hf(cfg, cfg_path, name=os.path.basename(os.path.normpath(folder)))
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen_path):  # chat models list their end-of-turn ids here (Llama 3: 128001, 128008, 128009)
        with named_errors(gen_path, "the generation config", "compare it with the model's original file"):
            extra = _token_ids(read_json_object(gen_path).get("eos_token_id"))
        config = config.replace(eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))
    weights: dict[str, Any] = {}
    tensors = take_fp8_weights(_read_tensors(folder), fp8_layout(cfg, cfg_path), folder)
    for name, w in tensors.items():
        canonical = canonical_name(name, config.family)
        if canonical is None or (canonical == "lm_head" and config.tie_word_embeddings):
            continue
        if isinstance(w, QuantizedWeight):  # FP8, already [in, out]; what the model keeps float is dequantized
            keeps = ".experts." not in canonical and canonical.rsplit(".", 1)[-1] in FP8_LINEARS
            weights[canonical] = w if keeps else np.asarray(w.dequantize(), dtype or np.float32)
            continue
        if np.dtype(w.dtype).kind in "iub":  # a float checkpoint's tensor (bf16's kind is "V"): an integer is no weight
            raise ValueError(f"{folder}: tensor {name!r} is {w.dtype}, not a float; quantized HF checkpoints (GPTQ, "
                             "AWQ) are not read: load the float checkpoint (pagejax quantizes it: quantization=...)")
        if canonical.rsplit(".", 1)[-1] in LINEARS:
            w = w.T
        elif canonical.endswith(".conv1d"):  # nn.Conv1d's depthwise [C, 1, K] -> [C, K]
            w = w.reshape(w.shape[0], -1)
        weights[canonical] = np.ascontiguousarray(w if dtype is None else w.astype(dtype, copy=False))
    if config.num_experts:
        weights = _stack_experts(weights, config)
    weights = _split_gate_up(weights)
    missing = sorted(set(expected_shapes(config)) - set(weights))
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks tensor {hf_name(missing[0], config.family)!r} ({len(missing)} missing in all); "
                         "is the download complete and does config.json match the weights?")
    check_weights(config, weights, folder)
    return config, weights


def save_fp8_folder(folder: str | os.PathLike[str], output: str | os.PathLike[str]) -> int:
    """Write `folder` (a dense HF model, e.g. bf16) as a compressed-tensors FP8 folder at `output` (new): per-channel
    e4m3 layer projections, everything else as stored, config.json with its quantization_config, the tokenizer and
    generation files copied. Returns the bytes of tensors written."""
    import shutil

    from safetensors.numpy import save_file

    folder, output = os.fspath(folder), os.fspath(output)
    config, weights = load_hf_folder(folder, dtype=None)
    if config.num_experts:
        raise ValueError(f"{folder}: writing FP8 checkpoints of mixtures of experts is not supported")
    cfg = read_json_object(os.path.join(folder, "config.json"))
    if cfg.get("quantization_config") and fp8_layout(cfg) != "compressed-tensors":
        raise ValueError(f"{folder} is already quantized ({cfg['quantization_config'].get('quant_method')}); "
                         "convert a float checkpoint")
    tensors = fp8_hf_tensors(weights, FP8_LINEARS, LINEARS, lambda n: hf_name(n, config.family))
    os.makedirs(output, exist_ok=False)
    save_file(tensors, os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(output, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg | {"quantization_config": COMPRESSED_TENSORS_FP8}, f, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copy(os.path.join(folder, name), os.path.join(output, name))
    return sum(t.nbytes for t in tensors.values())
