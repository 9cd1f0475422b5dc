"""scripts/bench/gpu_report.py --smoke: the GPU report's whole flow on CPU with tiny shapes (interpreted kernels with
padded metadata, tiny-llama through the benchmark machinery, a profiler trace summarized per kernel and step, the
scheduling policies side by side, the host-overhead bench in a child process, a family checkpoint against
transformers' logits, JSON and markdown), in a subprocess (absl flags are global); and
the trace summary on synthetic GPU-shaped events."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_report_smoke(tmp_path):
    out, md = tmp_path / "report.json", tmp_path / "report.md"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench", "gpu_report.py"), "--smoke",
                           f"--out={out}", f"--md={md}"], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["smoke"] and r["all_ok"] and not r["errors"]
    assert r["rates"]["copy_Bps"] > 0 and r["rates"]["matmul_flops"] > 0
    assert set(r["kernels"]["cases"]) == {"decode", "basic_padded"}
    padded = r["kernels"]["cases"]["basic_padded"]
    assert padded["num_seqs"] == 3 and padded["variants"]["pallas"]["ok"]
    for batch in r["batches"]:
        row = r["model"][f"batch_{batch}"]
        assert row["decode_tok_s"] > 0 and 0 < row["itl_p50_fraction_of_copy_floor"]
        assert 0 < row["prefill_fraction_of_matmul_rate"]
    trace = r["trace"]
    assert trace["step"] == "PjitFunction(packed_step)" and trace["steps"] >= 2
    assert 0 < trace["busy_ms_median"] <= trace["spacing_ms_median"] and trace["top_kernels"]
    assert r["families"] and all(f["ok"] for f in r["families"].values())
    serving = r["serving"]
    assert serving["auto"] in ("mixed", "prefill_first") and serving["num_requests"] == 4
    for policy in ("mixed", "prefill_first"):
        row = serving[policy]
        assert 0 < row["itl_p50_ms"] <= row["itl_p99_ms"] and row["itl_p99_over_p50"] >= 1
        assert row["output_tok_s"] > 0 and row["offline_output_tok_s"] > 0 and row["compiles_in_measured_run"] >= 0
    host = r["host"]
    small, large = host["seqs_4"], host["seqs_8"]
    assert small["device_ms"] > 0 and large["step_ms"] > 0 and large["host_ms_per_seq"] > 0
    assert abs(host["itl_p50_growth"] - large["itl_p50_ms"] / small["itl_p50_ms"]) < 1e-9
    assert abs(host["step_over_device_ms"] - (large["step_ms"] - large["device_ms"])) < 1e-9
    table = md.read_text()
    assert "basic_padded pallas" in table and "model batch_1 decode" in table and "trace batch" in table
    assert "serving prefill_first" in table and "host: tiny model's gap between tokens, 4 -> 8" in table


def _event(name, start, end):
    return SimpleNamespace(name=name, start_ns=start, end_ns=end)


def test_trace_summary_of_gpu_shaped_events():
    """Two steps 10 ms apart on the "XLA Modules" line; kernels on a stream line: busy time is the union of the
    kernels inside each step (overlaps counted once), and kernel names lose their numeric suffix."""
    from scripts.bench.trace_summary import summarize_trace

    ms = 1_000_000
    modules = [_event("jit__step(7)", 0, 9 * ms), _event("jit__step(7)", 10 * ms, 19 * ms),
               _event("jit_other(3)", 20 * ms, 21 * ms), _event("jit__step(7)", 20 * ms, 29 * ms)]
    stream = [_event("gemm_fusion_dot.12", 0, 4 * ms), _event("gemm_fusion_dot.13", 2 * ms, 5 * ms),
              _event("input_scatter_fusion_3", 5 * ms, 6 * ms), _event("gemm_fusion_dot.12", 10 * ms, 12 * ms)]
    plane = SimpleNamespace(name="/device:GPU:0", lines=[SimpleNamespace(name="XLA Modules", events=modules),
                                                         SimpleNamespace(name="Stream #13(compute)", events=stream)])
    s = summarize_trace([SimpleNamespace(name="/host:CPU", lines=[]), plane])
    assert s["step"] == "jit__step" and s["steps"] == 2  # 3 step starts: 2 intervals
    assert s["spacing_ms_median"] == 10 and s["busy_ms_median"] == 4  # steps busy 6 ms and 2 ms
    assert abs(s["busy_fraction"] - 8 / 20) < 1e-9
    assert s["top_kernels"][0] == {"name": "gemm_fusion_dot", "ms_per_step": 4.5}
    assert s["top_kernels"][1] == {"name": "input_scatter_fusion", "ms_per_step": 0.5}
