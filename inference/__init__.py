"""Offline generation API (vLLM-shaped), engine, scheduler, sampling."""

from inference.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inference.lora.request import LoRARequest
from inference.sampling.params import SamplingParams


def __getattr__(name: str):
    # LLM pulls in JAX and the model; import it lazily so `from inference import SamplingParams` stays light.
    if name == "LLM":
        from inference.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
