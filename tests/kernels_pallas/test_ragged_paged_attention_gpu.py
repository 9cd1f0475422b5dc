"""The Pallas Triton (GPU) ragged paged attention kernel, run in Pallas' generic interpreter on CPU, against the
pure-JAX reference, an independent numpy loop and JAX's in-tree reference; a pool poisoned with NaN/Inf wherever
no query may look; plus the Triton lowering, the compile-log parser and the tuning table. The real compiler (Triton
and ptxas, deviceless, H100 and H200) runs in tests/scripts/test_aot_compile.py, through the one compile harness.

Interpreted cases cost seconds each (mostly compiling the interpreter's grid loop), so the sweep is pairwise:
every value of each factor (batch kind, page size 8/16/64, GQA ratio 1/3/8, head_dim 64/128, window, soft cap,
int8 KV, split-KV, dtype, empty / one-page / page-crossing sequences, padding) appears, not every combination.
Caches are in kv_cache/layout.py's layout (`make_case`, `writes.quantize_cache`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import ragged_paged_attention
from kernels_pallas.kv_cache.writes import quantize_cache
from kernels_pallas.kv_cache.layout import scales_by_page, split_kv
from kernels_pallas.attention.gpu import ragged_paged_attention_gpu
from tests.kernels_pallas.test_ragged_paged_attention import make_case, naive
from tests.kernels_pallas.test_ragged_paged_attention_cpu import poison, poisoned_pool_case
from tests.kernels_pallas.test_ragged_paged_attention_tpu import assert_close, run_reference

# name: q_lens, kv_lens, (Hq, Hkv), head_dim, page_size, pages_per_seq, max_seqs, dtype, kw
CASES = {
    # decode: kv 8 = exactly one page, 13 crosses a page, 0 = an empty sequence; 2 padding sequences, padding
    # tokens, garbage page-table tails and a NaN page no sequence uses (see `build`)
    "decode_g3_p8_d64": ([1, 1, 0, 1], [8, 13, 0, 33], (9, 3), 64, 8, 5, 6, "float32",
                         dict(max_q_len=1, num_kv_splits=1)),
    # prefill only, MHA: 16 tokens = one page and two query blocks
    "prefill_g1_p16_d128": ([16, 11, 3], [16, 11, 3], (3, 3), 128, 16, 1, 3, "float32", dict(num_kv_splits=1)),
    "mixed_g8_p64_window_softcap_split2": ([1, 9, 1, 4], [100, 9, 1, 70], (8, 1), 64, 64, 2, 4, "float32",
                                           dict(sliding_window=40, soft_cap=3.0, num_kv_splits=2)),
    "mixed_g8_p8_d128_int8": ([1, 7, 3], [19, 7, 12], (16, 2), 128, 8, 3, 3, "int8", dict(num_kv_splits=1)),
    "decode_g1_p16_int8_window_split3": ([1, 1], [70, 5], (4, 4), 64, 16, 5, 3, "int8",
                                         dict(max_q_len=1, sliding_window=30, num_kv_splits=3)),
    # num_kv_splits left to the default (default_kv_splits: 2 here, one per 64-token KV block)
    "chunked_prefill_g3_p64_d128_bf16_softcap": ([6, 2], [70, 2], (6, 2), 128, 64, 2, 2, "bfloat16",
                                                 dict(soft_cap=5.0, pages_per_block=1)),
    "decode_g8_p16_d128_bf16_split4": ([1, 1, 1], [64, 1, 40], (8, 1), 128, 16, 4, 3, "bfloat16",
                                       dict(max_q_len=1, num_kv_splits=4)),
}


def build(name, cases=None, *, garbage_case="decode_g3_p8_d64"):
    """(q, kv_pages, [kv_lens, page_indices, cu_q_lens, num_seqs], dtype, kw, safe page_indices for the loop) of
    case `name` of `cases` (this module's CASES by default); `garbage_case` also gets a NaN page nobody uses,
    page-table tails far out of the pool and padding tokens (the Mosaic GPU tests name their own)."""
    q_lens, kv_lens, (hq, hkv), head_dim, page_size, pps, max_seqs, dtype, kw = (cases or CASES)[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    num_pages = pps * max_seqs + 2
    q, kv, lens, pages, cu, ns = make_case(rng, q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                                           page_size=page_size, pages_per_seq=pps, num_pages=num_pages,
                                           max_seqs=max_seqs)
    safe = pages.copy()
    if name == garbage_case:
        unused = sorted(set(range(num_pages)) - set(pages[:len(q_lens)].ravel()))[0]
        kv[:, unused] = np.nan  # a real out-of-range read could return anything
        for s in range(max_seqs):  # table entries past each sequence's pages point far out of the pool
            pages[s, -(-lens[s] // page_size) if s < len(q_lens) else 0:] = num_pages + 1000
        safe = np.where(pages >= num_pages, 0, pages)
        q = np.concatenate([q, rng.standard_normal((3, hq, head_dim)).astype(np.float32)])  # padding tokens
    return q, kv, [lens, pages, cu, ns], dtype, kw, safe


def dequantize(kv_q, scales) -> np.ndarray:
    """An int8 cache and its scales -> the float32 cache they stand for (kv_cache/layout.py's layout)."""
    num_kv_heads, num_pages, page_size, _ = kv_q.shape
    by_page = np.asarray(scales_by_page(jnp.asarray(scales), num_pages, page_size))  # [Hkv, P, 2, ps]
    k, v = (np.asarray(x, np.float32) for x in split_kv(np.asarray(kv_q)))
    return np.concatenate([k * by_page[:, :, 0, :, None], v * by_page[:, :, 1, :, None]], axis=-1)


def run_gpu(args, kv_scales=None, **kw):
    fn = jax.jit(lambda *a, s: ragged_paged_attention_gpu(*a, kv_scales=s, interpret=True, **kw))
    return fn(*map(jnp.asarray, args), s=kv_scales)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name):
    q, kv, rest, dtype, kw, safe = build(name)
    ref_kw = {k: v for k, v in kw.items() if k not in ("num_kv_splits", "pages_per_block")} | {"sm_scale": 0.125}
    naive_kw = {k: v for k, v in ref_kw.items() if k != "max_q_len"}
    safe_rest = [rest[0], safe, *rest[2:]]
    if dtype == "int8":  # quantized cache: both sides read the same int8 values and scales
        kv_q, scales = quantize_cache(jnp.asarray(kv))
        got = np.asarray(run_gpu((q, kv_q, *rest), kv_scales=scales, sm_scale=0.125, **kw))
        assert_close(got, run_reference((q, kv_q, *rest), kv_scales=scales, **ref_kw))
        assert_close(got, naive(q, dequantize(kv_q, scales), *rest, **naive_kw))  # independent second opinion
    elif dtype == "bfloat16":  # bf16 dots with f32 accumulation, against the f32 reference on the rounded values
        q16, kv16 = jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16)
        got = run_gpu((q16, kv16, *rest), sm_scale=0.125, **kw)
        assert got.dtype == jnp.bfloat16
        want = run_reference((q16.astype(jnp.float32), kv16.astype(jnp.float32), *rest), **ref_kw)
        assert_close(np.asarray(got.astype(jnp.float32)), want, tol=2e-2)
    else:
        got = np.asarray(run_gpu((q, kv, *rest), sm_scale=0.125, **kw))
        num_real = int(rest[2][-1])  # tokens of valid sequences; any after them are padding
        assert_close(got[:num_real], naive(q[:num_real], kv, *safe_rest, **naive_kw))
        assert np.all(got[num_real:] == 0), "padding tokens must come back as zeros"
        if (safe == rest[1]).all():  # the reference itself would follow a garbage table entry
            assert_close(got, run_reference((q, kv, *rest), **ref_kw))


def test_matches_jax_in_tree_reference_through_dispatch():
    """Shared semantics with jax.experimental.pallas.ops.tpu.ragged_paged_attention (static k/v scales too), through
    the dispatcher with impl="gpu"; off GPU, "auto" (the C++ CPU kernel, or the reference) agrees too."""
    in_tree = pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
    rng = np.random.default_rng(3)
    args = tuple(map(jnp.asarray, make_case(rng, [1, 6, 3], [17, 6, 25], num_q_heads=9, num_kv_heads=3,
                                            head_dim=64, page_size=8, pages_per_seq=4, num_pages=14)))
    kw = dict(sm_scale=0.125, sliding_window=9, soft_cap=20.0, k_scale=0.5, v_scale=1.5)
    ours = jax.jit(lambda *a: ragged_paged_attention(*a, impl="gpu", interpret=True, **kw))(*args)
    q, kv, *rest = args  # theirs reads [pages, page_size, 2 * Hkv, D], K at even and V at odd head slots
    hkv, num_pages, page_size, width = kv.shape
    interleaved = kv.reshape(hkv, num_pages, page_size, 2, width // 2).transpose(1, 2, 0, 3, 4).reshape(
        num_pages, page_size, 2 * hkv, width // 2)
    theirs = in_tree.ref_ragged_paged_attention(q, interleaved, *rest, **kw)
    assert_close(np.asarray(ours), np.asarray(theirs))
    if jax.default_backend() != "gpu":
        auto = jax.jit(lambda *a: ragged_paged_attention(*a, **kw))(*args)
        assert_close(np.asarray(auto), np.asarray(theirs))


def test_rejects_shapes_triton_cannot_tile():
    rng = np.random.default_rng(4)
    args = tuple(map(jnp.asarray, make_case(rng, [1], [5], num_q_heads=2, num_kv_heads=1, head_dim=64,
                                            page_size=12, pages_per_seq=1, num_pages=2)))
    with pytest.raises(ValueError, match="powers of two"):
        ragged_paged_attention_gpu(*args, interpret=True)
    args = tuple(map(jnp.asarray, make_case(rng, [1], [5], num_q_heads=2, num_kv_heads=1, head_dim=64,
                                            page_size=8, pages_per_seq=1, num_pages=2)))
    with pytest.raises(ValueError, match="power of two >= 16"):
        ragged_paged_attention_gpu(*args, interpret=True, block_q=4)


def poisoned_int8_pools(rng, clean, seen, dtype=jnp.int8):
    """{"clean": (int8 (or `dtype`: fp8) pages, scales), "dirty": the same with random bytes in every slot not
    `seen` (for fp8 NaN codes among them) and NaN/Inf in their scales and in the scales' padding tail} for a float
    pool `clean` (kv_cache/layout.py)."""
    kv_q, scales = (np.asarray(x) for x in quantize_cache(jnp.asarray(clean), dtype))
    stale = rng.integers(-128, 128, kv_q.shape, dtype=np.int8).view(kv_q.dtype)
    dirty = np.where(seen[None, :, :, None], kv_q, stale)
    flat_seen = np.zeros(scales[0].size, bool)
    flat_seen[:seen.size * 2] = np.repeat(seen, 2, axis=0).reshape(-1)  # page after page: K scales, V scales
    assert not flat_seen.all()  # the padding tail is poisoned too
    return {"clean": (kv_q, scales), "dirty": (dirty, poison(scales, flat_seen.reshape(scales.shape[1:])))}


@pytest.mark.parametrize("kv_dtype,options", [
    ("float32", {}),
    ("bfloat16", {"sliding_window": 5, "num_kv_splits": 2}),
    ("int8", {"sliding_window": 1, "soft_cap": 3.0}),
])
def test_stale_non_finite_slots_change_no_output(kv_dtype, options):
    """NaN/Inf in every slot no query may see (past kv_len, before the window, unused pages, the page padding
    entries of page_indices point at, the keys of a sequence without queries, the int8 scales' padding) leave the
    output bit-identical to the clean pool's; query blocks of 8 tokens and KV blocks of 16 put stale slots inside
    blocks the kernel loads (the 9-token prefill spans two query blocks with different window starts)."""
    rng = np.random.default_rng(8)
    (q, clean, *rest), seen = poisoned_pool_case(rng, head_dim=64, sliding_window=options.get("sliding_window"))
    kw = dict(sm_scale=0.125, block_q=8, pages_per_block=4) | options
    if kv_dtype == "int8":
        pools = poisoned_int8_pools(rng, clean, seen)
    else:
        dirty = poison(clean, seen[None, :, :, None])
        pools = {name: (jnp.asarray(x, kv_dtype), None) for name, x in (("clean", clean), ("dirty", dirty))}
    out = {name: np.asarray(run_gpu((q, kv, *rest), kv_scales=None if s is None else jnp.asarray(s), **kw))
           for name, (kv, s) in pools.items()}
    assert np.isfinite(out["dirty"]).all()
    np.testing.assert_array_equal(out["dirty"], out["clean"])
    kv, s = pools["clean"]
    want = run_reference((q, kv, *rest), kv_scales=s, **{k: v for k, v in kw.items() if k != "num_kv_splits"})
    assert_close(out["clean"], want, tol=2e-2 if kv_dtype == "bfloat16" else 2e-5)


def export_for_cuda(fn, *args, **kwargs):
    """`jax.export` for CUDA on a CPU host: jax >= 0.11's Triton lowering wants the target GPU named by an abstract
    mesh (the kernels' block sizes read it too); older jax ignores it."""
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)):
        return jax.export.export(fn, platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args, **kwargs)


def test_lowers_to_triton():
    """Export for CUDA runs the Pallas -> Triton IR lowering on CPU (power-of-two tiles, supported primitives; bf16
    queries over an int8 cache with split-KV, the widest path) without the GPU compiler."""
    rng = np.random.default_rng(11)
    args = list(map(jnp.asarray, make_case(rng, [1, 9, 4], [20, 9, 30], num_q_heads=9, num_kv_heads=3, head_dim=64,
                                           page_size=16, pages_per_seq=2, num_pages=11)))
    args[0] = args[0].astype(jnp.bfloat16)
    args[1], scales = quantize_cache(args[1])
    fn = jax.jit(lambda *a, s: ragged_paged_attention_gpu(*a, kv_scales=s, sm_scale=0.125, sliding_window=5,
                                                          soft_cap=3.0, num_kv_splits=2))
    assert "xla.gpu.triton" in export_for_cuda(fn, *args, s=scales).mlir_module()


def test_compile_report_parses_ptxas_and_triton_lines():
    from kernels_pallas.gpu_compile_report import parse_compile_log

    log = """I1201 xtile_compiler.cc:595] Shared memory usage: 98304 B
ptxas info    : Compiling entry function 'ragged_paged_attention_gpu' for 'sm_90a'
ptxas info    : Function properties for ragged_paged_attention_gpu
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 173 registers, used 1 barriers
ptxas info    : Compiling entry function 'loop_transpose_fusion' for 'sm_90a'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers"""
    report = parse_compile_log(log)
    assert report["shared_memory"] == [98304]
    assert report["kernels"]["ragged_paged_attention_gpu"] == dict(arch="sm_90a", registers=173, stack_frame=8,
                                                                   spill_stores=4, spill_loads=12)
    assert report["kernels"]["loop_transpose_fusion"]["registers"] == 10


def test_block_sizes_come_from_the_chip_table():
    from kernels_pallas.attention.gpu import block_config, gpu_chip
    from kernels_pallas.attention.gpu_tuning import BLOCK_SIZES

    assert gpu_chip("NVIDIA H100 80GB HBM3") == "h100" and gpu_chip("NVIDIA H200") == "h200"
    assert gpu_chip("NVIDIA A100-SXM4-80GB") == "default"
    assert set(BLOCK_SIZES) == {"h100", "h200", "default"}
    # bf16 prefill, group 4, D=128: 128 rows (32 tokens), 64-token KV blocks (32 KiB of K + V), 8 warps
    assert block_config("h100", 4, 16, 32, 512, 256, 128, "bfloat16") == dict(
        block_q=32, pages_per_block=4, num_warps=8, num_stages=2)
    # decode: one token x the group, padded to 16 rows; D=64 fits 256 tokens in the same 64 KiB
    assert block_config("h200", 4, 16, 64, 1, 128, 64, "bfloat16")["block_q"] == 4
    assert block_config("h200", 4, 16, 64, 1, 128, 64, "bfloat16")["pages_per_block"] == 16
    # a short sequence: the KV block is not much longer than it; MLA's 512-wide value: fewer rows
    assert block_config("h100", 4, 16, 2, 1, 256, 128, "bfloat16")["pages_per_block"] == 2
    assert block_config("h100", 16, 16, 32, 512, 576, 512, "bfloat16")["block_q"] == 2


def test_tuning_is_data_with_its_measurement():
    """Every (chip, kind, dtype) has an entry and the split rule; each says what it rests on: a timing (the run
    named by chip and date) or "default"; mixed batches have entries of their own, reached from the static shape."""
    from kernels_pallas.attention import gpu_tuning as t

    for chip, table in t.BLOCK_SIZES.items():
        assert set(table) == {(k, d) for k in t.KINDS for d in t.DTYPES}, chip
        for key, entry in table.items():
            assert entry.source.startswith(("default", "H200, 2026-12-04")), (chip, key, entry.source)
        assert t.SPLIT_RULES[chip].source
    timed = {k for k, e in t.BLOCK_SIZES["h200"].items() if not e.source.startswith("default")}
    assert timed == {("decode", "bfloat16"), ("decode", "int8"), ("mixed", "bfloat16")}  # BENCHMARKS.md's H200 section
    assert all(e.source.startswith("default") for e in t.BLOCK_SIZES["h100"].values())  # never run on an H100
    assert t.batch_kind(1, 64, 64) == "decode"
    assert t.batch_kind(512, 2048, 4) == "prefill"  # the engine's prefill bucket: every slot can be full
    assert t.batch_kind(512, 1040, 18) == "mixed"  # kernel_bench's mixed case: 16 decodes + 2 x 512
    with pytest.raises(ValueError, match="no Triton tuning entry"):
        t.blocks("h200", "verify", "bfloat16")


def test_auto_picks_gpu_kernel_on_gpu_only_where_it_tiles(monkeypatch):
    from kernels_pallas.attention import dispatch

    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    assert dispatch.resolve_impl("auto", 16, 128) == "gpu"
    assert dispatch.resolve_impl("auto", 16, 80) == "reference"  # head_dim 80: Triton cannot tile it
    assert dispatch.resolve_impl("auto", 12, 64) == "reference"
    assert dispatch.resolve_impl("tpu", 16, 64) == "tpu"
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "cpu")
    from kernels_pallas.attention import cpu
    from kernels_pallas.native import gate

    assert dispatch.resolve_impl("auto", 16, 128) == ("cpu" if gate.runs_here(cpu.KERNEL) else "reference")


def test_default_kv_splits_fill_the_grid():
    from kernels_pallas.attention.gpu import default_kv_splits

    assert default_kv_splits(8 * 3, 16) == 16  # SmolLM2 decode at batch 8, 2048 tokens: 24 programs -> 16 splits
    assert default_kv_splits(64 * 8, 16) == 1  # 64 sequences x 8 KV heads already fill the GPU
    assert default_kv_splits(2 * 2, 2) == 2  # never more splits than KV blocks
