// A standalone driver for the W8A8 kernel (kernels_pallas/native/csrc/int8_matmul_cpu.cc) without Python or XLA:
// how the aarch64 build is tested under qemu-aarch64 (test_cpu_kernels_aarch64.py), where no aarch64 jaxlib runs.
// It reads cases written by the test -- int64 m, k, n, then x (f32 [m, k]), w (s8 [k, n]), w_scale (f32 [n]) and
// the expected output (f32 [m, n], from the test's numpy model of the JAX W8A8 path) -- runs the kernel on each and
// compares bit for bit. Prints one line per case; exit status 1 if any differs.

#include <cstdio>
#include <cstring>
#include <vector>

#include "int8_matmul_cpu.cc"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CASES_FILE\n", argv[0]);
    return 2;
  }
  std::FILE* f = std::fopen(argv[1], "rb");
  if (f == nullptr) {
    std::perror(argv[1]);
    return 2;
  }
  int failures = 0, cases = 0;
  int64_t dims[3];
  while (std::fread(dims, sizeof(int64_t), 3, f) == 3) {
    const int64_t m = dims[0], k = dims[1], n = dims[2];
    std::vector<float> x(m * k), scale(n), want(m * n), got(m * n, -1.f);
    std::vector<int8_t> w(k * n);
    if (std::fread(x.data(), 4, x.size(), f) != x.size() || std::fread(w.data(), 1, w.size(), f) != w.size() ||
        std::fread(scale.data(), 4, n, f) != static_cast<size_t>(n) ||
        std::fread(want.data(), 4, want.size(), f) != want.size()) {
      std::fprintf(stderr, "truncated case %d\n", cases);
      return 2;
    }
    pagejax_int8_matmul(x.data(), w.data(), scale.data(), got.data(), m, k, n);
    int64_t bad = 0;
    for (int64_t i = 0; i < m * n; ++i) bad += std::memcmp(&got[i], &want[i], 4) != 0;
    std::printf("case m=%lld k=%lld n=%lld: %s (%lld of %lld differ)\n", static_cast<long long>(m),
                static_cast<long long>(k), static_cast<long long>(n), bad ? "FAIL" : "ok", static_cast<long long>(bad),
                static_cast<long long>(m * n));
    failures += bad != 0;
    ++cases;
  }
  std::fclose(f);
  std::printf("%d cases, %d failed, isa %s\n", cases, failures,
#ifdef PAGEJAX_INT8_DOT_ISA
              PAGEJAX_INT8_DOT_ISA
#else
              "portable"
#endif
  );
  return failures || cases == 0 ? 1 : 0;
}
