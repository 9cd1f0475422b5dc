"""The jitted model steps and the device state they own (parameters, paged KV cache).

`prefill_step` and `decode_step` are two `jax.jit` entry points over one pure step function
`(params, kv_caches, model_input, sampling) -> (sampled tokens + logprobs, new kv_caches)`. They compile once per
static bucket (tokens, sequences, pages per sequence, longest query, sampler flags); the KV cache is donated so it is
updated in place. Only the sampled tokens (and logprobs when asked) come back to the host.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference.batch import BucketLimits, ModelInput, SpecInput, bucket, bucket_ladder
from inference.sampler import (SamplerOutput, SamplingTensors, compute_logprobs, process_logits, sample,
                               sample_with_logprobs)
from inference.sampling_params import MAX_LOGPROBS, SAMPLING_EPS
from inference.speculative import probs_from_logits, rejection_sample
from kernels_pallas.kv_cache import copy_pages
from models.decoder import Decoder


@dataclasses.dataclass
class StepOutput:
    tokens: np.ndarray  # i32[S]
    logprob: np.ndarray | None = None  # f32[S]
    top_ids: np.ndarray | None = None  # i32[S, k]
    top_logprobs: np.ndarray | None = None
    prompt_logprob: np.ndarray | None = None  # f32[T]: logprob of target_ids[t] after token t
    prompt_top_ids: np.ndarray | None = None  # i32[T, k]
    prompt_top_logprobs: np.ndarray | None = None
    emitted: np.ndarray | None = None  # i32[S, k+1]: speculative steps: accepted drafts, then one more token
    num_accepted: np.ndarray | None = None  # i32[S]


def _step(graphdef, treedef, param_leaves, kv_caches, inp: ModelInput, sampling: SamplingTensors, *,
          use_filters: bool, logprobs: bool, prompt_logprobs: bool):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, param_leaves))
    hidden, kv_caches = model(inp.tokens, inp.positions, kv_caches, inp.attn)
    if inp.spec is not None:
        sampled = _verify(model, hidden, inp.spec, sampling, use_filters=use_filters, logprobs=logprobs)
    else:
        logits = model.logits(hidden[inp.logits_indices])
        # Top logprobs are computed at the largest k any request may ask for, so k never adds a compiled variant.
        sampled = sample_with_logprobs(logits, sampling, use_filters=use_filters,
                                       num_top=MAX_LOGPROBS if logprobs else 0)
    prompt = None
    if prompt_logprobs:
        prompt = compute_logprobs(model.logits(hidden), jnp.maximum(inp.target_ids, 0), MAX_LOGPROBS)
    return sampled, prompt, kv_caches


def _verify(model, hidden, spec: SpecInput, sampling: SamplingTensors, *, use_filters: bool, logprobs: bool):
    """Speculative verification: (SamplerOutput for position 0, emitted i32[S, k+1], num_accepted i32[S]).

    Drafts are deterministic proposals (n-gram), so the draft distribution is one-hot. Rows with no drafts emit one
    token sampled exactly like a plain decode. A row that verifies drafts samples from the same distributions but
    spends its random key differently, so a seeded request gives other (equally distributed) tokens when it
    speculates than when it does not. Logprobs (only requested by rows that
    do not speculate) come from position 0.
    """
    logits = model.logits(hidden[spec.logits_indices])  # [S, k+1, V]
    probs = probs_from_logits(logits, sampling, use_filters)
    emitted, accepted = rejection_sample(probs, None, spec.draft_tokens, sampling.keys(),
                                         greedy=sampling.temperature < SAMPLING_EPS, num_draft=spec.num_draft)
    # Rows without drafts sample exactly as a plain decode step would (same key use), so a seeded request's tokens
    # do not depend on whether its batch-mates speculate.
    plain = sample(logits[:, 0], sampling, use_filters=use_filters)
    first = jnp.where(spec.num_draft > 0, emitted[:, 0], plain)
    emitted = emitted.at[:, 0].set(first)
    if logprobs:
        raw = logits[:, 0]
        src = jnp.where(sampling.processed_logprobs[:, None], process_logits(raw, sampling, use_filters=use_filters),
                        raw)
        lp, top_ids, top_lp = compute_logprobs(src, first, MAX_LOGPROBS)
    else:
        lp, top_ids, top_lp = compute_logprobs(logits[:, 0], first, 0)
    return SamplerOutput(tokens=first, logprob=lp, top_ids=top_ids, top_logprobs=top_lp), emitted, accepted


class ModelRunner:
    def __init__(self, model: Decoder, *, num_pages: int, page_size: int, kv_dtype=jnp.float32):
        config = model.config
        self.config = config
        self.page_size = page_size
        self.num_pages = num_pages
        self.graphdef, params = nnx.split(model)
        # The jitted steps take the parameters as a flat list of arrays: flattening an nnx.State on every call
        # cost ~5 ms of host time per step (Python-level Variable flattening), a list costs microseconds.
        self.param_leaves, self.param_treedef = jax.tree.flatten(params)
        shape = (num_pages, page_size, 2 * config.num_kv_heads, config.head_dim)
        self.kv_caches = [jnp.zeros(shape, kv_dtype) for _ in range(config.num_layers)]
        static = ("use_filters", "logprobs", "prompt_logprobs")
        # Two partials, so each entry point keeps its own compilation cache (and count).
        step = (_step, self.graphdef, self.param_treedef)
        self.prefill_step = jax.jit(functools.partial(*step), static_argnames=static, donate_argnums=(1,))
        self.decode_step = jax.jit(functools.partial(*step), static_argnames=static, donate_argnums=(1,))
        self._copy_pages = jax.jit(lambda caches, src, dst: [copy_pages(c, src, dst) for c in caches],
                                   donate_argnums=(0,))

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.size * c.dtype.itemsize for c in self.kv_caches)

    def num_compilations(self) -> dict[str, int]:
        """Compiled variants of each step so far (one per static bucket seen)."""
        return {"prefill": self.prefill_step._cache_size(), "decode": self.decode_step._cache_size()}

    def execute(self, inp: ModelInput, sampling: SamplingTensors, *, is_decode: bool, use_filters: bool = False,
                logprobs: bool = False, prompt_logprobs: bool = False) -> StepOutput:
        """Run one step; only the sampled tokens (and the logprobs asked for) come back to the host."""
        fn = self.decode_step if is_decode else self.prefill_step
        sampled, prompt, self.kv_caches = fn(self.param_leaves, self.kv_caches, inp, sampling, use_filters=use_filters,
                                             logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        spec = None
        if inp.spec is not None:
            sampled, *spec = sampled
        if not (logprobs or prompt_logprobs or spec):
            return StepOutput(tokens=np.asarray(sampled.tokens))
        host = jax.device_get((sampled, prompt, spec))
        out = StepOutput(tokens=host[0].tokens, logprob=host[0].logprob, top_ids=host[0].top_ids,
                         top_logprobs=host[0].top_logprobs)
        if spec:
            out.emitted, out.num_accepted = host[2]
        if host[1] is not None:
            out.prompt_logprob, out.prompt_top_ids, out.prompt_top_logprobs = host[1]
        return out

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages src -> dst in every layer (copy-on-write), padded to a power-of-two count."""
        size = bucket(len(copies))
        padded = copies + [copies[-1]] * (size - len(copies))  # repeating a pair rewrites the same value
        src, dst = (np.asarray(x, np.int32) for x in zip(*padded))
        self.kv_caches = self._copy_pages(self.kv_caches, src, dst)

    def warmup_decode(self, limits: BucketLimits) -> int:
        """Compile the decode step for every (sequences, pages per sequence) bucket, with and without sampling
        filters, so serving never compiles a decode step. Returns how many variants were compiled."""
        before = self.decode_step._cache_size()
        for seqs in bucket_ladder(1, limits.max_seqs):
            for pages in bucket_ladder(limits.min_pages_per_seq, limits.max_pages_per_seq):
                inp = ModelInput.empty(num_tokens=seqs, num_seqs=seqs, pages_per_seq=pages, max_q_len=1)
                sampling = SamplingTensors.from_params([], [], [], pad_to=seqs)
                for use_filters in (False, True):
                    self.execute(inp, sampling, is_decode=True, use_filters=use_filters)
        return self.decode_step._cache_size() - before

    @property
    def params(self) -> nnx.State:
        """The model's parameters as an nnx.State (a fresh view of the arrays the steps use)."""
        return jax.tree.unflatten(self.param_treedef, self.param_leaves)

    def update_weights(self, params: nnx.State) -> None:
        """Swap in parameters of the same structure, shapes and dtypes: the compiled steps are reused as they are."""
        leaves, treedef = jax.tree.flatten(params)
        if treedef != self.param_treedef:
            raise ValueError("update_weights: the new parameters do not have the model's structure")
        for new_leaf, old_leaf in zip(leaves, self.param_leaves):
            if new_leaf.shape != old_leaf.shape or new_leaf.dtype != old_leaf.dtype:
                raise ValueError(f"update_weights: a parameter of shape {old_leaf.shape} {old_leaf.dtype} got "
                                 f"{new_leaf.shape} {new_leaf.dtype}; shapes and dtypes must match")
        self.param_leaves = [jnp.asarray(x) for x in leaves]
