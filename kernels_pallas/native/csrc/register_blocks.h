// Helpers for the kernels' register blocking, shared so each is written once.

#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) && !defined(PAGEJAX_PORTABLE)
#include <immintrin.h>
#endif

namespace pagejax {

// Calls fn(std::integral_constant<int, R>{}, r0) for chunks [r0, r0 + R) of [0, rows), R = min(kMax, rows - r0)
// (kMax <= 4): rows held in registers, R known at compile time.
template <int kMax, typename Fn>
void for_row_chunks(int64_t rows, Fn&& fn) {
  static_assert(kMax >= 1 && kMax <= 4);
  for (int64_t r0 = 0; r0 < rows; r0 += kMax) {
    switch (std::min<int64_t>(kMax, rows - r0)) {
      case 1: fn(std::integral_constant<int, 1>{}, r0); break;
      case 2: if constexpr (kMax >= 2) fn(std::integral_constant<int, 2>{}, r0); break;
      case 3: if constexpr (kMax >= 3) fn(std::integral_constant<int, 3>{}, r0); break;
      default: if constexpr (kMax >= 4) fn(std::integral_constant<int, 4>{}, r0); break;
    }
  }
}

#if defined(__AVX512F__) && !defined(PAGEJAX_PORTABLE)
// The first `count` of 16 lanes (count clamped to [0, 16]): masked loads and stores of a row's tail.
inline __mmask16 first_lanes(int64_t count) {
  count = std::clamp<int64_t>(count, 0, 16);
  return count == 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
}
#endif

}  // namespace pagejax
