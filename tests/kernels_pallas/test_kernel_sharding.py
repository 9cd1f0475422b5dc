"""kernels_pallas.sharded: attention split over KV heads with shard_map equals the unsharded call, for the reference,
the Pallas GPU kernel (interpret mode) and the C++ CPU kernel, f32, int8 and fp8 caches, and MLA split over query heads,
on 8 virtual CPU devices in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.xla_test_flags import cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sharded_attention_equals_unsharded():
    env = cpu_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
    worker = os.path.join(ROOT, "tests", "kernels_pallas", "kernel_sharding_worker.py")
    proc = subprocess.run([sys.executable, worker], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 8
    res = out["results"]
    # 16 query heads over 8 KV heads; [T=8 tokens, heads per device, D=64] on each device.
    expected = {"reference_tp8": (8, 2), "reference_int8_dp2_tp4": (4, 4), "gpu_interpret_int8_tp2": (2, 8),
                "cpu_kernel_int8_dp2_tp4": (4, 4), "cpu_kernel_fp8_tp8": (8, 2)}
    for name, (shards, heads) in expected.items():
        assert res[name]["max_err"] <= 2e-5, (name, res[name])
        assert res[name]["num_shards"] == shards and res[name]["shard_shape"] == [8, heads, 64], (name, res[name])
    # MLA: 8 query heads over 4 devices, output in latent space (Dl = 48)
    mla = res["mla_reference_tp4"]
    assert mla["max_err"] <= 2e-5 and mla["num_shards"] == 4 and mla["shard_shape"] == [8, 2, 48], mla
    assert "must all divide" in res["bad_axis_error"]
