"""scripts/bench/kernel_bench.py --smoke: the GPU benchmark's whole flow (checks against the reference, copy bandwidth,
timing, JSON) on tiny shapes in interpret mode, in a subprocess (absl flags are process-global)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_kernel_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    script = os.path.join(ROOT, "scripts", "bench", "kernel_bench.py")
    proc = subprocess.run([sys.executable, script, "--smoke", "--sweep", f"--out={out}"], cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["smoke"] and result["all_ok"] and result["copy_bandwidth_GBps"] > 0
    assert set(result["cases"]) == {"decode", "decode_int8", "mixed", "decode_bf16", "decode_bf16_int8",
                                     "basic_padded"}
    for name, case in result["cases"].items():
        assert "xla_reference" in case["variants"] and len(case["variants"]) >= 2
        for v in case["variants"].values():
            tol = 2e-2 if name.startswith("decode_bf16") else 2e-5
            assert v["max_err"] <= tol and v["time_ms"] > 0 and v["GBps"] > 0
    for name in ("decode_bf16", "decode_bf16_int8"):
        assert set(result["cases"][name]["variants"]) == {"xla_reference", "pallas", "mosaic"}
    # --sweep: the Triton tuning variants (one each under --smoke) in decode, decode_int8 and mixed
    assert "pallas_ppb2_w4_s2" in result["cases"]["decode"]["variants"]
    assert "pallas_ppb2_w4_s2" in result["cases"]["decode_int8"]["variants"]
    assert "pallas_bq8_ppb2" in result["cases"]["mixed"]["variants"]
    # the int8 cache reads 1-byte values plus one f32 scale per token and head slot: fewer bytes than f32
    assert result["cases"]["decode_int8"]["bytes_read"] < result["cases"]["decode"]["bytes_read"]
