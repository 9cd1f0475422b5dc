// float32 matmul of a few activation rows (batch-1 decode): an XLA FFI custom call behind
// kernels_pallas/matmul/f32_gemv_cpu.py.
//
// y [M, N] = x [M, K] @ w, w [K, N] (a Linear) or, `transposed`, w [N, K] (a tied LM head, x @ E^T), M <= kMaxRows.
// Why: at one row the product reads each weight once and does 2 flops per 4 bytes, so its speed is the memory
// bandwidth it reaches. XLA:CPU runs such a dot on one thread (its process CPU time equals its wall time), at about
// what one core reads (BENCHMARKS.md, "C++ CPU kernels per ISA"); here every work item streams a contiguous run of w,
// on the library's worker threads (parallel_for.h), with the activations and partial sums in L1. That pays only where
// more cores read more bandwidth: `gate.MEASURED` says where it was measured to.
//   * w [K, N]: items are (a part of K's rows) x (a block of up to kBlock columns); for a narrow matrix the block is
//     the whole row, so a part is one contiguous run of memory. Four rows of w at a time are multiplied into the
//     part's sums (in the scratch, L1-resident); the parts' sums are then added in part order.
//   * w [N, K]: items are blocks of kHeadRows rows of E, each row a dot product with x in 8-float lanes, summed
//     across lanes at the end.
// Vector code once for every ISA: GCC / Clang vector extensions (8 floats), which the compiler maps to AVX2 / AVX-512
// ymm registers or to NEON register pairs; fp-contract makes a * b + c one FMA. The portable build
// (PAGEJAX_PORTABLE) compiles the same source for the baseline ISA. The same result every call: items and the order
// their sums are added in depend only on the shape, never on which thread ran an item. Not batch invariant (XLA's dot
// runs the other row counts): `LLM(batch_invariant=True)` uses invariant_matmul_cpu.cc instead.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel_for.h"
#include "scratch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// a * b + c as one FMA in the loops below (ISO C++ mode turns contraction off); not around the FFI handler, whose
// always_inline helpers a function-level optimize attribute would stop inlining.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#ifdef __clang__
#pragma clang fp contract(fast)
#endif

typedef float v8 __attribute__((vector_size(32)));

constexpr int kMaxRows = 4;         // activation rows the kernel takes (the wrapper checks)
constexpr int64_t kBlock = 2048;    // columns per item at most, w [K, N]: a row's sums stay in L1
constexpr int64_t kMinPart = 32;    // rows of w per part at least
constexpr int64_t kItems = 8;       // items to aim for: K is cut into parts until there are about this many
constexpr int64_t kHeadRows = 128;  // rows of E per item, w [N, K]

inline v8 load(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

inline v8 splat(float a) { return v8{} + a; }

inline float lanes_sum(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// acc[r][c0 .. c1) (+)= sum over rows k0 .. k1 of w of x[r, k] * w[k, c], R rows of x, acc row stride n. The first
// group of rows sets acc (no separate zero fill).
template <int R>
void rows_block(const float* x, int64_t k_dim, const float* w, int64_t n, int64_t k0, int64_t k1, int64_t c0,
                int64_t c1, float* acc) {
  const int64_t vec_end = c0 + (c1 - c0) / 8 * 8;
  bool first = true;
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4, first = false) {
    float xs[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) xs[r][j] = x[r * k_dim + k + j];
    const float* w0 = w + k * n;
    const float* w1 = w0 + n;
    const float* w2 = w1 + n;
    const float* w3 = w2 + n;
    int64_t c = c0;
    for (; c < vec_end; c += 8) {
      const v8 a = load(w0 + c), b = load(w1 + c), d = load(w2 + c), e = load(w3 + c);
      for (int r = 0; r < R; ++r) {
        v8 y = first ? v8{} : load(acc + r * n + c);
        y = y + splat(xs[r][0]) * a;
        y = y + splat(xs[r][1]) * b;
        y = y + splat(xs[r][2]) * d;
        y = y + splat(xs[r][3]) * e;
        store(acc + r * n + c, y);
      }
    }
    for (; c < c1; ++c)
      for (int r = 0; r < R; ++r) {
        float y = first ? 0.f : acc[r * n + c];
        y = y + xs[r][0] * w0[c];
        y = y + xs[r][1] * w1[c];
        y = y + xs[r][2] * w2[c];
        y = y + xs[r][3] * w3[c];
        acc[r * n + c] = y;
      }
  }
  for (; k < k1; ++k, first = false)  // the part's last rows, one at a time
    for (int64_t c = c0; c < c1; ++c)
      for (int r = 0; r < R; ++r) acc[r * n + c] = (first ? 0.f : acc[r * n + c]) + x[r * k_dim + k] * w[k * n + c];
}

// y[r, e] = dot(x[r, :], E[e, :]) for rows e0 .. e1 of E [N, K], ER rows of E at a time.
template <int R>
void head_block(const float* x, int64_t k_dim, const float* e, int64_t n, int64_t e0, int64_t e1, float* y) {
  // Rows of E a pass, and accumulators per (row of E, row of x): 8 x 1 at one row (8 loads in flight: measured
  // ~10% faster than 4 x 2 there), 4 x 2 at two, 2 x 2 at three or four.
  constexpr int ER = R == 1 ? 8 : R == 2 ? 4 : 2;
  constexpr int AC = R == 1 ? 1 : 2;
  const int64_t vec_end = k_dim / (8 * AC) * (8 * AC);
  int64_t i = e0;
  for (; i + ER <= e1; i += ER) {
    v8 acc[ER][R][AC] = {};
    for (int64_t k = 0; k < vec_end; k += 8 * AC) {
      v8 xv[R][AC];
      for (int r = 0; r < R; ++r)
        for (int a = 0; a < AC; ++a) xv[r][a] = load(x + r * k_dim + k + 8 * a);
      for (int j = 0; j < ER; ++j) {
        const float* row = e + (i + j) * k_dim + k;
        for (int a = 0; a < AC; ++a) {
          const v8 wv = load(row + 8 * a);
          for (int r = 0; r < R; ++r) acc[j][r][a] = acc[j][r][a] + xv[r][a] * wv;
        }
      }
    }
    for (int j = 0; j < ER; ++j)
      for (int r = 0; r < R; ++r) {
        v8 t = acc[j][r][0];
        for (int a = 1; a < AC; ++a) t = t + acc[j][r][a];
        float s = lanes_sum(t);
        for (int64_t k = vec_end; k < k_dim; ++k) s += x[r * k_dim + k] * e[(i + j) * k_dim + k];
        y[r * n + i + j] = s;
      }
  }
  for (; i < e1; ++i)  // the block's last rows of E, one at a time
    for (int r = 0; r < R; ++r) {
      v8 a0 = {}, a1 = {};
      for (int64_t k = 0; k < vec_end; k += 16) {
        a0 = a0 + load(x + r * k_dim + k) * load(e + i * k_dim + k);
        a1 = a1 + load(x + r * k_dim + k + 8) * load(e + i * k_dim + k + 8);
      }
      float s = lanes_sum(a0 + a1);
      for (int64_t k = vec_end; k < k_dim; ++k) s += x[r * k_dim + k] * e[i * k_dim + k];
      y[r * n + i] = s;
    }
}

template <typename Fn>
void with_rows(int64_t m, Fn&& fn) {
  switch (m) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, 4>{}); break;
  }
}

void gemv(const float* x, const float* w, int64_t m, int64_t k, int64_t n, float* y) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int64_t wanted = std::clamp<int64_t>((kItems + blocks - 1) / blocks, 1, std::max<int64_t>(1, k / kMinPart));
  const int64_t rows_per_part = (k + wanted - 1) / wanted;
  const int64_t parts = (k + rows_per_part - 1) / rows_per_part;
  float* partial = parts > 1 ? pagejax::scratch<float, 0>(parts * m * n) : y;  // every element is written
  pagejax::parallel_for(parts * blocks, [&](int64_t i) {
    const int64_t p = i / blocks, c0 = (i % blocks) * kBlock;
    const int64_t k0 = p * rows_per_part, k1 = std::min(k, k0 + rows_per_part);
    with_rows(m, [&](auto rows) {
      rows_block<decltype(rows)::value>(x, k, w, n, k0, k1, c0, std::min(n, c0 + kBlock), partial + p * m * n);
    });
  });
  if (parts == 1) return;
  for (int64_t r = 0; r < m; ++r) {  // the parts' sums in part order (m * n floats: microseconds)
    float* dst = y + r * n;
    std::copy(partial + r * n, partial + (r + 1) * n, dst);
    for (int64_t p = 1; p < parts; ++p) {
      const float* src = partial + (p * m + r) * n;
      for (int64_t c = 0; c < n; ++c) dst[c] += src[c];
    }
  }
}

void head(const float* x, const float* e, int64_t m, int64_t k, int64_t n, float* y) {
  pagejax::parallel_for((n + kHeadRows - 1) / kHeadRows, [&](int64_t i) {
    const int64_t e0 = i * kHeadRows, e1 = std::min(n, e0 + kHeadRows);
    with_rows(m, [&](auto rows) { head_block<decltype(rows)::value>(x, k, e, n, e0, e1, y); });
  });
}

#pragma GCC pop_options

ffi::Error F32GemvCpu(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, bool transposed,
                      ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[0] > kMaxRows)
    return ffi::Error::InvalidArgument("f32_gemv_cpu: x [M <= 4, K], w [K, N] (or [N, K] transposed)");
  const int64_t m = xd[0], k = xd[1], n = transposed ? wd[0] : wd[1];
  if ((transposed ? wd[1] : wd[0]) != k) return ffi::Error::InvalidArgument("f32_gemv_cpu: x and w disagree on K");
  float* y = out->typed_data();
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(y, y + m * n, 0.f);
    return ffi::Error::Success();
  }
  if (transposed)
    head(x.typed_data(), w.typed_data(), m, k, n, y);
  else
    gemv(x.typed_data(), w.typed_data(), m, k, n, y);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagejaxF32GemvCpu, F32GemvCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K], M <= 4
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N], or [N, K] when transposed
                                  .Attr<bool>("transposed")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]
