"""Plot a `scripts/bench/benchmark.py --json` result: decode and end-to-end tokens/s and TTFT per side and batch size,
and pagejax's inter-token latency percentiles.

    python scripts/bench/benchmark.py --batch=1,32 --compare=hf --json > bench.log
    python scripts/bench/plot_benchmarks.py --json=bench.log --out=bench.png     # the last line of the file is read

or directly: `python scripts/bench/benchmark.py ... --plot=bench.png`. The figure is one PNG with four panels; a side
that has no number for a batch size simply has no bar there (serving-mode results show only the latency panel).
"""

from __future__ import annotations

import json

SIDES = ("pagejax", "hf", "llamacpp", "plain")
LABELS = {"pagejax": "pagejax", "hf": "transformers", "llamacpp": "llama.cpp", "plain": "pagejax (no speculation)"}


def batches_of(result: dict) -> list[int]:
    """Batch sizes any side measured, ascending."""
    found = {int(k.split("_", 1)[1]) for side in SIDES for k in result.get(side, {}) if k.startswith("batch_")}
    return sorted(found)


def _metric(result: dict, side: str, batch: int, key: str) -> float | None:
    entry = result.get(side, {}).get(f"batch_{batch}", {})
    value = entry.get(key)
    if value is None and key == "ttft_mean_s":
        value = entry.get("ttft_s", {}).get("mean") if isinstance(entry.get("ttft_s"), dict) else None
    return value


def _grouped_bars(ax, result: dict, batches: list[int], key: str, scale: float, ylabel: str) -> None:
    sides = [s for s in SIDES if any(_metric(result, s, b, key) is not None for b in batches)]
    width = 0.8 / max(len(sides), 1)
    for i, side in enumerate(sides):
        xs, ys = [], []
        for j, b in enumerate(batches):
            v = _metric(result, side, b, key)
            if v is not None:
                xs.append(j + (i - (len(sides) - 1) / 2) * width)
                ys.append(v * scale)
        bars = ax.bar(xs, ys, width, label=LABELS[side])
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel(ylabel)
    if sides:
        ax.legend(fontsize=8)


def _latency_rows(result: dict) -> list[tuple[str, dict]]:
    """(label, {p50, p90, p99} in seconds) for every pagejax run that recorded inter-token latencies."""
    rows = []
    for side in ("pagejax", "plain"):
        for key, entry in result.get(side, {}).items():
            if isinstance(entry, dict) and entry.get("itl_s"):
                where = key.replace("batch_", "batch ") if key.startswith("batch_") else key
                rows.append((f"{LABELS[side]}, {where}", entry["itl_s"]))
    return rows


def plot_results(result: dict, path: str) -> None:
    """Render `result` (benchmark.py's JSON object) into a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(side in result for side in SIDES):
        raise ValueError(f"no benchmark sides in the result (expected one of {SIDES}); pass benchmark.py's --json "
                         "output")
    batches = batches_of(result)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    _grouped_bars(axes[0, 0], result, batches, "decode_tok_s", 1.0, "decode tokens/s")
    axes[0, 0].set_title("decode throughput")
    _grouped_bars(axes[0, 1], result, batches, "output_tok_s", 1.0, "output tokens/s (end to end)")
    axes[0, 1].set_title("end-to-end throughput")
    _grouped_bars(axes[1, 0], result, batches, "ttft_mean_s", 1e3, "ms")
    axes[1, 0].set_title("time to first token (mean)")
    ax = axes[1, 1]
    rows = _latency_rows(result)
    for k, pct in enumerate(("p50", "p90", "p99")):
        bars = ax.bar([i + (k - 1) * 0.27 for i in range(len(rows))], [r[1].get(pct, 0) * 1e3 for r in rows], 0.27,
                      label=pct)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title("inter-token latency")
    if rows:
        ax.legend(fontsize=8)
    config = result.get("config", {})
    fig.suptitle(f"{config.get('model', '')}  in {config.get('input_len', '?')} / out {config.get('output_len', '?')} "
                 f"tokens, {config.get('quantization') or config.get('dtype', '')}\n{result.get('machine', '')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_result(path: str) -> dict:
    """benchmark.py's JSON object: the file's last non-empty line (the script prints it last)."""
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path} is empty; write benchmark.py's --json output into it")
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise ValueError(f"the last line of {path} is not JSON ({e}); run benchmark.py with --json") from None


def main(argv: list[str]) -> None:
    del argv
    plot_results(load_result(FLAGS.json), FLAGS.out)
    print(FLAGS.out)


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("json", None, "A file whose last line is benchmark.py's --json object.", required=True)
    flags.DEFINE_string("out", "benchmark.png", "Where to write the PNG.")
    FLAGS = flags.FLAGS
    app.run(main)
