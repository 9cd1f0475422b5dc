"""Ragged paged attention as a Pallas Mosaic GPU kernel for Hopper (sm_90a: H100, H200): TMA page copies into a
multi-stage shared-memory pipeline, QK and PV on warpgroup MMA (wgmma), online softmax in registers, optional
split-KV with a combine pass. Same signature and semantics as `ragged_paged_attention_reference`.

Status: tested on CPU in Mosaic GPU's interpret mode against the reference; compiled deviceless for sm_90a in the
tests where jax-cuda13-plugin is installed; never run on a GPU, so nothing here is a timing.

Design (why it is shaped this way):
  * One program (a CUDA block of one warpgroup, 128 threads) owns one 64-row query tile of one KV head. A tile's
    rows are (token, query head of the group) pairs, token-major: `block_q = 64 // group` tokens of one sequence
    times the `group = Hq // Hkv` query heads that share KV head h, so every page read serves the whole group
    (GQA's bandwidth saving) and the M of each wgmma is the 64 rows of one warpgroup MMA.
  * The grid is over tiles, not (sequence, query block): sequence s gets `cdiv(q_len_s, block_q)` tiles, numbered
    consecutively; the static bound `cdiv(T, block_q) + S` tiles covers any split of T tokens into S sequences,
    so no program is spent on the empty query blocks of a `(S, max_q_blocks)` grid. The wrapper computes each
    tile's scalars (sequence, first query position, the key range, the KV-block range of each KV split) in
    plain XLA, and the kernel reads them from one small int32 array in GMEM.
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
  * Stale slots (NaN/Inf past kv_len, before the window, in pages padding entries point at): keys outside the
    tile's range [kv_lo, kv_hi) get the mask value in their score column (a `where`, so a NaN K stays harmless),
    and in the first and last block of the range (the only ones that can hold such keys) V's rows outside the
    range are overwritten with zeros in shared memory before the PV MMA, because a masked key's probability is 0
    (or 1 while its row has seen nothing yet; wiped by alpha = 0 at its first visible key) and 0 * NaN is NaN.
  * Split-KV (`num_kv_splits`, static; default: enough for ~512 programs, `default_kv_splits`): a tile's KV-block
    range is cut into contiguous chunks on a third grid axis; each writes its normalized f32 output and
    log-sum-exp, and a tiny XLA pass combines them. An empty chunk writes zeros and lse = -inf (weight 0).
  * Precision: bf16 / f16 q and cache: MMAs in that dtype with f32 accumulation, probabilities rounded to the
    input dtype for PV (as the Triton kernel); exact `exp` (`approx_math=False`). Not supported yet (`supports`
    says False, the entry point raises NotImplementedError): f32 (wgmma's f32 is TF32, ~5e-4 off, not the
    accuracy path the f32 contract means; the Triton kernel's IEEE path stays), int8 caches with scales, head_dim
    other than 64 or 128, page sizes not a multiple of 8 or not dividing the KV block.
  * Interpret mode differs from the compiled kernel in two places, because Mosaic GPU's interpreter cannot run
    them: its wgmma reads the A operand only from shared memory and runs neither `run_state(ACC.init(acc))` nor a
    store into an accumulator, so interpreted, P is staged through a shared-memory tile and a fresh PV
    accumulator is added to acc (compiled: P is the register A operand and the MMA accumulates into acc); and on
    jax 0.10 (no layout ops, no transposed wgmma operand in its interpreter) both products are `dot_general`s on
    the same shared-memory tiles (`OLD_INTERPRETER`). TMA copies, barriers, the pipeline, masking, the V fix-up,
    the tile bookkeeping and the split combine are the same code in both.

What the compiler said (deviceless, sm_90a, `python -m kernels_pallas.attention.mosaic_gpu_compile h100|h200`;
H100 and H200 identical; jax 0.12.0.1, in parentheses jax 0.10.2, which prints no shared-memory figure):
  * decode 64 seqs x 2048 tokens, Hq 32 / Hkv 8 / D 128 bf16, 16-token pages (4 stages of 64 tokens, no split):
    209 (219) registers, 0 spills, 149504 B shared memory (q tile 16 KiB + 4 x (K 16 + V 16) KiB + barriers);
  * the same with 4 KV splits: 225 (221) registers, 0 spills, 183296 B (+ the f32 output tile and lse);
  * mixed 4 x 512-token prefills + 60 decodes: 209 (219) registers, 0 spills, 149504 B;
  * D 64, 64-token pages, window + soft cap: 214 (215) registers, 0 spills, 93184 B.
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

from kernels_pallas.attention.reference import DEFAULT_MASK_VALUE, check_attention_inputs
from kernels_pallas.kv_cache.layout import cache_dims

ROWS = 64  # query rows per tile: the M of one warpgroup MMA
SWIZZLE = 128  # bytes; the widest wgmma swizzle
SUPPORTED_DTYPES = ("bfloat16", "float16")
NUM_INFO = 8  # int32 scalars per (split, tile): see `tile_info`


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

    bf16 / f16 q and cache of the same dtype (no f32, no int8 yet), head_dim 64 or 128 (128-byte swizzled tiles;
    the f32 accumulator is 64 x D registers: 256 was never compiled and would crowd the 255-register ceiling),
    page_size a multiple of 8 (TMA into (8, 64) tiles) that divides the KV block (64 tokens, or the page itself up
    to 128), a group of at most 64 query heads per KV head (one tile row per head)."""
    q_dtype, kv_dtype = jnp.dtype(q_dtype), jnp.dtype(kv_dtype)
    if kv_scales or q_dtype != kv_dtype or q_dtype.name not in SUPPORTED_DTYPES:
        return False
    bkv = block_kv or default_block_kv(page_size)
    return (head_dim in (64, 128) and page_size % 8 == 0 and bkv % page_size == 0
            and bkv % 64 == 0 and bkv <= 128 and 1 <= group <= ROWS)


def is_hopper(device_kind: str | None) -> bool:
    """Whether a device kind ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA GH200 ...") is an sm_90 GPU: the
    kernel uses wgmma, which exists only on Hopper (Blackwell has tcgen05 instead)."""
    kind = (device_kind or "").lower()
    return any(chip in kind for chip in ("h100", "h200", "h800", "h20"))


def default_block_kv(page_size: int) -> int:
    return max(64, page_size)


def default_kv_splits(num_programs: int, num_kv_blocks: int, target_programs: int = 512) -> int:
    """Enough splits for ~`target_programs` programs (about 4 per SM of a 132-SM H100/H200), a power of two, at most
    16 and at most the KV blocks of the longest sequence. Untuned (no GPU here)."""
    want = -(-target_programs // max(num_programs, 1))
    return max(1, min(16, 1 << max(0, want - 1).bit_length(), num_kv_blocks))


# ----------------------------------------------------------------------------------------------------------------
# wrapper-side bookkeeping (plain XLA)


def tile_info(kv_lens, cu_q_lens, num_seqs, *, num_tokens, block_q, block_kv, num_tiles, num_splits,
              sliding_window):
    """int32 [splits, tiles, NUM_INFO]: (seq or -1, first packed token (for debugging; unused), first query
    position, kv_lo, kv_hi, first KV block, end KV block, tile) per KV split and tile; and each sequence's first
    tile."""
    max_seqs = kv_lens.shape[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    seq_valid = jnp.arange(max_seqs) < num_seqs[0]
    n_tiles = jnp.where(seq_valid, -(-q_lens // block_q), 0)
    tile_end = jnp.cumsum(n_tiles)
    tile_start = tile_end - n_tiles
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), max_seqs - 1).astype(jnp.int32)
    valid = t < tile_end[-1]
    tok0 = (t - tile_start[seq]) * block_q
    q_len, kv_len = q_lens[seq], kv_lens[seq]
    n_valid = jnp.minimum(block_q, q_len - tok0)
    first_pos = kv_len - q_len + tok0
    kv_hi = first_pos + n_valid
    kv_lo = jnp.zeros_like(kv_hi) if sliding_window is None else jnp.maximum(0, first_pos - sliding_window + 1)
    b_lo = kv_lo // block_kv
    b_hi = -(-kv_hi // block_kv)
    chunk = -(-(b_hi - b_lo) // num_splits)
    split = jnp.arange(num_splits, dtype=jnp.int32)[:, None]
    lo = jnp.minimum(b_lo[None] + split * chunk[None], b_hi[None])
    hi = jnp.minimum(lo + chunk[None], b_hi[None])
    fields = [jnp.where(valid, seq, -1), cu_q_lens[seq] + tok0, first_pos, kv_lo, kv_hi]
    fields = [jnp.broadcast_to(f[None], lo.shape) for f in fields]
    fields += [jnp.where(valid[None], lo, 0), jnp.where(valid[None], hi, 0), jnp.broadcast_to(t[None], lo.shape)]
    return jnp.stack(fields, axis=-1).astype(jnp.int32), tile_start


def sanitize_pages(page_indices, kv_lens, page_size, width):
    """Entries past each sequence's last page -> page 0 (never follow a garbage entry), padded to `width`."""
    max_seqs, pages_per_seq = page_indices.shape
    last = -(-kv_lens // page_size)
    col = jnp.arange(width)[None, :]
    padded = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, width - pages_per_seq)))
    return jnp.where(col < jnp.minimum(last, pages_per_seq)[:, None], padded, 0)


def combine_splits(o, lse):
    """o f32 [K, ..., D] normalized per split, lse f32 [K, ...] -> the softmax over all splits."""
    top = jnp.max(lse, axis=0)
    w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0)[None]), 0.0)
    total = jnp.sum(w, axis=0)
    return jnp.sum(w[..., None] * o, axis=0) / jnp.where(total > 0, total, 1.0)[..., None]


# ----------------------------------------------------------------------------------------------------------------
# the kernel


def _kernel(info_ref, pages_ref, q_ref, kv_ref, *refs, group, head_dim, page_size, block_kv, num_stages,
            num_splits, sm_scale, sliding_window, soft_cap, mask_value, v_scale, interpret):
    """One (tile, KV head, KV split) program. refs: the outputs (o, or o f32 + lse f32 for split-KV), then the
    scratch: q/o tile, K and V stage buffers, barriers (q, KV stages), and for split-KV the f32 o and lse tiles."""
    if num_splits == 1:
        (o_ref, scratch) = refs
        lse_ref = None
    else:
        (o_ref, lse_ref, scratch) = refs
    q_smem, k_smem, v_smem, q_bar, kv_bar, extra, p_smem = scratch
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

    @pl.when(seq >= 0)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[h, tile_rows], q_smem, q_bar)
        for s in range(num_stages):
            @pl.when(lo + s < hi)
            def _():
                issue(lo + s, s)

        plgpu.barrier_wait(q_bar)
        wgmma_layout = plgpu.Layout.WGMMA

        def iota(shape, dim):  # register layouts are a compiler matter; jax 0.10's interpreter runs no layout ops
            if interpret:
                return lax.broadcasted_iota(jnp.int32, shape, dim)
            return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=wgmma_layout)

        def cast(x, layout):
            return x if interpret else plgpu.layout_cast(x, layout)

        row, col = iota((ROWS, block_kv), 0), iota((ROWS, block_kv), 1)
        q_pos = first_pos + lax.div(row, jnp.int32(group))

        def body(b, carry):
            acc, m_prev, l_prev = carry
            slot = lax.rem(b - lo, jnp.int32(num_stages))
            plgpu.barrier_wait(kv_bar.at[slot])
            start = b * block_kv

            @pl.when((start < kv_lo) | (start + block_kv > kv_hi))
            def _():  # the range's first / last block: zero V rows outside [kv_lo, kv_hi) (stale, maybe NaN)
                v = v_smem[slot] if interpret else _load(v_smem.at[slot], wgmma_layout)
                key = start + iota((block_kv, head_dim), 0)
                v_smem.at[slot][...] = jnp.where((key >= kv_lo) & (key < kv_hi), v, jnp.zeros_like(v))
                plgpu.commit_smem()

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, _transpose(k_smem.at[slot], (1, 0)))
                return acc_ref[...]

            if interpret and OLD_INTERPRETER:  # jax 0.10's interpreter cannot read a transposed wgmma operand
                s = _dot(q_smem[...], k_smem[slot], ((1,), (1,))) * sm_scale
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
                acc = acc + _dot(p16, v_smem[slot], ((1,), (0,)))
            elif interpret:
                # The interpreter's wgmma reads A only from shared memory and runs neither run_state(ACC.init)
                # nor a store into an ACC: P goes through shared memory and a fresh PV accumulator is added.
                p_smem[...] = p16
                plgpu.commit_smem()

                def pv_scope(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                    return acc_ref[...]

                acc = acc + pl.run_scoped(pv_scope, plgpu.ACC((ROWS, head_dim), jnp.float32))
            else:  # on the GPU, P is the MMA's A operand from registers and it accumulates into acc (FA3's way)
                def pv_state(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

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
    elems = SWIZZLE // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(SWIZZLE)))


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
            f"{' with int8 scales' if kv_scales is not None else ''}, head_dim {head_dim}, page_size {page_size}, "
            f"group {group}, block_kv {block_kv} (see mosaic_gpu.supports); use impl='gpu' (Triton) or 'reference'")
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
    tile_bytes = block_kv * head_dim * q.dtype.itemsize
    stages = num_stages or max(2, min(4, (160 * 1024) // (2 * tile_bytes)))

    info, tile_start = tile_info(kv_lens.astype(jnp.int32), cu_q_lens.astype(jnp.int32),
                                 num_seqs.astype(jnp.int32), num_tokens=num_tokens, block_q=block_q,
                                 block_kv=block_kv, num_tiles=num_tiles, num_splits=splits,
                                 sliding_window=sliding_window)
    pages = sanitize_pages(page_indices, kv_lens.astype(jnp.int32), page_size, num_kv_blocks * block_kv // page_size)
    # q in the tiles' layout [Hkv, tiles * 64, D], the output's too: token t's group of query heads is rows
    # `token_rows[t]` of its tile (a scatter here, a gather after the kernel; rows of no valid token stay zero)
    token_rows = _token_rows(cu_q_lens.astype(jnp.int32), num_seqs, tile_start, num_tokens, block_q, group)
    out_rows = num_tiles * ROWS
    q_heads = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)  # [Hkv, T, group, D]
    q_tiles = jnp.zeros((num_kv_heads, out_rows, head_dim), q.dtype).at[:, token_rows].set(q_heads, mode="drop")

    scratch = [
        _tiled((ROWS, head_dim), q.dtype),
        _tiled((stages, block_kv, head_dim), kv_pages.dtype),
        _tiled((stages, block_kv, head_dim), kv_pages.dtype),
        plgpu.Barrier(num_arrivals=1, num_barriers=1),
        plgpu.Barrier(num_arrivals=2 * (block_kv // page_size), num_barriers=stages),
    ]
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((num_kv_heads, out_rows, head_dim), q.dtype)]
        scratch.append(None)
    else:
        out_shape = [jax.ShapeDtypeStruct((splits, num_kv_heads, out_rows, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits, num_kv_heads, out_rows), jnp.float32)]
        scratch.append((plgpu.SMEM((ROWS, head_dim), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32)))
    scratch.append(_tiled((ROWS, block_kv), q.dtype) if interpret else None)  # P, for the interpreter's wgmma

    kernel = functools.partial(
        _kernel, group=group, head_dim=head_dim, page_size=page_size, block_kv=block_kv, num_stages=stages,
        num_splits=splits, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        mask_value=mask_value, v_scale=v_scale, interpret=interpret)

    def ragged_paged_attention_mosaic_gpu_kernel(*refs):
        num_in = 4
        ins, outs = refs[:num_in], refs[num_in:]
        pl.run_scoped(lambda *scr: kernel(*ins, *outs, scr), *scratch)

    outs = plgpu.kernel(
        ragged_paged_attention_mosaic_gpu_kernel, out_type=out_shape, grid=(num_tiles, num_kv_heads, splits),
        grid_names=("tile", "head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=False),
        interpret=interpret_params() if interpret else None,
    )(info, pages, q_tiles, kv_pages)
    if splits == 1:
        out = outs[0] if isinstance(outs, (list, tuple)) else outs
        out = out.astype(jnp.float32)
    else:
        out = combine_splits(*outs)

    gathered = out[:, jnp.clip(token_rows, 0, out_rows - 1)]  # [Hkv, T, group, D]
    gathered = gathered.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
    token_valid = jnp.arange(num_tokens) < cu_q_lens[num_seqs[0]]
    return jnp.where(token_valid[:, None, None], gathered, 0).astype(q.dtype)


def _token_rows(cu_q_lens, num_seqs, tile_start, num_tokens, block_q, group):
    """int32 [T, group]: the tile rows of each token's query heads (token `within` of its sequence is row
    `(within % block_q) * group + g` of the sequence's tile `within // block_q`); tokens of no valid sequence
    get an out-of-range row (dropped by the scatter, clipped and zeroed by the gather)."""
    max_seqs = tile_start.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], t, side="right"), 0, max_seqs - 1)
    within = t - cu_q_lens[seq]
    row = (tile_start[seq] + within // block_q) * ROWS + (within % block_q) * group
    row = jnp.where(t < cu_q_lens[num_seqs[0]], row, jnp.iinfo(jnp.int32).max // 2)
    return row[:, None] + jnp.arange(group, dtype=jnp.int32)[None, :]
