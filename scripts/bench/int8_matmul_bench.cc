// The W8A8 kernel (kernels_pallas/native/csrc/int8_matmul_cpu.cc) timed alone, without Python or XLA: one SmolLM2-135M
// decoder layer's seven linears at 1 to 512 rows, each result first checked bit for bit against a scalar model
// of the JAX W8A8 path (quantize each row, exact int32 dot, (dot * x_scale) * w_scale). For A/B runs of the kernel's
// loops: build two checkouts and run them alternately (PAGEJAX_CPU_THREADS=1 for one core). BENCHMARKS.md
// ("C++ CPU kernels per ISA") records what it measured.
//
//   g++ -O3 -std=c++17 -march=native -pthread -fno-math-errno -fno-trapping-math -fassociative-math \
//       -fno-signed-zeros -w -I $(python -c "import jax; print(jax.ffi.include_dir())") \
//       -I kernels_pallas/native/csrc scripts/bench/int8_matmul_bench.cc -o /tmp/int8_matmul_bench
//   /tmp/int8_matmul_bench

// The kernel's source first: its `#pragma GCC optimize` must precede the standard headers, or g++ compiles their
// functions without it and will not inline them into the kernel's loops (calls to std::min in the hot loops).
#include "int8_matmul_cpu.cc"

#include <chrono>
#include <cstdio>
#include <random>

namespace {

void reference(const float* x, const int8_t* w, const float* ws, float* out, int64_t m, int64_t k, int64_t n) {
  std::vector<int32_t> q(k);
  for (int64_t r = 0; r < m; ++r) {
    const float scale = row_scale(x + r * k, k), inv = 1.f / scale;
    for (int64_t c = 0; c < k; ++c) q[c] = quantize(x[r * k + c], inv);
    for (int64_t j = 0; j < n; ++j) {
      int32_t dot = 0;
      for (int64_t c = 0; c < k; ++c) dot += q[c] * w[c * n + j];
      out[r * n + j] = static_cast<float>(dot) * scale * ws[j];
    }
  }
}

}  // namespace

int main() {
  const int64_t layer[7][2] = {{576, 576}, {576, 192}, {576, 192}, {576, 576}, {576, 1536}, {576, 1536}, {1536, 576}};
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> code(-127, 127);
  int failures = 0;
  for (const int64_t m : {1, 4, 8, 16, 32, 128, 512}) {
    double seconds = 0;
    int64_t macs = 0;
    for (const auto& shape : layer) {
      const int64_t k = shape[0], n = shape[1];
      std::vector<float> x(m * k), ws(n), out(m * n), want(m * n);
      std::vector<int8_t> w(k * n);
      for (auto& v : x) v = normal(gen);
      for (auto& v : w) v = static_cast<int8_t>(code(gen));
      for (auto& v : ws) v = 0.01f * (1 + 0.1f * normal(gen));
      pagejax_int8_matmul(x.data(), w.data(), ws.data(), out.data(), m, k, n);
      reference(x.data(), w.data(), ws.data(), want.data(), m, k, n);
      failures += std::memcmp(out.data(), want.data(), 4 * m * n) != 0;
      const int reps = m >= 512 ? 10 : 200;
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; ++i) pagejax_int8_matmul(x.data(), w.data(), ws.data(), out.data(), m, k, n);
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / reps;
      macs += m * k * n;
    }
    std::printf("rows %4lld: one layer's 7 linears %8.3f ms, %5.1f GMAC/s\n", static_cast<long long>(m),
                seconds * 1e3, macs / seconds / 1e9);
  }
  std::printf("%s\n", failures ? "MISMATCH against the scalar model" : "bit-identical to the scalar model");
  return failures != 0;
}
