"""scripts/bench/plot_benchmarks.py renders benchmark.py's JSON into a PNG; scripts/bench/llamacpp_bench.py fails with an install
hint when llama-cpp-python is missing. No model is loaded: these check the tools, not speed."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from scripts.bench import plot_benchmarks
from scripts.bench.llamacpp_bench import INSTALL_HINT, import_llama_cpp

RESULT = {
    "machine": "test box", "config": {"model": "tiny", "input_len": 8, "output_len": 4, "dtype": "float32"},
    "pagejax": {"load_s": 1.0,
                "batch_1": {"ttft_mean_s": 0.2, "decode_tok_s": 31.0, "output_tok_s": 29.0,
                            "itl_s": {"mean": 0.03, "p50": 0.031, "p90": 0.038, "p99": 0.044}},
                "batch_32": {"ttft_mean_s": 3.7, "decode_tok_s": 135.0, "output_tok_s": 121.0,
                             "itl_s": {"mean": 0.2, "p50": 0.21, "p90": 0.25, "p99": 0.29}}},
    "hf": {"batch_1": {"ttft_mean_s": 0.22, "decode_tok_s": 17.0, "output_tok_s": 16.6},
           "batch_32": {"ttft_mean_s": 5.8, "decode_tok_s": 157.0, "output_tok_s": 129.0}},
    "ratio": {"batch_1": {"decode_tok_s": 1.8, "output_tok_s": 1.7}},
}


def test_plot_renders_png(tmp_path):
    pytest.importorskip("matplotlib")  # in the `dev` extra
    from PIL import Image

    path = tmp_path / "bench.png"
    plot_benchmarks.plot_results(RESULT, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = np.asarray(Image.open(path).convert("L"))
    assert img.shape[0] > 500 and img.shape[1] > 800
    assert (img < 128).mean() > 0.01  # bars, axes and labels were drawn, not a blank canvas
    assert plot_benchmarks.batches_of(RESULT) == [1, 32]
    assert [r[0] for r in plot_benchmarks._latency_rows(RESULT)] == ["pagejax, batch 1", "pagejax, batch 32"]


def test_plot_reads_last_json_line_and_rejects_bad_input(tmp_path):
    pytest.importorskip("matplotlib")
    log = tmp_path / "bench.log"
    log.write_text("pagejax batch 1: ...\n" + json.dumps(RESULT) + "\n")
    assert plot_benchmarks.load_result(str(log)) == RESULT
    log.write_text("no json here\n")
    with pytest.raises(ValueError, match="--json"):
        plot_benchmarks.load_result(str(log))
    with pytest.raises(ValueError, match="no benchmark sides"):
        plot_benchmarks.plot_results({"machine": "x"}, str(tmp_path / "x.png"))


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama-cpp-python is installed here")
def test_llamacpp_missing_says_how_to_install():
    with pytest.raises(ValueError, match="pip install llama-cpp-python"):
        import_llama_cpp()
    assert "llamacpp" in INSTALL_HINT


def test_profile_step_smoke():
    """scripts/tools/profile_step.py end to end on a tiny random model: every decode step timed, no recompile after the
    warm-up run, the parts of the isolated step add up, and the table is printed."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "tools", "profile_step.py"), "--model=tiny-llama",
                           "--batch=2", "--input_len=8", "--output_len=5", "--repeats=1", "--json"], cwd=root,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["batch"] for r in result["rows"]] == [2]
    for row in result["rows"]:
        assert row["decode_steps"] == 4  # the first token comes from the prefill step
        assert {"prefill", "decode"} <= set(row["recompiles"]) and not any(row["recompiles"].values())
        assert row["host_to_device_transfers_per_step"] > 0
        assert all(v > 0 for v in row["isolated_ms"].values())
        split, iso = row["split_ms"], row["isolated_ms"]
        assert abs(split["attention"] + split["kv_write"] + split["dense_and_sampling"] - iso["step"]) < 1e-6
        assert row["step_ms"] > 0 and row["host_ms"] > 0 and row["dispatch_ms"] > 0
    assert "attention (page gather + softmax)" in proc.stderr

    # --ops traces the isolated step: XLA op kinds with their time; int8 weights skip the float matmul replay.
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "tools", "profile_step.py"), "--model=tiny-llama",
                           "--batch=2", "--input_len=8", "--output_len=5", "--repeats=1", "--json", "--ops", "--ops_top=0",
                           "--quantization=int8"], cwd=root, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    assert "matmuls_only" not in row["isolated_ms"]
    ops = row["ops"]
    assert ops and all(op["ms_per_step"] > 0 and op["events_per_step"] > 0 for op in ops)
    assert [op["ms_per_step"] for op in ops] == sorted((op["ms_per_step"] for op in ops), reverse=True)
    assert any("gather" in op["op"] for op in ops)  # the page gather of attention is one of the step's ops
    assert not any(op["op"].startswith("$") for op in ops)  # python frames are not XLA ops


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs the `llamacpp` extra")
def test_llamacpp_batched_greedy_matches_one_by_one():
    """The llama.cpp side runs every prompt of a batch as its own sequence: batched greedy tokens equal each
    prompt's tokens run alone, and prompts of different lengths do not leak into each other."""
    from configs.presets import PRESET_WEIGHTS
    from inference.loading.model_loader import packaged_file
    from scripts.bench.llamacpp_bench import LlamaCppGreedy

    gguf = packaged_file(*PRESET_WEIGHTS["smollm2-135m"])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 49000, 12).tolist(), rng.integers(100, 49000, 7).tolist()]
    runner = LlamaCppGreedy(gguf, num_seqs=2, max_len=24, threads=1)
    try:
        together, ttft, wall = runner.generate(prompts, 5)
        assert 0 < ttft <= wall
    finally:
        runner.close()
    alone = []
    for p in prompts:
        single = LlamaCppGreedy(gguf, num_seqs=1, max_len=24, threads=1)
        try:
            alone.append(single.generate([p], 5)[0][0])
        finally:
            single.close()
    assert [len(t) for t in together] == [5, 5]
    assert together == alone


PROMPT_ROWS = [{"id": 1, "prompt": "The capital of France is"},
               {"id": 2, "messages": [{"role": "user", "content": "Name three colors of the rainbow, please."}]},
               {"id": 3, "prompt": "Once upon a time, in a small village by the sea, there lived an old fisherman who"}]


def test_benchmark_offline_prompt_set_of_varied_lengths(tmp_path):
    """--prompts_file: the launcher's JSONL as the prompt set (text and chat rows), the first B rows per batch size,
    cycling; every request still yields exactly output_len tokens and the JSON records the prompt lengths."""
    import os
    import subprocess
    import sys

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PROMPT_ROWS))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench", "benchmark.py"), f"--prompts_file={path}",
                           "--batch=2,4", "--output_len=3", "--json"], cwd=root,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["config"]["prompts_file"] == str(path)
    two, four = result["pagejax"]["batch_2"], result["pagejax"]["batch_4"]
    assert two["prompt_tokens"]["min"] < two["prompt_tokens"]["max"]  # rows 1 and 2 differ in length
    assert four["prompt_tokens"]["min"] == two["prompt_tokens"]["min"]  # row 4 is row 1 again
    assert two["output_tokens"] == 2 * 3 and four["output_tokens"] == 4 * 3
    assert two["decode_tok_s"] > 0 and four["ttft_mean_s"] > 0


@pytest.mark.reference
def test_hf_side_left_pads_varied_lengths():
    """The transformers side runs a batch of different lengths left-padded: each prompt's greedy tokens equal the
    tokens of that prompt run alone."""
    import os

    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from configs.presets import PRESET_WEIGHTS
    from inference.loading.model_loader import packaged_file
    from scripts.bench.hf_bench import load_hf, run_hf

    gguf = packaged_file(*PRESET_WEIGHTS["smollm2-135m"])
    model = load_hf(gguf)
    # Text with confident continuations: random ids give near-tied next tokens that padding's rounding could flip.
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    short = tok.encode("The capital of France is")
    long = tok.encode("Once upon a time, in a small village by the sea, there lived an old fisherman who")
    assert len(short) < len(long)
    together = run_hf(model, [short, long], output_len=4)["first_tokens"]
    alone = [run_hf(model, [p], output_len=4)["first_tokens"][0] for p in (short, long)]
    assert together == alone
