// Greedy decoding's argmax over a row of logits (selfspec.executor.argmax).
//
// Why: torch's CPU argmax over a Qwen2.5 row of logits costs several times its amax, a
// noticeable share of a small model's decoding step, paid once a token by every method and
// per verified position. This is one
// pass of 8-lane compares, single-threaded (the row is in cache after the lm_head product).
//
// Semantics are torch.argmax(dim=-1)'s: the first index of the largest value. A row holding
// a NaN (torch's answer is the NaN's index) is reported in `status` and left to torch.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "common.h"

namespace {

template <typename T>
inline float scalar(const T* p, int64_t i);
template <>
inline float scalar<float>(const float* p, int64_t i) { return p[i]; }
template <>
inline float scalar<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }

// The argmax of x[0 .. n-1], or -1 when x holds a NaN.
template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  float best = -INFINITY;
  int64_t index = -1;
  int64_t i = 0;
  if (n >= 32) {
    // Four independent lane sets over consecutive 8-blocks (a single set is bound by the
    // compare-blend latency chain).
    __m256 vmax[4];
    __m256i vidx[4], cur[4];
    for (int a = 0; a < 4; ++a) {
      vmax[a] = _mm256_set1_ps(-INFINITY);
      cur[a] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                _mm256_set1_epi32(8 * a));
      vidx[a] = cur[a];
    }
    const __m256i step = _mm256_set1_epi32(32);
    __m256 nan = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32) {
      for (int a = 0; a < 4; ++a) {
        const __m256 v = load8(x + i + 8 * a);
        const __m256 gt = _mm256_cmp_ps(v, vmax[a], _CMP_GT_OQ);  // strict: keeps the first
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vmax[a] = _mm256_blendv_ps(vmax[a], v, gt);
        vidx[a] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx[a]),
                                                       _mm256_castsi256_ps(cur[a]), gt));
        cur[a] = _mm256_add_epi32(cur[a], step);
      }
    }
    if (_mm256_movemask_ps(nan)) return -1;
    // Across the 32 lanes: the largest value, on a tie the smallest index (the first).
    for (int a = 0; a < 4; ++a) {
      float m[8];
      int32_t id[8];
      _mm256_storeu_ps(m, vmax[a]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(id), vidx[a]);
      for (int l = 0; l < 8; ++l) {
        if (index < 0 || m[l] > best || (m[l] == best && id[l] < index)) {
          best = m[l];
          index = id[l];
        }
      }
    }
  }
  for (; i < n; ++i) {  // the tail's indices follow every lane's: strict > keeps the first
    const float v = scalar(x, i);
    if (v != v) return -1;
    if (index < 0 || v > best) {
      best = v;
      index = i;
    }
  }
  return index;
}

}  // namespace

extern "C" {

// out[r] = argmax of row r of x ([rows] rows of n values, row_stride elements apart; bf16 if
// `bf16`, else fp32), -1 for a row holding a NaN; *status = the number of such rows.
void selfspec_argmax_rows(const void* x, int64_t rows, int64_t n, int64_t row_stride,
                          int64_t bf16, int64_t* out, int64_t* status) {
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = bf16 ? row_argmax(static_cast<const uint16_t*>(x) + r * row_stride, n)
                           : row_argmax(static_cast<const float*>(x) + r * row_stride, n);
    out[r] = i;
    bad += i < 0;
  }
  *status = bad;
}

}  // extern "C"
