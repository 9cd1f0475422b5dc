"""MLA (latent cache, absorbed attention), DeepSeek-V2's mixture of experts, and cross-layer attention (CLA).

Equality with transformers for DeepSeek-V2 lives in tests/models/test_families.py (fixture `deepseek_v2`); here: cache
bytes, absorbed == materialized attention for both query forms, the router and expert dispatch against a direct
NumPy computation, and CLA's exactness and cache saving, through the model and through the engine.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from configs import get_model_config
from models.config import ModelConfig
from models.decoder import build_decoder, weight_targets
from models.moe import MoE
from models.weights import expected_shapes
from tests.llm_configs import SMALL_POOL
from tests.models.test_model import run_paged

DSV2 = get_model_config("tiny-deepseek-v2")


def _forward(model, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(model.forward(jnp.asarray(tokens[None])))[0]


# ------------------------------------------------------------------------------------------------------- MLA

def test_mla_caches_the_latent_and_rope_key_only():
    lite = get_model_config("deepseek-v2-lite")
    assert lite.kv_cache_spec(10, 16).shape == (10, 16, 576)
    assert lite.kv_bytes_per_token(2) == 576 * 27 * 2  # bf16: 31,104 B/token against 2·16·(128+64)·2·27 for MHA
    assert DSV2.kv_cache_spec(3, 4).shape == (3, 4, 32 + 8)


def test_absorbed_paged_attention_equals_materialized_keys_and_values():
    """The paged path folds kv_b_proj into the query and the output; the cache-free path expands per-head K/V as
    transformers does. Two prefill chunks, then decode, pages out of order. The query low-rank form is covered by
    the deepseek_v2 fixture in tests/models/test_families.py; this is the full-rank q_proj of DeepSeek-V2-Lite."""
    model = build_decoder(DSV2.replace(q_lora_rank=None), seed=3)
    assert "layers.0.q_proj" in expected_shapes(model.config) and "layers.0.q_a_proj" not in expected_shapes(
        model.config)
    tokens = np.random.default_rng(0).integers(0, DSV2.vocab_size, 21)
    got = run_paged(model, tokens, [7, 6] + [1] * 8, pages=[4, 1, 5, 0, 2, 3])
    np.testing.assert_allclose(got, _forward(model, tokens), atol=2e-5, rtol=1e-5)


def test_engine_runs_mla_with_a_latent_cache_of_576_style_width():
    from inference import SamplingParams

    llm = SMALL_POOL.replace("tiny-deepseek-v2").build()
    runner = llm.engine.runner
    assert len(runner.kv_caches) == DSV2.num_layers
    assert all(c.shape[1:] == (4, DSV2.kv_lora_rank + DSV2.qk_rope_head_dim) for c in runner.kv_caches)
    assert runner.kv_cache_bytes == runner.num_pages * 4 * DSV2.kv_bytes_per_token(4)
    prompts = [list(range(5, 17)), list(range(40, 45))]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0.0, max_tokens=10,
                                                                                  ignore_eos=True))
    model = build_decoder(DSV2)  # LLM's random init uses seed 0, as build_decoder does
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        argmax = _forward(model, np.array(prompt + tokens)).argmax(-1)
        assert tokens == argmax[len(prompt) - 1:-1].tolist()
    # n=2 forks the request after its prefill: the two samples share the prompt's partial last page until the first
    # decode writes it, which copies the page (copy-on-write). Greedy, both must be the single sample's tokens; a
    # latent cache's pages lead its shape, so a copy along the per-head cache's page axis would corrupt one of them.
    prompt = list(range(5, 11))  # 6 tokens on 4-token pages: the second page is partial
    greedy = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    [single] = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**greedy))
    [forked] = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(n=2, **greedy))
    assert [o.token_ids for o in forked.outputs] == [single.outputs[0].token_ids] * 2


# ------------------------------------------------------------------------------------------------------- MoE

def _moe_numpy(moe: MoE, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """DeepseekV2Moe written out token by token."""
    router = np.asarray(moe.router[...], np.float64)
    gate, up, down = (np.asarray(p[...], np.float64) for p in (moe.gate_proj, moe.up_proj, moe.down_proj))
    out = np.zeros_like(x, np.float64)
    for t, row in enumerate(x.astype(np.float64)):
        logits = row @ router
        scores = np.exp(logits - logits.max())
        scores /= scores.sum()
        if cfg.topk_method == "group_limited_greedy":
            groups = scores.reshape(cfg.n_group, -1)
            keep = np.argsort(-groups.max(-1))[:cfg.topk_group]
            mask = np.zeros(cfg.n_group, bool)
            mask[keep] = True
            scores = np.where(mask[:, None], groups, 0.0).reshape(-1)
        for e in np.argsort(-scores)[:cfg.num_experts_per_tok]:
            g = row @ gate[e]
            hidden = g / (1 + np.exp(-g)) * (row @ up[e])
            out[t] += cfg.routed_scaling_factor * scores[e] * (hidden @ down[e])
    if moe.shared is not None:
        out += np.asarray(moe.shared(jnp.asarray(x)), np.float64)
    return out


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_moe_routing_and_dispatch_equal_a_direct_computation(topk_method):
    from flax import nnx

    cfg = DSV2.replace(topk_method=topk_method, num_experts_per_tok=3)
    moe = MoE(cfg, rngs=nnx.Rngs(5))
    moe.router.set_value(moe.router[...] * 40)  # sharp, uneven routing so the group limit matters
    x = np.random.default_rng(1).standard_normal((37, cfg.hidden_size)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(moe(jnp.asarray(x))), _moe_numpy(moe, x, cfg), atol=2e-6, rtol=1e-4)
    if topk_method == "group_limited_greedy":  # the limit changed some token's experts
        greedy = MoE(cfg.replace(topk_method="greedy"), rngs=nnx.Rngs(5))
        greedy.router.set_value(moe.router[...])
        assert not np.array_equal(np.asarray(moe.route(jnp.asarray(x))[1]),
                                  np.asarray(greedy.route(jnp.asarray(x))[1]))


def test_moe_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="n_group"):
        DSV2.replace(n_group=3)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        DSV2.replace(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="cla_factor"):
        DSV2.replace(cla_factor=2)


# ------------------------------------------------------------------------------------------------------- CLA

CLA = get_model_config("tiny-cla")


def test_cla_factor_one_is_the_plain_model():
    plain = CLA.replace(cla_factor=1)
    assert plain == ModelConfig(**{**plain.__dict__})  # the default
    model = build_decoder(plain, seed=4)
    assert {n for n in expected_shapes(plain) if n.endswith("k_proj")} == {f"layers.{i}.k_proj" for i in range(4)}
    tokens = np.random.default_rng(2).integers(0, CLA.vocab_size, 15)
    np.testing.assert_allclose(run_paged(model, tokens, [6] + [1] * 9, pages=[2, 0, 3, 1]), _forward(model, tokens),
                               atol=2e-5, rtol=1e-5)


def test_cla_shares_one_cache_per_run_and_stays_exact():
    model = build_decoder(CLA, seed=4)
    shapes = expected_shapes(CLA)
    assert [f"layers.{i}.k_proj" in shapes for i in range(4)] == [True, False, True, False]
    assert set(weight_targets(model)) == set(shapes)
    assert CLA.num_kv_layers == 2 and CLA.kv_bytes_per_token(4) == CLA.replace(cla_factor=1).kv_bytes_per_token(4) / 2
    tokens = np.random.default_rng(2).integers(0, CLA.vocab_size, 15)
    np.testing.assert_allclose(run_paged(model, tokens, [6] + [1] * 9, pages=[2, 0, 3, 1]), _forward(model, tokens),
                               atol=2e-5, rtol=1e-5)
    # Sharing is real: the later layer of a run reads its owner's keys, so changing the owner's k_proj moves it.
    changed = build_decoder(CLA, seed=4)
    changed.layers[2].attn.k_proj.kernel.set_value(changed.layers[2].attn.k_proj.kernel[...] * 3)
    assert np.abs(_forward(changed, tokens) - _forward(model, tokens)).max() > 1e-3


def test_engine_cache_bytes_drop_by_the_sharing_factor():
    from inference import SamplingParams

    llm = SMALL_POOL.replace("tiny-cla").build(max_num_seqs=2)
    assert len(llm.engine.runner.kv_caches) == 2
    # The byte budget holds twice the pages (so twice the tokens) it would hold without sharing.
    unshared_pages = (1 << 18) // (4 * CLA.replace(cla_factor=1).kv_bytes_per_token(4))
    assert llm.engine.runner.num_pages == 2 * unshared_pages
    prompt = list(range(3, 14))
    tokens = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    argmax = _forward(build_decoder(CLA), np.array(prompt + tokens)).argmax(-1)
    assert tokens == argmax[len(prompt) - 1:-1].tolist()


# DeepSeek-V2-Lite's config.json as published (trimmed of training-only keys): loads into the preset's config.
_V2_LITE_JSON = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "bos_token_id": 100000,
    "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                            "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400}


def test_deepseek_v2_lite_config_json_loads_as_the_preset():
    from models.loaders.hf_checkpoint import config_from_hf

    ours = config_from_hf(_V2_LITE_JSON, name="deepseek-v2-lite")
    assert ours == get_model_config("deepseek-v2-lite").replace(name="deepseek-v2-lite")
    # YaRN x40 with mscale = mscale_all_dim: cos/sin unscaled, scores scaled by mscale(40, 0.707)^2 / sqrt(192).
    assert ours.rope_scaling.rope_attention_factor == 1.0
    assert ours.attn_scale == pytest.approx((0.1 * 0.707 * np.log(40) + 1) ** 2 / 192 ** 0.5)
