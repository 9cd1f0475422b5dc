"""FP8 weights (models/quantization/formats.py, modes.py "fp8"): the format, its two matmuls, the method each chip
gets, and a tiny random model quantized to FP8 against the float model of the same (dequantized) weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.presets import get_model_config
from inference import SamplingParams
from inference.engine.config import EngineConfig, check_batch_invariant
from kernels_pallas.backend import compiling_for
from models.batch_invariant import batch_invariance_problems
from models.decoder import build_decoder, quantize_decoder, weight_targets
from models.quantization.formats import (FP8_DTYPE, QuantizedWeight, fp8_weight, matmul, quantize_fp8,
                                         quantize_int8)
from models.quantization.modes import pick_method
from tests.llm_configs import SMOLLM2, merged_model

TINY = SMOLLM2.replace("tiny-llama", kv_cache_memory_bytes=4 << 20, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, skip_special_tokens=False)


def _w(k: int, n: int, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (k, n)) * 0.05


@pytest.mark.parametrize("group_size", [None, 128])
def test_quantize_fp8_round_trip_and_both_matmuls(group_size):
    w, x = _w(256, 384), jax.random.normal(jax.random.key(1), (5, 256))
    qw = quantize_fp8(w, group_size)
    assert qw.is_fp8 and qw.q.dtype == FP8_DTYPE and qw.scale.shape == (256 // (group_size or 256), 384)
    # e4m3 keeps 3 mantissa bits: a relative step of 1/8, so the rounding error is at most 1/16 of each value's
    # binade, and the largest |w| of a channel maps to exactly 448.
    err = np.abs(np.asarray(qw.dequantize() - w))
    assert err.max() <= np.abs(np.asarray(w)).max() / 16
    ref = np.asarray(x @ qw.dequantize())
    np.testing.assert_allclose(np.asarray(matmul(x, qw, "dequant")), ref, rtol=1e-5, atol=1e-5)
    # "fp8" also rounds the activations to e4m3 (per row): close, not exact.
    fp8 = np.asarray(matmul(x, qw, "fp8"))
    assert 0 < np.abs(fp8 - ref).max() <= 0.05 * np.abs(ref).max()
    # bf16 activations stay bf16 in the weight-only dot (codes are exact in bf16).
    got = matmul(x.astype(jnp.bfloat16), qw, "dequant")
    assert got.dtype == jnp.bfloat16
    assert np.abs(np.asarray(got, np.float32) - ref).max() <= 0.02 * np.abs(ref).max()


def test_fp8_weight_layouts_from_stored_scales():
    q = quantize_fp8(_w(256, 256)).q
    per_tensor = fp8_weight(q, jnp.float32(0.5))
    assert per_tensor.group_size == 256 and np.all(np.asarray(per_tensor.scale) == 0.5)
    per_channel = fp8_weight(q, jnp.arange(256, dtype=jnp.float32))
    assert per_channel.scale.shape == (1, 256)
    blocks = jnp.asarray([[1.0, 2.0], [3.0, 4.0]])  # [in/128, out/128]
    blocked = fp8_weight(q, blocks)
    want = np.asarray(q, np.float32) * np.kron(np.asarray(blocks), np.ones((128, 128)))
    np.testing.assert_array_equal(np.asarray(blocked.dequantize()), want)
    with pytest.raises(ValueError, match="w1: scale shape \\(3,\\) fits none"):
        fp8_weight(q, jnp.ones(3), name="w1")
    with pytest.raises(ValueError, match="w2: FP8 codes must be a 2-D float8_e4m3fn"):
        fp8_weight(q.astype(jnp.float16), jnp.ones(()), name="w2")
    with pytest.raises(ValueError, match="w3: its scale must be"):
        fp8_weight(q, jnp.ones((), jnp.int32), name="w3")
    with pytest.raises(ValueError, match="no zero_point or offset"):
        QuantizedWeight(q=q, scale=jnp.ones((1, 256)), zero_point=jnp.zeros((1, 256), jnp.int8), bits=8,
                        group_size=256, shape=(256, 256)).validate()
    with pytest.raises(ValueError, match="method 'fp8' is for FP8 weights"):
        matmul(jnp.ones((1, 256)), quantize_int8(_w(256, 256)), "fp8")


def test_method_choice_follows_the_chip():
    qw = quantize_fp8(_w(256, 256))
    assert pick_method(qw, 1) == "dequant"  # CPU: no FP8 units
    with compiling_for("tpu"):
        assert pick_method(qw, 64) == "dequant"
    with compiling_for("gpu"):  # no abstract mesh, no GPU here: an unknown GPU kind counts as FP8-capable
        assert pick_method(qw, 64) == "fp8"


def test_fp8_model_matches_the_float_model_of_its_weights():
    """Built as for a TPU (codes kept; no FP8 matmul there), run here through the weight-only dots; built for CPU
    the weights are the float32 of the same e4m3 values."""
    config = get_model_config("tiny-llama")
    model = build_decoder(config, seed=3)
    with compiling_for("tpu"):
        quantize_decoder(model, "fp8")
    targets = weight_targets(model)
    assert all(isinstance(p.get_value(), QuantizedWeight) and p.get_value().is_fp8
               for n, p in targets.items() if n.endswith(("proj", "embed", "lm_head")))
    ref = build_decoder(config, seed=3)
    for name, param in targets.items():
        v = param.get_value()
        w = v.dequantize() if isinstance(v, QuantizedWeight) else v
        weight_targets(ref)[name].set_value(w.T if name == "embed" else w)
    ids = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    got, want = np.asarray(model.forward(ids)), np.asarray(ref.forward(ids))
    # On CPU the FP8 matmuls are weight-only and exact: the same numbers as the float model up to float rounding.
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert batch_invariance_problems(model)  # quantized weights: refused, with the reason
    on_cpu = quantize_decoder(build_decoder(config, seed=3), "fp8")
    for name, param in weight_targets(on_cpu).items():
        np.testing.assert_array_equal(np.asarray(param.get_value()), np.asarray(weight_targets(ref)[name].get_value()))


def test_llm_fp8_generates_and_refuses_batch_invariance():
    llm = TINY.build(quantization="fp8")
    out = llm.generate(prompt_token_ids=[[5, 17, 42, 7, 99]], sampling_params=GREEDY)[0].outputs[0].token_ids
    assert len(out) == 8
    kernel = np.asarray(merged_model(llm).layers[0].attn.q_proj.kernel.get_value())
    assert kernel.dtype == np.float32  # on CPU: the e4m3 values held as float32 (decoder._hold_fp8_for_the_chip)
    scaled = kernel / (np.abs(kernel).max(axis=0) / 448)  # each channel's codes, back on the e4m3 grid
    np.testing.assert_allclose(scaled, scaled.astype(jnp.float8_e4m3fn).astype(np.float32), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="quantization='fp8'"):
        check_batch_invariant(EngineConfig.from_kwargs(quantization="fp8", batch_invariant=True))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):  # an fp8 cache: refused by name too
        EngineConfig.from_kwargs(kv_cache_dtype="fp8", batch_invariant=True)


def test_fp8_with_lora_and_speculative_decoding(tmp_path):
    """As with int8: a LoRA delta adds on top of the FP8 projections, and n-gram speculation over an FP8 model is
    token-identical to plain greedy decoding of it, both with an fp8 KV cache (read by the C++ CPU kernel where it
    runs)."""
    from inference import LLM, LoRARequest
    from tests import lora_adapters

    prompt = [5, 17, 300, 42, 9, 11, 200, 13] * 3
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    lora = LoRARequest("a", 1, lora_adapters.make_adapter(str(tmp_path / "a"), get_model_config("tiny-llama"),
                                                          rank=8, alpha=16, seed=1, std=0.3))
    llm = LLM("tiny-llama", quantization="fp8", kv_cache_dtype="fp8", enable_lora=True, max_loras=1, max_lora_rank=8,
              kv_cache_memory_bytes=1 << 20, page_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    base = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
    adapted = llm.generate(prompt_token_ids=[prompt], sampling_params=params, lora_request=lora)[0]
    assert adapted.error is None and adapted.outputs[0].token_ids != base
    spec = LLM("tiny-llama", quantization="fp8", kv_cache_dtype="fp8", speculative_method="ngram",
               num_speculative_tokens=3, kv_cache_memory_bytes=1 << 20, page_size=4, max_num_seqs=4,
               max_num_batched_tokens=64)
    assert spec.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids == base


def test_fp8_under_tensor_parallelism_on_8_devices():
    """tensor_parallel_size=8 with quantization="fp8" and an fp8 KV cache (tests/sharding/fp8_tp_worker.py on 8
    virtual CPU devices): the heads padded (4 -> 16 query, 2 -> 8 KV), then every projection quantized per channel
    (padded channels finite zeros), q column- and o row-parallel, and the same greedy tokens and logprobs as one
    device; an FP8 checkpoint under TP is refused by name. The codes' and scales' partition specs (which only
    matter where FP8 stays FP8, not on CPU) are in tests/sharding/test_sharding.py, their bytes per device in
    tests/scripts/test_aot_compile.py."""
    from tests.virtual_devices import run_worker

    runs = run_worker("tests/sharding/fp8_tp_worker.py")["results"]
    one, eight = runs["1"], runs["8"]
    assert one["q_proj_shape"] == [64, 64] and eight["q_proj_shape"] == [64, 256]
    assert eight["on_grid"] and all(eight["on_grid"].values()) and all(one["on_grid"].values())
    specs = eight["specs"]
    assert specs["['layers'][0]['attn']['q_proj']['kernel'].value"] == "P(None, 'model')"
    assert specs["['layers'][0]['attn']['o_proj']['kernel'].value"] == "P('model', None)"
    assert eight["tokens"] == one["tokens"]
    np.testing.assert_allclose(eight["logprobs"], one["logprobs"], atol=1e-4)
    assert "is an FP8 checkpoint; tensor_parallel_size" in runs["checkpoint_error"]
