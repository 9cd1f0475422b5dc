// Weight-only quantized matmul on CPU for grouped weights: an XLA FFI custom call behind inference/quantization.py's
// `matmul(method="dequant")` -- GGUF's Q8_0 / Q4_0 / Q4_1 blocks and the "int4" mode's min-form groups.
//
// y = x @ dequantize(W) with float32 activations, computed group by group without a float copy of W:
//   y[r, n] = sum_g scale[g, n] * (sum_{k in g} x[r, k] * z[k, n] - zero[g, n] * xs[r, g]) + offset[g, n] * xs[r, g]
// where z are the integer codes and xs[r, g] the sum of x over the group (the zero / offset terms when present).
//
// Why: XLA:CPU ran "dequant" as written -- a float32 copy of every weight, written and read again per call -- which
// made a batch-1 SmolLM2 step with 4-bit weights 150 ms, 12x the int8 one (BENCHMARKS.md). Here each code byte is
// read once: work items of whole groups x up to 4096 columns, 64 columns and up to two activation rows in registers
// at a time, the K parts' partial sums added at the end in a fixed order.

#include <algorithm>
#include <cstdint>

#include "parallel_for.h"
#include "scratch.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(PAGEJAX_PORTABLE)
#include <immintrin.h>
#define PAGEJAX_GROUPED_AVX512 1
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kStrip = 64;  // columns per register block
constexpr int64_t kBlock = 4096;  // columns per work item at most
constexpr int64_t kItems = 32;    // work items to aim for: K is cut into parts until there are about this many
constexpr int64_t kRows = 2;    // activation rows per pass over a strip
constexpr int64_t kPrefetch = 16;  // code rows ahead: they are N bytes apart, beyond the hardware prefetcher's reach

struct Grouped {
  const float* x;        // [M, K]
  const uint8_t* q;      // bits 8: int8 [K, N]; bits 4: [K/2, N], per group byte i = z[i] | z[i + g/2] << 4
  const float* scale;    // [G, N]
  const int8_t* zero;    // [G, N] or nullptr
  const float* offset;   // [G, N] or nullptr
  const float* xs;       // [M, G] sums of x over each group
  int64_t m, k, n, gs, bits;

  int64_t groups() const { return k / gs; }

  // Code z[k, col] (signed for 8 bits, 0..15 for 4).
  int32_t code(int64_t kk, int64_t col) const {
    if (bits == 8) return static_cast<int8_t>(q[kk * n + col]);
    const int64_t g = kk / gs, i = kk % gs, half = gs / 2;
    const uint8_t byte = q[(g * half + i % half) * n + col];
    return i < half ? byte & 0x0F : byte >> 4;
  }

  // Rows [r0, r0 + rows) x columns [n0, n0 + width) over groups [g0, g1), into dst (row stride n).
  void portable(int64_t r0, int64_t rows, int64_t n0, int64_t width, int64_t g0, int64_t g1, float* dst) const {
    for (int64_t r = r0; r < r0 + rows; ++r)
      for (int64_t c = n0; c < n0 + width; ++c) {
        float y = 0.f;
        for (int64_t g = g0; g < g1; ++g) {
          float dot = 0.f;
          for (int64_t kk = g * gs; kk < (g + 1) * gs; ++kk) dot += x[r * k + kk] * static_cast<float>(code(kk, c));
          const float sum = xs[r * groups() + g];
          if (zero != nullptr) dot -= static_cast<float>(zero[g * n + c]) * sum;
          y += scale[g * n + c] * dot;
          if (offset != nullptr) y += offset[g * n + c] * sum;
        }
        dst[r * n + c] = y;
      }
  }

#ifdef PAGEJAX_GROUPED_AVX512
  // The strip's 64 bytes of code row `row`, if there is one.
  void prefetch(int64_t row, int64_t n0) const {
    if (row < (bits == 4 ? k / 2 : k)) _mm_prefetch(reinterpret_cast<const char*>(q + row * n + n0), _MM_HINT_T0);
  }

  static __mmask16 lanes(int64_t width, int t) {
    const int64_t left = std::clamp<int64_t>(width - 16 * t, 0, 16);
    return left == 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  }

  // The same for R rows and one strip, 16 columns a vector; lo / hi accumulators (the two nibbles of a byte, or
  // even / odd rows for 8 bits) halve the FMA dependency chains.
  template <int R>
  void strip(int64_t r0, int64_t n0, int64_t width, int64_t g0, int64_t g1, float* dst) const {
    // All 4 vectors always, masked past `width`: a loop bound known at compile time keeps y, lo, hi in registers.
    __mmask16 mask[4];
    for (int t = 0; t < 4; ++t) mask[t] = lanes(width, t);
    __m512 y[R][4];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 4; ++t) y[r][t] = _mm512_setzero_ps();
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t g = g0; g < g1; ++g) {
      __m512 lo[R][4], hi[R][4];
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < 4; ++t) lo[r][t] = hi[r][t] = _mm512_setzero_ps();
      const float* xg[R];
      for (int r = 0; r < R; ++r) xg[r] = x + (r0 + r) * k + g * gs;
      if (bits == 4) {
        const int64_t half = gs / 2;
        for (int64_t i = 0; i < half; ++i) {
          const uint8_t* row = q + (g * half + i) * n + n0;
          prefetch(g * half + i + kPrefetch, n0);
          for (int t = 0; t < 4; ++t) {
            // A code's float is a lookup (vpermps reads an index's low 4 bits): cheaper than and + convert.
            const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask[t], row + 16 * t));
            const __m512 zl = _mm512_permutexvar_ps(b, codes);
            const __m512 zh = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), codes);
            for (int r = 0; r < R; ++r) {
              lo[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r][i]), zl, lo[r][t]);
              hi[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r][half + i]), zh, hi[r][t]);
            }
          }
        }
      } else {
        for (int64_t i = 0; i < gs; i += 2) {
          const uint8_t* row = q + (g * gs + i) * n + n0;
          prefetch(g * gs + i + kPrefetch, n0);
          prefetch(g * gs + i + kPrefetch + 1, n0);
          for (int t = 0; t < 4; ++t) {
            const __m512 z0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask[t], row + 16 * t)));
            const __m512 z1 =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask[t], row + n + 16 * t)));
            for (int r = 0; r < R; ++r) {
              lo[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r][i]), z0, lo[r][t]);
              hi[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r][i + 1]), z1, hi[r][t]);
            }
          }
        }
      }
      for (int t = 0; t < 4; ++t) {
        const int64_t col = g * n + n0 + 16 * t;
        const __m512 sc = _mm512_maskz_loadu_ps(mask[t], scale + col);
        const __m512 zp = zero == nullptr ? _mm512_setzero_ps()
                                          : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                _mm_maskz_loadu_epi8(mask[t], zero + col)));
        const __m512 off = offset == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[t], offset + col);
        for (int r = 0; r < R; ++r) {
          const __m512 sum = _mm512_set1_ps(xs[(r0 + r) * groups() + g]);
          const __m512 dot = _mm512_fnmadd_ps(zp, sum, _mm512_add_ps(lo[r][t], hi[r][t]));
          y[r][t] = _mm512_fmadd_ps(off, sum, _mm512_fmadd_ps(sc, dot, y[r][t]));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 4; ++t) _mm512_mask_storeu_ps(dst + (r0 + r) * n + n0 + 16 * t, mask[t], y[r][t]);
  }
#endif

  // Columns [c0, c1) over groups [g0, g1), strip by strip, so each code row of the item is read front to back.
  void item(int64_t c0, int64_t c1, int64_t g0, int64_t g1, float* dst) const {
    for (int64_t n0 = c0; n0 < c1; n0 += kStrip) {
      const int64_t width = std::min(kStrip, c1 - n0);
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = std::min(kRows, m - r0);
#ifdef PAGEJAX_GROUPED_AVX512
        if (rows == 2) {
          strip<2>(r0, n0, width, g0, g1, dst);
        } else {
          strip<1>(r0, n0, width, g0, g1, dst);
        }
#else
        portable(r0, rows, n0, width, g0, g1, dst);
#endif
      }
    }
  }
};

ffi::Error GroupedMatmulCpu(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::S8> zero, ffi::Buffer<ffi::F32> offset, int64_t bits, int64_t group_size,
                            bool has_zero, bool has_offset, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || (bits != 4 && bits != 8) || group_size <= 0 ||
      group_size % 2 || xd[1] % group_size || qd[0] * (bits == 4 ? 2 : 1) != xd[1] ||
      sd[0] != xd[1] / group_size || sd[1] != qd[1] || (has_zero && zero.element_count() != scale.element_count()) ||
      (has_offset && offset.element_count() != scale.element_count()) ||
      q.element_type() != (bits == 4 ? ffi::U8 : ffi::S8))
    return ffi::Error::InvalidArgument("grouped_matmul_cpu: inconsistent shapes or dtypes");
  const int64_t m = xd[0], k = xd[1], n = qd[1], groups = k / group_size;
  float* y = out->typed_data();
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(y, y + m * n, 0.f);
    return ffi::Error::Success();
  }
  float* xs = pagejax::scratch<float, 0>(m * groups);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t c = g * group_size; c < (g + 1) * group_size; ++c) s += x.typed_data()[r * k + c];
      xs[r * groups + g] = s;
    }
  const Grouped mm{x.typed_data(), static_cast<const uint8_t*>(q.untyped_data()), scale.typed_data(),
                   has_zero ? zero.typed_data() : nullptr, has_offset ? offset.typed_data() : nullptr, xs,
                   m, k, n, group_size, bits};
  // Items: (a part of K, whole groups) x (a block of up to kBlock columns). Each item reads its code rows front to
  // back over its columns; a strip-per-item split, each strip walking all K rows 64 bytes at a time, read SmolLM2's
  // Q8_0 LM head at half the speed. K is cut into parts until there are about kItems items (at ~30 us a call, both
  // threads need several), and the parts' partial sums are added below, part by part. Measured on SmolLM2's
  // matrices: 4096-column blocks 1.7 vs 2.2 ms (1024) for the head; one group per part 5.9 vs 7.3 ms (three) for
  // the layers' 210 matrices.
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int64_t wanted = std::clamp<int64_t>((kItems + blocks - 1) / blocks, 1, groups);
  const int64_t groups_per_part = (groups + wanted - 1) / wanted;
  const int64_t parts = (groups + groups_per_part - 1) / groups_per_part;
  float* partial = parts > 1 ? pagejax::scratch<float, 1>(parts * m * n) : nullptr;  // every element is written
  pagejax::parallel_for(parts * blocks, [&](int64_t i) {
    const int64_t p = i / blocks, c0 = (i % blocks) * kBlock;
    const int64_t g0 = p * groups_per_part, g1 = std::min(groups, g0 + groups_per_part);
    mm.item(c0, std::min(n, c0 + kBlock), g0, g1, parts > 1 ? partial + p * m * n : y);
  });
  if (parts > 1) {
    pagejax::parallel_for((n + 1023) / 1024, [&](int64_t c) {
      const int64_t c0 = c * 1024, c1 = std::min<int64_t>(n, c0 + 1024);
      for (int64_t r = 0; r < m; ++r) {
        float* dst = y + r * n;
        std::copy(partial + r * n + c0, partial + r * n + c1, dst + c0);
        for (int64_t p = 1; p < parts; ++p) {
          const float* src = partial + (p * m + r) * n;
          for (int64_t j = c0; j < c1; ++j) dst[j] += src[j];
        }
      }
    });
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagejaxGroupedMatmulCpu, GroupedMatmulCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // codes: int8 [K, N] or uint8 [K/2, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [G, N]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // zero point [G, N] or [1, 1]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // offset [G, N] or [1, 1]
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group_size")
                                  .Attr<bool>("has_zero")
                                  .Attr<bool>("has_offset")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]
