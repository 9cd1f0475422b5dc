"""LoRA adapters for the engine: `LoRARequest` (vLLM's), the PEFT checkpoint loader and validator, and the device
slot manager that loads adapters into `models/lora.py`'s stacked slots and evicts them LRU."""

from inference.lora.request import LoRARequest

__all__ = ["LoRARequest"]
