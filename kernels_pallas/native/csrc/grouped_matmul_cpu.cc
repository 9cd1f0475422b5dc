// Weight-only quantized matmul on CPU for grouped weights: an XLA FFI custom call behind models/quantization/formats.py's
// `matmul(method="dequant")` -- GGUF's Q8_0 / Q4_0 / Q4_1 blocks and the "int4" mode's min-form groups.
//
// y = x @ dequantize(W) with float32 activations, computed group by group without a float copy of W:
//   y[r, n] = sum_g scale[g, n] * (sum_{k in g} x[r, k] * z[k, n] - zero[g, n] * xs[r, g]) + offset[g, n] * xs[r, g]
// where z are the integer codes and xs[r, g] the sum of x over the group (the zero / offset terms when present).
//
// Why: XLA:CPU ran "dequant" as written -- a float32 copy of every weight, written and read again per call -- which
// made a batch-1 SmolLM2 step with 4-bit weights 150 ms, 12x the int8 one (BENCHMARKS.md). Here each code byte is
// read once: work items of whole groups x up to 4096 columns, 64 columns at a time; up to two activation rows are
// multiplied as the codes are converted, more rows against a float tile of one group's codes; the K parts' partial
// sums are added at the end in a fixed order.

#include <algorithm>
#include <cstdint>

#include "parallel_for.h"
#include "register_blocks.h"
#include "scratch.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(PAGEJAX_PORTABLE)
#include <immintrin.h>
#define PAGEJAX_GROUPED_AVX512 1
#elif !defined(PAGEJAX_PORTABLE)
// Below AVX-512 (AVX2, NEON): `vector_group`, written once in GCC / Clang vector extensions.
#define PAGEJAX_GROUPED_VECTOR 1
#endif

namespace ffi = xla::ffi;

namespace {

using pagejax::for_row_chunks;
#if defined(__AVX512F__) && !defined(PAGEJAX_PORTABLE)
using pagejax::first_lanes;
#endif

constexpr int64_t kStrip = 64;  // columns per register block
constexpr int64_t kBlock = 4096;  // columns per work item at most
constexpr int64_t kItems = 32;    // work items to aim for: K is cut into parts until there are about this many
constexpr int64_t kRows = 2;    // activation rows per pass over a strip, converting codes on the way (M <= 2)
constexpr int kTileRows = 4;  // more rows: per pass over a group's float tile
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

  // 16 columns of a 4-bit code row as floats: the low nibbles (K row i of the group) and the high ones (row i + g/2).
  // A code's float is a lookup (vpermps reads an index's low 4 bits): cheaper than and + convert.
  static void nibbles(const uint8_t* p, __mmask16 mask, __m512& lo, __m512& hi) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, p));
    lo = _mm512_permutexvar_ps(b, codes);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), codes);
  }

  // 16 columns of an 8-bit code row as floats.
  static __m512 int8_codes(const uint8_t* p, __mmask16 mask) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
  }

  // Calls fn(i, t, slot, z) with z = the codes of K row g * gs + i, columns n0 + 16t.., as floats, code row by code
  // row (a 4-bit row holds K rows i and i + g/2: slots 0 and 1; 8-bit rows go in pairs, slots 0 and 1): the slot
  // lets `strip` keep two FMA chains.
  template <typename Fn>
  void for_each_code(int64_t g, int64_t n0, const __mmask16 (&mask)[4], Fn&& fn) const {
    if (bits == 4) {
      const int64_t half = gs / 2;
      for (int64_t i = 0; i < half; ++i) {
        const uint8_t* row = q + (g * half + i) * n + n0;
        prefetch(g * half + i + kPrefetch, n0);
        for (int t = 0; t < 4; ++t) {
          __m512 zl, zh;
          nibbles(row + 16 * t, mask[t], zl, zh);
          fn(i, t, 0, zl);
          fn(half + i, t, 1, zh);
        }
      }
    } else {
      for (int64_t i = 0; i < gs; i += 2) {  // gs is even
        const uint8_t* row = q + (g * gs + i) * n + n0;
        prefetch(g * gs + i + kPrefetch, n0);
        prefetch(g * gs + i + kPrefetch + 1, n0);
        for (int t = 0; t < 4; ++t) {
          fn(i, t, 0, int8_codes(row + 16 * t, mask[t]));
          fn(i + 1, t, 1, int8_codes(row + n + 16 * t, mask[t]));
        }
      }
    }
  }

  // Group g's scale, zero point and offset for the 16 columns n0 + 16t.. (zeros where absent).
  struct GroupTerms {
    __m512 scale, zero, offset;
    // y + scale * (dot - zero * sum) + offset * sum, sum = the row's x summed over the group.
    __m512 add(__m512 dot, float sum, __m512 y) const {
      const __m512 s = _mm512_set1_ps(sum);
      return _mm512_fmadd_ps(offset, s, _mm512_fmadd_ps(scale, _mm512_fnmadd_ps(zero, s, dot), y));
    }
  };

  GroupTerms terms(int64_t g, int64_t n0, int t, __mmask16 mask) const {
    const int64_t col = g * n + n0 + 16 * t;
    return {_mm512_maskz_loadu_ps(mask, scale + col),
            zero == nullptr ? _mm512_setzero_ps()
                            : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, zero + col))),
            offset == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, offset + col)};
  }


  // The same for R rows and one strip, 16 columns a vector; lo / hi accumulators (the two nibbles of a byte, or
  // even / odd rows for 8 bits) halve the FMA dependency chains.
  template <int R>
  void strip(int64_t r0, int64_t n0, int64_t width, int64_t g0, int64_t g1, float* dst) const {
    // All 4 vectors always, masked past `width`: a loop bound known at compile time keeps y, lo, hi in registers.
    __mmask16 mask[4];
    for (int t = 0; t < 4; ++t) mask[t] = first_lanes(width - 16 * t);
    __m512 y[R][4];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 4; ++t) y[r][t] = _mm512_setzero_ps();
    for (int64_t g = g0; g < g1; ++g) {
      __m512 lo[R][4], hi[R][4];
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < 4; ++t) lo[r][t] = hi[r][t] = _mm512_setzero_ps();
      const float* xg[R];
      for (int r = 0; r < R; ++r) xg[r] = x + (r0 + r) * k + g * gs;
      for_each_code(g, n0, mask, [&](int64_t i, int t, int slot, __m512 z) {
        for (int r = 0; r < R; ++r) {
          __m512& a = slot ? hi[r][t] : lo[r][t];
          a = _mm512_fmadd_ps(_mm512_set1_ps(xg[r][i]), z, a);
        }
      });
      for (int t = 0; t < 4; ++t) {
        const GroupTerms c = terms(g, n0, t, mask[t]);
        for (int r = 0; r < R; ++r)
          y[r][t] = c.add(_mm512_add_ps(lo[r][t], hi[r][t]), xs[(r0 + r) * groups() + g], y[r][t]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 4; ++t) _mm512_mask_storeu_ps(dst + (r0 + r) * n + n0 + 16 * t, mask[t], y[r][t]);
  }

  // More rows: group g's codes of the strip converted to float once, tile[i * 64 + c] = z[g * gs + i, n0 + c], for
  // every chunk of rows to multiply against (`tile_rows`); converting again per pair of rows, as `strip` does, cost
  // more than the FMAs.
  void convert_group(int64_t g, int64_t n0, const __mmask16 (&mask)[4], float* tile) const {
    for_each_code(g, n0, mask, [&](int64_t i, int t, int, __m512 z) {
      _mm512_store_ps(tile + i * kStrip + 16 * t, z);
    });
  }

  // Rows [r0, r0 + R) x the strip, group g from its float tile, added into dst (set when g is the item's first).
  template <int R>
  void tile_rows(int64_t r0, int64_t n0, int64_t g, bool first, const __mmask16 (&mask)[4], const float* tile,
                 float* dst) const {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_ps();
    const float* xg[R];
    for (int r = 0; r < R; ++r) xg[r] = x + (r0 + r) * k + g * gs;
    for (int64_t i = 0; i < gs; ++i) {
      __m512 w[4];
      for (int t = 0; t < 4; ++t) w[t] = _mm512_load_ps(tile + i * kStrip + 16 * t);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(xg[r][i]);
        for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_fmadd_ps(a, w[t], acc[r][t]);
      }
    }
    for (int t = 0; t < 4; ++t) {
      const GroupTerms c = terms(g, n0, t, mask[t]);
      for (int r = 0; r < R; ++r) {
        float* out = dst + (r0 + r) * n + n0 + 16 * t;
        const __m512 before = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[t], out);
        _mm512_mask_storeu_ps(out, mask[t], c.add(acc[r][t], xs[(r0 + r) * groups() + g], before));
      }
    }
  }

  void tiled(int64_t n0, int64_t width, int64_t g0, int64_t g1, float* dst) const {
    __mmask16 mask[4];
    for (int t = 0; t < 4; ++t) mask[t] = first_lanes(width - 16 * t);
    float* tile = pagejax::scratch<float, 2>(gs * kStrip + 16);  // per thread: each worker converts its own
    tile = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(tile) + 63) & ~uintptr_t(63));
    for (int64_t g = g0; g < g1; ++g) {
      convert_group(g, n0, mask, tile);
      for_row_chunks<kTileRows>(m, [&](auto rows, int64_t r0) {
        tile_rows<decltype(rows)::value>(r0, n0, g, g == g0, mask, tile, dst);
      });
    }
  }
#endif

#ifdef PAGEJAX_GROUPED_VECTOR
  // Vector code for every ISA below AVX-512: 8 floats a vector, which the compiler maps to an AVX2 register or a
  // pair of NEON ones. Per group, the strip's codes become a float tile once (tile[i * 64 + c] = z[g * gs + i, n0 +
  // c], zero past `width`), then each row's dot with it runs in registers (`vector_rows`).
  typedef float v8 __attribute__((vector_size(32)));
  typedef int8_t i8x8 __attribute__((vector_size(8)));
  typedef int32_t i32x8 __attribute__((vector_size(32)));

  void convert_group(int64_t g, int64_t n0, int64_t width, float* tile) const {
    if (bits == 4) {
      const int64_t half = gs / 2;
      for (int64_t i = 0; i < half; ++i) {
        const uint8_t* row = q + (g * half + i) * n + n0;
        float* lo = tile + i * kStrip;
        float* hi = tile + (half + i) * kStrip;
        if (width == kStrip) {
          for (int64_t c = 0; c < kStrip; ++c) {
            lo[c] = static_cast<float>(row[c] & 0x0F);
            hi[c] = static_cast<float>(row[c] >> 4);
          }
        } else {
          for (int64_t c = 0; c < kStrip; ++c) {
            const uint8_t b = c < width ? row[c] : 0;
            lo[c] = static_cast<float>(b & 0x0F);
            hi[c] = static_cast<float>(b >> 4);
          }
        }
      }
    } else {
      for (int64_t i = 0; i < gs; ++i) {
        const int8_t* row = reinterpret_cast<const int8_t*>(q) + (g * gs + i) * n + n0;
        float* t = tile + i * kStrip;
        if (width == kStrip) {
          for (int64_t c = 0; c < kStrip; ++c) t[c] = static_cast<float>(row[c]);
        } else {
          for (int64_t c = 0; c < kStrip; ++c) t[c] = c < width ? static_cast<float>(row[c]) : 0.f;
        }
      }
    }
  }

  static v8 tile_load(const float* p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
  }

  // Row r0 (and r0 + 1 when kTwo) x the strip's columns: the dots with group g's tile, accumulated in named
  // variables (an indexed array of vectors, g++ kept on the stack, loading and storing it on every i), then the
  // group's terms added into dst (set when g is the item's first group). One row: all 8 vectors of the strip; two
  // rows: 4 vectors (half the strip, from vector v0), so 8 accumulators either way.
  template <bool kTwo>
  void vector_rows(int64_t r0, int64_t n0, int64_t width, int v0, int64_t g, bool first, const float* tile,
                   float* dst) const {
    const float* x0 = x + r0 * k + g * gs;
    const float* x1 = kTwo ? x0 + k : x0;
    v8 a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {}, a5 = {}, a6 = {}, a7 = {};
    const float* t = tile + 8 * v0;
    for (int64_t i = 0; i < gs; ++i, t += kStrip) {
      const v8 xa = v8{} + x0[i];
      const v8 w0 = tile_load(t), w1 = tile_load(t + 8), w2 = tile_load(t + 16), w3 = tile_load(t + 24);
      a0 += xa * w0;
      a1 += xa * w1;
      a2 += xa * w2;
      a3 += xa * w3;
      if constexpr (kTwo) {
        const v8 xb = v8{} + x1[i];
        a4 += xb * w0;
        a5 += xb * w1;
        a6 += xb * w2;
        a7 += xb * w3;
      } else {
        a4 += xa * tile_load(t + 32);
        a5 += xa * tile_load(t + 40);
        a6 += xa * tile_load(t + 48);
        a7 += xa * tile_load(t + 56);
      }
    }
    const v8 all[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    const int64_t vecs = kTwo ? 4 : 8;  // per row
    for (int r = 0; r < (kTwo ? 2 : 1); ++r) {
      const v8 sum = v8{} + xs[(r0 + r) * groups() + g];
      float* out = dst + (r0 + r) * n + n0;
      for (int64_t t = 0; t < vecs; ++t) {
        const int64_t c = 8 * (v0 + t), gc = g * n + n0 + c;
        if (c >= width) break;
        v8 d = all[r * vecs + t];
        if (c + 8 <= width) {  // y + scale * (dot - zero * sum) + offset * sum, 8 columns
          if (zero != nullptr) {
            i8x8 z;
            __builtin_memcpy(&z, zero + gc, sizeof z);
            d -= __builtin_convertvector(__builtin_convertvector(z, i32x8), v8) * sum;  // int32 first: g++
            // converts int8 lanes straight to float one by one
          }
          v8 y = (first ? v8{} : tile_load(out + c)) + tile_load(scale + gc) * d;
          if (offset != nullptr) y += tile_load(offset + gc) * sum;
          __builtin_memcpy(out + c, &y, sizeof y);
        } else {  // the strip's last columns
          for (int64_t l = 0; c + l < width; ++l) {
            const float dot = zero == nullptr ? d[l] : d[l] - static_cast<float>(zero[gc + l]) * sum[0];
            float y = (first ? 0.f : out[c + l]) + scale[gc + l] * dot;
            if (offset != nullptr) y += offset[gc + l] * sum[0];
            out[c + l] = y;
          }
        }
      }
    }
  }

  void vector_group(int64_t n0, int64_t width, int64_t g0, int64_t g1, float* dst) const {
    float* tile = pagejax::scratch<float, 2>(gs * kStrip);  // per thread: each worker converts its own
    for (int64_t g = g0; g < g1; ++g) {
      convert_group(g, n0, width, tile);
      int64_t r0 = 0;
      for (; r0 + 2 <= m; r0 += 2)
        for (int v0 = 0; v0 < 8; v0 += 4) vector_rows<true>(r0, n0, width, v0, g, g == g0, tile, dst);
      if (r0 < m) vector_rows<false>(r0, n0, width, 0, g, g == g0, tile, dst);
    }
  }
#endif

  // Columns [c0, c1) over groups [g0, g1), strip by strip, so each code row of the item is read front to back.
  void item(int64_t c0, int64_t c1, int64_t g0, int64_t g1, float* dst) const {
    for (int64_t n0 = c0; n0 < c1; n0 += kStrip) {
      const int64_t width = std::min(kStrip, c1 - n0);
#ifdef PAGEJAX_GROUPED_AVX512
      if (m > kRows) {
        tiled(n0, width, g0, g1, dst);
        continue;
      }
#elif defined(PAGEJAX_GROUPED_VECTOR)
      vector_group(n0, width, g0, g1, dst);
      continue;
#endif
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
