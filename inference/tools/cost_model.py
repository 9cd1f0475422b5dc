"""Back-of-envelope decode cost model: bandwidth-only step time, throughput and the roofline.

This is the arithmetic of CS336 lecture 10 ("Inference"), kept as code so a serving decision (batch size, KV heads,
chip) can be checked before anything is compiled. The bytes it moves (weights, KV cache, state cache) are
`model_bytes.py`'s; the launcher's inputs and outputs (tables, JSON rows, the figure) are `cost_model_io.py`'s.

- Decode step under the bandwidth-only model: every step reads all weights once and each sequence's cache once
  (a state is read and rewritten whole: twice its bytes), τ = (W + B·C)/β and throughput R = B/τ. It omits cache writes, activations and compute time, so it is an
  estimate under stated assumptions, not a measured timing.
- Arithmetic intensity (FLOPs per byte moved) of a [n, D]×[D, F] linear layer, ≈ n = B·T tokens while n ≪ D, F,
  and of attention, S·T/(S+T) for multi-head attention (S/(S+1) for one-token decode), compared with the chip's
  roofline crossover peak/bandwidth (≈ 295 FLOP/byte on an H100) to say compute- or memory-bound.

Nothing here imports JAX: the model is plain integer arithmetic over a `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from configs.chips import ChipSpec
from inference.tools.model_bytes import (ParamCount, check_positive, kv_bytes_per_sequence, kv_bytes_per_token,
                                         param_count, state_bytes_per_sequence, weight_bytes, weight_bytes_read)
from models.config import ModelConfig

GB = 1e9  # decimal gigabyte, as in the lecture's table

# --------------------------------------------------------------------------------------------------------------
# Arithmetic intensity and the roofline
# --------------------------------------------------------------------------------------------------------------


def linear_intensity(tokens: int, d_in: int, d_out: int, bytes_per_element: float = 2) -> float:
    """FLOPs per byte of a [tokens, d_in] × [d_in, d_out] matmul: 2·n·D·F / (b·(n·D + D·F + n·F)).

    Counts a multiply-add as two FLOPs and charges one read of the input and weight and one write of the output.
    `tokens` is B·T: batched sequences times query positions each (T = 1 in decode).
    """
    for name, value in (("tokens", tokens), ("d_in", d_in), ("d_out", d_out)):
        check_positive(name, value)
    check_positive("bytes_per_element", bytes_per_element)
    flops = 2 * tokens * d_in * d_out
    moved = bytes_per_element * (tokens * d_in + d_in * d_out + tokens * d_out)
    return flops / moved


def linear_intensity_approx(tokens: int, bytes_per_element: float = 2) -> float:
    """The weight-dominated limit of `linear_intensity` for tokens ≪ D, F: 2·n/b, i.e. ≈ B·T in bf16.

    Why it holds: the D·F weight bytes dominate traffic, so FLOPs/bytes → 2·n·D·F / (b·D·F). For large n the
    exact ratio instead saturates at 2·D·F / (b·(D + F)).
    """
    check_positive("tokens", tokens)
    return 2 * tokens / bytes_per_element


def attention_intensity(context: int, query_tokens: int, num_heads: int, num_kv_heads: int,
                        bytes_per_element: float = 2) -> float:
    """FLOPs per byte of attention over `context` cached tokens for `query_tokens` queries, per sequence.

    The lecture's optimistic traffic model, generalized to grouped-query attention (g = N/K query heads per KV
    head, head width H cancels):
        FLOPs  = 4·S·T·N·H                  (Q·Kᵀ and P·V, two FLOPs per multiply-add; scores stay on chip)
        bytes  = b·(2·S·K·H + 2·T·N·H)      (read K and V, read Q, write the output)
        I      = 2·S·T·N / (b·(S·K + T·N))  = S·T·g / (S + T·g) for b = 2.
    For multi-head attention (g = 1) this is S·T/(S+T): S/2 for a square prefill and S/(S+1) ≈ 1 for one-token
    decode. The batch size cancels, because every sequence brings its own private cache.
    """
    for name, value in (("context", context), ("query_tokens", query_tokens), ("num_heads", num_heads),
                        ("num_kv_heads", num_kv_heads)):
        check_positive(name, value)
    check_positive("bytes_per_element", bytes_per_element)
    flops = 4 * context * query_tokens * num_heads
    moved = bytes_per_element * (2 * context * num_kv_heads + 2 * query_tokens * num_heads)
    return flops / moved


def bound(intensity: float, chip: ChipSpec) -> str:
    """"compute" when `intensity` reaches the chip's crossover (peak FLOP/s ÷ bandwidth), else "memory"."""
    return "compute" if intensity >= chip.crossover_intensity else "memory"


# --------------------------------------------------------------------------------------------------------------
# Decode step estimates
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSummary:
    """Batch-independent figures for one model variant (one KV-head count)."""

    name: str
    kv_heads: int
    params: ParamCount
    bytes_per_element: float
    weight_bytes: float
    kv_bytes_per_token: float
    kv_bytes_per_sequence: float
    context: int
    state_bytes_per_sequence: float = 0.0  # a hybrid model's state layers: the same at every context


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """One decode step of `batch` sequences with `context` cached tokens each, under the bandwidth-only model."""

    kv_heads: int
    batch: int
    context: int
    weight_bytes: float
    kv_bytes: float  # KV cache bytes the step reads, plus a hybrid model's state bytes read and rewritten
    step_s: float
    linear_intensity: float
    linear_intensity_approx: float
    linear_bound: str
    attention_intensity: float
    attention_bound: str

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def tokens_per_s(self) -> float:
        """Aggregate throughput: each step emits one token per sequence."""
        return self.batch / self.step_s

    def json_row(self) -> dict[str, Any]:
        """The launcher's `--json` row: decimal GB, milliseconds, tokens per second, unrounded."""
        return {
            "kv_heads": self.kv_heads,
            "batch": self.batch,
            "weights_gb": self.weight_bytes / GB,
            "kv_cache_gb": self.kv_bytes / GB,
            "total_gb": self.total_bytes / GB,
            "step_ms": self.step_s * 1e3,
            "tokens_per_s": self.tokens_per_s,
        }


@dataclasses.dataclass(frozen=True)
class CostReport:
    """Everything the launcher prints: per-variant summaries, per-(variant, batch) rows, and the chip."""

    model: str
    chip: ChipSpec
    context: int
    bytes_per_element: float
    summaries: tuple[ModelSummary, ...]
    rows: tuple[StepEstimate, ...]


def with_kv_heads(config: ModelConfig, kv_heads: int | None) -> ModelConfig:
    """The config with `kv_heads` KV heads (a hypothetical GQA variant: K/V projections shrink too), or unchanged.

    The result is a different architecture, not the same checkpoint read differently; it serves what-if sizing.
    """
    if kv_heads is None or kv_heads == config.num_kv_heads:
        return config
    check_positive("kv_heads", kv_heads)
    if config.num_heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} does not divide num_heads={config.num_heads}; each KV head must serve "
                         "the same number of query heads")
    return config.replace(num_kv_heads=kv_heads)


def summarize(config: ModelConfig, context: int, bytes_per_element: float) -> ModelSummary:
    """Batch-independent sizes: parameters, weight bytes and KV bytes per token and per sequence."""
    check_positive("bytes_per_element", bytes_per_element)
    return ModelSummary(
        name=config.name, kv_heads=config.num_kv_heads, params=param_count(config),
        bytes_per_element=bytes_per_element, weight_bytes=weight_bytes(config, bytes_per_element),
        kv_bytes_per_token=kv_bytes_per_token(config, bytes_per_element),
        kv_bytes_per_sequence=kv_bytes_per_sequence(config, context, bytes_per_element), context=context,
        state_bytes_per_sequence=state_bytes_per_sequence(config, bytes_per_element))


def estimate_decode_step(config: ModelConfig, batch: int, context: int, chip: ChipSpec,
                         bytes_per_element: float = 2) -> StepEstimate:
    """Bandwidth-only decode step: τ = (W + B·C)/β, with the linear-layer and attention intensities at this batch.
    W is the weight bytes the step reads (`weight_bytes_read`: all of them unless experts are routed).

    The linear intensity is that of the MLP's [B, D] × [D, F] up projection, the largest matmul of a layer.
    """
    check_positive("batch", batch)
    summary = summarize(config, context, bytes_per_element)
    kv = batch * (summary.kv_bytes_per_sequence + 2 * summary.state_bytes_per_sequence)
    lin = linear_intensity(batch, config.hidden_size, config.intermediate_size, bytes_per_element)
    attn = attention_intensity(context, 1, config.num_heads, config.num_kv_heads, bytes_per_element)
    return StepEstimate(
        kv_heads=config.num_kv_heads, batch=batch, context=context, weight_bytes=summary.weight_bytes, kv_bytes=kv,
        step_s=(weight_bytes_read(config, batch, bytes_per_element) + kv) / chip.bandwidth_bytes_per_s,
        linear_intensity=lin,
        linear_intensity_approx=linear_intensity_approx(batch, bytes_per_element), linear_bound=bound(lin, chip),
        attention_intensity=attn, attention_bound=bound(attn, chip))


def cost_report(config: ModelConfig, batches: Sequence[int], context: int, chip: ChipSpec,
                bytes_per_element: float = 2, kv_heads: Sequence[int | None] = (None,)) -> CostReport:
    """Rows for every (KV-head variant, batch) pair; `None` in `kv_heads` means the model's own count."""
    if not batches:
        raise ValueError("need at least one batch size")
    if not kv_heads:
        kv_heads = (None,)
    variants = [with_kv_heads(config, k) for k in kv_heads]
    return CostReport(
        model=config.name, chip=chip, context=context, bytes_per_element=bytes_per_element,
        summaries=tuple(summarize(v, context, bytes_per_element) for v in variants),
        rows=tuple(estimate_decode_step(v, b, context, chip, bytes_per_element) for v in variants for b in batches))
