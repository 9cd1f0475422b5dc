"""The engine: requests in, one model step at a time, outputs out.

`add_request` validates and queues; `step` asks the scheduler for a batch, builds the padded input, runs the jitted
step, and folds the sampled tokens back into the sequences (stop checks, detokenization, logprobs, metrics).
Everything here is host-side Python over numpy; the only device work is the runner's step.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import operator
import random
import threading
import time

import numpy as np

from inference.runtime.batch import BucketLimits, ModelInput, build_model_input, bucket
from inference.runtime.step_variants import StepFlags, fold_extras, penalty_length
from inference.engine.compile_budget import padding_is_free, reads_padded_pages, scheduling_policy, warmup_serving
from inference.engine.pages.kv_cache_manager import KVCacheManager
from inference.engine.pages.state_slots import StateSlotManager
from inference.engine.metrics import EngineStats
from inference.engine.logprobs import TokenTexts
from inference.engine import fold
from inference.engine.outputs import RequestMetrics, RequestOutput
from inference.runtime.runner import ModelRunner, PendingStep, StepOutput
from inference.sampling.logit_bias import LogitBiasTensors, row_edits
from inference.sampling.sampler import SamplingTensors
from inference.sampling.token_mask import allowed_row, restrict_rows
from inference.sampling.params import (NEEDS_ALLOWED, NEEDS_FILTERS, NEEDS_LOGIT_RULES, NEEDS_LOGPROBS,
                                       NEEDS_PENALTIES, NEEDS_PROMPT_LOGPROBS, SamplingParams)
from inference.engine.async_scheduling import (PLACEHOLDER, AsyncStats, InFlightStep, ParamsChecked, async_step,
                                              fed_in_order, feed_pending_tokens, finishes_in_flight,
                                              fold_in_flight, merge_outputs)
from inference.engine.request_checks import bad_words_ids_of, compile_grammar, validate
from inference.engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig, check_speculative_budget
from inference.engine.scheduled_batch import ScheduledBatch
from inference.engine.scheduler import Scheduler
from inference.engine.input_rows import InputRows
from inference.engine.persistent_batch import PersistentDecodeBatch
from inference.engine.plain_rows import PlainRows
from inference.engine.sequence import Sequence
from inference.spec_decode.adaptive_k import AdaptiveK
from inference.spec_decode.proposer import Proposer
from inference.structured.manager import StructuredOutputManager
from inference.lora.manager import LoRAManager
from inference.lora.request import LoRARequest

log = logging.getLogger(__name__)

_params = operator.attrgetter("params")


def freeze_heap() -> int:
    """Collect garbage, then move every object alive now out of the cyclic collector's reach (`gc.freeze`); returns
    how many objects are frozen.

    Why: a loaded model, its compiled steps and the tokenizer are a few hundred thousand long-lived objects that
    every full (generation 2) collection walks again, a pause of hundreds of ms inside whichever step triggers it
    (BENCHMARKS.md, host overhead, fifth round). Frozen, a full collection walks only what was made since. Collection
    stays on (young objects are collected as before). vLLM freezes its server's heap after start-up the same way.

    Who calls it: the processes that hold one model for their whole life, once it is loaded (and warmed up): the
    server (`inference.entrypoints.openai.server.serve`) and the batch launcher (scripts/generate.py). Not
    `LLM.warmup`: objects frozen alive that later become cyclic garbage are never collected until the next call
    (which unfreezes and collects first), so a notebook or a test suite that drops a warmed-up `LLM` would keep its
    weights and compiled programs."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    error: str | None = None
    bad_words_ids: list[list[int]] = dataclasses.field(default_factory=list)  # params.bad_words, tokenized
    allowed_mask: np.ndarray | None = None  # params.allowed_token_ids as one token-bitmask row (token_mask.py)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer, scheduler_config: SchedulerConfig, *,
                 cache_config: CacheConfig | None = None, proposer: Proposer | None = None,
                 speculative_config: SpeculativeConfig | None = None, lora: LoRAManager | None = None):
        """`scheduler_config.max_model_len`: the context the engine admits (None: the model's
        max_position_embeddings; `LLM` passes the value its page pool allows). `cache_config`: the prefix cache
        switch (the runner already holds the pages). `proposer` turns on speculative decoding: each decoding
        sequence verifies up to `proposer.k` proposed tokens per step in one target pass; with
        `speculative_config.adaptive` each sequence's draft count follows its acceptance rate (`AdaptiveK`).
        `lora`: serve LoRA adapters (its slots must be the runner's `runner.lora`)."""
        cache_config = cache_config or CacheConfig()
        speculative_config = speculative_config or SpeculativeConfig()
        self.runner = runner
        self.tokenizer = tokenizer
        self.page_size = runner.page_size
        # One page pool and page table per KV cache group (one group unless the model has sliding windows).
        self.block_manager = KVCacheManager(runner.num_pages, runner.page_size, runner.config.kv_group_windows,
                                            enable_prefix_caching=cache_config.enable_prefix_caching)
        # A hybrid model's state layers: a state slot per running sequence, prefix checkpoints, and per-position
        # states of speculative verification (inference/engine/pages/state_slots.py).
        self.state = None
        if runner.num_state_slots:
            max_seqs, k = scheduler_config.max_num_seqs, proposer.k if proposer is not None else 0
            if runner.num_state_slots - 1 - max_seqs * k < max_seqs:
                raise ValueError(f"the state cache has {runner.num_state_slots} slots, fewer than the null slot, "
                                 f"max_num_seqs={max_seqs} sequences and {max_seqs * k} for speculative "
                                 "verification; lower max_num_seqs or give the runner more state slots "
                                 "(llm.num_state_slots sizes them from the cache budget)")
            self.state = StateSlotManager(runner.num_state_slots, spec_rows=max_seqs, num_spec=k,
                                          enable_prefix_caching=cache_config.enable_prefix_caching)
        self.proposer = proposer
        self.num_spec = proposer.k if proposer is not None else 0
        if proposer is not None and speculative_config.enabled and \
                speculative_config.num_speculative_tokens != proposer.k:
            raise ValueError(f"the proposer drafts k={proposer.k} tokens but num_speculative_tokens="
                             f"{speculative_config.num_speculative_tokens}; build the proposer with the same count")
        self.adaptive_k = AdaptiveK(self.num_spec) if speculative_config.adaptive and self.num_spec else None
        self.lora = lora
        policy = scheduling_policy(runner.config, runner.page_size, runner.attn_impl, runner.kv_dtype,
                                   scheduler_config, self.num_spec)
        # "auto" chose mixed steps for inter-token latency while prompts arrive; a caller that reads only final
        # outputs (`step(finished_only=True)`: LLM.generate) sees no inter-token latency, and there prefill_first
        # steps gave more throughput (BENCHMARKS.md, host overhead, fourth round): those steps run prefill_first.
        self.throughput_first_offline = scheduler_config.policy == "auto" and policy == "mixed"
        scheduler_config = dataclasses.replace(scheduler_config, policy=policy)
        self.scheduler = Scheduler(scheduler_config, self.block_manager,
                                   proposer=self._propose if self.num_spec else None,
                                   on_preempt=proposer.forget if proposer is not None else None,
                                   admit=self._lora_fits if lora is not None else None,
                                   finishing=lambda seq: finishes_in_flight(self, seq), state=self.state,
                                   max_model_len=scheduler_config.max_model_len
                                   or runner.config.max_position_embeddings, on_fail=self._fail_unschedulable)
        self.max_model_len = self.scheduler.max_model_len
        # The bucket axes that buy nothing with the attention kernel the steps run (it depends on the cache dtype).
        free = padding_is_free(runner.config, runner.page_size, runner.attn_impl, runner.kv_dtype)
        self.limits = BucketLimits(max_tokens=scheduler_config.max_num_batched_tokens,
                                   max_seqs=scheduler_config.max_num_seqs,
                                   max_pages_per_seq=self.block_manager.pages_needed(self.max_model_len),
                                   fine_pages=reads_padded_pages(runner.config, runner.page_size, runner.attn_impl,
                                                                 runner.kv_dtype),
                                   query_buckets=not free, page_buckets=not free)
        self.penalty_len = penalty_length(self.max_model_len)  # fold_extras: one length for the penalty ids
        if self.num_spec:
            check_speculative_budget(scheduler_config.max_num_seqs, self.limits.max_tokens, self.num_spec)
        if proposer is not None:
            proposer.bind(self.limits, vary_steps=self.adaptive_k is not None)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.eos_token_ids = set(runner.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        # Structured outputs: a matcher per constrained sequence, the per-step token bitmask (inference/structured/).
        self.structured = StructuredOutputManager(tokenizer, runner.config.vocab_size, self.eos_token_ids)
        self._lock = threading.Lock()
        self._next_seq_id = 0
        self._rng = random.Random()
        self._token_texts = TokenTexts(tokenizer)
        # Async scheduling (inference/engine/async_scheduling.py): never with a proposer (drafts read the tokens).
        self.async_scheduling = scheduler_config.async_scheduling and not self.num_spec
        self.in_flight: InFlightStep | None = None  # the dispatched step whose tokens are not folded yet
        self.async_stats = AsyncStats()
        self.params_checked = ParamsChecked()  # sync_reasons: the rows whose parameters were checked
        # The rows of the last async decode advance and their requests, reused while the rows stay the same.
        self.advanced_requests: tuple[list[Sequence], list[str]] | None = None
        self._undelivered: list[RequestOutput] = []  # outputs of a step folded outside `step` (drain)
        # Requests whose every sequence finished, not popped yet: a `step(finished_only=True)` builds outputs only
        # for these (fold.outputs).
        self.finished_ids: set[str] = set()
        self.finished_only = False  # set for the length of one `step`: which outputs it builds
        self.persistent = PersistentDecodeBatch(self.page_size)  # the steady decode batch's arrays, kept
        # Each running sequence's page tables and sampling row, kept across steps for the general build.
        self.input_rows = InputRows(self.limits.max_seqs, self.limits.max_pages_per_seq, self.block_manager.num_groups)
        # The fold's plain rows, found over the batch (no rows set aside under speculative decoding: `PlainRows`).
        self.plain_rows = PlainRows(runner.config.vocab_size, keep_base=proposer is None)
        # Every step returns its tokens this wide (`TokenFeed`). Engines built over one runner (an LLM rebuilt with
        # other limits, the server's) share it: the width only grows, so no engine's steps outgrow another's feed.
        runner.feed_width = max(runner.feed_width or 0, self.limits.max_seqs)

    # ---- submission -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request. Raises ValueError (and queues nothing) if it can never run (a bad LoRA adapter too), and
        RuntimeError while the model runner is asleep."""
        if self.runner.sleep_level:
            raise RuntimeError(f"request {request_id}: the model is asleep (sleep() freed its KV cache); call "
                               "wake_up() before adding requests")
        if params.truncate_prompt_tokens is not None:  # vLLM keeps the last k tokens
            k = params.truncate_prompt_tokens
            prompt_token_ids = list(prompt_token_ids)[-(self.max_model_len - 1 if k == -1 else k):]
        validate(self, request_id, prompt_token_ids, params)
        lora_id = 0
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(f"request {request_id} asks for LoRA adapter {lora_request!r}, but this engine was "
                                 "built without LoRA; pass enable_lora=True (and max_loras, max_lora_rank)")
            lora_id = self.lora.register(lora_request)
        grammar = compile_grammar(self, request_id, params)
        bad_words_ids = bad_words_ids_of(self, request_id, params)
        metrics = RequestMetrics(arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
                                 num_prompt_tokens=len(prompt_token_ids))
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        with self._lock:
            seqs = []
            for index in range(params.n):
                seqs.append(Sequence(seq_id=self._next_seq_id, request_id=request_id, index=index,
                                     token_ids=list(prompt_token_ids), num_prompt_tokens=len(prompt_token_ids),
                                     params=params, seed=base_seed + index, arrival_order=self._next_seq_id,
                                     priority=priority, lora_id=lora_id))
                self._next_seq_id += 1
            if grammar is not None:
                self.structured.add([s.seq_id for s in seqs], grammar)
            allowed = None if params.allowed_token_ids is None else \
                allowed_row(params.allowed_token_ids, self.runner.config.vocab_size)
            self.requests[request_id] = Request(request_id, prompt, list(prompt_token_ids), params, seqs, metrics,
                                                bad_words_ids=bad_words_ids, allowed_mask=allowed)
            for seq in seqs:
                self.scheduler.add(seq)
            self.stats.prompt_tokens += len(prompt_token_ids)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its pages."""
        with self._lock:
            request = self.requests.get(request_id)
            if request is None:
                return
            for seq in request.seqs:
                if not seq.is_finished:
                    self._finish(seq, "abort")
            fold_in_flight(self, only_if_idle=True)

    def warmup(self, prefill: bool = True, extras: bool = True) -> int:
        """Compile every step variant serving can run (`inference/engine/compile_budget.py`: decode, prefill and
        verification buckets with each flag set, the draft model's steps, the page copies), so a warmed-up engine
        compiles nothing. `prefill=False`: decode buckets only; `extras=False`: without the logprob / mask /
        penalty variants. Returns how many variants were compiled."""
        report = warmup_serving(self, prefill=prefill, extras=extras)
        log.info("warm-up: %s", {k: (v["variants"], round(v["seconds"], 1)) for k, v in report.items()})
        return sum(v["compiled"] for v in report.values())

    def reset_prefix_cache(self) -> None:
        """Forget all cached KV pages (their contents came from other weights)."""
        with self._lock:
            self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()
        if self.state is not None:
            self.state.reset_prefix_cache()

    def recompute_running(self) -> int:
        """Release every running sequence's KV and queue it to recompute its tokens (after a weight update, so
        the cache holds the new weights' keys and values); the prefix cache is dropped too. Returns how many."""
        with self._lock:
            self._settle()
            running = list(self.scheduler.running)
            for seq in running:
                self.scheduler.preempt(seq, count=False)
            self._reset_prefix_cache()
        return len(running)

    def reset_stats(self) -> None:
        """Start the engine's counters afresh (e.g. after a warm-up that should not count)."""
        self.stats = EngineStats()
        self.scheduler.num_preemptions = 0

    def metrics_summary(self) -> dict[str, float]:
        return {**self.stats.summary(), "preemptions": self.scheduler.num_preemptions}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    def settle(self) -> None:
        """Fold the in-flight step (async scheduling) and keep its outputs for the next `step` (or `drain`): no step
        left on the device, nothing lost to a caller that steps on (what `LLM.sleep` needs)."""
        with self._lock:
            self._settle()

    def _settle(self) -> None:
        self._undelivered = merge_outputs(self._undelivered, fold_in_flight(self))

    def drain(self) -> list[RequestOutput]:
        """Fold the in-flight step (async scheduling): no step left on the device, every token on the host; the
        outputs the next `step` would have reported."""
        with self._lock:
            outputs = merge_outputs(self._undelivered, fold_in_flight(self))
            self._undelivered = []
            return outputs

    def remove_lora(self, lora_id: int | str) -> None:
        """Forget a LoRA adapter (by id or name) between steps (host copy and slot); ValueError while a request still
        uses it."""
        with self._lock:
            if self.lora is None:
                raise ValueError("this engine was built without LoRA")
            lora_id = self.lora.resolve(lora_id)
            if any(s.lora_id == lora_id and not s.is_finished for r in self.requests.values() for s in r.seqs):
                raise ValueError(f"LoRA adapter {lora_id} is still used by a running request; remove it after")
            self.lora.remove(lora_id)

    def _fail_unschedulable(self, seq: Sequence, exc: Exception) -> None:
        """The scheduler's `on_fail`: the request fails with `exc` (it is delivered with this step's outputs). A
        sequence whose sampled token is still on the device (async scheduling) fails at the next step instead, once
        that token is folded, as the synchronous engine folds it before scheduling (it may also end the request)."""
        if self.in_flight is not None and seq in self.in_flight.rows:
            return
        self._fail(seq, exc)
        self._undelivered = merge_outputs(self._undelivered, [self._output(self.requests[seq.request_id])])

    def _lora_fits(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Admit a sequence only while the running ones need at most max_loras adapters (one slot each)."""
        return self.lora.fits(seq.lora_id, {s.lora_id for s in running if s.lora_id}, self.lora.max_loras)

    def _lora_slots(self, batch: ScheduledBatch) -> list[int] | None:
        """Each sequence's LoRA slot for this step, loading adapters that are not on the device."""
        if self.lora is None:
            return None
        busy = {s.lora_id for s in self.scheduler.running if s.lora_id}
        return self.lora.slots_for([s.lora_id for s in batch.seqs], busy)

    def _propose(self, seq: Sequence) -> list[int]:
        """Draft tokens for a decoding sequence, never past its max_tokens or the context. Requests that want
        logprobs do not speculate (their logprobs come from one position per step)."""
        room = self.max_model_len - seq.num_tokens - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        if room <= 0 or seq.params.logprobs is not None:
            return []
        k = min(self.adaptive_k.k(seq) if self.adaptive_k is not None else self.num_spec, room)
        return self.proposer.reserve(seq, k)  # the slots (and pages) to reserve; `_run_draft` fills them

    # ---- stepping ---------------------------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one model step; return an output for every request that advanced (finished ones included), or with
        `finished_only` only for those that finished (the same outputs, filtered by `out.finished`).

        Why the option: building an output is per-request work on the step's critical path; a caller that reads
        only final outputs (`LLM.generate`) need not pay it for every request at every step, a streaming one does."""
        with self._lock:
            self.finished_only = finished_only
            try:
                outputs = self._step()
            finally:
                self.finished_only = False
            return [out for out in outputs if out.finished] if finished_only else outputs

    def _step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule(throughput_first=self.finished_only and self.throughput_first_offline)
        undelivered, self._undelivered = self._undelivered, []  # after the scheduler, which may fail a request
        if batch is None:
            return merge_outputs(undelivered, fold_in_flight(self))
        now = time.perf_counter()
        for seq in batch.admitted:  # only a sequence that joins now can be scheduled for the first time
            metrics = self.requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        if self.async_scheduling:
            return merge_outputs(undelivered, async_step(self, batch))
        return merge_outputs(undelivered, self._process(batch, self._execute(batch)))

    def _execute(self, batch: ScheduledBatch, in_flight: InFlightStep | None = None,
                 fetch: bool = True) -> StepOutput | PendingStep:
        """Run the step (`fetch=False`: dispatch it, returning at once); `in_flight`: whose sampled tokens feed
        this step's placeholder tokens (async scheduling)."""
        for group, copies in enumerate(self.block_manager.take_copies()):
            if copies:
                self.runner.copy_pages(copies, group=group)
        if self.state is not None and self.state.pending_copies:  # forks, checkpoints, prefix-hit restores
            self.runner.copy_state_slots(self.state.take_copies())
        draft_probs = self._run_draft(batch) if batch.speculative else None
        lora_slots = self._lora_slots(batch)
        changes = self.block_manager.take_touched()
        self.input_rows.apply(changes)
        in_order = batch.computed is not None and fed_in_order(batch, in_flight)
        reused = None if self.num_spec and batch.speculative else \
            self.persistent.next_step(batch, changes, PLACEHOLDER if in_order else None)
        if reused is not None:  # the steady decode state: derived from the last step's arrays
            inp, sampling, flags = reused
            self.stats.record_step(True, len(batch.seqs), inp.tokens.shape[0])
        else:
            rows = self.input_rows.rows(batch.seqs)
            inp, sampling, flags = self._build_step(batch, rows, lora_slots, draft_probs)
            self.persistent.keep(batch, inp, sampling, flags, lora_slots is not None,
                                 self.block_manager.num_groups, self.input_rows.prompt_lens[rows])
        inp = feed_pending_tokens(inp, batch, in_flight, in_order)
        return self.runner.execute(inp, sampling, is_decode=batch.is_decode,
                                   use_filters=flags.use_filters, logprobs=flags.extras,
                                   prompt_logprobs=flags.prompt_logprobs, fetch=fetch)

    def _build_step(self, batch: ScheduledBatch, rows: np.ndarray, lora_slots: list[int] | None, draft_probs
                    ) -> tuple[ModelInput, SamplingTensors, StepFlags]:
        """The step's input, sampling rows and static flags, built from the sequences' kept rows (`rows`, their
        `InputRows`) and counts (the general path)."""
        seqs = batch.seqs
        inp, real_tokens = build_model_input(batch, self.page_size, self.limits, self.num_spec,
                                             lora_slots=lora_slots, state_slots=self.state is not None,
                                             spec_slot=self.state.spec_slot if self.state is not None else None,
                                             kept_tables=self.input_rows.kept_tables(rows))
        if draft_probs is not None:
            inp = inp.replace(spec=inp.spec.replace(draft_probs=draft_probs))
        self.stats.record_step(batch.is_decode_phase, real_tokens, inp.tokens.shape[0])
        # Per-row reads in C loops (`map` over the rows). The tables, sampling rows and the parts of the step the
        # rows need (`SamplingParams.needs`: penalties, a mask, edits, logprobs) come from the kept rows
        # (`InputRows`); a part only some rows need looks at the rows only when one of them needs it.
        needs = self.input_rows.needs_of(rows)
        params = list(map(_params, seqs))
        pen = bool(needs & NEEDS_PENALTIES)  # only then the rows' token ids go to the device
        pad_to = inp.logits_indices.shape[0]
        token_mask, mask_in_raw = self._token_mask(batch, bool(needs & NEEDS_ALLOWED), pad_to)
        generated = batch.counts()[1] - self.input_rows.prompt_lens[rows]
        sampling = SamplingTensors.from_params(
            params, None, generated, pad_to=pad_to,
            prompt_token_ids=[s.token_ids[:s.num_prompt_tokens] for s in seqs] if pen else None,
            output_token_ids=[s.output_token_ids for s in seqs] if pen else None,
            token_mask=token_mask, mask_in_raw=mask_in_raw,
            logit_bias=self._logit_bias(batch, pad_to) if needs & NEEDS_LOGIT_RULES else None,
            rows=(self.input_rows.sampling[rows], self.input_rows.seed_key[rows]), uses_penalties=pen)
        wants_prompt = bool(needs & NEEDS_PROMPT_LOGPROBS) and any(
            p.prompt_logprobs is not None and s.predicts_prompt for s, p in zip(seqs, params))
        flags = StepFlags.of_batch(bool(needs & NEEDS_FILTERS), bool(needs & NEEDS_LOGPROBS),
                                   sampling.token_mask is not None, pen, wants_prompt,
                                   prefill=not (batch.is_decode or batch.speculative),
                                   logit_edits=sampling.logit_bias is not None)
        sampling = fold_extras(sampling, flags, vocab_size=self.runner.config.vocab_size, penalty_len=self.penalty_len,
                               sharding=self.runner.token_sharding)
        return inp, sampling, flags

    def _token_mask(self, batch: ScheduledBatch, allowed_lists: bool, pad_to: int
                    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The step's token bitmask (the grammars of the constrained rows that sample now, and the allowed lists;
        None when the batch has neither) and the rows whose raw logprobs see it (`token_mask.restrict_rows`).
        `allowed_lists`: some row has one."""
        mask = self.structured.fill([(i, s) for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                                     if s.num_computed_tokens + n >= s.num_tokens], pad_to=pad_to) \
            if self.structured.active else None
        allowed = [(i, self.requests[s.request_id].allowed_mask, s.params.structured_outputs is not None)
                   for i, s in enumerate(batch.seqs) if s.params.allowed_token_ids is not None] \
            if allowed_lists else []
        return restrict_rows(mask, allowed, pad_to, self.runner.config.vocab_size)

    def _logit_bias(self, batch: ScheduledBatch, pad_to: int) -> LogitBiasTensors | None:
        """The sparse logit edits (logit_bias, bad words, min_tokens) of a batch where some row has them, or None."""
        # A row's stop ids for min_tokens: vLLM's all_stop_token_ids (stop_token_ids and EOS).
        edits = [row_edits(s.params, s.output_token_ids, self.requests[s.request_id].bad_words_ids,
                           set(s.params.stop_token_ids) | self.eos_token_ids) for s in batch.seqs]
        return LogitBiasTensors.from_rows(edits, pad_to)

    def _run_draft(self, batch: ScheduledBatch):
        """Fill the reserved draft slots with the proposer's tokens, batched over the speculating sequences;
        returns their probabilities in the step's row layout (None: deterministic or greedy drafts)."""
        proposal = self.proposer.propose(batch.seqs, pad_to=bucket(len(batch.seqs), maximum=self.limits.max_seqs))
        for seq, tokens in zip(batch.seqs, proposal.token_ids):
            if seq.spec_tokens:
                seq.spec_tokens = tokens
        return proposal.draft_probs

    # ---- the fold and the outputs (inference/engine/fold.py): methods of the engine ---------------------------
    _process = fold.process
    _fold_tokens = fold.fold_tokens
    _advance = fold.advance
    _fail = fold.fail
    _finish = fold.finish
    _output = fold.request_output
    _outputs = fold.outputs

    def output_of(self, request_id: str) -> RequestOutput:
        """The current output of a request that has not been popped."""
        with self._lock:
            return self._output(self.requests[request_id])

    def pop_finished(self, request_id: str) -> None:
        """Forget a finished request (the caller has its output)."""
        with self._lock:
            request = self.requests.get(request_id)
            if request is not None and request.finished:
                del self.requests[request_id]
                self.finished_ids.discard(request_id)

