// A standalone driver for the attention kernel (kernels_pallas/native/csrc/ragged_paged_attention_cpu.cc) without
// Python or XLA, as int8_matmul_driver.cc is for the W8A8 kernel: how its aarch64 build (the 8-float vector passes on
// NEON) is tested under qemu-aarch64 (test_cpu_kernels_aarch64.py). It reads cases written by the test -- int64
// T, Hq, D, Hkv, P, page_size, max_seqs, pages_per_seq, num_seqs, int8 (0: a float32 cache), scale_stride,
// sliding_window; f32 sm_scale, soft_cap, k_scale, v_scale; then q (f32 [T, Hq, D]), the cache (f32 or s8
// [Hkv, P, page_size, 2D]), its scales (f32 [Hkv, scale_stride], int8 only), kv_lens (s32 [max_seqs]), page
// indices (s32 [max_seqs, pages_per_seq]), cu_q_lens (s32 [max_seqs + 1]) and the expected output (f32, the JAX
// reference's) -- runs the kernel on each (head_dim 64 and 128 as the library compiles them, any other at run time)
// and compares within the x86 tests' tolerance. Prints one line per case; exit status 1 if any differs.

#include <cmath>
#include <cstdio>
#include <vector>

#include "ragged_paged_attention_cpu.cc"

template <typename T>
bool read(std::FILE* f, std::vector<T>& v, int64_t n) {
  v.resize(n);
  return std::fread(v.data(), sizeof(T), n, f) == static_cast<size_t>(n);
}

template <typename KV, int kD>
void run_at(const Shapes& s, const Options& o, const std::vector<float>& q, const std::vector<KV>& kv,
            const std::vector<float>& scales, const std::vector<int32_t>& kv_lens, const std::vector<int32_t>& pages,
            const std::vector<int32_t>& cu, int64_t num_seqs, std::vector<float>& out) {
  Attention<KV, kD> attn{q.data(), kv.data(), scales.empty() ? nullptr : scales.data(), kv_lens.data(), pages.data(),
                         cu.data(), out.data(), s, o};
  const std::vector<Item> items = make_items(cu.data(), num_seqs, s);
  pagejax::parallel_for(items.size(), [&](int64_t i) { attn.run(items[i]); });
}

template <typename KV>
void run(const Shapes& s, const Options& o, const std::vector<float>& q, const std::vector<KV>& kv,
         const std::vector<float>& scales, const std::vector<int32_t>& kv_lens, const std::vector<int32_t>& pages,
         const std::vector<int32_t>& cu, int64_t num_seqs, std::vector<float>& out) {
  if (s.head_dim == 64)
    run_at<KV, 64>(s, o, q, kv, scales, kv_lens, pages, cu, num_seqs, out);
  else if (s.head_dim == 128)
    run_at<KV, 128>(s, o, q, kv, scales, kv_lens, pages, cu, num_seqs, out);
  else
    run_at<KV, 0>(s, o, q, kv, scales, kv_lens, pages, cu, num_seqs, out);
}

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
  int64_t h[12];
  float opts[4];
  while (std::fread(h, sizeof(int64_t), 12, f) == 12 && std::fread(opts, sizeof(float), 4, f) == 4) {
    const int64_t T = h[0], Hq = h[1], D = h[2], Hkv = h[3], P = h[4], ps = h[5], max_seqs = h[6], pps = h[7];
    const int64_t num_seqs = h[8], int8 = h[9], scale_stride = h[10];
    Shapes s{T, Hq, D, P, ps, Hkv, Hq / Hkv, max_seqs, pps, int8 ? scale_stride : 0};
    const Options o{opts[0], opts[1], opts[2], opts[3], h[11]};
    std::vector<float> q, kv_f, scales, want, got(T * Hq * D, 0.f);
    std::vector<int8_t> kv_i;
    std::vector<int32_t> kv_lens, pages, cu;
    const int64_t cache = Hkv * P * ps * 2 * D;
    bool ok = D > 0 && read(f, q, T * Hq * D) && (int8 ? read(f, kv_i, cache) && read(f, scales, Hkv * scale_stride)
                                                         : read(f, kv_f, cache)) &&
              read(f, kv_lens, max_seqs) && read(f, pages, max_seqs * pps) && read(f, cu, max_seqs + 1) &&
              read(f, want, T * Hq * D);
    if (!ok) {
      std::fprintf(stderr, "truncated case %d\n", cases);
      return 2;
    }
    if (int8)
      run(s, o, q, kv_i, scales, kv_lens, pages, cu, num_seqs, got);
    else
      run(s, o, q, kv_f, scales, kv_lens, pages, cu, num_seqs, got);
    int64_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) bad += !(std::fabs(got[i] - want[i]) <= 2e-5f + 1e-5f * std::fabs(want[i]));
    std::printf("case %d (T=%lld, D=%lld, %s cache, window %lld): %s (%lld of %zu differ)\n", cases,
                static_cast<long long>(T), static_cast<long long>(D), int8 ? "int8" : "f32",
                static_cast<long long>(h[11]), bad ? "FAIL" : "ok",
                static_cast<long long>(bad), got.size());
    failures += bad != 0;
    ++cases;
  }
  std::fclose(f);
  std::printf("%d cases, %d failed\n", cases, failures);
  return failures || cases == 0 ? 1 : 0;
}
