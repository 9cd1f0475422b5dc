"""The C++ CPU kernel (XLA FFI) against the pure-JAX reference: a sweep of ragged batches, head layouts, page sizes,
head dims (the unrolled 64/128 paths, the generic vector one at 40, the loops at 36), KV dtypes (float32, bfloat16,
int8 and float8_e4m3fn with per-token scales; every fp8 code decoded exactly by each library build), sliding window,
soft cap and static scales, in each library build; a pool poisoned with NaN/Inf wherever no query may look; plus its
failure modes (no compiler, out-of-contract indices). Caches are in kv_cache/layout.py's layout, built through
`kv_cache_spec` (`make_case`) and `kv_cache.writes.quantize_cache` (int8, fp8)."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import ragged_paged_attention, ragged_paged_attention_reference
from kernels_pallas import rope_cpu
from kernels_pallas.attention import cpu
from kernels_pallas.kv_cache import writes
from kernels_pallas.native import build, gate
from kernels_pallas.kv_cache.writes import quantize_cache
from kernels_pallas.kv_cache.layout import kv_cache_spec, scale_rows, scales_by_page
from tests.kernels_pallas.test_ragged_paged_attention import make_case

# Only a machine without a C++ compiler skips; with one, a build failure fails test_kernel_builds_where_a_compiler_is.
needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None,
                               reason="no C++ compiler: auto dispatch uses the reference (see the missing-compiler test)")


@needs_cxx
def test_kernel_builds_where_a_compiler_is():
    assert gate.unavailable_reason(cpu.KERNEL) is None

CASES = {
    # name: (q_lens, kv_lens); more query tokens than the kernel's 8-token block in the prefill cases
    "decode": ([1, 1, 1, 1], [1, 16, 33, 70]),
    "prefill": ([7, 19, 3], [7, 19, 3]),
    "mixed": ([1, 12, 1, 0, 4], [20, 12, 1, 0, 30]),
    "chunked_prefill": ([21], [45]),
    "spec_verify": ([4, 4], [30, 9]),
}


def run_both(args, kv_dtype=jnp.float32, q_dtype=jnp.float32, build_name="native", **kw):
    q, kv, *rest = map(jnp.asarray, args)
    q = q.astype(q_dtype)
    scales = None
    if kv_dtype in (jnp.int8, jnp.float8_e4m3fn):
        kv, scales = quantize_cache(kv, kv_dtype)
    else:
        kv = kv.astype(kv_dtype)
    call = (q, kv, *rest)
    got = jax.jit(lambda *a: cpu.ragged_paged_attention_cpu(*a, kv_scales=scales, build=build_name, **kw))(*call)
    want = jax.jit(lambda *a: ragged_paged_attention_reference(*a, kv_scales=scales, **kw))(*call)
    assert got.dtype == q.dtype and got.shape == q.shape
    return np.asarray(got, np.float32), np.asarray(want, np.float32)


@needs_cxx
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim,page_size", [(64, 16), (128, 8), (40, 4), (36, 4)])
def test_kernel_matches_reference(case, heads, head_dim, page_size):
    rng = np.random.default_rng(0)
    q_lens, kv_lens = CASES[case]
    pages_per_seq = -(-max(kv_lens) // page_size) + 1  # one spare page: kv_len below the table's capacity
    args = make_case(rng, q_lens, kv_lens, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                     page_size=page_size, pages_per_seq=pages_per_seq, num_pages=pages_per_seq * len(q_lens) + 2,
                     max_seqs=len(q_lens) + 2)  # two padding sequences beyond num_seqs
    got, want = run_both(args, sm_scale=head_dim ** -0.5)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@needs_cxx
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 5}, {"soft_cap": 3.0, "k_scale": 0.7, "v_scale": 1.3},
                                     {"sliding_window": 1}])
def test_kv_dtypes_and_options(kv_dtype, options):
    rng = np.random.default_rng(1)
    args = make_case(rng, [1, 11, 3], [26, 11, 40], num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=8,
                     pages_per_seq=5, num_pages=18)
    got, want = run_both(args, kv_dtype=kv_dtype, sm_scale=0.125, **options)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


# The builds without the AVX-512 path that this CPU runs: the portable one, and the AVX2 one on x86 with AVX2.
GENERIC_BUILDS = ["portable", *(["avx2"] if gate.host_isa().startswith(("avx2", "avx512")) else [])]


@needs_cxx
@pytest.mark.parametrize("build_name", GENERIC_BUILDS)
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("head_dim", [64, 128, 40, 36])
def test_generic_builds_match_the_reference(build_name, kv_dtype, head_dim):
    """The builds without the AVX-512 path (the AVX2 one, and the portable one, which no ISA code enters) run the
    8-float vector passes (`scores8`, `weighted_sum`) at head dims of whole vectors (64 and 128 known at compile time,
    40 not), the plain loops at 36: decode rows, a prefill past the 8-token block, 1-8 keys in a block's last 8-key
    group, a sliding window and a soft cap."""
    rng = np.random.default_rng(2)
    args = make_case(rng, [1, 11, 3, 1], [26, 11, 40, 3], num_q_heads=6, num_kv_heads=2, head_dim=head_dim,
                     page_size=8, pages_per_seq=6, num_pages=26)
    for options in ({}, {"sliding_window": 5, "soft_cap": 3.0, "k_scale": 0.7, "v_scale": 1.3}):
        got, want = run_both(args, kv_dtype=kv_dtype, build_name=build_name, sm_scale=head_dim ** -0.5, **options)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@needs_cxx
@pytest.mark.parametrize("build_name", ["native", *GENERIC_BUILDS])
@pytest.mark.parametrize("head_dim", [64, 128, 40, 36])
@pytest.mark.parametrize("window", [None, 13, 100])
def test_a_query_token_has_the_same_bits_in_any_block(build_name, head_dim, window):
    """Batch-invariant mode's premise, on every build: a query token's output is the same bits decoded alone (its 3
    query rows one block) as the last of a prefill of 2-11 tokens (its rows then split over blocks of 4 and 1 rows
    beside other tokens' rows; with a window the item's first key, and so its 8-key groups and 64-key value blocks,
    shift), with another sequence in the batch or not."""
    rng = np.random.default_rng(3)
    q, kv, lens, pages, cu, _ = make_case(rng, [11, 5], [150, 23], num_q_heads=6, num_kv_heads=2,
                                          head_dim=head_dim, page_size=8, pages_per_seq=19, num_pages=40)
    kv = jnp.asarray(kv)

    def last_token(tokens: int, other: bool) -> np.ndarray:
        """The first sequence's last token's output, from a step whose first sequence has `tokens` query tokens."""
        q_lens = [tokens, 5] if other else [tokens]
        step_q = np.concatenate([q[11 - tokens:11], q[11:16]] if other else [q[11 - tokens:11]])
        step_cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        step_lens, step_pages = lens[:len(q_lens)], pages[:len(q_lens)]
        out = cpu.ragged_paged_attention_cpu(jnp.asarray(step_q), kv, jnp.asarray(step_lens), jnp.asarray(step_pages),
                                             jnp.asarray(step_cu), jnp.array([len(q_lens)], jnp.int32),
                                             sm_scale=head_dim ** -0.5, sliding_window=window, build=build_name)
        return np.asarray(out)[tokens - 1]

    alone = last_token(1, False)
    for tokens in (2, 3, 7, 9, 11):
        for other in (False, True):
            np.testing.assert_array_equal(last_token(tokens, other), alone, err_msg=f"{tokens} tokens, other {other}")


def poisoned_pool_case(rng, *, head_dim, sliding_window, q_lens=(1, 9, 3, 0, 2), kv_lens=(21, 9, 30, 12, 6),
                       page_size=4, pages_per_seq=9, num_q_heads=4, num_kv_heads=2, num_pages=30):
    """A batch whose pool holds stale data everywhere no query may look: returns (args, seen) with `seen[page, t]`
    True where some query of a valid sequence sees slot t of that page (every KV head alike).

    Sequences: decode, a prefill longer than the kernel's 8-token block, a chunked prefill, one with cached tokens
    but no query this step (none of its keys is seen) and a short one; two padding sequences beyond num_seqs with
    stale kv_lens. Every padding entry of page_indices points at page 0, which no sequence owns; a few pages are
    owned by nobody; each table row has spare entries past its kv_len. The defaults fit a 4-token page; the keywords
    let a kernel with other page constraints (the Mosaic GPU kernel: multiples of 8) build the same kind of case."""
    q_lens, kv_lens = list(q_lens), list(kv_lens)
    max_seqs = len(q_lens) + 2
    owned = 1 + rng.permutation(num_pages - 1)  # page 0: the padding page
    page_indices = np.zeros((max_seqs, pages_per_seq), np.int32)
    used = 0
    for i, kv_len in enumerate(kv_lens):
        n = -(-kv_len // page_size)
        page_indices[i, :n] = owned[used:used + n]
        used += n
    assert used < num_pages - 1  # some pages owned by nobody
    kv = np.zeros(max_seqs, np.int32)
    kv[:len(kv_lens)] = kv_lens
    kv[len(kv_lens):] = 7  # stale lengths of the padding sequences
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    seen = np.zeros((num_pages, page_size), bool)
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if q_len == 0:
            continue
        first = 0 if sliding_window is None else max(0, kv_len - q_len - sliding_window + 1)
        for j in range(first, kv_len):
            seen[page_indices[i, j // page_size], j % page_size] = True
    assert not seen[0].any() and seen.any() and not seen.all()
    q = rng.standard_normal((sum(q_lens) + 2, num_q_heads, head_dim)).astype(np.float32)  # two padding tokens
    kv_pages = rng.standard_normal(kv_cache_spec(num_pages, page_size, num_kv_heads, head_dim).shape)
    return (q, kv_pages.astype(np.float32), kv, page_indices, cu, np.array([len(q_lens)], np.int32)), seen


def poison(x: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """x where `keep` (broadcast), else a repeating NaN, +Inf, -Inf pattern."""
    bad = np.resize(np.array([np.nan, np.inf, -np.inf], np.float32), x.shape)
    return np.where(keep, x, bad).astype(np.float32)


@needs_cxx
@pytest.mark.parametrize("head_dim", [64, 128, 40, 36])  # both AVX-512 paths, the generic vector one, the loops
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 5}, {"sliding_window": 1, "soft_cap": 3.0}])
def test_stale_non_finite_slots_change_no_output(head_dim, kv_dtype, options):
    """NaN/Inf in every slot no query may see (past kv_len, before the window, unused pages, the page padding
    entries of page_indices point at, the keys of a sequence without queries, the int8 scales' padding lanes and
    rows) leave the kernel's output bit-identical to the clean pool's, and finite; both agree with the reference."""
    rng = np.random.default_rng(8)
    (q, clean, *rest), seen = poisoned_pool_case(rng, head_dim=head_dim, sliding_window=options.get("sliding_window"))
    num_kv_heads, num_pages, page_size, _ = clean.shape
    if kv_dtype in (jnp.int8, jnp.float8_e4m3fn):
        kv_q, scales = (np.asarray(x) for x in quantize_cache(jnp.asarray(clean), kv_dtype))
        stale = rng.integers(-128, 128, kv_q.shape, dtype=np.int8).view(kv_q.dtype)  # fp8: NaN codes among them
        dirty = np.where(seen[None, :, :, None], kv_q, stale)
        flat_seen = np.zeros(scale_rows(num_pages, page_size) * 128, bool)
        flat_seen[:num_pages * 2 * page_size] = np.stack([seen, seen], axis=1).reshape(-1)  # K then V per page
        assert not flat_seen.all()  # the layout's padding tail is poisoned too
        dirty_scales = poison(scales, flat_seen.reshape(1, *scales.shape[1:]))
        np.testing.assert_array_equal(  # the poison hides no scale a query reads
            np.asarray(scales_by_page(jnp.asarray(dirty_scales), num_pages, page_size))[:, seen.nonzero()[0], :,
                                                                                         seen.nonzero()[1]],
            np.asarray(scales_by_page(jnp.asarray(scales), num_pages, page_size))[:, seen.nonzero()[0], :,
                                                                                  seen.nonzero()[1]])
        pools = {"clean": (kv_q, scales), "dirty": (dirty, dirty_scales)}
    else:
        dirty = poison(clean, seen[None, :, :, None])
        pools = {"clean": (clean.astype(kv_dtype), None), "dirty": (jnp.asarray(dirty).astype(kv_dtype), None)}
    out = {}
    for name, (kv, scales) in pools.items():
        args = (jnp.asarray(q), jnp.asarray(kv), *map(jnp.asarray, rest))
        s = None if scales is None else jnp.asarray(scales)
        kw = dict(sm_scale=head_dim ** -0.5, kv_scales=s, **options)
        out[name] = np.asarray(jax.jit(lambda *a: cpu.ragged_paged_attention_cpu(*a, **kw))(*args))
        out[name + "_ref"] = np.asarray(jax.jit(lambda *a: ragged_paged_attention_reference(*a, **kw))(*args))
    assert np.isfinite(out["dirty"]).all()
    np.testing.assert_array_equal(out["dirty"], out["clean"])
    assert not out["clean"][-2:].any() and np.abs(out["clean"]).max() > 0.01  # padding tokens: zeros
    assert np.isfinite(out["dirty_ref"]).all()  # the reference's contract: the poison is where no query looks
    np.testing.assert_allclose(out["clean"], out["clean_ref"], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(out["dirty"], out["dirty_ref"], atol=2e-5, rtol=1e-5)


@needs_cxx
@pytest.mark.parametrize("build_name", ["native", "portable", "avx2"])  # ("no_amx" differs only in the int8 matmul)
@pytest.mark.parametrize("head_dim", [128, 40])  # whole 16-code pieces; and a tail the table decodes
def test_every_fp8_code_is_decoded_exactly(build_name, head_dim):
    """Each of the 256 float8_e4m3fn codes (subnormals, both zeros, the two NaNs) read as the value numpy's
    ml_dtypes gives it: one key per sequence, so the output is that key's V row times its scale (2, exact), in each
    library build (native: F16C here; avx2; portable: the table)."""
    codes = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn)
    num_seqs = -(-256 // head_dim)
    kv_spec, scale_spec = kv_cache_spec(num_seqs, 1, 1, head_dim, jnp.float8_e4m3fn)
    kv = np.zeros(kv_spec.shape, kv_spec.dtype)
    values = np.resize(codes, num_seqs * head_dim).reshape(num_seqs, head_dim)  # page i: the V row of sequence i
    kv[0, :, 0, head_dim:] = values
    scales = jnp.full(scale_spec.shape, 2.0, jnp.float32)
    seq = jnp.arange(num_seqs, dtype=jnp.int32)
    out = cpu.ragged_paged_attention_cpu(jnp.ones((num_seqs, 1, head_dim)), jnp.asarray(kv), jnp.ones_like(seq),
                                         seq[:, None], jnp.arange(num_seqs + 1, dtype=jnp.int32),
                                         jnp.array([num_seqs], jnp.int32), kv_scales=scales, build=build_name)
    want = 2 * values.astype(np.float32)
    assert np.isnan(want).sum() >= 2 and (want == 0).any() and np.nanmin(np.abs(want[want != 0])) == 2 * 2.0 ** -9
    np.testing.assert_array_equal(np.asarray(out)[:, 0], want)


@needs_cxx
def test_bfloat16_queries_come_back_in_bfloat16():
    rng = np.random.default_rng(2)
    args = make_case(rng, [1, 5], [9, 5], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4, pages_per_seq=3,
                     num_pages=8)
    got, want = run_both(args, kv_dtype=jnp.bfloat16, q_dtype=jnp.bfloat16, sm_scale=0.125)
    np.testing.assert_allclose(got, want, atol=1e-2, rtol=1e-2)  # both round the f32 result to bf16


@needs_cxx
def test_padding_rows_are_zero_and_rows_of_invalid_sequences_too():
    rng = np.random.default_rng(3)
    q, kv, kv_lens, pages, cu, _ = make_case(rng, [2, 3, 1], [5, 3, 9], num_q_heads=4, num_kv_heads=2, head_dim=64,
                                             page_size=4, pages_per_seq=3, num_pages=10)
    q = np.concatenate([q, rng.standard_normal((2, 4, 64)).astype(np.float32)])  # two padding tokens
    out = np.asarray(cpu.ragged_paged_attention_cpu(*map(jnp.asarray, (q, kv, kv_lens, pages, cu)),
                                                           jnp.array([2], jnp.int32), sm_scale=0.125))
    want = np.asarray(ragged_paged_attention_reference(*map(jnp.asarray, (q, kv, kv_lens, pages, cu)),
                                                       jnp.array([2], jnp.int32), sm_scale=0.125))
    np.testing.assert_allclose(out[:5], want[:5], atol=2e-5)  # the two valid sequences
    assert np.abs(out[:5]).max() > 0.01
    assert not out[5:].any()  # the third sequence (index >= num_seqs) and the padding tokens


@needs_cxx
def test_auto_dispatch_uses_the_kernel_on_cpu():
    rng = np.random.default_rng(4)
    args = list(map(jnp.asarray, make_case(rng, [1, 1], [7, 12], num_q_heads=4, num_kv_heads=2, head_dim=64,
                                           page_size=4, pages_per_seq=3, num_pages=8)))
    text = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.1, max_q_len=1)).lower(*args).as_text()
    assert cpu.KERNEL.target in text
    text = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.1, impl="reference")).lower(*args).as_text()
    assert cpu.KERNEL.target not in text


@needs_cxx
def test_out_of_contract_indices_are_clamped_not_read_out_of_bounds():
    rng = np.random.default_rng(5)
    q, kv, kv_lens, pages, cu, n = make_case(rng, [1, 2], [6, 4], num_q_heads=2, num_kv_heads=1, head_dim=64,
                                             page_size=4, pages_per_seq=2, num_pages=4)
    pages[0, 1] = 10 ** 6  # a page far outside the cache
    pages[1, 0] = -5
    kv_lens[1] = 10 ** 6  # longer than the page table's capacity
    out = cpu.ragged_paged_attention_cpu(*map(jnp.asarray, (q, kv, kv_lens, pages, cu, n)), sm_scale=0.125)
    assert np.isfinite(np.asarray(out)).all()


@needs_cxx
def test_bad_arguments_are_rejected_by_name():
    rng = np.random.default_rng(6)
    args = list(map(jnp.asarray, make_case(rng, [1], [3], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=4,
                                           pages_per_seq=1, num_pages=2)))
    with pytest.raises(ValueError, match="needs kv_scales"):
        cpu.ragged_paged_attention_cpu(args[0], args[1].astype(jnp.int8), *args[2:])
    with pytest.raises(ValueError, match="soft_cap"):
        cpu.ragged_paged_attention_cpu(*args, soft_cap=0.0)
    with pytest.raises(ValueError, match="float32, bfloat16, int8 or float8_e4m3fn"):
        cpu.ragged_paged_attention_cpu(args[0], args[1].astype(jnp.float16), *args[2:])
    kv_q, scales = quantize_cache(args[1])
    with pytest.raises(ValueError, match="kv_scales shape"):  # the old [num_pages, page_size, 2 * Hkv] scales
        cpu.ragged_paged_attention_cpu(args[0], kv_q, *args[2:], kv_scales=jnp.zeros((2, 4, 2)))
    with pytest.raises(ValueError, match="kv_cache_spec"):  # the old [num_pages, page_size, 2 * Hkv, D] cache
        cpu.ragged_paged_attention_cpu(args[0], jnp.zeros((2, 4, 2, 64)), *args[2:])


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-pagejax")
    monkeypatch.setenv("PAGEJAX_KERNEL_DIR", str(tmp_path))
    with pytest.raises(cpu.KernelBuildError, match="no C\\+\\+ compiler 'no-such-compiler-pagejax'.*"
                       "attn_impl='reference'"):
        build.build()
    assert not list(tmp_path.iterdir())


@needs_cxx
def test_build_is_cached_by_content(monkeypatch, tmp_path):
    """The build logic on a one-function source tree (the real kernels take most of a minute to compile, and every
    other test here builds them): cached by content, no temporary files left, a changed source rebuilt."""
    source = tmp_path / "csrc"
    source.mkdir()
    (source / "k.cc").write_text('extern "C" int pagejax_probe() { return 1; }\n')
    out = tmp_path / "out"
    monkeypatch.setattr(build, "CSRC", str(source))
    monkeypatch.setenv("PAGEJAX_KERNEL_DIR", str(out))
    first = build.build()
    mtime = out.joinpath(first.split("/")[-1]).stat().st_mtime_ns
    assert build.build() == first  # second call: no recompile
    assert out.joinpath(first.split("/")[-1]).stat().st_mtime_ns == mtime
    assert [p.name for p in out.iterdir()] == [first.split("/")[-1]]  # no temporary files left
    (source / "k.cc").write_text('extern "C" int pagejax_probe() { return 2; }\n')
    second = build.build()
    assert second != first and sorted(p.name for p in out.iterdir()) == sorted(
        p.split("/")[-1] for p in (first, second))


@needs_cxx
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_cache_write_kernel_equals_the_portable_loop(kv_dtype, monkeypatch):
    """write_kv through csrc/write_rows_cpu.cc (in place, one memcpy per token) gives the loop's bytes exactly,
    padding slots (-1) skipped and a slot written twice keeping the later token; a slot past the cache is skipped."""
    rng = np.random.default_rng(7)
    pages = jnp.asarray(rng.standard_normal(kv_cache_spec(5, 4, 2, 32).shape), jnp.float32)  # 20 slots
    k, v = (jnp.asarray(rng.standard_normal((6, 2, 32)), jnp.float32) for _ in range(2))
    cache, scales = quantize_cache(pages) if kv_dtype == jnp.int8 else (pages.astype(kv_dtype), None)

    def write(c, s, slots):
        return jax.tree.leaves(writes.write_kv(c, k, v, slots, kv_scales=s))

    slots = jnp.array([3, -1, 17, 0, 3, 19], jnp.int32)
    kernel = jax.jit(write)
    assert writes.WRITE_KERNEL.target in kernel.lower(cache, scales, slots).as_text()
    got = kernel(cache, scales, slots)
    past_end = kernel(cache, scales, jnp.array([-1, -1, 20, 400, -1, -1], jnp.int32))
    for before, after in zip(jax.tree.leaves((cache, scales)), past_end):
        np.testing.assert_array_equal(np.asarray(after, np.float32), np.asarray(before, np.float32))
    monkeypatch.setattr(gate, "runs_here", lambda kernel, rows=None: False)  # as without a compiler
    portable = jax.jit(lambda c, s, sl: write(c, s, sl))  # a new function: no trace cached with the kernel
    assert writes.WRITE_KERNEL.target not in portable.lower(cache, scales, slots).as_text()
    for a, b in zip(got, portable(cache, scales, slots)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@needs_cxx
def test_rope_tables_kernel_matches_jnp(monkeypatch):
    """models.layers.rope_tables through csrc/rope_tables_cpu.cc (materialized once, not re-evaluated per head)
    equals XLA's cos/sin to float32 rounding, at positions up to 32k."""
    from models import layers

    positions = jnp.array([0, 1, 7, 128, 4095, 32767], jnp.int32)
    inv_freq = layers.rope_inv_freq(64, 10000.0, None)
    kernel = jax.jit(lambda p: layers.rope_tables(p, inv_freq))
    assert rope_cpu.KERNEL.target in kernel.lower(positions).as_text()
    got = kernel(positions)
    monkeypatch.setattr(gate, "runs_here", lambda kernel, rows=None: False)  # as without a compiler
    portable = jax.jit(lambda p: layers.rope_tables(p, inv_freq))
    assert rope_cpu.KERNEL.target not in portable.lower(positions).as_text()
    for a, b in zip(got, portable(positions)):
        assert a.shape == (6, 32)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
