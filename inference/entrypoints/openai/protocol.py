"""The request bodies, in OpenAI's shapes (plus the vLLM extensions the engine supports).

Pydantic checks only shapes and types here (strict: "5" is not an integer, true is not a number) and rejects
fields OpenAI does not know (`extra="forbid"`), so a misspelt parameter is an error instead of a silently ignored
one. Ranges are not repeated here: they are `SamplingParams`'s own checks (inference/sampling/params.py), reached
through `to_sampling_params`, so the HTTP API and the offline API accept exactly the same values.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from inference.sampling.params import SamplingParams
from inference.structured.params import from_response_format


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both generation endpoints share. Defaults are OpenAI's (temperature 1, top_p 1, n 1)."""

    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None  # accepted and ignored, as OpenAI only uses it for abuse monitoring
    # vLLM's extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # the choice carries `token_ids` (and the response `prompt_token_ids`)

    def _common(self) -> dict[str, Any]:
        return dict(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                    skip_special_tokens=self.skip_special_tokens,
                    include_stop_str_in_output=self.include_stop_str_in_output,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def to_sampling_params(self) -> SamplingParams:
        """ValueError (naming the parameter) when a value is out of range: SamplingParams's own check."""
        return SamplingParams(**self._common(), max_tokens=self.max_tokens, logprobs=self.logprobs,
                              prompt_logprobs=self.logprobs if self.echo else None)

    def param_names(self) -> dict[str, str]:
        """SamplingParams field -> the request field that set it (an error's `param`), where they differ."""
        return {"prompt_logprobs": "logprobs"}


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id, ...: passed to the template
    role: str
    content: str | list[dict[str, Any]] | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True  # vLLM's extension

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        structured = None
        if self.response_format is not None:  # json_object / json_schema: structured outputs (inference/structured/)
            try:
                structured = from_response_format(self.response_format.model_dump(exclude_none=True))
            except ValueError as exc:  # named as the SamplingParams field, which param_names maps back
                raise ValueError(f"structured_outputs: {exc}") from None
        return SamplingParams(**self._common(), max_tokens=max_tokens, logprobs=logprobs,
                              structured_outputs=structured)

    def param_names(self) -> dict[str, str]:
        """SamplingParams field -> the request field that set it (an error's `param`), where they differ."""
        return {"max_tokens": "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens",
                "logprobs": "top_logprobs", "structured_outputs": "response_format"}


class TokenizeRequest(_Strict):
    """vLLM's /tokenize body (lm-eval's remote tokenizer sends it)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's POST /v1/load_lora_adapter body: serve the PEFT adapter folder `lora_path` as model `lora_name`."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's POST /v1/unload_lora_adapter body."""

    lora_name: str
