"""`LoRARequest`: which adapter a request runs with, in vLLM's shape (`LoRARequest(lora_name, lora_int_id,
lora_path)`), validated at construction."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id (unique per adapter: it keys the device slot and the prefix
    cache) and the folder of its PEFT checkpoint (`adapter_config.json` + `adapter_model.safetensors`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1 (0 means no adapter), got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"LoRARequest.lora_path must be a folder path string, got {self.lora_path!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
