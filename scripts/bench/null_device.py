"""A null device for the host-overhead benchmark: the runner's jitted steps swapped for a program that runs no model.

Why: on this CPU "the device" is XLA's CPU runtime on the host's own cores and caches. With SmolLM2's vocabulary a
256-row decode step spends ~100 ms sampling [256, 49152] logits, on both cores, streaming hundreds of MB, so the
host's work that overlaps it runs with cold caches and a shared core: its time grows with the device's work, which
an accelerator's host does not see. With the null device every step's tokens are a hash of each row's seed and step
(`null_tokens`), computed by a few integer operations on the sampled rows; the KV cache is passed through untouched.
The engine's own work (scheduling, the kept batch, the token feed, the fold, stop checks, detokenizing, outputs) is
unchanged and the same for every batch: what is left of a step is the host's.

The tokens are near uniform over the vocabulary, as a random-weight model's samples at temperature 0.8 are; a row's
token depends only on its seed and step, so every batch composition gives a request the same tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from inference.runtime.packing import unpack
from inference.sampling.params import MAX_LOGPROBS
from inference.sampling.sampler import SamplerOutput

_MULTIPLIERS = (0x9E3779B1, 0x85EBCA77, 0x2C1B3C6D, 0x297A2D39)


def null_tokens(seed_key, step, vocab_size: int, xp=jnp):
    """The token of each row: a 32-bit mix of its seed (`SamplingTensors.seed_key`, u32[S, 2]) and step (i32[S]),
    modulo the vocabulary. `xp`: jax.numpy inside the step, numpy for a test's reference."""
    u32 = xp.uint32
    key = seed_key.astype(u32)
    x = key[:, 1] * u32(_MULTIPLIERS[0]) ^ key[:, 0] * u32(_MULTIPLIERS[3]) ^ step.astype(u32) * u32(_MULTIPLIERS[1])
    x = x ^ (x >> u32(15))
    x = x * u32(_MULTIPLIERS[2])
    x = x ^ (x >> u32(12))
    x = x * u32(_MULTIPLIERS[3])
    x = x ^ (x >> u32(15))
    return (x % u32(vocab_size)).astype(xp.int32)


def _null_step(vocab_size: int, param_leaves, kv_caches, inp, sampling, lora=None, *, use_filters: bool = False,
               logprobs: bool = False, prompt_logprobs: bool = False):
    """`runner._step`'s outputs without the model: the tokens, zeros where logprobs are asked for (a prefill step
    always asks: its compiled variants are fixed), the caches as they came."""
    del param_leaves, lora, use_filters
    if inp.spec is not None:
        raise ValueError("the null device has no speculative (verification) steps")
    tokens = null_tokens(sampling.seed_key, sampling.step, vocab_size)
    rows, zeros, top = tokens.shape[0], jnp.zeros, (MAX_LOGPROBS,)
    sampled = SamplerOutput(tokens, zeros(rows, jnp.float32), zeros((rows, *top), jnp.int32) if logprobs else None,
                            zeros((rows, *top), jnp.float32) if logprobs else None,
                            zeros(rows, jnp.int32) if logprobs else None)
    prompt = None
    if prompt_logprobs:
        n = inp.tokens.shape[0]
        prompt = (zeros(n, jnp.float32), zeros((n, *top), jnp.int32), zeros((n, *top), jnp.float32),
                  zeros(n, jnp.int32))
    if inp.feed is None:
        return sampled, prompt, kv_caches
    wide = jnp.zeros_like(inp.feed.prev).at[:rows].set(tokens)
    return sampled, prompt, kv_caches, wide


def install(runner) -> None:
    """Swap `runner`'s four jitted steps (plain and packed, prefill and decode) for null ones with the same
    signatures (`inference/runtime/runner.py`: `jit_step`, `jit_packed_step`)."""
    vocab_size = runner.config.vocab_size

    def step(param_leaves, kv_caches, inp, sampling, lora=None, *, use_filters, logprobs, prompt_logprobs):
        return _null_step(vocab_size, param_leaves, kv_caches, inp, sampling, lora, use_filters=use_filters,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def packed_step(param_leaves, kv_caches, buffer, passed, lora, packing, use_filters, logprobs, prompt_logprobs):
        inp, sampling = unpack(packing, buffer, passed)
        return _null_step(vocab_size, param_leaves, kv_caches, inp, sampling, lora, use_filters=use_filters,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    for name in ("prefill_step", "decode_step"):
        setattr(runner, name, jax.jit(step, static_argnames=("use_filters", "logprobs", "prompt_logprobs"),
                                      donate_argnums=(1,)))
    for name in ("packed_prefill_step", "packed_decode_step"):
        setattr(runner, name, jax.jit(packed_step, static_argnums=(5, 6, 7, 8), donate_argnums=(1,),
                                      in_shardings=(None, None, runner.token_sharding, None, None)))


def reference_tokens(seed: int, steps: int, vocab_size: int) -> list[int]:
    """The null device's tokens for a request with `seed`, generated tokens 0..steps-1 (numpy)."""
    seed %= 1 << 64
    key = np.array([[seed >> 32, seed & 0xFFFFFFFF]] * steps, np.uint32)
    with np.errstate(over="ignore"):
        return null_tokens(key, np.arange(steps, dtype=np.int32), vocab_size, xp=np).tolist()
