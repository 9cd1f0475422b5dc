"""The TPU side of scripts/bench/kernel_bench.py (`--tpu --smoke`: pagejax's TPU kernel in interpret mode beside
JAX's in-tree reference on the converted cache layout) and the schedule report's replay of both kernels' loops."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tpu_ab_smoke(tmp_path):
    out = tmp_path / "tpu_ab.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench", "kernel_bench.py"), "--tpu",
                           "--smoke", f"--out={out}"], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["smoke"] and result["all_ok"] and result["copy_bandwidth_GBps"] > 0
    assert set(result["cases"]) == {"tpu_ab_decode", "tpu_ab_mixed"}
    for case in result["cases"].values():
        assert set(case["variants"]) == {"pagejax_tpu", "jax_in_tree_reference"}
        for v in case["variants"].values():
            assert v["max_err"] <= 2e-5 and v["time_ms"] > 0


def test_jax_layout_puts_k_and_v_of_head_h_at_2h_and_2h_plus_1():
    from scripts.bench.tpu_kernel_ab import jax_layout

    kv = jnp.arange(3 * 5 * 4 * 2 * 8, dtype=jnp.float32).reshape(3, 5, 4, 2 * 8)  # [Hkv, P, ps, 2D]
    got = np.asarray(jax_layout(kv))
    assert got.shape == (5, 4, 6, 8)
    np.testing.assert_array_equal(got[:, :, 2 * 1], np.asarray(kv)[1, :, :, :8])
    np.testing.assert_array_equal(got[:, :, 2 * 2 + 1], np.asarray(kv)[2, :, :, 8:])


def test_schedule_replay_counts():
    """Llama-3-8B decode 64 x 2048 at page 16: the grid kernel, one grid step per (KV head, sequence), a DMA and a
    wait per page; the work-item kernel, one grid step per KV head and one wait per block of pages; page-wide DMAs,
    one grid step, one DMA per page for all 8 KV heads (8x fewer, 8x larger); the same KV bytes."""
    from scripts.tools.tpu_schedule import WORKLOADS, _item_kernel_counts, _memref_bytes, _old_kernel_counts

    q_lens, kv_lens, max_q_len = WORKLOADS["decode_64x2048"]
    shape = dict(group=4, num_kv_heads=8, page_size=16)
    old = _old_kernel_counts(q_lens, kv_lens, max_q_len, pages_per_block=32, **shape)
    per_head = _item_kernel_counts(q_lens, kv_lens, max_q_len, block_q=1, pages_per_block=64, decode=True, heads=1,
                                   **shape)
    wide = _item_kernel_counts(q_lens, kv_lens, max_q_len, block_q=1, pages_per_block=64, decode=True, heads=8,
                               **shape)
    assert old["grid_steps"] == 8 * 64 and old["kv_dmas"] == old["kv_waits"] == 8 * 64 * 128
    assert per_head["grid_steps"] == 8 and per_head["kv_dmas"] == 8 * 64 * 128
    assert per_head["kv_waits"] == 8 * 64 * 2
    assert old["cold_starts"] == 512 and per_head["cold_starts"] == 8
    assert per_head["q_out_dmas"] == 8 * 64 * 2 and old["q_out_dmas"] == 8 * 64 * 3 * 4
    assert wide["grid_steps"] == wide["cold_starts"] == 1
    assert wide["kv_dmas"] == 64 * 128 and wide["kv_waits"] == 64 * 2 and wide["q_out_dmas"] == 64 * 2
    mixed = WORKLOADS["mixed_512chunk_63decodes"]
    prefill_wide = _item_kernel_counts(*mixed, block_q=32, pages_per_block=32, decode=False, heads=8, **shape)
    prefill_per_head = _item_kernel_counts(*mixed, block_q=32, pages_per_block=32, decode=False, heads=1, **shape)
    assert prefill_wide["kv_dmas"] * 8 == prefill_per_head["kv_dmas"]
    assert prefill_wide["q_out_dmas"] == prefill_per_head["q_out_dmas"]  # q/out: one DMA per query head either way
    assert _memref_bytes([2, 4, 128], "f32", (4, 128)) == 4096
    assert _memref_bytes([2, 3, 100], "bf16", (8, 128)) == 2 * 8 * 128 * 2  # minor axes padded to whole tiles
