"""Teacher-forced logprobs of given tokens under given parameters: the trainer side of an RL rollout.

An RL trainer needs log pi_theta(token | prefix) for the tokens the engine sampled, as a jittable, differentiable
function of the parameters (`jax.grad` + optax), and it needs it to be the *same quantity* the engine reported, so
that an importance ratio exp(trainer - engine) is 1 when the weights have not moved. `log_probs` is that function.

What the engine's logprob of a sampled token is (`SamplingParams.logprobs_mode`, `inference/sampling/sampler.py`):

* "raw": log_softmax(logits)[token], the model's own distribution over the real vocabulary: no penalties, no
  temperature, no filters. A ratio of raw logprobs compares the models, not the sampling policies.
* "processed": log_softmax(process_logits(logits))[token], the distribution the token was actually drawn from:
  repetition / presence / frequency penalties on the raw logits (counting the prompt and the tokens generated
  before this one), then logits / temperature, then min-p, top-k, top-p with dropped tokens at -inf, renormalised
  over what is kept. So a processed logprob already includes log(1 / mass kept): there is no hidden
  log(mass kept) term, and a ratio of processed logprobs is a ratio of sampling probabilities. Greedy requests
  (temperature < SAMPLING_EPS) get no temperature and no filters, so their processed logprobs are the raw ones with
  penalties applied. A token the filters drop under new weights has logprob -inf (ratio 0).

`log_probs(..., sampling=processed_tensors(...))` applies exactly `process_logits` per position, with the penalty
counts each position had when the engine sampled it, and takes the same `compute_logprobs`.

Numerics: the forward here is the cache-free `Decoder.forward` (differentiable; the engine's paged step has C++ and
while-loop pieces with no gradient). The two are the same function of the weights but not the same float program:
XLA:CPU's matmuls give a row a result that depends on how many rows the matmul has (a decode step has a batch of
sequences, this forward a whole sequence), so values agree to rounding, not bitwise (docs/rl.md has the measured
gaps).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference.sampling.params import SAMPLING_EPS, SamplingParams
from inference.sampling.sampler import SamplingTensors, compute_logprobs, needs_filters, process_logits
from models.decoder import Decoder
from models.lora import adapter_bound


def _as_model(model_or_params) -> Decoder:
    """A `Decoder`, or `(graphdef, state)` as `nnx.split` (and `LLM.runner.graphdef` / `LLM.get_params()`) give."""
    if isinstance(model_or_params, Decoder):
        return model_or_params
    if isinstance(model_or_params, tuple) and len(model_or_params) == 2:
        return nnx.merge(*model_or_params)
    raise ValueError("log_probs takes a Decoder or a (graphdef, params) pair from nnx.split(model) "
                     f"(e.g. (llm.runner.graphdef, llm.get_params())), got {type(model_or_params).__name__}")


def log_probs(model_or_params, token_ids: jax.Array, *, sampling: SamplingTensors | None = None,
              use_filters: bool = False, vocab_size: int | None = None, lora: dict | None = None,
              lora_scaling: float | None = None) -> jax.Array:
    """f32[B, L]: entry [b, j] = logprob of token_ids[b, j] after token_ids[b, :j] (entry [b, 0] is 0).

    Args:
      model_or_params: a `Decoder`, or `(graphdef, params)`; differentiate with respect to the params.
      token_ids: i32[B, L], prompt then completion, right-padded (the model is causal, so padding after a
        sequence's end changes none of its entries; mask them in the loss).
      sampling: None for "raw" logprobs; for "processed" ones, the per-position tensors of `processed_tensors`
        (B * L rows, row b * L + j describes the sampling of token j of sequence b).
      use_filters: static; True when `sampling` has a row with top-k / top-p / min-p (`processed_tensors` says).
      vocab_size: the real vocabulary when the model's is padded (tensor parallelism); logits past it are dropped.
      lora: a LoRA adapter on every token, {projection: (a [in, r], b [r, out])} in models/weights.py's names (what
        `LLM.update_lora` takes), applied by the engine's own delta (models/lora.py); with `lora_scaling` (PEFT's
        alpha / r, or alpha / sqrt(r) for rsLoRA: `inference.lora.peft.adapter_scaling`).

    Jittable (with `use_filters` and `vocab_size` static) and differentiable in the parameters and in `lora`'s
    arrays (LoRA-only training: differentiate in `lora` alone, the base weights stay frozen).
    """
    model = _as_model(model_or_params)
    tokens = jnp.asarray(token_ids, jnp.int32)
    if tokens.ndim != 2 or 0 in tokens.shape:
        raise ValueError(f"token_ids must be [batch, length] with both at least 1, got shape {tokens.shape}")
    b, length = tokens.shape
    _check_concrete(token_ids, sampling, use_filters, vocab_size or model.config.vocab_size)
    if (lora is None) != (lora_scaling is None):
        raise ValueError("log_probs takes lora and lora_scaling together (the adapter's scaling is part of its math)")
    with contextlib.nullcontext() if lora is None else adapter_bound(model, lora, lora_scaling):
        logits = model.forward(tokens)
    if vocab_size is not None:
        logits = logits[..., :vocab_size]
    # Position j - 1's logits predict token j: shift the targets left (the last position predicts nothing).
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    flat = logits.reshape(b * length, -1)
    if sampling is not None:
        if sampling.num_rows != b * length:
            raise ValueError(f"sampling has {sampling.num_rows} rows, token_ids needs batch * length = {b * length}; "
                             "build it with processed_tensors(params, token_ids)")
        flat = process_logits(flat, sampling, use_filters=use_filters, invariant=model.batch_invariant)
    lp, _, _ = compute_logprobs(flat, targets.reshape(-1), 0, invariant=model.batch_invariant)
    lp = lp.reshape(b, length)
    return jnp.concatenate([jnp.zeros((b, 1), jnp.float32), lp[:, :-1]], axis=1)


def _check_concrete(token_ids, sampling: SamplingTensors | None, use_filters: bool, vocab: int) -> None:
    """The checks that read values, where they are concrete (under `jit` they are traced and pass): token ids in the
    vocabulary (an id past it gave NaN, a negative one another token's logprob: padding like -100 is a real id
    masked in the loss), and `use_filters` set where a processed row has top-k / top-p / min-p (else the filters
    were dropped silently)."""
    try:
        ids = np.asarray(token_ids)
    except jax.errors.TracerArrayConversionError:
        return
    bad = np.argwhere((ids < 0) | (ids >= vocab))
    if bad.size:
        i, j = bad[0]
        raise ValueError(f"token_ids[{i}, {j}] = {ids[i, j]} is outside the vocabulary [0, {vocab}); pad with a real "
                         "token id (0, say) and mask the padding out of the loss")
    if sampling is None or use_filters:
        return
    try:
        greedy = np.asarray(sampling.temperature) < SAMPLING_EPS
        filtered = ((np.asarray(sampling.top_k) > 0) & (np.asarray(sampling.top_k) < vocab)) | \
            (np.asarray(sampling.top_p) < 1.0) | (np.asarray(sampling.min_p) > 0.0)
    except jax.errors.TracerArrayConversionError:
        return
    if (filtered & ~greedy).any():
        raise ValueError("sampling has rows with top-k, top-p or min-p, but use_filters=False would skip them; pass "
                         "the use_filters that processed_tensors returns with the tensors")


def processed_tensors(params: SamplingParams | Sequence[SamplingParams], token_ids: np.ndarray,
                      prompt_lens: Sequence[int]) -> tuple[SamplingTensors, bool]:
    """The per-position sampling tensors that make `log_probs` return "processed" logprobs, and `use_filters`.

    Row b * L + j holds sequence b's temperature and filters and, when it uses penalties, the counts the engine
    had when it sampled token j + 1: the prompt (`token_ids[b, :prompt_lens[b]]`) and the completion tokens before
    it. Host-side numpy, built once per batch of rollouts.
    """
    ids = np.asarray(token_ids)
    if ids.ndim != 2:
        raise ValueError(f"token_ids must be [batch, length], got shape {ids.shape}")
    b, length = ids.shape
    params_list = [params] * b if isinstance(params, SamplingParams) else list(params)
    if len(params_list) != b or len(prompt_lens) != b:
        raise ValueError(f"got {len(params_list)} SamplingParams and {len(prompt_lens)} prompt lengths for "
                         f"{b} sequences")
    for n in prompt_lens:
        if not 1 <= n <= length:
            raise ValueError(f"a prompt length must be in [1, {length}] (the padded length), got {n}")
    rows = [p for p in params_list for _ in range(length)]
    prompts, outputs = None, None
    if any(p.uses_penalties for p in params_list):
        prompts, outputs = [], []
        for seq, n in zip(ids.tolist(), prompt_lens):
            for j in range(length):
                # Row j predicts token j + 1; the engine had generated the completion tokens before it.
                prompts.append(seq[:n])
                outputs.append(seq[n:max(n, j + 1)])
    tensors = SamplingTensors.from_params(rows, [0] * len(rows), [0] * len(rows), pad_to=len(rows),
                                          prompt_token_ids=prompts, output_token_ids=outputs)
    return tensors, needs_filters(params_list)


__all__ = ["log_probs", "processed_tensors"]
