"""Offline generation API (vLLM-shaped), engine, scheduler, sampling."""

from inference.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from inference.entrypoints.prompts import PromptType, TextPrompt, TokensPrompt
from inference.lora.request import LoRARequest
from inference.sampling.params import SamplingParams
from inference.structured.params import StructuredOutputsParams


def __getattr__(name: str):
    # LLM pulls in JAX and the model; import it lazily so `from inference import SamplingParams` stays light.
    if name == "LLM":
        from inference.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "RequestMetrics", "Logprob", "TextPrompt", "TokensPrompt", "PromptType"]
