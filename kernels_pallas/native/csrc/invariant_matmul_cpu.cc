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
// `transposed` (a tied LM head x @ E^T with E [N, K]): rows of x in the lanes instead, x^T copied into scratch once,
// each E[n, k] broadcast (E read once, contiguously along k, 8 vocabulary rows at a time); the same chain per
// element. Strips are spread over the library's worker threads (parallel_for.h), each output element computed by
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
#include <vector>

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

// Rows [r0, r0 + R) of x times one strip: R x 4 accumulators, one fma per (row, k, 16 columns).
template <int R>
void block(const float* x, int64_t k_dim, int64_t r0, const Strip& s, float* out, int64_t n_dim) {
  __m512 acc[R][4];
  __mmask16 mask[4];
  for (int c = 0; c < 4; ++c) mask[c] = first_lanes(s.cols - 16 * c);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    __m512 wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = _mm512_maskz_loadu_ps(mask[c], s.w + k * s.ld + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[(r0 + r) * k_dim + k]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_mask_storeu_ps(out + (r0 + r) * n_dim + 16 * c, mask[c], acc[r][c]);
}
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

// x [M, K] @ E^T, E [N, K]: rows of x in lanes (blocks of kLanes rows, x^T [K, rows] in scratch), kTile vocabulary
// rows per register block, each acc lane one chain fma(E[n, k], x[m, k], acc) over k in order.
constexpr int64_t kLanes = 16, kTile = 8, kTask = 64;

#ifdef PAGEJAX_INVARIANT_AVX512
void transposed_tile(const float* xt, int64_t k_dim, int64_t rows, const float* e, int64_t tile, float* acc_out) {
  __m512 acc[kTile];
  for (int i = 0; i < kTile; ++i) acc[i] = _mm512_setzero_ps();
  const __mmask16 lanes = first_lanes(rows);
  for (int64_t c = 0; c < k_dim; ++c) {
    const __m512 xv = _mm512_maskz_loadu_ps(lanes, xt + c * kLanes);
    for (int i = 0; i < kTile; ++i)
      if (i < tile) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(e[i * k_dim + c]), xv, acc[i]);
  }
  for (int i = 0; i < kTile; ++i) _mm512_storeu_ps(acc_out + i * kLanes, acc[i]);
}
#else
void transposed_tile(const float* xt, int64_t k_dim, int64_t rows, const float* e, int64_t tile, float* acc_out) {
  float acc[kTile][kLanes] = {};
  for (int64_t c = 0; c < k_dim; ++c)
    for (int64_t i = 0; i < tile; ++i)
      for (int64_t l = 0; l < rows; ++l) acc[i][l] = std::fma(e[i * k_dim + c], xt[c * kLanes + l], acc[i][l]);
  for (int64_t i = 0; i < kTile; ++i)
    for (int64_t l = 0; l < kLanes; ++l) acc_out[i * kLanes + l] = acc[i][l];
}
#endif

void transposed_matmul(const float* x, const float* e, int64_t m, int64_t k, int64_t n, float* out) {
  const int64_t blocks = (m + kLanes - 1) / kLanes;
  // x^T per block of kLanes rows: [blocks, K, kLanes], zero past M (those lanes are never stored).
  std::vector<float> xt(static_cast<size_t>(blocks * k * kLanes), 0.f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c) xt[((r / kLanes) * k + c) * kLanes + r % kLanes] = x[r * k + c];
  const int64_t tasks = (n + kTask - 1) / kTask;
  pagejax::parallel_for(tasks, [&](int64_t t) {
    alignas(64) float acc[kTile * kLanes];
    const int64_t n_end = std::min(n, (t + 1) * kTask);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t rows = std::min(kLanes, m - b * kLanes);
      for (int64_t n0 = t * kTask; n0 < n_end; n0 += kTile) {
        const int64_t tile = std::min(kTile, n_end - n0);
        transposed_tile(xt.data() + b * k * kLanes, k, rows, e + n0 * k, tile, acc);
        for (int64_t l = 0; l < rows; ++l)
          for (int64_t i = 0; i < tile; ++i) out[(b * kLanes + l) * n + n0 + i] = acc[i * kLanes + l];
      }
    }
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
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* op = out->typed_data();
  if (transposed) {
    transposed_matmul(xp, wp, m, k, n, op);
    return ffi::Error::Success();
  }
  const int64_t strips = (n + kStrip - 1) / kStrip;
  pagejax::parallel_for(strips, [&](int64_t i) {
    const int64_t n0 = i * kStrip, cols = std::min(kStrip, n - n0);
    Strip s{wp + n0, n, cols};
    if (m > 4) {  // the strip contiguous in per-thread scratch (one row block reads w once: no copy)
      float* t = pagejax::scratch<float, 0>(static_cast<size_t>(k * kStrip));
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
