"""Presets: model configs by name (plain data, no code paths)."""

from configs.presets import MODEL_PRESETS, get_model_config

__all__ = ["MODEL_PRESETS", "get_model_config"]
