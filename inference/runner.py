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

from inference.batch import ModelInput
from inference.batch import BucketLimits, bucket, bucket_ladder
from inference.sampler import SamplingTensors, compute_logprobs, sample_with_logprobs
from inference.sampling_params import MAX_LOGPROBS
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


def _step(graphdef, treedef, param_leaves, kv_caches, inp: ModelInput, sampling: SamplingTensors, *,
          use_filters: bool, logprobs: bool, prompt_logprobs: bool):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, param_leaves))
    hidden, kv_caches = model(inp.tokens, inp.positions, kv_caches, inp.attn)
    logits = model.logits(hidden[inp.logits_indices])
    # Top logprobs are computed at the largest k any request may ask for, so k never adds a compiled variant.
    sampled = sample_with_logprobs(logits, sampling, use_filters=use_filters,
                                   num_top=MAX_LOGPROBS if logprobs else 0)
    prompt = None
    if prompt_logprobs:
        prompt = compute_logprobs(model.logits(hidden), jnp.maximum(inp.target_ids, 0), MAX_LOGPROBS)
    return sampled, prompt, kv_caches


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
        if not (logprobs or prompt_logprobs):
            return StepOutput(tokens=np.asarray(sampled.tokens))
        host = jax.device_get((sampled, prompt))
        out = StepOutput(tokens=host[0].tokens, logprob=host[0].logprob, top_ids=host[0].top_ids,
                         top_logprobs=host[0].top_logprobs)
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
