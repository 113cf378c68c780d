// Row-consistent bf16-weight matrix products, built twice from this source: for AVX2 + FMA
// CPUs without native bf16, and (SELFSPEC_BF16_NATIVE) for CPUs with AVX512-BF16, where
// vdpbf16ps multiplies pairs of bf16 weights and bf16 activations into fp32 lanes: 32 products
// an instruction against the AVX2 build's 8, so that verification rows cost less compute
// (activations are rounded to bf16 once per call; the weights are read as they are).
//
// y[t, n] = bf16(sum_k w[n, k] * x[t, k] (+ bias[n])), w bf16 [N, K] row-major, x bf16 [T, K],
// y bf16 [T, N], products and sums in fp32.
//
// Why our own kernel: on these CPUs torch's bf16 F.linear converts as it multiplies and its
// cost grows with the rows (a verification of T tokens costs about T decoding steps), and
// FBGEMM's fp16 kernel pays ~0.1 ms per call, more than SmolLM2-sized matrices take to read.
// Here each weight row is converted once (a 16-bit shift) and multiplied with up to six
// activation rows while it is in registers, so a call of a few rows reads the weights once.
//
// Row consistency, which lossless verification rests on: every dot product is accumulated in
// the same order whatever T, the row's place in the call, the grouping of rows and the split
// of N between threads (two 8-lane accumulators over alternating 8-wide chunks of k, a scalar
// tail, a fixed horizontal sum, then the bias), so each row of a T-row call is bit-identical
// to that row computed alone.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <vector>

#include "common.h"
#include "fused_layers.h"

namespace {

// Elements ahead along the weights (past a row's end: the next rows) that calls of one or two
// rows, which only stream, prefetch: 8 KiB. 2 KiB, as calls of more rows (compute-bound) keep,
// left them 28-46% slower on the 2-core AVX2 EPYC over Qwen2.5-1.5B's matrices
// (docs/results/executor-profile/prefetch-2026-11-26).
#ifndef SELFSPEC_BF16_PREFETCH
#define SELFSPEC_BF16_PREFETCH 4096
#endif
constexpr int64_t kPrefetchStreaming = SELFSPEC_BF16_PREFETCH;
constexpr int64_t kPrefetch = 1024;

#ifndef SELFSPEC_BF16_NATIVE
inline float finish(__m256 a, __m256 b, const uint16_t* w, const float* x, int64_t k0,
                    int64_t K) {
  float sum = hsum(_mm256_add_ps(a, b));
  for (int64_t k = k0; k < K; ++k) sum += bf16_to_float(w[k]) * x[k];
  return sum;
}

// NR weight rows (n .. n+NR-1) times TB activation rows (x starts at the group's first row,
// t0): store(t0 + t, n + r, dot + bias).
template <int NR, int TB, int64_t PF, typename Store>
inline void tile(const uint16_t* w, const float* x, int64_t t0, Store& store, const float* bias,
                 int64_t n, int64_t K) {
  const int64_t K16 = K & ~int64_t(15);
  __m256 a[NR][TB], b[NR][TB];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TB; ++t) a[r][t] = b[r][t] = _mm256_setzero_ps();
  const uint16_t* row = w + n * K;
  for (int64_t k = 0; k < K16; k += 16) {
    if ((k & 31) == 0)
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(row + r * K + k + PF), _MM_HINT_T0);
    __m256 u[NR], v[NR];
    for (int r = 0; r < NR; ++r) {
      u[r] = load8(row + r * K + k);
      v[r] = load8(row + r * K + k + 8);
    }
    for (int t = 0; t < TB; ++t) {
      __m256 xa = _mm256_loadu_ps(x + t * K + k), xb = _mm256_loadu_ps(x + t * K + k + 8);
      for (int r = 0; r < NR; ++r) {
        a[r][t] = _mm256_fmadd_ps(u[r], xa, a[r][t]);
        b[r][t] = _mm256_fmadd_ps(v[r], xb, b[r][t]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TB; ++t) {
      float s = finish(a[r][t], b[r][t], row + r * K, x + t * K, K16, K);
      if (bias) s += bias[n + r];
      store(t0 + t, n + r, s);
    }
}

template <int NR, int64_t PF, typename Store>
inline void rows_group(const uint16_t* w, const float* x, Store& store, const float* bias,
                       int64_t n, int64_t T, int64_t K) {
  // Groups of up to six activation rows per pass over the weight row(s), which stay in L1.
  for (int64_t t = 0; t < T;) {
    const float* xt = x + t * K;
    switch (T - t >= 6 ? 6 : T - t) {
      case 6: tile<NR, 6, PF>(w, xt, t, store, bias, n, K); t += 6; break;
      case 5: tile<NR, 5, PF>(w, xt, t, store, bias, n, K); t += 5; break;
      case 4: tile<NR, 4, PF>(w, xt, t, store, bias, n, K); t += 4; break;
      case 3: tile<NR, 3, PF>(w, xt, t, store, bias, n, K); t += 3; break;
      case 2: tile<NR, 2, PF>(w, xt, t, store, bias, n, K); t += 2; break;
      default: tile<NR, 1, PF>(w, xt, t, store, bias, n, K); t += 1; break;
    }
  }
}

// y[t, n] = w_n . x_t + bias[n] (fp32 x [T, K]), handed to store(t, n, y).
template <typename Store>
void product(const uint16_t* w, const float* x, const float* bias, int64_t T, int64_t K,
             int64_t N, Store store) {
  // One or two activation rows are too few FMAs to hide the accumulators' latency on one
  // weight row, so those take weight rows in pairs; more rows take one weight row at a time
  // (registers). Either way each dot product's order is the same.
  const bool pairs = T <= 2;
  const int64_t step = pairs ? 2 : 1;
  const int64_t units = N / step;
  at::parallel_for(0, units, 8, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      if (pairs) rows_group<2, kPrefetchStreaming>(w, x, store, bias, u * 2, T, K);
      else rows_group<1, kPrefetch>(w, x, store, bias, u, T, K);
    }
  });
  if (pairs && (N & 1)) rows_group<1, kPrefetchStreaming>(w, x, store, bias, N - 1, T, K);
}
#endif  // !SELFSPEC_BF16_NATIVE

#ifdef SELFSPEC_BF16_NATIVE
// AVX512-BF16 build: two 16-lane accumulators over alternating 32-wide chunks of k, the last
// partial chunk masked (zero pairs add nothing, exactly), a fixed horizontal sum, then the
// bias: the same order for every row whatever the grouping, so rows stay consistent.
inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_bh(const uint16_t* p, __mmask32 m) {
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}
inline __mmask32 tail_mask(int64_t count) {  // the first min(count, 32) lanes (count > 0)
  return count >= 32 ? ~__mmask32(0) : (__mmask32(1) << count) - 1;
}

template <int NR, int TB, int64_t PF, typename Store>
inline void tile_bh(const uint16_t* w, const uint16_t* x, int64_t t0, Store& store,
                    const float* bias, int64_t n, int64_t K) {
  const int64_t K64 = K & ~int64_t(63);
  __m512 a[NR][TB], b[NR][TB];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TB; ++t) a[r][t] = b[r][t] = _mm512_setzero_ps();
  const uint16_t* row = w + n * K;
  for (int64_t k = 0; k < K64; k += 64) {
    for (int r = 0; r < NR; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(row + r * K + k + PF), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + r * K + k + PF + 32), _MM_HINT_T0);
    }
    __m512bh u[NR], v[NR];
    for (int r = 0; r < NR; ++r) {
      u[r] = load_bh(row + r * K + k);
      v[r] = load_bh(row + r * K + k + 32);
    }
    for (int t = 0; t < TB; ++t) {
      const __m512bh xa = load_bh(x + t * K + k), xb = load_bh(x + t * K + k + 32);
      for (int r = 0; r < NR; ++r) {
        a[r][t] = _mm512_dpbf16_ps(a[r][t], u[r], xa);
        b[r][t] = _mm512_dpbf16_ps(b[r][t], v[r], xb);
      }
    }
  }
  if (K64 < K) {  // 1..63 inputs left: the first chunk into a, the rest (if any) into b
    const __mmask32 ma = tail_mask(K - K64);
    const __mmask32 mb = K - K64 > 32 ? tail_mask(K - K64 - 32) : __mmask32(0);
    for (int r = 0; r < NR; ++r) {
      const __m512bh u = load_bh(row + r * K + K64, ma);
      const __m512bh v = load_bh(row + r * K + K64 + 32, mb);
      for (int t = 0; t < TB; ++t) {
        a[r][t] = _mm512_dpbf16_ps(a[r][t], u, load_bh(x + t * K + K64, ma));
        b[r][t] = _mm512_dpbf16_ps(b[r][t], v, load_bh(x + t * K + K64 + 32, mb));
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TB; ++t) {
      float s = _mm512_reduce_add_ps(_mm512_add_ps(a[r][t], b[r][t]));
      if (bias) s += bias[n + r];
      store(t0 + t, n + r, s);
    }
}

template <int NR, int64_t PF, typename Store>
inline void rows_group_bh(const uint16_t* w, const uint16_t* x, Store& store, const float* bias,
                          int64_t n, int64_t T, int64_t K) {
  // Groups of up to eight activation rows per pass over the weight row(s) (32 zmm registers).
  for (int64_t t = 0; t < T;) {
    const uint16_t* xt = x + t * K;
    switch (T - t >= 8 ? 8 : T - t) {
      case 8: tile_bh<NR, 8, PF>(w, xt, t, store, bias, n, K); t += 8; break;
      case 7: tile_bh<NR, 7, PF>(w, xt, t, store, bias, n, K); t += 7; break;
      case 6: tile_bh<NR, 6, PF>(w, xt, t, store, bias, n, K); t += 6; break;
      case 5: tile_bh<NR, 5, PF>(w, xt, t, store, bias, n, K); t += 5; break;
      case 4: tile_bh<NR, 4, PF>(w, xt, t, store, bias, n, K); t += 4; break;
      case 3: tile_bh<NR, 3, PF>(w, xt, t, store, bias, n, K); t += 3; break;
      case 2: tile_bh<NR, 2, PF>(w, xt, t, store, bias, n, K); t += 2; break;
      default: tile_bh<NR, 1, PF>(w, xt, t, store, bias, n, K); t += 1; break;
    }
  }
}

// y[t, n] = w_n . x_t + bias[n] (bf16 x [T, K]), handed to store(t, n, y).
template <typename Store>
void product_bh(const uint16_t* w, const uint16_t* x, const float* bias, int64_t T, int64_t K,
                int64_t N, Store store) {
  const bool pairs = T <= 2;  // as product(): weight rows in pairs for one or two rows
  const int64_t step = pairs ? 2 : 1;
  const int64_t units = N / step;
  at::parallel_for(0, units, 8, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      if (pairs) rows_group_bh<2, kPrefetchStreaming>(w, x, store, bias, u * 2, T, K);
      else rows_group_bh<1, kPrefetch>(w, x, store, bias, u, T, K);
    }
  });
  if (pairs && (N & 1)) rows_group_bh<1, kPrefetchStreaming>(w, x, store, bias, N - 1, T, K);
}

// fp32 activations (the fused sub-layers'): rounded to bf16 once, then as above.
template <typename Store>
void product(const uint16_t* w, const float* x, const float* bias, int64_t T, int64_t K,
             int64_t N, Store store) {
  std::vector<uint16_t> x16(static_cast<size_t>(T * K));
  for (int64_t i = 0; i < T * K; ++i) x16[i] = float_to_bf16(x[i]);
  product_bh(w, x16.data(), bias, T, K, N, store);
}
#endif  // SELFSPEC_BF16_NATIVE

// One bf16 matrix [N, K] (Bf16Weight's ctypes mirror in fused_layers.py).
struct Matrix {
  const uint16_t* weight;
  const float* bias;  // [N] or null
  int64_t n, k;
};

// The fused sub-layers' products (fused_layers.h).
struct Bf16Product {
  template <typename Store>
  static void run(const void* matrix, const float* x, int64_t T, Store store) {
    const Matrix& m = *static_cast<const Matrix*>(matrix);
    product(m.weight, x, m.bias, T, m.k, m.n, store);
  }
};

}  // namespace

extern "C" {

// Version of this kernel's numerics; a change of rounding must change it.
#ifdef SELFSPEC_BF16_NATIVE
int selfspec_bf16_rows_version() { return 101; }

void selfspec_bf16_rows(const uint16_t* w, const uint16_t* x16, uint16_t* y, const float* bias,
                        int64_t T, int64_t K, int64_t N) {
  product_bh(w, x16, bias, T, K, N,
             [&](int64_t t, int64_t n, float v) { y[t * N + n] = float_to_bf16(v); });
}
#else
int selfspec_bf16_rows_version() { return 1; }

void selfspec_bf16_rows(const uint16_t* w, const uint16_t* x16, uint16_t* y, const float* bias,
                        int64_t T, int64_t K, int64_t N) {
  std::vector<float> x(static_cast<size_t>(T * K));
  for (int64_t i = 0; i < T * K; ++i) x[i] = bf16_to_float(x16[i]);
  product(w, x.data(), bias, T, K, N,
          [&](int64_t t, int64_t n, float v) { y[t * N + n] = float_to_bf16(v); });
}
#endif

// Whole sub-layers on bf16 matrices (fused_layers.h; the args' matrices are Matrix).
void selfspec_bf16_attention(const AttentionArgs* args) { attention<Bf16Product>(*args); }

void selfspec_bf16_mlp(const MlpArgs* args) { mlp<Bf16Product>(*args); }

}  // extern "C"
