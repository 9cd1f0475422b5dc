"""Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, DeepSeek-V2 (MLA + MoE) and Qwen3-Next (Gated DeltaNet + gated
attention + MoE) through the one decoder: equal to transformers, paged == cache-free.

The default tests read tiny committed models (tests/fixtures/families/<family>/: config.json, bf16 safetensors and
transformers' float32 logits, written by scripts/fixtures/make_family_fixtures.py) and need no transformers. Tests marked
`reference` rebuild the models with transformers and compare live.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import get_model_config
from models.attention import AttentionMetadata
from models.config import RopeScaling
from models.decoder import build_decoder, weight_targets
from models.loaders.hf_checkpoint import config_from_hf, load_hf_folder
from models.weights import expected_shapes
from tests.llm_configs import SMALL_POOL
from tests.models.test_model import run_paged

FIXTURES = Path(__file__).parent.parent / "fixtures" / "families"
FAMILIES = ("mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "deepseek_v2", "qwen3_next")
# The families the engine serves end to end: these, and Granite-4.0-H (Mamba2; tests/models/test_granite_hybrid.py
# checks its logits).
ENGINE_FAMILIES = (*FAMILIES, "granitemoehybrid")
HF_ATOL = 1e-4  # pagejax vs transformers, float32
PAGED_ATOL = 2e-5  # paged vs cache-free, as in tests/models/test_model.py


@functools.lru_cache(maxsize=None)
def _load(family: str):
    config, weights = load_hf_folder(FIXTURES / family)
    ref = np.load(FIXTURES / family / "reference.npz")
    return config, weights, ref["input_ids"], ref["logits"]


@functools.lru_cache(maxsize=None)
def _model(family: str):
    config, weights, _, _ = _load(family)
    return build_decoder(config, weights)


def _forward(model, ids: np.ndarray) -> np.ndarray:
    return np.asarray(model.forward(jnp.asarray(ids)))[0]


# ------------------------------------------------------------------------------------------- config translation

def test_fixture_configs_translate_to_the_family_fields():
    windows = {f: [_load(f)[0].layer_window(i) for i in range(_load(f)[0].num_layers)] for f in FAMILIES}
    assert windows == {"mistral": [8, 8], "qwen2": [None, 8], "qwen3": [None, None], "gemma2": [8, None],
                       "gemma3_text": [8, 8, None], "deepseek_v2": [None] * 3, "qwen3_next": [None] * 4}
    mistral, qwen2, qwen3, gemma2, gemma3, deepseek, qwen3_next = (_load(f)[0] for f in FAMILIES)
    assert qwen3_next.state_layers == (0, 1, 2) and qwen3_next.attention_layers == (3,)
    assert (qwen3_next.linear_num_key_heads, qwen3_next.linear_num_value_heads, qwen3_next.linear_key_head_dim,
            qwen3_next.linear_value_head_dim, qwen3_next.linear_conv_kernel_dim) == (2, 4, 16, 8, 4)
    assert qwen3_next.attn_output_gate and qwen3_next.qk_norm and qwen3_next.norm_style == "gemma"
    assert qwen3_next.rotary_dim == 4 and qwen3_next.norm_topk_prob and qwen3_next.shared_expert_gate
    assert (qwen3_next.num_experts, qwen3_next.num_experts_per_tok, qwen3_next.shared_expert_width) == (4, 2, 24)
    assert deepseek.is_mla and (deepseek.q_lora_rank, deepseek.kv_lora_rank, deepseek.qk_rope_head_dim) == (24, 32, 8)
    assert [deepseek.is_moe(i) for i in range(3)] == [False, True, True] and deepseek.rope_interleaved
    assert (deepseek.num_experts, deepseek.num_experts_per_tok, deepseek.n_group, deepseek.topk_group) == (8, 3, 4, 2)
    assert deepseek.kv_bytes_per_token(2) == 3 * (32 + 8) * 2  # latent + RoPE key per layer, nothing per head
    assert mistral.layer_types is None and not mistral.attention_bias and mistral.norm_style == "rms"
    assert qwen2.attention_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.sliding_window is None
    assert (gemma2.norm_style, gemma2.post_norms, gemma2.qk_norm, gemma2.hidden_act) == ("gemma", True, False,
                                                                                          "gelu_tanh")
    assert (gemma2.embed_scale, gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (8.0, 2.0, 3.0)
    assert gemma2.attn_scale == 24 ** -0.5 and gemma2.tie_word_embeddings
    assert gemma3.qk_norm and gemma3.post_norms and gemma3.attn_logit_softcap is None
    assert gemma3.final_logit_softcap is None and gemma3.rope_local_theta == 10_000.0
    assert [gemma3.layer_rope(i) for i in range(3)] == [(10_000.0, None), (10_000.0, None),
                                                        (1_000_000.0, RopeScaling(kind="linear", factor=4.0,
                                                                                  original_max_position_embeddings=128))]
    for config in (mistral, qwen2, qwen3):
        assert config.attn_scale == 16 ** -0.5 and config.embed_scale is None


def _hf(model_type: str, **extra) -> dict:
    cfg = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 12,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "head_dim": 16}
    cfg.update(extra)
    return cfg


def _kinds(config) -> str:
    return "".join("S" if config.is_sliding(i) else "F" for i in range(config.num_layers))


def test_hf_defaults_follow_transformers_config_classes():
    # Qwen2/Qwen3: no window unless use_sliding_window; then layers at index >= max_window_layers slide.
    assert config_from_hf(_hf("qwen2", sliding_window=8, max_window_layers=2)).sliding_window is None
    qwen = config_from_hf(_hf("qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=10))
    assert _kinds(qwen) == "F" * 10 + "SS" and qwen.sliding_window == 8
    assert _kinds(config_from_hf(_hf("qwen2", use_sliding_window=True, sliding_window=8))) == "F" * 12  # 28 default
    # Mistral: the window (default 4096) on every layer; explicit null disables it.
    assert _kinds(config_from_hf(_hf("mistral", sliding_window=8))) == "S" * 12
    assert config_from_hf(_hf("mistral")).sliding_window == 4096
    assert config_from_hf(_hf("mistral", sliding_window=None)).sliding_window is None
    # Gemma 2: sliding first, then alternating; soft caps default to 50 / 30 and null turns them off.
    gemma2 = config_from_hf(_hf("gemma2"))
    assert _kinds(gemma2) == "SF" * 6 and gemma2.sliding_window == 4096 and gemma2.tie_word_embeddings
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.attn_scale) == (50.0, 30.0, 256 ** -0.5)
    off = config_from_hf(_hf("gemma2", attn_logit_softcapping=None, final_logit_softcapping=None))
    assert off.attn_logit_softcap is None and off.final_logit_softcap is None
    # Gemma 3, pre-v5 config.json: every 6th layer global, rope_theta / rope_scaling global, local base separate.
    old = config_from_hf(_hf("gemma3_text", rope_theta=1e6, rope_local_base_freq=1e4,
                             rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert _kinds(old) == "SSSSSF" * 2 and old.final_logit_softcap is None and old.attn_logit_softcap is None
    assert old.layer_rope(0) == (1e4, None) and old.layer_rope(5)[0] == 1e6
    assert old.layer_rope(5)[1].kind == "linear" and old.layer_rope(5)[1].factor == 8.0
    bare = config_from_hf(_hf("gemma3_text", sliding_window_pattern=4))
    assert _kinds(bare) == "SSSF" * 3 and bare.rope_theta == 1e6 and bare.rope_local_theta == 1e4
    assert config_from_hf(_hf("gemma3_text", head_dim=None)).head_dim == 256
    with pytest.raises(ValueError, match="o_proj"):
        config_from_hf(_hf("qwen3", attention_bias=True))
    with pytest.raises(ValueError, match="layer_types has 2 entries"):
        config_from_hf(_hf("gemma2", layer_types=["sliding_attention", "full_attention"]))


def test_llama_defaults_are_unchanged():
    config = get_model_config("tiny-llama")
    assert config.sliding_window is None and [config.layer_rope(i) for i in range(2)] == [(10000.0, None)] * 2
    assert config.attn_scale == 16 ** -0.5 and config.norm_style == "rms" and not config.post_norms
    assert set(expected_shapes(config)) == set(expected_shapes(config.replace(family="mistral")))


# ------------------------------------------------------------------------------------------- numerics

@pytest.mark.parametrize("family", FAMILIES)
def test_cache_free_forward_equals_transformers(family):
    _, _, ids, expected = _load(family)
    np.testing.assert_allclose(_forward(_model(family), ids), expected, atol=HF_ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_prefill_and_decode_equal_cache_free_forward(family):
    model = _model(family)
    ids = _load(family)[2][0]
    reference = _forward(model, ids[None])
    # Two prefill chunks (the second starts past the window of 8), then decode; pages deliberately out of order.
    pages = [int(p) for p in np.random.default_rng(3).permutation(12)[:10]]
    got = run_paged(model, ids, [13, 9] + [1] * (len(ids) - 22), pages=pages)
    np.testing.assert_allclose(got, reference, atol=PAGED_ATOL, rtol=1e-5)


@pytest.mark.parametrize("family, change", [
    ("mistral", dict(sliding_window=None)),
    ("qwen2", dict(layer_types=None)),  # every layer windowed instead of layer 1 only
    ("gemma2", dict(attn_logit_softcap=None)),
    ("gemma2", dict(final_logit_softcap=None)),
    ("gemma2", dict(query_pre_attn_scalar=None)),
    ("gemma3_text", dict(rope_local_theta=None)),
    ("gemma3_text", dict(embed_scale=None)),
    ("deepseek_v2", dict(rope_interleaved=False)),
    ("deepseek_v2", dict(rope_scaling=None)),
    ("deepseek_v2", dict(topk_method="greedy")),
    ("deepseek_v2", dict(routed_scaling_factor=1.0)),
    ("qwen3_next", dict(partial_rotary_factor=0.5)),
    ("qwen3_next", dict(norm_topk_prob=False)),
])
def test_fixtures_are_sensitive_to_each_family_detail(family, change):
    """Dropping any one detail moves the logits far beyond the tolerance, so the equality tests above see it."""
    config, weights, ids, expected = _load(family)
    got = _forward(build_decoder(config.replace(**change), weights), ids)
    assert np.abs(got - expected).max() > 100 * HF_ATOL


def test_weight_targets_cover_the_family_layouts():
    for family in FAMILIES:
        config = _load(family)[0]
        targets, shapes = weight_targets(_model(family)), expected_shapes(config)
        assert set(targets) == set(shapes), family
        for name, param in targets.items():
            assert tuple(param.get_value().shape) == shapes[name], name
    gemma3 = set(expected_shapes(_load("gemma3_text")[0]))
    assert {"layers.0.q_norm", "layers.0.k_norm", "layers.0.post_attn_norm", "layers.0.post_mlp_norm"} <= gemma3


def test_tiny_family_presets_build_and_page():
    for name in ("tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3"):
        model = build_decoder(get_model_config(name), seed=2)
        assert set(weight_targets(model)) == set(expected_shapes(model.config)), name
    # The one preset with every variant at once (QK-norm, Gemma norms, local/global RoPE, window) also pages.
    tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, 14)
    got = run_paged(model, tokens, [9] + [1] * 5, pages=[3, 0, 2, 1])
    np.testing.assert_allclose(got, _forward(model, tokens[None]), atol=PAGED_ATOL, rtol=1e-5)


# ------------------------------------------------------------------------------------------- live (transformers)

@pytest.fixture(scope="module")
def fixture_script():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from scripts.fixtures import make_family_fixtures

    return make_family_fixtures


@pytest.mark.reference
@pytest.mark.parametrize("family", FAMILIES)
def test_live_transformers_equals_pagejax_and_fixture(family, fixture_script, tmp_path):
    ids, expected, greedy = fixture_script.build_family(family, str(tmp_path))
    config, weights = load_hf_folder(tmp_path)
    model = build_decoder(config, weights)
    np.testing.assert_allclose(_forward(model, ids), expected, atol=HF_ATOL, rtol=0)
    np.testing.assert_array_equal(ids, _load(family)[2])
    np.testing.assert_allclose(expected, _load(family)[3], atol=1e-5, rtol=0)  # the committed fixture is current
    np.testing.assert_array_equal(greedy, np.load(FIXTURES / family / "reference.npz")["greedy_ids"])


@pytest.mark.reference
@pytest.mark.parametrize("model_type, extra", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=5)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8)),
    ("mistral", dict(sliding_window=8)),
    ("gemma2", dict(sliding_window=8)),
    ("gemma3_text", dict(sliding_window=8)),
    ("gemma3_text", dict(sliding_window=8, sliding_window_pattern=4)),
])
def test_layer_kinds_match_transformers_config_classes(model_type, extra, fixture_script):
    import transformers

    raw = _hf(model_type, **extra)
    theirs = transformers.AutoConfig.for_model(**raw)
    ours = config_from_hf(raw)
    kinds = getattr(theirs, "layer_types", None) or ["sliding_attention"] * 12  # Mistral: the window on every layer
    window = theirs.sliding_window
    assert [ours.layer_window(i) for i in range(12)] == [window if k == "sliding_attention" and window else None
                                                         for k in kinds]


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_llm_loads_a_folder_without_tokenizer_and_generates_through_the_engine(family):
    """LLM(model=folder) on a freshly saved model (no tokenizer files): token ids work, text is a clear error, and
    the paged engine's 32-token greedy continuation (to 52 tokens, several windows long) is transformers'."""
    from inference import SamplingParams

    llm = SMALL_POOL.replace(str(FIXTURES / family)).build(kv_cache_memory_bytes=1 << 20)
    _, _, ids, _ = _load(family)
    prompt = ids[0, :20].tolist()
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=32, ignore_eos=True))[0].outputs[0].token_ids
    assert out == np.load(FIXTURES / family / "reference.npz")["greedy_ids"].tolist()
    assert "no tokenizer" in llm.generate(["hello"])[0].error


# ------------------------------------------------------------------------------------------- state layers (Qwen3-Next)

def run_ragged(model, seqs: list[np.ndarray], schedule: list[list[int]], page_size: int = 4) -> list[np.ndarray]:
    """Several sequences through the jitted ragged paged step together, as the runner batches them
    (inference/runtime/batch.py): step k feeds schedule[k][s] more tokens of sequence s (0: not in this step), padded
    to a prefill or a decode bucket (tokens, 4 sequence rows, max_q_len) with the padding tokens on a padded sequence
    in the null slot 0. Sequence s owns state slot s + 1, whose initial contents are garbage (a fresh sequence must not
    read them). Returns each sequence's logits at every position."""
    cfg = model.config
    pages_per_seq = -(-max(map(len, seqs)) // page_size)
    spec = cfg.kv_cache_spec(len(seqs) * pages_per_seq, page_size)
    rng = np.random.default_rng(0)
    caches = [jnp.zeros(spec.shape, spec.dtype) for _ in range(cfg.num_kv_layers)]
    caches += [jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype),
                            cfg.state_cache_spec(i, len(seqs) + 1)) for i in cfg.state_layers]
    tables = rng.permutation(len(seqs) * pages_per_seq).reshape(len(seqs), pages_per_seq).astype(np.int32)
    step = nnx.jit(lambda m, *args: m(*args))
    done, logits, rows_bucket = [0] * len(seqs), [[] for _ in seqs], 4
    for counts in schedule:
        num_tokens, max_q = (32, 20) if max(counts) > 1 else (8, 1)
        rows = [s for s, n in enumerate(counts) if n]
        tokens, positions, slot_mapping, cu = [], [], [], [0]
        for s in rows:
            pos = np.arange(done[s], done[s] + counts[s])
            tokens += list(seqs[s][pos])
            positions += list(pos)
            slot_mapping += list(tables[s][pos // page_size] * page_size + pos % page_size)
            cu.append(cu[-1] + counts[s])
        pad = num_tokens - len(tokens)
        tokens, positions, slot_mapping = tokens + [0] * pad, positions + [0] * pad, slot_mapping + [-1] * pad
        cu += [num_tokens] * (rows_bucket - len(rows))
        kv_lens = [done[s] + counts[s] for s in rows] + [0] * (rows_bucket - len(rows))
        table = np.zeros((rows_bucket, pages_per_seq), np.int32)
        table[:len(rows)] = tables[rows]
        meta = AttentionMetadata(
            slot_mapping=jnp.asarray(slot_mapping, jnp.int32), kv_lens=jnp.asarray(kv_lens, jnp.int32),
            page_indices=jnp.asarray(table), cu_q_lens=jnp.asarray(cu, jnp.int32),
            num_seqs=jnp.array([len(rows)], jnp.int32), max_q_len=max_q,
            state_slots=jnp.asarray([s + 1 for s in rows] + [0] * (rows_bucket - len(rows)), jnp.int32))
        hidden, caches = step(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), caches, meta)
        out = np.asarray(model.logits(hidden))
        for i, s in enumerate(rows):
            logits[s].append(out[cu[i]:cu[i + 1]])
            done[s] += counts[s]
    return [np.concatenate(x) for x in logits]


def test_qwen3_next_ragged_batch_carries_state_in_slots():
    """Two sequences share each step: prefill in chunks of different sizes (the chunked form, which restarts its
    blocks at each sequence and carries state across steps in the slots), then decode steps together (the
    recurrent form), each sequence against its own cache-free forward."""
    model = _model("qwen3_next")
    ids = _load("qwen3_next")[2][0]
    seqs = [ids, ids[::-1][:30]]
    schedule = [[13, 0], [9, 7], [5, 20]] + [[1, 1]] * 3 + [[1, 0]] * 10
    got = run_ragged(model, seqs, schedule)
    for s, seq in enumerate(seqs):
        n = len(got[s])
        np.testing.assert_allclose(got[s], _forward(model, seq[None, :n]), atol=PAGED_ATOL, rtol=1e-5)


def test_qwen3_next_config_keys_follow_transformers_defaults():
    ours = config_from_hf(_hf("qwen3_next", num_hidden_layers=8, num_experts=16))
    assert ours.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)
    assert (ours.linear_num_key_heads, ours.linear_num_value_heads, ours.linear_key_head_dim) == (16, 32, 128)
    assert ours.partial_rotary_factor == 0.25 and ours.num_experts_per_tok == 10 and ours.norm_topk_prob
    assert config_from_hf(_hf("qwen3_next", num_experts=0)).num_experts == 0
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        config_from_hf(_hf("qwen3_next", num_experts=4, decoder_sparse_step=2))
    real = get_model_config("qwen3-next-80b-a3b")
    assert real.num_kv_layers == 12 and len(real.state_layers) == 36
    # The state is constant in context length: 36 layers of [32, 128, 128] float32 plus a bf16 conv window.
    assert real.state_bytes_per_sequence("bfloat16") == 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
