"""LoRA against transformers + peft (tests/fixtures/lora/reference.json, written by scripts/fixtures/make_lora_fixtures.py):
SmolLM2 with random rank-8 (all projections) and rank-16 rsLoRA (attention only) adapters, rebuilt here from their
numpy seeds, and the tiny Qwen2 family model with a rank-8 adapter peft itself saved (committed). Teacher-forced
logprobs within 1e-4 (float32), greedy continuations identical; all adapters and the base model in one batch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from configs.presets import get_model_config
from inference import LLM, LoRARequest, SamplingParams
from tests import lora_adapters

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
REFERENCE = json.loads((FIXTURES / "lora" / "reference.json").read_text())["records"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, skip_special_tokens=False)
TEACHER = SamplingParams(max_tokens=1, prompt_logprobs=0)


def _check(llm: LLM, records: list[dict], loras: list[LoRARequest]) -> None:
    seqs = [r["prompt_ids"] + r["greedy_ids"] for r in records]
    outs = llm.generate(prompt_token_ids=seqs, sampling_params=TEACHER, lora_request=loras)
    for r, ids, out in zip(records, seqs, outs):
        assert out.error is None, out.error
        got = np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
        assert np.abs(got - np.asarray(r["target_logprobs"])).max() <= 1e-4, (r["adapter"], r["prompt_index"])
    outs = llm.generate(prompt_token_ids=[r["prompt_ids"] for r in records], sampling_params=GREEDY,
                        lora_request=loras)
    for r, out in zip(records, outs):
        assert out.outputs[0].token_ids == r["greedy_ids"], (r["adapter"], r["prompt_index"])


def test_smollm2_adapters_match_transformers_peft_in_one_batch(smollm2_lora, tmp_path):
    config = get_model_config("smollm2-135m")
    records = [r for r in REFERENCE if r["model"] == "smollm2-135m"]
    loras, ids = [], {}
    for r in records:
        name = r["adapter"]
        if name not in ids:
            recipe = dict(r["recipe"])
            if "modules" in recipe:
                recipe["modules"] = tuple(recipe["modules"])
            lora_adapters.make_adapter(str(tmp_path / name), config, **recipe)
            ids[name] = 81 + len(ids)  # ids of their own in the session's LLM (the launcher test counts from 1)
        loras.append(LoRARequest(f"ref-{name}", ids[name], str(tmp_path / name)))
    assert {r["recipe"]["rank"] for r in records} == {8, 16}
    llm = smollm2_lora
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # The base model rides in the same batch: a slot-0 row is the plain model, unchanged by its neighbours.
    plain = llm.generate(prompt_token_ids=[records[0]["prompt_ids"]], sampling_params=base)[0].outputs[0].token_ids
    _check(llm, records, loras)
    mixed = llm.generate(prompt_token_ids=[records[0]["prompt_ids"]] * 2, sampling_params=base,
                         lora_request=[loras[0], None])
    assert mixed[1].outputs[0].token_ids == plain
    assert mixed[0].outputs[0].token_ids == records[0]["greedy_ids"] != plain


def test_tiny_qwen2_adapter_saved_by_peft_matches_transformers():
    records = [r for r in REFERENCE if r["adapter"] == "qwen2_r8"]
    llm = LLM(str(FIXTURES / "families" / "qwen2"), enable_lora=True, max_loras=1, max_lora_rank=8, page_size=4,
              kv_cache_memory_bytes=1 << 20, max_num_seqs=4, max_num_batched_tokens=64, compilation_cache_dir=None)
    _check(llm, records, [LoRARequest("qwen2_r8", 1, str(FIXTURES / "lora" / "qwen2_r8"))])


@pytest.mark.reference
def test_fixture_script_reproduces_the_committed_tiny_reference(tmp_path):
    """With transformers + peft installed: the script's tiny record (peft's own adapter) is what is committed."""
    pytest.importorskip("peft")
    from scripts.fixtures import make_lora_fixtures

    record = make_lora_fixtures.tiny_records(tmp_path)[0]
    committed = next(r for r in REFERENCE if r["adapter"] == "qwen2_r8")
    assert record["greedy_ids"] == committed["greedy_ids"]
    # Both sides are rounded to 6 decimals, so one unit of the last place (and its binary representation) may part them.
    assert np.abs(np.asarray(record["target_logprobs"]) - committed["target_logprobs"]).max() <= 1.5e-6
