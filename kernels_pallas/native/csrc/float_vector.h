// Eight floats as one GCC/Clang vector (`vector_size(32)`): the compiler maps it to whatever the -march target has
// (AVX2's ymm, a pair of NEON or SSE registers), so a loop written once against it is vectorized the same way on
// every ISA, without hand-written intrinsics. The attention kernel's generic passes use it where its AVX-512 path
// does not run (ragged_paged_attention_cpu.cc).

#pragma once

#include <cstdint>
#include <cstring>

namespace pagejax {

typedef float Float8 __attribute__((vector_size(32)));

inline Float8 load8(const float* p) {
  Float8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, Float8 v) { std::memcpy(p, &v, sizeof(v)); }

// Lanes of two vectors picked by index (0-7: a's, 8-15: b's), as the compiler spells it.
#if defined(__clang__)
#define PAGEJAX_SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t Int8Lanes __attribute__((vector_size(32)));
#define PAGEJAX_SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, Int8Lanes{__VA_ARGS__})
#endif

// Lane j of the result = the sum of v[j]'s 8 lanes, every v[j] summed in the same order (lanes 0+2, 1+3, 4+6, 5+7;
// then those pairs; then the two halves), whatever its position j: a transpose-and-add tree, 7 adds and 14 shuffles
// for 8 sums, where 8 reductions one at a time take 3 adds and 3 shuffles each.
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

}  // namespace pagejax
