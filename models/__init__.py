"""Model definitions, configs and checkpoint loaders."""

from models.config import ModelConfig, RopeScaling

__all__ = ["ModelConfig", "RopeScaling"]
