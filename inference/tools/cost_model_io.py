"""The cost model's inputs (a model source, a chip with overrides, flag lists) and outputs (text tables, JSON rows,
the figure): what `scripts/tools/cost_model.py` and the notebook read and print, kept apart from the arithmetic
(`cost_model.py`, `model_bytes.py`)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from configs.chips import CHIP_PRESETS, ChipSpec, get_chip
from configs.presets import MODEL_PRESETS
from inference.tools.cost_model import GB, CostReport, StepEstimate, estimate_decode_step
from inference.tools.model_bytes import check_positive, format_bytes, kv_bytes_per_sequence, state_bytes_per_sequence
from models.config import ModelConfig
from models.loaders.hf_checkpoint import config_from_hf

# --------------------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------------------

#: The chips `bounds_table` prints by default: the FP8 chips (Hopper) of the presets.
FP8_CHIPS = ("h100", "h200")


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
        check_positive(what, n)
        out.append(n)
    return tuple(out)
