"""The Pallas Triton (GPU) ragged paged attention kernel, run in Pallas' generic interpreter on CPU, against the
pure-JAX reference, an independent numpy loop and JAX's in-tree reference; plus the Triton lowering itself.

Interpreted cases cost seconds each (mostly compiling the interpreter's grid loop), so the sweep is pairwise:
every value of each factor (batch kind, page size 8/16/64, GQA ratio 1/3/8, head_dim 64/128, window, soft cap,
int8 KV, split-KV, dtype, empty / one-page / page-crossing sequences, padding) appears, not every combination.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import ragged_paged_attention
from kernels_pallas.kv_cache import quantize_int8
from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from tests.test_ragged_paged_attention import make_case, naive
from tests.test_ragged_paged_attention_tpu import assert_close, run_reference

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


def build(name):
    """(q, kv_pages, [kv_lens, page_indices, cu_q_lens, num_seqs], dtype, kw, safe page_indices for the loop)."""
    q_lens, kv_lens, (hq, hkv), head_dim, page_size, pps, max_seqs, dtype, kw = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    num_pages = pps * max_seqs + 2
    q, kv, lens, pages, cu, ns = make_case(rng, q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                                           page_size=page_size, pages_per_seq=pps, num_pages=num_pages,
                                           max_seqs=max_seqs)
    safe = pages.copy()
    if name == "decode_g3_p8_d64":
        unused = sorted(set(range(num_pages)) - set(pages[:len(q_lens)].ravel()))[0]
        kv[unused] = np.nan  # a real out-of-range read could return anything
        for s in range(max_seqs):  # table entries past each sequence's pages point far out of the pool
            pages[s, -(-lens[s] // page_size) if s < len(q_lens) else 0:] = num_pages + 1000
        safe = np.where(pages >= num_pages, 0, pages)
        q = np.concatenate([q, rng.standard_normal((3, hq, head_dim)).astype(np.float32)])  # padding tokens
    return q, kv, [lens, pages, cu, ns], dtype, kw, safe


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
        kv_q, scales = quantize_int8(jnp.asarray(kv))
        got = np.asarray(run_gpu((q, kv_q, *rest), kv_scales=scales, sm_scale=0.125, **kw))
        assert_close(got, run_reference((q, kv_q, *rest), kv_scales=scales, **ref_kw))
        deq = np.asarray(kv_q, np.float32) * np.asarray(scales)[..., None]  # independent second opinion
        assert_close(got, naive(q, deq, *rest, **naive_kw))
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
    theirs = in_tree.ref_ragged_paged_attention(*args, **kw)
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


def test_lowers_to_triton():
    """Export for CUDA runs the Pallas -> Triton IR lowering on CPU (power-of-two tiles, supported primitives; bf16
    queries over an int8 cache with split-KV, the widest path); the Triton compiler itself only runs on a GPU."""
    rng = np.random.default_rng(11)
    args = list(map(jnp.asarray, make_case(rng, [1, 9, 4], [20, 9, 30], num_q_heads=9, num_kv_heads=3, head_dim=64,
                                           page_size=16, pages_per_seq=2, num_pages=11)))
    args[0] = args[0].astype(jnp.bfloat16)
    args[1], scales = quantize_int8(args[1])
    fn = jax.jit(lambda *a, s: ragged_paged_attention_gpu(*a, kv_scales=s, sm_scale=0.125, sliding_window=5,
                                                          soft_cap=3.0, num_kv_splits=2))
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args, s=scales)
    assert "xla.gpu.triton" in exported.mlir_module()


def test_auto_picks_gpu_kernel_on_gpu_only_where_it_tiles(monkeypatch):
    from kernels_pallas import dispatch

    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    assert dispatch.resolve_impl("auto", 16, 128) == "gpu"
    assert dispatch.resolve_impl("auto", 16, 80) == "reference"  # head_dim 80: Triton cannot tile it
    assert dispatch.resolve_impl("auto", 12, 64) == "reference"
    assert dispatch.resolve_impl("tpu", 16, 64) == "tpu"
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "cpu")
    from kernels_pallas import ragged_paged_attention_cpu

    assert dispatch.resolve_impl("auto", 16, 128) == ("cpu" if ragged_paged_attention_cpu.available() else "reference")


def test_default_kv_splits_fill_the_grid():
    from kernels_pallas.ragged_paged_attention_gpu import default_kv_splits

    assert default_kv_splits(8 * 3, 16) == 16  # SmolLM2 decode at batch 8, 2048 tokens: 24 programs -> 16 splits
    assert default_kv_splits(64 * 8, 16) == 1  # 64 sequences x 8 KV heads already fill the GPU
    assert default_kv_splits(2 * 2, 2) == 2  # never more splits than KV blocks
