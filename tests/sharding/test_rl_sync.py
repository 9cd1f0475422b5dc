"""`LLM.update_weights` from a trainer's FSDP layout over 8 virtual CPU devices into an engine at TP 2 x DP 2
(tests/sharding/rl_sync_worker.py in a subprocess): no recompile, no host transfer (JAX's transfer guards
disallow both directions during the sync), every replica's leaves bit-equal to the trainer's in the engine's own
shardings, and generation equals the same weights sent through the host."""

from __future__ import annotations

from tests.virtual_devices import run_worker


def test_update_weights_reshards_fsdp8_into_tp2_dp2_without_recompile_or_host_copy():
    r = run_worker("tests/sharding/rl_sync_worker.py")  # asserts the 8 devices
    assert r["trainer_devices"] == 8 and r["replica_devices"] == [2, 2]
    assert not r["recompiled"] and r["exact"] and r["same_shardings"]
    assert r["after"] == r["via_host"] and r["after"] != r["before"]
