"""Back-of-envelope decode cost model: weights, KV cache, bandwidth-only step time and the roofline.

This is the arithmetic of CS336 lecture 10 ("Inference"), kept as code so a serving decision (batch size, KV heads,
chip) can be checked before anything is compiled:

- KV cache: M = 2·b·B·S·L·K·H bytes (keys and values, B sequences of S cached tokens, L layers, K KV heads of
  width H, b bytes per element). Everything about *which* elements a layer caches lives in
  `kv_bytes_per_token` and its two per-layer hooks, so sliding-window and MLA variants extend one place.
- State cache (a hybrid model's state layers: Gated DeltaNet, Mamba2): a constant number of bytes per sequence,
  `ModelConfig.state_bytes_per_sequence`, whatever its context; `state_vs_kv` tabulates it against the KV
  cache's growth.
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
import json
import math
import os
from collections.abc import Sequence
from typing import Any

from configs.chips import CHIP_PRESETS, ChipSpec, get_chip
from configs.presets import MODEL_PRESETS
from models.config import ModelConfig
from models.loaders.hf_checkpoint import config_from_hf
from models.weights import expected_shapes

GB = 1e9  # decimal gigabyte, as in the lecture's table

# --------------------------------------------------------------------------------------------------------------
# Parameters and weight bytes
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParamCount:
    """Parameter count by kind.

    `matrices` is the lecture's simplified P = 2VD + 3DFL + (2DNH + 2DKH)L (for untied embeddings): it omits the
    small norm vectors and biases. `total` adds them back and equals `models.weights.num_params`; the weight bytes
    the step-time model reads are `total · b`, since every parameter is read each step.
    """

    embeddings: int
    attention: int
    mlp: int
    norms: int
    biases: int

    @property
    def matrices(self) -> int:
        return self.embeddings + self.attention + self.mlp

    @property
    def total(self) -> int:
        return self.matrices + self.norms + self.biases


_ATTENTION_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj")


def param_count(config: ModelConfig) -> ParamCount:
    """Count parameters by kind, from the weight layout the config implies (models/weights.py): so MLA's low-rank
    projections, experts, CLA's missing K/V and Gemma's extra norms are counted exactly as loaded."""
    counts = dict(embeddings=0, attention=0, mlp=0, norms=0, biases=0)
    for name, shape in expected_shapes(config).items():
        leaf = name.rsplit(".", 1)[-1]
        kind = ("embeddings" if name in ("embed", "lm_head") else "biases" if leaf.endswith("_bias")
                else "norms" if leaf.endswith("norm") else "attention" if leaf in _ATTENTION_LEAVES else "mlp")
        counts[kind] += math.prod(shape)
    return ParamCount(**counts)


#: Bytes per weight / cache element of the formats pagejax stores. fp8 is float8_e4m3fn (quantization="fp8",
#: kv_cache_dtype="fp8") and int8 one byte too; their float32 scales (one per output channel of a weight, one per
#: token and KV head of a cache: 4 / head_dim bytes per element, 3% at head_dim 128) are not counted.
FORMAT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0}
#: The chips `bounds_table` prints by default: the FP8 chips (Hopper) of the presets.
FP8_CHIPS = ("h100", "h200")


def format_bytes(name: str) -> float:
    """Bytes per element of a storage format name (FORMAT_BYTES)."""
    if name not in FORMAT_BYTES:
        raise ValueError(f"unknown format {name!r}; known: {', '.join(FORMAT_BYTES)}")
    return FORMAT_BYTES[name]


def weight_bytes(config: ModelConfig, bytes_per_element: float) -> float:
    """Bytes of all weights at `bytes_per_element` (2 for bf16): what one decode step of a dense model reads."""
    return param_count(config).total * bytes_per_element


def weight_bytes_read(config: ModelConfig, batch: int, bytes_per_element: float) -> float:
    """Weight bytes one decode step of `batch` sequences reads. Dense models read every weight. A mixture of experts
    reads only the routed experts some token picked: under uniform routing E·(1 − (1 − k/E)^B) of the E per layer
    (k at batch 1, nearly all once B ≫ E/k), so small batches of a sparse model cost far less than its size."""
    total = weight_bytes(config, bytes_per_element)
    if not config.num_experts:
        return total
    e, k = config.num_experts, config.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    moe_layers = sum(config.is_moe(i) for i in range(config.num_layers))
    expert_bytes = 3 * config.hidden_size * config.moe_intermediate_size * bytes_per_element
    return total - moe_layers * (e - touched) * expert_bytes


# --------------------------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------------------------


def _kv_elements_per_token(config: ModelConfig, layer: int) -> int:
    """Cache elements one token adds to one layer: 2·K·H for ordinary attention, the latent plus the RoPE key for
    MLA (512 + 64 = 576 for DeepSeek-V2), nothing for a CLA layer that reads an earlier layer's cache or a state
    layer (its state does not grow: `state_bytes_per_sequence`)."""
    return config.kv_width if config.owns_kv(layer) and not config.is_state_layer(layer) else 0


def _cached_tokens(config: ModelConfig, layer: int, context: int) -> int:
    """Tokens a layer keeps for a sequence of `context` tokens: windowed layers keep at most their window."""
    window = config.layer_window(layer)
    return context if window is None else min(context, window)


def kv_bytes_per_token(config: ModelConfig, bytes_per_element: float) -> float:
    """KV cache bytes one token occupies across all layers (2·L·K·H·b for ordinary attention); sliding windows
    bound tokens rather than bytes per token (see `kv_bytes_per_sequence`)."""
    return config.kv_bytes_per_token(bytes_per_element)


def kv_bytes_per_sequence(config: ModelConfig, context: int, bytes_per_element: float) -> float:
    """KV cache bytes of one sequence with `context` cached tokens: 2·b·S·L·K·H, windowed layers capped."""
    _check_positive("context", context)
    elements = sum(_kv_elements_per_token(config, i) * _cached_tokens(config, i, context)
                   for i in range(config.num_layers))
    return elements * bytes_per_element


def state_bytes_per_sequence(config: ModelConfig, bytes_per_element: float) -> float:
    """State-cache bytes of one sequence (0 without state layers), the same at every context: the recurrent states
    in float32 always, the conv windows in the activations' dtype (bfloat16 unless `bytes_per_element` is 4)."""
    if not config.has_state_layers:
        return 0.0
    return float(config.state_bytes_per_sequence("float32" if bytes_per_element >= 4 else "bfloat16"))


def state_vs_kv(config: ModelConfig, contexts: Sequence[int], bytes_per_element: float = 2) -> str:
    """One sequence's cache bytes at each context: the KV cache of the attention layers (growing) beside the state
    of the state layers (constant), and their sum."""
    state = state_bytes_per_sequence(config, bytes_per_element)
    lines = [f"model {config.name}: one sequence's cache, {bytes_per_element:g} bytes per KV element; "
             f"{config.num_kv_layers} KV layers, {len(config.state_layers)} state layers",
             "  context      kv_mb   state_mb   total_mb"]
    for context in contexts:
        kv = kv_bytes_per_sequence(config, context, bytes_per_element)
        lines.append(f"{context:9d} {kv / 1e6:10.2f} {state / 1e6:10.2f} {(kv + state) / 1e6:10.2f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# Arithmetic intensity and the roofline
# --------------------------------------------------------------------------------------------------------------


def linear_intensity(tokens: int, d_in: int, d_out: int, bytes_per_element: float = 2) -> float:
    """FLOPs per byte of a [tokens, d_in] × [d_in, d_out] matmul: 2·n·D·F / (b·(n·D + D·F + n·F)).

    Counts a multiply-add as two FLOPs and charges one read of the input and weight and one write of the output.
    `tokens` is B·T: batched sequences times query positions each (T = 1 in decode).
    """
    for name, value in (("tokens", tokens), ("d_in", d_in), ("d_out", d_out)):
        _check_positive(name, value)
    _check_positive("bytes_per_element", bytes_per_element)
    flops = 2 * tokens * d_in * d_out
    moved = bytes_per_element * (tokens * d_in + d_in * d_out + tokens * d_out)
    return flops / moved


def linear_intensity_approx(tokens: int, bytes_per_element: float = 2) -> float:
    """The weight-dominated limit of `linear_intensity` for tokens ≪ D, F: 2·n/b, i.e. ≈ B·T in bf16.

    Why it holds: the D·F weight bytes dominate traffic, so FLOPs/bytes → 2·n·D·F / (b·D·F). For large n the
    exact ratio instead saturates at 2·D·F / (b·(D + F)).
    """
    _check_positive("tokens", tokens)
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
        _check_positive(name, value)
    _check_positive("bytes_per_element", bytes_per_element)
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
    _check_positive("kv_heads", kv_heads)
    if config.num_heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} does not divide num_heads={config.num_heads}; each KV head must serve "
                         "the same number of query heads")
    return config.replace(num_kv_heads=kv_heads)


def summarize(config: ModelConfig, context: int, bytes_per_element: float) -> ModelSummary:
    """Batch-independent sizes: parameters, weight bytes and KV bytes per token and per sequence."""
    _check_positive("bytes_per_element", bytes_per_element)
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
    _check_positive("batch", batch)
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


def bounds_table(config: ModelConfig, batches: Sequence[int], context: int, formats: Sequence[str] = ("bf16", "fp8"),
                 chips: Sequence[str] = FP8_CHIPS) -> str:
    """The bandwidth-only decode bound (ms a step, tokens/s) of each chip x storage format (weights and KV cache in
    the same format) x batch, side by side: what FP8 weights and an FP8 cache buy on Hopper."""
    lines = [f"model {config.name}, context S={context}: decode bound = (weights + batch·KV per sequence) / bandwidth",
             "chip   format  batch  weights_gb  kv_gb  step_ms  tokens_per_s"]
    for chip_name in chips:
        chip = get_chip(chip_name)
        for fmt in formats:
            for b in batches:
                r = estimate_decode_step(config, b, context, chip, format_bytes(fmt))
                lines.append(f"{chip.name:6s} {fmt:7s} {b:5d}  {r.weight_bytes / GB:10.2f}  {r.kv_bytes / GB:5.2f}  "
                             f"{r.step_s * 1e3:7.2f}  {r.tokens_per_s:12,.0f}")
    return "\n".join(lines)


def json_rows(report: CostReport) -> list[dict[str, Any]]:
    return [row.json_row() for row in report.rows]


# --------------------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------------------

_COLUMNS = ("kv_heads", "batch", "weights_gb", "kv_cache_gb", "total_gb", "step_ms", "tokens_per_s",
            "linear_I", "~B", "linear", "attn_I", "attn")


def _row_cells(row: StepEstimate) -> tuple[str, ...]:
    j = row.json_row()
    return (str(row.kv_heads), str(row.batch), f"{j['weights_gb']:.2f}", f"{j['kv_cache_gb']:.2f}",
            f"{j['total_gb']:.2f}", f"{j['step_ms']:.2f}", f"{j['tokens_per_s']:,.0f}",
            f"{row.linear_intensity:.1f}", f"{row.linear_intensity_approx:g}", row.linear_bound,
            f"{row.attention_intensity:.3f}", row.attention_bound)


def format_report(report: CostReport) -> str:
    """A human-readable table; figures rounded as in the lecture (GB to 0.01, ms to 0.01, tokens/s to 1)."""
    chip = report.chip
    lines = [f"model {report.model or '(unnamed)'}, context S={report.context}, "
             f"{report.bytes_per_element:g} bytes per element"]
    for s in report.summaries:
        lines.append(
            f"  K={s.kv_heads}: {s.params.total:,} params ({s.params.matrices:,} without norms/biases); "
            f"weights {s.weight_bytes / GB:.2f} GB; KV {s.kv_bytes_per_token:,.0f} B/token, "
            f"{s.kv_bytes_per_sequence / GB:.3f} GB per sequence"
            + (f"; state {s.state_bytes_per_sequence / 1e6:.2f} MB per sequence (constant in the context)"
               if s.state_bytes_per_sequence else ""))
    lines.append(f"chip {chip.name}: {chip.flops_per_s / 1e12:g} TFLOP/s, {chip.bandwidth_bytes_per_s / 1e12:g} TB/s; "
                 f"roofline crossover {chip.crossover_intensity:.0f} FLOP/byte")
    lines.append("step_ms = (weights + batch·KV per sequence) / bandwidth; intensities in FLOP/byte "
                 "(linear: MLP [B,D]x[D,F]; attn: one-token decode)")
    cells = [_COLUMNS] + [_row_cells(r) for r in report.rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(_COLUMNS))]
    for c in cells:
        lines.append("  ".join(v.rjust(w) for v, w in zip(c, widths)))
    return "\n".join(lines)


def plot_report(report: CostReport, path: str) -> None:
    """Write a two-panel figure: memory bars (weights + KV per row) and the chip's roofline with this model's ops.

    matplotlib is imported here, not at module load, so the cost model works where it is not installed.
    """
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plotting the cost model needs matplotlib, which is not installed: "
                          "pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chip = report.chip
    fig, (mem, roof) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"K={r.kv_heads}\nB={r.batch}" for r in report.rows]
    weights = [r.weight_bytes / GB for r in report.rows]
    kv = [r.kv_bytes / GB for r in report.rows]
    mem.bar(labels, weights, label="weights")
    mem.bar(labels, kv, bottom=weights, label="KV cache")
    for i, r in enumerate(report.rows):
        mem.annotate(f"{r.total_bytes / GB:.2f}", (i, r.total_bytes / GB), ha="center", va="bottom", fontsize=8)
    if chip.hbm_bytes:
        mem.axhline(chip.hbm_bytes / GB, color="k", linestyle="--", linewidth=1,
                    label=f"{chip.name} nominal HBM {chip.hbm_bytes / GB:g} GB")
    mem.set_ylabel("decimal GB")
    mem.set_title(f"{report.model}: decode memory at S={report.context}")
    mem.legend(fontsize=8)

    crossover = chip.crossover_intensity
    xs = [0.1, crossover, crossover * 100]
    roof.loglog(xs, [min(chip.flops_per_s, x * chip.bandwidth_bytes_per_s) / 1e12 for x in xs], color="k")
    roof.axvline(crossover, color="gray", linestyle=":", linewidth=1)
    # Linear intensity depends on the batch only, decode attention on the KV-head count only: one point each.
    linear = {f"linear B={r.batch}": r.linear_intensity for r in report.rows}
    attention = {f"decode attn K={r.kv_heads}": r.attention_intensity for r in report.rows}
    for points, marker, offset in ((linear, "o", (-6, 6)), (attention, "s", (6, -10))):
        for label, x in points.items():
            y = min(chip.flops_per_s, x * chip.bandwidth_bytes_per_s) / 1e12
            roof.scatter([x], [y], marker=marker, s=20, zorder=3)
            roof.annotate(label, (x, y), fontsize=7, xytext=offset, textcoords="offset points",
                          ha="right" if offset[0] < 0 else "left")
    roof.set_xlabel("arithmetic intensity (FLOP/byte)")
    roof.set_ylabel("attainable TFLOP/s")
    roof.set_title(f"{chip.name} roofline, crossover ≈ {crossover:.0f} FLOP/byte")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------------
# Inputs: model source, chip, integer lists
# --------------------------------------------------------------------------------------------------------------

def load_model_config(source: str) -> ModelConfig:
    """A preset name, a Hugging Face config.json, or a folder holding one."""
    if source in MODEL_PRESETS:
        return MODEL_PRESETS[source]
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    if os.path.isfile(path):
        return config_from_hf_json(path)
    raise ValueError(f"unknown model {source!r}: not a preset ({', '.join(sorted(MODEL_PRESETS))}), "
                     "a config.json file, or a folder holding one")


def config_from_hf_json(path: str) -> ModelConfig:
    """A Hugging Face config.json through the loader's own translation (models.loaders.hf_checkpoint.config_from_hf):
    windows, MLA and mixtures of experts come out as the model would load them."""
    with open(path, encoding="utf-8") as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config_from_hf(hf, path, name=os.path.basename(os.path.dirname(os.path.abspath(path))))


def resolve_chip(name: str, flops: float | None = None, bandwidth: float | None = None) -> ChipSpec:
    """The named chip preset with explicit peak FLOP/s and/or bandwidth substituted where given.

    With both figures given, the name is only a label and need not be a preset (no HBM capacity is then known).
    """
    if flops is not None and bandwidth is not None and name.strip().lower() not in CHIP_PRESETS:
        return ChipSpec(name=name or "custom", flops_per_s=flops, bandwidth_bytes_per_s=bandwidth)
    chip = get_chip(name)
    if flops is None and bandwidth is None:
        return chip
    return dataclasses.replace(
        chip, name=f"{chip.name} with overrides",
        flops_per_s=chip.flops_per_s if flops is None else flops,
        bandwidth_bytes_per_s=chip.bandwidth_bytes_per_s if bandwidth is None else bandwidth)


def parse_int_list(values: Sequence[str] | None, what: str) -> tuple[int, ...]:
    """Parse "1,64,256"-style flag values into positive integers, naming the flag in any error."""
    out = []
    for v in values or ():
        try:
            n = int(str(v).strip())
        except ValueError:
            raise ValueError(f"{what}: {v!r} is not an integer") from None
        _check_positive(what, n)
        out.append(n)
    return tuple(out)


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")
