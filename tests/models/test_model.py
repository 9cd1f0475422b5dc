"""The decoder over the paged cache equals the cache-free forward, for every attention grouping and RoPE variant."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from configs import get_model_config
from kernels_pallas.recurrent.layout import zero_state
from models.attention import AttentionMetadata
from models.config import ModelConfig
from models.decoder import build_decoder, weight_targets
from models.layers import rope_inv_freq
from models.weights import expected_shapes

PAGE = 4


def _config(name: str, **changes) -> ModelConfig:
    return get_model_config(name).replace(**changes)


CONFIGS = {
    "gqa": _config("tiny-llama"),
    "mha": _config("tiny-llama", num_kv_heads=4),
    "mqa": _config("tiny-llama", num_kv_heads=1),
    "llama3_rope_bias": _config("tiny-llama3-rope", attention_bias=True),
    "untied_vs_tied": _config("tiny-llama", tie_word_embeddings=True),
}


def run_paged(model, tokens: np.ndarray, chunks: list[int], pages: list[int]) -> np.ndarray:
    """Feed `tokens` through the paged path in the given chunk sizes; return logits at every position."""
    cfg = model.config
    spec = cfg.kv_cache_spec(max(pages) + 1, PAGE)
    caches = [jnp.zeros(spec.shape, spec.dtype) for _ in range(cfg.num_kv_layers)]
    # A hybrid model's state layers: one RecurrentState each after the KV caches; the sequence owns slot 1.
    caches += [zero_state(cfg.state_cache_spec(i, 2)) for i in cfg.state_layers]
    state_slots = jnp.array([1], jnp.int32) if cfg.has_state_layers else None
    page_indices = np.array([pages], np.int32)
    logits, start = [], 0
    for n in chunks:
        pos = np.arange(start, start + n, dtype=np.int32)
        slots = page_indices[0][pos // PAGE] * PAGE + pos % PAGE
        meta = AttentionMetadata(slot_mapping=jnp.asarray(slots), kv_lens=jnp.array([start + n], jnp.int32),
                                 page_indices=jnp.asarray(page_indices), cu_q_lens=jnp.array([0, n], jnp.int32),
                                 num_seqs=jnp.array([1], jnp.int32), max_q_len=n, state_slots=state_slots)
        hidden, caches = model(jnp.asarray(tokens[start:start + n]), jnp.asarray(pos), caches, meta)
        logits.append(np.asarray(model.logits(hidden)))
        start += n
    return np.concatenate(logits)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_paged_prefill_and_decode_equal_cache_free_forward(name):
    model = build_decoder(CONFIGS[name], seed=1)
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, 23)
    reference = np.asarray(model.forward(jnp.asarray(tokens[None])))[0]
    # Prefill in two chunks (one crossing a page boundary), then decode token by token; pages deliberately shuffled.
    got = run_paged(model, tokens, [7, 6] + [1] * 10, pages=[5, 2, 7, 0, 3, 6])
    np.testing.assert_allclose(got, reference, atol=2e-5, rtol=1e-5)


def test_weight_targets_cover_the_canonical_layout():
    for config in CONFIGS.values():
        model = build_decoder(config)
        targets = weight_targets(model)
        shapes = expected_shapes(config)
        assert set(targets) == set(shapes)
        for name, param in targets.items():
            assert tuple(param.get_value().shape) == shapes[name], name


def test_build_decoder_rejects_mis_shaped_weights():
    config = CONFIGS["gqa"]
    weights = {name: np.zeros(shape, np.float32) for name, shape in expected_shapes(config).items()}
    weights["layers.1.k_proj"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match="layers.1.k_proj"):
        build_decoder(config, weights)
    del weights["layers.1.k_proj"]
    with pytest.raises(ValueError, match="lacks tensor 'layers.1.k_proj'"):
        build_decoder(config, weights)


def test_llama3_rope_scaling_matches_hugging_face_rule():
    """Long wavelengths divided by the factor, short ones kept, the band between interpolated smoothly."""
    scaling = get_model_config("tiny-llama3-rope").rope_scaling
    base = rope_inv_freq(64, 500000.0, None)
    scaled = rope_inv_freq(64, 500000.0, scaling)
    wavelen = 2 * np.pi / base
    low = wavelen > scaling.original_max_position_embeddings / scaling.low_freq_factor
    high = wavelen < scaling.original_max_position_embeddings / scaling.high_freq_factor
    np.testing.assert_allclose(scaled[low], base[low] / scaling.factor, rtol=1e-6)
    np.testing.assert_allclose(scaled[high], base[high], rtol=1e-6)
    mid = ~low & ~high
    assert mid.any() and np.all(scaled[mid] <= base[mid]) and np.all(scaled[mid] >= base[mid] / scaling.factor)


def test_config_rejects_heads_that_do_not_group():
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        _config("tiny-llama", num_heads=6, num_kv_heads=4)
