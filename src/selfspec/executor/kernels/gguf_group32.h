// Groups of 16 weight rows for the blocks of 32 inputs Q4_0, Q4_1 and Q8_0 (gguf_rows.cpp's
// AVX-512 builds; it includes this after its own helpers: fp16, u16, BlockQ8_0, BlockQ8_1).
//
// Why: row by row, every block of 32 inputs costs each (token, weight row) its own fp32
// scaling (a multiply-add per 32 products), so a call of M tokens cost about M one-token
// calls. Here the 16 rows sit in the 16 lanes of a vector: per token and block, vpdpbusd of
// the rows' codes with the token's 4 inputs broadcast (8 of them), then one vector of fp32
// steps for 16 rows; each decoded block serves every token of the call, so verification of a
// block of tokens costs little more than one.
//
// Scheme, per group of 16 weight rows, per chunk of up to kGroupTokens tokens, per block b
// (in order): the rows' codes as u8 (Q4_0 / Q4_1: the nibbles; Q8_0: q + 128), transposed so
// that lane n of vector r holds row n's codes of inputs 4r .. 4r + 3 (transpose16x4); then per
// token S = codes . inputs (exact int32), less kOffset * sum(inputs) (Q4_0: 8, Q8_0: 128),
// and acc = fma(S, d dx, acc) then, Q4_1, acc = fma(m, sx, acc) (sx: the Q8_1 block's s =
// dx * sum(inputs)), lane by lane.
//
// Row consistency: S is exact and the fp32 steps of a (token, row) are the same whatever M,
// the chunking, the group's other rows and the thread split, so a row is the same bits in any
// call; the AVX-512 and AMX builds share this path (the AVX2 build's rounding differs).

namespace group32 {

constexpr int kGroupTokens = 8;  // tokens a pass over a group (their sums in registers)

// Bytes in memory: a group's successor, for prefetching.
struct Span {
  const uint8_t* data;
  int64_t bytes;
};

// The activations of one call: the raw Q8_0 / Q8_1 rows and, per (token, block), dx, sx
// (Q8_1's s) and the exact sum of the 32 inputs.
struct Act {
  int64_t M = 0, nb = 0, stride = 0, qs = 0;  // stride: bytes a block; qs: codes' offset in it
  const uint8_t* raw = nullptr;
  std::vector<float> dx, sx;
  std::vector<int32_t> sum;
};

inline std::shared_ptr<Act> prepare(const uint8_t* act, int64_t M, int64_t K, bool q8_1) {
  auto a = std::make_shared<Act>();
  a->M = M;
  a->nb = K / 32;
  a->stride = q8_1 ? sizeof(BlockQ8_1) : sizeof(BlockQ8_0);
  a->qs = q8_1 ? 4 : 2;
  a->raw = act;
  const size_t n = static_cast<size_t>(M * a->nb);
  a->dx.resize(n);
  a->sx.resize(n);
  a->sum.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* blk = act + i * a->stride;
    a->dx[i] = fp16(u16(blk));
    a->sx[i] = q8_1 ? fp16(u16(blk + 2)) : 0.f;
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) s += static_cast<int8_t>(blk[a->qs + j]);
    a->sum[i] = s;
  }
  return a;
}

// z[r] int32 lane n = dword r of the 16 bytes at rows[n] + off (r < 4): four rows a zmm, then
// a 4 x 4 transpose of dwords in each 128-bit lane and one lane permutation.
inline void transpose16x4(const uint8_t* const* rows, int64_t off, __m512i z[4]) {
  __m512i x[4];
  for (int g = 0; g < 4; ++g) {
    __m512i v = _mm512_castsi128_si512(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * g] + off)));
    for (int j = 1; j < 4; ++j) {
      const __m128i row = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * g + j] + off));
      v = j == 1 ? _mm512_inserti32x4(v, row, 1)
          : j == 2 ? _mm512_inserti32x4(v, row, 2) : _mm512_inserti32x4(v, row, 3);
    }
    x[g] = v;  // 128-bit lane j: row 4g + j's dwords 0..3
  }
  const __m512i t0 = _mm512_unpacklo_epi32(x[0], x[1]), t1 = _mm512_unpackhi_epi32(x[0], x[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(x[2], x[3]), t3 = _mm512_unpackhi_epi32(x[2], x[3]);
  // u[r] 128-bit lane j, dword g: row 4g + j's dword r; lane n = 4g + j wanted at 4g + j
  const __m512i u[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                        _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int r = 0; r < 4; ++r) z[r] = _mm512_permutexvar_epi32(order, u[r]);
}

// lane n = the fp16 at rows[n] + off, as fp32.
inline __m512 heads_fp16(const uint8_t* const* rows, int64_t off) {
  alignas(32) uint16_t h[16];
  for (int n = 0; n < 16; ++n) h[n] = u16(rows[n] + off);
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h)));
}

// One block of 16 rows, decoded: codes[r] lane n = row n's u8 codes of inputs 4r .. 4r + 3.
struct Decoded {
  __m512i codes[8];
  __m512 d, m;
};

// Q4_0 (18 bytes: fp16 d, 16 bytes of nibbles; w = d (q - 8)), Q4_1 (20: fp16 d, m, nibbles;
// w = d q + m), Q8_0 (34: fp16 d, int8[32]; codes q + 128).
struct Q4_0 {
  static constexpr int64_t kBytes = 18, kOffset = 8;
  static constexpr bool kMin = false, kQ8_1 = false;
  static void decode(const uint8_t* const* rows, Decoded& w) { nibbles(rows, 2, w); }
  static void nibbles(const uint8_t* const* rows, int64_t off, Decoded& w) {
    __m512i z[4];
    transpose16x4(rows, off, z);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int r = 0; r < 4; ++r) {  // low nibbles: inputs 0..15, high: 16..31
      w.codes[r] = _mm512_and_si512(z[r], low4);
      w.codes[4 + r] = _mm512_and_si512(_mm512_srli_epi16(z[r], 4), low4);
    }
    w.d = heads_fp16(rows, 0);
  }
};
struct Q4_1 : Q4_0 {
  static constexpr int64_t kBytes = 20, kOffset = 0;
  static constexpr bool kMin = true, kQ8_1 = true;
  static void decode(const uint8_t* const* rows, Decoded& w) {
    nibbles(rows, 4, w);
    w.m = heads_fp16(rows, 2);
  }
};
struct Q8_0 {
  static constexpr int64_t kBytes = 34, kOffset = 128;
  static constexpr bool kMin = false, kQ8_1 = false;
  static void decode(const uint8_t* const* rows, Decoded& w) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // q + 128 as u8
    for (int h = 0; h < 2; ++h) {
      __m512i z[4];
      transpose16x4(rows, 2 + 16 * h, z);
      for (int r = 0; r < 4; ++r) w.codes[4 * h + r] = _mm512_xor_si512(z[r], flip);
    }
    w.d = heads_fp16(rows, 0);
  }
};

// Tokens m0 .. m0 + MT - 1 against weight rows wrows[0..15] (nb blocks of T each), every block
// in order, the accumulators in registers: acc[(m0 + t) * 16 + n].
template <class T, int MT>
void tokens(const uint8_t* const* wrows, const Act& a, int64_t m0, float* acc, Span next,
            bool first) {
  __m512 sum[MT];
  for (int t = 0; t < MT; ++t) sum[t] = _mm512_setzero_ps();
  const uint8_t* rows[16];
  Decoded w;
  const int64_t share = (next.bytes + a.nb - 1) / a.nb;
  for (int64_t b = 0; b < a.nb; ++b) {
    for (int n = 0; n < 16; ++n) rows[n] = wrows[n] + b * T::kBytes;
    if (first)  // the next group's bytes, in memory order, a share per block
      for (int64_t o = b * share; o < std::min(next.bytes, (b + 1) * share); o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next.data + o), _MM_HINT_T1);
    T::decode(rows, w);
    for (int t = 0; t < MT; ++t) {
      const int64_t i = (m0 + t) * a.nb + b;
      const uint8_t* x = a.raw + i * a.stride + a.qs;
      __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) {
        int32_t v;
        memcpy(&v, x + 4 * r, 4);
        s = _mm512_dpbusd_epi32(s, w.codes[r], _mm512_set1_epi32(v));
      }
      if constexpr (T::kOffset != 0)
        s = _mm512_sub_epi32(s, _mm512_set1_epi32(static_cast<int32_t>(T::kOffset) * a.sum[i]));
      sum[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(w.d, _mm512_set1_ps(a.dx[i])),
                               sum[t]);
      if constexpr (T::kMin) sum[t] = _mm512_fmadd_ps(w.m, _mm512_set1_ps(a.sx[i]), sum[t]);
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_storeu_ps(acc + (m0 + t) * 16, sum[t]);
}

// acc ([a.M, 16] fp32) = weight rows wrows[0..15] . every activation row.
template <class T>
void run(const uint8_t* const* wrows, const Act& a, float* acc, Span next) {
  for (int64_t m0 = 0; m0 < a.M; m0 += kGroupTokens) {
    const bool first = m0 == 0;
    switch (std::min<int64_t>(kGroupTokens, a.M - m0)) {
      case 8: tokens<T, 8>(wrows, a, m0, acc, next, first); break;
      case 7: tokens<T, 7>(wrows, a, m0, acc, next, first); break;
      case 6: tokens<T, 6>(wrows, a, m0, acc, next, first); break;
      case 5: tokens<T, 5>(wrows, a, m0, acc, next, first); break;
      case 4: tokens<T, 4>(wrows, a, m0, acc, next, first); break;
      case 3: tokens<T, 3>(wrows, a, m0, acc, next, first); break;
      case 2: tokens<T, 2>(wrows, a, m0, acc, next, first); break;
      default: tokens<T, 1>(wrows, a, m0, acc, next, first); break;
    }
  }
}

}  // namespace group32
