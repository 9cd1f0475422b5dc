"""FP8 Hugging Face checkpoints (models/loaders/fp8_checkpoint.py): tiny folders written here, by hand, in the
compressed-tensors `float-quantized` layout (weight_scale per channel or per tensor, input_scale) and the block-wise
`quant_method: "fp8"` layout (weight_scale_inv per 128x128 block), config.json's quantization_config included. They
load as FP8 QuantizedWeights (no float copy) and give the logits of the same weights dequantized; malformed ones
are errors naming the tensor."""

from __future__ import annotations

import copy
import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from configs.presets import get_model_config
from kernels_pallas.backend import compiling_for
from inference import LLM, SamplingParams
from models.decoder import build_decoder
from models.loaders.fp8_checkpoint import COMPRESSED_TENSORS_FP8
from models.loaders.hf_checkpoint import load_hf_folder
from models.loaders.hf_names import hf_name
from models.quantization.formats import QuantizedWeight
from models.weights import expected_shapes

F8 = ml_dtypes.float8_e4m3fn
PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# llm-compressor's FP8 scheme with a static per-tensor input scale (`input_scale` in the folder), the variant of the
# written layout (`COMPRESSED_TENSORS_FP8`: dynamic per-token activations) that checkpoints also ship.
CT_CONFIG = copy.deepcopy(COMPRESSED_TENSORS_FP8)
CT_CONFIG["config_groups"]["group_0"]["input_activations"].update(strategy="tensor", dynamic=False)
BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _hf_config(config) -> dict:
    return {"model_type": "llama", "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "vocab_size": config.vocab_size,
            "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps, "hidden_act": "silu",
            "tie_word_embeddings": config.tie_word_embeddings, "max_position_embeddings": 1024,
            "bos_token_id": 1, "eos_token_id": 2}


def _quantize_hf(w_out_in: np.ndarray, layout: str, per_tensor: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [out, in] e4m3, the scale tensor as the layout stores it, the dequantized [out, in] float32)."""
    out, inn = w_out_in.shape
    if layout == "compressed-tensors":
        amax = np.abs(w_out_in).max() if per_tensor else np.abs(w_out_in).max(axis=1, keepdims=True)
        scale = (np.asarray(amax, np.float32) / 448.0).reshape((1,) if per_tensor else (out, 1))
        full = np.broadcast_to(scale.reshape(-1, 1) if not per_tensor else scale, w_out_in.shape)
    else:  # 128x128 blocks, ragged at the edges
        bo, bi = -(-out // 128), -(-inn // 128)
        scale = np.zeros((bo, bi), np.float32)
        for i in range(bo):
            for j in range(bi):
                scale[i, j] = np.abs(w_out_in[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max() / 448.0
        full = np.kron(scale, np.ones((128, 128), np.float32))[:out, :inn]
    q = (w_out_in / full).astype(F8)
    return q, scale, q.astype(np.float32) * full


def write_fp8_folder(folder, layout: str, *, per_tensor: bool = False, seed: int = 0, drop=(), replace=None):
    """A tiny-llama folder in `layout`; returns (config, the dequantized canonical weights)."""
    config = get_model_config("tiny-llama")
    rng = np.random.default_rng(seed)
    state, dequantized = {}, {}
    for name, shape in expected_shapes(config).items():
        w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        leaf = name.rsplit(".", 1)[-1]
        hf = hf_name(name)
        if leaf in PROJS:
            q, scale, deq = _quantize_hf(np.ascontiguousarray(w.T), layout, per_tensor)
            state[hf] = q
            if layout == "compressed-tensors":
                state[hf[:-len(".weight")] + ".weight_scale"] = scale
                state[hf[:-len(".weight")] + ".input_scale"] = np.ones((1,), np.float32)
            else:
                state[hf[:-len(".weight")] + ".weight_scale_inv"] = scale
            dequantized[name] = np.ascontiguousarray(deq.T)
        else:
            state[hf] = np.ascontiguousarray(w.T if leaf == "lm_head" else w)
            dequantized[name] = w
    for key in drop:
        del state[key]
    state.update(replace or {})
    save_file(state, str(folder / "model.safetensors"))
    qc = CT_CONFIG if layout == "compressed-tensors" else BLOCK_CONFIG
    (folder / "config.json").write_text(json.dumps(_hf_config(config) | {"quantization_config": qc}))
    return config, dequantized


@pytest.mark.parametrize("layout,per_tensor", [("compressed-tensors", False), ("compressed-tensors", True),
                                               ("fp8", False)])
def test_fp8_folder_loads_fp8_and_matches_its_dequantized_logits(tmp_path, layout, per_tensor):
    config, dequantized = write_fp8_folder(tmp_path, layout, per_tensor=per_tensor)
    got_config, weights = load_hf_folder(tmp_path)
    q = weights["layers.0.q_proj"]
    assert isinstance(q, QuantizedWeight) and q.is_fp8 and q.q.dtype == jnp.float8_e4m3fn
    assert not isinstance(weights["lm_head"], QuantizedWeight)  # ignored by the checkpoint: float
    np.testing.assert_array_equal(np.asarray(weights["layers.1.down_proj"].dequantize()),
                                  dequantized["layers.1.down_proj"])
    with compiling_for("tpu"):  # a chip whose dot reads the codes: kept as they are; run here weight-only
        model = build_decoder(got_config, weights)
    assert model.layers[0].attn.q_proj.kernel.get_value().is_fp8
    ref = build_decoder(config, dequantized)
    ids = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    want = np.asarray(ref.forward(ids))
    np.testing.assert_allclose(np.asarray(model.forward(ids)), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_llm_serves_an_fp8_folder(tmp_path):
    write_fp8_folder(tmp_path, "fp8")
    llm = LLM(model=str(tmp_path), quantization="fp8", kv_cache_memory_bytes=4 << 20, max_num_seqs=2)
    out = llm.generate(prompt_token_ids=[[5, 17, 42]], sampling_params=SamplingParams(temperature=0.0, max_tokens=4,
                                                                                      ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="already quantized"):
        LLM(model=str(tmp_path), quantization="int8", kv_cache_memory_bytes=4 << 20, max_num_seqs=2)


SCALE = "model.layers.0.self_attn.k_proj.weight_scale"
WEIGHT = "model.layers.0.self_attn.k_proj.weight"


@pytest.mark.parametrize("drop,replace,match", [
    ((SCALE,), None, f"FP8 tensor '{WEIGHT}' has no scale '{SCALE}'"),
    ((), {SCALE: np.ones((5, 1), np.float32)}, f"{SCALE}: scale shape \\(5,\\) fits none"),
    ((), {SCALE: np.ones((32, 1), np.int32)}, f"{SCALE}: its scale must be float"),
    ((), {WEIGHT: np.zeros((32, 64), np.float16)}, f"'{WEIGHT}' has dtype float16, but its scale"),
])
def test_malformed_fp8_folders_name_the_tensor(tmp_path, drop, replace, match):
    write_fp8_folder(tmp_path, "compressed-tensors", drop=drop, replace=replace)
    with pytest.raises(ValueError, match=match):
        load_hf_folder(tmp_path)


def test_fp8_tensors_without_a_quantization_config_are_refused(tmp_path):
    write_fp8_folder(tmp_path, "fp8")
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="float8_e4m3fn but config.json has no quantization_config"):
        load_hf_folder(tmp_path)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="only \\[128, 128\\] blocks"):
        load_hf_folder(tmp_path)


def test_convert_writes_a_compressed_tensors_fp8_folder_from_a_float_one(tmp_path):
    """scripts/convert.py --quantization=fp8 (`save_fp8_folder`): a bf16/f32 HF folder -> per-channel FP8 codes and
    weight_scale in the compressed-tensors layout; it loads back as FP8 and stays close to the float model."""
    from models.loaders.hf_checkpoint import save_fp8_folder
    from tests.tiny_folder import make_tiny_hf_folder

    src = make_tiny_hf_folder(tmp_path / "src")
    size = save_fp8_folder(src, tmp_path / "fp8")
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "float-quantized" and (tmp_path / "fp8" / "tokenizer.json").exists()
    config, float_weights = load_hf_folder(src)
    _, weights = load_hf_folder(tmp_path / "fp8")
    assert weights["layers.0.q_proj"].is_fp8 and size < sum(w.nbytes for w in float_weights.values())
    ids = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    want = np.asarray(build_decoder(config, float_weights).forward(ids))
    got = np.asarray(build_decoder(config, weights).forward(ids))
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
    (tmp_path / "block").mkdir()
    write_fp8_folder(tmp_path / "block", "fp8")
    with pytest.raises(ValueError, match="already quantized"):
        save_fp8_folder(tmp_path / "block", tmp_path / "again")
