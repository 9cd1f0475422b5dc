// The batch-invariant float32 matmul on CPU: an XLA FFI custom call behind kernels_pallas/matmul/invariant_cpu.py.
//
// Contract: every output element y[m, n] is ONE fused-multiply-add chain over k = 0 .. K-1 in index order,
//   acc = 0; for k: acc = fma(x[m, k], w[k, n], acc)
// fma is correctly rounded, so the AVX-512 lanes, the masked column tail and the portable std::fma loop give the same
// bits; with no split of K and no tree reduction, a row's result cannot depend on M, on the row's position, on the
// register blocking or on the thread count. XLA:CPU's own dot gives a row bits that depend on M (BENCHMARKS.md,
// "Batch invariance today"), which is what `LLM(batch_invariant=True)` must not have.
//
// Blocking, w [K, N]: columns in strips of kStrip (64 = 4 vectors of 16), each strip's [K, 64] slice of w copied
// contiguous into per-thread scratch (walked in place, every k was a jump of N floats: a TLB miss per k per row
// block), where it stays in L2 while every block of up to kRows = 6 rows walks it (6 x 4 accumulators in registers).
// `transposed` (a tied LM head x @ E^T with E [N, K]): a strip's 64 rows of E are transposed into the scratch
// instead (16x16 register blocks), then the same micro-kernel; at M = 1 (nothing to share the packed strip with)
// 16 k-rows at a time into an L1 buffer inside the micro-kernel's k loop. Strips are spread over
// the library's worker threads (parallel_for.h), each output element computed by one thread. Blocking, packing and
// prefetching only change when and where an element's chain runs, never its order.

// The library is built with -fassociative-math (build.FLAGS); here it could vectorize the portable path's chain
// over k into partial sums, which is exactly what the contract forbids.
#pragma GCC optimize("no-associative-math")
#ifdef __clang__
#pragma clang fp reassociate(off)
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "parallel_for.h"
#include "register_blocks.h"
#include "scratch.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && !defined(PAGEJAX_PORTABLE)
#include <immintrin.h>
#define PAGEJAX_INVARIANT_AVX512 1
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kRows = 6;  // a register block: kRows rows x kVecs vectors of 16 columns (block's comment)
constexpr int kVecs = 4;
constexpr int64_t kStrip = 16 * kVecs;
constexpr int64_t kChunk = 16;     // k-rows of E^T transposed at a time (pack_chunk): one 16x16 register transpose
constexpr int64_t kPrefetch = 256;  // pack_chunk prefetches each E row this many floats ahead (comment there)

struct Strip {
  const float* w;  // the strip's first column: element (k, j) at w[k * ld + j] (block<R, true>: E itself)
  int64_t ld;      // row stride of w
  int64_t cols;    // columns in this strip, <= kStrip
};

#ifdef PAGEJAX_INVARIANT_AVX512
using pagejax::first_lanes;

// r[i] <- column i of the 16x16 block whose rows are r (unpack, then 64- and 128-bit lane shuffles).
inline void pagejax_transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

#endif

// Rows n0 .. n0 + cols of E [N, K], its k-rows kb .. kb + kChunk -> t [kChunk, kStrip] (row d at t + d * kStrip;
// columns past cols zero). With AVX-512, 16x16 blocks transposed in registers (the scalar copy of 2.3 KB rows into
// 256-byte-strided columns was the LM head's whole cost); a copy, so it changes no bits. Each chunk reads 64 bytes
// from each of 64 rows of E: more streams than the hardware prefetcher follows, so at one row block (batch-1 decode's
// LM head, E read once from memory, the pack inside the k loop) the loads waited on memory: there, kPrefetchRows,
// each row is prefetched kPrefetch floats ahead (measured slower when the whole strip is packed in one go).
template <bool kPrefetchRows>
inline void pack_chunk(const float* e, int64_t k_dim, int64_t n0, int64_t cols, int64_t kb, float* t) {
  static_assert(kChunk == 16, "one 16x16 transpose per 16 columns");
  const int64_t depth = std::min<int64_t>(kChunk, k_dim - kb);
#ifdef PAGEJAX_INVARIANT_AVX512
  const __mmask16 lanes = first_lanes(depth);
  for (int64_t jb = 0; jb < kStrip; jb += 16) {
    __m512 r[16];
    for (int64_t i = 0; i < 16; ++i) {
      const float* row = e + (n0 + jb + i) * k_dim + kb;
      if (kPrefetchRows && jb + i < cols) _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetch), _MM_HINT_T0);
      r[i] = jb + i < cols ? _mm512_maskz_loadu_ps(lanes, row) : _mm512_setzero_ps();
    }
    pagejax_transpose16(r);
    for (int64_t d = 0; d < depth; ++d) _mm512_storeu_ps(t + d * kStrip + jb, r[d]);
  }
#else
  for (int64_t d = 0; d < depth; ++d)
    for (int64_t j = 0; j < kStrip; ++j) t[d * kStrip + j] = j < cols ? e[(n0 + j) * k_dim + kb + d] : 0.f;
#endif
}

// The strip's whole [K, kStrip] slice of E^T into t, chunk by chunk (a row block count big enough to share it).
void pack_transposed(const float* e, int64_t k_dim, int64_t n0, int64_t cols, float* t) {
  for (int64_t kb = 0; kb < k_dim; kb += kChunk) pack_chunk<false>(e, k_dim, n0, cols, kb, t + kb * kStrip);
}

#ifdef PAGEJAX_INVARIANT_AVX512
// Rows [r0, r0 + R) of x times one strip: R x kVecs accumulators, one fma per (row, k, 16 columns). Accumulators as
// named registers: with an array of __m512 (indexed in loops), g++ kept a stack copy of every accumulator updated on
// each k (16 stores per k, half the speed). kRows x kVecs = 24 of AVX-512's 32 registers: per k, kVecs loads of w
// and kRows broadcasts of x feed 24 fmas (the 4 x 4 block fed 16 with 8 loads, and waited on loads).
#define PAGEJAX_FMA(r, v) \
  if constexpr (kVecs > v) a##r##v = _mm512_fmadd_ps(xv, w##v, a##r##v);
#define PAGEJAX_ROW(r)                                        \
  if constexpr (R > r) {                                      \
    const __m512 xv = _mm512_set1_ps(xr[(r) * k_dim + k]);    \
    PAGEJAX_FMA(r, 0) PAGEJAX_FMA(r, 1) PAGEJAX_FMA(r, 2) PAGEJAX_FMA(r, 3) \
  }
#define PAGEJAX_STORE1(r, v) \
  if constexpr (kVecs > v) _mm512_mask_storeu_ps(o + 16 * v, m##v, a##r##v);
#define PAGEJAX_STORE(r)                                                                  \
  if constexpr (R > r) {                                                                 \
    float* o = out + (r0 + r) * n_dim;                                                   \
    PAGEJAX_STORE1(r, 0) PAGEJAX_STORE1(r, 1) PAGEJAX_STORE1(r, 2) PAGEJAX_STORE1(r, 3)  \
  }
// One k of the chain for every accumulator: kVecs vectors of w's row k (at `wk`), one broadcast of x per row.
#define PAGEJAX_STEP(wk, k)                                                                               \
  {                                                                                                       \
    const __m512 w0 = _mm512_maskz_loadu_ps(m0, wk);                                                      \
    const __m512 w1 = kVecs > 1 ? _mm512_maskz_loadu_ps(m1, (wk) + 16) : w0;                              \
    const __m512 w2 = kVecs > 2 ? _mm512_maskz_loadu_ps(m2, (wk) + 32) : w0;                              \
    const __m512 w3 = kVecs > 3 ? _mm512_maskz_loadu_ps(m3, (wk) + 48) : w0;                              \
    PAGEJAX_ROW(0) PAGEJAX_ROW(1) PAGEJAX_ROW(2) PAGEJAX_ROW(3) PAGEJAX_ROW(4) PAGEJAX_ROW(5) PAGEJAX_ROW(6) \
    PAGEJAX_ROW(7)                                                                                        \
  }
#define PAGEJAX_ACC(r) __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = a##r##0, a##r##2 = a##r##0, a##r##3 = a##r##0;

// kPacked (the tied head at one row): the strip is E's rows n0 .. n0 + cols, transposed kChunk k-rows
// at a time into an L1 buffer inside the k loop while the accumulators stay in registers, rather than the whole
// [K, kStrip] strip into scratch first (written to L2 and read back, for one row block).
template <int R, bool kPacked>
void block(const float* x, int64_t k_dim, int64_t r0, const Strip& s, float* out, int64_t n_dim, int64_t n0) {
  static_assert(R >= 1 && R <= kRows && kRows <= 8 && kVecs <= 4);
  const __mmask16 m0 = first_lanes(s.cols), m1 = first_lanes(s.cols - 16), m2 = first_lanes(s.cols - 32),
                  m3 = first_lanes(s.cols - 48);
  PAGEJAX_ACC(0) PAGEJAX_ACC(1) PAGEJAX_ACC(2) PAGEJAX_ACC(3) PAGEJAX_ACC(4) PAGEJAX_ACC(5) PAGEJAX_ACC(6)
  PAGEJAX_ACC(7)
  const float* xr = x + r0 * k_dim;
  if constexpr (kPacked) {
    alignas(64) float buf[kChunk * kStrip];
    for (int64_t kb = 0; kb < k_dim; kb += kChunk) {
      pack_chunk<true>(s.w, k_dim, n0, s.cols, kb, buf);
      const float* w = buf;
      for (int64_t k = kb; k < std::min(k_dim, kb + kChunk); ++k, w += kStrip) PAGEJAX_STEP(w, k)
    }
  } else {
    const float* w = s.w;
    for (int64_t k = 0; k < k_dim; ++k, w += s.ld) PAGEJAX_STEP(w, k)
  }
  PAGEJAX_STORE(0) PAGEJAX_STORE(1) PAGEJAX_STORE(2) PAGEJAX_STORE(3) PAGEJAX_STORE(4) PAGEJAX_STORE(5)
  PAGEJAX_STORE(6) PAGEJAX_STORE(7)
}
#undef PAGEJAX_FMA
#undef PAGEJAX_ROW
#undef PAGEJAX_STORE1
#undef PAGEJAX_ACC
#undef PAGEJAX_STORE
#else
// Portable path: the same chain per element with std::fma (the compiler may vectorize over columns, never over k).
template <int R, bool kPacked>
void block(const float* x, int64_t k_dim, int64_t r0, const Strip& s, float* out, int64_t n_dim, int64_t n0) {
  float acc[R][kStrip] = {};
  float buf[kPacked ? kChunk * kStrip : 1];
  for (int64_t kb = 0; kb < k_dim; kb += kChunk) {
    const float* w = s.w + kb * s.ld;
    int64_t ld = s.ld;
    if constexpr (kPacked) {
      pack_chunk<true>(s.w, k_dim, n0, s.cols, kb, buf);
      w = buf;
      ld = kStrip;
    }
    for (int64_t k = kb; k < std::min(k_dim, kb + kChunk); ++k, w += ld)
      for (int r = 0; r < R; ++r) {
        const float xv = x[(r0 + r) * k_dim + k];
        for (int64_t j = 0; j < s.cols; ++j) acc[r][j] = std::fma(xv, w[j], acc[r][j]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < s.cols; ++j) out[(r0 + r) * n_dim + j] = acc[r][j];
}
#endif

// Calls fn(std::integral_constant<int, R>{}) for R = rows (1 <= rows <= kMax): a row block's height known at compile
// time. (register_blocks.h's for_row_chunks stops at 4 rows; this kernel's blocks are kRows tall.)
template <int kMax, typename Fn>
void with_rows(int64_t rows, Fn&& fn) {
  if constexpr (kMax > 1) {
    if (rows < kMax) return with_rows<kMax - 1>(rows, fn);
  }
  fn(std::integral_constant<int, kMax>{});
}

// y [m, n] = x [m, k] @ w (w [k, n], or [n, k] when transposed), each element one fma chain over k in order.
void invariant_matmul(const float* xp, const float* wp, int64_t m, int64_t k, int64_t n, bool transposed,
                      float* op) {
  const int64_t strips = (n + kStrip - 1) / kStrip;
  pagejax::parallel_for(strips, [&](int64_t i) {
    const int64_t n0 = i * kStrip, cols = std::min(kStrip, n - n0);
    // One row (batch-1 decode's LM head): E's strip packed as the k loop reaches it (block's kPacked). Measured
    // slower than packing the whole strip at 4 rows (16 accumulators live across the transposes).
    if (transposed && m == 1) {
      block<1, true>(xp, k, 0, Strip{wp, k, cols}, op + n0, n, n0);
      return;
    }
    Strip s{wp + n0, n, cols};
    if (transposed || m > kRows) {  // the strip contiguous in per-thread scratch (one row block of w reads it once)
      float* t = pagejax::scratch<float, 0>(static_cast<size_t>(k * kStrip));
      if (transposed)
        pack_transposed(wp, k, n0, cols, t);
      else
        for (int64_t c = 0; c < k; ++c) std::copy(wp + c * n + n0, wp + c * n + n0 + cols, t + c * kStrip);
      s = Strip{t, kStrip, cols};
    }
    // Blocks of equal height (8 rows: 4 + 4, not 6 + 2, whose short block wastes the strip's second walk).
    const int64_t blocks = (m + kRows - 1) / kRows, height = (m + blocks - 1) / blocks;
    for (int64_t r0 = 0; r0 < m; r0 += height)
      with_rows<kRows>(std::min(height, m - r0), [&](auto r) {
        block<decltype(r)::value, false>(xp, k, r0, s, op + n0, n, n0);
      });
  });
}

ffi::Error InvariantMatmulCpu(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, bool transposed,
                              ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument("invariant_matmul_cpu: x [M, K], w [K, N] (or [N, K] transposed)");
  const int64_t m = xd[0], k = xd[1], n = transposed ? wd[0] : wd[1];
  if ((transposed ? wd[1] : wd[0]) != k)
    return ffi::Error::InvalidArgument("invariant_matmul_cpu: x and w disagree on K");
  invariant_matmul(x.typed_data(), w.typed_data(), m, k, n, transposed, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagejaxInvariantMatmulCpu, InvariantMatmulCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N], or [N, K] when transposed
                                  .Attr<bool>("transposed")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]
