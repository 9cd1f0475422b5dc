"""The jitted model steps and the device state they own (parameters, paged KV cache, a hybrid model's state cache).

`prefill_step` and `decode_step` are two `jax.jit` entry points over one pure step function
`(params, kv_caches, model_input, sampling) -> (sampled tokens + logprobs, new kv_caches)`. They compile once per
static bucket (tokens, sequences, pages per sequence, longest query, sampler flags); the KV cache is donated so it is
updated in place. Only the sampled tokens (and logprobs when asked) come back to the host.

A hybrid model's state layers (`ModelConfig.state_layers`) each keep a `RecurrentState` of `num_state_slots` slots
(kernels_pallas/recurrent/layout.py), appended to the cache list after the KV caches (`ModelConfig.cache_index`), so
they are donated and updated in place with them; `copy_state_slots` runs the engine's queued slot copies (forks,
prefix checkpoints) before a step, as `copy_pages` runs page copies.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference.lora.slots import LoRASlots
from inference.runtime import new_weights
from inference.runtime.reshard import reshard_all
from inference.runtime.batch import ModelInput, SpecInput, TokenFeed, bucket
from inference.runtime.packing import Packing, pack, unpack
from inference.sampling.sampler import (SamplerOutput, SamplingTensors, compute_logprobs, process_logits, sample,
                                        sample_with_logprobs, token_rank)
from inference.sampling.params import MAX_LOGPROBS, SAMPLING_EPS
from inference.sampling.rejection import probs_from_logits, rejection_sample
from kernels_pallas.kv_cache.writes import copy_latent_pages, copy_pages
from kernels_pallas.kv_cache.layout import has_scales
from kernels_pallas.recurrent.layout import copy_state_slots, zero_state
from models.attention import QuantizedKV
from models.decoder import Decoder
from models.lora import bind_lora


@dataclasses.dataclass
class StepOutput:
    tokens: np.ndarray  # i32[S]
    logprob: np.ndarray | None = None  # f32[S]
    top_ids: np.ndarray | None = None  # i32[S, k]
    top_logprobs: np.ndarray | None = None
    rank: np.ndarray | None = None  # i32[S]: the sampled token's vocabulary rank (logprob steps only)
    prompt_logprob: np.ndarray | None = None  # f32[T]: logprob of target_ids[t] after token t
    prompt_top_ids: np.ndarray | None = None  # i32[T, k]
    prompt_top_logprobs: np.ndarray | None = None
    prompt_rank: np.ndarray | None = None  # i32[T]: rank of target_ids[t]
    emitted: np.ndarray | None = None  # i32[S, k+1]: speculative steps: accepted drafts, then one more token
    num_accepted: np.ndarray | None = None  # i32[S]


@dataclasses.dataclass
class PendingStep:
    """A dispatched step's outputs, still device arrays: `sampled.tokens` i32[S] can be the next step's input tokens
    before the host has seen them (async scheduling, inference/engine/async_scheduling.py)."""

    sampled: SamplerOutput
    prompt: tuple | None = None  # prompt logprobs (logprob, top ids, top logprobs, rank)
    spec: list | None = None  # speculative steps: [emitted, num_accepted]
    tokens_only: bool = True  # no logprobs asked: only the tokens come back
    feed: jax.Array | None = None  # i32[W]: the sampled tokens widened for the next step's `TokenFeed.prev`

    @property
    def tokens(self) -> jax.Array:
        return self.sampled.tokens


def _step(graphdef, treedef, layout: StepLayout, param_leaves, kv_caches, inp: ModelInput, sampling: SamplingTensors,
          lora=None, *, use_filters: bool, logprobs: bool, prompt_logprobs: bool):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, param_leaves))
    if lora is not None:  # LoRA slot arrays (inference/lora/slots.py): each token's adapter delta on the projections
        bind_lora(model, lora, inp.lora_slots)
    tokens = inp.tokens
    if inp.feed is not None:  # async scheduling: the in-flight step's tokens, gathered here rather than by the host
        tokens = tokens.at[inp.feed.dst].set(inp.feed.prev[inp.feed.src], mode="drop")
    hidden, kv_caches = model(tokens, inp.positions, kv_caches, inp.attn)
    if layout.kv_sharding is not None:  # the donated caches keep their sharding, so they are updated in place
        kv_caches = [jax.lax.with_sharding_constraint(c, layout.kv_sharding) for c in kv_caches]
    logits_of = functools.partial(_logits, model, layout)
    if inp.spec is not None:
        sampled = _verify(logits_of, hidden, inp.spec, sampling, use_filters=use_filters, logprobs=logprobs)
    else:
        logits = logits_of(hidden[inp.logits_indices])
        # Top logprobs are computed at the largest k any request may ask for, so k never adds a compiled variant.
        sampled = sample_with_logprobs(logits, sampling, use_filters=use_filters,
                                       num_top=MAX_LOGPROBS if logprobs else 0, invariant=model.batch_invariant)
    prompt = None
    if prompt_logprobs:
        prompt_logits, targets = logits_of(hidden), jnp.maximum(inp.target_ids, 0)
        prompt = (*compute_logprobs(prompt_logits, targets, MAX_LOGPROBS, invariant=model.batch_invariant),
                  token_rank(prompt_logits, targets))
    if inp.feed is None:
        return sampled, prompt, kv_caches
    tokens = (sampled[0] if inp.spec is not None else sampled).tokens  # a verification step: (output, drafts...)
    wide = jnp.zeros_like(inp.feed.prev).at[:tokens.shape[0]].set(tokens)  # the feed is never narrower (engine)
    return sampled, prompt, kv_caches, wide


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Static facts of a tensor-parallel model for the step: the real vocabulary (logits past it are padding) and
    the shardings of the KV cache and of the logits sampling reads (replicated). All None: one device."""

    vocab_size: int | None = None
    kv_sharding: jax.sharding.NamedSharding | None = None
    logits_sharding: jax.sharding.NamedSharding | None = None
    vocab_axis: str | None = None  # the mesh axis the LM head's vocab dimension is split over


def jit_step(graphdef, treedef, layout: StepLayout):
    """The jitted step `(param_leaves, kv_caches, inp, sampling, lora=None, *, use_filters, logprobs,
    prompt_logprobs)`, KV cache donated: what the runner calls, and what `scripts/tools/aot_compile.py` compiles from
    abstract inputs."""
    return jax.jit(functools.partial(_step, graphdef, treedef, layout),
                   static_argnames=("use_filters", "logprobs", "prompt_logprobs"), donate_argnums=(1,))


def jit_packed_step(graphdef, treedef, layout: StepLayout, buffer_sharding: jax.sharding.Sharding | None = None):
    """The jitted step over one packed buffer (`inference/runtime/packing.py`): `(param_leaves, kv_caches, buffer,
    passed, lora, packing, use_filters, logprobs, prompt_logprobs)`, all positional (the last four static), the
    step's `(inp, sampling)` unpacked inside it, KV cache donated. What `ModelRunner.execute` runs: one host ->
    device copy per step.

    `buffer_sharding` (the runner's devices, replicated): where the jit itself places the buffer, handed over as the
    numpy array `pack` made. The jit's C++ dispatch copies it there for a fraction of what a separate
    `jax.device_put` costs in Python (BENCHMARKS.md, host overhead). JAX takes no keyword arguments beside
    `in_shardings`, hence the positional flags."""
    def packed_step(param_leaves, kv_caches, buffer, passed, lora, packing: Packing, use_filters: bool,
                    logprobs: bool, prompt_logprobs: bool):
        inp, sampling = unpack(packing, buffer, passed)
        return _step(graphdef, treedef, layout, param_leaves, kv_caches, inp, sampling, lora, use_filters=use_filters,
                     logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    placed = {} if buffer_sharding is None else {"in_shardings": (None, None, buffer_sharding, None, None)}
    # Named for traces: scripts/bench/trace_summary.py finds the step as the program whose name says "step".
    return jax.jit(packed_step, static_argnums=(5, 6, 7, 8), donate_argnums=(1,), **placed)


def _logits(model, layout: StepLayout, hidden):
    logits = model.logits(hidden)
    if layout.vocab_axis is not None:
        # Pin the LM-head output vocab-parallel first, so XLA gathers the [T, V] logits and not the [D, V] weight.
        spec = jax.sharding.PartitionSpec(*(None,) * (logits.ndim - 1), layout.vocab_axis)
        logits = jax.lax.with_sharding_constraint(logits, jax.sharding.NamedSharding(layout.logits_sharding.mesh, spec))
    if layout.vocab_size is not None and logits.shape[-1] != layout.vocab_size:
        logits = logits[..., :layout.vocab_size]
    if layout.logits_sharding is not None:
        logits = jax.lax.with_sharding_constraint(logits, layout.logits_sharding)
    return logits


def _verify(logits_of, hidden, spec: SpecInput, sampling: SamplingTensors, *, use_filters: bool, logprobs: bool):
    """Speculative verification: (SamplerOutput for position 0, emitted i32[S, k+1], num_accepted i32[S]).

    Drafts are deterministic proposals (n-gram, greedy draft model: the draft distribution is one-hot) unless
    `spec.draft_probs` carries the distributions a draft model sampled from. Rows with no drafts emit one
    token sampled exactly like a plain decode. A row that verifies drafts samples from the same distributions but
    spends its random key differently, so a seeded request gives other (equally distributed) tokens when it
    speculates than when it does not. Logprobs (only requested by rows that
    do not speculate) come from position 0.
    """
    logits = logits_of(hidden[spec.logits_indices])  # [S, k+1, V]
    probs = probs_from_logits(logits, sampling, use_filters)
    emitted, accepted = rejection_sample(probs, spec.draft_probs, spec.draft_tokens, sampling.keys(),
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
        rank = token_rank(src, first)
    else:
        lp, top_ids, top_lp = compute_logprobs(logits[:, 0], first, 0)
        rank = None
    return SamplerOutput(tokens=first, logprob=lp, top_ids=top_ids, top_logprobs=top_lp, rank=rank), emitted, accepted


def _new_cache(spec):
    """One caching layer's zeroed cache from its `ModelConfig.kv_cache_spec`: an array, or pages + scales for an
    int8 cache."""
    if isinstance(spec, tuple):
        pages, scales = spec
        return QuantizedKV(pages=jnp.zeros(pages.shape, pages.dtype), scales=jnp.zeros(scales.shape, scales.dtype))
    return jnp.zeros(spec.shape, spec.dtype)


def _copy_cache_pages(cache, src, dst):
    """Copy-on-write of pages src -> dst in one cache: a per-head KV cache `[Hkv, pages, ...]` (int8 with its scales)
    or an MLA latent cache, whose pages lead (`[pages, ...]`)."""
    if isinstance(cache, QuantizedKV):
        return QuantizedKV(*copy_pages(cache.pages, src, dst, cache.scales))
    if cache.ndim < 4:
        return copy_latent_pages(cache, src, dst)
    return copy_pages(cache, src, dst)


class ModelRunner:
    def __init__(self, model: Decoder, *, num_pages: int, page_size: int, kv_dtype=jnp.float32,
                 mesh: jax.sharding.Mesh | None = None, config=None, lora: LoRASlots | None = None,
                 num_state_slots: int = 0, state_dtype=None):
        """`mesh`: tensor parallelism over its "model" axis (sharding/): parameters and KV caches get NamedShardings
        and XLA inserts the collectives. `config`: the model's real config when `model` was padded for the mesh
        (sharding.shard_decoder); `self.config` is that one, the KV cache follows the padded `model.config`.
        `lora`: LoRA slot arrays every step reads (built for `model.config` and `mesh`); None: no LoRA.
        `num_state_slots`: slots of each state layer's cache (a hybrid model; slot 0 the null slot), its conv state
        in `state_dtype` (the model dtype; default `kv_dtype`, float32 for a quantized cache)."""
        padded = model.config
        self.lora = lora
        self.config = config = config or padded
        self.page_size = page_size
        self.num_pages = num_pages
        self.mesh = mesh
        if any(layer.attn.mesh != mesh for layer in model.layers):
            # Attention runs per head shard under shard_map only if the model was built for this mesh
            # (`Decoder(mesh=)`, `sharding.shard_decoder`); the runner does not rewrite a built module.
            raise ValueError(f"the model's attention was built for mesh {model.layers[0].attn.mesh}, the runner got "
                             f"mesh={mesh}; build it with sharding.shard_decoder(..., mesh) (or Decoder(mesh=...))")
        # The attention kernel the steps run (the engine asks which bucket axes it pays for).
        self.attn_impl = getattr(model.layers[0].attn, "attn_impl", "auto")
        self.kv_dtype = jnp.dtype(kv_dtype)  # and which cache dtype it reads (whether the CPU kernel reads it)
        self.graphdef, params = nnx.split(model)
        # The jitted steps take the parameters as a flat list of arrays: flattening an nnx.State on every call
        # cost milliseconds of host time per step (Python-level Variable flattening; BENCHMARKS_HISTORY.md, host
        # overhead), a list next to nothing.
        self.param_leaves, self.param_treedef = jax.tree.flatten(params)
        # What update_weights checks new leaves against (the leaves themselves are gone while asleep).
        self._param_avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in self.param_leaves]
        # One device: where the steps run; update_weights moves leaves from elsewhere there.
        self._device = next(iter(self.param_leaves[0].devices()))
        # Where a step's input tokens (and any other per-step array made on the device) live, committed there: the
        # host's (numpy) and those gathered on the device from the previous step's samples (async scheduling) must
        # reach the jitted step alike, or each would compile its own variant (a one-device KV cache is committed
        # there too, for the same reason).
        self.token_sharding = jax.sharding.make_single_device_sharding(self._device)
        # A dispatched step's tokens start their device -> host copy at once (`execute(fetch=False)`), so the fetch
        # finds them on the host; on a CPU device the buffer is host memory already, and starting the copy costs the
        # host time while the step runs and saves the fetch nothing (BENCHMARKS.md, host overhead, thirteenth round).
        self.copies_early = self._device.platform != "cpu"
        spec = padded.kv_cache_spec(num_pages, page_size, kv_dtype)
        self.num_state_slots = num_state_slots if padded.has_state_layers else 0
        if padded.has_state_layers:
            if num_state_slots < 2:
                raise ValueError(f"a model with state layers needs num_state_slots >= 2 (the null slot and one per "
                                 f"running sequence), got {num_state_slots}")
            if mesh is not None:
                raise ValueError("tensor parallelism with state layers (linear_attention / mamba) is not supported "
                                 "yet: the state caches have no partition rule; use tensor_parallel_size=1")
            state_dtype = state_dtype or (jnp.float32 if has_scales(kv_dtype) else kv_dtype)
        self._state_specs = [padded.state_cache_spec(i, num_state_slots, state_dtype) for i in padded.state_layers] \
            if padded.has_state_layers else []
        layout = StepLayout(vocab_size=config.vocab_size if config.vocab_size != padded.vocab_size else None)
        self.param_shardings = None
        self._kv_spec, self._num_kv_layers, self._kv_sharding = spec, padded.num_kv_layers, None
        self.sleep_level = 0  # 0 awake; 1 KV cache freed; 2 weights freed too (sleep / wake_up)
        self._host_weights: list[np.ndarray] | None = None
        if mesh is None:
            self.kv_caches = self._zero_kv_caches()
        else:
            from sharding.partition import kv_cache_sharding, param_shardings, replicated
            self.param_shardings = param_shardings(params, mesh)
            self.param_leaves = self._place(self.param_leaves)
            # MLA's latent cache has no head axis: every device keeps the whole latent (docs/sharding.md).
            kv_sharding = replicated(mesh) if padded.is_mla else kv_cache_sharding(mesh, padded.num_kv_heads)
            if has_scales(kv_dtype) and not padded.is_mla:  # int8 / fp8: the scales are head-major too, same split
                kv_sharding = QuantizedKV(pages=kv_sharding, scales=kv_sharding)
            self._kv_sharding = kv_sharding
            self.token_sharding = replicated(mesh)
            self.kv_caches = self._zero_kv_caches()
            vocab_axis = "model" if padded.vocab_size % mesh.shape["model"] == 0 else None
            layout = dataclasses.replace(layout, kv_sharding=kv_sharding, logits_sharding=replicated(mesh),
                                         vocab_axis=vocab_axis)
        # Two jitted functions, so each entry point keeps its own compilation cache (and count): `execute` runs the
        # packed ones (one host -> device copy a step); the plain ones take the step's pytrees as they are (device
        # replays, `scripts/tools/aot_compile.py`, profiles).
        self.prefill_step = jit_step(self.graphdef, self.param_treedef, layout)
        self.decode_step = jit_step(self.graphdef, self.param_treedef, layout)
        self.packed_prefill_step = jit_packed_step(self.graphdef, self.param_treedef, layout, self.token_sharding)
        self.packed_decode_step = jit_packed_step(self.graphdef, self.param_treedef, layout, self.token_sharding)
        # Caches of each KV cache group (kv_cache_manager.py): copy-on-write copies name one group's pages.
        group_of = {padded.kv_layer(i): padded.kv_group(i) for i in padded.attention_layers}
        self.group_caches = [[c for c in sorted(group_of) if group_of[c] == g]
                             for g in range(len(padded.kv_group_windows))]
        kv_sharding = layout.kv_sharding
        self._copy_pages = jax.jit(
            lambda caches, src, dst: [_copy_cache_pages(c, src, dst) if kv_sharding is None else
                                      jax.lax.with_sharding_constraint(_copy_cache_pages(c, src, dst), kv_sharding)
                                      for c in caches], donate_argnums=(0,))
        self._copy_state = jax.jit(lambda caches, src, dst: [copy_state_slots(c, src, dst) for c in caches],
                                   donate_argnums=(0,))
        # Async scheduling's token feed (`TokenFeed`): the width of the sampled tokens every step also returns for
        # the next step to gather from (the engine sets its largest sequence bucket; None: each step's own).
        self.feed_width: int | None = None

    def _zero_kv_caches(self) -> list:
        """A zeroed KV cache per caching layer, created in its shards under a mesh (never whole on one device), and
        committed to its devices: the caches every step returns are, and the first step must see the same kind."""
        zeros = jax.jit(lambda: _new_cache(self._kv_spec), out_shardings=self._kv_sharding or self.token_sharding)
        states = [jax.jit(functools.partial(zero_state, spec), out_shardings=self.token_sharding)()
                  for spec in self._state_specs]
        return [zeros() for _ in range(self._num_kv_layers)] + states

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the whole KV cache (the state caches excluded), summed over devices."""
        return sum(c.size * c.dtype.itemsize for c in jax.tree.leaves(self.kv_caches[:self._num_kv_layers]))

    @property
    def state_cache_bytes(self) -> int:
        """Bytes of the state caches of a hybrid model's state layers (0 without): constant in the context."""
        return sum(c.size * c.dtype.itemsize for c in jax.tree.leaves(self.kv_caches[self._num_kv_layers:]))

    def num_compilations(self) -> dict[str, int]:
        """Compiled variants of each step so far (one per static bucket seen), and of the copy-on-write page copy
        (one per power-of-two count of copies)."""
        return {"prefill": self.packed_prefill_step._cache_size(), "decode": self.packed_decode_step._cache_size(),
                "copy_pages": self._copy_pages._cache_size(), "copy_state_slots": self._copy_state._cache_size()}

    def noop_feed(self, num_tokens: int, num_seqs: int) -> TokenFeed:
        """A feed that writes nothing (every entry dropped at the token bucket), of the width the engine's steps
        use: what a step without an in-flight predecessor carries (made once per shape)."""
        width = self.feed_width if self.feed_width is not None and self.feed_width >= num_seqs else num_seqs
        return _noop_feed(num_tokens, num_seqs, width, self.token_sharding)

    def execute(self, inp: ModelInput, sampling: SamplingTensors, *, is_decode: bool, use_filters: bool = False,
                logprobs: bool = False, prompt_logprobs: bool = False, fetch: bool = True) -> StepOutput | PendingStep:
        """Run one step; only the sampled tokens (and the logprobs asked for) come back to the host. `fetch=False`
        returns at once with the step's device outputs (`PendingStep`; JAX dispatch is asynchronous): async
        scheduling feeds its tokens to the next step on device and `fetch`es them while that step computes."""
        if self.sleep_level:
            raise RuntimeError(f"the model runner is asleep (sleep level {self.sleep_level}: its KV cache"
                               f"{' and weights' if self.sleep_level == 2 else ''} are freed); call wake_up() first")
        fn = self.packed_decode_step if is_decode else self.packed_prefill_step
        lora = None
        if self.lora is not None:
            lora = self.lora.arrays
            if inp.lora_slots is None:  # warm-up and other callers without adapters: every token on slot 0
                inp = inp.replace(lora_slots=np.zeros(inp.tokens.shape[0], np.int32))
        feed = inp.feed if inp.feed is not None else self.noop_feed(inp.tokens.shape[0], inp.logits_indices.shape[0])
        if self._state_specs and inp.attn.state_slots is None:  # warm-up and other callers: every row on slot 0
            inp = inp.replace(attn=inp.attn.replace(state_slots=np.zeros(inp.logits_indices.shape[0], np.int32)))
        # The step's numpy arrays in one buffer, one copy, which the jit places on the runner's devices (its
        # in_shardings); device arrays (the feed's previous tokens) pass through.
        packing, buffer, passed = pack((inp.replace(feed=feed), sampling))
        sampled, prompt, self.kv_caches, wide = fn(self.param_leaves, self.kv_caches, buffer, passed, lora, packing,
                                                   use_filters, logprobs, prompt_logprobs)
        spec = None
        if inp.spec is not None:
            sampled, *spec = sampled
        pending = PendingStep(sampled, prompt, spec, tokens_only=not (logprobs or prompt_logprobs or spec), feed=wide)
        if not fetch:
            if self.copies_early:
                for leaf in jax.tree.leaves(pending.tokens if pending.tokens_only else (sampled, prompt, spec)):
                    leaf.copy_to_host_async()  # the readback overlaps the next step instead of following it
            return pending
        return self.fetch(pending)

    @staticmethod
    def fetch(pending: PendingStep) -> StepOutput:
        """The host copy of a dispatched step's outputs (waits for the step to finish)."""
        if pending.tokens_only:
            return StepOutput(tokens=np.asarray(pending.sampled.tokens))
        host = jax.device_get((pending.sampled, pending.prompt, pending.spec))
        out = StepOutput(tokens=host[0].tokens, logprob=host[0].logprob, top_ids=host[0].top_ids,
                         top_logprobs=host[0].top_logprobs, rank=host[0].rank)
        if pending.spec:
            out.emitted, out.num_accepted = host[2]
        if host[1] is not None:
            out.prompt_logprob, out.prompt_top_ids, out.prompt_top_logprobs, out.prompt_rank = host[1]
        return out

    def copy_pages(self, copies: list[tuple[int, int]], group: int = 0) -> None:
        """Copy whole pages src -> dst in every cache of KV cache group `group` (copy-on-write), padded to a
        power-of-two count."""
        size = bucket(len(copies))
        padded = copies + [copies[-1]] * (size - len(copies))  # repeating a pair rewrites the same value
        src, dst = (np.asarray(x, np.int32) for x in zip(*padded))
        index = self.group_caches[group]
        if len(index) == len(self.kv_caches):
            self.kv_caches = self._copy_pages(self.kv_caches, src, dst)
            return
        for c, cache in zip(index, self._copy_pages([self.kv_caches[c] for c in index], src, dst)):
            self.kv_caches[c] = cache

    def copy_state_slots(self, copies: list[tuple[int, int]]) -> None:
        """Copy state slots src -> dst in every state layer's cache (forks, prefix checkpoints), padded to a
        power-of-two count with (0, 0) pairs (the null slot onto itself)."""
        size = bucket(len(copies))
        padded = copies + [(0, 0)] * (size - len(copies))
        src, dst = (np.asarray(x, np.int32) for x in zip(*padded))
        n = self._num_kv_layers
        self.kv_caches = self.kv_caches[:n] + self._copy_state(self.kv_caches[n:], src, dst)

    @property
    def params(self) -> nnx.State:
        """The model's parameters as an nnx.State (a fresh view of the arrays the steps use)."""
        if self.param_leaves is None:
            raise RuntimeError("the weights were freed by sleep(level=2); call wake_up() (or update_weights) first")
        return jax.tree.unflatten(self.param_treedef, self.param_leaves)

    def update_weights(self, params: nnx.State, *, check_finite: bool = True) -> None:
        """Swap in parameters of the same structure, shapes and dtypes: the compiled steps are reused as they are.

        The new leaves may live anywhere: host numpy, another device, or any sharding over any mesh (a trainer's
        FSDP layout); each is put into the runner's own sharding, device to device for arrays already on devices
        (inference/runtime/reshard.py), so the steps see exactly the shardings they were compiled for.
        `check_finite`: refuse weights holding NaN or inf (a diverged trainer's: the model would sample token 0
        and stop, silently), at the cost of one read of the weights on the device."""
        placed = self._place(new_weights.checked_leaves(params, self.param_treedef, self._param_avals))
        if check_finite:
            new_weights.check_finite(placed, self.param_treedef, self._param_avals)
        self.param_leaves = placed
        self._host_weights = None  # the new weights supersede a host copy kept by sleep(level=2)

    # ---- memory release between rollouts (RL): inference/rl docs, docs/rl.md --------------------------------------
    def sleep(self, level: int = 1, *, keep_weights_on_host: bool = True) -> None:
        """Free device memory: level 1 the KV cache (its buffers are deleted; the caller drops the pages'
        bookkeeping), level 2 the weights too, copied to host numpy first unless `keep_weights_on_host=False`
        (then `update_weights` must refill them before `wake_up`). Weight buffers are released, not deleted: a
        trainer that shares the arrays (`update_weights` without a copy) keeps them alive and valid."""
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (free the KV cache) or 2 (the weights too), got {level!r}")
        if self.sleep_level >= level:
            return
        if self.kv_caches is not None:
            for leaf in jax.tree.leaves(self.kv_caches):
                leaf.delete()  # only the runner holds its caches
            self.kv_caches = None
        if level == 2 and self.param_leaves is not None:
            self._host_weights = jax.device_get(self.param_leaves) if keep_weights_on_host else None
            self.param_leaves = None
        self.sleep_level = level

    def wake_up(self) -> None:
        """Restore what `sleep` freed: the weights from their host copy (unless `update_weights` already gave new
        ones) and a zeroed KV cache. Compiled steps are kept, so nothing recompiles."""
        if self.param_leaves is None:
            if self._host_weights is None:
                raise RuntimeError("wake_up: the weights were dropped by sleep(level=2, keep_weights_on_host=False); "
                                   "call update_weights(params) first")
            self.param_leaves, self._host_weights = self._place(self._host_weights), None
        if self.kv_caches is None:
            self.kv_caches = self._zero_kv_caches()
        self.sleep_level = 0

    def _place(self, leaves: list) -> list[jax.Array]:
        """Parameter leaves on the runner's devices: each into its NamedSharding under a mesh (every device gets
        only its slice), else onto the default device. The one copy path of the constructor and `update_weights`."""
        if self.param_shardings is None:
            # Leaves already on the device (or on the host) stay as jnp.asarray leaves them: committing them would
            # give the jitted steps another input signature (a new entry in their cache).
            if all(not isinstance(x, jax.Array) or x.devices() == {self._device} for x in leaves):
                return [jnp.asarray(x) for x in leaves]
            return reshard_all(leaves, [jax.sharding.make_single_device_sharding(self._device)] * len(leaves))
        return reshard_all(leaves, self.param_shardings)


def noop_feed_arrays(num_tokens: int, num_seqs: int, width: int) -> TokenFeed:
    """A token feed that writes nothing (every entry dropped at the token bucket), all numpy: what a step without
    an in-flight predecessor carries (`ModelRunner.noop_feed`), and what a deviceless compile of the step gives it
    (`scripts/tools/aot_steps.py`)."""
    return TokenFeed(prev=np.zeros(width, np.int32), dst=np.full(num_seqs, num_tokens, np.int32),
                     src=np.zeros(num_seqs, np.int32))


@functools.lru_cache(maxsize=256)
def _noop_feed(num_tokens: int, num_seqs: int, width: int, sharding: jax.sharding.Sharding) -> TokenFeed:
    """`ModelRunner.noop_feed`'s arrays, read-only: `prev` on the device, as a real feed's (the step's output) is."""
    feed = noop_feed_arrays(num_tokens, num_seqs, width)
    feed.dst.flags.writeable = feed.src.flags.writeable = False
    return feed.replace(prev=jax.device_put(feed.prev, sharding))
