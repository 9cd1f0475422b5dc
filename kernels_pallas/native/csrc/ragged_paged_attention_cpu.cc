// Ragged paged attention on CPU: an XLA FFI custom call with the contract of
// kernels_pallas/attention/reference.py. Cache layout (kernels_pallas/kv_cache/layout.py): kv_pages is
// [Hkv, num_pages, page_size, 2 * D], head-major, each token row holding K in elements [0, D) and V in [D, 2D);
// an int8 or fp8 (float8_e4m3fn) cache's scales are [Hkv, scale_rows, 128] f32, head h's flattened as, page after
// page, the page's page_size K scales then its page_size V scales (K of (page, t) at p * 2 * page_size + t, V at + page_size).
//
// Why a C++ kernel: the pure-JAX reference gathers every sequence's padded pages, transposes K and V and runs
// tiny batched dots; on XLA:CPU that was 97-107 ms of a 175-190 ms SmolLM2 decode step at batch 32 (BENCHMARKS.md,
// "CPU performance work, second pass"). This kernel reads each key and value row once, in place in the cache,
// only up to each sequence's length (and from its sliding-window start), so decode attention is bound by the
// bytes of the live KV cache, like the Pallas kernels on TPU/GPU.
//
// Work item = (sequence, KV head, block of up to kQueryBlock query tokens): the block's query rows (tokens x
// query heads of that KV head) are scored against the keys they can see, softmaxed exactly (two passes: scores,
// then max/exp/sum), and the values accumulated. Items are spread over the library's worker threads
// (parallel_for.h). With AVX-512 and a head_dim of 64 or 128, both passes convert each key and value row to float
// once for up to 4 (64) or 2 (128) query rows held in registers, and 16 keys' dot products are summed across lanes
// together
// (`sum16x16`); written as plain loops, g++ converted the row again for every query row and reduced every dot on
// its own (7.8 GB/s of int8 cache at batch 32, BENCHMARKS.md). Elsewhere each key or value row is converted to
// float once into a buffer (`convert_row`) and the loops over it are g++'s; an fp8 row's conversion is F16C bit
// arithmetic where the CPU has it (fp8_e4m3.h), the 256-entry table otherwise.
// Out-of-contract indices (pages, lengths, query offsets) are clamped: the kernel never reads outside a buffer.
//
// Stale slots: a block reads only keys in [lo, hi), the union of its query rows' visible ranges (causal, inside
// kv_len and the sliding window), i.e. keys some query of the sequence sees; keys past kv_len, before the window,
// the pages that padding entries of page_indices name and the scales' padding tail are never read. A key in
// [lo, hi) that one row does not see has its score dropped before the max/exp (only [first, last] enter the
// softmax) and an exact 0 weight; its V row is live data (another row sees it), so 0 * v stays 0. Non-finite values
// in slots no query sees therefore change no output, as in the reference.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "float_vector.h"
#include "fp8_e4m3.h"
#include "parallel_for.h"
#include "register_blocks.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && !defined(PAGEJAX_PORTABLE)
#include <immintrin.h>
#define PAGEJAX_ATTENTION_AVX512 1
#endif

namespace ffi = xla::ffi;

namespace {

using pagejax::convert_row;
using pagejax::Fp8E4M3;
using pagejax::for_row_chunks;
#if defined(__AVX512F__) && !defined(PAGEJAX_PORTABLE)
using pagejax::first_lanes;
#endif

constexpr int64_t kQueryBlock = 8;
// Keys whose value rows the generic pass 2 converts into a buffer at a time (`Attention::run`).
constexpr int64_t kValueBlock = 64;

inline float to_float(float x) { return x; }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(uint16_t x) {  // bfloat16 bits
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// dst[0, n) = a cache row as floats (fp8: pagejax::convert_row, vectorized by hand; these g++ vectorizes).
template <typename KV>
inline void convert_row(const KV* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}

struct Shapes {
  int64_t num_tokens, num_q_heads, head_dim, num_pages, page_size, num_kv_heads, group, max_seqs, pages_per_seq;
  int64_t scale_stride;  // scales per KV head (scale_rows * 128); 0 without scales
};

struct Options {
  float sm_scale, soft_cap, k_scale, v_scale;
  int64_t sliding_window;  // 0: none
};

struct Item {
  int64_t seq, kv_head, q_begin, q_end;
};

// exp for x <= 0 (softmax after subtracting the row max), branch-free so g++ vectorizes the loop that calls it:
// 2^n * p(r) with a degree-6 Taylor polynomial on |r| <= ln2/2 (relative error < 2e-7, like expf's rounding).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // keeps 2^n normal; exp(-87) ~ 1.6e-38, far below any kept weight
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

// The max of p[0, n), n >= 1, as 16 running maxima: g++ vectorizes these (one running max it would not without
// -ffinite-math-only: a scalar chain of vmaxss that was a quarter of the decode attention's time). Order does not
// change a max, so the result is the same as the one running max (NaN aside, as with any max).
inline float max_of(const float* p, int64_t n) {
  float lanes[16];
  for (int i = 0; i < 16; ++i) lanes[i] = p[0];
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int i = 0; i < 16; ++i) lanes[i] = std::max(lanes[i], p[j + i]);
  float m = p[0];
  for (; j < n; ++j) m = std::max(m, p[j]);
  for (int i = 0; i < 16; ++i) m = std::max(m, lanes[i]);
  return m;
}

#ifdef PAGEJAX_ATTENTION_AVX512
// 16 cache elements as floats.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const uint16_t* p) {  // bfloat16 bits, shifted into a float's high half
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}
inline __m512 load16(const Fp8E4M3* p) { return pagejax::fp8_e4m3_load16(p); }

// Lane j of the result = the sum of v[j]'s 16 lanes: a transpose-and-add tree, 45 instructions for 16 sums.
inline __m512 sum16x16(const __m512 (&v)[16]) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = v[2i], b = v[2i+1]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's partial sums of v[4i .. 4i+3]
    const __m512d c = _mm512_castps_pd(t[2 * i]), e = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, e)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, e)));
  }
  // Add the four 128-bit lanes: lane L of the result = the total of u[L].
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}
#endif

// kD > 0: head_dim known at compile time (fully unrolled dot products); kD == 0: any head_dim.
template <typename KV, int kD>
struct Attention {
  const float* q;
  const KV* pages;
  const float* scales;  // nullptr unless the cache is int8
  const int32_t* kv_lens;
  const int32_t* page_indices;
  const int32_t* cu_q_lens;
  float* out;
  Shapes s;
  Options o;

  int64_t dim() const { return kD > 0 ? kD : s.head_dim; }

  // Calls fn(j, row, scale) for cache positions j in [lo, hi) of `seq`, KV head `kv_head`, its K (`half` 0) or V
  // (`half` 1) rows, walking page by page (no division per key): one (head, page) is a contiguous
  // [page_size, 2 * D] block, K at row offset 0 and V at D; its scales are page_size K then page_size V floats.
  // `row` points into the cache; callers convert its elements inline, which the compiler fuses into the vectorized
  // dot / accumulation.
  template <typename Fn>
  void for_each_row(int64_t seq, int64_t kv_head, int64_t lo, int64_t hi, int half, float static_scale,
                    Fn&& fn) const {
    const int64_t D = dim(), ps = s.page_size, row = 2 * D;
    const KV* head_rows = pages + kv_head * s.num_pages * ps * row + half * D;
    const float* head_scales = scales == nullptr ? nullptr : scales + kv_head * s.scale_stride + half * ps;
    auto page_at = [&](int64_t j) {
      return std::min(std::max<int64_t>(page_indices[seq * s.pages_per_seq + j / ps], 0), s.num_pages - 1);
    };
    for (int64_t j0 = lo - lo % ps; j0 < hi; j0 += ps) {
      const int64_t page = page_at(j0);
      const KV* page_rows = head_rows + page * ps * row;
      // The next page of [lo, hi) is anywhere in the cache: the first cache line of each of its rows is asked for
      // now, a page of keys ahead of their use (a page's rows are contiguous, but the hardware prefetcher does not
      // follow the jump between pages; it fetches a row's further lines itself, and asking for every line of a
      // float32 page at once stalled on the CPU's few outstanding misses). The generic pass 2 walks 64-key blocks,
      // so with pages of 64 keys or more it gets no prefetch.
      if (j0 + ps < hi) {
        const KV* next = head_rows + page_at(j0 + ps) * ps * row;
        for (int64_t t = 0; t < std::min(ps, hi - j0 - ps); ++t) __builtin_prefetch(next + t * row);
      }
      const int64_t end = std::min(hi, j0 + ps);
      if (head_scales == nullptr) {
        for (int64_t j = std::max(lo, j0); j < end; ++j) fn(j, page_rows + (j - j0) * row, static_scale);
      } else {
        const float* page_scales = head_scales + page * 2 * ps;
        for (int64_t j = std::max(lo, j0); j < end; ++j)
          fn(j, page_rows + (j - j0) * row, page_scales[j - j0] * static_scale);
      }
    }
  }

#ifdef PAGEJAX_ATTENTION_AVX512
  static constexpr bool kVector = kD > 0 && kD % 16 == 0;
#else
  static constexpr bool kVector = false;
#endif
  // The 8-float vector passes below serve every head_dim of whole vectors (known at compile time or not) where the
  // AVX-512 path does not run.
  static constexpr bool kVector8 = !kVector && kD % 8 == 0;
  bool vector8() const { return kVector8 && dim() % 8 == 0; }

  // The generic pass 1 for a head_dim of whole 8-float vectors (pagejax::Float8: AVX2, NEON, SSE):
  // p[r * L + j - lo] = (q_r . k_j) * scale_j for rows [r0, r0 + R) and keys [lo, hi), each key row converted once
  // (into `row_f`; a float32 row is read in place), its R dot products accumulated lane by lane and 8 keys' sums
  // across lanes taken together (`sum8x8`). Each key's score is the same sum, in the same order, whichever of the 8
  // slots it takes and however many rows share the block (the chain is `fma8`'s), so it does not depend on the
  // block's other keys or rows: batch-invariant mode relies on it.
  template <int R>
  void scores8(const Item& it, int64_t lo, int64_t hi, int64_t L, const float* qbuf, int64_t r0, float* row_f,
               float* p) const {
    const int64_t D = dim();
    const float* q0 = qbuf + r0 * D;
    pagejax::Float8 part[R][8];
    float key_scale[8] = {};
    int64_t n = 0, j0 = lo;  // keys j0 .. j0 + n - 1 are in part
    auto flush = [&] {
      const pagejax::Float8 scale = pagejax::load8(key_scale);
      for (int r = 0; r < R; ++r) {
        for (int64_t i = n; i < 8; ++i) part[r][i] = pagejax::Float8{};
        float sums[8];
        pagejax::store8(sums, pagejax::sum8x8(part[r]) * scale);
        std::copy(sums, sums + n, p + (r0 + r) * L + (j0 - lo));
      }
    };
    for_each_row(it.seq, it.kv_head, lo, hi, 0, o.k_scale, [&](int64_t j, const KV* k, float ks) {
      // The row converted by a loop g++ vectorizes (fp8: F16C or the table): 8 elements at a time through vector
      // conversions it compiled to scalar code.
      const float* kf = row_f;
      if constexpr (std::is_same_v<KV, float>) {
        kf = k;
      } else {
        convert_row(k, row_f, D);
      }
      for (int r = 0; r < R; ++r) {
        pagejax::Float8 dot = pagejax::load8(q0 + r * D) * pagejax::load8(kf);
        for (int64_t c = 8; c < D; c += 8)
          dot = pagejax::fma8(pagejax::load8(q0 + r * D + c), pagejax::load8(kf + c), dot);
        part[r][n] = dot;
      }
      key_scale[n] = ks;
      if (++n == 8) {
        flush();
        n = 0;
        j0 = j + 1;
      }
    });
    if (n > 0) flush();
  }

#ifdef PAGEJAX_ATTENTION_AVX512
  static constexpr int kChunks = kD / 16, kRows = kD <= 64 ? 4 : 2;  // query rows per register block

  // p[r * L + j - lo] = (q_r . k_j) * scale_j for rows [r0, r0 + R) and keys [lo, hi): each key row converted once,
  // the R dot products accumulated in 16-lane vectors and summed across lanes 16 keys at a time.
  template <int R>
  void scores(const Item& it, int64_t lo, int64_t hi, int64_t L, const float* qbuf, int64_t r0, float* p) const {
    __m512 qv[R][kChunks], part[R][16];
    alignas(64) float key_scale[16] = {};  // lanes past n stay 0 (they are masked out when stored)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChunks; ++c) qv[r][c] = _mm512_loadu_ps(qbuf + (r0 + r) * kD + 16 * c);
    int64_t n = 0, j0 = lo;  // keys j0 .. j0 + n - 1 are in part
    auto flush = [&] {
      const __mmask16 lanes = first_lanes(n);
      const __m512 scale = _mm512_load_ps(key_scale);
      for (int r = 0; r < R; ++r) {
        for (int64_t i = n; i < 16; ++i) part[r][i] = _mm512_setzero_ps();
        _mm512_mask_storeu_ps(p + (r0 + r) * L + (j0 - lo), lanes, _mm512_mul_ps(sum16x16(part[r]), scale));
      }
    };
    for_each_row(it.seq, it.kv_head, lo, hi, 0, o.k_scale, [&](int64_t j, const KV* k, float ks) {
      __m512 kf[kChunks];
      for (int c = 0; c < kChunks; ++c) kf[c] = load16(k + 16 * c);
      for (int r = 0; r < R; ++r) {
        __m512 dot = _mm512_mul_ps(qv[r][0], kf[0]);
        for (int c = 1; c < kChunks; ++c) dot = _mm512_fmadd_ps(qv[r][c], kf[c], dot);
        part[r][n] = dot;
      }
      key_scale[n] = ks;
      if (++n == 16) {
        flush();
        n = 0;
        j0 = j + 1;
      }
    });
    if (n > 0) flush();
  }

  // acc[r] = sum_j p[r * L + j - lo] * scale_j * v_j for rows [r0, r0 + R): each value row converted once, the
  // R accumulators kept in registers.
  template <int R>
  void values(const Item& it, int64_t lo, int64_t hi, int64_t L, const float* p, int64_t r0, float* acc) const {
    __m512 a[R][kChunks];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChunks; ++c) a[r][c] = _mm512_setzero_ps();
    for_each_row(it.seq, it.kv_head, lo, hi, 1, o.v_scale, [&](int64_t j, const KV* v, float vs) {
      __m512 vf[kChunks];
      for (int c = 0; c < kChunks; ++c) vf[c] = load16(v + 16 * c);
      for (int r = 0; r < R; ++r) {
        const __m512 w = _mm512_set1_ps(p[(r0 + r) * L + (j - lo)] * vs);
        for (int c = 0; c < kChunks; ++c) a[r][c] = _mm512_fmadd_ps(w, vf[c], a[r][c]);
      }
    });
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + (r0 + r) * kD + 16 * c, a[r][c]);
  }
#endif

  // acc[0, D) += sum over j < n of (w[j] * scale[j]) * rows[j * D, (j + 1) * D), j ascending.
  void weighted_sum(const float* w, const float* scale, const float* rows, int64_t n, float* acc) const {
    // The vector branches sum in key order through fma8, which the compiler does not regroup: a row's sum cannot
    // depend on where the value blocks begin (its item's first key). With the head_dim compiled in, every vector's
    // accumulator stays in a register over the keys (a float array stayed in memory: a load and a store per FMA;
    // one vector at a time over every key, as for a head_dim known only here, measured slower: BENCHMARKS.md).
    if constexpr (kVector8 && kD > 0) {
      pagejax::Float8 a[kD / 8];
      for (int c = 0; c < kD / 8; ++c) a[c] = pagejax::load8(acc + 8 * c);
      for (int64_t j = 0; j < n; ++j) {
        const pagejax::Float8 wj = pagejax::Float8{} + w[j] * scale[j];
        for (int c = 0; c < kD / 8; ++c) a[c] = pagejax::fma8(wj, pagejax::load8(rows + j * kD + 8 * c), a[c]);
      }
      for (int c = 0; c < kD / 8; ++c) pagejax::store8(acc + 8 * c, a[c]);
    } else if (vector8()) {  // a head_dim known only here
      const int64_t D = dim();
      for (int64_t c = 0; c < D; c += 8) {
        pagejax::Float8 a = pagejax::load8(acc + c);
        for (int64_t j = 0; j < n; ++j)
          a = pagejax::fma8(pagejax::Float8{} + w[j] * scale[j], pagejax::load8(rows + j * D + c), a);
        pagejax::store8(acc + c, a);
      }
    } else {  // a head_dim of no whole vectors (a compiled head_dim takes a vector path)
      const int64_t D = dim();
      for (int64_t j = 0; j < n; ++j) {
        const float wj = w[j] * scale[j];
        for (int64_t d = 0; d < D; ++d) acc[d] += wj * rows[j * D + d];
      }
    }
  }

  void run(const Item& it) const {
    thread_local std::vector<float> work;
    const int64_t D = dim(), G = s.group;
    const int64_t seq_q_begin = cu_q_lens[it.seq];
    const int64_t q_len = cu_q_lens[it.seq + 1] - seq_q_begin;
    const int64_t kv_len = std::min<int64_t>(kv_lens[it.seq], s.pages_per_seq * s.page_size);
    const int64_t n_tok = it.q_end - it.q_begin, rows = n_tok * G;
    auto q_pos = [&](int64_t t) { return kv_len - q_len + (t - seq_q_begin); };
    // Row r sees keys [first(r), last(r)]: causal, inside kv_len, inside the sliding window.
    auto last = [&](int64_t r) { return std::min(q_pos(it.q_begin + r / G), kv_len - 1); };
    auto first = [&](int64_t r) {
      return o.sliding_window > 0 ? std::max<int64_t>(0, q_pos(it.q_begin + r / G) - o.sliding_window + 1) : 0;
    };
    const int64_t lo = first(0), hi = last(rows - 1) + 1, L = std::max<int64_t>(hi - lo, 0);

    work.resize(rows * D * 2 + rows * L + rows + D + kValueBlock * (D + 1));
    float* qbuf = work.data();
    float* acc = qbuf + rows * D;
    float* p = acc + rows * D;
    float* inv_sum = p + rows * L;
    float* row_f = inv_sum + rows;  // the generic loops' key or value row as floats, converted once for all rows
    float* value_rows = row_f + D;  // the generic pass 2's block of value rows as floats, and their scales
    float* value_scales = value_rows + kValueBlock * D;

    for (int64_t t = 0; t < n_tok; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const float* src = q + ((it.q_begin + t) * s.num_q_heads + it.kv_head * G + g) * D;
        float* dst = qbuf + (t * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * o.sm_scale;
      }

    // Pass 1: raw scores of every row against every key of the block's range.
#ifdef PAGEJAX_ATTENTION_AVX512
    if constexpr (kVector) {
      for_row_chunks<kRows>(rows, [&](auto r, int64_t r0) { scores<decltype(r)::value>(it, lo, hi, L, qbuf, r0, p); });
    } else
#endif
    if (vector8()) {
      for_row_chunks<4>(rows, [&](auto r, int64_t r0) {
        scores8<decltype(r)::value>(it, lo, hi, L, qbuf, r0, row_f, p);
      });
    } else
    for_each_row(it.seq, it.kv_head, lo, hi, 0, o.k_scale, [&](int64_t j, const KV* k, float ks) {
      convert_row(k, row_f, D);
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = qbuf + r * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * row_f[d];
        p[r * L + (j - lo)] = dot * ks;
      }
    });
    // Exact softmax of each row over its visible keys; invisible keys get weight 0.
    for (int64_t r = 0; r < rows; ++r) {
      float* pr = p + r * L;
      const int64_t a = first(r) - lo, b = last(r) + 1 - lo;
      if (b <= a) {  // no visible key (kv_len < q_len, out of contract): zeros
        std::fill(pr, pr + L, 0.f);
        inv_sum[r] = 0.f;
        continue;
      }
      if (o.soft_cap > 0.f)
        for (int64_t j = a; j < b; ++j) pr[j] = o.soft_cap * std::tanh(pr[j] / o.soft_cap);
      const float m = max_of(pr + a, b - a);
      float sum = 0.f;
      for (int64_t j = a; j < b; ++j) {
        pr[j] = exp_nonpositive(pr[j] - m);
        sum += pr[j];
      }
      std::fill(pr, pr + a, 0.f);
      std::fill(pr + b, pr + L, 0.f);
      inv_sum[r] = 1.f / sum;
    }
    // Pass 2: probability-weighted values.
#ifdef PAGEJAX_ATTENTION_AVX512
    if constexpr (kVector) {
      for_row_chunks<kRows>(rows, [&](auto r, int64_t r0) { values<decltype(r)::value>(it, lo, hi, L, p, r0, acc); });
    } else
#endif
    {
      // A block of value rows converted once, then each query row's sum over them, its accumulators in registers
      // where the head_dim is known. The same sums in the same order as a loop over keys with every row's
      // accumulators in memory (a load, an FMA and a store per vector, per key and row), which ran slower.
      std::fill(acc, acc + rows * D, 0.f);
      for (int64_t b0 = lo; b0 < hi; b0 += kValueBlock) {
        const int64_t b1 = std::min(hi, b0 + kValueBlock);
        for_each_row(it.seq, it.kv_head, b0, b1, 1, o.v_scale, [&](int64_t j, const KV* v, float vs) {
          convert_row(v, value_rows + (j - b0) * D, D);
          value_scales[j - b0] = vs;
        });
        for (int64_t r = 0; r < rows; ++r)
          weighted_sum(p + r * L + (b0 - lo), value_scales, value_rows, b1 - b0, acc + r * D);
      }
    }
    for (int64_t t = 0; t < n_tok; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = t * G + g;
        float* dst = out + ((it.q_begin + t) * s.num_q_heads + it.kv_head * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv_sum[r];
      }
  }
};

// Items of every valid sequence, with query offsets clamped into [0, num_tokens].
std::vector<Item> make_items(const int32_t* cu_q_lens, int64_t num_seqs, const Shapes& s) {
  std::vector<Item> items;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t begin = std::clamp<int64_t>(cu_q_lens[seq], 0, s.num_tokens);
    const int64_t end = std::clamp<int64_t>(cu_q_lens[seq + 1], begin, s.num_tokens);
    for (int64_t h = 0; h < s.num_kv_heads; ++h)
      for (int64_t b = begin; b < end; b += kQueryBlock) items.push_back({seq, h, b, std::min(b + kQueryBlock, end)});
  }
  return items;
}

template <typename KV>
ffi::Error dispatch(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv_pages,
                    ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                    ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> kv_scales,
                    bool has_scales, const Options& o, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = kv_pages.dimensions(), pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2 || kd[0] < 1)
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: q [T, Hq, D], kv_pages [Hkv, P, page_size, 2D]");
  // kv_pages [Hkv, num_pages, page_size, 2 * D] (kv_cache/layout.py)
  Shapes s{qd[0], qd[1], qd[2], kd[1], kd[2], kd[0], qd[1] / kd[0], pd[0], pd[1], 0};
  if (kd[3] != 2 * s.head_dim || s.num_q_heads % s.num_kv_heads || kv_lens.element_count() != s.max_seqs ||
      cu_q_lens.element_count() != s.max_seqs + 1 || s.num_pages < 1 || s.page_size < 1)
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: inconsistent shapes");
  if (has_scales) {  // [Hkv, scale_rows, 128], each head's rows holding its 2 * page_size scales per page
    const auto sd = kv_scales.dimensions();
    if (sd.size() != 3 || sd[0] != s.num_kv_heads || sd[1] * sd[2] < 2 * s.num_pages * s.page_size)
      return ffi::Error::InvalidArgument(
          "ragged_paged_attention_cpu: kv_scales must be [Hkv, scale_rows, 128] (kv_layout.kv_cache_spec)");
    s.scale_stride = sd[1] * sd[2];
  }
  float* out_data = out->typed_data();
  std::fill(out_data, out_data + out->element_count(), 0.f);
  const int64_t n = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, s.max_seqs);
  const std::vector<Item> items = make_items(cu_q_lens.typed_data(), n, s);  // parallel_for returns when all ran
  auto run = [&](auto head_dim) {
    Attention<KV, decltype(head_dim)::value> attn{
        q.typed_data(), static_cast<const KV*>(kv_pages.untyped_data()),
        has_scales ? kv_scales.typed_data() : nullptr, kv_lens.typed_data(), page_indices.typed_data(),
        cu_q_lens.typed_data(), out_data, s, o};
    pagejax::parallel_for(items.size(), [&](int64_t i) { attn.run(items[i]); });
  };
  switch (s.head_dim) {
    case 64: run(std::integral_constant<int, 64>{}); break;
    case 128: run(std::integral_constant<int, 128>{}); break;
    default: run(std::integral_constant<int, 0>{}); break;
  }
  return ffi::Error::Success();
}

ffi::Error RaggedPagedAttentionCpu(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv_pages,
                                   ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                                   ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                                   ffi::Buffer<ffi::F32> kv_scales, float sm_scale, float soft_cap, float k_scale,
                                   float v_scale, int64_t sliding_window, ffi::ResultBuffer<ffi::F32> out) {
  const Options o{sm_scale, soft_cap, k_scale, v_scale, sliding_window};
  switch (kv_pages.element_type()) {
    case ffi::F32:
      return dispatch<float>(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, kv_scales, false, o, out);
    case ffi::BF16:
      return dispatch<uint16_t>(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, kv_scales, false, o,
                                out);
    case ffi::S8:
      return dispatch<int8_t>(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, kv_scales, true, o, out);
    case ffi::F8E4M3FN:
      return dispatch<Fp8E4M3>(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, kv_scales, true, o, out);
    default:
      return ffi::Error::InvalidArgument(
          "ragged_paged_attention_cpu: kv_pages must be float32, bfloat16, int8 or float8_e4m3fn");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagejaxRaggedPagedAttentionCpu, RaggedPagedAttentionCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hq, D]
                                  .Arg<ffi::AnyBuffer>()         // kv_pages [Hkv, P, page_size, 2 D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices [S, pages_per_seq]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kv_scales [Hkv, scale_rows, 128] or [1, 1, 1]
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<float>("k_scale")
                                  .Attr<float>("v_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [T, Hq, D]
