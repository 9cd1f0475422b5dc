"""Granite-4.0-H (Mamba2 + attention hybrid) through the one decoder: equal to transformers on the committed
random-init fixture (tests/fixtures/families/granitemoehybrid, written by scripts/fixtures/make_family_fixtures.py),
through the cache-free path and through the ragged paged step (two sequences batched, prefill in chunks with their
state in slots, then decode steps); the config translation of real Granite-4.0-H config.json keys."""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import get_model_config
from kernels_pallas.recurrent.layout import zero_state
from models.attention import AttentionMetadata
from models.decoder import build_decoder
from models.loaders.hf_checkpoint import config_from_hf
from models.loaders.hf_names import hf_name
from tests.models.test_families import FIXTURES, HF_ATOL, _forward, _load

FAMILY = "granitemoehybrid"
PAGE = 4
STEP_TOKENS = 24


def _caches(config, num_pages: int, num_slots: int) -> list:
    """The step's cache list: the KV caches, then one zeroed state cache per state layer (`cache_index` order)."""
    spec = config.kv_cache_spec(num_pages, PAGE)
    kv = [jnp.zeros(spec.shape, spec.dtype) for _ in range(config.num_kv_layers)]
    return kv + [zero_state(config.state_cache_spec(i, num_slots)) for i in config.state_layers]


class RaggedSteps:
    """Drives the model's jitted step over a ragged batch of `num_seqs` sequences as the engine would: each step
    padded to STEP_TOKENS tokens plus one padding sequence on slot 0, max_q_len 1 for a decode step (else
    STEP_TOKENS), sequence s's state in slot `slots[s]`, its pages shuffled."""

    def __init__(self, model, num_seqs: int, max_len: int, slots: list[int]):
        self.model, self.slots = model, slots
        graphdef, params = nnx.split(model)

        @jax.jit
        def step(params, ids, positions, caches, meta):
            net = nnx.merge(graphdef, params)
            hidden, caches = net(ids, positions, caches, meta)
            return net.logits(hidden), caches

        self._step = lambda *args: step(params, *args)
        pages_per_seq = -(-max_len // PAGE)
        table = np.arange(num_seqs * pages_per_seq, dtype=np.int32).reshape(num_seqs, pages_per_seq)[::-1]
        self.page_table = np.concatenate([table, np.zeros((1, pages_per_seq), np.int32)])  # + the padding sequence's
        self.caches = _caches(model.config, self.page_table.size, num_slots=max(slots) + 1)
        self.done = [0] * num_seqs

    def step(self, chunks: list[np.ndarray]) -> list[np.ndarray]:
        """Feed sequence s the tokens `chunks[s]` (maybe none); returns each sequence's logits for them."""
        tokens, positions, slot_mapping = [], [], []
        counts = [len(c) for c in chunks]
        for s, chunk in enumerate(chunks):
            pos = np.arange(self.done[s], self.done[s] + len(chunk))
            tokens += list(map(int, chunk))
            positions += pos.tolist()
            slot_mapping += (self.page_table[s][pos // PAGE] * PAGE + pos % PAGE).tolist()
        pad = STEP_TOKENS - len(tokens)
        cu = np.concatenate([[0], np.cumsum(counts), [len(tokens)]]).astype(np.int32)
        kv_lens = np.array([d + n for d, n in zip(self.done, counts)] + [0], np.int32)
        meta = AttentionMetadata(
            slot_mapping=jnp.asarray(slot_mapping + [-1] * pad, jnp.int32), kv_lens=jnp.asarray(kv_lens),
            page_indices=jnp.asarray(self.page_table), cu_q_lens=jnp.asarray(cu),
            num_seqs=jnp.array([len(chunks)], jnp.int32), max_q_len=1 if max(counts) == 1 else STEP_TOKENS,
            state_slots=jnp.array(self.slots + [0], jnp.int32))
        logits, self.caches = self._step(jnp.asarray(tokens + [0] * pad, jnp.int32),
                                         jnp.asarray(positions + [0] * pad, jnp.int32), self.caches, meta)
        logits = np.asarray(logits)
        self.done = [d + n for d, n in zip(self.done, counts)]
        return [logits[cu[s]:cu[s + 1]] for s in range(len(chunks))]


def run_ragged(model, seqs: list[np.ndarray], schedule: list[list[int]], slots: list[int]) -> list[np.ndarray]:
    """Feed the sequences together, step k giving sequence s `schedule[k][s]` more tokens (0: none); returns each
    sequence's logits at every position."""
    steps = RaggedSteps(model, len(seqs), max(map(len, seqs)), slots)
    out: list[list[np.ndarray]] = [[] for _ in seqs]
    for counts in schedule:
        chunks = [seq[d:d + n] for seq, d, n in zip(seqs, steps.done, counts)]
        for s, logits in enumerate(steps.step(chunks)):
            out[s].append(logits)
    return [np.concatenate(parts) for parts in out]


def test_fixture_equals_transformers_through_the_cache_free_path():
    config, weights, ids, expected = _load(FAMILY)
    model = build_decoder(config, weights)
    np.testing.assert_allclose(_forward(model, ids), expected, atol=HF_ATOL, rtol=0)


def test_ragged_paged_steps_equal_transformers():
    """The fixture's sequence beside another one: prefill in chunks (the chunked SSD; a chunk of 7 does not divide
    the mixer's chunk size 8, a step holds one sequence's tokens and not the other's), then decode steps (the
    recurrent SSD, max_q_len 1), each sequence's state in its own slot. The fixture's sequence equals transformers'
    logits; the other equals the cache-free forward."""
    config, weights, ids, expected = _load(FAMILY)
    model = build_decoder(config, weights)
    other = np.random.default_rng(5).integers(3, config.vocab_size, 21).astype(np.int32)
    schedule = [[7, 9], [13, 0], [12, 8], [0, 1], [1, 1], [1, 1], [5, 1], [1, 0]]
    assert [sum(c[s] for c in schedule) for s in (0, 1)] == [40, 21]
    got, got_other = run_ragged(model, [ids[0], other], schedule, slots=[3, 1])
    np.testing.assert_allclose(got, expected, atol=HF_ATOL, rtol=0)
    np.testing.assert_allclose(got_other, _forward(model, other[None]), atol=2e-5, rtol=1e-5)


def test_greedy_decode_through_slots_is_transformers_greedy():
    """Prompt of 20 in two chunks beside another sequence, then 32 greedy decode steps (recurrent SSD, conv and SSD
    states carried in the slots): transformers' greedy continuation, token for token."""
    config, weights, ids, _ = _load(FAMILY)
    want = np.load(FIXTURES / FAMILY / "reference.npz")["greedy_ids"]
    steps = RaggedSteps(build_decoder(config, weights), 2, 20 + len(want), slots=[2, 1])
    other = np.random.default_rng(9).integers(3, config.vocab_size, 20 + len(want))
    steps.step([ids[0, :8], other[:11]])
    last = steps.step([ids[0, 8:20], other[11:20]])[0][-1]
    got = []
    for k in range(len(want)):
        got.append(int(np.argmax(last)))
        last = steps.step([np.array([got[-1]]), other[20 + k:21 + k]])[0][-1]
    assert got == want.tolist()


def test_batch_invariant_mode_gives_the_same_bits_for_any_split():
    """make_batch_invariant: the SSD's invariant form on every step, so a prompt fed whole, in chunks, or beside
    another sequence gives bitwise-identical logits (the prefix-caching and chunked-prefill tests rely on it)."""
    from models.batch_invariant import make_batch_invariant

    model = make_batch_invariant(build_decoder(get_model_config("tiny-granite-hybrid"), seed=3))
    assert all(model.layers[i].attn.mode(SimpleNamespace(max_q_len=16)) == "invariant" for i in (0, 1, 3))
    rng = np.random.default_rng(4)
    prompt, other = rng.integers(0, model.config.vocab_size, 13), rng.integers(0, model.config.vocab_size, 13)
    (whole,) = run_ragged(model, [prompt], [[13]], slots=[1])
    (split,) = run_ragged(model, [prompt], [[5], [1], [7]], slots=[2])
    (decoded,) = run_ragged(model, [prompt], [[1]] * 13, slots=[2])  # off by ~1e-7 without batch invariance
    beside, _ = run_ragged(model, [prompt, other], [[4, 9], [9, 4]], slots=[1, 2])
    for got in (split, decoded, beside):
        np.testing.assert_array_equal(got, whole)


def test_config_translation_of_granite_keys():
    config = _load(FAMILY)[0]
    assert config.layer_types == ("mamba", "mamba", "full_attention", "mamba") and not config.use_rope
    assert config.state_layers == (0, 1, 3) and [config.cache_index(i) for i in range(4)] == [1, 2, 0, 3]
    assert (config.mamba_num_heads, config.mamba_head_dim, config.mamba_n_groups, config.ssm_state_size) == (4, 16, 2, 8)
    assert config.mamba_conv_dim == 64 + 2 * 2 * 8 and config.intermediate_size == 48  # shared_intermediate_size
    assert math.isclose(config.attn_scale, 0.2) and config.embed_scale == 1.5 and config.tie_word_embeddings
    assert (config.residual_multiplier, config.logits_scaling, config.mamba_time_step_limit) == (0.5, 2.5,
                                                                                               (0.0, math.inf))
    spec = config.state_cache_spec(0, num_slots=3, dtype="bfloat16")
    assert spec.conv.shape == (3, 96, 3) and spec.conv.dtype == jnp.bfloat16 and spec.ssm.shape == (3, 4, 16, 8)
    assert config.state_bytes_per_sequence("bfloat16") == 3 * (96 * 3 * 2 + 4 * 16 * 8 * 4)
    raw = {"model_type": FAMILY, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 3,
           "num_attention_heads": 4, "vocab_size": 256, "num_local_experts": 0, "mamba_n_heads": 8}
    legacy = config_from_hf({**raw, "layer_types": ["mamba", "attention", "mamba"], "position_embedding_type": "rope"})
    assert legacy.layer_types == ("mamba", "full_attention", "mamba") and legacy.use_rope
    assert legacy.mamba_head_dim == 2 * 64 // 8  # "auto": expand * hidden / heads
    assert config_from_hf(raw).layer_types == ("mamba",) * 3  # transformers' default: every layer Mamba2
    with pytest.raises(ValueError, match="num_local_experts > 0"):
        config_from_hf({**raw, "num_local_experts": 8})
    with pytest.raises(ValueError, match="unknown granitemoehybrid layer type 'moe'"):
        config_from_hf({**raw, "layer_types": ["moe"] * 3})
    with pytest.raises(ValueError, match="mamba_num_heads=4 is not a multiple of mamba_n_groups=3"):
        config.replace(mamba_n_groups=3)
    with pytest.raises(ValueError, match="ssm_state_size must be positive for mamba"):
        config.replace(ssm_state_size=0)
    assert hf_name("layers.1.gate_proj", FAMILY) == "model.layers.1.shared_mlp.input_linear.weight"
    assert hf_name("layers.0.conv1d", FAMILY) == "model.layers.0.mamba.conv1d.weight"


def test_presets_build_and_the_real_size_one_is_granite_4_0_h_micro():
    tiny = build_decoder(get_model_config("tiny-granite-hybrid"), seed=1)
    tokens = np.random.default_rng(2).integers(0, tiny.config.vocab_size, 11).astype(np.int32)
    (got,) = run_ragged(tiny, [tokens], [[6], [1], [4]], slots=[1])
    np.testing.assert_allclose(got, _forward(tiny, tokens[None]), atol=2e-5, rtol=1e-5)
    micro = get_model_config("granite-4.0-h-micro")
    assert micro.state_layers == tuple(i for i in range(40) if i not in (5, 15, 25, 35))
    assert micro.num_kv_layers == 4 and micro.mamba_intermediate_size == 2 * micro.hidden_size
    # Per sequence: 36 Mamba2 layers' conv (bf16) + SSD (f32) states, against 4 attention layers' KV per token.
    assert micro.state_bytes_per_sequence("bfloat16") == 36 * (micro.mamba_conv_dim * 3 * 2 + 64 * 64 * 128 * 4)
    assert micro.kv_bytes_per_token(2) == 4 * 2 * 8 * 64 * 2


@pytest.mark.reference
def test_live_transformers_equals_pagejax_and_fixture(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from models.loaders.hf_checkpoint import load_hf_folder
    from scripts.fixtures import make_family_fixtures

    ids, expected, greedy = make_family_fixtures.build_family(FAMILY, str(tmp_path))
    config, weights = load_hf_folder(tmp_path)
    np.testing.assert_allclose(_forward(build_decoder(config, weights), ids), expected, atol=HF_ATOL, rtol=0)
    np.testing.assert_allclose(expected, _load(FAMILY)[3], atol=1e-5, rtol=0)  # the committed fixture is current
    np.testing.assert_array_equal(greedy, np.load(FIXTURES / FAMILY / "reference.npz")["greedy_ids"])

