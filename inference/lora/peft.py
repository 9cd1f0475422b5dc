"""PEFT LoRA checkpoints -> `LoRAAdapter`, validated against the base model before anything reaches a device.

A PEFT folder holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, base_model_name_or_path)
and `adapter_model.safetensors` with `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r] (torch's [out, in] layout). They become `models/weights.py`-named pairs
in pagejax's `x @ w` layout: a [in, r] = lora_A.T, b [r, out] = lora_B.T, float32 on the host. Only safetensors
is read (never a pickled `adapter_model.bin`). Every problem is a ValueError that names the file and the fix, so
a bad adapter fails its own request at submission and never a running batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from models.config import ModelConfig
from models.lora import TARGET_MODULES, target_shapes

PEFT_DEFAULT_ALPHA = 8  # LoraConfig's lora_alpha when the file leaves it out
# The largest |scaling| (alpha / r, or alpha / sqrt(r)) accepted: trained adapters' are O(1) to O(100); one far past
# it (a lora_alpha of 1e38) turns every activation it touches into inf or NaN, silently.
MAX_SCALING = 1e6
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
# PEFT config fields this loader does not implement: a non-default value would silently change the math.
_UNSUPPORTED = {"use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
                "bias": "none", "fan_in_fan_out": False, "lora_bias": False, "target_parameters": None,
                "layer_replication": None, "trainable_token_indices": None, "use_qalora": False,
                "alora_invocation_tokens": None}


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """A validated adapter on the host: `weights` maps canonical projection names to (a [in, r], b [r, out])."""

    name: str
    rank: int
    scaling: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    base_model_name: str | None = None
    path: str = ""


def adapter_scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling of the low-rank product: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return float(alpha) / (math.sqrt(rank) if use_rslora else rank)


def load_peft_adapter(path: str, config: ModelConfig, max_rank: int, name: str | None = None) -> LoRAAdapter:
    """Read and validate the PEFT adapter in folder `path` for a base model of `config` (the unpadded one)."""
    label = name or path
    if not path or not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {label!r}: {path!r} is not a folder; lora_path must name a PEFT adapter "
                         f"folder holding {CONFIG_NAME} and {WEIGHTS_NAME}")
    cfg = _read_config(os.path.join(path, CONFIG_NAME), label)
    tensors = _read_tensors(path, label)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {label!r}: {CONFIG_NAME} has r={rank!r}; it must be a positive integer")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {label!r} has rank {rank}, above max_lora_rank={max_rank}; raise "
                         "max_lora_rank when building the LLM")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not _finite(alpha):
        raise ValueError(f"LoRA adapter {label!r}: {CONFIG_NAME} has lora_alpha={alpha!r}; it must be a finite "
                         "number")
    for key, default in _UNSUPPORTED.items():
        if cfg.get(key) and cfg.get(key) != default:
            raise ValueError(f"LoRA adapter {label!r}: {CONFIG_NAME} sets {key}={cfg[key]!r}, which pagejax does not "
                             f"support (only plain LoRA on {sorted(TARGET_MODULES)}); retrain without it")
    _check_target_modules(cfg.get("target_modules"), label)
    weights = _pairs(tensors, config, rank, label, cfg.get("base_model_name_or_path"))
    scaling = adapter_scaling(alpha, rank, bool(cfg.get("use_rslora")))
    if abs(scaling) > MAX_SCALING:
        raise ValueError(f"LoRA adapter {label!r}: lora_alpha={alpha!r} with r={rank} scales its product by "
                         f"{scaling:g}, past {MAX_SCALING:g}: its delta would overflow the activations; "
                         f"{CONFIG_NAME} is corrupt")
    return LoRAAdapter(name=label, rank=rank, scaling=scaling, weights=weights,
                       base_model_name=cfg.get("base_model_name_or_path"), path=path)


def _finite(x: int | float) -> bool:
    """A finite float32-or-wider number (an int past a float's range, 10**400, is not)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _read_config(file: str, label: str) -> dict:
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {label!r}: {file} is missing; a PEFT adapter folder needs {CONFIG_NAME}")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"LoRA adapter {label!r}: {file} is not valid JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {label!r}: {file} must hold a JSON object")
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"LoRA adapter {label!r}: {file} has peft_type={kind!r}; only LORA adapters are supported")
    return cfg


def _read_tensors(path: str, label: str) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    file = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(file):
        extra = " (adapter_model.bin is a pickle, which is never loaded: save with safe_serialization=True)" \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise ValueError(f"LoRA adapter {label!r}: {file} is missing{extra}")
    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError, TypeError) as exc:
        raise ValueError(f"LoRA adapter {label!r}: {file} is not a readable safetensors file ({exc}); "
                         "re-save the adapter") from exc


def _check_target_modules(targets, label: str) -> None:
    if targets is None or isinstance(targets, str):  # a regex (or absent): the tensors present decide
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"LoRA adapter {label!r}: {CONFIG_NAME} has target_modules={targets!r}; it must be a list "
                         "of module names or a regex string (as PEFT writes it)")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"LoRA adapter {label!r} targets {unknown}, which pagejax cannot adapt; supported target "
                         f"modules are {sorted(TARGET_MODULES)}")


def _pairs(tensors: dict[str, np.ndarray], config: ModelConfig, rank: int, label: str,
           base: str | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    shapes = target_shapes(config)
    found: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in TARGET_MODULES:
            raise ValueError(f"LoRA adapter {label!r}: tensor {key!r} is not a LoRA A/B of a supported module "
                             f"({sorted(TARGET_MODULES)} of a decoder layer); unknown module")
        found.setdefault(f"layers.{m.group(1)}.{m.group(2)}", {})[m.group(3)] = value
    if not found:
        raise ValueError(f"LoRA adapter {label!r}: {WEIGHTS_NAME} holds no LoRA tensors")
    trained_for = f" (it was trained for {base!r})" if base else ""
    weights = {}
    for name, pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {label!r}: {name} has lora_{''.join(pair)} but not both lora_A and "
                             "lora_B; the file is incomplete")
        if name not in shapes:
            raise ValueError(f"LoRA adapter {label!r} adapts {name}, which this model ({config.name}, "
                             f"{config.num_layers} layers) does not have{trained_for}; wrong base model")
        d_in, d_out = shapes[name]
        a, b = np.asarray(pair["A"]), np.asarray(pair["B"])
        if a.shape != (rank, d_in) or b.shape != (d_out, rank):
            raise ValueError(f"LoRA adapter {label!r}: {name} lora_A is {list(a.shape)} and lora_B {list(b.shape)}, "
                             f"but rank {rank} on this model ({config.name}) needs [{rank}, {d_in}] and "
                             f"[{d_out}, {rank}]{trained_for}; wrong base model or a wrong r in {CONFIG_NAME}")
        a, b = a.astype(np.float32).T, b.astype(np.float32).T
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise ValueError(f"LoRA adapter {label!r}: {name} holds NaN or infinite values; the file is corrupt")
        weights[name] = (np.ascontiguousarray(a), np.ascontiguousarray(b))
    return weights


def save_peft_adapter(folder: str, weights: dict[str, tuple[np.ndarray, np.ndarray]], *, alpha: float,
                      use_rslora: bool = False, base_model_name: str | None = None) -> str:
    """Write (a [in, r], b [r, out]) pairs by canonical name as a PEFT folder (`load_peft_adapter`'s inverse, the
    files PEFT's `save_pretrained` writes), e.g. an RL trainer's freshly initialised adapter for a `LoRARequest`.
    Returns `folder`."""
    if not weights:
        raise ValueError("save_peft_adapter: the adapter has no projections")
    ranks = {np.shape(a)[1] for a, _ in weights.values()}
    if len(ranks) != 1:
        raise ValueError(f"save_peft_adapter: every projection needs the same rank, got ranks {sorted(ranks)}")
    tensors, modules = {}, set()
    for name, (a, b) in weights.items():
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "layers" or parts[2] not in TARGET_MODULES:
            raise ValueError(f"save_peft_adapter: {name!r} is not a projection LoRA adapts (layers.<i>.<module>, "
                             f"module one of {sorted(TARGET_MODULES)})")
        parent = "self_attn" if TARGET_MODULES[parts[2]].startswith("attn.") else "mlp"
        key = f"base_model.model.model.layers.{parts[1]}.{parent}.{parts[2]}"
        tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(np.asarray(a, np.float32).T)
        tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(np.asarray(b, np.float32).T)
        modules.add(parts[2])
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": ranks.pop(), "lora_alpha": alpha,
              "use_rslora": use_rslora, "target_modules": sorted(modules), "base_model_name_or_path": base_model_name,
              "lora_dropout": 0.0, "bias": "none"}
    return write_peft_files(folder, config, tensors)


def write_peft_files(folder: str, config: dict, tensors: dict[str, np.ndarray]) -> str:
    """The two files of a PEFT adapter folder (the config as JSON, the PEFT-named tensors as safetensors), as
    PEFT's `save_pretrained` lays them out; returns `folder`."""
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, CONFIG_NAME), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(folder, WEIGHTS_NAME))
    return folder
