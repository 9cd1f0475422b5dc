// A standalone driver for the few-row float32 matmul (kernels_pallas/native/csrc/f32_gemv_cpu.cc) without Python or
// XLA: how its aarch64 build (NEON through the vector extensions) is tested under qemu-aarch64
// (test_cpu_kernels_aarch64.py). It reads, on stdin, cases written by the test -- int64 m, k, n, transposed, then x
// (f32 [m, k]), w (f32 [k, n], or [n, k] transposed) and the float64 product rounded to f32 [m, n] -- runs the kernel and
// checks each element within 1e-5 * sqrt(k) * max |product|. Prints one line per case; exit status 1 if any fails.

#include <cmath>
#include <cstdio>
#include <vector>

#include "f32_gemv_cpu.cc"

int main() {
  std::FILE* f = stdin;
  int failures = 0, cases = 0;
  int64_t dims[4];
  while (std::fread(dims, sizeof(int64_t), 4, f) == 4) {
    const int64_t m = dims[0], k = dims[1], n = dims[2], transposed = dims[3];
    std::vector<float> x(m * k), w(k * n), want(m * n), got(m * n, NAN);
    if (std::fread(x.data(), 4, x.size(), f) != x.size() || std::fread(w.data(), 4, w.size(), f) != w.size() ||
        std::fread(want.data(), 4, want.size(), f) != want.size()) {
      std::fprintf(stderr, "truncated case %d\n", cases);
      return 2;
    }
    if (transposed)
      head(x.data(), w.data(), m, k, n, got.data());
    else
      gemv(x.data(), w.data(), m, k, n, got.data());
    float scale = 0.f;
    for (float v : want) scale = std::max(scale, std::fabs(v));
    const float tol = 1e-5f * std::sqrt(static_cast<float>(k)) * scale;
    int64_t bad = 0;
    for (int64_t i = 0; i < m * n; ++i) bad += !(std::fabs(got[i] - want[i]) <= tol);
    std::printf("case m=%lld k=%lld n=%lld transposed=%lld: %s (%lld of %lld off)\n", static_cast<long long>(m),
                static_cast<long long>(k), static_cast<long long>(n), static_cast<long long>(transposed),
                bad ? "FAIL" : "ok", static_cast<long long>(bad), static_cast<long long>(m * n));
    failures += bad != 0;
    ++cases;
  }
  std::printf("%d cases, %d failed\n", cases, failures);
  return failures || cases == 0 ? 1 : 0;
}
