"""Perplexity of a model on a text, with a fixed window and stride (the sliding-window recipe of Hugging Face's
perplexity guide).

    ppl = exp( -(1/N) * sum_t log p(x_t | x_{max(0, t-c)} .. x_{t-1}) )

Windows of `window` tokens start every `stride` (< window) tokens; each token t >= 1 is scored exactly once, in the
first window that contains it and has not scored it yet, so every scored token (after the first window) sees at least
`window - stride` tokens of context. Token 0 has no context and is never scored. Every window is padded on the right to
`window` tokens, so the forward compiles once; causal attention keeps the real positions exact under right padding.

`perplexity` runs through the **cache-free forward** (`Decoder.forward`), not the engine's prompt logprobs: one
jitted call per window, deterministic, no page budget or prefix cache involved, and the log-softmax and the gather of
the target tokens happen inside the jit, so a [window, vocab] logits array never leaves the device. Each window
restarts at position 0, as in the recipe. The cache-free forward has no KV cache, so it cannot see a quantized one:
`engine_perplexity` scores the same tokens through the engine's prompt logprobs (the paged path) for that.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference.loading.shipped_text import shipped_text

@dataclasses.dataclass(frozen=True)
class Perplexity:
    perplexity: float
    nll: float  # summed negative log-likelihood (nats) of the scored tokens
    num_tokens: int  # tokens scored (len(ids) - 1)
    window: int
    stride: int

    @property
    def mean_nll(self) -> float:
        return self.nll / self.num_tokens


def window_spans(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over n tokens; positions [first, end) are scored in it."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if not 1 <= stride < window:
        raise ValueError(f"stride must be in [1, window={window}) so that windows overlap and every token is scored "
                         f"with context, got {stride}")
    if n < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {n}")
    spans, prev_end = [], 1  # token 0 is never a target
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        spans.append((begin, end, prev_end))
        prev_end = end
        if end == n:
            break
    return spans


def target_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """logits[1, W, V], tokens[1, W] -> log p(tokens[t+1] | ..t) for t < W-1, shape [W-1] (float32)."""
    lp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(lp, tokens[0, 1:, None], axis=-1)[:, 0]


def perplexity(model: Callable[[jax.Array], jax.Array], token_ids: Sequence[int], *, window: int = 512,
               stride: int = 256) -> Perplexity:
    """Perplexity of `model` on `token_ids`.

    `model` is a `models.decoder.Decoder` (its cache-free forward runs jitted, once per window) or any callable
    tokens[1, W] -> logits[1, W, V] (run as given; tests pass hand-made ones).
    """
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    spans = window_spans(len(ids), window, stride)
    window = min(window, len(ids))
    score = _scorer(model)
    nll, count = 0.0, 0
    for begin, end, first in spans:
        chunk = np.zeros((1, window), np.int32)
        chunk[0, :end - begin] = ids[begin:end]
        lp = np.asarray(score(jnp.asarray(chunk)), np.float64)  # lp[j] = log p(chunk[j+1] | chunk[..j])
        scored = lp[first - begin - 1:end - begin - 1]
        nll -= float(scored.sum())
        count += len(scored)
    assert count == len(ids) - 1, (count, len(ids))
    return Perplexity(math.exp(nll / count), nll, count, window, stride)


@nnx.jit
def _decoder_logprobs(model, tokens: jax.Array) -> jax.Array:
    """One compilation per model structure and window, shared by every call (a model and its quantized twin differ
    in structure, so each compiles once)."""
    return target_logprobs(model.forward(tokens), tokens)


def _scorer(model) -> Callable[[jax.Array], jax.Array]:
    from models.decoder import Decoder

    if isinstance(model, Decoder):
        return functools.partial(_decoder_logprobs, model)
    return lambda t: target_logprobs(jnp.asarray(model(t)), t)


def engine_perplexity(llm, token_ids: Sequence[int], *, window: int = 512, stride: int = 256) -> Perplexity:
    """The same windows and scored tokens as `perplexity`, through the engine's prompt logprobs instead: the paged
    prefill path, so the KV cache format (an int8 cache) is part of what is measured. Every window is one request of
    one call (batched by the engine; requests with prompt logprobs skip the prefix cache)."""
    from inference.sampling.params import SamplingParams

    ids = [int(t) for t in token_ids]
    spans = window_spans(len(ids), window, stride)
    outs = llm.generate(prompt_token_ids=[ids[b:e] for b, e, _ in spans],
                        sampling_params=SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    nll, count = 0.0, 0
    for (begin, end, first), out in zip(spans, outs):
        if out.error is not None:
            raise ValueError(f"window [{begin}, {end}) failed in the engine: {out.error}")
        for pos in range(first, end):
            nll -= out.prompt_logprobs[pos - begin][ids[pos]].logprob
            count += 1
    return Perplexity(math.exp(nll / count), nll, count, min(window, len(ids)), stride)


def llm_perplexity(llm, text: str | None = None, *, window: int = 512, stride: int = 256,
                   through: str = "forward") -> Perplexity:
    """Perplexity of an `inference.LLM`'s model (whatever its quantization) on `text` (default: the shipped text),
    through the cache-free forward ("forward") or the engine's prompt logprobs ("engine", which includes the KV
    cache format)."""
    if llm.tokenizer is None:
        raise ValueError(f"{llm.model_source} has no tokenizer; call perplexity(model, token_ids) instead")
    ids = llm.tokenizer.encode(shipped_text() if text is None else text)
    if through == "engine":
        return engine_perplexity(llm, ids, window=window, stride=stride)
    if through != "forward":
        raise ValueError(f"through must be 'forward' or 'engine', got {through!r}")
    return perplexity(nnx.merge(llm.runner.graphdef, llm.runner.params), ids, window=window, stride=stride)
