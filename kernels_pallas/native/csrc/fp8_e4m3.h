// float8_e4m3fn (an fp8 KV cache's codes) to float32, exactly: a 256-entry table for the scalar loops, bit
// arithmetic through float16 for the vector ones.
//
// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, 0x7F / 0xFF are NaN, exponent 0 is
// subnormal (m * 2^-9). Why through float16 (F16C's vcvtph2ps, AVX-512's 16-lane form): shifting the 7 magnitude
// bits left by 7 gives the float16 whose exponent is e and mantissa m (bias 15 instead of 7, float16 subnormals where
// e4m3 has them), so the value times 2^8 is the e4m3 value, subnormals included, with no per-lane branch and no
// float32 denormal (which a thread with DAZ set would read as 0). Five integer operations and one conversion for 16
// codes, where a gather from the table costs a load per lane.

#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if (defined(__F16C__) || defined(__AVX512F__)) && defined(__AVX2__) && !defined(PAGEJAX_PORTABLE)
#include <immintrin.h>
#define PAGEJAX_FP8_F16C 1
#endif

namespace pagejax {

// One float8_e4m3fn code, a distinct type so the kernels' to_float / load overloads do not take it for int8.
struct Fp8E4M3 {
  uint8_t bits;
};

inline float fp8_e4m3_value(uint8_t bits) {
  const int e = (bits >> 3) & 15, m = bits & 7;
  float v;
  if ((bits & 0x7F) == 0x7F) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else {
    v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(8 + m), e - 10);
  }
  return bits & 0x80 ? -v : v;
}

// The 256 values, built once (thread-safe static initialisation).
inline const float* fp8_e4m3_table() {
  static const struct Table {
    float v[256];
    Table() {
      for (int b = 0; b < 256; ++b) v[b] = fp8_e4m3_value(static_cast<uint8_t>(b));
    }
  } table;
  return table.v;
}

inline float to_float(Fp8E4M3 x) { return fp8_e4m3_table()[x.bits]; }

#ifdef PAGEJAX_FP8_F16C
// 16 codes as the float16 bits whose value is 2^-8 times theirs (NaN codes as float16 NaN).
inline __m256i fp8_e4m3_halves(const Fp8E4M3* p) {
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7F)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8);
  const __m256i nan = _mm256_and_si256(_mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7F << 7)),
                                       _mm256_set1_epi16(0x7C00));  // exponent 31, mantissa != 0: NaN
  return _mm256_or_si256(_mm256_or_si256(magnitude, sign), nan);
}

// dst[0, 16) = the 16 codes at p as floats.
inline void fp8_e4m3_to_float16(const Fp8E4M3* p, float* dst) {
  const __m256i h = fp8_e4m3_halves(p);
  const __m256 k = _mm256_set1_ps(256.f);
  _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k));
  _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k));
}
#endif

#if defined(PAGEJAX_FP8_F16C) && defined(__AVX512F__)
inline __m512 fp8_e4m3_load16(const Fp8E4M3* p) {
  return _mm512_mul_ps(_mm512_cvtph_ps(fp8_e4m3_halves(p)), _mm512_set1_ps(256.f));
}
#endif

// dst[0, n) = src[0, n) as floats: 16 at a time where F16C is, the table for the rest.
inline void convert_row(const Fp8E4M3* src, float* dst, int64_t n) {
  int64_t d = 0;
#ifdef PAGEJAX_FP8_F16C
  for (; d + 16 <= n; d += 16) fp8_e4m3_to_float16(src + d, dst + d);
#endif
  const float* table = fp8_e4m3_table();
  for (; d < n; ++d) dst[d] = table[src[d].bits];
}

}  // namespace pagejax
