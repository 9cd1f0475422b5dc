"""scripts/generate.py with LoRA: --lora NAME=PATH flags become LLM(enable_lora=...) and LoRARequests, and each row's
`lora` field picks its adapter (rows without it run the base model; an unknown name is that row's error)."""

from __future__ import annotations

import pytest
from absl import app, flags

from configs.presets import get_model_config
from inference import LoRARequest, SamplingParams
from inference.tools import jsonl_io
from scripts import generate
from tests import lora_adapters
from tests.scripts.test_generate_script import LIGHT, read_jsonl, run_script_with_failed_rows, write_jsonl

FLAGS = flags.FLAGS


def test_lora_flags_configure_the_llm(monkeypatch):
    seen = {}
    monkeypatch.setattr("inference.entrypoints.llm.LLM", lambda model, **kw: seen.update(kw, model=model))
    FLAGS.unparse_flags()
    FLAGS(["generate.py", *LIGHT, "--lora=a=/tmp/a", "--lora=b=/tmp/b", "--max_lora_rank=8"])
    try:
        generate.build_llm()
        assert generate.lora_requests() == {"a": LoRARequest("a", 1, "/tmp/a"), "b": LoRARequest("b", 2, "/tmp/b")}
        assert (seen["enable_lora"], seen["max_loras"], seen["max_lora_rank"]) == (True, 2, 8)
        FLAGS.unparse_flags()
        FLAGS(["generate.py", *LIGHT, "--lora=/tmp/a"])
        with pytest.raises(app.UsageError, match="give NAME=PATH"):
            generate.lora_requests()
    finally:
        FLAGS.unparse_flags()
    with pytest.raises(ValueError, match="started without --lora"):
        jsonl_io.row_lora({"id": 1, "lora": "a"}, {})
    with pytest.raises(ValueError, match="must be the name of a --lora adapter"):
        jsonl_io.row_lora({"id": 1, "lora": 3}, {"a": None})


def test_prompt_lora_gives_every_prompt_row_the_adapter():
    FLAGS.unparse_flags()
    try:
        FLAGS(["generate.py", *LIGHT, "--lora=a=/tmp/a", "--prompt=hi", "--prompt=yo", "--prompt_lora=a"])
        assert generate.input_rows() == [{"id": 0, "prompt": "hi", "lora": "a"}, {"id": 1, "prompt": "yo", "lora": "a"}]
        FLAGS.unparse_flags()
        FLAGS(["generate.py", *LIGHT, "--lora=a=/tmp/a", "--prompt=hi", "--prompt_lora=b"])
        with pytest.raises(app.UsageError, match=r"--prompt_lora='b' is not the NAME of a --lora.*\['a'\]"):
            generate.input_rows()
        FLAGS.unparse_flags()
        FLAGS(["generate.py", *LIGHT, "--lora=a=/tmp/a", "--input=rows.jsonl", "--prompt_lora=a"])
        with pytest.raises(app.UsageError, match="applies to --prompt rows"):
            generate.input_rows()
    finally:
        FLAGS.unparse_flags()


def test_rows_pick_their_adapter(tmp_path, smollm2_lora, monkeypatch):
    monkeypatch.setattr(generate, "build_llm", lambda: smollm2_lora)
    path = lora_adapters.make_adapter(str(tmp_path / "r"), get_model_config("smollm2-135m"), rank=8, alpha=16,
                                      seed=8, std=0.03)
    prompt = "Once upon a time,"
    rows = [{"id": 1, "prompt": prompt, "lora": "r"}, {"id": 2, "prompt": prompt},
            {"id": 3, "prompt": prompt, "lora": "nope"}]
    out = tmp_path / "out.jsonl"
    run_script_with_failed_rows(f"--input={write_jsonl(tmp_path / 'in.jsonl', rows)}", f"--output={out}",
                                f"--lora=r={path}")
    got = {row["id"]: row for row in read_jsonl(out)}
    params = SamplingParams(temperature=0.0, max_tokens=4)
    want = smollm2_lora.generate([prompt, prompt], params, lora_request=[LoRARequest("r", 1, path), None])
    assert got[1]["outputs"][0]["token_ids"] == want[0].outputs[0].token_ids != want[1].outputs[0].token_ids
    assert got[2]["outputs"][0]["token_ids"] == want[1].outputs[0].token_ids
    assert got[1]["lora"] == "r" and "lora" not in got[2]
    assert "unknown" in got[3]["error"] and "['r']" in got[3]["error"]
