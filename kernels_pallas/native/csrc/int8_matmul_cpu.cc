// The W8A8 matmul on CPU: an XLA FFI custom call behind models/quantization/formats.py's `matmul(method="int8")` with
// per-channel int8 weights. It takes float32 activations and returns float32, doing what the JAX path does around
// its int8 dot -- quantize each row of x (scale max|x| / 127, round half to even), the exact int8 x int8 -> int32
// dot, then (float(dot) * x_scale) * w_scale -- with the same float operations in the same order, so the result
// is bit-identical (tested).
//
// Why: at batch 1 a decode step is the weights' GEMVs, and XLA:CPU runs a 1- or 2-row int8 dot through YNNPACK at
// about 12 GB/s of weights (BENCHMARKS.md), under a third of what the f32 GEMVs reach. Here each weight byte is
// read once from memory for all rows: columns are cut into blocks whose int32 accumulators stay in L1, K is
// walked four rows at a time, and the blocks are spread over the library's worker threads (parallel_for.h). With
// AVX-512 VNNI (and not PAGEJAX_PORTABLE, which tests define to check the portable path) the dots are vpdpbusd;
// on AVX2 and on ARMv8.2 dotprod they are `Int8Dot`'s (int8_dot.h), one kernel source for both (`Int8Vector`); on
// CPUs with AMX-INT8 tiles the many-row loop runs on them (int8_amx.h, `amx_strip`).
// Quantizing and rescaling in here rather than in XLA: those were XLA:CPU fusions of their own around each of the
// 211 dots, 9.5 of a 33 ms chain of SmolLM2's int8 matmuls at 32 rows (BENCHMARKS.md).

// The library is built with -fassociative-math (cpu_build.FLAGS, for the attention kernel's reductions); here it
// would turn (dot * x_scale) * w_scale into dot * (x_scale * w_scale), one rounding off XLA's result.
#pragma GCC optimize("no-associative-math")
#ifdef __clang__
#pragma clang fp reassociate(off)
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "int8_amx.h"
#include "int8_dot.h"
#include "parallel_for.h"
#include "register_blocks.h"
#include "scratch.h"
#include "xla/ffi/api/ffi.h"

#if (defined(__AVX512F__) || defined(__AVX2__)) && !defined(PAGEJAX_PORTABLE)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__) && !defined(PAGEJAX_PORTABLE)
using pagejax::first_lanes;
#endif

// Largest K: the int32 sums (up to 255 * 127 * K with the +128 bias of the VNNI path) stay below 2^31.
constexpr int64_t kMaxK = 65535;

// Portable path: the compiler vectorizes over columns; a block's int32 accumulators of all rows stay in L1.
constexpr int64_t kColumnBlock = 256;
constexpr int64_t kMaxRows = 16;

// The float operations of the activation quantizing are those XLA:CPU compiles models/quantization/formats.py's
// `_matmul_int8` to: its algebraic simplifier turns `amax / 127` into a multiply by the constant 1/127 and `x / scale`
// into x * (1 / scale).
inline float row_scale(const float* row, int64_t k) {
  float amax = 0.f;
  for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::fabs(row[c]));
  return amax > 0.f ? amax * (1.f / 127.f) : 1.f;
}

inline int8_t quantize(float v, float inv_scale) {
  // rint rounds half to even in the default rounding mode, as jnp.round; NaN (from NaN or infinite inputs) -> 0, as
  // XLA's convert gives, and the clamp keeps the cast defined.
  const float t = v * inv_scale;
  return std::isnan(t) ? 0 : static_cast<int8_t>(std::rint(std::max(-127.f, std::min(127.f, t))));
}

struct Matmul {
  const int8_t* xq;     // [M, k_pad] (k_pad = K rounded up to a multiple of 4), readable past it (below)
  const float* xscale;  // [M]
  const int32_t* xsum;  // [M]
  const int8_t* w;      // [K, N]
  const float* wscale;  // [N]
  float* out;           // [M, N]
  int64_t m, k, n;

  int64_t k_pad() const { return (k + 3) / 4 * 4; }
  // x's rows as 4 consecutive K values per uint32: what vpdpbusd broadcasts (xq points into a uint32 buffer).
  const uint32_t* xu() const { return reinterpret_cast<const uint32_t*>(static_cast<const void*>(xq)); }
  float rescale(int32_t dot, int64_t r, int64_t col) const {
    return static_cast<float>(dot) * xscale[r] * wscale[col];
  }

  void run_portable(int64_t block, int64_t r0, int64_t rows) const {
    const int64_t n0 = block * kColumnBlock, width = std::min(kColumnBlock, n - n0);
    alignas(64) int32_t acc[kMaxRows][kColumnBlock];
    for (int64_t r = 0; r < rows; ++r) std::fill(acc[r], acc[r] + width, 0);
    int64_t kk = 0;
    for (; kk + 4 <= k; kk += 4) {
      const int8_t* w0 = w + kk * n + n0;
      const int8_t* w1 = w0 + n;
      const int8_t* w2 = w1 + n;
      const int8_t* w3 = w2 + n;
      for (int64_t r = 0; r < rows; ++r) {
        const int8_t* xr = xq + (r0 + r) * k_pad() + kk;
        const int32_t a0 = xr[0], a1 = xr[1], a2 = xr[2], a3 = xr[3];
        int32_t* ar = acc[r];
        for (int64_t j = 0; j < width; ++j) ar[j] += a0 * w0[j] + a1 * w1[j] + a2 * w2[j] + a3 * w3[j];
      }
    }
    for (; kk < k; ++kk) {
      const int8_t* w0 = w + kk * n + n0;
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t a0 = xq[(r0 + r) * k_pad() + kk];
        int32_t* ar = acc[r];
        for (int64_t j = 0; j < width; ++j) ar[j] += a0 * w0[j];
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < width; ++j) out[(r0 + r) * n + n0 + j] = rescale(acc[r][j], r0 + r, n0 + j);
  }

  int64_t portable_items() const { return ((n + kColumnBlock - 1) / kColumnBlock) * ((m + kMaxRows - 1) / kMaxRows); }

  void portable_item(int64_t i) const {
    const int64_t blocks = (n + kColumnBlock - 1) / kColumnBlock, r0 = (i / blocks) * kMaxRows;
    run_portable(i % blocks, r0, std::min(kMaxRows, m - r0));
  }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(PAGEJAX_PORTABLE)
  // AVX-512 VNNI path. vpdpbusd multiplies 4 unsigned by 4 signed bytes per int32 lane and adds them up, so each
  // 64-column piece of 4 consecutive rows of W is repacked (`pack`) into 4 registers whose lanes hold one column's
  // 4 K values, made unsigned by flipping the sign bit (w + 128); x's 4 bytes are broadcast as the signed operand,
  // and 128 * (row sum of x) is subtracted at the end: the result is exact.
  static constexpr int64_t kPrefetch = 16;  // rows ahead: W's rows are N bytes apart, beyond the prefetcher's reach

  // v[q], lane 4L + j = the 4 K values of column n0 + 16L + 4q + j, rows 4b..4b+3 (zero past K or past `cols`),
  // made unsigned (+128) for vpdpbusd, or left signed (`to_unsigned` false) for AMX's signed x signed tdpbssd.
  void pack(int64_t b, int64_t n0, __mmask64 cols, bool prefetch, __m512i (&v)[4], bool to_unsigned = true) const {
    __m512i r[4];
    for (int i = 0; i < 4; ++i) {
      const int64_t row = 4 * b + i;
      r[i] = row < k ? _mm512_maskz_loadu_epi8(cols, w + row * n + n0) : _mm512_setzero_si512();
      if (prefetch && row + kPrefetch < k)
        _mm_prefetch(reinterpret_cast<const char*>(w + (row + kPrefetch) * n + n0), _MM_HINT_T0);
    }
    const __m512i flip = to_unsigned ? _mm512_set1_epi8(static_cast<char>(0x80)) : _mm512_setzero_si512();
    const __m512i t0 = _mm512_unpacklo_epi8(r[0], r[1]), t1 = _mm512_unpackhi_epi8(r[0], r[1]);
    const __m512i t2 = _mm512_unpacklo_epi8(r[2], r[3]), t3 = _mm512_unpackhi_epi8(r[2], r[3]);
    v[0] = _mm512_xor_si512(_mm512_unpacklo_epi16(t0, t2), flip);
    v[1] = _mm512_xor_si512(_mm512_unpackhi_epi16(t0, t2), flip);
    v[2] = _mm512_xor_si512(_mm512_unpacklo_epi16(t1, t3), flip);
    v[3] = _mm512_xor_si512(_mm512_unpackhi_epi16(t1, t3), flip);
  }

  // A packed piece's 4 accumulators in column order (a 4 x 4 transpose of 128-bit lanes): cols[t] = columns
  // 16t..16t+15 of the piece.
  static void to_columns(const __m512i (&a)[4], __m512i (&cols)[4]) {
    const __m512i u0 = _mm512_shuffle_i32x4(a[0], a[1], 0x44), u1 = _mm512_shuffle_i32x4(a[0], a[1], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(a[2], a[3], 0x44), u3 = _mm512_shuffle_i32x4(a[2], a[3], 0xEE);
    cols[0] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    cols[1] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    cols[2] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    cols[3] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
  }


  // The piece's `width` int32 sums, in column order.
  static void store_columns(const __m512i (&a)[4], int32_t* dst, int64_t width) {
    __m512i cols[4];
    to_columns(a, cols);
    for (int t = 0; t < 4 && 16 * t < width; ++t)
      _mm512_mask_storeu_epi32(dst + 16 * t, first_lanes(width - 16 * t), cols[t]);
  }

  // The piece's `width` results of row r, columns n0..: (float(sum - bias * xsum[r]) * xscale[r]) * wscale[col]
  // (bias 128 undoes `pack`'s unsigned weights).
  void store_rescaled(const __m512i (&a)[4], int64_t r, int64_t n0, int64_t width, int32_t bias = 128) const {
    __m512i cols[4];
    to_columns(a, cols);
    const __m512i correction = _mm512_set1_epi32(xsum[r] * bias);
    const __m512 xs = _mm512_set1_ps(xscale[r]);
    for (int t = 0; t < 4 && 16 * t < width; ++t) {
      const __mmask16 mask = first_lanes(width - 16 * t);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(cols[t], correction));
      const __m512 ws = _mm512_maskz_loadu_ps(mask, wscale + n0 + 16 * t);
      _mm512_mask_storeu_ps(out + r * n + n0 + 16 * t, mask, _mm512_mul_ps(_mm512_mul_ps(dot, xs), ws));
    }
  }

  static __mmask64 column_mask(int64_t width) { return width >= 64 ? ~__mmask64(0) : (__mmask64(1) << width) - 1; }

  // Few rows (M <= 4, GEMV-like): W is streamed whole rows at a time, the order memory likes; item i owns K rows
  // [i * rows_per_item, ...) across all N columns and writes its partial sums to partial[i][r][N], which the caller
  // adds up. Column strips (below) read W in 64-byte pieces N bytes apart: 11.5 vs 8.8 ms for SmolLM2's weights.
  void vnni_rows(int64_t item, int64_t rows_per_item, int32_t* partial) const {
    const int64_t k4 = (k + 3) / 4, b0 = item * rows_per_item / 4, b1 = std::min(k4, (item + 1) * rows_per_item / 4);
    for (int64_t n0 = 0; n0 < n; n0 += 64) {
      const int64_t width = std::min<int64_t>(64, n - n0);
      __m512i acc[4][4];  // [row][q]
      for (int64_t r = 0; r < m; ++r)
        for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_setzero_si512();
      for (int64_t b = b0; b < b1; ++b) {
        __m512i v[4];
        pack(b, n0, column_mask(width), false, v);
        for (int64_t r = 0; r < m; ++r) {
          const __m512i x4 = _mm512_set1_epi32(static_cast<int32_t>(xu()[r * k4 + b]));
          for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_dpbusd_epi32(acc[r][q], v[q], x4);
        }
      }
      for (int64_t r = 0; r < m; ++r) store_columns(acc[r], partial + (item * m + r) * n + n0, width);
    }
  }

  // More rows: one 64-column strip of W per item, packed once (and used at once by the first 6 rows of x), then
  // streamed from L1/L2 for every further 6-row chunk: 6 x 4 accumulators + 4 weights + a broadcast in 32 registers.
  static constexpr int64_t kRowChunk = 6;

  // One 6-row chunk of x against strip n0; kFirst packs W (storing it for later chunks when `keep`), the rest read
  // the packed strip. A template, so the accumulators stay in registers in both loops.
  template <bool kFirst>
  void strip_chunk(int64_t n0, int64_t width, int64_t r0, bool keep, __m512i* packed) const {
    const int64_t k4 = (k + 3) / 4, rows = std::min(kRowChunk, m - r0);
    __m512i acc[kRowChunk][4];
    for (int r = 0; r < kRowChunk; ++r)
      for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_setzero_si512();
    for (int64_t b = 0; b < k4; ++b) {
      __m512i v[4];
      if constexpr (kFirst) {
        pack(b, n0, column_mask(width), true, v);
        if (keep)
          for (int q = 0; q < 4; ++q) packed[4 * b + q] = v[q];
      } else {
        for (int q = 0; q < 4; ++q) v[q] = packed[4 * b + q];
      }
      for (int r = 0; r < kRowChunk; ++r) {
        if (r >= rows) break;
        const __m512i x4 = _mm512_set1_epi32(static_cast<int32_t>(xu()[(r0 + r) * k4 + b]));
        for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_dpbusd_epi32(acc[r][q], v[q], x4);
      }
    }
    for (int64_t r = 0; r < rows; ++r) store_rescaled(acc[r], r0 + r, n0, width);
  }

  void vnni_strip(int64_t strip) const {
    const int64_t n0 = strip * 64, width = std::min<int64_t>(64, n - n0);
    const bool keep = m > kRowChunk;
    thread_local std::vector<__m512i> packed;
    if (keep) packed.resize(4 * ((k + 3) / 4));
    strip_chunk<true>(n0, width, 0, keep, packed.data());
    for (int64_t r0 = kRowChunk; r0 < m; r0 += kRowChunk)
      strip_chunk<false>(n0, width, r0, keep, packed.data());
  }

#ifdef PAGEJAX_INT8_AMX
  // The AMX loop for the same strips (int8_amx.h): the strip's K packed signed, as `pack` lays it out, in groups of
  // 16 four-row blocks (zero past K), so one group's 16 x 64 bytes of each q are a B tile of 16 rows 256 bytes
  // apart; each 16 rows of x are an A tile read in place (`xq`, its rows k_pad bytes apart: a tile's bytes past K
  // meet zero weights, and rows past M, whose sums are not stored, stay inside `pagejax_int8_matmul`'s buffer);
  // C tile q holds the sums of lanes `pack` puts in v[q], so each row's 4 C rows are the VNNI loop's accumulators.
  static constexpr int64_t kTileRows = 16;

  void amx_strip(int64_t strip) const {
    const int64_t n0 = strip * 64, width = std::min<int64_t>(64, n - n0), k4 = (k + 3) / 4;
    const int64_t groups = (k4 + kTileRows - 1) / kTileRows;
    thread_local std::vector<__m512i> packed;
    packed.resize(4 * kTileRows * groups);
    for (int64_t b = 0; b < k4; ++b) {
      __m512i v[4];
      pack(b, n0, column_mask(width), true, v, false);
      for (int q = 0; q < 4; ++q) packed[4 * b + q] = v[q];
    }
    std::fill(packed.begin() + 4 * k4, packed.end(), _mm512_setzero_si512());
    pagejax::configure_int8_tiles();
    constexpr int64_t kStride = 4 * sizeof(__m512i);  // between a B tile's rows: the 4 vectors of one K block
    for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t g = 0; g < groups; ++g) {
        const __m512i* block = packed.data() + 4 * kTileRows * g;
        _tile_loadd(4, xq + r0 * k_pad() + g * 4 * kTileRows, k_pad());
        _tile_loadd(5, block, kStride);
        _tile_dpbssd(0, 4, 5);
        _tile_loadd(6, block + 1, kStride);
        _tile_dpbssd(1, 4, 6);
        _tile_loadd(5, block + 2, kStride);
        _tile_dpbssd(2, 4, 5);
        _tile_loadd(6, block + 3, kStride);
        _tile_dpbssd(3, 4, 6);
      }
      alignas(64) int32_t sums[4][kTileRows][16];
      _tile_stored(0, sums[0], 64);
      _tile_stored(1, sums[1], 64);
      _tile_stored(2, sums[2], 64);
      _tile_stored(3, sums[3], 64);
      for (int64_t r = 0; r < std::min(kTileRows, m - r0); ++r) {
        const __m512i a[4] = {_mm512_load_si512(sums[0][r]), _mm512_load_si512(sums[1][r]),
                              _mm512_load_si512(sums[2][r]), _mm512_load_si512(sums[3][r])};
        store_rescaled(a, r0 + r, n0, width, 0);
      }
    }
    _tile_release();
  }
#endif
#endif
};

#if defined(PAGEJAX_INT8_DOT) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
// The AVX2 / AVX-VNNI / NEON-dotprod path: the VNNI path's two loops (K-split row streaming for M <= 4, packed column
// strips for more rows) written once against int8_dot.h. Signed x signed bytes (no correction), or on AVX-VNNI the
// AVX-512 VNNI path's unsigned weights and its correction (`Int8Dot::kBias`).
struct Int8Vector {
  using D = pagejax::Int8Dot;
  static constexpr int64_t kCols = D::kCols;
  const Matmul& mm;

  // Rows 4b..4b+3 of W, columns n0 .. n0 + width (zero past K or past width), packed.
  void piece(int64_t b, int64_t n0, int64_t width, D::Packed (&v)[4]) const {
    decltype(D::load(nullptr)) r[4];
    for (int i = 0; i < 4; ++i) {
      const int64_t row = 4 * b + i;
      if (row < mm.k && width == kCols) {
        r[i] = D::load(mm.w + row * mm.n + n0);
      } else {
        alignas(64) int8_t tail[kCols] = {};
        if (row < mm.k) std::memcpy(tail, mm.w + row * mm.n + n0, width);
        r[i] = D::load(tail);
      }
    }
    D::pack(r, v);
  }

  // Item `item` of the M <= 4 loop: K blocks [b0, b1) for all columns, partial sums into partial[item][r][N].
  void rows(int64_t item, int64_t rows_per_item, int32_t* partial) const {
    const int64_t k4 = (mm.k + 3) / 4, b0 = item * rows_per_item / 4;
    const int64_t b1 = std::min(k4, (item + 1) * rows_per_item / 4);
    for (int64_t n0 = 0; n0 < mm.n; n0 += kCols) {
      const int64_t width = std::min(kCols, mm.n - n0);
      D::Acc acc[4][4];
      for (int64_t r = 0; r < mm.m; ++r)
        for (int q = 0; q < 4; ++q) acc[r][q] = D::zero();
      for (int64_t b = b0; b < b1; ++b) {
        D::Packed v[4];
        piece(b, n0, width, v);
        for (int64_t r = 0; r < mm.m; ++r) {
          const auto x4 = D::broadcast(mm.xu()[r * k4 + b]);
          for (int q = 0; q < 4; ++q) acc[r][q] = D::dot(acc[r][q], v[q], x4);
        }
      }
      for (int64_t r = 0; r < mm.m; ++r) {
        alignas(64) int32_t sums[kCols];
        D::columns(acc[r], sums);
        std::copy(sums, sums + width, partial + (item * mm.m + r) * mm.n + n0);
      }
    }
  }

  // More rows: one strip of kCols columns per item, its K cut into blocks of kBlock 4-row groups. A block is packed
  // once (kBlock * 4 pieces, in L1: 16 KiB on AVX2, 8 KiB with AVX-VNNI, where twice the block measured the same) and
  // then run by every chunk of R rows of x, whose accumulators stay in registers within the block and carry over
  // blocks in `carry` (L1/L2). Packing the whole strip (in L2 at K = 1536) for 3-row chunks that spilled accumulators
  // measured half as fast (BENCHMARKS.md).
  static constexpr int64_t kBlock = kCols == 32 ? 64 : 128;
  // Rows per chunk, R x 4 accumulators in registers beside 2 x 4 weights (AVX2: 16 registers), 4 on NEON (32).
  static constexpr int kRowChunk = kCols == 32 ? 2 : 4;

  template <int R>
  void chunk(const D::Packed* block, int64_t b0, int64_t b1, int64_t r0, D::Acc* carry) const {
    const int64_t k4 = (mm.k + 3) / 4;
    D::Acc acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < 4; ++q) acc[r][q] = b0 == 0 ? D::zero() : carry[(r0 + r) * 4 + q];
    const uint32_t* x = mm.xu() + r0 * k4;
    for (int64_t b = b0; b < b1; ++b) {
      const D::Packed* v = block + 4 * (b - b0);
      decltype(D::broadcast(0)) x4[R];
      for (int r = 0; r < R; ++r) x4[r] = D::broadcast(x[r * k4 + b]);
      for (int q = 0; q < 4; ++q)
        for (int r = 0; r < R; ++r) acc[r][q] = D::dot(acc[r][q], v[q], x4[r]);
    }
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < 4; ++q) carry[(r0 + r) * 4 + q] = acc[r][q];
  }

  // Strips per work item: a wide N (the LM head's 49152 columns) takes 4 adjacent AVX2 strips per item, so each
  // item reads 128 contiguous bytes of every W row it walks (rows N bytes apart: a TLB miss each at that N) where
  // one strip read 32; its K blocks shrink to keep the packed block at 16 KiB. 1.1x on the LM head at 32 rows
  // (BENCHMARKS.md). Fewer columns keep one strip an item, so both threads have items.
  static constexpr int64_t kMaxSub = kCols == 32 ? 4 : 1;
  static int64_t strips_per_item(int64_t n) { return n >= 64 * kMaxSub * kCols ? kMaxSub : 1; }

  void strip(int64_t item, int64_t sub) const {
    const int64_t n0 = item * sub * kCols, k4 = (mm.k + 3) / 4, bsize = kBlock / sub;
    thread_local std::vector<D::Packed> block;
    thread_local std::vector<D::Acc> carry;
    block.resize(4 * kBlock);
    carry.resize(4 * mm.m * sub);
    const int64_t strips = std::min(sub, (mm.n - n0 + kCols - 1) / kCols);
    for (int64_t b0 = 0; b0 < k4; b0 += bsize) {
      const int64_t b1 = std::min(k4, b0 + bsize);
      for (int64_t t = 0; t < strips; ++t)
        for (int64_t b = b0; b < b1; ++b) {
          D::Packed v[4];
          piece(b, n0 + t * kCols, std::min(kCols, mm.n - n0 - t * kCols), v);
          std::copy(v, v + 4, block.data() + 4 * (t * bsize + b - b0));
        }
      pagejax::for_row_chunks<kRowChunk>(mm.m, [&](auto rows, int64_t r0) {
        for (int64_t t = 0; t < strips; ++t)
          chunk<decltype(rows)::value>(block.data() + 4 * t * bsize, b0, b1, r0, carry.data() + 4 * mm.m * t);
      });
    }
    for (int64_t t = 0; t < strips; ++t) {
      const int64_t c0 = n0 + t * kCols, width = std::min(kCols, mm.n - c0);
      for (int64_t r = 0; r < mm.m; ++r) {
        alignas(64) int32_t sums[kCols];
        const D::Acc(&a)[4] = *reinterpret_cast<const D::Acc(*)[4]>(carry.data() + 4 * mm.m * t + 4 * r);
        D::columns(a, sums);
        const int32_t correction = D::kBias * mm.xsum[r];
        for (int64_t j = 0; j < width; ++j) mm.out[r * mm.n + c0 + j] = mm.rescale(sums[j] - correction, r, c0 + j);
      }
    }
  }
};
#define PAGEJAX_INT8_VECTOR 1
#endif

// Row r of x into xq (zero-padded to k_pad), its scale and its integer sum. g++ vectorizes neither loop (a float
// max and rint), so the AVX-512, AVX2 and NEON builds spell them out: 16, 8 or 4 lanes, the same operations per
// element.
// Row r of x quantized: xq[r * k_pad + c] = round(x[r, c] / x_scale[r]) (zero for c >= K), xsum[r] = sum of row r.
void quantize_row(const float* xr, int64_t k, int8_t* qr, float* xscale, int32_t* xsum) {
#if defined(__AVX512F__) && !defined(PAGEJAX_PORTABLE)
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 16)
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(first_lanes(k - c), xr + c)));
  const float amax = _mm512_reduce_max_ps(vmax);
  const float scale = *xscale = amax > 0.f ? amax * (1.f / 127.f) : 1.f;
  const __m512 inv = _mm512_set1_ps(1.f / scale), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t c = 0; c < k; c += 16) {
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(first_lanes(k - c), xr + c), inv);
    v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);  // NaN -> 0, as the portable path
    v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
    const __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    sum = _mm512_add_epi32(sum, q);
    _mm512_mask_cvtepi32_storeu_epi8(qr + c, first_lanes(k - c), q);
  }
  *xsum = _mm512_reduce_add_epi32(sum);
#elif defined(__AVX2__) && !defined(PAGEJAX_PORTABLE)
  // 8 lanes, then the portable loop's operations on the tail. The max's NaN lanes keep the running max, as
  // std::max(amax, NaN) does (vmaxps returns its second operand when either is NaN).
  const int64_t k8 = k / 8 * 8;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t c = 0; c < k8; c += 8) vmax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xr + c), abs_mask), vmax);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = 0.f;
  for (float v : lanes) amax = std::max(amax, v);
  for (int64_t c = k8; c < k; ++c) amax = std::max(amax, std::fabs(xr[c]));
  const float scale = *xscale = amax > 0.f ? amax * (1.f / 127.f) : 1.f;
  const float inv_scale = 1.f / scale;
  const __m256 inv = _mm256_set1_ps(inv_scale), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256i vsum = _mm256_setzero_si256();
  for (int64_t c = 0; c < k8; c += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + c), inv);
    v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));  // NaN -> 0
    v = _mm256_max_ps(lo, _mm256_min_ps(hi, v));
    const __m256i q = _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    vsum = _mm256_add_epi32(vsum, q);
    const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(qr + c), _mm_packs_epi16(q16, q16));
  }
  alignas(32) int32_t partial[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(partial), vsum);
  int32_t sum = 0;
  for (int32_t v : partial) sum += v;
  for (int64_t c = k8; c < k; ++c) sum += (qr[c] = quantize(xr[c], inv_scale));
  *xsum = sum;
#elif defined(__aarch64__) && !defined(PAGEJAX_PORTABLE)
  // NEON, 4 lanes, then the portable loop's operations on the tail: vmaxnm skips a NaN lane as std::max(amax, NaN)
  // keeps amax; vcvtn rounds half to even, as rint does.
  const int64_t k4 = k / 4 * 4;
  float32x4_t vmax = vdupq_n_f32(0.f);
  for (int64_t c = 0; c < k4; c += 4) vmax = vmaxnmq_f32(vmax, vabsq_f32(vld1q_f32(xr + c)));
  float amax = vmaxnmvq_f32(vmax);
  for (int64_t c = k4; c < k; ++c) amax = std::max(amax, std::fabs(xr[c]));
  const float scale = *xscale = amax > 0.f ? amax * (1.f / 127.f) : 1.f;
  const float inv_scale = 1.f / scale;
  const float32x4_t inv = vdupq_n_f32(inv_scale), lo = vdupq_n_f32(-127.f), hi = vdupq_n_f32(127.f);
  int32x4_t vsum = vdupq_n_s32(0);
  for (int64_t c = 0; c < k4; c += 4) {
    float32x4_t v = vmulq_f32(vld1q_f32(xr + c), inv);
    v = vbslq_f32(vceqq_f32(v, v), v, vdupq_n_f32(0.f));  // NaN -> 0
    v = vmaxq_f32(lo, vminq_f32(hi, v));
    const int32x4_t q = vcvtnq_s32_f32(v);
    vsum = vaddq_s32(vsum, q);
    const int16x4_t q16 = vmovn_s32(q);
    const int8x8_t q8 = vmovn_s16(vcombine_s16(q16, q16));
    std::memcpy(qr + c, &q8, 4);
  }
  int32_t sum = vaddvq_s32(vsum);
  for (int64_t c = k4; c < k; ++c) sum += (qr[c] = quantize(xr[c], inv_scale));
  *xsum = sum;
#else
  const float inv_scale = 1.f / (*xscale = row_scale(xr, k));
  int32_t sum = 0;
  for (int64_t c = 0; c < k; ++c) sum += (qr[c] = quantize(xr[c], inv_scale));
  *xsum = sum;
#endif
}

void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* xq, float* xscale, int32_t* xsum) {
  const int64_t k_pad = (k + 3) / 4 * 4;
  auto row = [&](int64_t r) { quantize_row(x + r * k, k, xq + r * k_pad, xscale + r, xsum + r); };
  if (m * k < (1 << 15)) {
    for (int64_t r = 0; r < m; ++r) row(r);
  } else {
    pagejax::parallel_for(m, row);
  }
}

// out = rescale(sum of the `used` partial sums - bias * xsum[r]): bias 128 undoes the VNNI path's unsigned weights.
void add_partials(const Matmul& mm, const int32_t* partial, int64_t used, int32_t bias) {
  const int64_t m = mm.m, n = mm.n;
  pagejax::parallel_for((n + 1023) / 1024, [&](int64_t c) {
    const int64_t c0 = c * 1024, c1 = std::min<int64_t>(n, c0 + 1024);
    int32_t dot[1024];
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t j = c0; j < c1; ++j) dot[j - c0] = -bias * mm.xsum[r];
      for (int64_t i = 0; i < used; ++i) {
        const int32_t* src = partial + (i * m + r) * n;
        for (int64_t j = c0; j < c1; ++j) dot[j - c0] += src[j];
      }
      for (int64_t j = c0; j < c1; ++j) mm.out[r * n + j] = mm.rescale(dot[j - c0], r, j);
    }
  });
}

// The vector paths' two loops. M <= 4: K cut into at most 8 items of whole 4-row blocks, rows(i, rows_per_item,
// partial) writing item i's sums of every row and column to partial[i][r][N], added up here (`add_partials`, less
// bias * xsum). More rows: strip(s) for each strip of `strip_cols` columns.
template <typename Rows, typename Strip>
void run_vector(const Matmul& mm, int32_t bias, const Rows& rows, int64_t strip_cols, const Strip& strip) {
  if (mm.m <= 4) {
    const int64_t k4 = (mm.k + 3) / 4;
    const int64_t items = std::min<int64_t>(k4, 8), rows_per_item = 4 * ((k4 + items - 1) / items);
    const int64_t used = (k4 * 4 + rows_per_item - 1) / rows_per_item;
    int32_t* partial = pagejax::scratch<int32_t, 3>(used * mm.m * mm.n);  // every element is written
    pagejax::parallel_for(used, [&](int64_t i) { rows(i, rows_per_item, partial); });
    add_partials(mm, partial, used, bias);
  } else {
    pagejax::parallel_for((mm.n + strip_cols - 1) / strip_cols, strip);
  }
}

}  // namespace

// out [M, N] = the W8A8 product of x [M, K] and w [K, N], w_scale [N] (K <= kMaxK): the kernel without XLA's FFI,
// which tests/kernels_pallas/int8_matmul_driver.cc calls directly (the aarch64 build, run under qemu).
void pagejax_int8_matmul(const float* x, const int8_t* w, const float* wscale, float* out, int64_t m, int64_t k,
                         int64_t n) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    std::fill(out, out + m * n, 0.f);
    return;
  }
  const int64_t k4 = (k + 3) / 4;
  // The quantized rows, read as bytes or 4-byte groups, zero past K; the AMX loop reads 16 rows and 64 bytes of K at
  // a time, so the buffer reaches a multiple of 16 rows and 16 groups past the last (zeroed too: defined bytes).
  const int64_t padded = ((m + 15) / 16 * 16) * k4 + 16;
  uint32_t* xu = pagejax::scratch<uint32_t, 0>(padded);
  std::fill(xu, xu + padded, 0u);
  float* xscale = pagejax::scratch<float, 1>(m);
  int32_t* xsum = pagejax::scratch<int32_t, 2>(m);
  int8_t* xq = reinterpret_cast<int8_t*>(xu);
  quantize_rows(x, m, k, xq, xscale, xsum);
  const Matmul mm{xq, xscale, xsum, w, wscale, out, m, k, n};
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(PAGEJAX_PORTABLE)
#ifdef PAGEJAX_INT8_AMX
  if (m > 4 && pagejax::amx_permitted())  // run_vector's strips, on AMX tiles
    return pagejax::parallel_for((n + 63) / 64, [&](int64_t i) { mm.amx_strip(i); });
#endif
  run_vector(mm, 128, [&](int64_t i, int64_t rows_per_item, int32_t* p) { mm.vnni_rows(i, rows_per_item, p); }, 64,
             [&](int64_t i) { mm.vnni_strip(i); });
#elif defined(PAGEJAX_INT8_VECTOR)
  const Int8Vector vec{mm};
  const int64_t sub = Int8Vector::strips_per_item(n);
  run_vector(
      mm, Int8Vector::D::kBias, [&](int64_t i, int64_t rows_per_item, int32_t* p) { vec.rows(i, rows_per_item, p); },
      sub * Int8Vector::kCols, [&](int64_t i) { vec.strip(i, sub); });
#else
  pagejax::parallel_for(mm.portable_items(), [&](int64_t i) { mm.portable_item(i); });
#endif
}

// Whether this build's many-row loop runs on AMX tiles here (compiled in, and the OS grants the tile state): tests
// check it against the CPU's flags.
extern "C" bool pagejax_int8_matmul_amx() {
#ifdef PAGEJAX_INT8_AMX
  return pagejax::amx_permitted();
#else
  return false;
#endif
}

// The instructions of this build's int8 dot ("avx512-vnni", "avx-vnni", "avx2", "neon-dotprod" or "portable"):
// tests check each build takes the path its -march promises.
extern "C" const char* pagejax_int8_matmul_dot_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(PAGEJAX_PORTABLE)
  return "avx512-vnni";
#elif defined(PAGEJAX_INT8_VECTOR)
  return PAGEJAX_INT8_DOT_ISA;
#else
  return "portable";
#endif
}

namespace {

ffi::Error Int8MatmulCpu(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> wscale,
                         ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || wscale.element_count() != wd[1] || xd[1] > kMaxK)
    return ffi::Error::InvalidArgument("int8_matmul_cpu: expected x [M, K], w [K, N] and w_scale [N], K <= 65535");
  pagejax_int8_matmul(x.typed_data(), w.typed_data(), wscale.typed_data(), out->typed_data(), xd[0], xd[1], wd[1]);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagejaxInt8MatmulCpu, Int8MatmulCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w [K, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_scale [N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]
