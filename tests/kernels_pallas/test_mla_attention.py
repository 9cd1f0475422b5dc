"""Ragged paged MLA over a latent cache: the reference against a numpy loop and against the GQA reference (MLA is
MQA with key [c | k_rope] and value c), the Pallas Triton kernel in interpret mode, write_latent, the lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.backend import compiling_for
from kernels_pallas.mla.gpu import ragged_paged_mla_attention_gpu
from kernels_pallas.kv_cache.writes import write_latent
from kernels_pallas.mla.dispatch import ragged_paged_mla_attention
from kernels_pallas.kv_cache.latent_layout import latent_cache_shape, latent_page_size
from configs import get_model_config
from kernels_pallas.attention.reference import ragged_paged_attention_reference
from tests.kernels_pallas.test_ragged_paged_attention import make_case
from tests.kernels_pallas.test_ragged_paged_attention_gpu import export_for_cuda
from tests.kernels_pallas.test_ragged_paged_attention_tpu import assert_close


def mla_case(rng, q_lens, kv_lens, *, heads, latent_dim, rope_dim, page_size, pages_per_seq, max_seqs=None):
    """(q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs) as numpy arrays."""
    max_seqs = max_seqs or len(q_lens)
    num_pages = pages_per_seq * max_seqs + 2
    q, _, kv, pi, cu, ns = make_case(rng, q_lens, kv_lens, num_q_heads=heads, num_kv_heads=1,
                                     head_dim=latent_dim + rope_dim, page_size=page_size,
                                     pages_per_seq=pages_per_seq, num_pages=num_pages, max_seqs=max_seqs)
    latent = rng.standard_normal((num_pages, page_size, latent_dim + rope_dim)).astype(np.float32)
    return q[..., :latent_dim], q[..., latent_dim:], latent, kv, pi, cu, ns


def naive_mla(ql, qr, latent, kv_lens, page_indices, cu, num_seqs, *, sm_scale, sliding_window=None, soft_cap=None):
    out = np.zeros_like(ql)
    latent_dim = ql.shape[-1]
    for s in range(int(num_seqs[0])):
        rows = latent[page_indices[s]].reshape(-1, latent.shape[-1])[:kv_lens[s]]
        c, kr = rows[:, :latent_dim], rows[:, latent_dim:]
        q_len = cu[s + 1] - cu[s]
        for i, t in enumerate(range(cu[s], cu[s + 1])):
            pos = kv_lens[s] - q_len + i
            keys = np.arange(kv_lens[s])
            visible = (keys <= pos) & ((keys > pos - sliding_window) if sliding_window else True)
            for h in range(ql.shape[1]):
                score = (c @ ql[t, h] + kr @ qr[t, h]) * sm_scale
                if soft_cap is not None:
                    score = soft_cap * np.tanh(score / soft_cap)
                p = np.exp(np.where(visible, score, -np.inf) - score[visible].max())
                out[t, h] = (p / p.sum()) @ c
    return out


def test_reference_matches_numpy_loop_and_gqa_reference():
    rng = np.random.default_rng(0)
    args = mla_case(rng, [1, 6, 0, 3], [20, 6, 0, 11], heads=4, latent_dim=32, rope_dim=8, page_size=8,
                    pages_per_seq=3, max_seqs=6)
    kw = dict(sm_scale=0.15, sliding_window=7, soft_cap=4.0)
    got = np.asarray(jax.jit(lambda *a: ragged_paged_mla_attention(*a, max_q_len=6, **kw))(*map(jnp.asarray, args)))
    assert_close(got, naive_mla(*args, **kw))
    # MLA == MQA with K = [c | k_rope], V = [c | 0] (first Dl output columns).
    ql, qr, latent, *rest = args
    width = latent.shape[-1]  # one KV head: K lanes [c | k_rope], then V lanes [c | 0] (kv_cache/layout.py)
    kv = np.zeros((1, *latent.shape[:2], 2 * width), np.float32)
    kv[0, :, :, :width], kv[0, :, :, width:width + 32] = latent, latent[..., :32]
    gqa = jax.jit(lambda *a: ragged_paged_attention_reference(*a, **kw))(
        jnp.asarray(np.concatenate([ql, qr], -1)), *map(jnp.asarray, (kv, *rest)))
    assert_close(got, np.asarray(gqa)[..., :32])


@pytest.mark.parametrize("dtype,splits", [("float32", 2), ("bfloat16", 1)])
def test_gpu_kernel_matches_reference(dtype, splits):
    """f32: mixed batch, window, soft cap, split-KV, padding sequences. bf16: DeepSeek-V2 sizes (Dl=512, Dr=64)."""
    rng = np.random.default_rng(1)
    if dtype == "float32":
        args = mla_case(rng, [1, 5, 2], [40, 5, 17], heads=4, latent_dim=64, rope_dim=16, page_size=8,
                        pages_per_seq=5, max_seqs=4)
        kw = dict(sm_scale=0.1, sliding_window=24, soft_cap=5.0)
    else:
        args = mla_case(rng, [1, 1], [30, 9], heads=16, latent_dim=512, rope_dim=64, page_size=16, pages_per_seq=2)
        kw = dict(sm_scale=0.04, max_q_len=1)
    arrays = [jnp.asarray(a, dtype) if i < 3 else jnp.asarray(a) for i, a in enumerate(args)]
    got = jax.jit(lambda *a: ragged_paged_mla_attention_gpu(*a, interpret=True, num_kv_splits=splits, **kw))(*arrays)
    assert got.dtype == jnp.dtype(dtype) and got.shape == args[0].shape
    want = jax.jit(lambda *a: ragged_paged_mla_attention(*a, **kw))(
        *[a.astype(jnp.float32) if i < 3 else a for i, a in enumerate(arrays)])
    assert_close(np.asarray(got.astype(jnp.float32)), np.asarray(want), tol=2e-5 if dtype == "float32" else 2e-2)


def test_write_latent_places_rows_and_skips_padding():
    pages = jnp.zeros((3, 4, 6))
    latent = jnp.arange(3 * 6, dtype=jnp.float32).reshape(3, 6) + 1
    out = np.asarray(jax.jit(write_latent)(pages, latent, jnp.array([5, -1, 11], jnp.int32)))
    np.testing.assert_array_equal(out[1, 1], latent[0])
    np.testing.assert_array_equal(out[2, 3], latent[2])
    written = np.zeros((3, 4), bool)
    written[1, 1] = written[2, 3] = True
    assert np.all(out[~written] == 0)
    with pytest.raises(ValueError, match="latent rows"):
        write_latent(pages, latent[:, :5], jnp.array([0, 1, 2], jnp.int32))


def test_flat_pages_as_tpu_keeps_them_read_and_write_the_same_rows():
    """TPU's cache shape `[P, page_size * W]` (kv_cache/latent_layout.py): the reference, the GPU kernel and both
    forms of write_latent (the CPU loop, and the windowed scatter TPU traces) agree with `[P, page_size, W]` exactly."""
    rng = np.random.default_rng(3)
    ql, qr, latent, *rest = mla_case(rng, [1, 4], [13, 4], heads=4, latent_dim=64, rope_dim=16, page_size=8,
                                     pages_per_seq=2)
    num_pages, page_size, width = latent.shape
    with compiling_for("tpu"):
        assert latent_cache_shape(num_pages, page_size, width) == (num_pages, page_size * width)
    assert latent_cache_shape(num_pages, page_size, width) == latent.shape  # CPU (and GPU) keep pages 3-D
    flat = latent.reshape(num_pages, -1)
    assert latent_page_size(flat.shape, width) == latent_page_size(latent.shape, width) == page_size
    kw = dict(sm_scale=0.1, max_q_len=4)
    args = [jnp.asarray(a) for a in (ql, qr)], [jnp.asarray(a) for a in rest]
    for fn in (lambda *a: ragged_paged_mla_attention(*a, **kw),
               lambda *a: ragged_paged_mla_attention_gpu(*a, interpret=True, **kw)):
        want, got = (np.asarray(jax.jit(fn)(*args[0], jnp.asarray(x), *args[1])) for x in (latent, flat))
        np.testing.assert_array_equal(got, want)
    rows, slots = jnp.asarray(rng.standard_normal((3, width)), jnp.float32), jnp.array([5, -1, 17], jnp.int32)
    want = np.asarray(jax.jit(write_latent)(jnp.asarray(latent), rows, slots))
    np.testing.assert_array_equal(np.asarray(jax.jit(write_latent)(jnp.asarray(flat), rows, slots)),
                                  want.reshape(flat.shape))
    with compiling_for("tpu"):  # a fresh function: jit's trace cache does not look at the target backend
        lowered = jax.jit(lambda *a: write_latent(*a)).lower(jnp.asarray(flat), rows, slots)
    assert "scatter" in lowered.as_text()
    np.testing.assert_array_equal(np.asarray(lowered.compile()(jnp.asarray(flat), rows, slots)),
                                  want.reshape(flat.shape))
    with pytest.raises(ValueError, match="latent_pages"):
        latent_page_size((num_pages, page_size * width + 1), width)


def test_model_config_builds_and_reads_the_backends_latent_cache():
    config = get_model_config("tiny-deepseek-v2")  # latent 32 + RoPE key 8
    assert config.kv_cache_spec(5, 4).shape == (5, 4, 40)
    with compiling_for("tpu"):
        spec = config.kv_cache_spec(5, 4)
    assert spec.shape == (5, 160) and config.kv_cache_page_size(spec) == 4


def test_dispatch_and_lowering():
    rng = np.random.default_rng(2)
    args = list(map(jnp.asarray, mla_case(rng, [1, 3], [9, 3], heads=16, latent_dim=512, rope_dim=64, page_size=16,
                                          pages_per_seq=1)))
    with pytest.raises(ValueError, match="unknown MLA attention impl"):
        ragged_paged_mla_attention(*args, sm_scale=1.0, impl="tpu")
    if jax.default_backend() == "cpu":  # auto is the reference on CPU
        auto, ref = (jax.jit(lambda *a, impl=impl: ragged_paged_mla_attention(*a, sm_scale=0.1, impl=impl))(*args)
                     for impl in ("auto", "reference"))
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(ref))
    args[:3] = [a.astype(jnp.bfloat16) for a in args[:3]]
    fn = jax.jit(lambda *a: ragged_paged_mla_attention_gpu(*a, sm_scale=0.1, num_kv_splits=2))
    assert "xla.gpu.triton" in export_for_cuda(fn, *args).mlir_module()


@pytest.mark.parametrize("flat", [False, True])
def test_copy_latent_pages_copies_whole_pages(flat):
    """Copy-on-write of a latent cache moves whole pages (its leading axis, in both forms) and nothing else."""
    from kernels_pallas.kv_cache.writes import copy_latent_pages

    pages = np.arange(6 * 4 * 5, dtype=np.float32).reshape(6, 4, 5)
    cache = pages.reshape(6, -1) if flat else pages
    got = np.asarray(jax.jit(copy_latent_pages)(jnp.asarray(cache), jnp.array([1, 4], jnp.int32),
                                                jnp.array([3, 0], jnp.int32)))
    want = cache.copy()
    want[3], want[0] = cache[1], cache[4]
    np.testing.assert_array_equal(got, want)
