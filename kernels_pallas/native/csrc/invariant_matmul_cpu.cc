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
// block), where it stays in L2 while every block of up to 4 rows walks it (4 x 4 accumulators in registers).
// `transposed` (a tied LM head x @ E^T with E [N, K]): a strip's 64 rows of E are transposed into the scratch
// instead (16x16 register blocks), then the same micro-kernel. Strips are spread over the library's worker threads (parallel_for.h), each output element computed by
// one thread.

// The library is built with -fassociative-math (build.FLAGS); here it could vectorize the portable path's chain
// over k into partial sums, which is exactly what the contract forbids.
#pragma GCC optimize("no-associative-math")
#ifdef __clang__
#pragma clang fp reassociate(off)
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>

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

constexpr int64_t kStrip = 64;

struct Strip {
  const float* w;  // the strip's first column: element (k, j) at w[k * ld + j]
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

// Rows [r0, r0 + R) of x times one strip: R x 4 accumulators, one fma per (row, k, 16 columns).
// Up to 4 rows x 64 columns of accumulators as named registers: with an array of __m512 (indexed in loops), g++ kept
// a stack copy of every accumulator updated on each k (16 stores per k, half the speed).
#define PAGEJAX_ROW(r)                                                                    \
  if constexpr (R > r) {                                                                 \
    const __m512 xv = _mm512_set1_ps(x[(r0 + r) * k_dim + k]);                           \
    a##r##0 = _mm512_fmadd_ps(xv, w0, a##r##0);                                          \
    a##r##1 = _mm512_fmadd_ps(xv, w1, a##r##1);                                          \
    a##r##2 = _mm512_fmadd_ps(xv, w2, a##r##2);                                          \
    a##r##3 = _mm512_fmadd_ps(xv, w3, a##r##3);                                          \
  }
#define PAGEJAX_STORE(r)                                                                  \
  if constexpr (R > r) {                                                                 \
    float* o = out + (r0 + r) * n_dim;                                                   \
    _mm512_mask_storeu_ps(o, m0, a##r##0);                                               \
    _mm512_mask_storeu_ps(o + 16, m1, a##r##1);                                          \
    _mm512_mask_storeu_ps(o + 32, m2, a##r##2);                                          \
    _mm512_mask_storeu_ps(o + 48, m3, a##r##3);                                          \
  }

template <int R>
void block(const float* x, int64_t k_dim, int64_t r0, const Strip& s, float* out, int64_t n_dim) {
  const __mmask16 m0 = first_lanes(s.cols), m1 = first_lanes(s.cols - 16), m2 = first_lanes(s.cols - 32),
                  m3 = first_lanes(s.cols - 48);
  __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
  const float* w = s.w;
  for (int64_t k = 0; k < k_dim; ++k, w += s.ld) {
    const __m512 w0 = _mm512_maskz_loadu_ps(m0, w), w1 = _mm512_maskz_loadu_ps(m1, w + 16);
    const __m512 w2 = _mm512_maskz_loadu_ps(m2, w + 32), w3 = _mm512_maskz_loadu_ps(m3, w + 48);
    PAGEJAX_ROW(0)
    PAGEJAX_ROW(1)
    PAGEJAX_ROW(2)
    PAGEJAX_ROW(3)
  }
  PAGEJAX_STORE(0)
  PAGEJAX_STORE(1)
  PAGEJAX_STORE(2)
  PAGEJAX_STORE(3)
}
#undef PAGEJAX_ROW
#undef PAGEJAX_STORE
#else
// Portable path: the same chain per element with std::fma (the compiler may vectorize over columns, never over k).
template <int R>
void block(const float* x, int64_t k_dim, int64_t r0, const Strip& s, float* out, int64_t n_dim) {
  float acc[R][kStrip] = {};
  for (int64_t k = 0; k < k_dim; ++k)
    for (int r = 0; r < R; ++r) {
      const float xv = x[(r0 + r) * k_dim + k];
      for (int64_t j = 0; j < s.cols; ++j) acc[r][j] = std::fma(xv, s.w[k * s.ld + j], acc[r][j]);
    }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < s.cols; ++j) out[(r0 + r) * n_dim + j] = acc[r][j];
}
#endif

// Rows n0 .. n0 + cols of E [N, K] -> the strip's [K, kStrip] slice t (columns past cols zero). With AVX-512, 16x16
// blocks transposed in registers (the scalar copy of 2.3 KB rows into 256-byte-strided columns was the LM head's
// whole cost); a copy, so it changes no bits.
void pack_transposed(const float* e, int64_t k_dim, int64_t n0, int64_t cols, float* t) {
#ifdef PAGEJAX_INVARIANT_AVX512
  for (int64_t kb = 0; kb < k_dim; kb += 16) {
    const __mmask16 lanes = first_lanes(k_dim - kb);
    const int64_t depth = std::min<int64_t>(16, k_dim - kb);
    for (int64_t jb = 0; jb < kStrip; jb += 16) {
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = jb + i < cols ? _mm512_maskz_loadu_ps(lanes, e + (n0 + jb + i) * k_dim + kb) : _mm512_setzero_ps();
      pagejax_transpose16(r);
      for (int64_t d = 0; d < depth; ++d) _mm512_storeu_ps(t + (kb + d) * kStrip + jb, r[d]);
    }
  }
#else
  for (int64_t c = 0; c < k_dim; ++c)
    for (int64_t j = 0; j < kStrip; ++j) t[c * kStrip + j] = j < cols ? e[(n0 + j) * k_dim + c] : 0.f;
#endif
}

ffi::Error InvariantMatmulCpu(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, bool transposed,
                              ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument("invariant_matmul_cpu: x [M, K], w [K, N] (or [N, K] transposed)");
  const int64_t m = xd[0], k = xd[1], n = transposed ? wd[0] : wd[1];
  if ((transposed ? wd[1] : wd[0]) != k)
    return ffi::Error::InvalidArgument("invariant_matmul_cpu: x and w disagree on K");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* op = out->typed_data();
  const int64_t strips = (n + kStrip - 1) / kStrip;
  pagejax::parallel_for(strips, [&](int64_t i) {
    const int64_t n0 = i * kStrip, cols = std::min(kStrip, n - n0);
    Strip s{wp + n0, n, cols};
    if (transposed || m > 4) {  // the strip contiguous in per-thread scratch (one row block of w reads it once)
      float* t = pagejax::scratch<float, 0>(static_cast<size_t>(k * kStrip));
      if (transposed)
        pack_transposed(wp, k, n0, cols, t);
      else
        for (int64_t c = 0; c < k; ++c) std::copy(wp + c * n + n0, wp + c * n + n0 + cols, t + c * kStrip);
      s = Strip{t, kStrip, cols};
    }
    pagejax::for_row_chunks<4>(m, [&](auto r, int64_t r0) {
      block<decltype(r)::value>(xp, k, r0, s, op + n0, n);
    });
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagejaxInvariantMatmulCpu, InvariantMatmulCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N], or [N, K] when transposed
                                  .Attr<bool>("transposed")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]
