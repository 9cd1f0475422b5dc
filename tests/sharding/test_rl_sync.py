"""`LLM.update_weights` from a trainer's FSDP layout over 8 virtual CPU devices into an engine at TP 2 x DP 2
(tests/sharding/rl_sync_worker.py in a subprocess): no recompile, no host transfer (JAX's transfer guards
disallow both directions during the sync), every replica's leaves bit-equal to the trainer's in the engine's own
shardings, and generation equals the same weights sent through the host."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_update_weights_reshards_fsdp8_into_tp2_dp2_without_recompile_or_host_copy():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    worker = os.path.join(ROOT, "tests", "sharding", "rl_sync_worker.py")
    proc = subprocess.run([sys.executable, worker], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["devices"] == 8 and r["trainer_devices"] == 8 and r["replica_devices"] == [2, 2]
    assert not r["recompiled"] and r["exact"] and r["same_shardings"]
    assert r["after"] == r["via_host"] and r["after"] != r["before"]
