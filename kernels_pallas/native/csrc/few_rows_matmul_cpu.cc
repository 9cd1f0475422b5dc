// The float32 matmul of a few rows on CPU (a decode step's projections and LM head at small batch): an XLA FFI
// custom call behind kernels_pallas/matmul/few_rows_cpu.py.
//
// Why: at a few rows a float32 matmul streams its weight from memory once and does little arithmetic per byte, so it
// should run near the memory's read rate whatever the row count; XLA:CPU's dot read SmolLM2's weights ever more
// slowly as rows were added (BENCHMARKS.md), so a decode step at batch 2 or 4 took far longer than at batch 1.
//
// y [M, N] = x [M, K] @ w [K, N]: K is cut into slices over the library's worker threads (parallel_for.h), each a
// contiguous stretch of w walked in order, four rows at a time, each row times x[r, k] added into the slice's partial
// [M, N] (per-thread scratch); the partials are summed after. Each weight byte is read once for all rows, in
// sequence, and g++ vectorizes the column loop for the machine's ISA (-march=native: AVX-512, AVX2 or NEON). `transposed` (a tied LM head: y = x @ E^T, E [N, K]): each
// output is a dot of an x row with a row of E, blocks of E's rows over the threads, each row read once for all M.
// Sums run in k order within each vector lane group as g++ vectorizes them (the library's -fassociative-math), so
// results match XLA's dot to float32 rounding, not bitwise.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel_for.h"
#include "scratch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 16;

// partial [M, N] = x[:, k0:k1] @ w[k0:k1, :]: rows k0..k1 of w are one contiguous stretch of memory, walked in
// order four rows at a time, each row's columns added into the M accumulator rows.
void k_slice(const float* x, const float* w, float* partial, int64_t m, int64_t k, int64_t n, int64_t k0,
             int64_t k1) {
  std::fill(partial, partial + m * n, 0.f);
  int64_t kk = k0;
  for (; kk + 4 <= k1; kk += 4) {
    const float* w0 = w + kk * n;
    const float* w1 = w0 + n;
    const float* w2 = w1 + n;
    const float* w3 = w2 + n;
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k + kk;
      const float a0 = xr[0], a1 = xr[1], a2 = xr[2], a3 = xr[3];
      float* pr = partial + r * n;
      for (int64_t j = 0; j < n; ++j) pr[j] += a0 * w0[j] + a1 * w1[j] + a2 * w2[j] + a3 * w3[j];
    }
  }
  for (; kk < k1; ++kk) {
    const float* w0 = w + kk * n;
    for (int64_t r = 0; r < m; ++r) {
      const float a0 = x[r * k + kk];
      float* pr = partial + r * n;
      for (int64_t j = 0; j < n; ++j) pr[j] += a0 * w0[j];
    }
  }
}

// Rows [n0, n1) of E [N, K]: y[r, i] = x[r] . E[i]. With several x rows, four rows of E at a time, so each x row's
// pass over K carries four independent sums (one would wait on its own adds); one x row reads one E row at a time
// (four streams measured slower there, BENCHMARKS.md).
void transposed_block(const float* x, const float* e, float* y, int64_t m, int64_t k, int64_t n, int64_t n0,
                      int64_t n1) {
  int64_t i = n0;
  for (; m > 1 && i + 4 <= n1; i += 4) {
    const float* e0 = e + i * k;
    const float* e1 = e0 + k;
    const float* e2 = e1 + k;
    const float* e3 = e2 + k;
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k;
      float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
      for (int64_t c = 0; c < k; ++c) {
        const float v = xr[c];
        d0 += v * e0[c];
        d1 += v * e1[c];
        d2 += v * e2[c];
        d3 += v * e3[c];
      }
      float* yr = y + r * n + i;
      yr[0] = d0, yr[1] = d1, yr[2] = d2, yr[3] = d3;
    }
  }
  for (; i < n1; ++i) {
    const float* ei = e + i * k;
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k;
      float dot = 0.f;
      for (int64_t c = 0; c < k; ++c) dot += xr[c] * ei[c];
      y[r * n + i] = dot;
    }
  }
}

}  // namespace

// y [M, N] = x [M, K] @ w [K, N] (or @ w^T for w [N, K] when `transposed`), M <= kMaxRows.
void pagejax_few_rows_matmul(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n,
                             bool transposed) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    std::fill(y, y + m * n, 0.f);
    return;
  }
  if (transposed) {
    constexpr int64_t kRowsPerItem = 64;
    pagejax::parallel_for((n + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t i) {
      transposed_block(x, w, y, m, k, n, i * kRowsPerItem, std::min(n, (i + 1) * kRowsPerItem));
    });
    return;
  }
  // K in slices (whole groups of 4 rows), 4 a thread where K allows; their partial sums added after, in order.
  const int64_t threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t groups = (k + 3) / 4, slices = std::min<int64_t>(groups, 4 * threads);
  const int64_t per = (groups + slices - 1) / slices * 4, used = (k + per - 1) / per;
  float* partial = pagejax::scratch<float, 0>(used * m * n);
  pagejax::parallel_for(used, [&](int64_t i) {
    k_slice(x, w, partial + i * m * n, m, k, n, i * per, std::min(k, (i + 1) * per));
  });
  constexpr int64_t kColumns = 1024;
  pagejax::parallel_for((m * n + kColumns - 1) / kColumns, [&](int64_t c) {
    const int64_t e0 = c * kColumns, e1 = std::min(m * n, e0 + kColumns);
    for (int64_t e = e0; e < e1; ++e) {
      float sum = partial[e];
      for (int64_t i = 1; i < used; ++i) sum += partial[i * m * n + e];
      y[e] = sum;
    }
  });
}

namespace {

ffi::Error FewRowsMatmulCpu(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y,
                            bool transposed) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[0] > kMaxRows || xd[1] != wd[transposed ? 1 : 0])
    return ffi::Error::InvalidArgument("few_rows_matmul_cpu: expected x [M, K] with M <= 16 and w [K, N] ([N, K] "
                                       "transposed)");
  pagejax_few_rows_matmul(x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], wd[transposed ? 0 : 1],
                          transposed);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagejaxFewRowsMatmulCpu, FewRowsMatmulCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N], or [N, K] transposed
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<bool>("transposed"));
