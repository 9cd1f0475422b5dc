"""scripts/generate.py, run in-process: JSONL round trip, resume after a crash, bad rows, bad input, bad flags.

The real default model is loaded once per module (through the launcher's own `build_llm`, so the engine flags are
exercised) and handed to every run; with greedy decoding and `--max_tokens=4` the compiled steps are shared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from absl import flags

from inference import SamplingParams
from inference.tools import jsonl_io
from scripts import generate

FLAGS = flags.FLAGS
# Light engine settings; `--compilation_cache_dir=` leaves alone the cache conftest.py already enabled.
LIGHT = ["--kv_cache_memory_bytes=67108864", "--max_num_seqs=4", "--max_num_batched_tokens=128", "--max_tokens=4",
         "--compilation_cache_dir="]


def _parse(*args: str) -> None:
    FLAGS.unparse_flags()
    FLAGS(["generate.py", *LIGHT, *args])


def run_script(*args: str) -> None:
    """Set the flags as the command line would, run main, and leave the flags unparsed for the next test."""
    _parse(*args)
    try:
        generate.main(["generate.py"])
    finally:
        FLAGS.unparse_flags()


def run_script_with_failed_rows(*args: str) -> None:
    """`run_script` for a job some of whose rows fail: it runs to its end and exits with EXIT_ROWS_FAILED."""
    with pytest.raises(SystemExit) as exit_:
        run_script(*args)
    assert exit_.value.code == generate.EXIT_ROWS_FAILED


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def llm():
    _parse()
    try:
        return generate.build_llm()
    finally:
        FLAGS.unparse_flags()


@pytest.fixture
def use_llm(llm, monkeypatch):
    monkeypatch.setattr(generate, "build_llm", lambda: llm)
    return llm


def forbid_model(monkeypatch) -> None:
    """For runs that must stop (or finish) before the model would load."""
    def fail():
        raise AssertionError("the model should not be loaded")
    monkeypatch.setattr(generate, "build_llm", fail)


@pytest.fixture
def no_model(monkeypatch):
    forbid_model(monkeypatch)


PROMPTS = [{"id": "a", "prompt": "The capital of France is"}, {"id": "b", "prompt": "One, two, three,"},
           {"id": 3, "prompt": "Hello, my name is"},
           {"id": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]}]


def test_jsonl_round_trip(tmp_path, use_llm, capsys):
    out = tmp_path / "out.jsonl"
    run_script(f"--input={write_jsonl(tmp_path / 'in.jsonl', PROMPTS)}", f"--output={out}", "--max_in_flight=3")
    rows = sorted(read_jsonl(out), key=lambda r: [r["id"] for r in PROMPTS].index(r["id"]))  # finish order
    assert [r["id"] for r in rows] == ["a", "b", 3, "chat"]
    for row in rows:
        assert "error" not in row
        assert row["num_prompt_tokens"] > 0 and row["ttft_s"] > 0
        [completion] = row["outputs"]
        assert completion["text"] and 1 <= len(completion["token_ids"]) <= 4
        assert completion["finish_reason"] in ("length", "stop")
    assert rows[0]["prompt"] == PROMPTS[0]["prompt"] and rows[3]["messages"] == PROMPTS[3]["messages"]
    assert "rows done 4, skipped 0, failed 0" in capsys.readouterr().err


def test_resume_skips_done_ids_and_drops_truncated_line(tmp_path, use_llm, monkeypatch):
    done = [{"id": "a", "prompt": "x", "outputs": [{"index": 0, "text": "OLD"}]},
            {"id": 3, "prompt": "y", "outputs": [{"index": 0, "text": "OLD"}]}]
    out = write_jsonl(tmp_path / "out.jsonl", done)
    old_text = out.read_text()
    with open(out, "a") as f:
        f.write('{"id": "b", "outputs": [{"ind')  # a crash mid-write: no closing brace, no newline
    inp = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    run_script(f"--input={inp}", f"--output={out}")
    text = out.read_text()
    assert text.startswith(old_text)  # the finished rows are untouched
    rows = read_jsonl(out)
    assert sorted(map(str, (r["id"] for r in rows))) == ["3", "a", "b", "chat"]
    assert [r["outputs"][0]["text"] for r in rows[:2]] == ["OLD", "OLD"]
    new = {r["id"]: r for r in rows[2:]}
    assert sorted(map(str, new)) == ["b", "chat"] and new["b"]["outputs"][0]["text"] != "OLD"

    forbid_model(monkeypatch)  # a finished job reruns without loading the model, and writes nothing
    run_script(f"--input={inp}", f"--output={out}")
    assert out.read_text() == text


def test_bad_rows_become_error_rows(tmp_path, use_llm):
    rows = [{"id": "ok", "prompt": "The capital of France is"}, {"id": "none"}, {"id": "int", "prompt": 7},
            {"id": "both", "prompt": "a", "messages": []}, {"id": "msgs", "messages": "hi"},
            {"id": "empty", "prompt": ""},  # rejected by the engine rather than by the script
            {"id": "ok2", "prompt": "One, two, three,"}]
    out = tmp_path / "out.jsonl"
    run_script_with_failed_rows(f"--input={write_jsonl(tmp_path / 'in.jsonl', rows)}", f"--output={out}")
    got = {r["id"]: r for r in read_jsonl(out)}
    assert sorted(got) == sorted(r["id"] for r in rows)
    for ok in ("ok", "ok2"):
        assert "error" not in got[ok] and got[ok]["outputs"][0]["text"]
    for bad in ("none", "int", "both", "msgs", "empty"):
        assert got[bad]["error"], bad
    assert "prompt" in got["none"]["error"] and "string" in got["int"]["error"]


def test_duplicate_ids_are_an_error(tmp_path, no_model):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "x", "prompt": "a"}, {"id": "y", "prompt": "b"},
                                              {"id": "x", "prompt": "c"}])
    with pytest.raises(SystemExit, match="duplicate id 'x'"):
        run_script(f"--input={inp}")


def test_invalid_temperature_fails_before_loading(no_model, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_script("--temperature=-1")
    assert exit_.value.code == 2 and "temperature must be" in capsys.readouterr().err


def test_bad_output_file_middle_line_is_an_error(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1, "outputs": []}\nnot json\n{"id": 2, "outputs": []}\n')
    with pytest.raises(ValueError, match=":2: not a result row"):
        jsonl_io.load_done_ids(str(out))
    assert jsonl_io.load_done_ids(str(tmp_path / "missing.jsonl")) == {}


def test_an_output_that_is_another_file_is_never_rewritten(tmp_path, no_model):
    """Only a last line cut short (no newline: a crash mid-write) is dropped; a whole line that is no result row,
    last or not, is someone else's file, left as it was."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    with pytest.raises(SystemExit, match="notes.txt:1: not a result row of this launcher"):
        run_script(f"--input={inp}", f"--output={notes}")
    assert notes.read_text() == "my notes\n"
    other_input = write_jsonl(tmp_path / "other.jsonl", [{"id": 1, "prompt": "a row, not a result"}])
    with pytest.raises(SystemExit, match="other.jsonl:1: not a result row of this launcher"):
        run_script(f"--input={inp}", f"--output={other_input}")  # its id would otherwise count as done


def test_bad_input_and_output_files_stop_the_job_before_the_model_loads(tmp_path, no_model, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    with pytest.raises(SystemExit, match="cannot write .*o.jsonl: the folder .*nonexistent does not exist"):
        run_script(f"--input={inp}", f"--output={tmp_path / 'nonexistent' / 'o.jsonl'}")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"id": 1, "prompt": "hi"}\n{"id": 2, "prompt": "caf\xe9"}\n')
    with pytest.raises(SystemExit, match="latin1.jsonl:2: not UTF-8 .*save the file as UTF-8"):
        run_script(f"--input={latin1}")
    with pytest.raises(SystemExit) as exit_:
        run_script(f"--input={inp}", f"--output={inp}")
    assert exit_.value.code == 2 and "--output is the --input file" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    run_script(f"--input={empty}", f"--output={tmp_path / 'out.jsonl'}")  # nothing to do: exit 0, and it says so
    assert "has no rows; nothing to generate" in capsys.readouterr().err


def test_a_lone_surrogate_fails_its_row_alone(tmp_path, use_llm):
    """JSON's "\\udc80" escape alone is a valid JSON string but no text: in a prompt it is that row's error, in an
    id it is written back as the same escape; the other rows are generated and the job ends."""
    out = tmp_path / "out.jsonl"
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "ok", "prompt": "Hello"}\n{"id": "p", "prompt": "a\\ud800b"}\n'
                   '{"id": "x\\udc80", "prompt": "One, two,"}\n')
    run_script_with_failed_rows(f"--input={inp}", f"--output={out}")
    got = {r["id"]: r for r in read_jsonl(out)}
    assert sorted(got) == ["ok", "p", "x\udc80"]
    assert "lone UTF-16 surrogate" in got["p"]["error"]
    assert "error" not in got["ok"] and "error" not in got["x\udc80"] and got["x\udc80"]["outputs"][0]["text"]
    assert "\\udc80" in out.read_text()  # the escape, not a character no UTF-8 file can hold
    line = jsonl_io.json_line({"id": "x\udc80", "outputs": []})  # also what merging process shards writes
    assert line.isascii() and json.loads(line) == {"id": "x\udc80", "outputs": []}


def test_prompt_flag_prints_readably(use_llm, capsys):
    run_script("--prompt=The capital of France is", "--prompt=Hello")
    printed = capsys.readouterr().out
    assert "Q: The capital of France is\nA: " in printed and "Q: Hello\nA: " in printed


def test_rows_are_written_as_they_finish(tmp_path, use_llm):
    """Long rows go in first, yet with room for every row in flight the short ones are in the file before them: no
    row waits for a slower one to be written."""
    rows = ([{"id": f"long{i}", "prompt": "Once upon a time", "max_tokens": 24} for i in range(2)]
            + [{"id": f"short{i}", "prompt": "One, two, three,", "max_tokens": 1} for i in range(4)])
    out = tmp_path / "out.jsonl"
    run_script(f"--input={write_jsonl(tmp_path / 'in.jsonl', rows)}", f"--output={out}", "--ignore_eos",
               "--max_in_flight=8")
    got = read_jsonl(out)
    assert [r["id"][:4] for r in got] == ["shor"] * 4 + ["long"] * 2
    assert {len(r["outputs"][0]["token_ids"]) for r in got} == {1, 24}


def test_per_row_max_tokens_must_be_positive(tmp_path, use_llm):
    rows = [{"id": "zero", "prompt": "a", "max_tokens": 0}, {"id": "ok", "prompt": "Hello", "max_tokens": 2}]
    out = tmp_path / "out.jsonl"
    run_script_with_failed_rows(f"--input={write_jsonl(tmp_path / 'in.jsonl', rows)}", f"--output={out}")
    got = {r["id"]: r for r in read_jsonl(out)}
    assert "max_tokens" in got["zero"]["error"] and len(got["ok"]["outputs"][0]["token_ids"]) <= 2


def test_seed_modes(tmp_path, use_llm):
    """per_row: identical prompts, different samples, the same ones again on a rerun (a null seed or temperature is
    no value of the row's own, as in the OpenAI API); shared: identical samples."""
    rows = [{"id": i, "prompt": "My favourite animal is the"} for i in range(4)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)

    def samples(name: str, *flags: str, source: Path = inp) -> dict:
        out = tmp_path / name
        run_script(f"--input={source}", f"--output={out}", "--temperature=1", "--seed=7", "--ignore_eos", *flags)
        return {r["id"]: tuple(r["outputs"][0]["token_ids"]) for r in read_jsonl(out)}

    per_row = samples("per_row.jsonl")
    assert len(set(per_row.values())) > 1
    nulls = write_jsonl(tmp_path / "nulls.jsonl", [{**row, "seed": None, "temperature": None} for row in rows])
    assert samples("per_row_again.jsonl", "--seed_mode=per_row", source=nulls) == per_row
    assert len(set(samples("shared.jsonl", "--seed_mode=shared").values())) == 1


def test_resume_in_any_order(tmp_path, use_llm):
    """A streamed output is in finish order; a rerun skips exactly the ids in it, wherever they stand."""
    done = [{"id": "chat", "outputs": []}, {"id": "a", "outputs": []}]
    out = write_jsonl(tmp_path / "out.jsonl", done)
    run_script(f"--input={write_jsonl(tmp_path / 'in.jsonl', PROMPTS)}", f"--output={out}")
    ids = [r["id"] for r in read_jsonl(out)]
    assert ids[:2] == ["chat", "a"] and sorted(map(str, ids)) == ["3", "a", "b", "chat"]


def test_ctrl_c_saves_rows_and_a_rerun_finishes(tmp_path):
    """SIGINT once rows are in the file: exit 130, one line saying how many rows are saved, no traceback, every
    saved line a whole row; the same command again completes the job without duplicates."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    from tests.tiny_folder import make_tiny_hf_folder

    repo = Path(__file__).resolve().parents[2]
    model = make_tiny_hf_folder(tmp_path / "model")
    # Four short rows come out first; the long rest (about 2,900 tokens) keeps the job running for seconds after
    # them, so a test process starved under load still signals a job that has work left.
    rows = [{"id": i, "prompt": f"row {i}", "max_tokens": 8 if i < 4 else 96} for i in range(34)]
    inp, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    cmd = [sys.executable, str(repo / "scripts" / "generate.py"), f"--model={model}", f"--input={inp}",
           f"--output={out}", "--ignore_eos", "--max_num_seqs=2", "--max_in_flight=4", "--fsync_every=1000",
           "--kv_cache_memory_bytes=4194304", "--max_num_batched_tokens=64",
           f"--compilation_cache_dir={repo}/.jax_cache"]
    env = {**os.environ, "PYTHONPATH": str(repo), "JAX_PLATFORMS": "cpu"}
    # The full suite's xdist workers have SIGINT ignored by now, and a child inherits an ignored signal (Python then
    # installs no KeyboardInterrupt handler); a handled one is reset to the default at exec, as a shell starts a job.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if out.exists() and len(out.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the job finished (or died) before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    saved = read_jsonl(out)  # every line parses: no cut-short row
    match = re.search(r"^interrupted: (\d+) rows saved to (.+); rerun the same command to resume$", err, re.M)
    assert match and int(match[1]) == len(saved) and match[2] == str(out), err
    assert 3 <= len(saved) < len(rows)

    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=240)
    ids = [r["id"] for r in read_jsonl(out)]
    assert ids[:len(saved)] == [r["id"] for r in saved] and sorted(ids) == list(range(len(rows)))


def test_batch_size_is_a_deprecated_alias(tmp_path, use_llm, capsys):
    out = tmp_path / "out.jsonl"
    run_script(f"--input={write_jsonl(tmp_path / 'in.jsonl', PROMPTS)}", f"--output={out}", "--batch_size=2")
    assert sorted(map(str, (r["id"] for r in read_jsonl(out)))) == ["3", "a", "b", "chat"]
    assert "--batch_size is deprecated" in capsys.readouterr().err


def test_json_schema_flag_and_per_row_schemas(tmp_path, use_llm):
    """--json_schema=FILE constrains every row; a row's own json_schema replaces it; a bad one is that row's error."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"enum": ["red", "green", "blue"]}))
    rows = [{"id": "flag", "prompt": "My favourite color is", "max_tokens": 8},
            {"id": "row", "prompt": "Is the sky blue?", "max_tokens": 8, "json_schema": {"type": "boolean"}},
            {"id": "bad", "prompt": "Hello", "json_schema": {"type": "foo"}}]
    out = tmp_path / "out.jsonl"
    run_script_with_failed_rows(f"--input={write_jsonl(tmp_path / 'in.jsonl', rows)}", f"--output={out}",
                                f"--json_schema={schema}")
    got = {r["id"]: r for r in read_jsonl(out)}
    assert json.loads(got["flag"]["outputs"][0]["text"]) in ("red", "green", "blue")
    assert isinstance(json.loads(got["row"]["outputs"][0]["text"]), bool)
    assert "structured_outputs.json is invalid" in got["bad"]["error"]
    with pytest.raises(SystemExit, match="cannot read --json_schema"):
        run_script(f"--json_schema={tmp_path / 'missing.json'}")


def test_rows_set_their_own_sampling_parameters(tmp_path, use_llm):
    """A row's temperature, seed, n and stop are its own (as the OpenAI server's requests are): equal to the offline
    run with those parameters; a bad value, or a sampling field a row cannot set, is that row's error."""
    prompt = "Once upon a time"
    rows = [{"id": "greedy", "prompt": prompt, "temperature": 0.0},
            {"id": "seeded", "prompt": prompt, "temperature": 1.0, "seed": 7, "n": 2},
            {"id": "stop", "prompt": "One, two, three,", "temperature": 0.0, "stop": [","], "max_tokens": 8},
            {"id": "bad", "prompt": prompt, "temperature": -5},
            {"id": "refused", "prompt": prompt, "logprobs": 2},
            {"id": "meta", "prompt": prompt, "temperature": 0.0, "answer": "anything"},
            {"id": "min", "prompt": prompt, "temperature": 0.0, "max_tokens": 6, "min_tokens": 6}]
    out = tmp_path / "out.jsonl"
    run_script_with_failed_rows(f"--input={write_jsonl(tmp_path / 'in.jsonl', rows)}", f"--output={out}",
                                "--temperature=0.7", "--seed=1")
    got = {r["id"]: r for r in read_jsonl(out)}
    base = SamplingParams(max_tokens=4)
    want = use_llm.generate([prompt, prompt, "One, two, three,"],
                            [base.replace(temperature=0.0), base.replace(temperature=1.0, seed=7, n=2),
                             base.replace(temperature=0.0, stop=[","], max_tokens=8)])
    for key, w in zip(("greedy", "seeded", "stop"), want):
        assert [o["token_ids"] for o in got[key]["outputs"]] == [list(o.token_ids) for o in w.outputs], key
    assert got["stop"]["outputs"][0]["finish_reason"] == "stop"
    assert got["meta"]["outputs"][0]["token_ids"] == got["greedy"]["outputs"][0]["token_ids"]
    assert "temperature must be" in got["bad"]["error"]
    assert "error" not in got["min"] and len(got["min"]["outputs"][0]["token_ids"]) == 6  # over --max_tokens=4
    assert "a row cannot set 'logprobs'" in got["refused"]["error"]


def test_retry_failed_runs_the_error_rows_again_once_the_input_is_fixed(tmp_path, use_llm, capsys):
    out = tmp_path / "out.jsonl"
    rows = [{"id": "ok", "prompt": "Hello"}, {"id": "fixed", "prompt": "One, two,", "max_tokens": 0}]
    run_script_with_failed_rows(f"--input={write_jsonl(tmp_path / 'in.jsonl', rows)}", f"--output={out}")
    assert "--retry_failed runs them again" in capsys.readouterr().err
    first = {r["id"]: r for r in read_jsonl(out)}
    rows[1]["max_tokens"] = 2
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    # a plain rerun skips the error row: nothing to do, and its exit still says the output holds an error row
    run_script_with_failed_rows(f"--input={inp}", f"--output={out}")
    assert {r["id"]: r for r in read_jsonl(out)} == first
    assert "1 rows failed (1 from earlier runs)" in capsys.readouterr().err
    assert jsonl_io.load_done_ids(str(out)) == {"ok": False, "fixed": True}
    run_script(f"--input={inp}", f"--output={out}", "--retry_failed")
    got = read_jsonl(out)
    assert sorted(r["id"] for r in got) == ["fixed", "ok"] and not any("error" in r for r in got)
    assert got[0] == first["ok"] and len(got[1]["outputs"][0]["token_ids"]) <= 2
