"""GGUF and Hugging Face safetensors loaders: config translation, dequantization, Q/K order, error messages."""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest

from gguf import GGMLQuantizationType as Q
from safetensors.numpy import save_file

from configs.presets import get_model_config
from models.loaders import gguf_file as gguf_loader
from models.loaders import hf_checkpoint as hf_loader
from models.loaders import hf_names
from models.config import ModelConfig, RopeScaling
from models.loaders.gguf_file import (dequantize, fit_llama3_rope_scaling, llama3_rope_factors, load_gguf,
                                      permute_qk_llamacpp, unpermute_qk)
from models.loaders.hf_checkpoint import load_hf_folder, read_safetensors_raw
from models.weights import expected_shapes
from tests.reference_fixtures import gguf_path


@pytest.fixture(scope="module")
def smollm():
    path = gguf_path()
    start = time.perf_counter()
    config, weights, info = load_gguf(path)
    return config, weights, info, time.perf_counter() - start


@pytest.fixture(scope="module")
def smollm_reader():
    """The raw tensors, read once; the loader's fast reader subclass (plain GGUFReader parses 3x slower)."""
    return gguf_loader._ArrayReader(gguf_path())


def _random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in expected_shapes(config).items()}


# ---------------------------------------------------------------------------------------------- a synthetic GGUF writer

_TO_GGUF_LAYER = {v: k for k, v in gguf_loader._LAYER_NAMES.items()}


def _to_gguf_tensors(config: ModelConfig, weights: dict[str, np.ndarray], permute: bool) -> dict[str, np.ndarray]:
    """Canonical weights -> what llama.cpp's convert_hf_to_gguf writes (HF [out, in], Q/K permuted for llama)."""
    out = {}
    for name, w in weights.items():
        if name in ("embed", "final_norm", "lm_head"):
            gname = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}[name]
        else:
            _, i, leaf = name.split(".")
            gname = f"blk.{i}.{_TO_GGUF_LAYER[leaf]}"
        leaf = name.rsplit(".", 1)[-1]
        if leaf in gguf_loader._LINEARS:
            w = w.T
        if permute and leaf in ("q_proj", "q_bias"):
            w = permute_qk_llamacpp(w, config.num_heads, config.num_heads)
        elif permute and leaf in ("k_proj", "k_bias"):
            w = permute_qk_llamacpp(w, config.num_heads, config.num_kv_heads)
        out[gname] = np.ascontiguousarray(w)
    return out


def _write_gguf(path: Path, arch: str, config: ModelConfig, tensors: dict[str, np.ndarray], qtype: Q = Q.F32,
                extra: dict | None = None, tokens: list[str] | None = None) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_dimension_count(config.head_dim)
    tokens = tokens or [f"t{i}" for i in range(config.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_eos_token_id(0)
    for key, value in (extra or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32)(
            key, value)
    for name, arr in tensors.items():
        if arr.ndim == 2 and qtype != Q.F32:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------------------------- the real SmolLM2 file

def test_smollm2_config(smollm):
    config, _, _, _ = smollm
    expected = get_model_config("smollm2-135m")
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (9, 3, 64, 49152)
    assert config.tie_word_embeddings and not config.attention_bias and config.rope_scaling is None
    assert config.rope_theta == 100000.0 and config.rms_norm_eps == 1e-5
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,) and config.max_position_embeddings == 8192
    assert config.replace(name=expected.name) == expected


def test_smollm2_weights_complete_and_finite(smollm):
    config, weights, _, _ = smollm  # its load time is a benchmark's to report, not a test's (a loaded CI box)
    shapes = expected_shapes(config)
    assert set(weights) == set(shapes) and "lm_head" not in weights
    for name, shape in shapes.items():
        assert weights[name].shape == shape and weights[name].dtype == np.float32, name
        assert np.isfinite(weights[name]).all(), name


def test_smollm2_gguf_info(smollm):
    _, _, info, _ = smollm
    assert len(info.tokens) == 49152 and len(info.token_types) == 49152 and len(info.merges) > 40000
    assert (info.tokenizer_model, info.pre_tokenizer, info.architecture) == ("gpt2", "smollm", "llama")
    assert (info.bos_token_id, info.eos_token_id, info.add_bos) == (1, 2, False)
    assert info.tokens[1] == "<|im_start|>" and "<|im_start|>" in info.chat_template


def test_real_tensors_dequantize_like_gguf_package(smollm_reader):
    smallest: dict[Q, gguf.ReaderTensor] = {}
    for t in smollm_reader.tensors:
        if t.tensor_type != Q.F32 and (t.tensor_type not in smallest or t.n_bytes < smallest[t.tensor_type].n_bytes):
            smallest[t.tensor_type] = t
    assert set(smallest) == {Q.Q4_1, Q.Q8_0}
    for qtype, t in smallest.items():
        rows = t.data[:512]  # the only Q8_0 tensor is the 49152-row embedding; gguf's reference is slow
        np.testing.assert_array_equal(dequantize(rows, qtype, (rows.shape[0], int(t.shape[0]))),
                                      gguf.quants.dequantize(rows, qtype))


def test_real_q_proj_is_unpermuted(smollm, smollm_reader):
    config, weights, _, _ = smollm
    raw = next(t for t in smollm_reader.tensors if t.name == "blk.0.attn_q.weight")
    stored = gguf.quants.dequantize(raw.data, raw.tensor_type)  # [out, in], llama.cpp order
    np.testing.assert_array_equal(permute_qk_llamacpp(weights["layers.0.q_proj"].T, config.num_heads), stored)


def _numpy_last_logits(config: ModelConfig, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """A plain numpy Llama forward (rotate-half RoPE, GQA, SwiGLU): checks the loader apart from the JAX decoder."""
    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + config.rms_norm_eps) * g

    def rope(x, pos):  # x: [T, heads, D]
        d = x.shape[-1]
        ang = pos[:, None] * config.rope_theta ** (-np.arange(0, d, 2) / d)[None]
        cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
        return x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    t, h, kv, d = len(ids), config.num_heads, config.num_kv_heads, config.head_dim
    x, pos, mask = w["embed"][ids], np.arange(t, dtype=np.float32), np.triu(np.full((t, t), -np.inf), 1)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        a = rms(x, w[p + "attn_norm"])
        q = rope((a @ w[p + "q_proj"]).reshape(t, h, d), pos)
        k = np.repeat(rope((a @ w[p + "k_proj"]).reshape(t, kv, d), pos), h // kv, axis=1)
        v = np.repeat((a @ w[p + "v_proj"]).reshape(t, kv, d), h // kv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        x = x + np.einsum("hts,shd->thd", s / s.sum(-1, keepdims=True), v).reshape(t, h * d) @ w[p + "o_proj"]
        m = rms(x, w[p + "mlp_norm"])
        g = m @ w[p + "gate_proj"]
        x = x + (g / (1 + np.exp(-g)) * (m @ w[p + "up_proj"])) @ w[p + "down_proj"]
    return (rms(x[-1:], w["final_norm"]) @ w["embed"].T)[0]


def test_loaded_weights_reproduce_transformers_logits(smollm):
    """End to end check of un-permutation and transposes against logits recorded from transformers."""
    fixtures = Path(__file__).parent.parent / "fixtures"
    if not (fixtures / "smollm2_reference_logits.npz").is_file():
        pytest.skip("reference fixtures missing (scripts/fixtures/make_reference_fixtures.py)")
    config, weights, _, _ = smollm
    prompts = json.loads((fixtures / "smollm2_reference.json").read_text())["prompts"]
    index = min(range(len(prompts)), key=lambda i: len(prompts[i]["prompt_ids"]))  # cheapest prompt
    ref = np.load(fixtures / "smollm2_reference_logits.npz")[f"p{index}_last_prompt"]
    logits = _numpy_last_logits(config, weights, prompts[index]["prompt_ids"])
    np.testing.assert_allclose(logits, ref, atol=1e-3)
    assert logits.argmax() == ref.argmax()


# ---------------------------------------------------------------------------------------------- dequantization

@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16])
def test_dequantize_matches_gguf_package(qtype):
    x = np.random.default_rng(1).standard_normal((6, 128)).astype(np.float32) * 3
    raw = gguf.quants.quantize(x, qtype)
    got = dequantize(raw, qtype, (6, 128))
    np.testing.assert_array_equal(got, gguf.quants.dequantize(raw, qtype))
    assert got.dtype == np.float32


# ---------------------------------------------------------------------------------------------- Q/K permutation

@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 8), (6, 2, 16), (9, 3, 64)])
def test_unpermute_inverts_llamacpp_permute(heads, kv_heads, head_dim):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((heads * head_dim, 24)).astype(np.float32)
    k = rng.standard_normal((kv_heads * head_dim, 24)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute_qk_llamacpp(q, heads, heads), heads), q)
    np.testing.assert_array_equal(unpermute_qk(permute_qk_llamacpp(k, heads, kv_heads), heads, kv_heads), k)
    bias = rng.standard_normal(kv_heads * head_dim).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute_qk_llamacpp(bias, heads, kv_heads), heads, kv_heads), bias)


def test_permutation_is_interleave_of_rotate_half_pairs():
    # One head, head_dim 8: HF rows [x0..x3 | y0..y3] become llama.cpp's interleaved (x0,y0,x1,y1,...).
    rows = np.arange(8, dtype=np.float32)[:, None]
    assert permute_qk_llamacpp(rows, 1, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


# ---------------------------------------------------------------------------------------------- synthetic GGUF files

@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_synthetic_llama_gguf_roundtrip(tmp_path, qtype):
    config = get_model_config("tiny-llama")
    weights = _random_weights(config)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", config, _to_gguf_tensors(config, weights, permute=True), qtype)
    got_config, got, info = load_gguf(path)
    assert not got_config.tie_word_embeddings and got_config.family == "llama"
    assert (got_config.num_heads, got_config.num_kv_heads, got_config.head_dim) == (4, 2, 16)
    assert got_config.eos_token_ids == (0,) and info.eos_token_id == 0
    assert all(w.flags.writeable for w in got.values())  # copies, not views of the read-only file mapping
    for name, w in weights.items():
        if qtype == Q.F32 or w.ndim == 1:
            np.testing.assert_array_equal(got[name], w, err_msg=name)
        else:
            np.testing.assert_allclose(got[name], w, atol=0.05 * np.abs(w).max(), err_msg=name)


def test_synthetic_qwen2_gguf_has_biases_and_no_permutation(tmp_path):
    config = get_model_config("tiny-llama").replace(attention_bias=True, tie_word_embeddings=True)
    weights = _random_weights(config, seed=3)
    path = tmp_path / "qwen.gguf"
    _write_gguf(path, "qwen2", config, _to_gguf_tensors(config, weights, permute=False))
    got_config, got, _ = load_gguf(path)
    assert got_config.attention_bias and got_config.tie_word_embeddings and got_config.family == "qwen2"
    for name, w in weights.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)


def test_gguf_rope_scaling_metadata(tmp_path):
    config = get_model_config("tiny-llama")
    tensors = _to_gguf_tensors(config, _random_weights(config), permute=True)
    path = tmp_path / "linear.gguf"
    _write_gguf(path, "llama", config, tensors,
                extra={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    assert load_gguf(path)[0].rope_scaling == RopeScaling(kind="linear", factor=4.0,
                                                          original_max_position_embeddings=1024)
    path = tmp_path / "yarn.gguf"
    _write_gguf(path, "llama", config, tensors, extra={
        "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 8.0,
        "llama.rope.scaling.original_context_length": 128})
    scaling = load_gguf(path)[0].rope_scaling
    assert scaling.kind == "yarn" and scaling.factor == 8.0 and scaling.original_max_position_embeddings == 128


def test_gguf_llama3_rope_freqs_tensor(tmp_path):
    config = get_model_config("tiny-llama3-rope")
    factors = llama3_rope_factors(config.rope_theta, config.head_dim, config.rope_scaling).astype(np.float32)
    tensors = _to_gguf_tensors(config, _random_weights(config), permute=True)
    tensors["rope_freqs.weight"] = factors
    path = tmp_path / "llama3.gguf"
    _write_gguf(path, "llama", config, tensors)
    got_config, weights, _ = load_gguf(path)
    assert got_config.rope_scaling.kind == "llama3" and "rope_freqs" not in " ".join(weights)
    np.testing.assert_allclose(llama3_rope_factors(config.rope_theta, config.head_dim, got_config.rope_scaling),
                               factors, rtol=1e-5)


def test_fit_llama31_rope_parameters():
    scaling = RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    factors = llama3_rope_factors(500000.0, 128, scaling).astype(np.float32)
    assert fit_llama3_rope_scaling(factors, 500000.0, 128) == scaling
    step = np.where(np.arange(64) < 40, 1.0, 8.0)  # no smooth band: only the factors can be checked
    np.testing.assert_allclose(llama3_rope_factors(500000.0, 128, fit_llama3_rope_scaling(step, 500000.0, 128)), step)
    assert fit_llama3_rope_scaling(np.ones(64, np.float32), 500000.0, 128) is None
    with pytest.raises(ValueError, match="does not match Llama 3"):
        fit_llama3_rope_scaling(np.linspace(1, 8, 64), 500000.0, 128)


# ---------------------------------------------------------------------------------------------- GGUF errors

def test_missing_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="not found.*nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("n_bytes", [0, 100, 1 << 20])
def test_truncated_gguf(tmp_path, n_bytes):
    path = tmp_path / "cut.gguf"
    with open(gguf_path(), "rb") as f:
        path.write_bytes(f.read(n_bytes))
    with pytest.raises(ValueError, match="truncated or not a GGUF file"):
        load_gguf(path)


def test_gguf_with_truncated_tensor_data(tmp_path):
    config = get_model_config("tiny-llama")
    full = tmp_path / "full.gguf"
    _write_gguf(full, "llama", config, _to_gguf_tensors(config, _random_weights(config), permute=True))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="truncated"):
        load_gguf(cut)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("definitely not gguf " * 50)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(path)


def test_unsupported_quant_type(tmp_path):
    config = get_model_config("tiny-llama")
    tensors = _to_gguf_tensors(config, _random_weights(config), permute=True)
    path = tmp_path / "q5k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    block_size, type_size = gguf.GGML_QUANT_SIZES[Q.Q5_K]
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((128, 256 // block_size * type_size), np.uint8), raw_dtype=Q.Q5_K)
    w.add_tensor("token_embd.weight", tensors["token_embd.weight"])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*Q5_K.*supported types: .*Q4_0.*Q8_0"):
        load_gguf(path)


def test_unsupported_architecture(tmp_path):
    config = get_model_config("tiny-llama")
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, "gpt2", config, {"token_embd.weight": np.zeros((512, 64), np.float32)})
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'.*llama, qwen2"):
        load_gguf(path)


# ---------------------------------------------------------------------------------------------- HF safetensors folders

def _hf_state(config: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, w in weights.items():
        if name.rsplit(".", 1)[-1] in hf_names.LINEARS:
            w = w.T
        out[hf_names.hf_name(name)] = np.ascontiguousarray(w)
    return out


def _hf_config(config: ModelConfig, model_type: str = "llama", **extra) -> dict:
    cfg = {"model_type": model_type, "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
           "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
           "num_key_value_heads": config.num_kv_heads, "vocab_size": config.vocab_size,
           "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps, "hidden_act": "silu",
           "tie_word_embeddings": config.tie_word_embeddings, "max_position_embeddings": 1024,
           "bos_token_id": 1, "eos_token_id": [2, 3]}
    cfg.update(extra)
    return cfg


def test_hf_folder_roundtrip(tmp_path):
    config = get_model_config("tiny-llama")
    weights = _random_weights(config, seed=4)
    save_file(_hf_state(config, weights), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(_hf_config(config)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 9]}))
    got_config, got = load_hf_folder(tmp_path)
    assert got_config.eos_token_ids == (2, 3, 9) and got_config.bos_token_id == 1 and got_config.head_dim == 16
    assert set(got) == set(weights)
    for name, w in weights.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)


def test_hf_sharded_bf16_qwen2_tied(tmp_path):
    config = get_model_config("tiny-llama").replace(attention_bias=True, tie_word_embeddings=True)
    weights = _random_weights(config, seed=5)
    state = {k: v.astype(ml_dtypes.bfloat16) for k, v in _hf_state(config, weights).items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied checkpoints may still store it
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / fname))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(_hf_config(config, "qwen2", rope_scaling=rope, eos_token_id=7)))
    got_config, got = load_hf_folder(tmp_path)
    assert got_config.attention_bias and got_config.tie_word_embeddings and got_config.eos_token_ids == (7,)
    assert got_config.rope_scaling == RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=64)
    assert "lm_head" not in got
    for name, w in weights.items():
        np.testing.assert_array_equal(got[name], w.astype(ml_dtypes.bfloat16).astype(np.float32), err_msg=name)
    kept = load_hf_folder(tmp_path, dtype=None)[1]
    assert kept["embed"].dtype == ml_dtypes.bfloat16


def test_raw_safetensors_reader_matches_safe_open(tmp_path):
    x = np.random.default_rng(6).standard_normal((3, 5)).astype(ml_dtypes.bfloat16)
    save_file({"x": x, "y": np.arange(4, dtype=np.float32)}, str(tmp_path / "t.safetensors"))
    np.testing.assert_array_equal(read_safetensors_raw(str(tmp_path / "t.safetensors"), "x"), x)
    np.testing.assert_array_equal(read_safetensors_raw(str(tmp_path / "t.safetensors"), "y"), np.arange(4))


def test_hf_config_variants():
    base = get_model_config("tiny-llama")
    cfg = hf_loader.config_from_hf(_hf_config(base, "mistral", head_dim=32, rope_scaling={"type": "linear",
                                                                                         "factor": 2.0}))
    assert cfg.head_dim == 32 and cfg.rope_scaling.kind == "linear" and cfg.rope_scaling.factor == 2.0
    cfg = hf_loader.config_from_hf(_hf_config(base, head_dim=None, rope_scaling={"rope_type": "default"}))
    assert cfg.head_dim == 16 and cfg.rope_scaling is None and not cfg.attention_bias


def test_hf_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_folder(tmp_path)
    config = get_model_config("tiny-llama")
    (tmp_path / "config.json").write_text(json.dumps(_hf_config(config, "gpt_neox")))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt_neox'.*llama, mistral, qwen2"):
        load_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_hf_config(config)))
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_hf_folder(tmp_path)
    state = _hf_state(config, _random_weights(config))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_hf_folder(tmp_path)


def test_hf_bin_only_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_hf_config(get_model_config("tiny-llama"))))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02")
    with pytest.raises(ValueError, match="safetensors only"):
        load_hf_folder(tmp_path)
