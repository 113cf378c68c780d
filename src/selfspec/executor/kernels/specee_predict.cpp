// SpecEE's per-token work outside the layers, one call each (SpecEE §4;
// selfspec.decoding.specee.kernel).
//
// selfspec_specee_predict, per feature layer: from the bf16 state leaving the layer, the
// model's final RMSNorm, the optional head lens T (an exit head's transform, read as
// T · normed), the k candidates' logits and local softmax probabilities, their change against
// the previous feature layer (the 3k features), and, where a predictor runs, its MLP
// (3k [+ H state] -> hidden -> 1, the first layer's weights in bf16: half the bytes a call
// reads).
//
// selfspec_specee_candidates, per token: the feature drafter (selfspec.heads.drafter), the
// final norm, the draft vocabulary's lm_head rows and their top k.
//
// Both round where torch's path rounds (norms and bf16 products to bf16) and sum in fp32 in
// their own order, so they agree with the torch path to fp32 summation order.
//
// Why a kernel: in torch these are ~30 small operations per layer, each with far more dispatch
// and allocation than arithmetic; at 10-14 layers a token they were a noticeable share of
// verified SpecEE's time.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <vector>

#include "common.h"

namespace {

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return bf16_to_float(v); }

// Dot product of n weights (fp32 or bf16) with fp32 x, in a fixed order (two 8-lane
// accumulators, scalar tail).
template <typename W>
inline float dot(const W* w, const float* x, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(load8(w + i), load8(x + i), s0);
    s1 = _mm256_fmadd_ps(load8(w + i + 8), load8(x + i + 8), s1);
  }
  float s = hsum(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) s += to_float(w[i]) * x[i];
  return s;
}

inline float round_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

// HF's RMSNorm of x (fp32 values of bf16) with a bf16 weight (null: none): bf16 values out.
inline void rms_norm(const float* x, const uint16_t* weight, float eps, int64_t H, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float r = 1.f / sqrtf(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) {
    const float v = round_bf16(x[i] * r);
    out[i] = weight ? round_bf16(bf16_to_float(weight[i]) * v) : v;
  }
}

// out[n] = bf16(w_n . x (+ bias[n])) for n < N, w bf16 [N, K], in parallel over n.
inline void product_bf16(const uint16_t* w, const float* x, const float* bias, int64_t N,
                         int64_t K, float* out) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      out[n] = round_bf16(dot(w + n * K, x, K) + (bias ? bias[n] : 0.f));
  });
}

}  // namespace

extern "C" {

// One layer's inputs and outputs (SpecEEKernel's ctypes mirror in decoding/specee/kernel.py).
struct PredictArgs {
  const uint16_t* hidden;       // [H] bf16, the state leaving the layer (before the final norm)
  const uint16_t* norm_weight;  // [H] bf16, the final RMSNorm's weight
  float eps;
  int64_t H;
  const uint16_t* lens;         // [H, H] bf16 head transform T (out = T x), or null
  const uint16_t* rows;         // [k, H] bf16 candidate lm_head rows
  const float* bias;            // [k] lm_head bias of the candidates, or null
  int64_t k;
  const float* previous;        // [k] local probabilities at the previous feature layer, or null
  float* features;              // out [3k]: logits, probabilities, change
  // The predictor (fc1 null: features only).
  const uint16_t* fc1;          // [hidden, 3k + state_dim] bf16 (the MLP reads it from memory
                                // every call: half the bytes of fp32)
  const float* b1;              // [hidden]
  const float* w2;              // [hidden]
  float b2;
  const float* mean;            // [3k] feature standardisation (state-reading), or null
  const float* std;             // [3k]
  int64_t hidden_units;
  int64_t state_dim;            // 0 or H: the predictor also reads the normed state
  float state_scale;
  float* logit;                 // out: the predictor's pre-sigmoid output
};

int selfspec_specee_predict_version() { return 1; }

void selfspec_specee_predict(const PredictArgs* a) {
  const int64_t H = a->H, k = a->k;
  std::vector<float> buf(static_cast<size_t>(2 * H));
  float* normed = buf.data();
  float* read = normed + H;
  for (int64_t i = 0; i < H; ++i) read[i] = bf16_to_float(a->hidden[i]);
  rms_norm(read, a->norm_weight, a->eps, H, normed);
  const float* x = normed;
  if (a->lens) {  // T · normed, a bf16 product rounded to bf16
    product_bf16(a->lens, normed, nullptr, H, H, read);
    x = read;
  }
  float* f = a->features;
  float top = -INFINITY;
  for (int64_t j = 0; j < k; ++j) {
    float v = round_bf16(dot(a->rows + j * H, x, H));
    if (a->bias) v += a->bias[j];
    f[j] = v;
    top = fmaxf(top, v);
  }
  float total = 0.f;
  for (int64_t j = 0; j < k; ++j) total += (f[k + j] = expf(f[j] - top));
  for (int64_t j = 0; j < k; ++j) {
    f[k + j] /= total;
    f[2 * k + j] = a->previous ? f[k + j] - a->previous[j] : f[k + j];
  }
  if (!a->fc1) return;
  const int64_t nf = 3 * k, width = nf + a->state_dim;
  std::vector<float> in(static_cast<size_t>(width));
  for (int64_t j = 0; j < nf; ++j) in[j] = a->mean ? (f[j] - a->mean[j]) / a->std[j] : f[j];
  if (a->state_dim) {  // F.normalize(normed) * scale
    float n2 = 0.f;
    for (int64_t i = 0; i < H; ++i) n2 += normed[i] * normed[i];
    const float s = a->state_scale / fmaxf(sqrtf(n2), 1e-12f);
    for (int64_t i = 0; i < H; ++i) in[nf + i] = normed[i] * s;
  }
  std::vector<float> act(static_cast<size_t>(a->hidden_units));
  at::parallel_for(0, a->hidden_units, 32, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u)
      act[u] = fmaxf(dot(a->fc1 + u * width, in.data(), width) + a->b1[u], 0.f);
  });
  *a->logit = dot(act.data(), a->w2, a->hidden_units) + a->b2;
}

// The feature drafter's candidates for one token (CandidateKernel's ctypes mirror).
struct CandidateArgs {
  const uint16_t* previous;     // [H] bf16, the previous position's state
  const uint16_t* embedding;    // [H] bf16, the current token's embedding
  int64_t H;
  float drafter_eps;            // the drafter's weightless RMSNorm eps
  const uint16_t* fc;           // [H, 2H] bf16 drafter weight
  const float* fc_bias;         // [H] (fp32 values of the bf16 bias)
  const uint16_t* norm_weight;  // [H] bf16 final norm weight
  float eps;
  const uint16_t* rows;         // [R, H] bf16 draft-vocabulary lm_head rows
  const float* row_bias;        // [R] or null
  int64_t R;
  int64_t k;
  int64_t* top;                 // out [k]: indices into rows, highest logit first
};

void selfspec_specee_candidates(const CandidateArgs* a) {
  const int64_t H = a->H, R = a->R;
  std::vector<float> buf(static_cast<size_t>(5 * H + R));
  float *prev = buf.data(), *x = prev + H, *h = x + 2 * H, *normed = h + H, *logits = normed + H;
  for (int64_t i = 0; i < H; ++i) {
    prev[i] = bf16_to_float(a->previous[i]);
    h[i] = bf16_to_float(a->embedding[i]);
  }
  // previous + fc([rms(previous), rms(embedding)]) + bias, each step rounded to bf16
  rms_norm(prev, nullptr, a->drafter_eps, H, x);
  rms_norm(h, nullptr, a->drafter_eps, H, x + H);
  product_bf16(a->fc, x, a->fc_bias, H, 2 * H, h);
  for (int64_t i = 0; i < H; ++i) h[i] = round_bf16(prev[i] + h[i]);
  rms_norm(h, a->norm_weight, a->eps, H, normed);
  product_bf16(a->rows, normed, a->row_bias, R, H, logits);
  // top k, the lower index first among equal logits (one pass, insertion into k slots)
  const int64_t k = a->k;
  std::vector<float> val(static_cast<size_t>(k), -INFINITY);
  for (int64_t j = 0; j < k; ++j) a->top[j] = -1;
  for (int64_t r = 0; r < R; ++r) {
    const float v = logits[r];
    if (a->top[k - 1] >= 0 && !(v > val[k - 1])) continue;
    int64_t p = k - 1;
    while (p > 0 && (a->top[p - 1] < 0 || v > val[p - 1])) {
      val[p] = val[p - 1];
      a->top[p] = a->top[p - 1];
      --p;
    }
    val[p] = v;
    a->top[p] = r;
  }
}

}  // extern "C"
