// Draft products on 4-bit weights and 8-bit activations for AVX2 CPUs (W4A8, llama.cpp's
// Q4_1 x Q8_0 scheme).
//
// y[t, n] ~= sum_b dx[t, b] * (dw[n, b] * sum_{k in b} q[n, k] a[t, k] + mw[n, b] * sum_{k in b}
// a[t, k]) (+ bias[n]) over 32-input blocks b: weight codes q in [0, 15] with one fp16 scale dw
// and minimum mw per block (w ~= q dw + mw), activation codes a in [-127, 127] with one fp32
// scale dx per block (quantized here, per call). Needs AVX2, FMA and F16C.
//
// Why our own kernel: a draft token on quantized weights costs what reading them costs, and on
// AVX2 CPUs torch's int4 kernel unpacks nibbles well below the memory bandwidth while FBGEMM's
// W8A8 reads a byte a weight. Here the integer dot products run on vpmaddubsw/vpmaddwd (16
// weights a cycle a port), so one pass reads 0.625 bytes a weight.
//
// Layout: codes [N, K/2] bytes, blocks b, b+1 (b even) of row n in the 32 bytes at n*K/2 +
// b*16. Within a block, code byte j holds input j in its low nibble and input j + 16 in its
// high one; the pair's 32 bytes interleave the two blocks' 16 in 4-byte chunks (chunk g of
// block b + c at byte 8g + 4c), so after vpmaddwd int32 lane i belongs to block b + (i & 1)
// and one 64-bit broadcast gives the lanes' scales. One 32-byte load, a shift and two masks
// give the low and high halves of both blocks: two blocks cost two vpmaddubsw, one vpmaddwd,
// one conversion and one FMA. An odd last block is 16 bytes in block order. Scales [N, K/32]
// fp16, minima [N, K/32] fp16: 0.625 bytes a weight in all.
//
// The minimum's term, summed over blocks, is a dot product of the weight row's minima with the
// activation's per-block dx * sum a, done once per row after the block loop.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "common.h"
#include "fused_layers.h"

namespace {

constexpr int64_t kBlock = 32;
#ifndef SELFSPEC_W4A8_PREFETCH
#define SELFSPEC_W4A8_PREFETCH 2048
#endif
constexpr int64_t kPrefetch = SELFSPEC_W4A8_PREFETCH;  // bytes ahead along the codes

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

struct Activations {
  std::vector<int8_t> codes;   // [T, K], each pair of blocks interleaved (quantize_row)
  std::vector<float> scale;    // [T, K/32]
  std::vector<float> sums;     // [T, K/32]: scale * sum of the block's codes
};

// One activation row (fp32 or bf16) into int8 codes per 32-input block, round to nearest
// even, in the order of the weight codes (see Layout): for blocks b, b+1 of a pair, 4-input
// chunk g of block b + c goes to the 4 bytes at 8g + 4c of the first 32 bytes (inputs 0-15)
// or of the second 32 (inputs 16-31). An odd last block stays in order.
template <typename In>
void quantize_row(const In* x, int64_t K, int8_t* q, float* scale, float* sums) {
  const int64_t KB = K / kBlock;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < KB; ++b) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = load8(x + b * kBlock + j * 8);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float top = _mm_cvtss_f32(m);
    const float d = top / 127.f;
    const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
    __m256i i[4];
    for (int j = 0; j < 4; ++j)  // |x * inv| <= 127: no clamp; MXCSR rounds to nearest even
      i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])),
        order);
    int8_t* dst = q + (b & ~int64_t(1)) * kBlock;
    if ((b | 1) < KB) {
      alignas(32) int32_t chunk[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(chunk), packed);
      int32_t* out = reinterpret_cast<int32_t*>(dst) + (b & 1);
      for (int g = 0; g < 4; ++g) {
        memcpy(out + 2 * g, chunk + g, 4);
        memcpy(out + 8 + 2 * g, chunk + 4 + g, 4);
      }
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
    }
    scale[b] = d;
    sums[b] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

// NR weight rows (n ..) times TB activation rows (t0 ..).
template <int NR, int TB>
inline void tile(const uint8_t* codes, const uint16_t* wscale, const uint16_t* wmin,
                 const Activations& a,
                 int64_t t0, int64_t n, int64_t K, float* out /* [TB][NR] */) {
  const int64_t KB = K / kBlock, row_bytes = K / 2;
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0f);
  __m256 acc[NR][TB];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm256_setzero_ps();
  const uint8_t* row = codes + n * row_bytes;
  const uint16_t* ws = wscale + n * KB;
  const int8_t* xq = a.codes.data() + t0 * K;
  const float* xs = a.scale.data() + t0 * KB;
  int64_t b = 0;
  for (; b + 2 <= KB; b += 2) {  // two blocks a step: 32 bytes of codes per weight row
    if ((b & 3) == 0)
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(row + r * row_bytes + b * 16 + kPrefetch),
                     _MM_HINT_T0);
    __m256i lo[NR], hi[NR];
    __m256 wsc[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m256i v = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(row + r * row_bytes + b * 16));
      lo[r] = _mm256_and_si256(v, nibble);
      hi[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      // int32 lane i of a product holds block b + (i & 1): scales [dw_b, dw_b+1] x 4, from
      // the two fp16 scales broadcast as one 32-bit value.
      int32_t two;
      memcpy(&two, ws + r * KB + b, 4);
      wsc[r] = _mm256_cvtph_ps(_mm_set1_epi32(two));
    }
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
      const int8_t* x = xq + t * K + b * kBlock;
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
      const __m256 dx = _mm256_castpd_ps(
          _mm256_broadcast_sd(reinterpret_cast<const double*>(xs + t * KB + b)));
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        // |pair sums| <= 2 * 15 * 127 each, so adding the low and high halves fits int16.
        const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], xa),
                                             _mm256_maddubs_epi16(hi[r], xb));
        const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
        acc[r][t] = _mm256_fmadd_ps(s, _mm256_mul_ps(wsc[r], dx), acc[r][t]);
      }
    }
  }
  if (b < KB) {  // an odd last block: 16 bytes, codes in order
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m128i raw = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(row + r * row_bytes + b * 16));
      const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), nibble);
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t) {
        const __m256i x = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(xq + t * K + b * kBlock));
        const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, x), ones));
        acc[r][t] = _mm256_fmadd_ps(s, _mm256_set1_ps(half_to_float(ws[r * KB + b]) * xs[t * KB + b]),
                                    acc[r][t]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
      const float* off = a.sums.data() + (t0 + t) * KB;
      const uint16_t* w = wmin + (n + r) * KB;
      __m256 c = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= KB; i += 8)
        c = _mm256_fmadd_ps(
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i))),
            _mm256_loadu_ps(off + i), c);
      float corr = hsum(c);
      for (; i < KB; ++i) corr += half_to_float(w[i]) * off[i];
      out[t * NR + r] = hsum(acc[r][t]) + corr;
    }
}

template <int NR, int TBMAX>
inline void rows(const uint8_t* codes, const uint16_t* wscale, const uint16_t* wmin,
                 const Activations& a, int64_t n,
                 int64_t T, int64_t K, float* out /* [T][NR] */) {
  for (int64_t t = 0; t < T;) {
    switch (T - t >= TBMAX ? TBMAX : T - t) {
      case 4: tile<NR, 4>(codes, wscale, wmin, a, t, n, K, out + t * NR); t += 4; break;
      case 3: tile<NR, 3>(codes, wscale, wmin, a, t, n, K, out + t * NR); t += 3; break;
      case 2: tile<NR, 2>(codes, wscale, wmin, a, t, n, K, out + t * NR); t += 2; break;
      default: tile<NR, 1>(codes, wscale, wmin, a, t, n, K, out + t * NR); t += 1; break;
    }
  }
}

// One w4a8 matrix [N, K] in the layout above (W4A8Linear's ctypes mirror in w4a8.py).
struct Weight {
  const uint8_t* codes;
  const uint16_t* scale;
  const uint16_t* minimum;
  const float* bias;  // [N] or null
  int64_t n, k;
};

template <typename In>
void quantize(const In* x, int64_t T, int64_t K, Activations& a) {
  const int64_t KB = K / kBlock;
  a.codes.resize(static_cast<size_t>(T * K));
  a.scale.resize(static_cast<size_t>(T * KB));
  a.sums.resize(static_cast<size_t>(T * KB));
  for (int64_t t = 0; t < T; ++t)
    quantize_row(x + t * K, K, a.codes.data() + t * K, a.scale.data() + t * KB,
                 a.sums.data() + t * KB);
}

// y[t, n] = w_n . x_t + bias[n] for the quantized rows a, handed to store(t, n, y) in fp32.
template <typename Store>
void product(const Weight& w, const Activations& a, int64_t T, Store store) {
  const int64_t N = w.n, K = w.k;
  auto emit = [&](int64_t t, int64_t n, float v) { store(t, n, w.bias ? v + w.bias[n] : v); };
  // Weight rows in pairs against up to four activation rows: each weight load serves up to
  // four rows, each activation load two weight rows (two chains of FMAs even for one row).
  // Faster than one weight row by four activation rows on long blocks (the same numbers, as
  // rows are independent).
  const int64_t step = 2;
  const int64_t units = N / step;
  at::parallel_for(0, units, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> out(static_cast<size_t>(T * step));
    for (int64_t u = begin; u < end; ++u) {
      rows<2, 4>(w.codes, w.scale, w.minimum, a, u * 2, T, K, out.data());
      for (int64_t t = 0; t < T; ++t)
        for (int64_t r = 0; r < step; ++r) emit(t, u * step + r, out[t * step + r]);
    }
  });
  if (units * step < N) {
    std::vector<float> out(static_cast<size_t>(T));
    rows<1, 4>(w.codes, w.scale, w.minimum, a, N - 1, T, K, out.data());
    for (int64_t t = 0; t < T; ++t) emit(t, N - 1, out[t]);
  }
}

// The fused sub-layers' products (fused_layers.h): activations quantized per call.
struct W4A8Product {
  template <typename Store>
  static void run(const void* matrix, const float* x, int64_t T, Store store) {
    const Weight& w = *static_cast<const Weight*>(matrix);
    Activations a;
    quantize(x, T, w.k, a);
    product(w, a, T, store);
  }
};

}  // namespace

extern "C" {

// Version of this kernel's numerics and layout; a change must change it.
int selfspec_w4a8_rows_version() { return 3; }

// x: [T, K] bf16 (x_bf16 = 1) or fp32; y: [T, N] in the same dtype; bias fp32 [N] or null.
// K must be a multiple of 32.
void selfspec_w4a8_rows(const uint8_t* codes, const uint16_t* wscale, const uint16_t* wmin,
                        const void* x, void* y,
                        const float* bias, int64_t T, int64_t K, int64_t N, int64_t x_bf16) {
  const Weight w{codes, wscale, wmin, bias, N, K};
  Activations a;
  if (x_bf16) {
    quantize(static_cast<const uint16_t*>(x), T, K, a);
    product(w, a, T, [&](int64_t t, int64_t n, float v) {
      static_cast<uint16_t*>(y)[t * N + n] = float_to_bf16(v);
    });
  } else {
    quantize(static_cast<const float*>(x), T, K, a);
    product(w, a, T, [&](int64_t t, int64_t n, float v) { static_cast<float*>(y)[t * N + n] = v; });
  }
}

// h_out = h_in + o(attention(RoPE(qkv(RMSNorm(h_in))))) on args->rows rows, appending their
// keys and values to the segments' caches first (fused_layers.h); matrices are Weights.
void selfspec_w4a8_attention(const AttentionArgs* args) { attention<W4A8Product>(*args); }

// h_out = h_in + down(SiLU(gate) * up), [gate, up] = gate_up(RMSNorm(h_in)).
void selfspec_w4a8_mlp(const MlpArgs* args) { mlp<W4A8Product>(*args); }

}  // extern "C"
