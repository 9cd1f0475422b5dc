"""scripts/generate.py explains itself: one-line usage errors (exit 2), --help (exit 0), a missing model file told
apart from an unknown preset, random-weight presets marked and refused for text rows, and a first run that says it
is compiling (a warm rerun's silence: tests/inference/test_compile_progress.py). In-process where possible; one
subprocess for what only a real process shows (absl's logging set-up, the compile announcements)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags

from scripts import generate
from tests.scripts.test_generate_script import forbid_model, run_script, write_jsonl

FLAGS = flags.FLAGS


def _exit_code(capsys, *argv: str, call=generate.parse_flags) -> tuple[int, str, str]:
    try:
        with pytest.raises(SystemExit) as exit_:
            call(["generate.py", *argv])
    finally:
        FLAGS.unparse_flags()
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def test_usage_errors_are_one_line_and_help_exits_0(capsys):
    code, _, err = _exit_code(capsys, "--no_such_flag=1")
    assert code == 2 and err.splitlines() == ["error: Unknown command line flag 'no_such_flag'",
                                              "run with --help for the flags"]
    FLAGS(["generate.py"])
    code, _, err = _exit_code(capsys, "stray", call=generate.main)
    assert code == 2 and err.splitlines() == ["error: unexpected arguments: stray", "run with --help for the flags"]
    code, out, _ = _exit_code(capsys, "--help")
    assert code == 0 and out.startswith("Batch generation from the command line") and "--max_in_flight" in out


def test_missing_file_unknown_preset_and_random_weight_presets(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit, match="missing.gguf: no such file or folder"):
        run_script("--model=missing.gguf", "--prompt=hi")
    with pytest.raises(SystemExit, match=r"unknown model preset 'nope'; presets: smollm2-135m \(shipped weights\); "
                                         r"random-weight test models, no tokenizer: .*tiny-llama"):
        run_script("--model=nope", "--prompt=hi")
    forbid_model(monkeypatch)  # refused before anything loads
    rows = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(SystemExit, match="tiny-llama is a random-weight test model with no tokenizer, so it cannot "
                                         "run 'messages' rows"):
        run_script("--model=tiny-llama", f"--input={rows}")
    assert "warning: tiny-llama is a random-weight test model" in capsys.readouterr().err


def test_first_run_says_it_compiles_and_logs_no_backend_info(tmp_path):
    """A fresh compilation cache: the compile line names the model and the cache, a line per compiled step; absl's
    INFO line about the missing TPU backend is gone (JAX_PLATFORMS unset so JAX probes its backends)."""
    from tests.tiny_folder import make_tiny_hf_folder

    repo = Path(__file__).resolve().parents[2]
    model, cache = make_tiny_hf_folder(tmp_path / "model"), tmp_path / "xla"
    rows = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "prompt": "hello"}])
    cmd = [sys.executable, str(repo / "scripts" / "generate.py"), f"--model={model}", f"--input={rows}",
           f"--output={tmp_path / 'out.jsonl'}", "--max_tokens=2", "--kv_cache_memory_bytes=4194304",
           f"--compilation_cache_dir={cache}"]
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = str(repo)
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"compiling decode steps for {model}, cached in {cache}" in run.stderr
    assert "  compiled 1 step (" in run.stderr
    assert "Unable to initialize backend" not in run.stderr
    assert not re.search(r"^I\d{4} ", run.stderr, re.M), run.stderr  # absl's INFO prefix
