"""Ragged paged attention as a Pallas Mosaic GPU kernel for Hopper (sm_90a: H100, H200): TMA page copies into a
multi-stage shared-memory pipeline, QK and PV on warpgroup MMA (wgmma), online softmax in registers, optional
split-KV with a combine pass. Same signature and semantics as `ragged_paged_attention_reference`.

Status: tested on CPU in Mosaic GPU's interpret mode against the reference; compiled deviceless for sm_90a in the
tests where jax-cuda13-plugin is installed; run once on an H200 (2026-12-04; figures in BENCHMARKS.md): it matched
the f32 reference and was slower than the Triton kernel in decode and with int8; its non-finite output on padded
metadata there is fixed (`clean_metadata`).

Design (why it is shaped this way):
  * One program (a CUDA block of one warpgroup, 128 threads) owns one 64-row query tile of one KV head. A tile's
    rows are (token, query head of the group) pairs, token-major: `block_q = 64 // group` tokens of one sequence
    times the `group = Hq // Hkv` query heads that share KV head h, so every page read serves the whole group
    (GQA's bandwidth saving) and the M of each wgmma is the 64 rows of one warpgroup MMA.
  * The grid is over tiles, not (sequence, query block): sequence s gets `cdiv(q_len_s, block_q)` tiles, numbered
    consecutively; the static bound `cdiv(T, block_q) + S` tiles covers any split of T tokens into S sequences,
    so no program is spent on the empty query blocks of a `(S, max_q_blocks)` grid. The wrapper computes each
    tile's scalars (sequence, first query position, the key range, the KV-block range of each KV split) in
    plain XLA (`mosaic_gpu_tiles.py`), and the kernel reads them from one small int32 array in GMEM. That
    bookkeeping first empties the slots past `num_seqs` (`clean_metadata`): callers pad them as they like (JAX's
    tests pad `cu_q_lens` with zeros), and its binary searches need a non-decreasing `cu_q_lens`.
  * q and the output live in the tiles' layout `[Hkv, tiles * 64, D]` (a scatter of q before the kernel, a gather
    of the output after it, both plain XLA over T * Hq * D elements): a tile's rows start at `tile * 64`, because
    a TMA copy into (8, 64)-tiled shared memory needs a GMEM row offset that is a multiple of 8 (Mosaic's layout
    inference rejects `token * group`), and every tile owns its 64 output rows, so the epilogue stores the whole
    tile with one TMA copy (a TMA store cannot be masked per row) and no program writes rows another owns.
  * KV: a KV block is `block_kv` tokens (64, or the page if larger) = `block_kv // page_size` whole pages. Per
    page, K (lanes [0, D)) and V (lanes [D, 2D)) of KV head h are two strided TMA copies `kv[h, page, :, 0:D]`
    and `kv[h, page, :, D:2D]` into the block's stage of the K and V buffers (128-byte swizzle, (8, 64) tiles, as
    wgmma reads them); all copies of a stage arrive on one mbarrier (arrival count = copies per stage).
    `num_stages` stages are in flight: the prologue issues the first blocks, and once block b's PV MMA has
    completed (its accumulator is read back) the same warpgroup issues block b + num_stages into the freed slot.
    Page-table entries past a sequence's last page become page 0 in the wrapper: a garbage entry is never
    followed. No warp specialization yet (one warpgroup issues the TMAs and does the math; a producer warpgroup
    and two consumer warpgroups, as JAX's `attention_mgpu` does, is the next step, to be decided on timings).
  * int8 cache (`kv_scales`, per-token-per-head f32 scales, `kv_cache/layout.py`): the pages arrive int8 by the
    same TMA copies into int8 stage buffers (64-byte swizzle at D 64), half the bytes of bf16. Each block's
    scales arrive on the stage's mbarrier too, as one TMA copy of two contiguous rows (K's, V's) of a per-sequence
    array the wrapper gathers (`scales_by_sequence` says why not one TMA per page). Before the MMAs the
    warpgroup dequantizes the stage into one bf16 K tile and one bf16 V tile in shared memory (`int8 * scale` in
    f32 registers, in int8's own WGMMA_8BIT layout on jax >= 0.11, each token's scale a row broadcast, rounded
    to q's dtype), and the two wgmmas read those, as for a bf16 cache. V scales outside [kv_lo, kv_hi) are zeroed
    first, so stale V rows become exact zeros in every block (the bf16 path's first / last block fix-up is not
    needed). Scaling the tiles rather than the score and probability columns (the Triton kernel's way) keeps
    the MMA operands and the softmax code one path for both caches; its rounding is that of a bf16 cache.
  * Stale slots (NaN/Inf past kv_len, before the window, in pages padding entries point at): keys outside the
    tile's range [kv_lo, kv_hi) get the mask value in their score column (a `where`, so a NaN K stays harmless),
    and in the first and last block of the range (the only ones that can hold such keys) V's rows outside the
    range are overwritten with zeros in shared memory before the PV MMA, because a masked key's probability is 0
    (or 1 while its row has seen nothing yet; wiped by alpha = 0 at its first visible key) and 0 * NaN is NaN.
  * Split-KV (`num_kv_splits`, static; default: enough for ~512 programs, `default_kv_splits`): a tile's KV-block
    range is cut into contiguous chunks on a third grid axis; each writes its normalized f32 output and
    log-sum-exp, and a tiny XLA pass combines them. An empty chunk writes zeros and lse = -inf (weight 0).
  * fp8 (float8_e4m3fn) cache: the int8 path with e4m3 codes (the same 1-byte stages, TMA copies, scales and
    dequantization), and, since an e4m3 code can be NaN, the first / last block's stale V rows zeroed in the
    dequantized tile as a bf16 cache's are.
  * Precision: bf16 / f16 q with a cache of that dtype, int8 or fp8 (dequantized to q's dtype): MMAs in q's dtype with
    f32 accumulation, probabilities rounded to q's dtype for PV (as the Triton kernel); exact `exp`
    (`approx_math=False`). f32 inputs (q or cache) are not supported (`supports` says False, the entry point
    raises NotImplementedError naming impl='gpu'): the Triton kernel's f32 path is IEEE f32 (`Precision.HIGHEST`,
    FMAs on the CUDA cores), not bf16 with f32 accumulation, because f32 is the accuracy path (the reference's and
    the CPU kernel's numbers). wgmma's only 32-bit input type is TF32 (~5e-4 off at D 128, gpu.py's docstring),
    so a real f32 path here would be 3xTF32 (hi/lo splits, three MMAs per product); and Mosaic GPU's CPU
    interpreter computes an f32 wgmma exactly, so no CPU test could see a TF32 path's error. Also unsupported:
    head_dim other than 64 or 128, page sizes not a multiple of 8 or not dividing the KV block.
  * No MLA variant yet (MLA stays on the Triton kernel, `mla/gpu.py`): its value is the 512-lane latent, and a
    64-row f32 accumulator of 512 lanes is 256 registers a thread, past the ceiling of one warpgroup; it needs the
    value split over warpgroups (or passes), a different program shape, to be designed after this kernel's first
    timings.
  * Interpret mode differs from the compiled kernel in two places, because Mosaic GPU's interpreter cannot run
    them: its wgmma reads the A operand only from shared memory and runs neither `run_state(ACC.init(acc))` nor a
    store into an accumulator, so interpreted, P is staged through a shared-memory tile and a fresh PV
    accumulator is added to acc (compiled: P is the register A operand and the MMA accumulates into acc); and on
    jax 0.10 (no layout ops, no transposed wgmma operand in its interpreter) both products are `dot_general`s on
    the same shared-memory tiles (`OLD_INTERPRETER`). TMA copies, barriers, the pipeline, masking, the V fix-up,
    the tile bookkeeping and the split combine are the same code in both.

What the compiler said (deviceless, sm_90a, `scripts/tools/aot_compile.py --chips=h100 --what=mosaic_gpu`;
H100 and H200 identical; jax 0.12.0.1, in parentheses jax 0.10.2, which prints no shared-memory figure; the same
figures at the batch shapes of the harness's other kernel cases, recompiled 2026-12-04, as at the shapes below):
  * decode 64 seqs x 2048 tokens, Hq 32 / Hkv 8 / D 128 bf16, 16-token pages (4 stages of 64 tokens, no split):
    209 (219) registers, 0 spills, 149504 B shared memory (q tile 16 KiB + 4 x (K 16 + V 16) KiB + barriers);
  * the same with 4 KV splits: 225 (221) registers, 0 spills, 183296 B (+ the f32 output tile and lse);
  * mixed 4 x 512-token prefills + 60 decodes (the harness: 2 x 256 + 32): 209 (219) registers, 0 spills, 149504 B;
  * D 64, Hq 32 / Hkv 4, 64-token pages, window + soft cap: 214 (215) registers, 0 spills, 93184 B;
  * int8 cache, the decode shape: 226 (241) registers, 0 spills, 118784 B (q 16 KiB + 4 x (K 8 + V 8)
    KiB int8 stages + 4 x 512 B scales + the bf16 K and V tiles 2 x 16 KiB); the mixed batch: the same figures;
  * int8 cache, D 64, 32-token pages, 4 KV splits: 194 (195) registers, 0 spills, 78848 B;
  * fp8 (e4m3) cache, the decode shape (2026-12-05, H200): 246 (241) registers, 0 spills, 118784 B (int8's stages;
    e4m3 -> f32 goes through f16, and the first / last block's V fix-up; int8 in the same run: 226 (241)).
  jax 0.12: the int8 dequantization's loads in the 16-bit WGMMA layout put the D 128 kernel at 255 registers (no
  spills); int8's own WGMMA_8BIT layout brought it to 226 (jax 0.10 cannot broadcast into that layout and uses
  WGMMA's: 241).
  One block per SM by shared memory (227 KiB opt-in) at D 128 and 4 stages; 128 threads x ~210 registers.
  Beside it, the Triton kernel (shared/ACCELERATOR_NOTES.md, its own shapes: 64 seqs x 256 tokens): bf16 decode
  165 registers, 104 KiB shared memory; prefill 8 x 512: 255 registers. No timings exist for either.

Versions: jax 0.10.2 and 0.12.x (the two APIs differ in `transpose_ref` vs `Ref.transpose`, `plgpu.load`'s index
argument and where `InterpretGPUParams` lives; `_compat` below bridges them).
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.attention.mosaic_gpu_tiles import (NUM_INFO, ROWS, clean_metadata, combine_splits,
                                                       default_block_kv, default_kv_splits, sanitize_pages,
                                                       scales_by_sequence, tile_info, token_rows_of)
from kernels_pallas.attention.reference import DEFAULT_MASK_VALUE, check_attention_inputs
from kernels_pallas.kv_cache.layout import cache_dims

SWIZZLE = 128  # bytes; the widest wgmma swizzle
SUPPORTED_DTYPES = ("bfloat16", "float16")
#: Cache dtypes stored as 1-byte codes with per-token scales (kv_cache/layout.py), dequantized in shared memory.
CODE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


# ----------------------------------------------------------------------------------------------------------------
# jax version bridges


# jax 0.10's Mosaic GPU API (jax >= 0.11 has InterpretGPUParams in plgpu, Ref.transpose, load without an index)
OLD_API = not hasattr(plgpu, "InterpretGPUParams")


def _transpose(ref, perm):
    return plgpu.transpose_ref(ref, perm) if OLD_API else ref.transpose(perm)


_LOAD_TAKES_IDX = "idx" in inspect.signature(plgpu.load).parameters


def _load(ref, layout):
    return plgpu.load(ref, (), layout=layout) if _LOAD_TAKES_IDX else plgpu.load(ref, layout=layout)


# jax 0.10's Mosaic GPU interpreter: no layout ops, no transposed wgmma operands (jax >= 0.11's runs both); there
# the interpreted kernel computes its two products with `lax.dot_general` on the same shared-memory tiles.
OLD_INTERPRETER = OLD_API


def _dot(a, b, contract):
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def interpret_params():
    """Mosaic GPU's CPU interpreter parameters (`interpret=` of `plgpu.kernel`)."""
    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:  # jax 0.10
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls()


# ----------------------------------------------------------------------------------------------------------------
# what the kernel supports


def supports(q_dtype, kv_dtype, head_dim: int, page_size: int, group: int, *, kv_scales: bool = False,
             block_kv: int | None = None) -> bool:
    """Whether this kernel handles the case (impl="auto" can route here, else to the Triton kernel).

    bf16 / f16 q with a cache of the same dtype, or with an int8 or fp8 (float8_e4m3fn) cache and its scales
    (`kv_scales`); no f32 (the
    module docstring says why); head_dim 64 or 128
    (128-byte swizzled tiles; the f32 accumulator is 64 x D registers: 256 was never compiled and would crowd the
    255-register ceiling), page_size a multiple of 8 (TMA into (8, 64) tiles) that divides the KV block (64
    tokens, or the page itself up to 128), a group of at most 64 query heads per KV head (one tile row per head)."""
    q_dtype, kv_dtype = jnp.dtype(q_dtype), jnp.dtype(kv_dtype)
    if q_dtype.name not in SUPPORTED_DTYPES:
        return False
    if kv_dtype in CODE_DTYPES:
        if not kv_scales:
            return False
    elif kv_scales or q_dtype != kv_dtype:
        return False
    bkv = block_kv or default_block_kv(page_size)
    return (head_dim in (64, 128) and page_size % 8 == 0 and bkv % page_size == 0
            and bkv % 64 == 0 and bkv <= 128 and 1 <= group <= ROWS)


def is_hopper(device_kind: str | None) -> bool:
    """Whether a device kind ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA GH200 ...") is an sm_90 GPU: the
    kernel uses wgmma, which exists only on Hopper (Blackwell has tcgen05 instead)."""
    kind = (device_kind or "").lower()
    return any(chip in kind for chip in ("h100", "h200", "h800", "h20"))


# ----------------------------------------------------------------------------------------------------------------
# the kernel


def _kernel(info_ref, pages_ref, q_ref, kv_ref, *refs, group, head_dim, page_size, block_kv, num_stages,
            num_splits, sm_scale, sliding_window, soft_cap, mask_value, v_scale, quantized, interpret):
    """One (tile, KV head, KV split) program. refs: for an int8 cache its scales by sequence
    (`scales_by_sequence`), the outputs (o, or o f32 + lse f32 for split-KV), then the scratch: q/o tile, K and
    V stage buffers, barriers (q, KV stages), for split-KV the f32 o and lse tiles, the interpreter's P tile,
    and for an int8 cache the scale stages and the bf16 K and V tiles the dequantization writes."""
    scales_ref = refs[0] if quantized else None
    refs = refs[1:] if quantized else refs
    if num_splits == 1:
        (o_ref, scratch) = refs
        lse_ref = None
    else:
        (o_ref, lse_ref, scratch) = refs
    q_smem, k_smem, v_smem, q_bar, kv_bar, extra, p_smem, int8_scratch = scratch
    tile = lax.axis_index("tile")
    h = lax.axis_index("head")
    sp = lax.axis_index("split")
    seq, _, first_pos, kv_lo, kv_hi, lo, hi, _ = (info_ref[sp, tile, i] for i in range(NUM_INFO))
    # TMA into (8, 64)-tiled shared memory needs tile-aligned GMEM offsets: q and out rows start at tile * 64
    tile_rows = pl.ds(pl.multiple_of(tile * ROWS, ROWS), ROWS)
    pages_per_block = block_kv // page_size
    dtype = q_smem.dtype

    def issue(b, slot):
        for i in range(pages_per_block):
            page = pages_ref[seq, b * pages_per_block + i]
            dst = pl.ds(i * page_size, page_size)
            plgpu.copy_gmem_to_smem(kv_ref.at[h, page, :, pl.ds(0, head_dim)], k_smem.at[slot, dst],
                                    kv_bar.at[slot])
            plgpu.copy_gmem_to_smem(kv_ref.at[h, page, :, pl.ds(head_dim, head_dim)], v_smem.at[slot, dst],
                                    kv_bar.at[slot])
        if quantized:  # the block's K and V scales: two contiguous rows of the sequence's gathered scales
            plgpu.copy_gmem_to_smem(scales_ref.at[h, seq, :, pl.ds(b * block_kv, block_kv)],
                                    int8_scratch[0].at[slot], kv_bar.at[slot])

    @pl.when(seq >= 0)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[h, tile_rows], q_smem, q_bar)
        for s in range(num_stages):
            @pl.when(lo + s < hi)
            def _():
                issue(lo + s, s)

        plgpu.barrier_wait(q_bar)
        wgmma_layout = plgpu.Layout.WGMMA

        def iota(shape, dim, layout=wgmma_layout):  # layouts are a compiler matter; jax 0.10's interpreter
            if interpret:  # runs no layout ops
                return lax.broadcasted_iota(jnp.int32, shape, dim)
            return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout)

        def cast(x, layout):
            return x if interpret else plgpu.layout_cast(x, layout)

        def load(ref, layout):
            return ref[...] if interpret else _load(ref, layout)

        def dequantize(slot, start):
            """int8 / fp8 K and V of the stage -> bf16 tiles `code * scale` (a row broadcast of each token's
            scale, the WGMMA layout's own). V scales outside [kv_lo, kv_hi) become zeros first, so those V rows
            are exact zeros (a stale scale may be NaN/Inf; the int8 values are finite), a `where` over a
            (block_kv,) vector rather than over the whole tile; fp8 codes include NaN (NaN * 0 is NaN), so an
            fp8 tile's stale V rows are zeroed afterwards as a bf16 cache's are (`zero_stale_values`). K's stale
            rows stay: each reaches only its own score column, which the mask `where` replaces. fp8 -> f32 lowers
            through f16 (`cvt.rn.f16x2.e4m3x2`)."""
            sc_smem, k16_smem, v16_smem = int8_scratch
            shape = (block_kv, head_dim)
            # int8's own register layout (4 bytes a load): with the 16-bit WGMMA layout the D 128 kernel sat at
            # the 255-register ceiling; rows are spread as in WGMMA's, so the row broadcast and the bf16 store
            # into the swizzled tile lower as they are. jax 0.10 cannot broadcast into WGMMA_8BIT: WGMMA there.
            int8_layout = wgmma_layout if OLD_API else plgpu.Layout.WGMMA_8BIT
            row_layout = int8_layout.reduce(1)

            def scaled(x_smem, sc):  # one tile at a time
                sc = lax.broadcast_in_dim(sc, shape, [0])
                return (load(x_smem.at[slot], int8_layout).astype(jnp.float32) * sc).astype(dtype)

            key = start + iota((block_kv,), 0, row_layout)
            v_sc = load(sc_smem.at[slot, 1], row_layout)
            k16_smem.at[0][...] = scaled(k_smem, load(sc_smem.at[slot, 0], row_layout))
            v16_smem[...] = scaled(v_smem, jnp.where((key >= kv_lo) & (key < kv_hi), v_sc, 0.0))
            plgpu.commit_smem()
            # V as a whole ref: a static index (`.at[0]`) closed over by the PV `run_state` does not lower
            return k16_smem.at[0], v16_smem

        row, col = iota((ROWS, block_kv), 0), iota((ROWS, block_kv), 1)
        q_pos = first_pos + lax.div(row, jnp.int32(group))

        def body(b, carry):
            acc, m_prev, l_prev = carry
            slot = lax.rem(b - lo, jnp.int32(num_stages))
            plgpu.barrier_wait(kv_bar.at[slot])
            start = b * block_kv
            if quantized:
                k_tile, v_tile = dequantize(slot, start)
            else:
                k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
            if not quantized or v_smem.dtype == jnp.float8_e4m3fn:  # int8 codes are finite: the scales did it

                @pl.when((start < kv_lo) | (start + block_kv > kv_hi))
                def zero_stale_values():  # the range's first / last block: zero V rows outside [kv_lo, kv_hi)
                    v = load(v_tile, wgmma_layout)  # (stale, maybe NaN)
                    key = start + iota((block_kv, head_dim), 0)
                    v_tile[...] = jnp.where((key >= kv_lo) & (key < kv_hi), v, jnp.zeros_like(v))
                    plgpu.commit_smem()

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, _transpose(k_tile, (1, 0)))
                return acc_ref[...]

            if interpret and OLD_INTERPRETER:  # jax 0.10's interpreter cannot read a transposed wgmma operand
                s = _dot(q_smem[...], k_tile[...], ((1,), (1,))) * sm_scale
            else:
                s = pl.run_scoped(qk_scope, plgpu.ACC((ROWS, block_kv), jnp.float32)) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            key = start + col
            visible = (key <= q_pos) & (key < kv_hi) & (key >= kv_lo)
            if sliding_window is not None:
                visible &= key > q_pos - sliding_window
            s = jnp.where(visible, s, mask_value)
            m_new = jnp.maximum(m_prev, s.max(axis=1))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_new = l_prev * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            p16 = p.astype(dtype)
            if interpret and OLD_INTERPRETER:
                acc = acc + _dot(p16, v_tile[...], ((1,), (0,)))
            elif interpret:
                # The interpreter's wgmma reads A only from shared memory and runs neither run_state(ACC.init)
                # nor a store into an ACC: P goes through shared memory and a fresh PV accumulator is added.
                p_smem[...] = p16
                plgpu.commit_smem()

                def pv_scope(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, v_tile)
                    return acc_ref[...]

                acc = acc + pl.run_scoped(pv_scope, plgpu.ACC((ROWS, head_dim), jnp.float32))
            else:  # on the GPU, P is the MMA's A operand from registers and it accumulates into acc (FA3's way)
                def pv_state(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_tile)

                acc = pl.run_state(pv_state)(plgpu.ACC.init(acc))

            @pl.when(b + num_stages < hi)
            def _():
                issue(b + num_stages, slot)

            return acc, m_new, l_new

        acc = cast(jnp.zeros((ROWS, head_dim), jnp.float32), wgmma_layout)
        m = cast(jnp.full((ROWS,), mask_value, jnp.float32), wgmma_layout.reduce(1))
        l = cast(jnp.zeros((ROWS,), jnp.float32), wgmma_layout.reduce(1))
        acc, m, l = lax.fori_loop(lo, hi, body, (acc, m, l))
        l_safe = jnp.where(l > 0, l, 1.0)
        out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        if v_scale is not None:
            out = out * v_scale
        rows = tile_rows
        if num_splits == 1:
            q_smem[...] = out.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[h, rows])
        else:
            o32_smem, lse_smem = extra
            o32_smem[...] = out
            lse_smem[...] = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o32_smem, o_ref.at[sp, h, rows])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[sp, h, rows])
        plgpu.wait_smem_to_gmem(0)


def _tiled(shape, dtype):
    """Shared memory in (8, swizzle) tiles, as TMA writes and wgmma reads them: the widest swizzle the rows allow
    (128 bytes, or 64 for int8 rows of head_dim 64)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(SWIZZLE, shape[-1] * itemsize)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // itemsize)),
                                                plgpu.SwizzleTransform(swizzle)))


def ragged_paged_attention_mosaic_gpu(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [Hkv, num_pages, page_size, 2 * D] (kv_layout.py): K lanes, then V lanes
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    max_q_len: int | None = None,
    kv_scales: jax.Array | None = None,
    interpret: bool = False,
    num_kv_splits: int | None = None,
    block_kv: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """Same contract as `ragged_paged_attention_reference`; returns `[T, Hq, D]` in q's dtype.

    `interpret=True` runs Mosaic GPU's CPU interpreter. `num_kv_splits` (static): split-KV chunks per tile (None:
    `default_kv_splits`); `block_kv` (tokens per pipeline stage, a multiple of 64 and of page_size) and
    `num_stages` (stages in flight) override the defaults. `max_q_len` is accepted for the contract and unused:
    the tile grid already follows the ragged lengths."""
    num_kv_heads, group = check_attention_inputs(q, kv_pages, kv_scales, sliding_window)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_pages, page_size, _ = cache_dims(kv_pages)
    block_kv = block_kv or default_block_kv(page_size)
    if not supports(q.dtype, kv_pages.dtype, head_dim, page_size, group, kv_scales=kv_scales is not None,
                    block_kv=block_kv):
        raise NotImplementedError(
            f"the Mosaic GPU kernel does not support q {q.dtype}, cache {kv_pages.dtype}"
            f"{' with scales' if kv_scales is not None else ''}, head_dim {head_dim}, page_size {page_size}, "
            f"group {group}, block_kv {block_kv} (see mosaic_gpu.supports: bf16/f16 queries over a cache of the same "
            f"dtype or int8 / float8_e4m3fn with kv_scales; f32 is the Triton kernel's IEEE path); use impl='gpu' "
            f"(Triton) or "
            f"'reference'")
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1 (or None for the default), got {num_kv_splits}")
    del max_q_len
    max_seqs, pages_per_seq = page_indices.shape
    mask_value = DEFAULT_MASK_VALUE if mask_value is None else mask_value
    sm_scale = sm_scale if k_scale is None else sm_scale * k_scale
    block_q = ROWS // group
    num_tiles = -(-num_tokens // block_q) + max_seqs
    num_kv_blocks = -(-pages_per_seq * page_size // block_kv)
    splits = num_kv_splits or default_kv_splits(num_tiles * num_kv_heads, num_kv_blocks)
    tile_bytes = block_kv * head_dim * kv_pages.dtype.itemsize
    stages = num_stages or max(2, min(4, (160 * 1024) // (2 * tile_bytes)))

    num_seqs = num_seqs.astype(jnp.int32)
    kv_lens, cu_q_lens = clean_metadata(kv_lens.astype(jnp.int32), cu_q_lens.astype(jnp.int32), num_seqs)
    info, tile_start = tile_info(kv_lens, cu_q_lens, num_seqs, num_tokens=num_tokens, block_q=block_q,
                                 block_kv=block_kv, num_tiles=num_tiles, num_splits=splits,
                                 sliding_window=sliding_window)
    pages = sanitize_pages(page_indices, kv_lens, page_size, num_kv_blocks * block_kv // page_size)
    # q in the tiles' layout [Hkv, tiles * 64, D], the output's too: token t's group of query heads is rows
    # `token_rows[t]` of its tile (a scatter here, a gather after the kernel; rows of no valid token stay zero)
    token_rows = token_rows_of(cu_q_lens, num_seqs, tile_start, num_tokens, block_q, group)
    out_rows = num_tiles * ROWS
    q_heads = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)  # [Hkv, T, group, D]
    q_tiles = jnp.zeros((num_kv_heads, out_rows, head_dim), q.dtype).at[:, token_rows].set(q_heads, mode="drop")
    quantized = kv_scales is not None
    operands = [info, pages, q_tiles, kv_pages]
    if quantized:
        operands.append(scales_by_sequence(kv_scales, pages, num_pages, page_size))

    scratch = [
        _tiled((ROWS, head_dim), q.dtype),
        _tiled((stages, block_kv, head_dim), kv_pages.dtype),
        _tiled((stages, block_kv, head_dim), kv_pages.dtype),
        plgpu.Barrier(num_arrivals=1, num_barriers=1),
        plgpu.Barrier(num_arrivals=2 * (block_kv // page_size) + quantized, num_barriers=stages),
    ]
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((num_kv_heads, out_rows, head_dim), q.dtype)]
        scratch.append(None)
    else:
        out_shape = [jax.ShapeDtypeStruct((splits, num_kv_heads, out_rows, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits, num_kv_heads, out_rows), jnp.float32)]
        scratch.append((plgpu.SMEM((ROWS, head_dim), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32)))
    scratch.append(_tiled((ROWS, block_kv), q.dtype) if interpret else None)  # P, for the interpreter's wgmma
    scratch.append((plgpu.SMEM((stages, 2, block_kv), jnp.float32), _tiled((1, block_kv, head_dim), q.dtype),
                    _tiled((block_kv, head_dim), q.dtype)) if quantized else None)

    kernel = functools.partial(
        _kernel, group=group, head_dim=head_dim, page_size=page_size, block_kv=block_kv, num_stages=stages,
        num_splits=splits, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        mask_value=mask_value, v_scale=v_scale, quantized=quantized, interpret=interpret)

    def ragged_paged_attention_mosaic_gpu_kernel(*refs):
        num_in = len(operands)
        ins, outs = refs[:num_in], refs[num_in:]
        pl.run_scoped(lambda *scr: kernel(*ins, *outs, scr), *scratch)

    outs = plgpu.kernel(
        ragged_paged_attention_mosaic_gpu_kernel, out_type=out_shape, grid=(num_tiles, num_kv_heads, splits),
        grid_names=("tile", "head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=False),
        interpret=interpret_params() if interpret else None,
    )(*operands)
    if splits == 1:
        out = outs[0] if isinstance(outs, (list, tuple)) else outs
        out = out.astype(jnp.float32)
    else:
        out = combine_splits(*outs)

    gathered = out[:, jnp.clip(token_rows, 0, out_rows - 1)]  # [Hkv, T, group, D]
    gathered = gathered.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
    token_valid = jnp.arange(num_tokens) < cu_q_lens[num_seqs[0]]
    return jnp.where(token_valid[:, None, None], gathered, 0).astype(q.dtype)
