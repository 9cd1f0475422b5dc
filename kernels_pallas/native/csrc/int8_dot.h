// The int8 dot of the W8A8 matmul on the ISAs below AVX-512 VNNI: one kernel (int8_matmul_cpu.cc, `Int8Vector`)
// written once against the small interface here, with the one instruction sequence each ISA has for "4 signed bytes
// times 4 signed bytes, summed into an int32 lane":
//   * AVX2 (x86-64-v3: Zen 2/3, Intel since Haswell): vpmaddubsw + vpmaddwd. vpmaddubsw takes unsigned x signed
//     bytes and saturates its int16 pair sums, so the signs move to x (vpsignb) and |w| is the unsigned operand:
//     |w| <= 128 and |x| <= 127 (x is quantized to [-127, 127]) bound a pair by 2 * 128 * 127 < 2^15, no saturation.
//     With AVX-VNNI and no AVX-512 VNNI (Intel client CPUs since Alder Lake; -march=native there), one vpdpbusd
//     replaces the three, on W made unsigned (+128) as on AVX-512 VNNI; the kernel subtracts 128 * (row sum of x)
//     (`kBias`).
//   * ARMv8.2-A with the dot-product extension (Apple M1+, Graviton 2+, Ampere Altra): sdot, signed x signed.
// All are exact integer arithmetic, so every path gives the same int32 sums and the kernel's result stays
// bit-identical to the JAX W8A8 path. Which ISA a build targets is the compiler's -march (build.py).
//
// A "piece" is kCols consecutive columns of 4 consecutive rows of W, repacked so an int32 lane holds one column's 4
// bytes (`Packed`, the layout both instructions read); `columns` writes a piece's 4 accumulators in column order.

#pragma once

#include <cstdint>
#include <cstring>

#if !defined(PAGEJAX_PORTABLE) && defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
#include <immintrin.h>
#define PAGEJAX_INT8_DOT 1
#ifdef __AVXVNNI__
#define PAGEJAX_INT8_DOT_ISA "avx-vnni"
#else
#define PAGEJAX_INT8_DOT_ISA "avx2"
#endif
#elif !defined(PAGEJAX_PORTABLE) && defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#define PAGEJAX_INT8_DOT 1
#define PAGEJAX_INT8_DOT_ISA "neon-dotprod"
#endif

namespace pagejax {

#if defined(PAGEJAX_INT8_DOT) && defined(__AVX2__)
struct Int8Dot {
  static constexpr int64_t kCols = 32;
  using Acc = __m256i;
#ifdef __AVXVNNI__
  // vpdpbusd takes unsigned x signed bytes and cannot saturate, so W is made unsigned as the AVX-512 VNNI path makes
  // it (w + 128, the sign bit flipped) and x stays signed; the sums carry 128 * (row sum of x), which the kernel
  // subtracts (`kBias`): one instruction per 32 products, exact.
  static constexpr int32_t kBias = 128;
  struct Packed {
    __m256i w_u;
  };
#else
  static constexpr int32_t kBias = 0;
  struct Packed {  // the signed bytes, and their absolute values (vpmaddubsw's unsigned operand)
    __m256i w, abs_w;
  };
#endif

  static Acc zero() { return _mm256_setzero_si256(); }
  static __m256i load(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static __m256i broadcast(uint32_t x4) { return _mm256_set1_epi32(static_cast<int32_t>(x4)); }

  // rows[i] = kCols bytes of row i; v[q], lane 4L + j = the 4 bytes of column 16L + 4q + j (per 128-bit half L).
  static void pack(const __m256i (&r)[4], Packed (&v)[4]) {
    const __m256i t0 = _mm256_unpacklo_epi8(r[0], r[1]), t1 = _mm256_unpackhi_epi8(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi8(r[2], r[3]), t3 = _mm256_unpackhi_epi8(r[2], r[3]);
    const __m256i w[4] = {_mm256_unpacklo_epi16(t0, t2), _mm256_unpackhi_epi16(t0, t2),
                          _mm256_unpacklo_epi16(t1, t3), _mm256_unpackhi_epi16(t1, t3)};
#ifdef __AVXVNNI__
    for (int q = 0; q < 4; ++q) v[q] = {_mm256_xor_si256(w[q], _mm256_set1_epi8(static_cast<char>(0x80)))};
#else
    for (int q = 0; q < 4; ++q) v[q] = {w[q], _mm256_abs_epi8(w[q])};
#endif
  }

  static Acc dot(Acc acc, const Packed& v, __m256i x4) {
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(acc, v.w_u, x4);
#else
    const __m256i pairs = _mm256_maddubs_epi16(v.abs_w, _mm256_sign_epi8(x4, v.w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
  }

  // dst[c] = the sum of column c, c < kCols.
  static void columns(const Acc (&a)[4], int32_t* dst) {
    const __m256i c[4] = {_mm256_permute2x128_si256(a[0], a[1], 0x20), _mm256_permute2x128_si256(a[2], a[3], 0x20),
                          _mm256_permute2x128_si256(a[0], a[1], 0x31), _mm256_permute2x128_si256(a[2], a[3], 0x31)};
    for (int t = 0; t < 4; ++t) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * t), c[t]);
  }
};
#elif defined(PAGEJAX_INT8_DOT)
struct Int8Dot {
  static constexpr int64_t kCols = 16;
  static constexpr int32_t kBias = 0;  // sdot: signed x signed
  using Acc = int32x4_t;
  struct Packed {
    int8x16_t w;
  };

  static Acc zero() { return vdupq_n_s32(0); }
  static int8x16_t load(const int8_t* p) { return vld1q_s8(p); }
  static int8x16_t broadcast(uint32_t x4) { return vreinterpretq_s8_u32(vdupq_n_u32(x4)); }

  // v[q], lane j = the 4 bytes of column 4q + j (NEON's zips interleave across the whole register).
  static void pack(const int8x16_t (&r)[4], Packed (&v)[4]) {
    const int16x8_t t0 = vreinterpretq_s16_s8(vzip1q_s8(r[0], r[1])), t1 = vreinterpretq_s16_s8(vzip2q_s8(r[0], r[1]));
    const int16x8_t t2 = vreinterpretq_s16_s8(vzip1q_s8(r[2], r[3])), t3 = vreinterpretq_s16_s8(vzip2q_s8(r[2], r[3]));
    v[0].w = vreinterpretq_s8_s16(vzip1q_s16(t0, t2));
    v[1].w = vreinterpretq_s8_s16(vzip2q_s16(t0, t2));
    v[2].w = vreinterpretq_s8_s16(vzip1q_s16(t1, t3));
    v[3].w = vreinterpretq_s8_s16(vzip2q_s16(t1, t3));
  }

  static Acc dot(Acc acc, const Packed& v, int8x16_t x4) { return vdotq_s32(acc, v.w, x4); }

  static void columns(const Acc (&a)[4], int32_t* dst) {
    for (int q = 0; q < 4; ++q) vst1q_s32(dst + 4 * q, a[q]);
  }
};
#endif

}  // namespace pagejax
