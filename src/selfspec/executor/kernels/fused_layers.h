// Whole decoder sub-layers in one call each, on any matrix kernel: included by
// w4a8_rows.cpp, bf16_rows.cpp and gguf_rows.cpp, each with its own Product:
//   struct Product { template <typename Store> static void run(const void* matrix,
//       const float* x /* [T, K] */, int64_t T, Store store /* (t, n, y_tn + bias_n) */); };
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <cmath>
#include <vector>

#include "common.h"

namespace {

// An attention or MLP sub-layer (norms included, residual added) on T rows, every product on
// one matrix kernel, so a decode step makes two calls a layer instead of some thirty torch
// operators (a noticeable share of a Qwen2.5-1.5B step on AVX2). Llama's layer, plus what
// the args switch on: per-head q/k RMSNorms (Qwen3, Gemma 3), a post-norm of each
// sub-layer's output (Gemma 3's four norms a layer), a sliding window, GELU-tanh (Gemma 3).
// Every row is computed as it would be alone (norms, products, RoPE, attention over its own
// prefix or window), so verification blocks equal one-token decoding bit for bit. Hidden
// states and the KV cache are bf16 (bf16 = 1) or fp32; norm weights are fp32 (Gemma's
// 1 + w made at load); everything in between is fp32.

inline float get(const float* p) { return *p; }
inline float get(const uint16_t* p) { return bf16_to_float(*p); }
inline void put(float* p, float v) { *p = v; }
inline void put(uint16_t* p, float v) { *p = float_to_bf16(v); }

// e^x for x <= 88 (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n in the
// exponent bits; relative error ~1e-7); inputs below -87 give ~1e-38, not 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float exp1(float x) {
  alignas(32) float v[8];
  _mm256_store_ps(v, exp8(_mm256_set1_ps(x)));
  return v[0];
}

// RMSNorm of one row, as HF's RMSNorms but all in fp32: y = x / sqrt(mean(x^2) + eps) * w
// (w fp32: Llama's w, Gemma's 1 + w). y may be x (fp32 rows: the q/k and post norms).
template <typename D>
void rms_norm(const D* x, const float* w, int64_t H, float eps, float* y) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= H; i += 8) {
    const __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (; i < H; ++i) ss += get(x + i) * get(x + i);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (i = 0; i < H; ++i) y[i] = get(x + i) * r * w[i];
}

template <typename D>
inline float dot(const float* q, const D* k, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += q[i] * get(k + i);
  return s;
}

// softmax(q K[0:n]^T * scaling) V[0:n] for one query head: K, V [n, hd] rows of one KV head.
template <typename D>
void attend(const float* q, const D* K, const D* V, int64_t n, int64_t hd, float scaling,
            float* scores, float* out) {
  float top = -HUGE_VALF;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = dot(q, K + j * hd, hd) * scaling;
    top = scores[j] > top ? scores[j] : top;
  }
  __m256 acc = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(top);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift));
    _mm256_storeu_ps(scores + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = hsum(acc);
  for (; j < n; ++j) {
    scores[j] = exp1(scores[j] - top);
    total += scores[j];
  }
  for (int64_t d = 0; d < hd; ++d) out[d] = 0.f;
  for (j = 0; j < n; ++j) {
    const __m256 p = _mm256_set1_ps(scores[j]);
    const D* v = V + j * hd;
    int64_t d = 0;
    for (; d + 8 <= hd; d += 8)
      _mm256_storeu_ps(out + d, _mm256_fmadd_ps(p, load8(v + d), _mm256_loadu_ps(out + d)));
    for (; d < hd; ++d) out[d] += scores[j] * get(v + d);
  }
  const float inv = 1.f / total;
  for (int64_t d = 0; d < hd; ++d) out[d] *= inv;
}

// HF's rotate_half RoPE on one head: x' = x cos + rotate_half(x) sin.
inline void rope(float* x, const float* cos, const float* sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// One run of consecutive rows of one sequence and its layer's KV storage [H_kv, capacity, hd]
// (batch-1 cache): row first_row + i is at position first_position + i.
struct Segment {
  int64_t keys, values;  // addresses
  int64_t capacity, first_position, first_row, rows;
};

struct AttentionArgs {
  const void* hidden_in;
  void* hidden_out;          // may be hidden_in
  const float* norm;         // [H] fp32
  const void* qkv;           // [(Hq + 2 H_kv) hd, H]: a matrix as the kernel's Product takes it
  const void* o;             // [H, Hq hd]
  const float* cos;          // [T, hd]: each row's RoPE at its position (its layer's table)
  const float* sin;
  const Segment* segments;
  int64_t num_segments, rows, hidden, heads, kv_heads, head_dim, bf16;
  float eps, scaling;
  const float* q_norm;       // [hd] fp32 per-head RMSNorm of each query head, or null
  const float* k_norm;       // [hd] of each key head (null with q_norm)
  const float* post_norm;    // [H] fp32 RMSNorm of the sub-layer's output, or null
  float qk_eps, post_eps;
  int64_t window;            // a query at p sees keys p - window < k <= p; 0: all of them
};

// The MLP's activation of its gate: act(gate) * up.
enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

struct MlpArgs {
  const void* hidden_in;
  void* hidden_out;
  const float* norm;         // [H] fp32
  const void* gate_up;       // [2I, H]: gate rows, then up rows
  const void* down;          // [H, I]
  int64_t rows, hidden, intermediate, bf16;
  float eps;
  const float* post_norm;    // [H] fp32 RMSNorm of the MLP's output, or null
  float post_eps;
  int64_t act;               // an Activation
};

// h_out = h_in + post_norm(y) (or + y without one) for the T x H rows of a sub-layer's last
// product: the rows go to a buffer first when a post-norm needs the whole row. Each output
// is written once, after its input was read: h_out may alias h_in.
template <typename D, typename Product>
void add_output(const void* matrix, const float* in, int64_t T, int64_t H, const D* h_in,
                D* h_out, const float* post_norm, float post_eps) {
  if (post_norm == nullptr) {
    Product::run(matrix, in, T, [&](int64_t t, int64_t n, float v) {
      put(h_out + t * H + n, get(h_in + t * H + n) + v);
    });
    return;
  }
  std::vector<float> y(static_cast<size_t>(T * H));
  Product::run(matrix, in, T, [&](int64_t t, int64_t n, float v) { y[t * H + n] = v; });
  for (int64_t t = 0; t < T; ++t) {
    float* row = y.data() + t * H;
    rms_norm(row, post_norm, H, post_eps, row);
    for (int64_t n = 0; n < H; ++n) put(h_out + t * H + n, get(h_in + t * H + n) + row[n]);
  }
}

template <typename D, typename Product>
void attention_block(const AttentionArgs& p) {
  const int64_t T = p.rows, H = p.hidden, hd = p.head_dim, nq = p.heads, nkv = p.kv_heads;
  const int64_t width = (nq + 2 * nkv) * hd, groups = nq / nkv;
  const D* h_in = static_cast<const D*>(p.hidden_in);
  std::vector<float> x(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t)
    rms_norm(h_in + t * H, p.norm, H, p.eps, x.data() + t * H);
  std::vector<float> qkv(static_cast<size_t>(T * width));
  Product::run(p.qkv, x.data(), T, [&](int64_t t, int64_t n, float v) { qkv[t * width + n] = v; });
  // RoPE, then every row's keys and values into its cache before any row attends.
  std::vector<int64_t> position(static_cast<size_t>(T)), segment(static_cast<size_t>(T));
  for (int64_t s = 0; s < p.num_segments; ++s)
    for (int64_t i = 0; i < p.segments[s].rows; ++i) {
      position[p.segments[s].first_row + i] = p.segments[s].first_position + i;
      segment[p.segments[s].first_row + i] = s;
    }
  for (int64_t t = 0; t < T; ++t) {
    float* row = qkv.data() + t * width;
    if (p.q_norm != nullptr)  // per-head q/k norms, before RoPE (Qwen3, Gemma 3)
      for (int64_t h = 0; h < nq + nkv; ++h)
        rms_norm(row + h * hd, h < nq ? p.q_norm : p.k_norm, hd, p.qk_eps, row + h * hd);
    for (int64_t h = 0; h < nq + nkv; ++h) rope(row + h * hd, p.cos + t * hd, p.sin + t * hd, hd);
    const Segment& seg = p.segments[segment[t]];
    D* keys = reinterpret_cast<D*>(seg.keys);
    D* values = reinterpret_cast<D*>(seg.values);
    for (int64_t h = 0; h < nkv; ++h) {
      const int64_t at = (h * seg.capacity + position[t]) * hd;
      for (int64_t d = 0; d < hd; ++d) {
        put(keys + at + d, row[(nq + h) * hd + d]);
        put(values + at + d, row[(nq + nkv + h) * hd + d]);
      }
    }
  }
  std::vector<float> ctx(static_cast<size_t>(T * nq * hd));
  at::parallel_for(0, T * nq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t t = u / nq, h = u % nq, kvh = h / groups;
      const Segment& seg = p.segments[segment[t]];
      // Keys lo .. position[t]: the window's, as transformers' sliding_window_causal.
      const int64_t lo = p.window > 0 && position[t] >= p.window ? position[t] - p.window + 1 : 0;
      const int64_t n = position[t] + 1 - lo;
      scores.resize(static_cast<size_t>(n));
      const int64_t base = (kvh * seg.capacity + lo) * hd;
      attend(qkv.data() + t * width + h * hd, reinterpret_cast<const D*>(seg.keys) + base,
             reinterpret_cast<const D*>(seg.values) + base, n, hd, p.scaling, scores.data(),
             ctx.data() + (t * nq + h) * hd);
    }
  });
  add_output<D, Product>(p.o, ctx.data(), T, H, h_in, static_cast<D*>(p.hidden_out),
                         p.post_norm, p.post_eps);
}

// y = act(g) * u for one row (g = gate [I], u = g + I). Both activations are g * sigmoid(a g'):
// SiLU = g / (1 + e^-g); GELU-tanh (PyTorch's approximate="tanh") = g (1 + tanh(s)) / 2 =
// g / (1 + e^-2s), s = sqrt(2/pi) (g + 0.044715 g^3).
inline void gated(const float* g, int64_t I, int64_t act, float* y) {
  const float* u = g + I;
  const float c = 0.7978845608028654f, k = 0.044715f;
  const __m256 one = _mm256_set1_ps(1.f), two_c = _mm256_set1_ps(-2.f * c),
               kv = _mm256_set1_ps(k);
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 arg = act == kGeluTanh
        ? _mm256_mul_ps(two_c, _mm256_fmadd_ps(_mm256_mul_ps(kv, gv), _mm256_mul_ps(gv, gv), gv))
        : _mm256_sub_ps(_mm256_setzero_ps(), gv);
    const __m256 e = exp8(arg);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)),
                                          _mm256_loadu_ps(u + i)));
  }
  for (; i < I; ++i) {
    const float arg = act == kGeluTanh ? -2.f * c * (k * g[i] * (g[i] * g[i]) + g[i]) : -g[i];
    y[i] = g[i] / (1.f + exp1(arg)) * u[i];
  }
}

template <typename D, typename Product>
void mlp_block(const MlpArgs& p) {
  const int64_t T = p.rows, H = p.hidden, I = p.intermediate;
  const D* h_in = static_cast<const D*>(p.hidden_in);
  std::vector<float> x(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t)
    rms_norm(h_in + t * H, p.norm, H, p.eps, x.data() + t * H);
  std::vector<float> gu(static_cast<size_t>(T * 2 * I));
  Product::run(p.gate_up, x.data(), T, [&](int64_t t, int64_t n, float v) { gu[t * 2 * I + n] = v; });
  std::vector<float> act(static_cast<size_t>(T * I));
  for (int64_t t = 0; t < T; ++t)
    gated(gu.data() + t * 2 * I, I, p.act, act.data() + t * I);
  add_output<D, Product>(p.down, act.data(), T, H, h_in, static_cast<D*>(p.hidden_out),
                         p.post_norm, p.post_eps);
}

// The entry points' bodies: hidden states and cache in bf16 (args.bf16) or fp32.
template <typename Product>
void attention(const AttentionArgs& args) {
  if (args.bf16) attention_block<uint16_t, Product>(args);
  else attention_block<float, Product>(args);
}

template <typename Product>
void mlp(const MlpArgs& args) {
  if (args.bf16) mlp_block<uint16_t, Product>(args);
  else mlp_block<float, Product>(args);
}

}  // namespace
