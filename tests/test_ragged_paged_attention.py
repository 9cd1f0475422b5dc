"""The pure-JAX ragged paged attention against a per-sequence numpy loop and JAX's in-tree reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import ragged_paged_attention, ragged_paged_attention_reference, write_kv


def make_case(rng, q_lens, kv_lens, *, num_q_heads, num_kv_heads, head_dim, page_size, pages_per_seq, num_pages,
              max_seqs=None):
    """Random packed queries and paged KV with each sequence on distinct random pages."""
    max_seqs = max_seqs or len(q_lens)
    q = rng.standard_normal((sum(q_lens), num_q_heads, head_dim)).astype(np.float32)
    kv_pages = rng.standard_normal((num_pages, page_size, 2 * num_kv_heads, head_dim)).astype(np.float32)
    perm = rng.permutation(num_pages)
    page_indices = np.zeros((max_seqs, pages_per_seq), np.int32)
    for i in range(len(q_lens)):
        page_indices[i] = perm[i * pages_per_seq:(i + 1) * pages_per_seq]
    kv = np.zeros(max_seqs, np.int32)
    kv[:len(kv_lens)] = kv_lens
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    return q, kv_pages, kv, page_indices, cu, np.array([len(q_lens)], np.int32)


def naive(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window=None, soft_cap=None):
    out = np.zeros_like(q)
    num_kv_heads = kv_pages.shape[2] // 2
    group = q.shape[1] // num_kv_heads
    for s in range(int(num_seqs[0])):
        q_start, q_end = cu_q_lens[s], cu_q_lens[s + 1]
        kv_len = kv_lens[s]
        kv = kv_pages[page_indices[s]].reshape(-1, kv_pages.shape[2], kv_pages.shape[3])[:kv_len]
        k, v = kv[:, 0::2], kv[:, 1::2]
        for i, t in enumerate(range(q_start, q_end)):
            pos = kv_len - (q_end - q_start) + i
            for h in range(q.shape[1]):
                scores = k[:, h // group] @ q[t, h] * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                keys = np.arange(kv_len)
                visible = keys <= pos
                if sliding_window is not None:
                    visible &= keys > pos - sliding_window
                scores = np.where(visible, scores, -np.inf)
                p = np.exp(scores - scores.max())
                out[t, h] = (p / p.sum()) @ v[:, h // group]
    return out


CASES = {
    # name: (q_lens, kv_lens)
    "decode": ([1, 1, 1], [5, 16, 33]),
    "prefill": ([7, 16, 3], [7, 16, 3]),
    "mixed": ([1, 9, 1, 4], [20, 9, 1, 30]),
    "chunked_prefill": ([6], [22]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("page_size", [4, 16])
def test_reference_matches_naive_loop(case, heads, page_size):
    rng = np.random.default_rng(0)
    q_lens, kv_lens = CASES[case]
    pages_per_seq = -(-max(kv_lens) // page_size)
    args = make_case(rng, q_lens, kv_lens, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=32,
                     page_size=page_size, pages_per_seq=pages_per_seq, num_pages=pages_per_seq * len(q_lens) + 2)
    fn = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=0.2, max_q_len=max(q_lens)))
    got = fn(*map(jnp.asarray, args))  # jitted: one compile per shape, not one per eager op
    np.testing.assert_allclose(np.asarray(got), naive(*args, sm_scale=0.2), atol=2e-5, rtol=1e-5)


def test_sliding_window_and_soft_cap():
    rng = np.random.default_rng(1)
    args = make_case(rng, [1, 5, 2], [40, 12, 30], num_q_heads=6, num_kv_heads=2, head_dim=16, page_size=8,
                     pages_per_seq=5, num_pages=16)
    got = ragged_paged_attention_reference(*map(jnp.asarray, args), sm_scale=0.5, sliding_window=7, soft_cap=3.0)
    np.testing.assert_allclose(np.asarray(got), naive(*args, sm_scale=0.5, sliding_window=7, soft_cap=3.0),
                               atol=2e-5, rtol=1e-5)


def test_padding_sequences_and_tokens_are_ignored():
    """num_seqs below the array size: rows of the padding sequences stay zero and do not disturb the others."""
    rng = np.random.default_rng(2)
    q, kv_pages, kv_lens, page_indices, cu, num_seqs = make_case(
        rng, [3, 1], [10, 7], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, pages_per_seq=3,
        num_pages=10, max_seqs=4)
    q_padded = np.concatenate([q, rng.standard_normal((4, 4, 16)).astype(np.float32)])
    got = np.asarray(ragged_paged_attention_reference(
        *map(jnp.asarray, (q_padded, kv_pages, kv_lens, page_indices, cu, num_seqs)), sm_scale=0.3))
    np.testing.assert_allclose(got[:4], naive(q, kv_pages, kv_lens, page_indices, cu, num_seqs, sm_scale=0.3),
                               atol=2e-5)
    assert np.all(got[4:] == 0)


def test_matches_jax_in_tree_reference():
    """Same semantics as jax.experimental.pallas.ops.tpu.ragged_paged_attention (its reference runs eagerly)."""
    in_tree = pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
    rng = np.random.default_rng(3)
    args = make_case(rng, [1, 6, 3], [17, 6, 25], num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=8,
                     pages_per_seq=4, num_pages=14)
    ours = ragged_paged_attention(*map(jnp.asarray, args), sm_scale=0.125, sliding_window=9, soft_cap=20.0)
    theirs = in_tree.ref_ragged_paged_attention(*map(jnp.asarray, args), sm_scale=0.125, sliding_window=9,
                                                soft_cap=20.0)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=2e-5, rtol=1e-5)


def test_is_jittable_and_dispatch_rejects_unknown_impl():
    rng = np.random.default_rng(4)
    args = tuple(map(jnp.asarray, make_case(rng, [2, 1], [5, 9], num_q_heads=2, num_kv_heads=1, head_dim=8,
                                            page_size=4, pages_per_seq=3, num_pages=8)))
    jitted = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=1.0, max_q_len=2))
    np.testing.assert_allclose(np.asarray(jitted(*args)), np.asarray(ragged_paged_attention(*args, sm_scale=1.0)),
                               atol=1e-6)
    with pytest.raises(ValueError, match="unknown attention impl"):
        ragged_paged_attention(*args, impl="cuda-magic")


def test_write_kv_places_tokens_and_skips_padding():
    num_pages, page_size, num_kv_heads, head_dim = 4, 4, 2, 3
    pages = jnp.zeros((num_pages, page_size, 2 * num_kv_heads, head_dim))
    k = jnp.arange(3 * num_kv_heads * head_dim, dtype=jnp.float32).reshape(3, num_kv_heads, head_dim) + 1
    v = -k
    slots = jnp.array([13, -1, 2], jnp.int32)  # page 3 offset 1; padding; page 0 offset 2
    out = np.asarray(jax.jit(write_kv)(pages, k, v, slots))
    np.testing.assert_array_equal(out[3, 1, 0::2], k[0])
    np.testing.assert_array_equal(out[3, 1, 1::2], v[0])
    np.testing.assert_array_equal(out[0, 2, 0::2], k[2])
    np.testing.assert_array_equal(out[0, 2, 1::2], v[2])
    written = np.zeros(out.shape[:2], bool)
    written[3, 1] = written[0, 2] = True
    assert np.all(out[~written] == 0), "padding token or untouched slot was written"


def test_int8_write_kv_quantizes_per_token_per_head_and_reference_dequantizes():
    """write_kv with kv_scales stores round(x / scale) with scale = max|x| / 127 per (token, KV head), zero rows stay
    exact; the reference on the int8 cache equals the reference on the dequantized f32 cache."""
    from kernels_pallas.kv_cache import quantize_int8

    rng = np.random.default_rng(5)
    num_pages, page_size, hkv, d = 6, 4, 2, 16
    k = rng.standard_normal((5, hkv, d)).astype(np.float32)
    v = rng.standard_normal((5, hkv, d)).astype(np.float32) * 3
    k[1, 0] = 0.0  # an all-zero row: scale 0, no division by zero
    slots = jnp.array([0, 5, -1, 9, 23], jnp.int32)
    pages = jnp.zeros((num_pages, page_size, 2 * hkv, d), jnp.int8)
    scales = jnp.zeros((num_pages, page_size, 2 * hkv), jnp.float32)
    pages, scales = jax.jit(write_kv)(pages, k, v, slots, scales)
    assert pages.dtype == jnp.int8 and scales.dtype == jnp.float32
    flat_p = np.asarray(pages).reshape(-1, 2 * hkv, d)
    flat_s = np.asarray(scales).reshape(-1, 2 * hkv)
    for i, slot in enumerate([0, 5, -1, 9, 23]):
        if slot < 0:
            continue
        for x, off in ((k[i], 0), (v[i], 1)):
            np.testing.assert_allclose(flat_s[slot, off::2], np.abs(x).max(-1) / 127, rtol=1e-6)
            deq = flat_p[slot, off::2].astype(np.float32) * flat_s[slot, off::2, None]
            np.testing.assert_allclose(deq, x, atol=np.abs(x).max() / 254 + 1e-7)
    assert np.all(flat_p[5, 0] == 0) and flat_s[5, 0] == 0
    untouched = np.ones(len(flat_p), bool)
    untouched[[0, 5, 9, 23]] = False
    assert np.all(flat_p[untouched] == 0) and np.all(flat_s[untouched] == 0)

    q, kv_f32, *rest = make_case(rng, [2, 1], [7, 12], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                                 pages_per_seq=3, num_pages=8)
    kv_q, kv_s = quantize_int8(jnp.asarray(kv_f32))
    deq = kv_q.astype(jnp.float32) * kv_s[..., None]
    got = ragged_paged_attention(jnp.asarray(q), kv_q, *map(jnp.asarray, rest), sm_scale=0.3, kv_scales=kv_s,
                                 k_scale=0.5, v_scale=2.0)
    want = naive(q, np.asarray(deq) * np.array([0.5, 2.0] * 2)[None, None, :, None], *rest, sm_scale=0.3)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="kv_scales shape"):
        ragged_paged_attention(jnp.asarray(q), kv_q, *map(jnp.asarray, rest), kv_scales=kv_s[:, :, :2])
    with pytest.raises(ValueError, match="int8"):
        write_kv(jnp.zeros((2, 4, 4, 16)), jnp.asarray(k[:1]), jnp.asarray(v[:1]), slots[:1], scales[:2])


def test_copy_pages_copies_scales_with_pages():
    from kernels_pallas import copy_pages

    pages = jnp.arange(4 * 2 * 2 * 3, dtype=jnp.int32).astype(jnp.int8).reshape(4, 2, 2, 3)
    scales = jnp.arange(4 * 2 * 2, dtype=jnp.float32).reshape(4, 2, 2)
    src, dst = jnp.array([1, 3], jnp.int32), jnp.array([2, 0], jnp.int32)
    new_pages, new_scales = jax.jit(copy_pages)(pages, src, dst, scales)
    np.testing.assert_array_equal(new_pages[2], pages[1])
    np.testing.assert_array_equal(new_scales[2], scales[1])
    np.testing.assert_array_equal(new_scales[0], scales[3])
    np.testing.assert_array_equal(np.asarray(new_scales)[[1, 3]], np.asarray(scales)[[1, 3]])
    np.testing.assert_array_equal(np.asarray(copy_pages(pages, src, dst)), np.asarray(new_pages))
