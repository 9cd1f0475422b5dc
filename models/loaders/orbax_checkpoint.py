"""Orbax checkpoints of a model: the canonical flat weights, the config and the tokenizer in one folder.

    folder/pagejax_config.json   {"format": "pagejax-orbax", "version": 1, "config": {ModelConfig fields}}
    folder/weights/              an orbax StandardCheckpointer tree: {"embed": ..., "layers.0.q_proj": ..., ...}
    folder/tokenizer.json        (and tokenizer_config.json) when the source model had a tokenizer

The weights are the canonical layout of `models/weights.py` (unpadded, `[in, out]` linears), so one checkpoint
serves every tensor-parallel size. Why orbax: a restore takes a target `ShapeDtypeStruct` with a sharding per
array, and tensorstore then reads only each device's slice of each array straight into that device; no process
materialises a full copy (and under jax.distributed no host reads another host's slices). `scripts/convert.py`
writes these folders from GGUF and Hugging Face checkpoints; `LLM(model=folder)` reads them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from typing import Any, Mapping

import numpy as np

from models.config import ModelConfig, RopeScaling
from models.weights import check_weights

CONFIG_FILE = "pagejax_config.json"
WEIGHTS_DIR = "weights"
FORMAT = "pagejax-orbax"
VERSION = 1


def is_orbax_folder(path: str) -> bool:
    """Whether `path` is a folder written by `save_checkpoint` (it has our config file)."""
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


# ---- config as JSON ---------------------------------------------------------------------------------------------
def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_from_dict(data: Mapping[str, Any], source: str) -> ModelConfig:
    """A ModelConfig from `config_to_dict`'s output; lists back to tuples, `rope_scaling` back to RopeScaling."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{source}: unknown config field {unknown[0]!r}; the checkpoint was written by a newer "
                         "pagejax, or the file is not a pagejax config")
    hints = typing.get_type_hints(ModelConfig)
    values = {}
    try:
        for name, value in data.items():
            if name == "rope_scaling" and isinstance(value, dict):
                value = RopeScaling(**value)
            elif isinstance(value, list) and "tuple" in str(hints[name]):
                value = tuple(value)
            if not _matches(value, hints[name]):
                raise TypeError(f"{name}={value!r} is not a {_type_name(hints[name])}")
            values[name] = value
        return ModelConfig(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: invalid model config ({e}); re-create the folder with scripts/convert.py") \
            from None


def _matches(value: Any, hint: Any) -> bool:
    """Whether a config value read from JSON has its field's type (ints are floats too; bools are not ints). A hint
    this does not know (none today) passes."""
    if hint is type(None):
        return value is None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(value) == len(args) and all(_matches(v, h) for v, h in zip(value, args))
    return isinstance(value, hint) if isinstance(hint, type) else True


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def read_config(folder: str) -> ModelConfig:
    path = os.path.join(folder, CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: cannot read the checkpoint's config ({e}); re-create the folder with "
                         "scripts/convert.py") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("config"), dict):
        raise ValueError(f"{path}: not a pagejax orbax config (expected format {FORMAT!r}); re-create the folder "
                         "with scripts/convert.py")
    if meta.get("version") != VERSION:
        raise ValueError(f"{path}: checkpoint format version {meta.get('version')!r}, this pagejax reads "
                         f"version {VERSION}")
    return config_from_dict(meta["config"], path)


# ---- save ---------------------------------------------------------------------------------------------------------
def save_checkpoint(folder: str, config: ModelConfig, weights: Mapping[str, Any], tokenizer: Any = None) -> None:
    """Write `weights` (canonical names; numpy or jax arrays) with their config, and the tokenizer if given.

    Refuses an existing non-empty folder rather than mixing two models' files."""
    check_weights(config, dict(weights), "save_checkpoint")
    if os.path.exists(folder) and os.listdir(folder):
        raise ValueError(f"{folder} exists and is not empty; choose a new folder for the checkpoint")
    os.makedirs(folder, exist_ok=True)
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.abspath(os.path.join(folder, WEIGHTS_DIR)), dict(weights))
    checkpointer.wait_until_finished()
    if tokenizer is not None:
        write_tokenizer(tokenizer, folder)
    # The config goes last: a folder without it is an interrupted conversion, not a checkpoint.
    with open(os.path.join(folder, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "version": VERSION, "config": config_to_dict(config)}, f, indent=1)


def write_tokenizer(tokenizer: Any, folder: str) -> None:
    """tokenizer.json plus the tokenizer_config.json fields `inference.loading.tokenizer.Tokenizer.from_folder` reads
    (special tokens, chat template, whether a BOS is added), so the folder loads like a Hugging Face one."""
    tokenizer.backend.save(os.path.join(folder, "tokenizer.json"))
    bos_id = tokenizer.bos_token_id
    cfg = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
           "unk_token": tokenizer.unk_token, "chat_template": tokenizer.chat_template,
           "add_bos_token": bos_id is not None and tokenizer.encode("a")[:1] == [bos_id]}
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in cfg.items() if v is not None}, f, indent=1, ensure_ascii=False)


# ---- restore ------------------------------------------------------------------------------------------------------
def _this_process_only():
    """Orbax's restore syncs every process of a `jax.distributed` job by default. pagejax's processes each load
    their own copy, each at its own time (process-level data parallelism: no array spans processes, and a process
    with no rows left loads nothing), so a restore involves this process alone."""
    import jax
    import orbax.checkpoint as ocp

    index = jax.process_index()
    return ocp.options.MultiprocessingOptions(primary_host=index, active_processes={index})


def restore_weights(folder: str, config: ModelConfig, shardings: Mapping[str, Any] | None = None
                    ) -> dict[str, Any]:
    """The checkpoint's weights, checked against `config` before anything is read.

    `shardings` (name -> jax Sharding, e.g. `sharding.checkpoint_shardings`): each array is restored straight into
    that layout, every device reading only its slice. None: host numpy arrays (one device, or a model that must be
    padded on the host first)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.path.join(folder, WEIGHTS_DIR))
    hint = "re-create it with scripts/convert.py"
    if not os.path.isdir(path):
        raise ValueError(f"{folder}: has no {WEIGHTS_DIR}/ folder (a conversion that did not finish, or the files were "
                         f"moved); {hint}")
    this_process = _this_process_only()
    checkpointer = ocp.StandardCheckpointer(multiprocessing_options=this_process)
    try:
        metadata = checkpointer.metadata(path).item_metadata
        tree = getattr(metadata, "tree", metadata)
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for missing or corrupt files
        raise ValueError(f"{folder}: cannot read the orbax checkpoint's metadata ({type(e).__name__}: {e}); "
                         f"{hint}") from None
    if not isinstance(tree, Mapping):
        raise ValueError(f"{folder}: the orbax checkpoint is not a flat name -> array tree; {hint}")
    check_weights(config, dict(tree), f"{folder} (orbax)")
    try:
        if shardings is None:
            restore_args = {name: ocp.RestoreArgs(restore_type=np.ndarray) for name in tree}
            handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=this_process)
            weights = ocp.Checkpointer(handler, multiprocessing_options=this_process).restore(
                path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
        else:
            import jax

            target = {name: jax.ShapeDtypeStruct(tuple(meta.shape), meta.dtype, sharding=shardings[name])
                      for name, meta in tree.items()}
            weights = checkpointer.restore(path, target)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{folder}: the orbax checkpoint is corrupt or incomplete ({type(e).__name__}: {e}); "
                         f"{hint}") from None
    return dict(weights)


__all__ = ["config_from_dict", "config_to_dict", "is_orbax_folder", "read_config", "restore_weights",
           "save_checkpoint", "write_tokenizer"]
