"""The Pallas Mosaic ragged paged attention kernel, run in TPU interpret mode on CPU, against the pure-JAX reference.

`pltpu.InterpretParams()` (defaults: DMAs complete on `.wait()`, uninitialised memory reads as NaN) models async
DMA ordering, so a VMEM read before its copy was waited on shows up as NaN here. Each grid point costs ~10-25 ms
interpreted, so the shapes are tiny.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import ragged_paged_attention, ragged_paged_attention_reference
from kernels_pallas.attention.tpu import ragged_paged_attention_tpu
from tests.kernels_pallas.test_ragged_paged_attention import make_case, naive

F32_TOL = 2e-5


@pytest.fixture(autouse=True)
def _reset_interpreter():
    """A failed interpreted kernel leaves the interpreter's shared state behind; clear it for the next test."""
    try:
        yield
    finally:
        pltpu.reset_tpu_interpret_mode_state()


def run_kernel(args, interpret=None, **kw):
    try:
        out = ragged_paged_attention_tpu(*map(jnp.asarray, args), interpret=interpret or pltpu.InterpretParams(),
                                         **kw)
        return np.asarray(out)
    except Exception:
        pltpu.reset_tpu_interpret_mode_state()
        raise


def run_reference(args, kv_scales=None, **kw):
    """The reference, jitted (one compile per shape instead of one per eager op: seconds per case on 2 cores)."""
    kw.pop("pages_per_block", None)
    kw.pop("block_q", None)
    fn = jax.jit(lambda *a, s: ragged_paged_attention_reference(*a, kv_scales=s, **kw))
    return np.asarray(fn(*map(jnp.asarray, args), s=kv_scales))


def assert_close(got, want, tol=F32_TOL):
    assert not np.isnan(got).any(), "NaN in kernel output (read before DMA wait?)"
    err = float(np.max(np.abs(got.astype(np.float32) - want.astype(np.float32))))
    assert err <= tol, f"max abs error {err} > {tol}"


# name: q_lens, kv_lens, (num_q_heads, num_kv_heads), head_dim, page_size, pages_per_seq, pages_per_block, extra kw
CASES = {
    # decode; kv 8 = exactly one page, 13 crosses a page, 33 spans 5 pages; T=3 < block_q (padded window path)
    "decode_gqa3_p8": ([1, 1, 1], [8, 13, 33], (9, 3), 64, 8, 5, 2, dict(max_q_len=1)),
    # prefill only: 16 = exactly one page, 11 (two query blocks), 3; one sequence ending at the tail of q
    "prefill_mha_p16": ([16, 11, 3], [16, 11, 3], (3, 3), 64, 16, 1, 1, {}),
    # mixed decode + prefill + chunked prefill (q_len < kv_len), pages_per_seq not a multiple of pages_per_block
    "mixed_gqa3_p8": ([1, 9, 1, 4], [20, 9, 1, 30], (3, 1), 64, 8, 4, 3, {}),
    "chunked_prefill_d128_p16": ([6], [22], (3, 1), 128, 16, 2, 1, {}),
    "sliding_window_soft_cap": ([1, 5, 2], [40, 12, 30], (6, 2), 64, 8, 5, 2, dict(sliding_window=7, soft_cap=3.0)),
    "kv_scales": ([2, 3], [9, 17], (3, 1), 64, 8, 3, 2, dict(k_scale=0.5, v_scale=1.5, sm_scale=0.3)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference_f32(name):
    q_lens, kv_lens, (hq, hkv), head_dim, page_size, pps, ppb, extra = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    args = make_case(rng, q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, page_size=page_size,
                     pages_per_seq=pps, num_pages=pps * len(q_lens) + 3)
    kw = {"sm_scale": 0.125, "pages_per_block": ppb} | extra
    got = run_kernel(args, **kw)
    assert_close(got, run_reference(args, **kw))
    if "k_scale" not in kw:  # the numpy loop is an independent second opinion
        naive_kw = {k: kw[k] for k in ("sm_scale", "sliding_window", "soft_cap") if k in kw}
        assert_close(got, naive(*args, **naive_kw))


def test_num_seqs_below_array_size_padding_rows_zero_and_page_table_tails_unread():
    """Padding sequences and padding tokens give zero rows; page-table entries past a sequence's pages (and the
    rows of the padding sequences) are out of range, so fetching any of them would raise in the interpreter."""
    rng = np.random.default_rng(7)
    q, kv_pages, kv_lens, page_indices, cu, num_seqs = make_case(
        rng, [3, 1, 2], [10, 7, 16], num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=8, pages_per_seq=3,
        num_pages=12, max_seqs=5)
    bad = kv_pages.shape[1] + 1000
    for s in range(5):
        used = -(-kv_lens[s] // 8) if s < 3 else 0
        page_indices[s, used:] = bad
    q = np.concatenate([q, rng.standard_normal((3, 6, 64)).astype(np.float32)])  # 3 padding tokens
    args = (q, kv_pages, kv_lens, page_indices, cu, num_seqs)
    got = run_kernel(args, sm_scale=0.2, pages_per_block=2)
    safe = page_indices.copy()
    safe[safe == bad] = 0
    want = naive(q[:6], kv_pages, kv_lens, safe, cu, num_seqs, sm_scale=0.2)
    assert_close(got[:6], want)
    assert np.all(got[6:] == 0)


def test_bf16_inputs():
    """bf16 q and pages, f32 accumulation; compared with the f32 reference on the same bf16-rounded values."""
    rng = np.random.default_rng(8)
    args = make_case(rng, [1, 7, 3], [19, 7, 12], num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=16,
                     pages_per_seq=2, num_pages=8)
    q16, kv16 = jnp.asarray(args[0], jnp.bfloat16), jnp.asarray(args[1], jnp.bfloat16)
    got = run_kernel((q16, kv16, *args[2:]), sm_scale=0.125, pages_per_block=1)
    assert got.dtype == jnp.bfloat16
    want = run_reference((q16.astype(jnp.float32), kv16.astype(jnp.float32), *args[2:]), sm_scale=0.125)
    assert_close(got, want, tol=2e-2)


def test_no_races_with_two_cores():
    """The KV-head grid axis is "parallel" (one step per KV head here, as on a megacore chip): split across two
    simulated cores, with the race detector on."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    rng = np.random.default_rng(9)
    args = make_case(rng, [1, 5], [12, 5], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8, pages_per_seq=2,
                     num_pages=6)
    got = run_kernel(args, interpret=pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2),
                     sm_scale=0.125, pages_per_block=1, kv_heads_per_block=1)  # two grid steps, one per core
    assert_close(got, run_reference(args, sm_scale=0.125))
    races = getattr(ipc, "races", None)
    if races is not None:
        assert not races.races_found


def test_dispatch_tpu_impl_and_auto_on_cpu():
    rng = np.random.default_rng(10)
    args = tuple(map(jnp.asarray, make_case(rng, [1, 2], [9, 2], num_q_heads=3, num_kv_heads=3, head_dim=64,
                                            page_size=8, pages_per_seq=2, num_pages=6)))
    want = run_reference(args, sm_scale=0.125)
    try:
        got = np.asarray(ragged_paged_attention(*args, sm_scale=0.125, impl="tpu", max_q_len=2,
                                                interpret=pltpu.InterpretParams()))
    except Exception:
        pltpu.reset_tpu_interpret_mode_state()
        raise
    assert_close(got, want)
    if jax.default_backend() != "tpu":  # auto must not pick the Mosaic kernel off TPU (it would need interpret)
        auto = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.125))
        assert "tpu_custom_call" not in auto.lower(*args).as_text()
        assert_close(np.asarray(auto(*args)), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_lowers_to_mosaic_for_tpu(dtype, monkeypatch, request):
    """Cross-platform export runs the Pallas -> Mosaic MLIR lowering without a TPU (not Mosaic's own compiler,
    which lives in libtpu). The lowering asks for the chip's info, so pretend the CPU is a v5e."""
    try:
        from jax._src.pallas.mosaic import tpu_info
        chip = tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
    except (ImportError, AttributeError) as e:  # private API; may move in later jax versions
        pytest.skip(f"tpu_info API unavailable: {e}")
    monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind, lambda: chip)
    clear = getattr(tpu_info.get_tpu_info, "cache_clear", lambda: None)  # get_tpu_info memoises its answer
    clear()
    request.addfinalizer(clear)
    rng = np.random.default_rng(11)
    args = list(map(jnp.asarray, make_case(rng, [1, 9, 4], [20, 9, 30], num_q_heads=9, num_kv_heads=3, head_dim=64,
                                           page_size=16, pages_per_seq=2, num_pages=8)))
    kw = {}
    if dtype == "int8":  # bf16 queries over an int8 cache with per-token scales
        from kernels_pallas.kv_cache.writes import quantize_cache

        args[0] = args[0].astype(jnp.bfloat16)
        args[1], kw["kv_scales"] = quantize_cache(args[1])
    else:
        args[0], args[1] = args[0].astype(dtype), args[1].astype(dtype)
    fn = jax.jit(lambda *a, **k: ragged_paged_attention_tpu(*a, sm_scale=0.125, sliding_window=5, soft_cap=3.0, **k))
    text = jax.export.export(fn, platforms=["tpu"])(*args, **kw).mlir_module()
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("dtype,page_size,heads", [("int8", 8, None), ("float8_e4m3fn", 8, 1), ("int8", 128, 1)])
def test_scaled_kv_cache_with_per_token_scales(dtype, page_size, heads):
    """int8 / fp8 pages + f32 per-token-per-head scales: the scale rows of a page's KV heads are DMA'd beside it
    (a read before the wait would show up as NaN), rotated into place and applied to score and probability
    columns; equals the reference on the same cache. page_size 8: 8 pages share a 128-lane scale row; 128: a page's
    scales fill two rows (the TPU's default page for a 2048-token model)."""
    from kernels_pallas.kv_cache.writes import quantize_cache

    rng = np.random.default_rng(12)
    q, kv, *rest = make_case(rng, [1, 6, 2], [13, 6, 24 * page_size // 8], num_q_heads=6, num_kv_heads=2,
                             head_dim=64, page_size=page_size, pages_per_seq=3, num_pages=11)
    kv_q, scales = quantize_cache(jnp.asarray(kv), jnp.dtype(dtype))
    args = (q, kv_q, *rest)
    kw = dict(sm_scale=0.125, sliding_window=9 * page_size // 8, v_scale=0.5)
    got = run_kernel(args, kv_scales=scales, pages_per_block=2, kv_heads_per_block=heads, **kw)
    assert_close(got, run_reference(args, kv_scales=scales, **kw))


@pytest.mark.parametrize("kv_dtype,page_size", [("float32", 8), ("bfloat16", 16), ("int8", 8), ("int8", 64)])
def test_stale_pages_change_no_output(kv_dtype, page_size):
    """NaN/Inf in every slot no query may see (past kv_len, before the window, unused pages, pages the padding
    entries of the page table point at, the scales' padding) changes no output of the kernel."""
    from kernels_pallas.kv_cache.writes import quantize_cache

    rng = np.random.default_rng(13)
    pps, num_pages = 3, 12
    q, kv, lens, pages, cu, ns = make_case(rng, [1, 3, 2], [page_size + 3, 2 * page_size + 1, 2], num_q_heads=4,
                                           num_kv_heads=2, head_dim=64, page_size=page_size, pages_per_seq=pps,
                                           num_pages=num_pages, max_seqs=4)
    pages[2, 1:] = pages[3] = 11  # padding entries point at page 11 (used by no sequence)
    window = page_size  # the second sequence's first page falls out of its window
    seen = np.zeros((num_pages, page_size), bool)
    for s in range(3):
        q_len = cu[s + 1] - cu[s]
        for j in range(max(0, lens[s] - q_len - window + 1), lens[s]):
            seen[pages[s, j // page_size], j % page_size] = True
    kw = dict(sm_scale=0.3, sliding_window=window, pages_per_block=2, max_q_len=3)
    if kv_dtype == "int8":
        kv_ok, s_ok = quantize_cache(jnp.asarray(kv))
        kv_bad = np.array(kv_ok)
        kv_bad[:, ~seen] = 127
        s_bad = np.array(s_ok).reshape(2, -1)
        flat_seen = np.stack([seen, seen], axis=1).reshape(-1)
        s_bad[:, np.flatnonzero(~flat_seen)] = np.nan
        s_bad[:, flat_seen.size:] = np.inf
        want = run_kernel((q, kv_ok, lens, pages, cu, ns), kv_scales=s_ok, **kw)
        got = run_kernel((q, kv_bad, lens, pages, cu, ns), kv_scales=s_bad.reshape(s_ok.shape), **kw)
    else:
        bad = np.array(kv)
        bad[:, ~seen] = np.where(rng.random(bad[:, ~seen].shape) < 0.5, np.nan, np.inf)
        dtype = jnp.dtype(kv_dtype)
        want = run_kernel((q, jnp.asarray(kv, dtype), lens, pages, cu, ns), **kw)
        got = run_kernel((q, jnp.asarray(bad, dtype), lens, pages, cu, ns), **kw)
    assert np.all(np.isfinite(want))
    np.testing.assert_array_equal(got, want)


# JAX's own RPA test lists (jax tests/pallas/tpu_ragged_paged_attention_test.py): (q_len, kv_len) per sequence.
JAX_DECODE = [(1, 18), (1, 129), (1, 597), (1, 122), (1, 64), (1, 322), (1, 463), (1, 181), (1, 1107), (1, 123),
              (1, 31), (1, 18), (1, 1229), (1, 229), (1, 87), (1, 1328)]
JAX_MIXED = [(5, 18), (1, 129), (120, 597), (1, 122), (1, 64), (32, 322), (251, 463), (1, 181), (1, 1107),
             (99, 123), (1, 31), (5, 18), (3, 1229), (117, 229), (1, 87), (1, 1328)]
JAX_PREFILL = [(5, 18), (15, 129), (120, 597), (100, 122), (21, 64), (32, 322), (251, 463), (40, 181), (64, 1107),
               (99, 123), (10, 31), (5, 18), (3, 1229), (120, 229), (9, 87), (2, 1328)]


def _jax_list_case(seq_lens, head_dim, page_size, hq, hkv, seed, max_seqs=None):
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = zip(*seq_lens)
    pps = -(-max(kv_lens) // page_size)
    return make_case(rng, list(q_lens), list(kv_lens), num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                     page_size=page_size, pages_per_seq=pps, num_pages=pps * len(seq_lens) + 2,
                     max_seqs=max_seqs)


@pytest.mark.parametrize("head_dim,kw", [(128, dict(k_scale=0.5, v_scale=2.0)),
                                         (256, dict(sliding_window=128, soft_cap=20.0))])
def test_jax_decode_list_decode_variant(head_dim, kw):
    """JAX's decode-only list through the decode variant (max_q_len 1: one query row per KV head and sequence,
    no causal mask), padded metadata (max_seqs 20 > 16 sequences), the pipeline crossing 16 sequences."""
    args = _jax_list_case(JAX_DECODE, head_dim, 64, 4, 2, head_dim, max_seqs=20)
    kw = dict(sm_scale=head_dim ** -0.5, max_q_len=1, pages_per_block=4) | kw
    assert_close(run_kernel(args, **kw), run_reference(args, **kw))


@pytest.mark.parametrize("seq_lens", [JAX_MIXED, JAX_PREFILL], ids=["mixed", "prefill"])
def test_jax_mixed_and_prefill_lists_window_soft_cap(seq_lens):
    """JAX's mixed and prefill-only lists (queries of 1-251 tokens): several query blocks per sequence, each
    item's window spilling into the next sequence's rows, which that sequence's later write must overwrite."""
    args = _jax_list_case(seq_lens, 128, 64, 4, 1, 21)
    kw = dict(sm_scale=0.08, sliding_window=200, soft_cap=30.0, block_q=32, pages_per_block=4)
    assert_close(run_kernel(args, **kw), run_reference(args, **kw))


def test_sequences_without_queries_and_no_sequences():
    """A valid sequence with q_len 0 has no work item (and no rows); num_seqs 0 gives an all-zero output."""
    rng = np.random.default_rng(14)
    args = list(make_case(rng, [3, 0, 2, 0], [9, 5, 20, 4], num_q_heads=4, num_kv_heads=2, head_dim=64,
                          page_size=8, pages_per_seq=3, num_pages=14))
    kw = dict(sm_scale=0.2, pages_per_block=2, block_q=2)
    assert_close(run_kernel(args, **kw), run_reference(args, **kw))
    args[5] = np.array([0], np.int32)
    assert np.all(run_kernel(args, **kw) == 0)


def test_work_items_list_real_blocks_only():
    from kernels_pallas.attention.tpu import work_items

    cu = jnp.array([0, 5, 5, 6, 23, 23, 23], jnp.int32)  # q_lens 5, 0, 1, 17 and two padding slots
    items = work_items(cu, jnp.array([4], jnp.int32), block_q=8, num_tokens=24)
    n = int(items.count[0])
    assert n == 1 + 0 + 1 + 3
    assert items.seq.shape == (3 + 6,)
    assert list(np.asarray(items.seq[:n])) == [0, 2, 3, 3, 3]
    assert list(np.asarray(items.qb[:n])) == [0, 0, 0, 1, 2]


def test_block_size_table():
    from kernels_pallas.attention.tpu import schedule_params
    from kernels_pallas.attention.tpu_block_sizes import KV_BUFFER_BYTES, TUNED, block_sizes, chip_generation

    assert chip_generation("TPU v6 lite") == "v6e" and chip_generation("TPU v5 lite") == "v5e"
    assert chip_generation("TPU v5") == "v5p"
    for (chip, head_dim, dtype, page_size, case), (kv_tokens, block_q) in TUNED.items():
        got = block_sizes(chip, head_dim, dtype, page_size, 1 if case == "decode" else 64)
        assert (got.kv_tokens, got.block_q) == (kv_tokens, block_q)
        assert kv_tokens % page_size == 0
    assert block_sizes("v6e", 128, "bfloat16", 16, 1).block_q == 1
    assert block_sizes("v6e", 128, "bfloat16", 16, 3).block_q == 3  # never more rows than the longest query
    with pytest.raises(ValueError, match="unknown TPU chip"):
        block_sizes("v4", 128, "bfloat16", 16, 1)
    # Llama-3-8B decode on v6e: one grid step, each DMA one page of all 8 KV heads (64 KiB), 64 pages a block.
    plan = schedule_params((64, 32, 128), (8, 8193, 16, 256), jnp.bfloat16, (64, 128), max_q_len=1, chip="v6e")
    assert plan["decode"] and plan["pages_per_block"] == 64 and plan["vmem_limit_bytes"] == 64 << 20
    assert plan["kv_heads_per_block"] == 8 and plan["bytes_per_kv_dma"] == 8 * 16 * 256 * 2
    assert plan["vmem_scratch_bytes"] == (2 * 64 * 8 * 16 * 256 * 2 + 2 * 2 * 8 * 4 * 128 * 4
                                          + 8 * 4 * (2 * 128 + 128) * 4)
    # v5p (two cores): two steps of 4 heads; 32 KV heads of D 256: the KV buffer budget caps the block.
    assert schedule_params((64, 32, 128), (8, 8193, 16, 256), jnp.bfloat16, (64, 128), max_q_len=1,
                           chip="v5p")["kv_heads_per_block"] == 4
    big = schedule_params((64, 32, 256), (32, 8193, 16, 512), jnp.bfloat16, (64, 128), max_q_len=1, chip="v6e")
    assert big["pages_per_block"] == KV_BUFFER_BYTES["v6e"] // (2 * big["bytes_per_kv_dma"]) < 512 // 16
    with pytest.raises(ValueError, match="must divide"):
        schedule_params((64, 32, 128), (8, 8193, 16, 256), jnp.bfloat16, (64, 128), kv_heads_per_block=3, chip="v6e")


def test_kv_heads_per_block_split_grid():
    """4 KV heads in grid steps of 2 (a megacore chip's split; the default takes all 4 in one step, and the race
    test steps of 1): each step's page DMAs move only its own heads, and its q / out rows are its heads' columns."""
    rng = np.random.default_rng(15)
    args = make_case(rng, [1, 9, 1, 4], [20, 9, 1, 30], num_q_heads=8, num_kv_heads=4, head_dim=64, page_size=8,
                     pages_per_seq=4, num_pages=19)
    kw = dict(sm_scale=0.125, pages_per_block=2, block_q=4, soft_cap=5.0)
    assert_close(run_kernel(args, kv_heads_per_block=2, **kw), run_reference(args, **kw))
