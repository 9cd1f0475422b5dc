"""Offline generation API (vLLM-shaped), engine, scheduler, sampling."""

from inference.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inference.sampling_params import SamplingParams


def __getattr__(name: str):
    # LLM pulls in JAX and the model; import it lazily so `from inference import SamplingParams` stays light.
    if name == "LLM":
        from inference.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
