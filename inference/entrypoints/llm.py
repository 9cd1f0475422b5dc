"""The offline API, shaped like vLLM's `LLM` so evaluation and RL code ports over unchanged.

    llm = LLM(model="smollm2-135m")
    outs = llm.generate(["What is the capital of France?"], SamplingParams(max_tokens=32))
    outs = llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(temperature=0.7, seed=1))

All prompts of a call go into the engine at once and run under continuous batching; a prompt that is invalid on
its own (empty, too long, bad token id) comes back with `error` set and `finish_reason="error"` while the other
prompts of the call complete.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from inference.runtime.compile_cache import apply_cache_setting
from inference.engine.data_parallel import DataParallelEngine
from inference.engine.llm_engine import Engine
from inference.loading.model_loader import load_model
from inference.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inference.runtime.runner import ModelRunner
from inference.sampling.params import SamplingParams
from inference.engine.client import EngineClient
from inference.engine.config import (DTYPES, KV_CACHE_DTYPES, CacheConfig, EngineConfig, check_dtype,
                                     default_page_size)
from inference.lora.request import LoRARequest
from inference.entrypoints.prompts import ParsedPrompt, PromptType, parse_prompts
from inference.entrypoints.replica import build_replica_decoder, make_lora_manager, make_proposer, replica_meshes_for
from inference.entrypoints.streaming import DeltaTracker, EngineLoop, StreamDelta
from kernels_pallas.backend import target_backend
from models.batch_invariant import make_batch_invariant

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BUDGET = 1 << 30  # bytes; devices that report their memory use a fraction of it instead


def resolve_dtype(dtype: str) -> str:
    """A dtype name, with "auto" made bfloat16 on TPU and GPU (what they compute in) and float32 on CPU (which
    has no fast bf16 path, and where results are exact)."""
    if check_dtype(dtype) == "auto":
        return "float32" if target_backend() == "cpu" else "bfloat16"
    return dtype


def kv_cache_budget(kv_cache_memory_bytes: int | None, memory_fraction: float) -> int:
    """Bytes for the KV cache: the explicit budget, else a fraction of free device memory, else 1 GiB."""
    if kv_cache_memory_bytes is not None:
        return int(kv_cache_memory_bytes)
    stats = jax.local_devices()[0].memory_stats() or {}  # local: under jax.distributed devices()[0] is remote
    if "bytes_limit" in stats:
        return int((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * memory_fraction)
    return DEFAULT_CPU_KV_BUDGET


def num_state_slots(config, budget: int, max_num_seqs: int, dtype, enable_prefix_caching: bool,
                    num_speculative_tokens: int = 0) -> int:
    """State slots of a hybrid model's state caches (0 without state layers): the null slot, one per running
    sequence, `num_speculative_tokens` per sequence for verification's per-position states when speculating, and as
    many prefix checkpoints as sequences as long as the state caches take at most half of `budget` (the KV cache
    gets the rest). A ValueError when the budget cannot hold the required states and a KV page beside them."""
    if not config.has_state_layers:
        return 0
    per_seq = config.state_bytes_per_sequence(dtype)
    required = 1 + max_num_seqs * (1 + num_speculative_tokens)
    need = required * per_seq
    if need >= budget:
        raise ValueError(f"the cache budget of {budget} bytes cannot hold the state of max_num_seqs={max_num_seqs} "
                         f"sequences ({per_seq} bytes each, {need} with the null slot"
                         f"{' and the speculative positions' if num_speculative_tokens else ''}) and any KV page; "
                         "raise kv_cache_memory_bytes or lower max_num_seqs")
    checkpoints = max_num_seqs if enable_prefix_caching else 0
    checkpoints = min(checkpoints, max(budget // 2 - need, 0) // per_seq)
    return required + checkpoints


def _num_pages(budget: int, cache: CacheConfig, kv_dtype, configs: list) -> int:
    """KV pages of `cache.page_size` tokens that `budget` bytes (`kv_cache_budget`'s, less a hybrid model's state
    caches) hold for every model in `configs` (the target, and a draft model, whose cache has a slot for every target
    page since it runs on the target's page tables)."""
    # An int8 / fp8 cache keeps one float32 scale per token and KV head (kernels_pallas/kv_cache/writes.py).
    scale_bytes = 4 if cache.kv_cache_dtype in ("int8", "fp8") else 0
    bytes_per_token = sum(c.kv_bytes_per_token(jnp.dtype(kv_dtype).itemsize, scale_bytes=scale_bytes) for c in configs)
    page_size = cache.page_size
    num_pages = int(budget // (bytes_per_token * page_size))
    while num_pages > 0 and sum(c.kv_cache_bytes(num_pages, page_size, kv_dtype) for c in configs) > budget:
        num_pages -= 1  # the layout's padding (an int8 cache's scale rows) costs a few pages at most
    if num_pages < 1:
        raise ValueError(f"a KV budget of {budget} bytes holds no page of {page_size} tokens "
                         f"({bytes_per_token} bytes per token{' with the draft model' if len(configs) > 1 else ''}); "
                         "raise kv_cache_memory_bytes")
    return num_pages


class LLM:
    def __init__(self, model: str = "smollm2-135m", *, dtype: str = "auto", kv_cache_dtype: str | None = None,
                 page_size: int | None = None, kv_cache_memory_bytes: int | None = None, memory_fraction: float = 0.5,
                 max_model_len: int | None = None, max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 scheduling_policy: str = "auto", enable_prefix_caching: bool = True,
                 speculative_method: str | None = None, num_speculative_tokens: int = 4,
                 speculative_model: str | None = None, speculative_adaptive: bool = False, attn_impl: str = "auto",
                 seed: int = 0, compilation_cache_dir: str | None = "default",
                 quantization: str | None = None, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 quantization_group_size: int | None = None, enable_lora: bool = False, max_loras: int = 1,
                 max_lora_rank: int = 16, batch_invariant: bool = False, async_scheduling: bool = True):
        """`dtype`: weights and compute ("float32", "bfloat16", "float16"); "auto" (vLLM's convention) is bfloat16 on
        TPU and GPU and float32 on CPU (`resolve_dtype`). `kv_cache_dtype` None follows it.

        `page_size`: tokens per KV page; None picks the backend's default for the model length
        (`inference/engine/config.py: default_page_size`: 16 on CPU and GPU; on TPU next_pow2(max_model_len) / 16
        clamped to 16-256, the upstream TPU kernels' guidance: larger pages, larger KV DMAs).

        `compilation_cache_dir`: where JAX keeps compiled steps across runs. JAX's cache is process-wide
        configuration, so: None leaves jax.config untouched; a path points the cache there (overriding any earlier
        setting: you asked for it); "default" (vLLM's behaviour: a second start loads its compiled steps from disk)
        enables $PAGEJAX_CACHE_DIR or ~/.cache/pagejax/xla only if no cache is configured yet, so an application's
        own cache setting is kept (inference/runtime/compile_cache.py: apply_cache_setting).

        `quantization`: None (weights in `dtype`), "int8" (per-channel int8 weights, W8A8 matmuls), "int4" (grouped
        int4 layer linears, int8 LM head) or "gguf" (a .gguf model keeps its Q8_0/Q4_0/Q4_1 blocks); see
        models/quantization/modes.py. "int4-awq": AWQ scales searched at load time on the shipped calibration text
        (models/quantization/awq.py; 256 tokens), then "int4". `quantization_group_size`: the int4 group (32, 64 or
        128; default 32 when it divides every input dimension, else 64).

        `tensor_parallel_size`: shard the model over that many devices (GSPMD tensor parallelism; heads, vocab and
        MLP width zero-padded to multiples of it; see docs/sharding.md). 1: one device, as before.

        `data_parallel_size`: that many independent replicas (each its own weights, KV pages and scheduler on its own
        `tensor_parallel_size` devices of this process), requests balanced across them
        (inference/engine/data_parallel.py). Needs data_parallel_size * tensor_parallel_size local devices.

        Speculative decoding: `speculative_method="ngram"` (prompt lookup) or "draft" (a draft model named by
        `speculative_model`: a model, "MODEL:layers=0,3,..." to keep a subset of its layers, or a draft .safetensors
        file from scripts/tools/distill_draft.py; see inference/spec_decode/draft.py), `num_speculative_tokens` drafts per
        step; `speculative_adaptive=True` adapts each request's draft count to its acceptance rate.

        LoRA (vLLM's keywords): `enable_lora=True` serves PEFT adapters per request (`generate(...,
        lora_request=LoRARequest(name, id, path))`); `max_loras` adapters fit on the device at once (one batch can
        mix that many, plus the base model), each of rank up to `max_lora_rank`. See inference/lora/.

        `batch_invariant=True`: a request's logits (so its greedy and seeded tokens and logprobs) are the same bits
        whatever else is batched with it, however its prompt is chunked, prefix-cached or recomputed, and
        `inference.rl.log_probs` over `runner.graphdef` returns the engine's logprobs bit for bit (CPU, float32,
        one device; models/batch_invariant.py, docs/rl.md).

        `async_scheduling` (vLLM's): dispatch each step before the previous step's tokens reach the host, so the
        host's bookkeeping overlaps the device; the outputs are the synchronous engine's (bit for bit with
        `batch_invariant=True`, to rounding otherwise), and steps that cannot overlap exactly run synchronously
        (inference/engine/async_scheduling.py). False: one step at a time."""
        # The flat vLLM keywords, validated and grouped (inference/engine/config.py) before anything is loaded.
        config = EngineConfig.from_kwargs(**{k: v for k, v in locals().items() if k != "self"})
        self.engine_config = config
        apply_cache_setting(config.compilation_cache_dir)
        cache, spec, quant, parallel = config.cache, config.speculative, config.quantization, config.parallel
        dtype = resolve_dtype(config.dtype)
        loaded = load_model(config.model)
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_source = loaded.source
        self.quantization = quant.mode
        if cache.kv_cache_dtype == "int8" and loaded.config.is_mla:
            raise ValueError("kv_cache_dtype='int8' is not supported for MLA's latent cache; use 'fp8' or the model "
                             "dtype")
        kv_dtype = KV_CACHE_DTYPES[cache.kv_cache_dtype or dtype]
        draft = None
        if spec.method == "draft" and loaded.config.has_state_layers:
            raise ValueError("speculative_method='draft' is not supported for a model with state layers "
                             "(linear_attention / mamba): the draft model's runner keeps no state slots; use "
                             "speculative_method='ngram'")
        if spec.method == "draft":
            from inference.spec_decode.draft import load_draft
            draft = load_draft(spec.model, target_config=loaded.config, target_tokenizer=loaded.tokenizer,
                               seed=config.seed)
        context = config.scheduler.max_model_len or loaded.config.max_position_embeddings
        if cache.page_size is None:  # the backend's default for this model length (engine/config.py)
            cache = dataclasses.replace(cache, page_size=default_page_size(target_backend(), context))
        budget = kv_cache_budget(cache.kv_cache_memory_bytes, cache.memory_fraction)
        state_slots = num_state_slots(loaded.config, budget, config.scheduler.max_num_seqs, DTYPES[dtype],
                                      cache.enable_prefix_caching, spec.num_speculative_tokens if spec.method else 0)
        state_bytes = state_slots * loaded.config.state_bytes_per_sequence(DTYPES[dtype]) if state_slots else 0
        num_pages = _num_pages(budget - state_bytes, cache, kv_dtype,
                               [loaded.config] + ([draft.config] if draft is not None else []))
        page_size = cache.page_size
        if None in loaded.config.kv_group_windows:  # full-attention layers keep every page: the pool caps it
            context = min(context, num_pages * page_size)
        scheduler = dataclasses.replace(config.scheduler, max_model_len=context)
        engines = []
        for mesh in replica_meshes_for(parallel):
            decoder = build_replica_decoder(loaded, mesh, dtype=DTYPES[dtype], attn_impl=config.attn_impl,
                                            seed=config.seed, quantization=quant)
            if config.batch_invariant:  # models/batch_invariant.py (refuses MLA, MoE, no C++ kernels)
                make_batch_invariant(decoder)
            lora = make_lora_manager(config.lora, decoder.config, loaded.config, dtype=DTYPES[dtype], mesh=mesh)
            runner = ModelRunner(decoder, num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype, mesh=mesh,
                                 config=loaded.config, lora=lora.slots if lora is not None else None,
                                 num_state_slots=state_slots, state_dtype=DTYPES[dtype])
            proposer = make_proposer(spec, draft, num_pages=num_pages, page_size=page_size, dtype=DTYPES[dtype],
                                     kv_dtype=kv_dtype, attn_impl=config.attn_impl)
            engines.append(Engine(runner, self.tokenizer, scheduler, cache_config=cache, proposer=proposer,
                                  speculative_config=spec, lora=lora))
        self.runners = [e.runner for e in engines]  # one per data-parallel replica
        self.runner = self.runners[0]
        log.info("cache: %d KV pages of %d tokens (%d bytes, growing with the context), %d state slots (%d bytes, "
                 "constant in the context)", num_pages, page_size, self.runner.kv_cache_bytes, state_slots,
                 self.runner.state_cache_bytes)
        self.engine: EngineClient = engines[0] if len(engines) == 1 else DataParallelEngine(engines)
        self._ids = itertools.count()

    # ---- generation -------------------------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. `prompts`: a str, a `TextPrompt` {"prompt": str}, a
        `TokensPrompt` {"prompt_token_ids": [...]}, or a list mixing them (inference/entrypoints/prompts.py);
        `prompt_token_ids=[[...], ...]` is the older spelling of TokensPrompts. `lora_request`: one adapter for every
        prompt, or a list aligned with the prompts (None entries run the base model); needs
        `LLM(enable_lora=True)`."""
        submitted = self.submit(prompts, sampling_params, prompt_token_ids=prompt_token_ids,
                                lora_request=lora_request)
        finished = self._run(sum(1 for s in submitted if s.error is None), use_tqdm)
        outputs = []
        for s in submitted:
            if s.error is not None:
                outputs.append(s.error)
            else:
                outputs.append(finished[s.request_id])
                self.engine.pop_finished(s.request_id)
        return outputs

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, use_tqdm: bool = False,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot render a chat; "
                             "use generate(prompt_token_ids=...)")
        conversations = _conversations(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def stream(self, prompts: PromptType | Sequence[PromptType] | None = None,
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
               prompt_token_ids: Sequence[Sequence[int]] | None = None,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> Iterator[StreamDelta]:
        """Like `generate` (`lora_request` as there), but yield token/text deltas of every request as the engine
        produces them (in this thread). Prompts that fail validation yield one finished delta with the error on
        its output."""
        trackers: dict[str, DeltaTracker] = {}
        for s in self.submit(prompts, sampling_params, prompt_token_ids=prompt_token_ids, lora_request=lora_request):
            if s.error is not None:
                yield StreamDelta(s.request_id, 0, [], "", True, "error", s.error)
            else:
                trackers[s.request_id] = DeltaTracker(s.params)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id not in trackers:
                        continue  # submitted through a background loop
                    yield from trackers[out.request_id].deltas(out)
                    if out.finished:
                        self.engine.pop_finished(out.request_id)
        finally:  # a caller that stops reading early (break, close): its requests are aborted, their pages freed
            for request_id in trackers:
                if request_id in self.engine.requests:
                    self.engine.abort(request_id)
                    self.engine.pop_finished(request_id)

    def background(self) -> EngineLoop:
        """A background engine loop for this model: `submit` from any thread while it generates."""
        return EngineLoop(self.engine)

    def submit(self, prompts: PromptType | Sequence[PromptType] | None = None,
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
               prompt_token_ids: Sequence[Sequence[int]] | None = None,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[Submitted]:
        """Encode and queue every prompt without stepping the engine (`generate` and `stream` step it; a caller
        that keeps its own window of requests, like scripts/generate.py, steps `self.engine` itself). A prompt the
        engine rejects, or whose shape is wrong (a bad adapter too), gets its error output instead
        (`Submitted.error`)."""
        if self.is_sleeping:
            raise RuntimeError("the LLM is asleep (sleep() freed its KV cache); call wake_up() before generating")
        parsed = parse_prompts(prompts, prompt_token_ids)
        params = self._per_prompt(sampling_params, len(parsed))
        loras = _per_prompt_lora(lora_request, len(parsed))
        submitted = []
        for i, (prompt, p) in enumerate(zip(parsed, params)):
            request_id, ids = str(next(self._ids)), prompt.token_ids
            try:
                if prompt.error is not None:
                    raise ValueError(prompt.error)
                ids = ids if ids is not None else self._encode(prompt)
                if loras[i] is None:  # the keyword only when used: engines without LoRA keep their signature
                    self.engine.add_request(request_id, ids, p, prompt=prompt.text)
                else:
                    self.engine.add_request(request_id, ids, p, prompt=prompt.text, lora_request=loras[i])
                submitted.append(Submitted(request_id, p))
            except ValueError as exc:
                log.warning("prompt %d rejected: %s", i, exc)
                submitted.append(Submitted(request_id, p,
                                           _error_output(request_id, prompt.text, ids or [], p, str(exc))))
        return submitted

    def _encode(self, prompt: ParsedPrompt) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_source} has no tokenizer; pass token ids "
                             '({"prompt_token_ids": [...]}) instead of text')
        return self.tokenizer.encode(prompt.text)

    @staticmethod
    def _per_prompt(sampling_params, count: int) -> list[SamplingParams]:
        """One SamplingParams per prompt, every one checked before any prompt is queued."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if isinstance(sampling_params, (str, bytes, dict)) or not isinstance(sampling_params, Iterable):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), not a "
                            f"{type(sampling_params).__name__}; e.g. SamplingParams(temperature=0.0, max_tokens=16)")
        sampling_params = list(sampling_params)
        for i, p in enumerate(sampling_params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] is a {type(p).__name__}, not a SamplingParams; build it with "
                                "SamplingParams(...)")
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {count} prompts")
        return sampling_params

    def _run(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=num_requests, desc="generating", unit="req")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step(finished_only=True):  # only final outputs are read: build no others
                if out.finished and out.request_id not in finished:
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        for request_id, request in list(self.engine.requests.items()):  # aborted meanwhile: no step reported them
            if request.finished and request_id not in finished:
                finished[request_id] = self.engine.output_of(request_id)
        return finished

    def warmup(self, prefill: bool = True, extras: bool = True) -> int:
        """Compile every step variant serving can run (decode, prefill and speculative verification buckets with
        their sampler and logprob flags, the draft model's steps), so the first requests compile nothing: the one
        call a server makes before traffic. `prefill=False` warms decode buckets only, `extras=False` skips the
        logprob / structured-output / penalty variants (both for quick starts). Returns the variants compiled."""
        return self.engine.warmup(prefill=prefill, extras=extras)

    # ---- RL hooks ---------------------------------------------------------------------------------------------
    def get_params(self) -> nnx.State:
        return self.runner.params

    def update_weights(self, params: nnx.State, *, check_finite: bool = True) -> None:
        """Swap in new parameters (same shapes and dtypes); nothing recompiles. The prefix cache is dropped, since
        its pages hold keys and values of the old weights. Weights holding NaN or inf are refused
        (`ModelRunner.update_weights`; `check_finite=False` skips that read of the weights)."""
        for runner in self.runners:  # every data-parallel replica, each into its own devices' shardings
            runner.update_weights(params, check_finite=check_finite)
        self.engine.reset_prefix_cache()

    def add_lora(self, lora_request: LoRARequest) -> int:
        """Load and validate an adapter now rather than on its first request (vLLM's `add_lora`); returns its id.
        Needs `LLM(enable_lora=True)`; a bad adapter is a ValueError naming the problem."""
        if not self.engine_config.lora.enable_lora:
            raise ValueError("add_lora needs an LLM built with enable_lora=True")
        return self.engine.lora.register(lora_request)

    def update_lora(self, lora: str | int, weights: dict) -> None:
        """Replace a loaded adapter's A/B in place (RL: a LoRA-only training step), by name or id: `weights` maps
        projection names (`layers.3.q_proj`, models/weights.py) to (a [in, r], b [r, out]) pairs (x @ a @ b, the
        transpose of PEFT's lora_A / lora_B), for any of the projections the adapter has, at its rank. Nothing
        recompiles; the prefix cache is dropped (its pages hold keys and values of the old adapter)."""
        if not self.engine_config.lora.enable_lora:
            raise ValueError("update_lora needs an LLM built with enable_lora=True")
        self.engine.lora.update(lora, weights)  # one replica: enable_lora rejects data_parallel_size > 1
        self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1, *, keep_weights_on_host: bool = True) -> None:
        """Free device memory between rollouts (vLLM's sleep mode): level 1 deletes the KV cache's buffers (the
        prefix cache is dropped with them), level 2 also releases the weights, kept as host numpy unless
        `keep_weights_on_host=False` (then `update_weights` must refill them). `wake_up` restores; generating while
        asleep raises. No request may be in flight. A draft model's cache (speculative_method="draft") is kept."""
        self.engine.settle()  # async scheduling: a step still on the device would use the freed buffers
        if self.engine.has_unfinished_requests():
            raise RuntimeError("sleep: requests are still in flight; let them finish or abort them first")
        for runner in self.runners:
            runner.sleep(level, keep_weights_on_host=keep_weights_on_host)
        self.engine.reset_prefix_cache()

    def wake_up(self) -> None:
        """Undo `sleep`: the weights back on device (the host copy, or what `update_weights` gave meanwhile) and a
        fresh KV cache. Nothing recompiles."""
        for runner in self.runners:
            runner.wake_up()

    @property
    def is_sleeping(self) -> bool:
        return any(runner.sleep_level for runner in self.runners)

    def get_tokenizer(self):
        return self.tokenizer


def _per_prompt_lora(lora_request, count: int) -> list:
    """One LoRARequest (or None) per prompt: a single request (or None) for all, or a list aligned with them."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if isinstance(lora_request, (str, bytes, dict)) or not isinstance(lora_request, Iterable):
        raise TypeError(f"lora_request must be a LoRARequest, None or a list of them (one per prompt), not a "
                        f"{type(lora_request).__name__}")
    loras = list(lora_request)
    for i, lora in enumerate(loras):
        if lora is not None and not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request[{i}] is a {type(lora).__name__}, not a LoRARequest or None")
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} lora_requests for {count} prompts; give one per prompt (None: the base "
                         "model) or a single LoRARequest for all")
    return loras


def _conversations(messages) -> list[list[dict[str, Any]]]:
    """`chat`'s argument as a list of conversations: one conversation (a list of message dicts) or a list of them;
    a TypeError naming the first message that is not a dict with a string `role`."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or not messages:
        raise TypeError("chat() takes a conversation, a non-empty list of {'role': ..., 'content': ...} dicts, or a "
                        f"list of conversations; got {type(messages).__name__} {str(messages)[:60]!r}")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conversation in enumerate(conversations):
        if isinstance(conversation, (str, bytes, dict)) or not isinstance(conversation, Sequence) or not conversation:
            raise TypeError(f"chat(): conversation {i} must be a non-empty list of {{'role': ..., 'content': ...}} "
                            f"dicts, got {type(conversation).__name__} {str(conversation)[:60]!r}")
        for j, message in enumerate(conversation):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise TypeError(f"chat(): message {j} of conversation {i} must be a dict with a string 'role' (and "
                                f"its 'content'), got {type(message).__name__} {str(message)[:60]!r}")
    return conversations


@dataclasses.dataclass
class Submitted:
    """A prompt `LLM.submit` queued (`error` None) or rejected (`error`: its finished error output)."""

    request_id: str
    params: SamplingParams
    error: RequestOutput | None = None  # the error output of a rejected prompt


def _error_output(request_id: str, prompt: str | None, ids: list[int], params: SamplingParams,
                  error: str) -> RequestOutput:
    outputs = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="error") for i in range(params.n)]
    metrics = RequestMetrics(arrival_time=0.0, num_prompt_tokens=len(ids))
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=ids, prompt_logprobs=None,
                         outputs=outputs, finished=True, metrics=metrics, error=error)


__all__ = ["LLM", "Submitted"]
