"""Random LoRA adapters in PEFT's on-disk format, made from a numpy seed (so tests rebuild the exact files the
reference script fed to transformers + peft, and nothing large is committed)."""

from __future__ import annotations

import numpy as np

from inference.lora.peft import write_peft_files

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each LoRA-adaptable projection of a dense Llama-style config."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    d, f = config.hidden_size, config.intermediate_size
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "gate_proj": (d, f),
            "up_proj": (d, f), "down_proj": (f, d)}


def random_adapter_tensors(config, *, rank: int, seed: int, modules=ALL_MODULES, layers=None,
                           std: float = 0.05) -> dict[str, np.ndarray]:
    """PEFT-named float32 tensors: lora_A [r, in], lora_B [out, r], both random (a trained-looking adapter, not
    PEFT's B = 0 initialisation, so the delta is nonzero)."""
    rng = np.random.default_rng(seed)
    shapes = module_shapes(config)
    out = {}
    for i in (range(config.num_layers) if layers is None else layers):
        for m in modules:
            d_in, d_out = shapes[m]
            key = f"base_model.model.model.layers.{i}.{_PARENT[m]}.{m}"
            out[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, d_in)) * std).astype(np.float32)
            out[f"{key}.lora_B.weight"] = (rng.standard_normal((d_out, rank)) * std).astype(np.float32)
    return out


def peft_tensors(weights: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """pagejax's (a [in, r], b [r, out]) pairs by projection name -> PEFT's lora_A [r, in] / lora_B [out, r]."""
    out = {}
    for name, (a, b) in weights.items():
        _, i, module = name.split(".")
        key = f"base_model.model.model.layers.{i}.{_PARENT[module]}.{module}"
        out[f"{key}.lora_A.weight"] = np.ascontiguousarray(np.asarray(a, np.float32).T)
        out[f"{key}.lora_B.weight"] = np.ascontiguousarray(np.asarray(b, np.float32).T)
    return out


def write_adapter(folder: str, tensors: dict[str, np.ndarray], *, rank: int, alpha: float, modules=ALL_MODULES,
                  use_rslora: bool = False, base_model: str | None = None, **config_fields) -> str:
    """Write adapter_config.json + adapter_model.safetensors as PEFT's save_pretrained does (every field PEFT
    writes, `config_fields` over them); returns `folder`."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": list(modules), "use_rslora": use_rslora, "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": base_model, "fan_in_fan_out": False, "init_lora_weights": True,
              "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
              **config_fields}
    return write_peft_files(folder, config, tensors)


def make_adapter(folder: str, config, *, rank: int, alpha: float, seed: int, modules=ALL_MODULES,
                 use_rslora: bool = False, layers=None, std: float = 0.05, **config_fields) -> str:
    """A random adapter written to `folder` (random_adapter_tensors + write_adapter)."""
    tensors = random_adapter_tensors(config, rank=rank, seed=seed, modules=modules, layers=layers, std=std)
    return write_adapter(folder, tensors, rank=rank, alpha=alpha, modules=modules, use_rslora=use_rslora,
                         **config_fields)
