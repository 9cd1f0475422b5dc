"""Run a worker script on virtual CPU devices in a subprocess (a pytest process has one CPU device, and the device
count is fixed when JAX starts) and read the JSON object it prints on its last stdout line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.xla_test_flags import cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_worker(script: str, devices: int = 8, timeout: int = 2400) -> dict:
    """`script`: a path relative to the repository root. Fails the test with the worker's stderr tail."""
    env = cpu_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == devices
    return result
