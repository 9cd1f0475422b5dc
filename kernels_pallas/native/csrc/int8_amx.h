// AMX int8 tiles for the W8A8 matmul's many-row loop (int8_matmul_cpu.cc, `Matmul::amx_strip`), on CPUs with AMX-INT8
// (Intel Xeon since Sapphire Rapids): one `tdpbssd` multiplies a 16 x 64 tile of int8 activations by a 64 x 16 tile
// of int8 weights into 16 x 16 int32 sums, 16384 multiply-adds where AVX-512 VNNI's vpdpbusd does 64. The sums are
// the same exact integers as every other path's, so the result stays bit-identical to the JAX W8A8 path.
//
// Why the operating system is asked first: Linux gives a process the 8 KiB of tile registers only after
// arch_prctl(ARCH_REQ_XCOMP_PERM) (since Linux 5.16); where it refuses (an older kernel, a hypervisor that hides the
// state), `amx_permitted` is false and the VNNI loops run instead. Which build compiles this in is the compiler's
// -march (build.py: "native" on such a CPU); PAGEJAX_NO_AMX leaves it out (the "no_amx" build, which tests use to
// keep the VNNI loops covered on AMX machines).

#pragma once

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BW__) && !defined(PAGEJAX_PORTABLE) && \
    !defined(PAGEJAX_NO_AMX) && defined(__linux__)
#define PAGEJAX_INT8_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace pagejax {

inline bool amx_permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // <asm/prctl.h>, the tile data state component
  static const bool permitted = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

// The tiles `Matmul::amx_strip` uses, all 16 rows of 64 bytes: 0-3 the int32 sums of 16 rows of x against the 4
// packed column groups of a 64-column strip, 4 the 16 rows x 64 K values of x, 5 and 6 a packed group's 16 x 4 K
// values of 16 columns (alternating, so a load can overlap the previous product).
inline void configure_int8_tiles() {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
  } config;
  std::memset(&config, 0, sizeof(config));
  config.palette = 1;
  for (int t = 0; t < 7; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

}  // namespace pagejax

#endif
