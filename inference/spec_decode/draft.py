"""A draft model for speculative decoding: a small decoder that shares the target's tokenizer and page tables.

The draft proposes k tokens per speculating sequence; the target verifies them in one pass
(`inference/runtime/runner.py: _verify`, `rejection_sample`). Two design choices make it cheap to run inside the engine:

* **Same page ids as the target** (vLLM's design). The draft has its own paged KV cache (its own layers) with the
  target's `num_pages` and `page_size`, and it reads and writes the *target's* block tables (`seq.pages`). So there is
  no second page bookkeeping: the scheduler reserves pages for the last token plus k drafts, which covers every
  position the draft writes, and draft KV past the accepted length is simply overwritten later.
* **One jitted call per step for the whole batch.** The draft catches up on the tokens it has not seen (like a
  prefill chunk: usually 0-1 per step), samples draft 1, then runs k-1 decode steps, all inside one jit
  (`_propose_step`), batched over the speculating sequences. Only the draft tokens come back to the host; the draft
  probabilities stay on the device and go straight into the target's verification.

Exactness: each draft token is sampled from `probs_from_logits` of the draft's logits with the request's own
temperature and filters, and those probabilities are passed to `rejection_sample`, so the emitted tokens follow the
target's distribution exactly at any temperature. Greedy rows take the draft's argmax and are verified by argmax.
Draft keys are the request's (seed, token index) keys under a salted seed, so they are independent of the keys the
verification uses.

Drafts made from a checkpoint by structured pruning (`prune_layers`: keep a subset of the layers) are selected as
`speculative_model="smollm2-135m:layers=0:30:3,29"`; a distilled draft (`scripts/tools/distill_draft.py`) is a safetensors
file that names its base and layers in its metadata.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference.runtime.batch import BucketLimits, ModelInput, bucket, build_model_input
from inference.runtime.runner import ModelRunner
from inference.runtime.step_variants import StepVariant, warm_variants
from inference.runtime.warmup import decode_shapes, prefill_shapes, propose_limits, propose_shapes
from inference.sampling.sampler import PRNG_IMPL, SamplingTensors, needs_filters, sample
from inference.engine.scheduled_batch import ScheduledBatch
from inference.sampling.rejection import probs_from_logits
from inference.engine.config import check_num_drafts
from inference.spec_decode.proposer import DraftModelProposer, DraftProposal
from models.attention import AttentionMetadata
from models.config import ModelConfig
from models.decoder import Decoder, build_decoder, export_weights

#: Folded into every request's seed key to derive its draft-sampling keys: independent of the verification keys.
DRAFT_KEY_SALT = 0x5D2AF7

#: The safetensors metadata key that marks a pagejax draft file.
DRAFT_FORMAT = "pagejax-draft-v1"


# ----------------------------------------------------------------------------------------------------------------
# Structured pruning and the draft's weights.


def parse_layers(text: str, num_layers: int) -> list[int]:
    """'0,3,29' or Python-slice items '0:30:3,29' -> sorted unique layer indices, each in [0, num_layers)."""
    keep: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            if ":" in item:
                parts = [int(p) if p.strip() else None for p in item.split(":")]
                if len(parts) > 3:
                    raise ValueError
                keep.update(range(num_layers)[slice(*parts)])
            else:
                keep.add(int(item))
        except ValueError:
            raise ValueError(f"layers={text!r}: {item!r} is not a layer index or a start:stop:step slice") from None
    return sorted(keep)


def prune_layers(config: ModelConfig, weights: dict[str, np.ndarray], keep: Sequence[int]
                 ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A decoder made of the layers `keep` of `config` (structured pruning): (config, canonical weights).

    Why this is a fair draft: every layer writes into the same residual stream, so dropping layers leaves a model
    whose embeddings, final norm and LM head still speak the target's language; it is a crude approximation of the
    target that distillation (scripts/tools/distill_draft.py) then repairs. Kept layers are renumbered 0..len(keep)-1 in
    order; per-layer config (layer_types) follows them. Weights are shared with the input dict (no copies).
    """
    keep = list(keep)
    if not keep:
        raise ValueError("prune_layers: keep at least one layer")
    if sorted(set(keep)) != keep:
        raise ValueError(f"prune_layers: layer indices must be increasing and unique, got {keep}")
    if keep[0] < 0 or keep[-1] >= config.num_layers:
        raise ValueError(f"prune_layers: layer indices must be in [0, {config.num_layers}), got {keep}")
    if getattr(config, "cla_factor", 1) != 1:
        raise ValueError("prune_layers: cross-layer attention (cla_factor > 1) shares KV across layer runs; pruning "
                         "would break the runs, so prune a model without it")
    changes: dict = {"num_layers": len(keep), "name": f"{config.name}:layers={','.join(map(str, keep))}"}
    if config.layer_types is not None:
        changes["layer_types"] = tuple(config.layer_types[i] for i in keep)
    if getattr(config, "num_experts", 0):  # dense layers come first; the kept ones stay first
        changes["first_k_dense_replace"] = sum(1 for i in keep if i < config.first_k_dense_replace)
    pruned_config = config.replace(**changes)
    new_index = {old: new for new, old in enumerate(keep)}
    pruned: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        if not name.startswith("layers."):
            pruned[name] = value
            continue
        _, index, rest = name.split(".", 2)
        if int(index) in new_index:
            pruned[f"layers.{new_index[int(index)]}.{rest}"] = value
    return pruned_config, pruned


#: The canonical weight dict of a built float decoder (the name the draft tools and tests use).
decoder_weights = export_weights


def save_draft(path: str, base: str, keep: Sequence[int] | None, weights: dict[str, np.ndarray]) -> None:
    """Write draft weights (the pruned layout's names) as safetensors: no pickle. The metadata names the base model
    and kept layers; tensors absent from the file (e.g. the frozen embedding) are taken from the base on load."""
    from safetensors.numpy import save_file

    meta = {"format": DRAFT_FORMAT, "base": base, "layers": ",".join(map(str, keep)) if keep is not None else ""}
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()}, path, metadata=meta)


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    """What `speculative_model` names: a base model (preset, .gguf or HF folder), optionally a subset of its layers,
    optionally a safetensors file of (distilled) weights that override the pruned base's."""

    base: str
    layers: str | None = None  # parse_layers syntax; None: every layer
    weights_file: str | None = None

    @classmethod
    def parse(cls, spec: str) -> "DraftSpec":
        """'smollm2-135m:layers=0:30:3,29', 'path/draft.safetensors' or a plain model name / path."""
        if not isinstance(spec, str) or not spec:
            raise ValueError("speculative_model must name the draft: 'MODEL', 'MODEL:layers=0,3,...' or a draft "
                             ".safetensors file written by scripts/tools/distill_draft.py")
        if spec.endswith(".safetensors"):
            if not os.path.isfile(spec):
                raise ValueError(f"speculative_model {spec!r}: no such draft file")
            from safetensors import safe_open

            with safe_open(spec, framework="numpy") as f:
                meta = f.metadata() or {}
            if meta.get("format") != DRAFT_FORMAT:
                raise ValueError(f"{spec} is not a pagejax draft file (no '{DRAFT_FORMAT}' metadata); write one with "
                                 "scripts/tools/distill_draft.py")
            return cls(meta["base"], meta.get("layers") or None, spec)
        base, sep, rest = spec.partition(":layers=")
        if sep and not rest:
            raise ValueError(f"speculative_model {spec!r}: give the layers to keep, e.g. ':layers=0,3,29'")
        return cls(base, rest if sep else None)


def load_draft_weights(spec: DraftSpec, *, seed: int = 0):
    """(config, canonical weights, tokenizer) of the draft `spec` names. A base without weights (a test preset) gets
    the random weights `LLM(model=base, seed=seed)` would have, so a pruned draft is a pruned copy of that target."""
    from inference.loading.model_loader import load_model

    loaded = load_model(spec.base)
    weights = loaded.weights
    if weights is None and getattr(loaded, "checkpoint", None) is not None:  # an orbax folder
        from models.loaders.orbax_checkpoint import restore_weights
        weights = restore_weights(loaded.checkpoint, loaded.config, None)
    if weights is None:
        weights = decoder_weights(build_decoder(loaded.config, None, seed=seed))
    config = loaded.config
    if spec.layers is not None:
        config, weights = prune_layers(config, weights, parse_layers(spec.layers, config.num_layers))
    if spec.weights_file is not None:
        from safetensors.numpy import load_file

        override = load_file(spec.weights_file)
        for name, value in override.items():
            if name not in weights or weights[name].shape != value.shape:
                raise ValueError(f"{spec.weights_file}: tensor {name!r} {value.shape} does not fit the draft "
                                 f"{config.name} (expected {getattr(weights.get(name), 'shape', 'no such tensor')})")
        weights = {**weights, **override}
    return config, weights, loaded.tokenizer


def check_same_tokenizer(target_config: ModelConfig, target_tok, draft_config: ModelConfig, draft_tok) -> None:
    """Raise ValueError unless the draft can propose the target's token ids (same vocabulary)."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"the draft model has a vocabulary of {draft_config.vocab_size} tokens, the target "
                         f"{target_config.vocab_size}; a draft must share the target's tokenizer")
    if target_tok is not None and draft_tok is not None:
        probe = "Speculative decoding: the draft's tokens must mean the same text. 0123 äöü"
        if target_tok.encode(probe) != draft_tok.encode(probe):
            raise ValueError("the draft model's tokenizer encodes text differently from the target's; a draft must "
                             "share the target's tokenizer")


# ----------------------------------------------------------------------------------------------------------------
# The jitted proposal step.


def _draft_keys(sampling: SamplingTensors) -> SamplingTensors:
    """The same rows with a salted seed key: draft draws are independent of the verification's (seed, step) keys."""
    base = jax.random.wrap_key_data(jnp.asarray(sampling.seed_key, jnp.uint32), impl=PRNG_IMPL)
    salted = jax.vmap(lambda key: jax.random.fold_in(key, DRAFT_KEY_SALT))(base)
    return sampling.replace(seed_key=jax.random.key_data(salted))


def _propose_step(graphdef, treedef, param_leaves, kv_caches, inp: ModelInput, sampling: SamplingTensors,
                  num_draft: jax.Array, out_rows: jax.Array, *, num_steps: int, k_max: int, out_size: int,
                  use_filters: bool, want_probs: bool):
    """Catch up on `inp` (each row's unseen tokens, ending with its last token), then sample `num_steps` drafts per
    row, feeding each back as a one-token decode. Returns (tokens i32[S, num_steps], draft probs f32[out_size, k_max,
    V] scattered to the target's rows `out_rows` (zero elsewhere and past a row's num_draft) or None, kv_caches).

    Positions: row i has kv_lens[i] = L_i tokens cached after the catch-up; draft j >= 1 feeds draft j-1 at position
    L_i + j - 1. Writes past a row's num_draft - 1 are masked (slot -1): the scheduler reserved pages for
    L_i + num_draft tokens, and the draft must never write outside them.
    """
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, param_leaves))
    hidden, kv_caches = model(inp.tokens, inp.positions, kv_caches, inp.attn)
    logits = model.logits(hidden[inp.logits_indices])
    s = logits.shape[0]
    live = jnp.arange(s) < inp.attn.num_seqs[0]
    pages = inp.attn.page_indices
    page_size = model.config.kv_cache_page_size(kv_caches[0])
    keyed = _draft_keys(sampling)
    tokens, probs = [], []
    tok = None
    for j in range(num_steps):
        if j > 0:
            pos = inp.attn.kv_lens + (j - 1)
            page = jnp.take_along_axis(pages, jnp.clip(pos // page_size, 0, pages.shape[1] - 1)[:, None], 1)[:, 0]
            slot = jnp.where(live & (j < num_draft), page * page_size + pos % page_size, -1)
            attn = AttentionMetadata(slot_mapping=slot.astype(jnp.int32),
                                     kv_lens=jnp.where(live, jnp.minimum(pos + 1, pages.shape[1] * page_size), 0),
                                     page_indices=pages, cu_q_lens=jnp.minimum(jnp.arange(s + 1), inp.attn.num_seqs[0]),
                                     num_seqs=inp.attn.num_seqs, max_q_len=1)
            hidden, kv_caches = model(tok, jnp.where(live, pos, 0), kv_caches, attn)
            logits = model.logits(hidden)
        t_j = keyed.replace(step=sampling.step + j)  # key of (seed', index of the token this draft guesses)
        tok = sample(logits, t_j, use_filters=use_filters)
        tokens.append(tok)
        if want_probs:
            probs.append(probs_from_logits(logits, t_j, use_filters))
    out_probs = None
    if want_probs:
        p = jnp.stack(probs, axis=1)  # [S, num_steps, V]
        p = jnp.pad(p, ((0, 0), (0, k_max - num_steps), (0, 0)))
        p = jnp.where((jnp.arange(k_max)[None, :] < num_draft[:, None])[..., None], p, 0.0)
        out_probs = jnp.zeros((out_size, k_max, p.shape[-1]), jnp.float32).at[out_rows].set(p, mode="drop")
    return jnp.stack(tokens, axis=1), out_probs, kv_caches


@dataclasses.dataclass
class _DraftState:
    """What the draft's cache holds for one sequence: valid KV for positions < computed, in the pages `snapshot`
    (the sequence's page table when it was written)."""

    computed: int
    snapshot: tuple[int, ...]


@dataclasses.dataclass
class _View:
    """A sequence as the batch builder sees it, but with the draft's own computed length (catch-up chunks)."""

    token_ids: list[int]
    num_computed_tokens: int
    pages: list[int]
    num_prompt_tokens: int
    spec_tokens: list[int] = dataclasses.field(default_factory=list)

    @property
    def block_tables(self) -> list[list[int]]:
        return [self.pages]  # one KV cache group: drafts of sliding-window models are refused


class PagedDraftProposer(DraftModelProposer):
    """A draft model over the target's block tables (see the module docstring).

    Contract with the engine: the scheduler reserves `len(seq.spec_tokens)` draft slots per speculating sequence
    (and the pages for them); `propose(batch_seqs, pad_to)` returns that many draft tokens for each of them (none
    for the others) and, when some speculating row samples, their probabilities in the target's row layout
    [pad_to, k, V] as a device array.
    """

    def __init__(self, model: Decoder, *, k: int, num_pages: int, page_size: int, kv_dtype=jnp.float32):
        self.k = check_num_drafts(k)
        self.config = model.config
        self.runner = ModelRunner(model, num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype)
        self.page_size = page_size
        self.limits: BucketLimits | None = None  # the engine's buckets: `bind`
        self.vary_steps = False  # adaptive k (`bind`): see _num_steps
        self._state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        static = ("num_steps", "k_max", "out_size", "use_filters", "want_probs")
        self._step = jax.jit(functools.partial(_propose_step, self.runner.graphdef, self.runner.param_treedef),
                             static_argnames=static, donate_argnums=(1,))

    def num_compilations(self) -> dict[str, int]:
        return {"propose": self._step._cache_size(), **{f"catch_up_{k}": v
                                                        for k, v in self.runner.num_compilations().items()}}

    def _computed(self, seq) -> int:
        """Valid draft KV of `seq`: its recorded length, cut where its pages changed (copy-on-write swaps a page) and
        at the target's computed length (rejected drafts are not the sequence). Preemption: `forget`."""
        state = self._state.get(seq)
        if state is None:
            return 0
        same = 0
        for old, new in zip(state.snapshot, seq.pages):
            if old != new:
                break
            same += 1
        return min(state.computed, same * self.page_size, seq.num_computed_tokens)

    def _catch_up(self, views: list[_View], ends: list[int]) -> None:
        """Run the draft over each view's tokens up to ends[i] (exclusive) in prefill chunks within the token budget
        (nothing sampled is used)."""
        budget = self.limits.max_tokens
        while True:
            todo = [(v, e - v.num_computed_tokens) for v, e in zip(views, ends) if e > v.num_computed_tokens]
            if not todo:
                return
            seqs, counts = [], []
            for view, need in todo:
                if budget - sum(counts) <= 0 or len(seqs) == self.limits.max_seqs:
                    break
                seqs.append(view)
                counts.append(min(need, budget - sum(counts)))
            inp, _ = build_model_input(ScheduledBatch(seqs, counts), self.page_size, self.limits)
            pad = inp.logits_indices.shape[0]
            self.runner.execute(inp, SamplingTensors.from_params([], [], [], pad_to=pad), is_decode=all(
                c == 1 for c in counts))
            for view, count in zip(seqs, counts):
                view.num_computed_tokens += count

    def _num_steps(self, most: int) -> int:
        """Draft steps to run for a batch whose longest proposal is `most`: always k (one compiled variant), or with
        `vary_steps` (adaptive k) the next power of two (log2(k) + 1 variants) so shrunken k saves draft passes."""
        if not self.vary_steps:
            return self.k
        return min(1 << (most - 1).bit_length(), self.k)

    def bind(self, limits: BucketLimits, *, vary_steps: bool) -> None:
        """The draft runs on the target's page tables, so in the engine's own buckets; under adaptive k it runs as
        few draft steps as the batch's longest proposal needs (`_num_steps`)."""
        self.limits = limits
        self.vary_steps = vary_steps

    def _warm_plan(self) -> tuple[list[StepVariant], list[tuple]]:
        """What `warmup` compiles: the catch-up chunks (plain sampling, the engine's prefill and decode shapes) and
        the proposal step per (shape, use_filters, want_probs, draft steps): greedy, sampled and filtered, at each
        draft length `_num_steps` can give."""
        if self.limits is None:
            raise ValueError("PagedDraftProposer is not bound; the engine calls bind(limits, ...) when it takes it")
        catch_up = [StepVariant(s, True) for s in decode_shapes(self.limits)]
        catch_up += [StepVariant(s, False) for s in prefill_shapes(self.limits, self.page_size)]
        steps = sorted({self._num_steps(n) for n in range(1, self.k + 1)})
        flags = ((False, False), (False, True), (True, True))  # (use_filters, want_probs): filters imply sampling
        proposals = [(shape, use_filters, want_probs, num_steps) for shape in propose_shapes(self.limits)
                     for use_filters, want_probs in flags for num_steps in steps]
        return catch_up, proposals

    def num_variants(self) -> int:
        catch_up, proposals = self._warm_plan()
        return len(catch_up) + len(proposals)

    def warmup(self) -> int:
        catch_up, proposals = self._warm_plan()
        before = sum(self.num_compilations().values())
        warm_variants(self.runner, catch_up, penalty_len=0)
        for shape, use_filters, want_probs, num_steps in proposals:
            inp = ModelInput.empty(shape.num_tokens, shape.num_seqs, shape.pages_per_seq, shape.max_q_len)
            sampling = SamplingTensors.from_params([], [], [], pad_to=shape.num_seqs)
            _, _, self.runner.kv_caches = self._step(
                self.runner.param_leaves, self.runner.kv_caches, inp, sampling, np.zeros(shape.num_seqs, np.int32),
                np.full(shape.num_seqs, shape.num_seqs, np.int32), num_steps=num_steps, k_max=self.k,
                out_size=shape.num_seqs, use_filters=use_filters, want_probs=want_probs)
        return sum(self.num_compilations().values()) - before

    def forget(self, seq) -> None:
        self._state.pop(seq, None)

    def propose(self, seqs: Sequence, pad_to: int | None = None) -> DraftProposal:
        if self.limits is None:
            raise ValueError("PagedDraftProposer is not bound; the engine calls bind(limits, ...) when it takes it")
        pad_to = len(seqs) if pad_to is None else pad_to
        rows = [i for i, s in enumerate(seqs) if s.spec_tokens]
        token_ids: list[list[int]] = [[] for _ in seqs]
        if not rows:
            return DraftProposal(token_ids, None)
        spec = [seqs[i] for i in rows]
        views = [_View(s.token_ids, self._computed(s), s.pages, s.num_prompt_tokens) for s in spec]
        # Unseen tokens before the last two go through catch-up chunks (the prompt, once). The proposal step always
        # takes each sequence's last two tokens, even when the draft has seen the first (its KV is rewritten with
        # the same values): after a rejection 1 token is new, after a full accept 2, and one query length means
        # one compiled shape per (sequences, pages) bucket.
        self._catch_up(views, [len(v.token_ids) - 2 for v in views])
        for view in views:
            view.num_computed_tokens = len(view.token_ids) - 2
        counts = [2] * len(views)
        # Padded to the target step's rows (two tokens each, beyond a small prefill budget if need be), so the
        # proposal step compiles once per target bucket, however many of its rows speculate.
        limits = propose_limits(self.limits, bucket(pad_to, maximum=self.limits.max_seqs))
        inp, _ = build_model_input(ScheduledBatch(views, counts), self.page_size, limits)
        s_pad = inp.logits_indices.shape[0]
        params = [s.params for s in spec]
        sampling = SamplingTensors.from_params(params, [s.seed for s in spec], [s.num_output_tokens for s in spec],
                                               pad_to=s_pad)
        num_draft = np.zeros(s_pad, np.int32)
        num_draft[:len(spec)] = [len(s.spec_tokens) for s in spec]
        out_rows = np.full(s_pad, pad_to, np.int32)  # padding rows scatter out of bounds (dropped)
        out_rows[:len(spec)] = rows
        want_probs = any(not p.greedy for p in params)
        tokens, probs, self.runner.kv_caches = self._step(
            self.runner.param_leaves, self.runner.kv_caches, inp, sampling, num_draft, out_rows,
            num_steps=self._num_steps(int(num_draft.max())), k_max=self.k, out_size=pad_to,
            use_filters=needs_filters(params), want_probs=want_probs)
        tokens = np.asarray(tokens)
        for row, (i, seq) in enumerate(zip(rows, spec)):
            n = len(seq.spec_tokens)
            token_ids[i] = [int(t) for t in tokens[row, :n]]
            # Draft KV is now valid through the last draft it fed back (position L + n - 2).
            self._state[seq] = _DraftState(len(seq.token_ids) + n - 1, tuple(seq.pages))
        return DraftProposal(token_ids, probs)


class LoadedDraft(NamedTuple):
    """A draft model's config and weights, loaded once (before the KV budget, which its cache shares)."""

    source: str
    config: ModelConfig
    weights: dict


def load_draft(speculative_model: str, *, target_config: ModelConfig, target_tokenizer, seed: int = 0) -> LoadedDraft:
    """Parse and load `speculative_model` for this target: same tokenizer, no sliding-window target."""
    if target_config.sliding_window is not None:
        raise ValueError("a draft model for a sliding-window target is not supported yet (the target releases pages "
                         "behind the window that the draft's catch-up would still read); use "
                         "speculative_method='ngram'")
    config, weights, tokenizer = load_draft_weights(DraftSpec.parse(speculative_model), seed=seed)
    check_same_tokenizer(target_config, target_tokenizer, config, tokenizer)
    return LoadedDraft(speculative_model, config, weights)


def make_draft_proposer(draft: LoadedDraft, *, k: int, num_pages: int, page_size: int, dtype=jnp.float32,
                        kv_dtype=jnp.float32, attn_impl: str = "auto") -> PagedDraftProposer:
    """The proposer for `LLM(speculative_method="draft", speculative_model=...)`."""
    model = build_decoder(draft.config, draft.weights, dtype=dtype, attn_impl=attn_impl, source=draft.source)
    return PagedDraftProposer(model, k=k, num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype)


__all__ = ["DraftSpec", "LoadedDraft", "PagedDraftProposer", "check_same_tokenizer", "decoder_weights", "load_draft",
           "load_draft_weights", "make_draft_proposer", "parse_layers", "prune_layers", "save_draft"]
