// Eight floats as one GCC/Clang vector (`vector_size(32)`): the compiler maps it to whatever the -march target has
// (AVX2's ymm, a pair of NEON or SSE registers), so a loop written once against it is vectorized the same way on
// every ISA, without hand-written intrinsics. The attention kernel's generic passes use it where its AVX-512 path
// does not run (ragged_paged_attention_cpu.cc).

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

// A 32-byte vector passed by value on a target without AVX (the SSE builds): g++ warns that such an ABI differs from
// AVX's. These functions are inline within one library, so no call crosses the two.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace pagejax {

typedef float Float8 __attribute__((vector_size(32)));

inline Float8 load8(const float* p) {
  Float8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, Float8 v) { std::memcpy(p, &v, sizeof(v)); }

// a * b + c, rounded once where the CPU has FMA, through the ISA's FMA intrinsic: the library's -fassociative-math
// lets g++ regroup a chain of `+` differently where it is inlined into different code (it did, by how many query
// rows a block held), but not a chain of intrinsic calls, so a sum written with fma8 keeps its order everywhere.
inline Float8 fma8(Float8 a, Float8 b, Float8 c) {
#if defined(__FMA__) && defined(__AVX__)
  return reinterpret_cast<Float8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                  reinterpret_cast<__m256>(c)));
#elif defined(__aarch64__)
  float32x4_t x[2], y[2], z[2];
  std::memcpy(x, &a, sizeof(a));
  std::memcpy(y, &b, sizeof(b));
  std::memcpy(z, &c, sizeof(c));
  for (int h = 0; h < 2; ++h) z[h] = vfmaq_f32(z[h], x[h], y[h]);
  Float8 out;
  std::memcpy(&out, z, sizeof(out));
  return out;
#else
  return a * b + c;  // no FMA unit (baseline x86): the compiler's multiply and add
#endif
}

// Lane j of the result = the sum of v[j]'s 8 lanes: a transpose-and-add tree, 7 adds and 14 shuffles for 8 sums,
// where 8 reductions one at a time take 3 adds and 3 shuffles each. Written as ((lanes 0+2) + (1+3)) + ((4+6) +
// (5+7)); the compiler may regroup the whole-vector adds (-fassociative-math; it did on aarch64), but every regrouping
// applies to all lanes alike, so each v[j] is summed in the same order whatever its position j.
//
// Lanes of two vectors picked by index (0 .. n-1: a's, n .. 2n-1: b's), as each compiler spells it (g++ takes the
// indices as a vector of `Lanes`).
#if defined(__clang__)
#define PAGEJAX_SHUFFLE(Lanes, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PAGEJAX_SHUFFLE(Lanes, a, b, ...) __builtin_shuffle(a, b, Lanes{__VA_ARGS__})
#endif

#if defined(__AVX__)
// One 256-bit register per vector: shuffles of 8 lanes (within 128-bit halves, then across them).
typedef int32_t Int8Lanes __attribute__((vector_size(32)));
#define PAGEJAX_SHUFFLE8(a, b, ...) PAGEJAX_SHUFFLE(Int8Lanes, a, b, __VA_ARGS__)

inline Float8 sum8x8(const Float8 (&v)[8]) {
  Float8 t[4], u[2];
  for (int i = 0; i < 4; ++i)  // per half: [a0+a2, b0+b2, a1+a3, b1+b3] of a = v[2i], b = v[2i+1]
    t[i] = PAGEJAX_SHUFFLE8(v[2 * i], v[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
           PAGEJAX_SHUFFLE8(v[2 * i], v[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  for (int i = 0; i < 2; ++i)  // per half: the half's partial sums of v[4i .. 4i+3]
    u[i] = PAGEJAX_SHUFFLE8(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           PAGEJAX_SHUFFLE8(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return PAGEJAX_SHUFFLE8(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) + PAGEJAX_SHUFFLE8(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}
#else
// 128-bit registers (NEON, SSE): a vector is two of them, and shuffles across the pair compiled to lane-by-lane
// moves (g++ 12, aarch64), so the same tree runs on each half's 4 lanes (zip / trn) and adds the halves last.
typedef float Float4 __attribute__((vector_size(16)));
typedef int32_t Int4Lanes __attribute__((vector_size(16)));
#define PAGEJAX_SHUFFLE4(a, b, ...) PAGEJAX_SHUFFLE(Int4Lanes, a, b, __VA_ARGS__)

inline Float8 sum8x8(const Float8 (&v)[8]) {
  Float4 half[2][8];  // half[h][i] = lanes 4h .. 4h+3 of v[i]
  for (int i = 0; i < 8; ++i) {
    std::memcpy(&half[0][i], reinterpret_cast<const float*>(&v[i]), sizeof(Float4));
    std::memcpy(&half[1][i], reinterpret_cast<const float*>(&v[i]) + 4, sizeof(Float4));
  }
  Float4 out[2];
  for (int g = 0; g < 2; ++g) {  // out[g] = the totals of v[4g .. 4g+3]
    Float4 u[2];
    for (int h = 0; h < 2; ++h) {
      const Float4* w = half[h] + 4 * g;
      const Float4 t0 = PAGEJAX_SHUFFLE4(w[0], w[1], 0, 4, 1, 5) + PAGEJAX_SHUFFLE4(w[0], w[1], 2, 6, 3, 7);
      const Float4 t1 = PAGEJAX_SHUFFLE4(w[2], w[3], 0, 4, 1, 5) + PAGEJAX_SHUFFLE4(w[2], w[3], 2, 6, 3, 7);
      u[h] = PAGEJAX_SHUFFLE4(t0, t1, 0, 1, 4, 5) + PAGEJAX_SHUFFLE4(t0, t1, 2, 3, 6, 7);
    }
    out[g] = u[0] + u[1];
  }
  Float8 result;
  std::memcpy(&result, out, sizeof(result));
  return result;
}
#endif

}  // namespace pagejax
