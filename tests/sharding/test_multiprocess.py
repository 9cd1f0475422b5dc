"""Orbax conversion and multi-process generation, end to end through the scripts.

A tiny Hugging Face folder (tests/tiny_folder.py: the Mistral family fixture, sliding window, 4/2 heads, vocab 256,
plus a byte-level tokenizer of exactly 256 tokens) is converted with scripts/convert.py; the orbax folder must give
the HF folder's outputs, and a corrupt or mismatched one must fail with a clear error. Then scripts/generate.py
runs a 16-row file once in one process and once as two `jax.distributed` processes on 127.0.0.1 (gloo), each with
two virtual devices and two data-parallel replicas: the merged output must equal the single-process output, row
for row, in input order.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from inference import LLM, SamplingParams
from tests.tiny_folder import make_tiny_hf_folder
from tests.xla_test_flags import cpu_env

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".jax_cache"
ENGINE = ["--kv_cache_memory_bytes=1048576", "--max_num_seqs=8", "--max_num_batched_tokens=64",
          f"--compilation_cache_dir={CACHE}"]


def _env(devices: int) -> dict[str, str]:
    return cpu_env(PYTHONPATH=str(ROOT), XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """(the HF folder, its orbax conversion by scripts/convert.py)."""
    tmp = tmp_path_factory.mktemp("convert")
    hf, orbax = make_tiny_hf_folder(tmp / "hf"), tmp / "orbax"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert.py"), f"--model={hf}",
                           f"--output={orbax}"], env=_env(1), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return hf, orbax


def _run(model: Path) -> tuple[LLM, list[list[int]], list[list[float]]]:
    llm = LLM(str(model), kv_cache_memory_bytes=1 << 20, page_size=4, compilation_cache_dir=None)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(["The sea is calm tonight.", "abc"], params)
    return (llm, [o.outputs[0].token_ids for o in outs],
            [[e[t].logprob for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in outs])


def test_orbax_conversion_round_trip(folders):
    hf, orbax = folders
    assert sorted(os.listdir(orbax)) == ["pagejax_config.json", "tokenizer.json", "tokenizer_config.json", "weights"]
    want_llm, want_tokens, want_lp = _run(hf)
    got_llm, got_tokens, got_lp = _run(orbax)
    assert got_llm.config == want_llm.config
    assert got_tokens == want_tokens
    for got, want in zip(got_lp, want_lp):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    text = "Grüße, sea!"
    assert got_llm.tokenizer.encode(text) == want_llm.tokenizer.encode(text)
    assert len(want_llm.tokenizer.encode(text)) > 5
    assert got_llm.tokenizer.eos_token_id == want_llm.tokenizer.eos_token_id == 2


def test_bad_orbax_checkpoints_fail_clearly(folders, tmp_path):
    _, orbax = folders
    mismatched = tmp_path / "mismatched"
    shutil.copytree(orbax, mismatched)
    meta = json.loads((mismatched / "pagejax_config.json").read_text())
    meta["config"]["intermediate_size"] = 48
    (mismatched / "pagejax_config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"gate_proj.*shape.*disagree"):
        LLM(str(mismatched), compilation_cache_dir=None)

    corrupt = tmp_path / "corrupt"
    shutil.copytree(orbax, corrupt)
    for path in (corrupt / "weights").rglob("*"):
        if path.is_file() and "ocdbt" in str(path.relative_to(corrupt)) and path.stat().st_size > 0:
            path.write_bytes(b"\0" * 16)  # truncated / overwritten data and index files
    with pytest.raises(ValueError, match="orbax checkpoint.*convert.py"):
        LLM(str(corrupt), compilation_cache_dir=None)

    (corrupt / "pagejax_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the checkpoint's config"):
        LLM(str(corrupt), compilation_cache_dir=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(model: Path, rows: Path, output: Path, devices: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "scripts" / "generate.py"), f"--model={model}", f"--input={rows}",
           f"--output={output}", "--max_tokens=8", "--ignore_eos", "--temperature=0.8", "--seed=3", *ENGINE, *extra]
    return subprocess.Popen(cmd, env=_env(devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _outcomes(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Each process's (exit code, stderr); a process still running after 300 s (a hang) fails the test."""
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, err) for p, (_, err) in zip(procs, results)]


def _wait(procs: list[subprocess.Popen]) -> list[int]:
    """Each process's exit code: 0, or the launcher's EXIT_ROWS_FAILED (3) where rows of its own got error rows."""
    outcomes = _outcomes(procs)
    for code, err in outcomes:
        assert code in (0, 3), err[-3000:]
    return [code for code, _ in outcomes]


def _two_processes(model: Path, rows: Path, output: Path) -> list[subprocess.Popen]:
    address = f"127.0.0.1:{_free_port()}"
    return [_launch(model, rows, output, 2, [f"--coordinator_address={address}", "--num_processes=2",
                                             f"--process_id={i}", "--data_parallel_size=2"]) for i in range(2)]


def test_two_processes_match_one(folders, tmp_path):
    _, orbax = folders
    rows = [{"id": f"r{i}", "prompt": "word " * (1 + i % 7) + str(i)} for i in range(14)]
    rows.insert(5, {"id": "chat", "messages": [{"role": "user", "content": "hi"}]})
    rows.insert(9, {"id": "bad", "text": "neither prompt nor messages"})  # an error row, merged like the others
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    single = tmp_path / "single.jsonl"
    assert _wait([_launch(orbax, path, single, 1, [])]) == [3]  # the bad row's error row: exit 3
    multi = tmp_path / "multi.jsonl"
    codes = _wait(_two_processes(orbax, path, multi))
    assert sorted(codes) == [0, 3]  # only the process whose share held the bad row

    def essentials(file: Path) -> list[tuple]:
        return [(r["id"], r.get("error"), [(o["token_ids"], o["text"]) for o in r["outputs"]])
                for r in map(json.loads, file.read_text().splitlines())]

    want, got = essentials(single), essentials(multi)
    assert [r[0] for r in got] == [r["id"] for r in rows]  # merged in input order
    # one process writes rows in the order they finish (the streaming launcher): compare row by row, by id
    assert sorted(got) == sorted(want) and len(want) == len(rows)
    assert [r[0] for r in got if r[1] is not None] == ["bad"]  # the bad row failed alone
    assert all(len(r[2][0][0]) == 8 for r in got if r[1] is None)
    assert not list(tmp_path.glob("multi.jsonl.process-*"))  # shards merged and removed

    # A rerun where process 0's share is all done: it loads no model (a restore involves one process only) while
    # process 1 redoes its own share.
    first_share = {row["id"] for row in rows[0::2]}
    multi.write_text("".join(line + "\n" for line in multi.read_text().splitlines()
                             if json.loads(line)["id"] in first_share))
    assert _wait(_two_processes(orbax, path, multi)) == [0, 3]
    assert sorted(essentials(multi)) == sorted(want)


def test_a_process_that_fails_stops_the_others(folders, tmp_path):
    """A process that cannot go on (process 0 refusing an --output that is not the launcher's, process 1 unable to
    write its shard) stops the job at the next barrier: each process exits 1 saying why, none waits for the one
    that left, and nothing is written over."""
    _, orbax = folders
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"word {i}"}) + "\n" for i in range(4)))

    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"id": "r0", "note": "not a result row"}\n')
    (code0, err0), (code1, err1) = _outcomes(_two_processes(orbax, rows, foreign))
    assert code0 == 1 and "not a result row" in err0 and str(foreign) in err0, err0[-3000:]
    assert code1 == 1 and "process 0 of this job stopped with an error" in err1, err1[-3000:]
    assert foreign.read_text() == '{"id": "r0", "note": "not a result row"}\n'

    output = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.process-00001-of-00002").mkdir()  # process 1's shard cannot be written
    (code0, err0), (code1, err1) = _outcomes(_two_processes(orbax, rows, output))
    assert code1 == 1 and "cannot write" in err1 and "process-00001-of-00002" in err1, err1[-3000:]
    assert code0 == 1 and "process 1 of this job stopped with an error" in err0, err0[-3000:]
    assert not output.exists() and not (tmp_path / "out.jsonl.process-00000-of-00002").exists()


def test_distributed_settings_from_flags_or_environment():
    from sharding.distributed import DistributedConfig, resolve

    env = {"PAGEJAX_COORDINATOR_ADDRESS": "10.0.0.1:8476", "PAGEJAX_NUM_PROCESSES": "4", "PAGEJAX_PROCESS_ID": "3"}
    assert resolve(environ=env) == DistributedConfig("10.0.0.1:8476", 4, 3)
    assert resolve(process_id=1, environ=env) == DistributedConfig("10.0.0.1:8476", 4, 1)  # a flag wins
    assert not resolve(environ={}).is_multi_process  # nothing set: one process, nothing to initialise
    assert resolve(environ={"PAGEJAX_DISTRIBUTED_AUTO": "1"}).auto
    with pytest.raises(ValueError, match="process_id missing"):
        resolve("127.0.0.1:1234", 2, environ={})
    with pytest.raises(ValueError, match=r"process_id must be in \[0, 4\)"):
        resolve(process_id=4, environ=env)
    with pytest.raises(ValueError, match="host:port"):
        resolve("localhost", 2, 0, environ={})
    with pytest.raises(ValueError, match="not an integer"):
        resolve(environ={**env, "PAGEJAX_NUM_PROCESSES": "two"})


def test_every_preset_config_survives_the_checkpoint_json():
    from configs.presets import MODEL_PRESETS
    from models.loaders.orbax_checkpoint import config_from_dict, config_to_dict

    for name, config in MODEL_PRESETS.items():
        assert config_from_dict(json.loads(json.dumps(config_to_dict(config))), name) == config, name
    with pytest.raises(ValueError, match="unknown config field 'wings'"):
        config_from_dict({**config_to_dict(config), "wings": 2}, "x")
