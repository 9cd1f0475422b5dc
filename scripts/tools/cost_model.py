"""Decode cost model: weights, KV cache, bandwidth-only step time, throughput and roofline for a model and chip.

    python scripts/tools/cost_model.py --model=llama-2-13b --batch=1,64,256 --context=1024 --bandwidth=3.35e12
    python scripts/tools/cost_model.py --model=llama-2-13b --batch=64,256 --kv_heads=8 --json
    python scripts/tools/cost_model.py --model=path/to/config.json --chip=v5e --plot=out.png
    python scripts/tools/cost_model.py --model=llama-3-8b --batch=1,64,256 --formats=bf16,fp8   # H100/H200 bounds
    python scripts/tools/cost_model.py --model=qwen3-next-80b-a3b --state_vs_kv=1024,32768,262144  # hybrid caches

The logic lives in `inference.tools.cost_model` (its inputs and outputs in `cost_model_io`); this file only reads
flags and prints.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from absl import app, flags

from inference.tools import cost_model, cost_model_io

_MODEL = flags.DEFINE_string("model", "llama-2-13b", "Model preset name, or a HF config.json (or folder holding one).")
_BATCH = flags.DEFINE_list("batch", ["1"], "Comma-separated batch sizes (concurrent sequences).")
_CONTEXT = flags.DEFINE_integer("context", 1024, "Cached tokens per sequence (S).")
_KV_HEADS = flags.DEFINE_list("kv_heads", None, "Comma-separated KV-head counts for hypothetical GQA variants "
                              "(default: the model's own).")
_BYTES = flags.DEFINE_float("bytes_per_element", 2.0, "Bytes per weight and cache element (2 = bf16).")
_FORMATS = flags.DEFINE_list("formats", None, "Storage formats (bf16, fp8, int8, float32): print the H100/H200 "
                             "decode bounds of each side by side instead of the single-chip report.")
_CHIP = flags.DEFINE_string("chip", "h100", "Chip preset: h100, h200, v5e, v6e.")
_FLOPS = flags.DEFINE_float("flops", None, "Peak FLOP/s, overriding the chip preset.")
_BANDWIDTH = flags.DEFINE_float("bandwidth", None, "Memory bandwidth in bytes/s, overriding the chip preset.")
_JSON = flags.DEFINE_bool("json", False, "Print a JSON list of rows instead of the table.")
_STATE_VS_KV = flags.DEFINE_list("state_vs_kv", None, "Comma-separated contexts: print one sequence's KV bytes "
                                  "(growing) beside its state bytes (constant; hybrid models) at each.")
_PLOT = flags.DEFINE_string("plot", None, "Write a memory-bars + roofline figure to this path (needs matplotlib).")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        config = cost_model_io.load_model_config(_MODEL.value)
        if _STATE_VS_KV.value:
            contexts = cost_model_io.parse_int_list(_STATE_VS_KV.value, "--state_vs_kv")
            print(cost_model_io.state_vs_kv(config, contexts, _BYTES.value))
            return
        if _FORMATS.value:
            print(cost_model_io.bounds_table(config, cost_model_io.parse_int_list(_BATCH.value, "--batch"),
                                             _CONTEXT.value, _FORMATS.value))
            return
        chip = cost_model_io.resolve_chip(_CHIP.value, _FLOPS.value, _BANDWIDTH.value)
        report = cost_model.cost_report(
            config, cost_model_io.parse_int_list(_BATCH.value, "--batch"), _CONTEXT.value, chip, _BYTES.value,
            cost_model_io.parse_int_list(_KV_HEADS.value, "--kv_heads") or (None,))
    except ValueError as e:
        sys.exit(f"error: {e}")
    if _JSON.value:
        print(json.dumps(cost_model_io.json_rows(report), indent=1))
    else:
        print(cost_model_io.format_report(report))
    if _PLOT.value:
        cost_model_io.plot_report(report, _PLOT.value)


if __name__ == "__main__":
    app.run(main)
