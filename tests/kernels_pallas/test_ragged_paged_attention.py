"""The pure-JAX ragged paged attention against a per-sequence numpy loop and JAX's in-tree reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import ragged_paged_attention, ragged_paged_attention_reference, write_kv
from kernels_pallas.kv_cache.layout import kv_cache_spec, scales_by_page


def make_case(rng, q_lens, kv_lens, *, num_q_heads, num_kv_heads, head_dim, page_size, pages_per_seq, num_pages,
              max_seqs=None):
    """Random packed queries and paged KV with each sequence on distinct random pages."""
    max_seqs = max_seqs or len(q_lens)
    q = rng.standard_normal((sum(q_lens), num_q_heads, head_dim)).astype(np.float32)
    kv_pages = rng.standard_normal(kv_cache_spec(num_pages, page_size, num_kv_heads, head_dim).shape).astype(np.float32)
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
    num_kv_heads, head_dim = kv_pages.shape[0], kv_pages.shape[3] // 2
    group = q.shape[1] // num_kv_heads
    for s in range(int(num_seqs[0])):
        q_start, q_end = cu_q_lens[s], cu_q_lens[s + 1]
        kv_len = kv_lens[s]
        kv = kv_pages[:, page_indices[s]].reshape(num_kv_heads, -1, 2 * head_dim)[:, :kv_len]
        k, v = kv[..., :head_dim], kv[..., head_dim:]  # [Hkv, kv_len, D]
        for i, t in enumerate(range(q_start, q_end)):
            pos = kv_len - (q_end - q_start) + i
            for h in range(q.shape[1]):
                scores = k[h // group] @ q[t, h] * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                keys = np.arange(kv_len)
                visible = keys <= pos
                if sliding_window is not None:
                    visible &= keys > pos - sliding_window
                scores = np.where(visible, scores, -np.inf)
                p = np.exp(scores - scores.max())
                out[t, h] = (p / p.sum()) @ v[h // group]
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
    q, kv, *rest = args  # theirs reads [pages, page_size, 2 * Hkv, D], K at even and V at odd head slots
    hkv, num_pages, page_size, width = kv.shape
    interleaved = kv.reshape(hkv, num_pages, page_size, 2, width // 2).transpose(1, 2, 0, 3, 4).reshape(
        num_pages, page_size, 2 * hkv, width // 2)
    theirs = in_tree.ref_ragged_paged_attention(*map(jnp.asarray, (q, interleaved, *rest)), sm_scale=0.125,
                                                sliding_window=9, soft_cap=20.0)
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
    pages = jnp.zeros(kv_cache_spec(num_pages, page_size, num_kv_heads, head_dim).shape)
    k = jnp.arange(3 * num_kv_heads * head_dim, dtype=jnp.float32).reshape(3, num_kv_heads, head_dim) + 1
    v = -k
    slots = jnp.array([13, -1, 2], jnp.int32)  # page 3 offset 1; padding; page 0 offset 2
    out = np.asarray(jax.jit(write_kv)(pages, k, v, slots))
    np.testing.assert_array_equal(out[:, 3, 1, :head_dim], k[0])
    np.testing.assert_array_equal(out[:, 3, 1, head_dim:], v[0])
    np.testing.assert_array_equal(out[:, 0, 2, :head_dim], k[2])
    np.testing.assert_array_equal(out[:, 0, 2, head_dim:], v[2])
    written = np.zeros(out.shape[1:3], bool)
    written[3, 1] = written[0, 2] = True
    assert np.all(out[:, ~written] == 0), "padding token or untouched slot was written"


@pytest.mark.parametrize("page_size", [4, 40, 128])  # scale runs inside one 128-lane row, across rows, 2 rows
def test_int8_write_kv_quantizes_per_token_per_head_and_reference_dequantizes(page_size):
    """write_kv with kv_scales stores round(x / scale) with scale = max|x| / 127 per (token, KV head), zero rows stay
    exact; the reference on the int8 cache equals the reference on the dequantized f32 cache."""
    from kernels_pallas.kv_cache.writes import quantize_cache

    rng = np.random.default_rng(5)
    num_pages, hkv, d = 6, 2, 16
    k = rng.standard_normal((5, hkv, d)).astype(np.float32)
    v = rng.standard_normal((5, hkv, d)).astype(np.float32) * 3
    k[1, 0] = 0.0  # an all-zero row: scale 0, no division by zero
    slot_list = [0, page_size + 1, -1, 2 * page_size + 1, 5 * page_size + page_size - 1]
    slots = jnp.array(slot_list, jnp.int32)
    pages_spec, scales_spec = kv_cache_spec(num_pages, page_size, hkv, d, jnp.int8)
    pages, scales = jnp.zeros(pages_spec.shape, jnp.int8), jnp.zeros(scales_spec.shape, jnp.float32)
    pages, scales = jax.jit(write_kv)(pages, k, v, slots, scales)
    assert pages.dtype == jnp.int8 and scales.dtype == jnp.float32
    flat_p = np.asarray(pages).reshape(hkv, -1, 2 * d)  # [Hkv, slot, 2D]
    by_page = np.asarray(scales_by_page(scales, num_pages, page_size))  # [Hkv, page, 2, page_size]
    flat_s = by_page.transpose(0, 1, 3, 2).reshape(hkv, -1, 2)  # [Hkv, slot, (K, V)]
    for i, slot in enumerate(slot_list):
        if slot < 0:
            continue
        for x, off in ((k[i], 0), (v[i], 1)):
            np.testing.assert_allclose(flat_s[:, slot, off], np.abs(x).max(-1) / 127, rtol=1e-6)
            deq = flat_p[:, slot, off * d:(off + 1) * d].astype(np.float32) * flat_s[:, slot, off, None]
            np.testing.assert_allclose(deq, x, atol=np.abs(x).max() / 254 + 1e-7)
    assert np.all(flat_p[0, page_size + 1, :d] == 0) and flat_s[0, page_size + 1, 0] == 0
    untouched = np.ones(flat_p.shape[1], bool)
    untouched[[s for s in slot_list if s >= 0]] = False
    assert np.all(flat_p[:, untouched] == 0) and np.all(flat_s[:, untouched] == 0)
    assert np.all(np.asarray(scales).reshape(hkv, -1)[:, num_pages * 2 * page_size:] == 0), "padding lanes written"

    q, kv_f32, *rest = make_case(rng, [2, 1], [7, 12], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                                 pages_per_seq=3, num_pages=8)
    kv_q, kv_s = quantize_cache(jnp.asarray(kv_f32))
    k_q, v_q = np.split(np.asarray(kv_q).astype(np.float32), 2, axis=-1)
    s_by_page = np.asarray(scales_by_page(kv_s, 8, 4))  # [Hkv, P, 2, ps]
    deq = np.concatenate([k_q * s_by_page[:, :, 0, :, None] * 0.5, v_q * s_by_page[:, :, 1, :, None] * 2.0], -1)
    got = ragged_paged_attention(jnp.asarray(q), kv_q, *map(jnp.asarray, rest), sm_scale=0.3, kv_scales=kv_s,
                                 k_scale=0.5, v_scale=2.0)
    want = naive(q, deq, *rest, sm_scale=0.3)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="kv_scales shape"):
        ragged_paged_attention(jnp.asarray(q), kv_q, *map(jnp.asarray, rest), kv_scales=kv_s[:, :, :64])
    with pytest.raises(ValueError, match="int8"):
        write_kv(jnp.zeros(pages_spec.shape), jnp.asarray(k[:1]), jnp.asarray(v[:1]), slots[:1], scales)


@pytest.mark.parametrize("page_size", [2, 40, 128])
def test_copy_pages_copies_scales_with_pages(page_size):
    from kernels_pallas import copy_pages

    pages_spec, scales_spec = kv_cache_spec(4, page_size, 2, 3, jnp.int8)
    pages = (jnp.arange(np.prod(pages_spec.shape)) % 127).astype(jnp.int8).reshape(pages_spec.shape)
    scales = jnp.arange(np.prod(scales_spec.shape), dtype=jnp.float32).reshape(scales_spec.shape)
    src, dst = jnp.array([1, 3], jnp.int32), jnp.array([2, 0], jnp.int32)
    new_pages, new_scales = jax.jit(copy_pages)(pages, src, dst, scales)
    np.testing.assert_array_equal(new_pages[:, 2], pages[:, 1])
    old_s, new_s = (np.asarray(scales_by_page(x, 4, page_size)) for x in (scales, new_scales))
    np.testing.assert_array_equal(new_s[:, 2], old_s[:, 1])
    np.testing.assert_array_equal(new_s[:, 0], old_s[:, 3])
    np.testing.assert_array_equal(new_s[:, [1, 3]], old_s[:, [1, 3]])
    np.testing.assert_array_equal(np.asarray(copy_pages(pages, src, dst)), np.asarray(new_pages))


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("window", [None, 5])
def test_stale_pages_change_no_output(kv_dtype, window):
    """A freed page keeps whatever its last owner wrote (NaN included) and uninitialized memory holds anything: the
    reference must not care what slots no query may see hold (past kv_len, before the window, pages the padding
    entries of the page table point at, unused pages, the scales' padding lanes)."""
    from kernels_pallas.kv_cache.writes import quantize_cache

    rng = np.random.default_rng(6)
    page_size, pps, num_pages = 4, 4, 14
    q, kv, lens, pages, cu, ns = make_case(rng, [1, 3, 2], [9, 11, 2], num_q_heads=4, num_kv_heads=2, head_dim=8,
                                           page_size=page_size, pages_per_seq=pps, num_pages=num_pages, max_seqs=4)
    pages[2, 1:] = pages[3] = 12  # padding entries of the table (and a padding sequence) point at page 12
    kv_ok = jnp.asarray(kv)
    poisoned = np.array(kv)
    seen = np.zeros((num_pages, page_size), bool)
    for s in range(3):
        first = 0 if window is None else max(0, lens[s] - (cu[s + 1] - cu[s]) - window + 1)
        for j in range(first, lens[s]):
            seen[pages[s, j // page_size], j % page_size] = True
    poisoned[:, ~seen] = np.where(rng.random(poisoned[:, ~seen].shape) < 0.5, np.nan, np.inf)
    kw = dict(sm_scale=0.4, sliding_window=window, max_q_len=3)
    rest = tuple(map(jnp.asarray, (lens, pages, cu, ns)))
    if kv_dtype == "int8":
        (kv_ok, s_ok) = quantize_cache(kv_ok)
        kv_bad = np.array(kv_ok)
        kv_bad[:, ~seen] = 127
        s_bad = np.array(s_ok).reshape(2, -1)
        flat_seen = np.stack([seen, seen], axis=1).reshape(-1)  # [page, (K, V), offset] flattened
        s_bad[:, np.flatnonzero(~flat_seen)] = np.nan
        s_bad[:, flat_seen.size:] = np.inf  # the padding lanes past the last page
        want = ragged_paged_attention_reference(jnp.asarray(q), kv_ok, *rest, kv_scales=s_ok, **kw)
        got = ragged_paged_attention_reference(jnp.asarray(q), jnp.asarray(kv_bad), *rest,
                                               kv_scales=jnp.asarray(s_bad).reshape(s_ok.shape), **kw)
    else:
        dtype = jnp.dtype(kv_dtype)
        want = ragged_paged_attention_reference(jnp.asarray(q), kv_ok.astype(dtype), *rest, **kw)
        got = ragged_paged_attention_reference(jnp.asarray(q), jnp.asarray(poisoned).astype(dtype), *rest, **kw)
    assert np.all(np.isfinite(np.asarray(want)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
