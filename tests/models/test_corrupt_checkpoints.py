"""Corrupt or hand-broken checkpoints: each is a ValueError naming the file, what is wrong and what to do
(models/loaders/read_errors.py), never a bare KeyError / TypeError / library `Exception`, and a broken tokenizer
file is an error, not a model silently without a tokenizer. Tiny synthetic files (tests/models/test_loaders.py's
writers) and the tiny HF folder with a tokenizer (tests/tiny_folder.py)."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from configs.presets import get_model_config
from inference.loading.model_loader import load_model
from models.loaders.gguf_file import load_gguf
from models.loaders.hf_checkpoint import load_hf_folder
from models.loaders.orbax_checkpoint import CONFIG_FILE, WEIGHTS_DIR, read_config, restore_weights, save_checkpoint
from tests.models.test_loaders import _hf_config, _hf_state, _random_weights, _to_gguf_tensors, _write_gguf
from tests.tiny_folder import make_tiny_hf_folder

CONFIG = get_model_config("tiny-llama")


def _hf_folder(folder, **config_changes):
    save_file(_hf_state(CONFIG, _random_weights(CONFIG)), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**_hf_config(CONFIG), **config_changes}))
    return folder


@pytest.mark.parametrize("what, config_json, message", [
    ("a list", "[]", r"config\.json holds a JSON list, not an object"),
    ("a null number", {"hidden_size": None}, r"config\.json: cannot read the model config \(TypeError"),
    ("a string number", {"hidden_size": "x"}, r"config\.json: cannot read the model config \(ValueError"),
    ("no heads", {"num_attention_heads": 0}, r"config\.json: cannot read the model config \(ZeroDivisionError"),
    ("rope_scaling a string", {"rope_scaling": "linear"}, r"config\.json: cannot read the model config"),
    ("not UTF-8", b'{"model_type": "ll\xe9ma"}', r"config\.json is not valid JSON"),
])
def test_a_broken_hf_config_names_the_file(tmp_path, what, config_json, message):
    _hf_folder(tmp_path)
    cfg = tmp_path / "config.json"
    if isinstance(config_json, dict):
        cfg.write_text(json.dumps({**_hf_config(CONFIG), **config_json}))
    elif isinstance(config_json, bytes):
        cfg.write_bytes(config_json)
    else:
        cfg.write_text(config_json)
    with pytest.raises(ValueError, match=message):
        load_hf_folder(tmp_path)


def test_hf_generation_config_shards_and_integer_tensors(tmp_path):
    _hf_folder(tmp_path)
    (tmp_path / "generation_config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"generation_config\.json holds a JSON list"):
        load_hf_folder(tmp_path)
    os.remove(tmp_path / "generation_config.json")
    # an index that places a tensor in a shard that does not hold it
    os.replace(tmp_path / "model.safetensors", tmp_path / "shard.safetensors")
    names = list(load_file(str(tmp_path / "shard.safetensors")))
    index = {"weight_map": {**dict.fromkeys(names, "shard.safetensors"), "model.extra.weight": "shard.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"shard\.safetensors lacks 'model\.extra\.weight' .*index\.json places"):
        load_hf_folder(tmp_path)
    for name in ("shard.safetensors", "model.safetensors.index.json"):
        os.remove(tmp_path / name)
    # an integer tensor where a float checkpoint has a weight: refused, not cast into a garbage model
    state = _hf_state(CONFIG, _random_weights(CONFIG))
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].astype(np.int16)
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16)  # bf16: fine
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' is int16, not a float"):
        load_hf_folder(tmp_path)


@pytest.mark.parametrize("name, content, message", [
    ("tokenizer.json", "{not json", r"tokenizer\.json: cannot read the tokenizer \(Exception"),
    ("tokenizer_config.json", "{not json", r"tokenizer_config\.json is not valid JSON"),
    ("chat_template.json", "[1, 2]", r"chat_template\.json holds a JSON list"),
])
def test_a_broken_tokenizer_file_is_an_error_not_a_missing_tokenizer(tmp_path, name, content, message):
    folder = make_tiny_hf_folder(tmp_path / "model")
    assert load_model(str(folder)).tokenizer is not None
    (folder / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        load_model(str(folder))


def test_gguf_metadata_that_disagrees_or_is_not_utf8_names_the_file(tmp_path):
    weights = _random_weights(CONFIG)
    tensors = _to_gguf_tensors(CONFIG, weights, permute=True)
    path = tmp_path / "m.gguf"
    _write_gguf(path, "llama", CONFIG.replace(num_heads=8), tensors)  # head_count disagrees with the tensors
    with pytest.raises(ValueError, match=r"m\.gguf"):
        load_gguf(path)
    _write_gguf(path, "llama", CONFIG, tensors)
    data = path.read_bytes()
    assert data.count(b"gpt2") == 1
    path.write_bytes(data.replace(b"gpt2", b"\xffpt2"))  # the tokenizer model's string, no longer UTF-8
    with pytest.raises(ValueError, match=r"m\.gguf: cannot read the GGUF file \(UnicodeDecodeError"):
        load_gguf(path)


def test_orbax_config_fields_of_the_wrong_type_and_missing_parts(tmp_path):
    folder = tmp_path / "ckpt"
    save_checkpoint(str(folder), CONFIG, _random_weights(CONFIG))
    cfg_path = folder / CONFIG_FILE
    good = json.loads(cfg_path.read_text())
    for change, message in (({"num_heads": 4.0}, r"num_heads=4\.0 is not a int"),
                            ({"eos_token_ids": "2"}, r"eos_token_ids='2' is not a tuple"),
                            ({"rope_scaling": {"factor": 2.0, "bogus": 1}}, "unexpected keyword argument 'bogus'"),
                            ({"rope_scaling": "linear"}, r"rope_scaling='linear' is not a")):
        cfg_path.write_text(json.dumps({**good, "config": {**good["config"], **change}}))
        with pytest.raises(ValueError, match=rf"{CONFIG_FILE}: invalid model config \(.*{message}"):
            read_config(str(folder))
    cfg_path.write_bytes(b'{"format": "pagejax-orbax", "x": "\xe9"}')
    with pytest.raises(ValueError, match=r"cannot read the checkpoint's config .*utf-8"):
        read_config(str(folder))
    cfg_path.write_text(json.dumps(good))
    assert read_config(str(folder)) == CONFIG
    shutil.rmtree(folder / WEIGHTS_DIR)
    with pytest.raises(ValueError, match=rf"has no {WEIGHTS_DIR}/ folder .*scripts/convert\.py"):
        restore_weights(str(folder), CONFIG)
    save_checkpoint(str(tmp_path / "unfinished"), CONFIG, _random_weights(CONFIG))
    os.remove(tmp_path / "unfinished" / CONFIG_FILE)  # a conversion stopped before its config was written
    with pytest.raises(ValueError, match=rf"has a {WEIGHTS_DIR}/ folder but no {CONFIG_FILE}"):
        load_model(str(tmp_path / "unfinished"))
