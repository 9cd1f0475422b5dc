"""LoRA serving on the random tiny Llama: the batched delta's math, a mixed batch of adapters and the base model, slot
eviction and reload, prefix caching keyed by adapter, update_lora without recompiling, and each bad adapter's
clear error (the other prompts of the call still complete)."""

from __future__ import annotations

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from configs.presets import get_model_config
from inference import LLM, LoRARequest, SamplingParams
from inference.engine.config import LoRAConfig
from models.lora import LoRAWeights, lora_delta
from tests import lora_adapters

CONFIG = get_model_config("tiny-llama")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [5, 17, 300, 42, 9, 11, 200, 13, 77, 401, 3]


def test_masked_delta_equals_each_tokens_own_adapter():
    rng = np.random.default_rng(0)
    slots, d_in, rank, d_out, tokens = 4, 6, 3, 5, 7
    a = rng.standard_normal((slots, d_in, rank)).astype(np.float32)
    b = rng.standard_normal((slots, rank, d_out)).astype(np.float32)
    a[0], b[0] = 0, 0
    scaling = np.array([0.0, 0.5, 2.0, 1.0], np.float32)
    x = rng.standard_normal((tokens, d_in)).astype(np.float32)
    token_slots = np.array([0, 1, 2, 3, 1, 0, 2], np.int32)
    got = np.asarray(lora_delta(jnp.asarray(x), LoRAWeights(jnp.asarray(a), jnp.asarray(b), jnp.asarray(scaling)),
                                jnp.asarray(token_slots)))
    want = np.stack([x[t] @ a[s] @ b[s] * scaling[s] for t, s in enumerate(token_slots)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not got[0].any() and not got[5].any()  # slot 0: exactly no change


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    specs = {"a": dict(rank=8, alpha=16, seed=1), "b": dict(rank=4, alpha=8, seed=2, use_rslora=True,
                                                              modules=("q_proj", "v_proj")),
             "c": dict(rank=8, alpha=8, seed=3, modules=("gate_proj", "up_proj", "down_proj")),
             "d": dict(rank=2, alpha=4, seed=4, layers=[1])}
    return {name: LoRARequest(name, i + 1, lora_adapters.make_adapter(str(root / name), CONFIG, std=0.3, **spec))
            for i, (name, spec) in enumerate(specs.items())}


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", enable_lora=True, max_loras=3, max_lora_rank=8, kv_cache_memory_bytes=1 << 20,
               page_size=4, max_num_seqs=8, max_num_batched_tokens=64, compilation_cache_dir=None)


def _tokens(llm, lora, prompt=PROMPT):
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=lora)[0]
    assert out.error is None, out.error
    return out.outputs[0].token_ids


def test_mixed_batch_of_three_adapters_and_base_equals_each_alone(llm, adapters):
    loras = [adapters["a"], adapters["b"], adapters["c"], None]
    alone = [_tokens(llm, lora) for lora in loras]
    assert len({tuple(t) for t in alone}) == 4  # every adapter changes the output (else this proves nothing)
    mixed = llm.generate(prompt_token_ids=[PROMPT] * 4, sampling_params=GREEDY, lora_request=loras)
    assert [o.outputs[0].token_ids for o in mixed] == alone
    compiles = llm.runner.num_compilations()
    again = llm.generate(prompt_token_ids=[PROMPT] * 4, sampling_params=GREEDY, lora_request=loras[::-1])
    assert [o.outputs[0].token_ids for o in again] == alone[::-1]
    assert llm.runner.num_compilations() == compiles  # another mix of adapters: the same compiled steps
    assert llm.runner.lora.num_compilations() == 1  # every slot write reuses one compiled update


def test_stream_takes_lora_requests_like_generate(llm, adapters):
    loras = [adapters["a"], None, adapters["d"]]
    want = [_tokens(llm, lora) for lora in loras]
    streamed: dict[str, list[int]] = {}
    order = []
    for delta in llm.stream(prompt_token_ids=[PROMPT] * 3, sampling_params=GREEDY, lora_request=loras):
        assert delta.finish_reason != "error", delta.output.error
        if delta.request_id not in streamed:
            order.append(delta.request_id)
        streamed.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert [streamed[r] for r in order] == want and len({tuple(t) for t in want}) == 3


def test_remove_lora_waits_for_its_requests_then_frees_the_slot(llm, adapters, tmp_path):
    engine = llm.engine
    path = lora_adapters.make_adapter(str(tmp_path / "gone"), CONFIG, rank=4, alpha=8, seed=9, std=0.3)
    gone = LoRARequest("gone", 40, path)
    want = _tokens(llm, gone)
    assert gone.lora_int_id in engine.lora.resident
    engine.add_request("remove-me", PROMPT, GREEDY, lora_request=gone)
    with pytest.raises(ValueError, match="still used by a running request"):
        engine.remove_lora(gone.lora_int_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.pop_finished("remove-me")
    engine.remove_lora(gone.lora_int_id)
    assert gone.lora_int_id not in engine.lora.adapters and gone.lora_int_id not in engine.lora.resident
    assert "gone" not in engine.lora.ids
    assert _tokens(llm, LoRARequest("gone", 41, path)) == want  # the name again, under a new id
    base = _tokens(llm, None)
    engine.remove_lora("gone")  # by name: the id it names is forgotten everywhere, and the engine runs on
    assert 41 not in engine.lora.adapters and 41 not in engine.lora.resident and "gone" not in engine.lora.ids
    assert _tokens(llm, None) == base and _tokens(llm, adapters["a"]) == _tokens(llm, adapters["a"])


def test_slots_evict_least_recently_used_and_reload(llm, adapters):
    manager = llm.engine.lora
    first = {name: _tokens(llm, adapters[name]) for name in ("a", "b", "c")}
    loads = manager.num_loads
    assert _tokens(llm, adapters["d"]) != _tokens(llm, None)
    assert manager.num_loads == loads + 1 and adapters["a"].lora_int_id not in manager.resident  # a was the LRU
    assert _tokens(llm, adapters["a"]) == first["a"]  # reloaded from the host copy, same output
    assert manager.num_loads == loads + 2 and adapters["b"].lora_int_id not in manager.resident
    # Four adapters in one call with three slots: the scheduler holds one back until a slot frees; all match.
    names = ["a", "b", "c", "d"]
    outs = llm.generate(prompt_token_ids=[PROMPT] * 4, sampling_params=GREEDY,
                        lora_request=[adapters[n] for n in names])
    assert [o.outputs[0].token_ids for o in outs[:3]] == [first[n] for n in names[:3]]
    assert outs[3].outputs[0].token_ids == _tokens(llm, adapters["d"])
    assert llm.runner.lora.num_compilations() == 1


def test_prefix_cache_never_hits_across_adapters(llm, adapters):
    prompt = list(range(20, 60))  # ten full pages
    _tokens(llm, adapters["a"], prompt)
    out_b = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=adapters["b"])[0]
    out_base = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
    out_a = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=adapters["a"])[0]
    assert out_b.metrics.num_cached_tokens == 0 and out_base.metrics.num_cached_tokens == 0
    assert out_a.metrics.num_cached_tokens == 36  # its own adapter's pages do hit


def test_update_lora_replaces_the_adapter_without_recompiling(llm, adapters, tmp_path):
    target = adapters["b"]
    manager = llm.engine.lora
    manager.register(target)
    rng = np.random.default_rng(9)
    new = {name: (rng.standard_normal(a.shape).astype(np.float32) * 0.3,
                  rng.standard_normal(b.shape).astype(np.float32) * 0.3)
           for name, (a, b) in manager.adapters[target.lora_int_id].weights.items()}
    before = _tokens(llm, target)
    # The same weights as a fresh PEFT folder (lora_A = a.T, lora_B = b.T) under another id: the expected output.
    folder = lora_adapters.write_adapter(str(tmp_path / "b2"), lora_adapters.peft_tensors(new), rank=4, alpha=8,
                                         use_rslora=True, modules=("q_proj", "v_proj"))
    expected = _tokens(llm, LoRARequest("b2", 9, folder))
    assert expected != before
    compiles, writes = llm.runner.num_compilations(), llm.runner.lora.num_compilations()
    llm.update_lora("b", new)
    assert _tokens(llm, target) == expected
    assert llm.runner.num_compilations() == compiles and llm.runner.lora.num_compilations() == writes == 1
    with pytest.raises(ValueError, match=r"needs a \[64, 4\]"):
        llm.update_lora(target.lora_int_id, {"layers.0.q_proj": (np.zeros((64, 8)), np.zeros((8, 64)))})
    with pytest.raises(ValueError, match="does not adapt layers.0.k_proj"):
        llm.update_lora("b", {"layers.0.k_proj": new["layers.0.q_proj"]})
    with pytest.raises(ValueError, match="no LoRA adapter 'nope'"):
        llm.update_lora("nope", {})


def _bad(folder, kind: str):
    """An adapter folder broken in one way."""
    tensors = lora_adapters.random_adapter_tensors(CONFIG, rank=4, seed=0, modules=("q_proj",))
    cfg: dict = {}
    if kind == "rank":
        tensors = lora_adapters.random_adapter_tensors(CONFIG, rank=16, seed=0, modules=("q_proj",))
    elif kind == "wrong_base":
        big = CONFIG.replace(hidden_size=128, num_heads=8)
        tensors = lora_adapters.random_adapter_tensors(big, rank=4, seed=0, modules=("q_proj",))
        cfg = {"base_model_name_or_path": "some/other-model"}
    elif kind == "layer":
        tensors = lora_adapters.random_adapter_tensors(CONFIG.replace(num_layers=3), rank=4, seed=0,
                                                       modules=("q_proj",), layers=[2])
    elif kind == "module":
        tensors["base_model.model.lm_head.lora_A.weight"] = np.zeros((4, 64), np.float32)
    elif kind == "target":
        cfg = {"target_modules": ["q_proj", "embed_tokens"]}
    elif kind == "target_type":
        cfg = {"target_modules": [["q_proj"]]}
    elif kind == "alpha_nan":
        cfg = {"lora_alpha": float("nan")}
    elif kind == "alpha_huge":
        cfg = {"lora_alpha": 1e38}
    elif kind == "nan":
        next(iter(tensors.values()))[0, 0] = np.nan
    elif kind == "half":
        tensors = {k: v for k, v in tensors.items() if "lora_B" not in k or ".0." not in k}
    elif kind == "dora":
        cfg = {"use_dora": True}
    rank = 16 if kind == "rank" else 4
    lora_adapters.write_adapter(str(folder), tensors, rank=rank, alpha=8, **cfg)
    if kind == "corrupt":
        with open(os.path.join(folder, "adapter_model.safetensors"), "r+b") as f:
            f.write(b"\xff" * 16)
    elif kind == "no_weights":
        os.replace(os.path.join(folder, "adapter_model.safetensors"), os.path.join(folder, "adapter_model.bin"))
    elif kind == "no_config":
        os.remove(os.path.join(folder, "adapter_config.json"))
    elif kind == "bad_json":
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            f.write("{not json")
    return str(folder)


BAD = {"rank": "above max_lora_rank=8", "wrong_base": r"needs \[4, 64\].*'some/other-model'.*wrong base model",
       "layer": "does not have.*wrong base model", "module": "lm_head.*unknown module",
       "target": r"targets \['embed_tokens'\]", "target_type": "it must be a list of module names",
       "alpha_nan": "lora_alpha=nan; it must be a finite number",
       "alpha_huge": r"scales its product by 2.5e\+37, past 1e\+06",
       "nan": "NaN", "half": "not both lora_A and lora_B",
       "dora": "use_dora", "corrupt": "not a readable safetensors file", "no_weights": "pickle, which is never loaded",
       "no_config": "adapter_config.json is missing", "bad_json": "not valid JSON", "no_folder": "is not a folder"}


def test_each_bad_adapter_is_a_clear_error_and_the_batch_still_runs(llm, adapters, tmp_path):
    good = _tokens(llm, adapters["a"])
    base = _tokens(llm, None)
    kinds = list(BAD)
    bad = [LoRARequest(f"bad-{k}", 100 + i, str(tmp_path / "missing") if k == "no_folder" else _bad(tmp_path / k, k))
           for i, k in enumerate(kinds)]
    outs = llm.generate(prompt_token_ids=[PROMPT] * (len(bad) + 2), sampling_params=GREEDY,
                        lora_request=bad + [adapters["a"], None])
    for kind, out in zip(kinds, outs):
        assert out.outputs[0].finish_reason == "error" and out.error is not None, kind
        assert re.search(BAD[kind], out.error), (kind, out.error)
    assert outs[-2].outputs[0].token_ids == good and outs[-1].outputs[0].token_ids == base
    assert not any(r.lora_int_id in llm.engine.lora.adapters for r in bad)


def test_lora_arguments_are_checked(llm, adapters, tiny_llama):
    with pytest.raises(ValueError, match="max_loras must be an integer >= 1"):
        LoRAConfig(enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(ValueError, match="speculative decoding"):
        LLM("tiny-llama", enable_lora=True, speculative_method="ngram")
    out = tiny_llama.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, lora_request=adapters["a"])[0]
    assert "enable_lora=True" in out.error
    with pytest.raises(ValueError, match="2 lora_requests for 1 prompts"):
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, lora_request=[None, None])
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY,
                       lora_request=LoRARequest("a", 77, adapters["a"].lora_path))[0]
    assert "registered with id 1" in out.error


def test_update_lora_names_a_wrong_argument(llm, adapters):
    _tokens(llm, adapters["a"])  # registered
    with pytest.raises(ValueError, match="weights must map projection names to \\(a, b\\) pairs, got NoneType"):
        llm.update_lora("a", None)
    with pytest.raises(ValueError, match="named by its name \\(str\\) or id \\(int\\), got True"):
        llm.update_lora(True, {})


def test_a_known_adapter_from_another_path_is_refused_not_ignored(llm, adapters):
    _tokens(llm, adapters["a"])  # registered from its folder
    moved = LoRARequest("a", adapters["a"].lora_int_id, adapters["b"].lora_path)
    with pytest.raises(ValueError, match="was loaded from .*not .*known name go through update_lora"):
        llm.add_lora(moved)
    assert llm.add_lora(LoRARequest("a", adapters["a"].lora_int_id, adapters["a"].lora_path + "/")) == 1  # same folder
