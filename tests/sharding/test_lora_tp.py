"""LoRA under tensor parallelism: TP 2 on virtual devices equals TP 1 with two adapters and the base model in one
batch, the adapter slots shard like the weights they modify (heads padded 9/3 -> 12/4), and update_lora works in
shards without recompiling (tests/sharding/lora_worker.py in a subprocess, since this process has one device)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.virtual_devices import run_worker


@pytest.fixture(scope="module")
def worker() -> dict:
    return run_worker("tests/sharding/lora_worker.py")


def test_tp2_equals_tp1_with_adapters_in_one_batch(worker):
    one, two = worker["results"]["1"], worker["results"]["2"]
    assert one["errors"] == two["errors"] == [None] * 3
    assert len({tuple(t) for t in one["tokens"]}) == 3
    assert two["tokens"] == one["tokens"]
    for got, want in zip(two["prompt_logprobs"], one["prompt_logprobs"]):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert two["tokens_before_update"] == one["tokens_before_update"] == one["tokens"][0]
    assert two["tokens_after_update"] == one["tokens_after_update"] != one["tokens"][0]
    assert not one["recompiled_after_update"] and not two["recompiled_after_update"]


def test_adapter_slots_shard_like_their_weights(worker):
    one, two = worker["results"]["1"], worker["results"]["2"]
    specs = two["specs"]
    # Column parallel (q, k: output on "model"): A whole, B's output split. Row parallel (o, down): A's input split.
    assert specs["layers.0.q_proj.a"] == specs["layers.0.k_proj.a"] == "P(None, None, None)"
    assert specs["layers.0.q_proj.b"] == specs["layers.0.k_proj.b"] == "P(None, None, 'model')"
    assert specs["layers.0.o_proj.a"] == specs["layers.0.down_proj.a"] == "P(None, 'model', None)"
    assert specs["layers.0.o_proj.b"] == "P(None, None, None)"
    # 3 slots (max_loras=2 + none), rank 8; 9 query heads of 16 padded to 12 at TP 2.
    assert one["shapes"]["layers.0.q_proj"] == [[3, 64, 8], [3, 8, 144]]
    assert two["shapes"]["layers.0.q_proj"] == [[3, 64, 8], [3, 8, 192]]
    assert two["shapes"]["layers.0.o_proj"] == [[3, 192, 8], [3, 8, 64]]
    assert two["slot_bytes_per_device"] < two["slot_bytes_global"]
