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
// FBGEMM's fp16 kernel pays more overhead per call than SmolLM2-sized matrices take to read.
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
#include <algorithm>
#include <vector>
#include "common.h"
#include "fused_layers.h"
#ifdef SELFSPEC_BF16_AMX
#include "amx.h"
#endif

namespace {

// Elements ahead along the weights (past a row's end: the next rows) that calls of one or two
// rows, which only stream, prefetch: 8 KiB. 2 KiB, as calls of more rows (compute-bound) keep,
// left them clearly slower on AVX2 over Qwen2.5-1.5B's matrices.
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
  // Groups of up to eight activation rows per pass over one weight row, six over two (32 zmm
  // registers: 2 NR TB accumulators).
  constexpr int64_t kMax = NR == 1 ? 8 : 6;
  for (int64_t t = 0; t < T;) {
    const uint16_t* xt = x + t * K;
    switch (T - t >= kMax ? kMax : T - t) {
      case 8: tile_bh<NR, NR == 1 ? 8 : 1, PF>(w, xt, t, store, bias, n, K); t += NR == 1 ? 8 : 1;
        break;  // (NR = 2 never takes 7 or 8: kMax)
      case 7: tile_bh<NR, NR == 1 ? 7 : 1, PF>(w, xt, t, store, bias, n, K); t += NR == 1 ? 7 : 1;
        break;
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
  // Weight rows in pairs for one or two rows (as product()), and for more than eight, where
  // each activation load then feeds two weight rows: loads from L1/L2, not the multiplies,
  // bound those calls (measured: 16 rows 25% faster on Qwen2.5-1.5B's matrices; no change at
  // 8 or fewer, where one weight row takes the larger tiles of 8).
  const bool pairs = T <= 2 || T > 8;
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

#ifdef SELFSPEC_BF16_AMX
// AMX build (on top of the AVX512-BF16 one): every call, whatever its row count, runs in AMX
// bf16 tiles, so that a verification block of up to 16 tokens reads each weight once and
// costs about what one token costs (vdpbf16ps needs one instruction per weight pair and
// token: compute-bound at 16 rows on 1.5B models).
//
// The weights are the A operand, read in place: 16 weight rows x 32 inputs a tile (64 bytes
// of each row, K * 2 bytes apart; no copy, no transpose). The activations are the B operand,
// laid out once per call in AMX's pair layout: per 32 inputs, 16 pair rows x 16 tokens x 2.
// C[r][t] (16 weight rows x 16 tokens, fp32) accumulates tdpbf16ps over the 32-input chunks
// in order, two weight groups (32 rows) a pass over a token tile.
//
// Row consistency: C[r][t] depends only on weight row r, token t's inputs and the fixed
// sequence of tdpbf16ps over k (padding tokens and padded inputs are zeros and touch only
// their own lanes), then + bias in fp32, so a row is the same bits whatever T, its place in
// the call and the thread split. This build rounds differently from the other two.
namespace amxbf {

constexpr int64_t kRows = 16, kChunk = 32;  // weight rows a tile, inputs a chunk

using selfspec_amx::permission;
using selfspec_amx::TileConfig;

// Tiles 0, 1: C of weight groups 0 and 1 (16 rows x cols tokens); 2, 3: their A (16 rows x
// 32 inputs); 4: B (16 input pairs x cols tokens). cols = min(T, 16): a one-token call lays
// out and multiplies one column.
inline void configure(int cols) {
  TileConfig c;
  memset(&c, 0, sizeof(c));
  c.palette = 1;
  for (int t = 0; t < 5; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  for (int t : {0, 1, 4}) c.colsb[t] = static_cast<uint16_t>(4 * cols);
  selfspec_amx::load_config(c);
}

// No software prefetch: the hardware's streams serve the 16 rows a tile reads. Prefetching
// 512 or 2,048 bytes ahead along each row, or the next 32 rows' block line by line, measured
// slower (one-row calls over SmolLM2-135M / Qwen2.5-1.5B matrices from DRAM).

// y[t, n] = w_n . x_t + bias[n] for bf16 x [T, K], handed to store(t, n, y).
template <typename Store>
void product(const uint16_t* w, const uint16_t* x, const float* bias, int64_t T, int64_t K,
             int64_t N, Store store) {
  if (T <= 0 || N <= 0 || K <= 0) return;  // nothing to compute (and no valid tile shape)
  const int64_t chunks = (K + kChunk - 1) / kChunk, full = K / kChunk;
  const int64_t ttiles = (T + 15) / 16, cols = std::min<int64_t>(T, 16), bsize = 16 * cols;
  // B: [ttile][chunk][16 pairs][cols tokens] dwords (two bf16 inputs each), zero-padded.
  std::vector<uint32_t> xb(static_cast<size_t>(ttiles * chunks * bsize), 0u);
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* row = x + t * K;
    uint32_t* dst = xb.data() + (t / 16) * chunks * bsize + (t % 16);
    for (int64_t k = 0; k < K; k += 2) {
      const uint32_t lo = row[k], hi = k + 1 < K ? row[k + 1] : 0u;
      dst[(k / kChunk) * bsize + ((k % kChunk) / 2) * cols] = lo | (hi << 16);
    }
  }
  const int64_t groups = (N + kRows - 1) / kRows, units = (groups + 1) / 2;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    configure(static_cast<int>(cols));
    alignas(64) float c[2][16 * 16];
    alignas(64) uint16_t pad[2][16 * kChunk];  // a partial tile of weights, zero-padded
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g0 = 2 * u, ng = g0 + 1 < groups ? 2 : 1;
      int64_t rows[2];
      for (int64_t i = 0; i < ng; ++i) rows[i] = std::min<int64_t>(kRows, N - (g0 + i) * kRows);
      for (int64_t j = 0; j < ttiles; ++j) {
        _tile_zero(0);
        _tile_zero(1);
        const uint32_t* bj = xb.data() + j * chunks * bsize;
        for (int64_t ch = 0; ch < chunks; ++ch) {
          _tile_loadd(4, bj + ch * bsize, 4 * cols);
          for (int64_t i = 0; i < ng; ++i) {
            const uint16_t* a = w + (g0 + i) * kRows * K + ch * kChunk;
            int64_t stride = K * 2;
            if (ch >= full || rows[i] < kRows) {  // a partial tile: copy what there is
              memset(pad[i], 0, sizeof(pad[i]));
              const int64_t cols = std::min<int64_t>(kChunk, K - ch * kChunk);
              for (int64_t r = 0; r < rows[i]; ++r)
                memcpy(pad[i] + r * kChunk, a + r * K, static_cast<size_t>(cols) * 2);
              a = pad[i];
              stride = kChunk * 2;
            }
            if (i == 0) {
              _tile_loadd(2, a, stride);
              _tile_dpbf16ps(0, 2, 4);
            } else {
              _tile_loadd(3, a, stride);
              _tile_dpbf16ps(1, 3, 4);
            }
          }
        }
        _tile_stored(0, c[0], 4 * cols);
        _tile_stored(1, c[1], 4 * cols);
        for (int64_t i = 0; i < ng; ++i)
          for (int64_t r = 0; r < rows[i]; ++r) {
            const int64_t n = (g0 + i) * kRows + r;
            for (int64_t t = j * 16; t < std::min<int64_t>(T, j * 16 + 16); ++t) {
              float v = c[i][r * cols + (t - j * 16)];
              if (bias) v += bias[n];
              store(t, n, v);
            }
          }
      }
    }
    _tile_release();
  });
}

}  // namespace amxbf
#endif  // SELFSPEC_BF16_AMX

// fp32 activations (the fused sub-layers'): rounded to bf16 once, then as above.
template <typename Store>
void product(const uint16_t* w, const float* x, const float* bias, int64_t T, int64_t K,
             int64_t N, Store store) {
  std::vector<uint16_t> x16(static_cast<size_t>(T * K));
  for (int64_t i = 0; i < T * K; ++i) x16[i] = float_to_bf16(x[i]);
#ifdef SELFSPEC_BF16_AMX
  amxbf::product(w, x16.data(), bias, T, K, N, store);
#else
  product_bh(w, x16.data(), bias, T, K, N, store);
#endif
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
#if defined(SELFSPEC_BF16_AMX)
int selfspec_bf16_rows_version() { return 201; }

// 1 where Linux granted this process the AMX tile state (the build's other calls need it).
int64_t selfspec_bf16_rows_amx() { return amxbf::permission() ? 1 : 0; }

void selfspec_bf16_rows(const uint16_t* w, const uint16_t* x16, uint16_t* y, const float* bias,
                        int64_t T, int64_t K, int64_t N) {
  amxbf::product(w, x16, bias, T, K, N,
                 [&](int64_t t, int64_t n, float v) { y[t * N + n] = float_to_bf16(v); });
}
#elif defined(SELFSPEC_BF16_NATIVE)
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
