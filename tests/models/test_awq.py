"""AWQ-style scaling (models/quantization/awq.py) on tiny random models: the folded scales are an exact float
transformation, they lower the quantized layers' output error against plain int4, and LLM(quantization="int4-awq")
runs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from configs.presets import get_model_config
from inference import LLM
from inference.loading.shipped_text import calibration_token_ids
from models.quantization.awq import AWQConfig, apply_awq, calibration_dataset
from models.quantization.formats import QuantizedWeight
from models.decoder import build_decoder, quantize_decoder
from tests.llm_configs import merged_model

CONFIG = AWQConfig(num_tokens=128, seq_len=32, batch_size=2)


def _salient_model(name: str, seed: int = 0):
    """A random tiny model whose norms give a few channels ~10x larger activations (what AWQ is for), and random
    biases where the config has them."""
    model = build_decoder(get_model_config(name), seed=seed)
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        for norm in (layer.attn_norm, layer.mlp_norm):
            w = rng.uniform(0.5, 1.5, norm.weight.get_value().shape)
            w[rng.choice(len(w), 4, replace=False)] *= 10.0
            norm.weight.set_value(jnp.asarray(w if norm.style == "rms" else w - 1.0, jnp.float32))
        for proj in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj):
            if proj.bias is not None:
                proj.bias.set_value(jnp.asarray(rng.normal(0, 0.1, proj.bias.get_value().shape), jnp.float32))
    return model


def _tokens(model, n=CONFIG.num_tokens, seed=0):
    return calibration_token_ids(None, model.config.vocab_size, n, seed=seed)


def test_calibration_dataset_is_a_grain_pipeline_of_fixed_chunks():
    ds = calibration_dataset(np.arange(100), seq_len=16, batch_size=4)
    batches = list(ds)
    assert [b.shape for b in batches] == [(4, 16), (2, 16)]  # 6 full chunks; the last 4 tokens are dropped
    np.testing.assert_array_equal(np.concatenate(batches).reshape(-1), np.arange(96))
    with pytest.raises(ValueError, match="fill no chunk"):
        calibration_dataset(np.arange(10), seq_len=16, batch_size=1)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-gemma2"])
def test_awq_scales_are_an_exact_transformation_in_float(name):
    """GQA-tied o_proj scales folded into v_proj (with bias), q/k/v and gate/up into rms- and Gemma-style norms."""
    model = _salient_model(name)
    ids = jnp.asarray(_tokens(model, 24, seed=1).reshape(2, 12))
    before = np.asarray(model.forward(ids))
    results = apply_awq(model, _tokens(model), CONFIG)
    assert len(results) == 4 * model.config.num_layers
    assert sum(r.alpha > 0 for r in results) >= len(results) // 2  # most groups were actually rescaled
    after = np.asarray(model.forward(ids))
    assert np.abs(after - before).max() <= 1e-4 * max(1.0, np.abs(before).max())


def test_awq_lowers_the_quantized_layers_output_error():
    """Measured outside the search, on calibration activations (the float model's hidden states): the output of each
    layer's attention block (o_proj) and MLP (down_proj), int4 after AWQ vs plain int4, against float. (Single
    projections are not comparable: AWQ rescales v_proj's and up_proj's output columns on purpose.)"""
    plain, awq, ref = (_salient_model("tiny-llama") for _ in range(3))
    results = apply_awq(awq, _tokens(ref), CONFIG)
    assert all(r.error_awq <= r.error_plain for r in results)
    quantize_decoder(plain, "int4")
    quantize_decoder(awq, "int4")
    x = ref.embed(jnp.asarray(_tokens(ref).reshape(4, 32)))
    positions = jnp.arange(32)
    errors = {"plain": 0.0, "awq": 0.0}
    for i, layer in enumerate(ref.layers):
        attn_ref = layer.attn.forward_dense(layer.attn_norm(x), positions)[0]
        mlp_ref = layer.mlp(layer.mlp_norm(x))
        for kind, model in (("plain", plain), ("awq", awq)):
            q = model.layers[i]
            assert isinstance(q.attn.q_proj.kernel.get_value(), QuantizedWeight)
            attn = q.attn.forward_dense(q.attn_norm(x), positions)[0]
            mlp = q.mlp(q.mlp_norm(x))
            errors[kind] += float(jnp.mean((attn - attn_ref) ** 2) + jnp.mean((mlp - mlp_ref) ** 2))
        x, _ = layer.forward_dense(x, positions)
    assert errors["awq"] < 0.9 * errors["plain"], errors


def test_llm_int4_awq_builds_and_rejects_bad_input():
    """LLM(quantization="int4-awq") calibrates at load (random ids for a tokenizer-less random model) and holds int4
    weights of the scaled model; the engine path is the int4 one (same shapes and matmuls), tested elsewhere."""
    llm = LLM("tiny-llama", quantization="int4-awq", kv_cache_memory_bytes=4 << 20, max_num_seqs=2,
              compilation_cache_dir=None)
    model = merged_model(llm)
    assert isinstance(model.layers[0].attn.q_proj.kernel.get_value(), QuantizedWeight)
    assert model.layers[0].attn.q_proj.kernel.get_value().bits == 4
    assert not np.allclose(np.asarray(model.layers[0].mlp_norm.weight.get_value()), 1.0)  # 1/s folded in
    with pytest.raises(ValueError, match="include 0"):
        AWQConfig(alphas=(0.5, 1.0))
    with pytest.raises(ValueError, match="quantization_group_size"):
        build_decoder(get_model_config("tiny-llama"), quantization="int8", quantization_group_size=64)
    model = build_decoder(get_model_config("tiny-llama"))
    with pytest.raises(ValueError, match="calibration_tokens"):
        quantize_decoder(model, "int4-awq")
    quantize_decoder(model, "int4")
    with pytest.raises(ValueError, match="float model"):
        apply_awq(model, _tokens(model), CONFIG)
