// Row-consistent products on a GGUF file's own quantized blocks (llama.cpp's formats), for x86
// CPUs with AVX2 + FMA + F16C or with AVX-512 (F/BW/VL) + VNNI: the same source built twice.
//
// Scheme (llama.cpp's vec_dot pairs): each weight type is multiplied with activations quantized
// per call to the format llama.cpp pairs it with, Q8_0 (blocks of 32: fp16 d, int8[32]) for
// Q4_0/Q5_0/Q8_0, Q8_1 (fp16 d, fp16 s = d * sum, int8[32]) for Q4_1/Q5_1, and Q8_K (blocks of
// 256: fp32 d, int8[256], int16 bsums[16]) for Q4_K/Q5_K/Q6_K; quantization rounds exactly as
// llama.cpp's quantize_row_q8_0_ref / q8_1_ref / q8_K_ref (the references, not its SIMD
// quantizers, which round differently). F32/F16/BF16 weight rows take fp32 activations (FMA).
// Within a block (or K-quant sub-block) the dot product is an integer one, exact: vpmaddubsw +
// vpmaddwd on AVX2 (32 inputs a ymm), vpdpbusd / vpdpwssd on AVX-512 VNNI (64 inputs a zmm;
// blocks of 32 in pairs). Each block's integer sum is scaled in fp32 into 8 (AVX2) or 16
// (AVX-512) fp32 lanes per (row, output), summed once at the end.
//
// Why: a model stored as GGUF can then decode on the bytes of its file (no re-quantization into
// selfspec's own w4a8 blocks, no bf16 copy), at the cost of reading them.
//
// Row consistency (the point of this kernel against llama.cpp's): out[t, n] is computed by the
// same instruction sequence whatever the number of rows M of the call and whatever the other
// rows are: rows are processed in tiles of up to kTile rows, each decoded weight block being
// used for every row of the tile, but each (t, n) has its own accumulators and the same
// per-block order; the tile size only changes how many accumulators are live. Built with
// -ffp-contract=off so that the compiler cannot fuse scalar multiply-adds differently in
// differently unrolled tiles. The two builds may differ from each other in the last bits; each
// is row-consistent. Threads split the weight rows, which leaves every (t, n) unchanged.
//
// Layouts: weights [N, row_bytes] as stored in the GGUF (row n = K / block_size blocks of the
// type's struct, ggml-common.h); activations [M, K / 32 or K / 256 blocks] of ggml's structs
// (BlockQ8_0/Q8_1/Q8_K below; both builds repack blocks of 32 per call: Act32, Q8Pair, QuadAct);
// outputs written at out + t * ldo + n (fp32 or bf16), so a caller fills column slices of one
// wider output.
//
// Fused sub-layers (fused_layers.h, selfspec_gguf_attention / selfspec_gguf_mlp): GgufProduct
// runs a whole matrix (SelfspecGgufMatrix) on fp32 rows, quantized once per activation format.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "common.h"
#include "fused_layers.h"
#ifdef SELFSPEC_GGUF_AMX
#include "amx.h"  // at file scope: gguf_amx.h is included inside a namespace
#endif

namespace {

// ggml's type ids (ggml.h enum ggml_type), used for weight types and activation formats.
enum : int64_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ8_1 = 9,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kQ8_K = 15, kBF16 = 30,
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define SELFSPEC_GGUF_VNNI 1
#endif

// Activation rows per pass over a weight row. Decoding a block costs about as much as one row's
// dot product, so the more rows share it the better, until accumulators spill: 8 rows cost
// 10-15% less than two tiles of 4 with AVX2's 16 registers too (decoded blocks spill to L1,
// which reloads cheaply), measured on K-quants.
constexpr int kTile = 8;

// Bytes ahead along the weights that each step prefetches (the hardware prefetcher alone leaves
// some bandwidth on one-token products; 1024 or 4096 bytes do about as well).
constexpr int64_t kPrefetch = 2048;

struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };
struct BlockQ8_1 { uint16_t d, s; int8_t qs[32]; };
struct BlockQ8_K { float d; int8_t qs[256]; int16_t bsums[16]; };
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ8_1) == 36 && sizeof(BlockQ8_K) == 292,
              "activation blocks must match ggml's");

inline float fp16(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t to_fp16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
inline uint16_t u16(const uint8_t* p) { uint16_t v; memcpy(&v, p, 2); return v; }
inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Sum of u8 x s8 products over each 4 bytes into 8 int32 lanes (the AVX2 build's blocks of
// 32). No saturation: every use has |u| <= 128 and |s| <= 127, so vpmaddubsw's pair sums stay
// within int16.
inline __m256i dot_us(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// acc + the int16 pair products of a and b summed per int32 lane (256-bit paths).
inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}

// Byte j = 0x10 where bit j of bits is set (Q5_0/Q5_1's fifth bits), else 0.
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                         0x0303030303030303));
  // byte j of a lane: all ones but bit j % 8, so the OR is all ones iff that bit is set
  const __m256i set = _mm256_cmpeq_epi8(
      _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi8(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// 16 bytes of nibbles -> 32 bytes: byte j's low nibble at j, its high one at j + 16 (the
// order of Q4_0/Q4_1/Q5_0/Q5_1's 32 inputs).
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
}

// ---------------------------------------------------------------------------------------------
// Weight types. Each has Act (the activation step), Acc (its accumulator), kBlock (inputs of a
// GGUF block), kBytes (its bytes), kUnit (blocks a step), Decoded, decode(blocks, Decoded&,
// count) once per step of a weight row (count: its blocks, fewer than kUnit at a row's end) and
// dot(Decoded, Act, acc, extra) per activation row: acc and extra (a scalar, for the AVX2
// Q4_1/Q5_1's minimum term) accumulate the step's contribution.

#ifndef SELFSPEC_GGUF_VNNI  // AVX2: a block of 32 a step

// The activations repacked once per call (repack_blocks) with their scales in fp32, so that no
// (row, output, block) converts them again.
struct Act32 {
  int8_t qs[32];
  float d, s;  // s: Q8_1's d * sum (0 from Q8_0)
};

template <class Src>
void repack_blocks(const uint8_t* act, int64_t M, int64_t nblocks, Act32* out) {
  const Src* x = reinterpret_cast<const Src*>(act);
  for (int64_t i = 0; i < M * nblocks; ++i) {
    memcpy(out[i].qs, x[i].qs, 32);
    out[i].d = fp16(x[i].d);
    if constexpr (std::is_same<Src, BlockQ8_1>::value) out[i].s = fp16(x[i].s);
    else out[i].s = 0.f;
  }
}

// Blocks of 32 with signed codes (Q4_0, Q5_0, Q8_0): codes as int8, |code| as u8, one scale.
struct Signed32 {
  __m256i q, aq;
  float d;
};

inline void dot_signed32(const Signed32& w, const Act32& x, __m256& acc, float&) {
  // vpmaddubsw multiplies unsigned by signed: |w| by x carrying w's sign.
  const __m256i p = dot_us(w.aq, _mm256_sign_epi8(load32(x.qs), w.q));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(w.d * x.d), acc);
}

struct TypeQ4_0 {
  using Src = BlockQ8_0;
  using Act = Act32;
  static constexpr bool kRepack = true;
  static void repack(const uint8_t* act, int64_t M, int64_t nblocks, Act* out) {
    repack_blocks<Src>(act, M, nblocks, out);
  }
  using Acc = __m256;
  using Decoded = Signed32;
  static constexpr int64_t kUnit = 1, kBlock = 32, kBytes = 18;
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    w.d = fp16(u16(b));
    w.q = _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8));
    w.aq = _mm256_abs_epi8(w.q);
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float& e) {
    dot_signed32(w, x, acc, e);
  }
};

struct TypeQ5_0 {
  using Src = BlockQ8_0;
  using Act = Act32;
  static constexpr bool kRepack = true;
  static void repack(const uint8_t* act, int64_t M, int64_t nblocks, Act* out) {
    repack_blocks<Src>(act, M, nblocks, out);
  }
  using Acc = __m256;
  using Decoded = Signed32;
  static constexpr int64_t kUnit = 1, kBlock = 32, kBytes = 22;
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    w.d = fp16(u16(b));
    w.q = _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), fifth_bits(qh)),
                          _mm256_set1_epi8(16));
    w.aq = _mm256_abs_epi8(w.q);
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float& e) {
    dot_signed32(w, x, acc, e);
  }
};

struct TypeQ8_0 {
  using Src = BlockQ8_0;
  using Act = Act32;
  static constexpr bool kRepack = true;
  static void repack(const uint8_t* act, int64_t M, int64_t nblocks, Act* out) {
    repack_blocks<Src>(act, M, nblocks, out);
  }
  using Acc = __m256;
  using Decoded = Signed32;
  static constexpr int64_t kUnit = 1, kBlock = 32, kBytes = 34;
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    w.d = fp16(u16(b));
    w.q = load32(b + 2);
    w.aq = _mm256_abs_epi8(w.q);  // -128 becomes 0x80, read as 128 by the unsigned side
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float& e) {
    dot_signed32(w, x, acc, e);
  }
};

// Blocks of 32 with unsigned codes and a minimum (Q4_1, Q5_1): w = q d + m, so
// w . x = d dx sum q a + m (dx sum a), the last factor being Q8_1's s.
struct Unsigned32 {
  __m256i q;
  float d, m;
};

inline void dot_unsigned32(const Unsigned32& w, const Act32& x, __m256& acc, float& extra) {
  const __m256i p = dot_us(w.q, load32(x.qs));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(w.d * x.d), acc);
  extra += w.m * x.s;
}

struct TypeQ4_1 {
  using Src = BlockQ8_1;
  using Act = Act32;
  static constexpr bool kRepack = true;
  static void repack(const uint8_t* act, int64_t M, int64_t nblocks, Act* out) {
    repack_blocks<Src>(act, M, nblocks, out);
  }
  using Acc = __m256;
  using Decoded = Unsigned32;
  static constexpr int64_t kUnit = 1, kBlock = 32, kBytes = 20;
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    w.d = fp16(u16(b));
    w.m = fp16(u16(b + 2));
    w.q = nibbles32(b + 4);
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float& e) {
    dot_unsigned32(w, x, acc, e);
  }
};

struct TypeQ5_1 {
  using Src = BlockQ8_1;
  using Act = Act32;
  static constexpr bool kRepack = true;
  static void repack(const uint8_t* act, int64_t M, int64_t nblocks, Act* out) {
    repack_blocks<Src>(act, M, nblocks, out);
  }
  using Acc = __m256;
  using Decoded = Unsigned32;
  static constexpr int64_t kUnit = 1, kBlock = 32, kBytes = 24;
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    w.d = fp16(u16(b));
    w.m = fp16(u16(b + 2));
    w.q = _mm256_or_si256(nibbles32(b + 8), fifth_bits(qh));
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float& e) {
    dot_unsigned32(w, x, acc, e);
  }
};

#else  // SELFSPEC_GGUF_VNNI: blocks of 32 two (Q8_0) or four (4- and 5-bit codes) a step

// The activations are repacked once per call (Q8Pair, QuadAct): codes in the order of the
// decoded weights, so that int32 lane i of a product belongs to one block and the blocks' fp32
// scales, stored beside, broadcast straight from memory onto the lanes. vpdpbusd multiplies
// unsigned by signed bytes: Q4_1/Q5_1's codes are unsigned and meet the signed activations as
// they are; Q4_0/Q5_0/Q8_0's weights w are signed, so their activations are stored as u8
// a + 128 and the accumulator starts at -128 sum w per lane (computed when the weights are
// decoded): sum (a + 128) w - 128 sum w = sum a w exactly. Blocks missing at a row's end are
// zero (codes, scales and sums).

// Q8_0: two blocks a step, their 4-byte chunks interleaved (chunk g of block c at bytes
// 8g + 4c: lane i belongs to block i & 1, and [dx0, dx1] broadcast as one 64-bit value).
struct Q8Pair {
  uint8_t qs[64];
  float d[2];
};

inline __m512i interleave_pair(__m256i first, __m256i second) {
  // int32 lane i <- lane i / 2 of first (i even) or of second (i odd)
  const __m512i idx = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  return _mm512_permutexvar_epi32(
      idx, _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1));
}

struct TypeQ8_0 {
  using Act = Q8Pair;
  using Acc = __m512;
  static constexpr bool kRepack = true;
  static constexpr int64_t kBlock = 32, kBytes = 34, kUnit = 2;
  static void repack(const uint8_t* act, int64_t M, int64_t nblocks, Act* out) {
    const int64_t steps = (nblocks + 1) / 2;
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t t = 0; t < M; ++t) {
      const BlockQ8_0* x = reinterpret_cast<const BlockQ8_0*>(act) + t * nblocks;
      for (int64_t u = 0; u < steps; ++u) {
        const bool lone = 2 * u + 1 == nblocks;
        Q8Pair& p = out[t * steps + u];
        const __m256i second = lone ? _mm256_setzero_si256() : load32(x[2 * u + 1].qs);
        _mm512_storeu_si512(p.qs,
                            _mm512_xor_si512(interleave_pair(load32(x[2 * u].qs), second), flip));
        p.d[0] = fp16(x[2 * u].d);
        p.d[1] = lone ? 0.f : fp16(x[2 * u + 1].d);
      }
    }
  }
  struct Decoded {
    __m512i w, start;
    __m512 d;
  };
  static void decode(const uint8_t* b, Decoded& w, int64_t count) {
    const bool lone = count < 2;
    w.w = interleave_pair(load32(b + 2), lone ? _mm256_setzero_si256() : load32(b + kBytes + 2));
    w.start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(
        _mm512_setzero_si512(), _mm512_set1_epi8(static_cast<char>(0x80)), w.w));
    const uint32_t both = u16(b) | (lone ? 0u : uint32_t(u16(b + kBytes)) << 16);
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int32_t>(both)));
    w.d = _mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_castps_pd(d)));  // [d0, d1] per 64 bits
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float&) {
    const __m512i p = _mm512_dpbusd_epi32(w.start, _mm512_loadu_si512(x.qs), w.w);
    double d;
    memcpy(&d, x.d, 8);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),
                          _mm512_mul_ps(w.d, _mm512_castpd_ps(_mm512_set1_pd(d))), acc);
  }
};

// Q4_0, Q4_1, Q5_0, Q5_1: four blocks a step, 128 inputs in two zmm. Block c's 16 code bytes
// load into 128-bit quarter c; their low nibbles are its codes 0-15, the high ones 16-31; one
// vpermd each transposes the 4 x 4 int32 chunks so that lane 4g + c holds chunk g of block c.
// The activations are repacked alike (QuadAct), and their per-block scales broadcast as one
// 128-bit [dx0, dx1, dx2, dx3] scale all lanes. The blocks' fp16 scales (and minima) come out
// of one or two 64-byte loads with one vpermt2w. Taken in pairs instead, these types' one-token
// products were bound by decoding, not by memory.
struct QuadAct {
  uint8_t lo[64];  // codes 0-15 of the 4 blocks: int32 lane 4g + c = codes 4g .. 4g + 3 of block c
  uint8_t hi[64];  // codes 16-31 alike
  float d[4];
  float s[4];      // Q8_1's s (0 from Q8_0)
};

template <class Src>
void repack_quads(const uint8_t* act, int64_t M, int64_t nblocks, QuadAct* out) {
  constexpr bool kQ8_1 = std::is_same<Src, BlockQ8_1>::value;
  const uint8_t flip = kQ8_1 ? 0 : 0x80;  // a + 128 against signed weights (see above)
  const int64_t steps = (nblocks + 3) / 4;
  for (int64_t t = 0; t < M; ++t) {
    const Src* x = reinterpret_cast<const Src*>(act) + t * nblocks;
    for (int64_t u = 0; u < steps; ++u) {
      QuadAct& q = out[t * steps + u];
      for (int c = 0; c < 4; ++c) {
        const int64_t i = 4 * u + c;
        const bool here = i < nblocks;
        for (int g = 0; g < 4; ++g)
          for (int j = 0; j < 4; ++j) {
            q.lo[16 * g + 4 * c + j] = (here ? static_cast<uint8_t>(x[i].qs[4 * g + j]) : 0) ^ flip;
            q.hi[16 * g + 4 * c + j] =
                (here ? static_cast<uint8_t>(x[i].qs[16 + 4 * g + j]) : 0) ^ flip;
          }
        q.d[c] = here ? fp16(x[i].d) : 0.f;
        if constexpr (kQ8_1) q.s[c] = here ? fp16(x[i].s) : 0.f;
        else q.s[c] = 0.f;
      }
    }
  }
}

// Base: Src, kBytes, kQs (offset of the 16 code bytes), kQh (of the fifth bits; 0: none),
// kOffset (w = code - kOffset) or kMin (w = d q + m, m after d).
template <class Base>
struct Quad32 {
  using Src = typename Base::Src;
  using Act = QuadAct;
  static constexpr bool kRepack = true;
  static void repack(const uint8_t* act, int64_t M, int64_t nblocks, Act* out) {
    repack_quads<Src>(act, M, nblocks, out);
  }
  using Acc = __m512;
  static constexpr int64_t kBlock = 32, kBytes = Base::kBytes, kUnit = 4;
  struct Decoded {
    __m512i lo, hi, start;
    __m512 d, m;
  };
  static void decode(const uint8_t* b, Decoded& w, int64_t count) {
    __m512i raw = _mm512_castsi128_si512(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + Base::kQs)));
    if (count > 1) raw = _mm512_inserti32x4(raw, _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(b + kBytes + Base::kQs)), 1);
    if (count > 2) raw = _mm512_inserti32x4(raw, _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(b + 2 * kBytes + Base::kQs)), 2);
    if (count > 3) raw = _mm512_inserti32x4(raw, _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(b + 3 * kBytes + Base::kQs)), 3);
    const __m512i nib = _mm512_set1_epi8(0x0f);
    __m512i lo = _mm512_and_si512(raw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
    if constexpr (Base::kQh != 0) {  // bit j of block c's qh: code j's fifth bit
      uint64_t bits_lo = 0, bits_hi = 0;
      for (int c = 0; c < 4; ++c) {
        uint32_t qh = 0;
        if (c < count) memcpy(&qh, b + c * kBytes + Base::kQh, 4);
        bits_lo |= uint64_t(qh & 0xffff) << (16 * c);
        bits_hi |= uint64_t(qh >> 16) << (16 * c);
      }
      const __m512i bit = _mm512_set1_epi8(0x10);
      lo = _mm512_mask_or_epi32(lo, 0xffff, lo, _mm512_maskz_mov_epi8(bits_lo, bit));
      hi = _mm512_mask_or_epi32(hi, 0xffff, hi, _mm512_maskz_mov_epi8(bits_hi, bit));
    }
    const __m512i transpose =
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    lo = _mm512_permutexvar_epi32(transpose, lo);
    hi = _mm512_permutexvar_epi32(transpose, hi);
    // fp16 d (and m) of the 4 blocks: int16 lanes [d0, m0, d1, m1, ...] from the step's bytes
    // (masked loads: nothing read past the last block)
    const int64_t n = count * kBytes;
    const __m512i first = _mm512_maskz_loadu_epi8(n >= 64 ? ~0ull : (1ull << n) - 1, b);
    const __m512i second = n > 64 ? _mm512_maskz_loadu_epi8((1ull << (n - 64)) - 1, b + 64)
                                  : _mm512_setzero_si512();
    constexpr int16_t h = kBytes / 2;  // int16s a block
    const __m512i pick = _mm512_setr_epi32(
        (1 << 16) * Base::kMin, h | ((h + 1) << 16) * Base::kMin,
        2 * h | ((2 * h + 1) << 16) * Base::kMin, 3 * h | ((3 * h + 1) << 16) * Base::kMin,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i halves = _mm512_permutex2var_epi16(first, pick, second);
    const __m512 dm = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm512_castsi512_si128(halves)));
    w.d = _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6), dm);
    if constexpr (Base::kMin) {
      w.lo = lo;
      w.hi = hi;
      w.start = _mm512_setzero_si512();
      w.m = _mm512_maskz_permutexvar_ps(0x000f, _mm512_setr_epi32(1, 3, 5, 7, 0, 0, 0, 0, 0, 0,
                                                                  0, 0, 0, 0, 0, 0), dm);
    } else {
      const __m512i off = _mm512_set1_epi8(Base::kOffset);
      w.lo = _mm512_sub_epi8(lo, off);
      w.hi = _mm512_sub_epi8(hi, off);
      const __m512i top = _mm512_set1_epi8(static_cast<char>(0x80));
      w.start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(
          _mm512_dpbusd_epi32(_mm512_setzero_si512(), top, w.lo), top, w.hi));
    }
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float&) {
    const __m512i xl = _mm512_loadu_si512(x.lo), xh = _mm512_loadu_si512(x.hi);
    const __m512i p = Base::kMin
        ? _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(w.start, w.lo, xl), w.hi, xh)
        : _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(w.start, xl, w.lo), xh, w.hi);
    const __m512 dx = _mm512_broadcast_f32x4(_mm_loadu_ps(x.d));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(w.d, dx), acc);
    if constexpr (Base::kMin)
      acc = _mm512_fmadd_ps(w.m, _mm512_broadcast_f32x4(_mm_loadu_ps(x.s)), acc);
  }
};

struct QuadQ4_0 {
  using Src = BlockQ8_0;
  static constexpr int64_t kBytes = 18, kQs = 2, kQh = 0;
  static constexpr int kOffset = 8, kMin = 0;
};
struct QuadQ5_0 {
  using Src = BlockQ8_0;
  static constexpr int64_t kBytes = 22, kQs = 6, kQh = 2;
  static constexpr int kOffset = 16, kMin = 0;
};
struct QuadQ4_1 {
  using Src = BlockQ8_1;
  static constexpr int64_t kBytes = 20, kQs = 4, kQh = 0;
  static constexpr int kOffset = 0, kMin = 1;
};
struct QuadQ5_1 {
  using Src = BlockQ8_1;
  static constexpr int64_t kBytes = 24, kQs = 8, kQh = 4;
  static constexpr int kOffset = 0, kMin = 1;
};

using TypeQ4_0 = Quad32<QuadQ4_0>;
using TypeQ5_0 = Quad32<QuadQ5_0>;
using TypeQ4_1 = Quad32<QuadQ4_1>;
using TypeQ5_1 = Quad32<QuadQ5_1>;
#endif

// Q4_K / Q5_K: 256 inputs in 8 sub-blocks of 32, each a 6-bit scale and minimum (packed in 12
// bytes), fp16 d and dmin: w = d sc q - dmin m. Codes: 32 bytes per 64 inputs, low nibbles for
// the first 32, high for the next (Q5_K: bit 2j / 2j+1 of qh[l] is input 64j + l's / 64j + 32 +
// l's fifth bit). Per block, integer sums sum_j sc_j (q_j . a_j) and sum_j m_j (bsum_2j +
// bsum_2j+1) (Q8_K's bsums are per 16), each scaled once. The AVX-512 build takes 64 inputs
// (two sub-blocks) a vector, halving the instructions per activation row.

// The 12 bytes of scales and minima as 16 bytes sc[0..7], m[0..7]: for j < 4, sc_j and m_j
// are the low 6 bits of bytes j and j + 4; sc_j+4 and m_j+4 take their low 4 bits from byte
// j + 8's low and high nibbles and their top 2 from bits 6-7 of bytes j and j + 4 (ggml's
// get_scale_min_k4), in a few byte shuffles (16 bytes read: the block's codes follow).
inline __m128i k_scales(const uint8_t* s) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  // a: bytes [0..3, 8..11, 4..7, 8..11]; b: [-, 0..3, -, 4..7] (-: zero)
  const __m128i a =
      _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i b =
      _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i low = _mm_and_si128(
      a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
  // 16-bit shifts: the masks keep each byte's own bits
  const __m128i high_nibbles = _mm_and_si128(
      _mm_srli_epi16(a, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
  const __m128i top =
      _mm_srli_epi16(_mm_and_si128(b, _mm_set1_epi8(static_cast<char>(0xc0))), 2);
  return _mm_or_si128(_mm_or_si128(low, high_nibbles), top);
}

// int16 [m0, m0, m1, m1, ..., m7, m7]: against the 16 bsums, vpmaddwd gives m_j (bsum_2j +
// bsum_2j+1) in int32 lane j.
inline __m256i k_mins(__m128i scales) {
  return _mm256_cvtepu8_epi16(_mm_shuffle_epi8(
      scales, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
}

#ifdef SELFSPEC_GGUF_VNNI
// 64 inputs a zmm. Per activation row the 512-bit integer multiplies (port 0 only on Intel)
// set a tile's cost: vpdpbusd gives the sums of 4 code x input products (|sum| <= 4 * 63 * 127
// < 2^15 for 6-bit codes), two such vectors pack to int16 (vpackssdw, port 5, exact) and one
// vpdpwssd applies the sub-blocks' scales: 3 multiplies per 128 inputs where vpmaddubsw +
// vpdpwssd take 4 (measured as fast, not faster: the zeroed accumulators cost moves).
// vpackssdw interleaves its sources per 128-bit lane L: int16 8L .. 8L + 3 from the first,
// 8L + 4 .. 8L + 7 from the second; the scale vectors follow.

// The mins term (8 int32 sums) in a 256-bit accumulator beside the 512-bit one.
struct AccK {
  __m512 a;
  __m256 m;
};
inline float sum_acc(AccK a) { return _mm512_reduce_add_ps(a.a) + hsum(a.m); }  // fixed order

// Scale vector for a packed pair: int16 lane 8L + i (L < 4, i < 8) takes src's int16 lane
// first[L] (i < 4) or second[L] (i >= 4).
inline __m512i pair_scales(__m512i src, const int (&first)[4], const int (&second)[4]) {
  int16_t idx[32];
  for (int lane = 0; lane < 4; ++lane)
    for (int i = 0; i < 8; ++i)
      idx[8 * lane + i] = static_cast<int16_t>(i < 4 ? first[lane] : second[lane]);
  return _mm512_permutexvar_epi16(_mm512_loadu_si512(idx), src);
}

inline __m512i dpbusd0(__m512i u, __m512i s) {
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
}

struct KQuant32 {
  __m512i q[4];   // inputs 64j .. 64j + 63 (u8): sub-block 2j in 128-bit lanes 0-1, 2j + 1 in 2-3
  __m512i sc[2];  // pack(P_2k, P_2k+1)'s: lanes 0-1 [sc_4k, sc_4k+2], 2-3 [sc_4k+1, sc_4k+3]
  __m256i mins;
  float d, dmin;
};

inline void k_decode_scales(const uint8_t* s, KQuant32& w) {
  const __m128i scales = k_scales(s);
  const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(scales));
  w.sc[0] = pair_scales(sc16, {0, 0, 1, 1}, {2, 2, 3, 3});
  w.sc[1] = pair_scales(sc16, {4, 4, 5, 5}, {6, 6, 7, 7});
  w.mins = k_mins(scales);
}

// 32 bytes of nibbles -> 64 u8: the low nibbles (inputs 0-31), then the high ones (32-63).
inline __m512i k_nibbles(const uint8_t* p) {
  const __m512i both = _mm512_broadcast_i64x4(load32(p));
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  return _mm512_and_si512(_mm512_srlv_epi16(both, shift), _mm512_set1_epi8(0x0f));
}

// sum_j sc_j (q_j . a_j) of one block, exact, spread over 16 int32 lanes.
inline __m512i kquant32_isum(const KQuant32& w, const BlockQ8_K& x) {
  __m512i isum = _mm512_setzero_si512();
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {
    const __m512i p0 = dpbusd0(w.q[2 * k], _mm512_loadu_si512(x.qs + 128 * k));
    const __m512i p1 = dpbusd0(w.q[2 * k + 1], _mm512_loadu_si512(x.qs + 128 * k + 64));
    isum = _mm512_dpwssd_epi32(isum, _mm512_packs_epi32(p0, p1), w.sc[k]);
  }
  return isum;
}

inline void dot_kquant32(const KQuant32& w, const BlockQ8_K& x, AccK& acc) {
  const __m512i isum = kquant32_isum(w, x);
  const __m256i msum = _mm256_madd_epi16(w.mins, _mm256_loadu_si256(
                                                     reinterpret_cast<const __m256i*>(x.bsums)));
  acc.a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(w.d * x.d), acc.a);
  acc.m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(-(w.dmin * x.d)), acc.m);
}

struct TypeQ4_K {
  using Act = BlockQ8_K;
  static constexpr bool kRepack = false;
  using Acc = AccK;
  using Decoded = KQuant32;
  static constexpr int64_t kUnit = 1, kBlock = 256, kBytes = 144;
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    w.d = fp16(u16(b));
    w.dmin = fp16(u16(b + 2));
    k_decode_scales(b + 4, w);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) w.q[j] = k_nibbles(b + 16 + 32 * j);
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float&) { dot_kquant32(w, x, acc); }
  static __m512i isum(const Decoded& w, const Act& x) { return kquant32_isum(w, x); }
};

struct TypeQ5_K {
  using Act = BlockQ8_K;
  static constexpr bool kRepack = false;
  using Acc = AccK;
  using Decoded = KQuant32;
  static constexpr int64_t kUnit = 1, kBlock = 256, kBytes = 176;
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    w.d = fp16(u16(b));
    w.dmin = fp16(u16(b + 2));
    k_decode_scales(b + 4, w);
    // qh in both halves, shifted so that bit 2j (low half) or 2j + 1 (high half) of each byte
    // lands on bit 4; 16-bit shifts keep a byte's own bits there (shifts of at most 4).
    const __m512i qh = _mm512_broadcast_i64x4(load32(b + 16));
    const __m512i bit4 = _mm512_set1_epi8(0x10);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i high =
          j < 2 ? _mm512_sllv_epi16(qh, _mm512_inserti64x4(_mm512_set1_epi16(4 - 2 * j),
                                                           _mm256_set1_epi16(3 - 2 * j), 1))
                : _mm512_srlv_epi16(qh, _mm512_inserti64x4(_mm512_set1_epi16(2 * j - 4),
                                                           _mm256_set1_epi16(2 * j - 3), 1));
      w.q[j] = _mm512_or_si512(k_nibbles(b + 48 + 32 * j), _mm512_and_si512(high, bit4));
    }
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float&) { dot_kquant32(w, x, acc); }
  static __m512i isum(const Decoded& w, const Act& x) { return kquant32_isum(w, x); }
};

// Q6_K: 256 inputs in 16 sub-blocks of 16, int8 scales, fp16 d; 6-bit codes u = q + 32 (4 low
// bits in ql, 2 high in qh). Per 128 inputs (ql 64 bytes, qh 32): input l + 32 k (l < 32) has
// ql[l + 32 (k & 1)]'s low (k < 2) or high nibble and qh[l]'s bits 2k, 2k + 1. Sub-block i of
// 16 inputs has scale sc[i]. w . a = d dx (sum_i sc_i (u_i . a_i) - 32 sum_i sc_i bsum_i).
struct TypeQ6_K {
  using Act = BlockQ8_K;
  static constexpr bool kRepack = false;
  using Acc = __m512;
  static constexpr int64_t kUnit = 1, kBlock = 256, kBytes = 210;
  struct Decoded {
    __m512i u[4];      // inputs 64p .. 64p + 63 (u8, 0..63): sub-block 4p + L in 128-bit lane L
    __m512i sc[2];     // pack(P_2k, P_2k+1)'s scales: lane L [sc_8k+L, sc_8k+4+L]
    __m256i sc_all;    // int16 sc[0..15]
    float d;
  };
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    w.d = fp16(u16(b + 208));
    w.sc_all = _mm256_cvtepi8_epi16(sc8);
    const __m512i low = _mm512_set1_epi8(0x0f), two = _mm512_set1_epi8(0x03);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(b + 64 * h);            // inputs 0-31 | 32-63
      const __m512i qh = _mm512_broadcast_i64x4(load32(b + 128 + 32 * h));
      const __m512i s01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
      const __m512i s23 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
      w.u[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low), _mm512_slli_epi16(
          _mm512_and_si512(_mm512_srlv_epi16(qh, s01), two), 4));
      w.u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low),
                                       _mm512_slli_epi16(_mm512_and_si512(
                                           _mm512_srlv_epi16(qh, s23), two), 4));
    }
    const __m512i all = _mm512_castsi256_si512(w.sc_all);
    w.sc[0] = pair_scales(all, {0, 1, 2, 3}, {4, 5, 6, 7});
    w.sc[1] = pair_scales(all, {8, 9, 10, 11}, {12, 13, 14, 15});
  }
  // sum_i sc_i ((u_i - 32) . a_i) of one block, exact, spread over 16 int32 lanes.
  static __m512i isum(const Decoded& w, const Act& x) {
    __m512i isum = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int k = 0; k < 2; ++k) {  // |sums of 4| <= 4 * 63 * 127: int16
      const __m512i p0 = dpbusd0(w.u[2 * k], _mm512_loadu_si512(x.qs + 128 * k));
      const __m512i p1 = dpbusd0(w.u[2 * k + 1], _mm512_loadu_si512(x.qs + 128 * k + 64));
      isum = _mm512_dpwssd_epi32(isum, _mm512_packs_epi32(p0, p1), w.sc[k]);
    }
    const __m256i off = _mm256_madd_epi16(
        w.sc_all, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums)));
    return _mm512_sub_epi32(isum, _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5)));  // +32
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float&) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum(w, x)), _mm512_set1_ps(w.d * x.d), acc);
  }
};

#else  // AVX2: 32 inputs a vector

struct KQuant32 {
  __m256i q[8];       // sub-block j's 32 codes (u8)
  __m256i sc[8];      // int16 sc_j in every lane
  __m256i mins;
  float d, dmin;
};

inline void k_decode_scales(const uint8_t* s, KQuant32& w) {
  const __m128i scales = k_scales(s);
  const __m256i sc16 = _mm256_cvtepu8_epi16(scales);  // sc0..7 | m0..7, one per 16-bit lane
  const __m256i lo = _mm256_permute2x128_si256(sc16, sc16, 0x00);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)
    w.sc[j] = _mm256_shuffle_epi8(  // bytes 2j, 2j + 1 (int16 lane j) into every lane
        lo, _mm256_set1_epi16(static_cast<int16_t>(0x0100 * (2 * j + 1) + 2 * j)));
  w.mins = k_mins(scales);
}

inline void dot_kquant32(const KQuant32& w, const BlockQ8_K& x, __m256& acc) {
  __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)  // |pair sums| <= 2 * 31 * 127: int16
    isum = madd_acc(isum, _mm256_maddubs_epi16(w.q[j], load32(x.qs + 32 * j)), w.sc[j]);
  const __m256i msum = _mm256_madd_epi16(w.mins, _mm256_loadu_si256(
                                                     reinterpret_cast<const __m256i*>(x.bsums)));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(w.d * x.d), acc);
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(-(w.dmin * x.d)), acc);
}

struct TypeQ4_K {
  using Act = BlockQ8_K;
  static constexpr bool kRepack = false;
  using Acc = __m256;
  using Decoded = KQuant32;
  static constexpr int64_t kUnit = 1, kBlock = 256, kBytes = 144;
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    w.d = fp16(u16(b));
    w.dmin = fp16(u16(b + 2));
    k_decode_scales(b + 4, w);
    const __m256i low = _mm256_set1_epi8(0x0f);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i v = load32(b + 16 + 32 * j);
      w.q[2 * j] = _mm256_and_si256(v, low);
      w.q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float&) { dot_kquant32(w, x, acc); }
};

struct TypeQ5_K {
  using Act = BlockQ8_K;
  static constexpr bool kRepack = false;
  using Acc = __m256;
  using Decoded = KQuant32;
  static constexpr int64_t kUnit = 1, kBlock = 256, kBytes = 176;
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    w.d = fp16(u16(b));
    w.dmin = fp16(u16(b + 2));
    k_decode_scales(b + 4, w);
    const __m256i low = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(0x10);
    __m256i qh = load32(b + 16);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      // bits 0 and 1 of each byte of qh (shifted right 2j so far: bits 2j, 2j + 1) to bit 4
      const __m256i v = load32(b + 48 + 32 * j);
      w.q[2 * j] = _mm256_or_si256(_mm256_and_si256(v, low),
                                   _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
      w.q[2 * j + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                       _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit4));
      qh = _mm256_srli_epi16(qh, 2);  // a byte's bits 0-7 stay its own while 2j + 1 <= 7
    }
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float&) { dot_kquant32(w, x, acc); }
};

// Q6_K: 256 inputs in 16 sub-blocks of 16, int8 scales, fp16 d; 6-bit codes u = q + 32 (4 low
// bits in ql, 2 high in qh). Per 128 inputs (ql 64 bytes, qh 32): input l + 32 k (l < 32) has
// ql[l + 32 (k & 1)]'s low (k < 2) or high nibble and qh[l]'s bits 2k, 2k + 1. Sub-block i of
// 16 inputs has scale sc[i]. w . a = d dx (sum_i sc_i (u_i . a_i) - 32 sum_i sc_i bsum_i).
struct TypeQ6_K {
  using Act = BlockQ8_K;
  static constexpr bool kRepack = false;
  using Acc = __m256;
  static constexpr int64_t kUnit = 1, kBlock = 256, kBytes = 210;
  struct Decoded {
    __m256i u[8];      // inputs 32p .. 32p + 31 (u8, 0..63)
    __m256i sc[8];     // int16: sc[2p] in the low 128 bits, sc[2p + 1] in the high ones
    __m256i sc_all;    // int16 sc[0..15]
    float d;
  };
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    w.d = fp16(u16(b + 208));
    w.sc_all = _mm256_cvtepi8_epi16(sc8);
    const __m256i low = _mm256_set1_epi8(0x0f);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(ql + 64 * h), l1 = load32(ql + 64 * h + 32);
      const __m256i hb = load32(qh + 32 * h);
      w.u[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(
          _mm256_and_si256(hb, _mm256_set1_epi8(0x03)), 4));
      w.u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_slli_epi16(
          _mm256_and_si256(hb, _mm256_set1_epi8(0x0c)), 2));
      w.u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                       _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
      w.u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                       _mm256_srli_epi16(_mm256_and_si256(
                                           hb, _mm256_set1_epi8(static_cast<char>(0xc0))), 2));
    }
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m128i pick = _mm_setr_epi8(2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p,
                                         2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1,
                                         2 * p + 1, 2 * p + 1, 2 * p + 1);
      w.sc[p] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick));
    }
  }
  static void dot(const Decoded& w, const Act& x, __m256& acc, float&) {
    __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p)  // |pair sums| <= 2 * 63 * 127: int16
      isum = madd_acc(isum, _mm256_maddubs_epi16(w.u[p], load32(x.qs + 32 * p)), w.sc[p]);
    const __m256i off = _mm256_madd_epi16(
        w.sc_all, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums)));
    isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(off, 5));  // the codes' +32
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(w.d * x.d), acc);
  }
};
#endif

// Q2_K and Q3_K: 256 inputs in 16 sub-blocks of 16, 2-bit codes (Q3_K: a third bit in hmask).
// Per 128 inputs h, 32 bytes of codes: input 128h + 32j + l (l < 32) has bits 2j, 2j + 1 of
// byte l; Q3_K's third bit is bit 4h + j of hmask[l]. Sub-block i of 16 inputs has scale i.

#ifdef SELFSPEC_GGUF_VNNI
// 64 inputs a zmm, 128-bit lane L of vector k being sub-block 4k + L. Small codes leave room to
// fold each sub-block's scale into the weight bytes when decoding (one vpshufb a vector from a
// table of code x scale per lane), so that per activation row a block costs 4 vpdpbusd into
// one int32 accumulator and one float multiply-add: the pack + vpdpwssd scaling of Q4_K / Q6_K
// (and the AVX2 path's 8 vpmaddwd) would be paid per row. Both the table and its index are made
// once per block; each table vector comes out of one vpmullw: two bytes of one int16 lane
// belong to one sub-block, so a 16-bit product by its scale is two exact byte products.
// Faster than the shared AVX2 path for one row and more so for several; bound by the two
// 512-bit vector ports, decoding (fields, tables) costing about what the products do.

// The 32 code bytes p in both halves, the high half shifted down 2: 2-bit field 0 of the low
// half and field 1 of the high one in bits 0-1 (inputs 0-31, 32-63 of vector 2h), fields 2 and
// 3 there after a further shift by 4 (vector 2h + 1); garbage above.
inline __m512i q23_codes(const uint8_t* p) {
  const __m512i both = _mm512_broadcast_i64x4(load32(p));
  return _mm512_mask_srli_epi16(both, 0xffff0000u, both, 2);
}

// Q2_K (84 bytes): scales[16] (low nibble scale, high nibble minimum), qs[64], fp16 d, dmin:
// w = d sc q - dmin m, q in 0..3. Weight bytes sc q <= 45 (u8) against the int8 activations.
struct TypeQ2_K {
  using Act = BlockQ8_K;
  static constexpr bool kRepack = false;
  using Acc = AccK;
  static constexpr int64_t kUnit = 1, kBlock = 256, kBytes = 84;
  struct Decoded {
    __m512i w[4];    // sc q of inputs 64k .. 64k + 63
    __m256i mins;    // int16 m[0..15]
    __m512 d;        // d in every lane
    __m256 dmin;     // dmin alike
  };
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    // int16 sc_i + 16 m_i: the minima are its top bits, the scales its low 4
    const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    w.mins = _mm256_srli_epi16(both, 4);
    // Table: lane L byte 4c + q = sc_4c+L q; int16 lane m of lane L holds q = 2 (m & 1) and
    // 2 (m & 1) + 1 of sub-block 4 (m / 2) + L.
    alignas(64) static const int16_t kSpread[32] = {
        0, 0, 4, 4, 8, 8, 12, 12, 1, 1, 5, 5, 9, 9, 13, 13,
        2, 2, 6, 6, 10, 10, 14, 14, 3, 3, 7, 7, 11, 11, 15, 15};
    const __m512i spread = _mm512_permutexvar_epi16(
        _mm512_load_si512(kSpread),
        _mm512_castsi256_si512(_mm256_and_si256(both, _mm256_set1_epi16(0x0f))));
    const __m512i table = _mm512_mullo_epi16(spread, _mm512_set1_epi32(0x03020100));
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i even = q23_codes(b + 16 + 32 * h);
      const __m512i odd = _mm512_srli_epi16(even, 4);
      // (codes & 3) | 4k: vector k's sub-blocks in the table
      w.w[2 * h] = _mm512_shuffle_epi8(table, _mm512_ternarylogic_epi32(
          even, _mm512_set1_epi8(3), _mm512_set1_epi8(static_cast<char>(8 * h)), 0xea));
      w.w[2 * h + 1] = _mm512_shuffle_epi8(table, _mm512_ternarylogic_epi32(
          odd, _mm512_set1_epi8(3), _mm512_set1_epi8(static_cast<char>(8 * h + 4)), 0xea));
    }
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int32_t>(
        u16(b + 80) | uint32_t(u16(b + 82)) << 16)));
    w.d = _mm512_broadcastss_ps(dm);
    w.dmin = _mm256_permutexvar_ps(_mm256_set1_epi32(1), _mm256_castps128_ps256(dm));
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float&) {
    __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.w[0], _mm512_loadu_si512(x.qs));
#pragma GCC unroll 3
    for (int k = 1; k < 4; ++k)
      isum = _mm512_dpbusd_epi32(isum, w.w[k], _mm512_loadu_si512(x.qs + 64 * k));
    const __m256i msum = _mm256_madd_epi16(
        w.mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums)));
    // scales d dx and dmin dx as the scalar products would round them, one multiply each
    acc.a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(w.d, _mm512_set1_ps(x.d)),
                            acc.a);
    acc.m = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum),
                             _mm256_mul_ps(w.dmin, _mm256_set1_ps(x.d)), acc.m);
  }
};

// Q3_K's table factors C (int16 lanes m & 3 = 0..3: u = 0, 1 / 2, 3 / 4, 5 / 6, 7) packed as
// 64 bits, and 0x8080 - 64 C alike (see TypeQ3_K::decode).
constexpr int64_t q3_pack(int v0, int v1, int v2, int v3) {
  return static_cast<int64_t>((uint64_t(uint16_t(v0))) | uint64_t(uint16_t(v1)) << 16 |
                              uint64_t(uint16_t(v2)) << 32 | uint64_t(uint16_t(v3)) << 48);
}
constexpr int q3_factor(int m) { return (2 * m + 1 - 4) * 256 + (2 * m - 4); }
constexpr int64_t kQ3Factor = q3_pack(q3_factor(0), q3_factor(1), q3_factor(2), q3_factor(3));
constexpr int64_t kQ3Offset = q3_pack(0x8080 - 64 * q3_factor(0), 0x8080 - 64 * q3_factor(1),
                                      0x8080 - 64 * q3_factor(2), 0x8080 - 64 * q3_factor(3));

// Q3_K (110 bytes): hmask[32], qs[64], 12 bytes of 6-bit scales (stored + 32), fp16 d:
// w = d (sc - 32) (u - 4), u = q + 4 hbit in 0..7. The weight bytes are 128 + s (u - 4) with
// s = 32 - stored = -(sc - 32) in -31..32, so in 0..252 (u8; with sc - 32 itself 256 could
// occur). Against the int8 activations a they sum to sum s (u - 4) a + 128 sum a: the
// accumulator starts at -128 sum a (from bsums), and the scale is -d dx.
struct TypeQ3_K {
  using Act = BlockQ8_K;
  static constexpr bool kRepack = false;
  using Acc = __m512;
  static constexpr int64_t kUnit = 1, kBlock = 256, kBytes = 110;
  struct Decoded {
    __m512i w[4];    // 128 + s (u - 4) of inputs 64k .. 64k + 63
    __m512 d;        // d in every lane
  };
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    // Scale i: low 4 bits from byte i % 8 (low nibble for i < 8, high for i >= 8), high 2 bits
    // from bits 2 (i / 4) .. of byte 8 + i % 4 (8 at a time in 64-bit words). Bytes 96 -
    // stored = s + 64 (in 33..96: no borrows, and zero-extend to int16); the tables take the 64
    // back as a constant.
    uint64_t lo4, hi2;
    uint32_t top;
    memcpy(&lo4, b + 96, 8);
    memcpy(&top, b + 104, 4);
    hi2 = uint64_t(top) | uint64_t(top >> 2) << 32;  // bytes 0-3: bits 0-1; 4-7: bits 2-3
    const uint64_t four = 0x0f0f0f0f0f0f0f0full, two = 0x0303030303030303ull;
    const uint64_t ninety_six = 0x6060606060606060ull;
    const uint64_t s_lo = ninety_six - ((lo4 & four) | (hi2 & two) << 4);
    const uint64_t s_hi = ninety_six - (((lo4 >> 4) & four) | ((hi2 >> 4) & two) << 4);
    // (not through memory: a 16-byte load of two 8-byte stores cannot be forwarded, and its
    // wait serialized one-row products, several times slower)
    const __m512i s16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(
        _mm_set_epi64x(static_cast<int64_t>(s_hi), static_cast<int64_t>(s_lo))));
    // Tables p = 0, 1: lane L byte 8c + u = 128 + s_8p+4c+L (u - 4); int16 lane m of lane L
    // holds u = 2 (m & 3) and 2 (m & 3) + 1 of sub-block 8p + 4 (m / 4) + L: with the int16
    // C = (u_odd - 4) 256 + (u_even - 4), (s + 64) C + (0x8080 - 64 C) = 0x8080 + s C is
    // 128 + s (u_odd - 4) in the high byte and 128 + s (u_even - 4) in the low one (each in
    // 0..252: no carries).
    const __m512i factor = _mm512_set1_epi64(kQ3Factor), offset = _mm512_set1_epi64(kQ3Offset);
    alignas(64) static const int16_t kSpread[2][32] = {
        {0, 0, 0, 0, 4, 4, 4, 4, 1, 1, 1, 1, 5, 5, 5, 5,
         2, 2, 2, 2, 6, 6, 6, 6, 3, 3, 3, 3, 7, 7, 7, 7},
        {8, 8, 8, 8, 12, 12, 12, 12, 9, 9, 9, 9, 13, 13, 13, 13,
         10, 10, 10, 10, 14, 14, 14, 14, 11, 11, 11, 11, 15, 15, 15, 15}};
    __m512i table[2];
#pragma GCC unroll 2
    for (int p = 0; p < 2; ++p) {
      const __m512i spread = _mm512_permutexvar_epi16(_mm512_load_si512(kSpread[p]), s16);
      table[p] = _mm512_add_epi16(_mm512_mullo_epi16(spread, factor), offset);
    }
    const __m512i hm = _mm512_broadcast_i64x4(load32(b));
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i even = q23_codes(b + 32 + 32 * h);
      const __m512i odd = _mm512_srli_epi16(even, 4);
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) {
        const int k = 2 * h + c;
        // index (codes & 3) | 4 third bit | 8 c (blends and ternary logic: no register copies)
        const __mmask64 third = _mm512_test_epi8_mask(
            hm, _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << 2 * k)),
                                   _mm256_set1_epi8(static_cast<char>(1 << (2 * k + 1))), 1));
        const __m512i high =
            _mm512_mask_blend_epi8(third, _mm512_set1_epi8(static_cast<char>(8 * c)),
                                   _mm512_set1_epi8(static_cast<char>(8 * c + 4)));
        w.w[k] = _mm512_shuffle_epi8(table[h], _mm512_ternarylogic_epi32(
            c ? odd : even, _mm512_set1_epi8(3), high, 0xea));
      }
    }
    w.d = _mm512_set1_ps(fp16(u16(b + 108)));
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float&) {
    __m512i isum = _mm512_zextsi256_si512(_mm256_madd_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums)), _mm256_set1_epi16(-128)));
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k)
      isum = _mm512_dpbusd_epi32(isum, w.w[k], _mm512_loadu_si512(x.qs + 64 * k));
    acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(w.d, _mm512_set1_ps(x.d)),
                           acc);
  }
};

#else  // AVX2: 32 inputs a vector

// sc[p] = int16 [sc_2p x 8 | sc_2p+1 x 8] of 16 int8 scales (against a vpmaddubsw of inputs
// 32p .. 32p + 31, whose low 128 bits are sub-block 2p): widened once, each 128-bit half
// copied to both lanes, then one in-lane byte shuffle a vector (one op where a shuffle and a
// widening each took two).
inline void pair16_scales(__m128i sc8, __m256i (&sc)[8]) {
  const __m256i s16 = _mm256_cvtepi8_epi16(sc8);
  const __m256i half[2] = {_mm256_permute2x128_si256(s16, s16, 0x00),
                           _mm256_permute2x128_si256(s16, s16, 0x11)};
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    const char a = static_cast<char>(4 * p % 16), b = static_cast<char>((4 * p + 2) % 16);
    sc[p] = _mm256_shuffle_epi8(
        half[p / 4], _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1,
                                      a, a + 1, a, a + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1,
                                      b, b + 1, b, b + 1, b, b + 1, b, b + 1));
  }
}

// Q2_K (84 bytes): scales[16] (low nibble scale, high nibble minimum), qs[64], fp16 d, dmin:
// w = d sc q - dmin m, q in 0..3.
struct TypeQ2_K {
  using Act = BlockQ8_K;
  static constexpr bool kRepack = false;
  using Acc = __m256;
  static constexpr int64_t kUnit = 1, kBlock = 256, kBytes = 84;
  struct Decoded {
    __m256i q[8];    // inputs 32p .. 32p + 31
    __m256i sc[8];   // pair16_scales
    __m256i mins;    // int16 m[0..15]
    float d, dmin;
  };
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m128i nib = _mm_set1_epi8(0x0f);
    const __m128i sc8 = _mm_and_si128(packed, nib);
    w.mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), nib));
    pair16_scales(sc8, w.sc);
    const __m256i two = _mm256_set1_epi8(0x03);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i v = load32(b + 16 + 32 * h);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        w.q[4 * h + j] = _mm256_and_si256(_mm256_srli_epi16(v, 2 * j), two);
    }
    w.d = fp16(u16(b + 80));
    w.dmin = fp16(u16(b + 82));
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float&) {
    __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p)  // |pair sums| <= 2 * 3 * 127
      isum = madd_acc(isum, _mm256_maddubs_epi16(w.q[p], load32(x.qs + 32 * p)), w.sc[p]);
    const __m256i msum = _mm256_madd_epi16(
        w.mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(w.d * x.d), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(-(w.dmin * x.d)), acc);
  }
};

// Q3_K (110 bytes): hmask[32], qs[64], 12 bytes of 6-bit scales (stored + 32), fp16 d:
// w = d (sc - 32) (u - 4) with u = q + 4 * hbit in 0..7, so
// w . a = d (sum_i sc_i (u_i . a_i) - 4 sum_i sc_i bsum_i).
struct TypeQ3_K {
  using Act = BlockQ8_K;
  static constexpr bool kRepack = false;
  using Acc = __m256;
  static constexpr int64_t kUnit = 1, kBlock = 256, kBytes = 110;
  struct Decoded {
    __m256i u[8];     // inputs 32p .. 32p + 31 (0..7)
    __m256i sc[8];    // pair16_scales
    __m256i sc_all;   // int16 sc[0..15]
    float d;
  };
  static void decode(const uint8_t* b, Decoded& w, int64_t) {
    // Scale i: low 4 bits from byte i % 8 (low nibble for i < 8, high for i >= 8), high 2 bits
    // from bits 2 (i / 4) .. of byte 8 + i % 4.
    uint32_t a[3];
    memcpy(a, b + 96, 12);
    const uint32_t four = 0x0f0f0f0f, two = 0x03030303;
    const __m128i stored = _mm_setr_epi32(
        static_cast<int32_t>((a[0] & four) | ((a[2] & two) << 4)),
        static_cast<int32_t>((a[1] & four) | (((a[2] >> 2) & two) << 4)),
        static_cast<int32_t>(((a[0] >> 4) & four) | (((a[2] >> 4) & two) << 4)),
        static_cast<int32_t>(((a[1] >> 4) & four) | (((a[2] >> 6) & two) << 4)));
    const __m128i sc8 = _mm_sub_epi8(stored, _mm_set1_epi8(32));
    w.sc_all = _mm256_cvtepi8_epi16(sc8);
    pair16_scales(sc8, w.sc);
    const __m256i hm = load32(b);
    const __m256i low2 = _mm256_set1_epi8(0x03), bit2 = _mm256_set1_epi8(0x04);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i v = load32(b + 32 + 32 * h);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        // bit 4h + j of each hmask byte to bit 2 (16-bit shifts: each byte keeps its own bits)
        const int c = 4 * h + j;
        const __m256i third = _mm256_and_si256(
            c >= 2 ? _mm256_srli_epi16(hm, c - 2) : _mm256_slli_epi16(hm, 2 - c), bit2);
        w.u[c] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 2 * j), low2), third);
      }
    }
    w.d = fp16(u16(b + 108));
  }
  static void dot(const Decoded& w, const Act& x, Acc& acc, float&) {
    __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p)  // |pair sums| <= 2 * 7 * 127
      isum = madd_acc(isum, _mm256_maddubs_epi16(w.u[p], load32(x.qs + 32 * p)), w.sc[p]);
    const __m256i off = _mm256_madd_epi16(
        w.sc_all, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums)));
    isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(off, 2));  // the codes' +4
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(w.d * x.d), acc);
  }
};
#endif

inline float sum_acc(__m256 a) { return hsum(a); }
#ifdef SELFSPEC_GGUF_VNNI
inline float sum_acc(__m512 a) { return _mm512_reduce_add_ps(a); }  // a fixed order
#endif

// TB activation rows (act, rows act_bytes apart, T::Act a step) against weight row w of
// nblocks blocks, T::kUnit blocks a step: res[t].
template <class T, int TB>
void quant_tile(const uint8_t* w, const uint8_t* act, int64_t act_bytes, int64_t nblocks,
                float* res) {
  using Act = typename T::Act;
  typename T::Acc acc[TB];
  float extra[TB];
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) {
    acc[t] = typename T::Acc{};  // zeros
    extra[t] = 0.f;
  }
  const int64_t steps = (nblocks + T::kUnit - 1) / T::kUnit;
  for (int64_t u = 0; u < steps; ++u) {
    const uint8_t* ahead = w + u * T::kUnit * T::kBytes + kPrefetch;
    for (int64_t o = 0; o < T::kUnit * T::kBytes; o += 64)  // past the row: its successor's
      _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
    typename T::Decoded dw;
    T::decode(w + u * T::kUnit * T::kBytes, dw, std::min(T::kUnit, nblocks - u * T::kUnit));
#pragma GCC unroll 8
    for (int t = 0; t < TB; ++t)
      T::dot(dw, reinterpret_cast<const Act*>(act + t * act_bytes)[u], acc[t], extra[t]);
  }
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) res[t] = sum_acc(acc[t]) + extra[t];
}

// Unquantized rows against fp32 activations: two 8-lane FMA chains per (row, output), then the
// scalar tail of K % 16 inputs in order.
template <int64_t Type>
struct FloatRow {
  using Elem = typename std::conditional<Type == kF32, float, uint16_t>::type;
  static __m256 load(const Elem* p) {  // 8 weights as fp32
    if constexpr (Type == kF32) return _mm256_loadu_ps(p);
    else if constexpr (Type == kF16)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    else return load8(p);  // bf16
  }
  static float scalar(const Elem* p) {
    if constexpr (Type == kF32) return *p;
    else if constexpr (Type == kF16) return fp16(*p);
    else return bf16_to_float(*p);
  }
};

template <int64_t Type, int TB>
void float_tile(const uint8_t* wbytes, const float* x, int64_t K, float* res) {
  using R = FloatRow<Type>;
  const auto* w = reinterpret_cast<const typename R::Elem*>(wbytes);
  __m256 a0[TB], a1[TB];
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 w0 = R::load(w + k), w1 = R::load(w + k + 8);
#pragma GCC unroll 8
    for (int t = 0; t < TB; ++t) {
      a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * K + k), a0[t]);
      a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * K + k + 8), a1[t]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) {
    float s = hsum(_mm256_add_ps(a0[t], a1[t]));
    for (int64_t j = k; j < K; ++j) s = fmaf(R::scalar(w + j), x[t * K + j], s);
    res[t] = s;
  }
}

#ifdef SELFSPEC_GGUF_AMX
#include "gguf_amx.h"
#endif
#ifdef SELFSPEC_GGUF_VNNI
#include "gguf_group32.h"
#endif

// One segment of rows of one type, ready to multiply: tile(n, t0, tb, res) computes rows
// t0 .. t0 + tb - 1 (tb <= kTile) against the segment's weight row n. Holds the activations
// repacked for its type (blocks of 32), made once per call before the rows are split. In the
// AVX-512 builds, Q4_0 / Q4_1 / Q8_0 segments instead run groups of 16 weight rows
// (gguf_group32.h), and in the AMX build Q4_K / Q6_K ones (gguf_amx.h).
constexpr int64_t kGroupRows = 16;  // weight rows a group (amx::kGroup, gguf_group32.h)

#ifdef SELFSPEC_GGUF_AMX
using GroupScratch = amx::Scratch;
#else
struct GroupScratch {};  // the groups of gguf_group32.h keep nothing between groups
#endif

struct Runner {
  std::function<void(int64_t, int64_t, int64_t, float*)> tile;
  std::shared_ptr<void> keep;
#ifdef SELFSPEC_GGUF_VNNI
  // acc ([mpad, 16]) = weight rows 16 g .. 16 g + 15 (zero rows past the segment) . every
  // activation row; null for a segment of another type.
  std::function<void(int64_t, float*, GroupScratch&)> group;
  int64_t group_rows = 0;  // activation rows acc holds (padded to the AMX tiles' height)
  int64_t group_tile_mc = 0;  // AMX build: the tiles' height where group runs tiles, else 0
#endif
};

#ifdef SELFSPEC_GGUF_AMX
template <class T>
bool amx_runner(const uint8_t* w, int64_t N, int64_t K, const uint8_t* act, int64_t M,
                Runner& r) {
  if (K % 256 || !amx::permission()) return false;
  const int64_t row_bytes = K / 256 * T::kBytes;
  auto prepared = amx::prepare(act, M, K, M <= T::kSmallMax);
  auto zero = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(row_bytes), 0);
  r.keep = std::make_shared<std::pair<decltype(prepared), decltype(zero)>>(prepared, zero);
  r.group_rows = prepared->mpad;
  r.group_tile_mc = prepared->small ? 0 : prepared->mc;
  const amx::Act* a = prepared.get();
  const uint8_t* z = zero->data();
  r.group = [=](int64_t g, float* acc, GroupScratch& scratch) {
    const uint8_t* rows[16];
    for (int l = 0; l < 16; ++l) {
      const int64_t n = 16 * g + l;
      rows[l] = n < N ? w + n * row_bytes : z;
    }
    amx::run<T>(rows, *a, acc, scratch);
  };
  return true;
}
#endif

#ifdef SELFSPEC_GGUF_VNNI
// Q4_0 / Q4_1 / Q8_0 rows in groups of 16 (gguf_group32.h), every call whatever its rows.
template <class T>
bool group32_runner(const uint8_t* w, int64_t N, int64_t K, const uint8_t* act, int64_t M,
                    Runner& r) {
  if (K % 32) return false;
  const int64_t row_bytes = K / 32 * T::kBytes;
  auto prepared = group32::prepare(act, M, K, T::kQ8_1);
  auto zero = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(row_bytes), 0);
  r.keep = std::make_shared<std::pair<decltype(prepared), decltype(zero)>>(prepared, zero);
  r.group_rows = M;
  const group32::Act* a = prepared.get();
  const uint8_t* z = zero->data();
  r.group = [=](int64_t g, float* acc, GroupScratch&) {
    const uint8_t* rows[16];
    for (int l = 0; l < 16; ++l) {
      const int64_t n = 16 * g + l;
      rows[l] = n < N ? w + n * row_bytes : z;
    }
    const int64_t next = std::min<int64_t>(N, 16 * g + 32) - std::min<int64_t>(N, 16 * g + 16);
    group32::run<T>(rows, *a, acc, {w + (16 * g + 16) * row_bytes, next * row_bytes});
  };
  return true;
}
#endif

template <class T>
bool quant_runner(const uint8_t* w, int64_t K, const uint8_t* act, int64_t M, Runner& r) {
  if (K % T::kBlock) return false;
  const int64_t nb = K / T::kBlock, row_bytes = nb * T::kBytes;
  int64_t act_bytes = nb * static_cast<int64_t>(sizeof(typename T::Act));
  if constexpr (T::kRepack) {  // blocks of 32: activations repacked once per call
    const int64_t steps = (nb + T::kUnit - 1) / T::kUnit;
    auto repacked = std::make_shared<std::vector<typename T::Act>>(static_cast<size_t>(M * steps));
    T::repack(act, M, nb, repacked->data());
    act = reinterpret_cast<const uint8_t*>(repacked->data());
    act_bytes = steps * static_cast<int64_t>(sizeof(typename T::Act));
    r.keep = repacked;
  }
  r.tile = [=](int64_t n, int64_t t0, int64_t tb, float* res) {
    const uint8_t* row = w + n * row_bytes;
    const uint8_t* a = act + t0 * act_bytes;
    switch (tb) {
      case 8: quant_tile<T, 8>(row, a, act_bytes, nb, res); break;
      case 7: quant_tile<T, 7>(row, a, act_bytes, nb, res); break;
      case 6: quant_tile<T, 6>(row, a, act_bytes, nb, res); break;
      case 5: quant_tile<T, 5>(row, a, act_bytes, nb, res); break;
      case 4: quant_tile<T, 4>(row, a, act_bytes, nb, res); break;
      case 3: quant_tile<T, 3>(row, a, act_bytes, nb, res); break;
      case 2: quant_tile<T, 2>(row, a, act_bytes, nb, res); break;
      default: quant_tile<T, 1>(row, a, act_bytes, nb, res); break;
    }
  };
  return true;
}

template <int64_t Type>
bool float_runner(const uint8_t* w, int64_t K, const uint8_t* act, Runner& r) {
  const float* x = reinterpret_cast<const float*>(act);
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(typename FloatRow<Type>::Elem));
  r.tile = [=](int64_t n, int64_t t0, int64_t tb, float* res) {
    const uint8_t* row = w + n * row_bytes;
    const float* a = x + t0 * K;
    switch (tb) {
      case 8: float_tile<Type, 8>(row, a, K, res); break;
      case 7: float_tile<Type, 7>(row, a, K, res); break;
      case 6: float_tile<Type, 6>(row, a, K, res); break;
      case 5: float_tile<Type, 5>(row, a, K, res); break;
      case 4: float_tile<Type, 4>(row, a, K, res); break;
      case 3: float_tile<Type, 3>(row, a, K, res); break;
      case 2: float_tile<Type, 2>(row, a, K, res); break;
      default: float_tile<Type, 1>(row, a, K, res); break;
    }
  };
  return true;
}

// The runner of a segment of type (ggml id) rows w with activations act, or false for an
// unsupported type or a K that is not a multiple of its block.
bool make_runner(int64_t type, const uint8_t* w, int64_t N, int64_t K, const void* act,
                 int64_t M, Runner& r) {
  const auto* a = static_cast<const uint8_t*>(act);
#ifdef SELFSPEC_GGUF_AMX
  if (type == kQ4_K) return amx_runner<amx::Q4K>(w, N, K, a, M, r);
  if (type == kQ6_K) return amx_runner<amx::Q6K>(w, N, K, a, M, r);
#endif
#ifdef SELFSPEC_GGUF_VNNI
  if (type == kQ4_0 && group32_runner<group32::Q4_0>(w, N, K, a, M, r)) return true;
  if (type == kQ4_1 && group32_runner<group32::Q4_1>(w, N, K, a, M, r)) return true;
  if (type == kQ8_0 && group32_runner<group32::Q8_0>(w, N, K, a, M, r)) return true;
#else
  (void)N;
#endif
  switch (type) {
    case kQ4_0: return quant_runner<TypeQ4_0>(w, K, a, M, r);
    case kQ4_1: return quant_runner<TypeQ4_1>(w, K, a, M, r);
    case kQ5_0: return quant_runner<TypeQ5_0>(w, K, a, M, r);
    case kQ5_1: return quant_runner<TypeQ5_1>(w, K, a, M, r);
    case kQ8_0: return quant_runner<TypeQ8_0>(w, K, a, M, r);
    case kQ2_K: return quant_runner<TypeQ2_K>(w, K, a, M, r);
    case kQ3_K: return quant_runner<TypeQ3_K>(w, K, a, M, r);
    case kQ4_K: return quant_runner<TypeQ4_K>(w, K, a, M, r);
    case kQ5_K: return quant_runner<TypeQ5_K>(w, K, a, M, r);
    case kQ6_K: return quant_runner<TypeQ6_K>(w, K, a, M, r);
    case kF32: return float_runner<kF32>(w, K, a, r);
    case kF16: return float_runner<kF16>(w, K, a, r);
    case kBF16: return float_runner<kBF16>(w, K, a, r);
    default: return false;
  }
}

}  // namespace

// A segment of a GgufMatrix (ctypes mirror in gguf_rows.py): rows weight rows of type (ggml
// id), the products going to output columns col .. col + rows - 1, plus bias (fp32 [rows] or
// null).
struct SelfspecGgufSegment {
  int64_t type;
  const uint8_t* w;
  int64_t rows;
  const float* bias;
  int64_t col;
};

namespace {

// emit(t, col_s + n, segment s's row n . activation row t (+ bias)) for every segment, in one
// parallel region over all segments' rows (threads split the rows; tiles of up to kTile
// activation rows per pass over a weight row). -1 (nothing emitted) where a segment's type or
// K is refused.
template <typename Emit>
int64_t product_rows(const SelfspecGgufSegment* segs, int64_t nseg, int64_t K,
                     const void* const* acts, int64_t M, Emit emit) {
  std::vector<Runner> runners(static_cast<size_t>(nseg));
  // Units of work: a weight row, or (AMX segments) a group of 16.
  std::vector<int64_t> start(static_cast<size_t>(nseg + 1), 0);
  int64_t group_units = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    if (!make_runner(segs[s].type, segs[s].w, segs[s].rows, K, acts[s], M, runners[s]))
      return -1;
    int64_t units = segs[s].rows;
#ifdef SELFSPEC_GGUF_VNNI
    if (runners[s].group) units = (segs[s].rows + kGroupRows - 1) / kGroupRows;
    if (runners[s].group) group_units += units;
#endif
    start[s + 1] = start[s] + units;
  }
  // Rows a thread takes at least: about 2^20 multiply-adds, so that a small product does not
  // pay a wake-up of the other threads (on a loaded machine that wake-up can cost far more than
  // the product).
  int64_t grain = std::max<int64_t>(16, (int64_t(1) << 20) / std::max<int64_t>(1, K * M));
  if (group_units == start[nseg]) grain = std::max<int64_t>(1, grain / 16);
  at::parallel_for(0, start[nseg], grain, [&](int64_t begin, int64_t end) {
    float res[kTile];
    int64_t s = 0;
#ifdef SELFSPEC_GGUF_VNNI
    std::vector<float> acc_buf;  // [mpad, 16] fp32, 64-byte aligned within
    GroupScratch scratch;
#endif
#ifdef SELFSPEC_GGUF_AMX
    int64_t tiles = -1;  // the (mc, ks) the tiles are configured for
#endif
    for (int64_t g = begin; g < end; ++g) {
      while (g >= start[s + 1]) ++s;
      const SelfspecGgufSegment& seg = segs[s];
      const int64_t n = g - start[s];
#ifdef SELFSPEC_GGUF_VNNI
      if (runners[s].group) {
        const int64_t rows = runners[s].group_rows;
#ifdef SELFSPEC_GGUF_AMX
        const int64_t mc = runners[s].group_tile_mc;
        const int ks = seg.type == kQ4_K ? amx::Q4K::kKs : amx::Q6K::kKs;
        if (mc > 0 && tiles != mc * 64 + ks) {
          amx::configure(static_cast<int>(mc), ks);
          tiles = mc * 64 + ks;
        }
#endif
        if (acc_buf.size() < static_cast<size_t>(rows * 16 + 16))
          acc_buf.resize(static_cast<size_t>(rows * 16 + 16));
        float* acc = reinterpret_cast<float*>(
            (reinterpret_cast<uintptr_t>(acc_buf.data()) + 63) & ~uintptr_t(63));
        memset(acc, 0, static_cast<size_t>(rows * 16) * sizeof(float));
        runners[s].group(n, acc, scratch);
        for (int l = 0; l < kGroupRows && kGroupRows * n + l < seg.rows; ++l) {
          const int64_t row = kGroupRows * n + l;
          for (int64_t t = 0; t < M; ++t) {
            const float v = acc[t * 16 + l];
            emit(t, seg.col + row, seg.bias ? v + seg.bias[row] : v);
          }
        }
        continue;
      }
#endif
      for (int64_t t0 = 0; t0 < M; t0 += kTile) {
        const int64_t tb = M - t0 < kTile ? M - t0 : kTile;
        runners[s].tile(n, t0, tb, res);
        for (int64_t t = 0; t < tb; ++t)
          emit(t0 + t, seg.col + n, seg.bias ? res[t] + seg.bias[n] : res[t]);
      }
    }
#ifdef SELFSPEC_GGUF_AMX
    if (tiles >= 0) _tile_release();
#endif
  });
  return 0;
}

// out[t * ldo + col_s + n] (fp32, or bf16 where out_bf16) = product_rows' values.
int64_t product(const SelfspecGgufSegment* segs, int64_t nseg, int64_t K,
                const void* const* acts, int64_t M, void* out, int64_t ldo, bool out_bf16) {
  if (out_bf16)
    return product_rows(segs, nseg, K, acts, M, [&](int64_t t, int64_t n, float v) {
      static_cast<uint16_t*>(out)[t * ldo + n] = float_to_bf16(v);
    });
  return product_rows(segs, nseg, K, acts, M, [&](int64_t t, int64_t n, float v) {
    static_cast<float*>(out)[t * ldo + n] = v;
  });
}

// ---------------------------------------------------------------------------------------------
// Activation quantization (llama.cpp's reference rounding).

inline float amax32(const float* x, int64_t n) {  // max |x| (order-free)
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8)
    m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask));
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// 8 int32 of roundf(v) (halves away from zero, as C's roundf): trunc, then one more step
// away from zero where the dropped fraction is at least a half (v - trunc(v) is exact).
inline __m256i roundf8(__m256 v) {
  const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 frac = _mm256_and_ps(_mm256_sub_ps(v, t), abs_mask);
  const __m256 step = _mm256_or_ps(_mm256_set1_ps(1.f),
                                   _mm256_andnot_ps(abs_mask, v));  // +-1 with v's sign
  const __m256 up = _mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
  return _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_and_ps(up, step)));
}

// 32 int32 (4 x 8) -> 32 int8 in order (values within int8: packs does not saturate them).
inline void pack32(const __m256i i[4], int8_t* dst) {
  const __m256i packed = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
}

// quantize_row_q8_0_ref / q8_1_ref: d = amax / 127, q = roundf(x * (1 / d)), d (and s =
// fp16(sum q * d)) stored as fp16.
template <bool WithSum>
void quantize_q8_32(const float* x, int64_t K, uint8_t* out) {
  const int64_t bytes = WithSum ? 36 : 34, qs_at = WithSum ? 4 : 2;
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* v = x + 32 * b;
    uint8_t* blk = out + b * bytes;
    const float d = amax32(v, 32) / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    __m256i i[4];
    for (int j = 0; j < 4; ++j)
      i[j] = roundf8(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), _mm256_set1_ps(id)));
    int8_t* qs = reinterpret_cast<int8_t*>(blk + qs_at);
    pack32(i, qs);
    const uint16_t dh = to_fp16(d);
    memcpy(blk, &dh, 2);
    if (WithSum) {
      int sum = 0;
      for (int j = 0; j < 32; ++j) sum += qs[j];
      const uint16_t sh = to_fp16(static_cast<float>(sum) * d);
      memcpy(blk + 2, &sh, 2);
    }
  }
}

// quantize_row_q8_K_ref: max = the first input of largest magnitude, iscale = -127 / max,
// q = nearest_int(iscale x) (halves to even, as vcvtps2dq in the default rounding mode), capped
// at 127; d = 1 / iscale; bsums per 16. An all-zero block has d = 0 and zero codes and sums.
void quantize_q8_k(const float* x, int64_t K, uint8_t* out) {
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* v = x + 256 * b;
    BlockQ8_K blk;
    const float amax = amax32(v, 256);
    if (!(amax > 0.f)) {
      memset(&blk, 0, sizeof(blk));
    } else {
      float max = 0.f;
      for (int j = 0; j < 256; ++j)
        if (fabsf(v[j]) == amax) { max = v[j]; break; }
      const float iscale = -127.f / max;
      const __m256 s = _mm256_set1_ps(iscale);
      for (int c = 0; c < 8; ++c) {
        __m256i i[4];
        for (int j = 0; j < 4; ++j)
          i[j] = _mm256_min_epi32(
              _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 32 * c + 8 * j), s)),
              _mm256_set1_epi32(127));
        pack32(i, blk.qs + 32 * c);
      }
      for (int g = 0; g < 16; ++g) {
        int sum = 0;
        for (int j = 0; j < 16; ++j) sum += blk.qs[16 * g + j];
        blk.bsums[g] = static_cast<int16_t>(sum);
      }
      blk.d = 1.f / iscale;
    }
    memcpy(out + b * static_cast<int64_t>(sizeof(BlockQ8_K)), &blk, sizeof(blk));
  }
}

int64_t act_row_bytes(int64_t fmt, int64_t K) {
  switch (fmt) {
    case kQ8_0: return K % 32 ? -1 : K / 32 * 34;
    case kQ8_1: return K % 32 ? -1 : K / 32 * 36;
    case kQ8_K: return K % 256 ? -1 : K / 256 * 292;
    default: return -1;
  }
}

// The activation format a weight type's products take (kF32: the fp32 input itself), or -1.
int64_t activation_format(int64_t type) {
  switch (type) {
    case kQ4_0: case kQ5_0: case kQ8_0: return kQ8_0;
    case kQ4_1: case kQ5_1: return kQ8_1;
    case kQ2_K: case kQ3_K: case kQ4_K: case kQ5_K: case kQ6_K: return kQ8_K;
    case kF32: case kF16: case kBF16: return kF32;
    default: return -1;
  }
}

// x: [M, K] fp32 (x_bf16 = 0) or bf16 -> out: [M, row_bytes] blocks of fmt (row_bytes =
// act_row_bytes(fmt, K), checked by the caller).
void quantize_rows(int64_t fmt, const void* x, bool x_bf16, int64_t M, int64_t K,
                   int64_t row_bytes, uint8_t* out) {
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(x_bf16 ? static_cast<size_t>(K) : 0);
    for (int64_t t = begin; t < end; ++t) {
      const float* v;
      if (x_bf16) {
        const uint16_t* src = static_cast<const uint16_t*>(x) + t * K;
        for (int64_t k = 0; k < K; ++k) row[k] = bf16_to_float(src[k]);
        v = row.data();
      } else {
        v = static_cast<const float*>(x) + t * K;
      }
      uint8_t* dst = out + t * row_bytes;
      if (fmt == kQ8_0) quantize_q8_32<false>(v, K, dst);
      else if (fmt == kQ8_1) quantize_q8_32<true>(v, K, dst);
      else quantize_q8_k(v, K, dst);
    }
  });
}

}  // namespace

// A whole GgufMatrix as the fused sub-layers take it (ctypes mirror in gguf_rows.py): its
// segments (each with its slice of the bias) stacked along the outputs, K inputs.
struct SelfspecGgufMatrix {
  const SelfspecGgufSegment* segments;
  int64_t num_segments, k;
};

namespace {

// The fused sub-layers' products (fused_layers.h) on a SelfspecGgufMatrix: the fp32 rows
// quantized once per activation format its segments take, then all segments in one call, as
// selfspec_gguf_rows_segments (each row as computed alone).
struct GgufProduct {
  template <typename Store>
  static void run(const void* matrix, const float* x, int64_t T, Store store) {
    const SelfspecGgufMatrix& m = *static_cast<const SelfspecGgufMatrix*>(matrix);
    const int64_t K = m.k, nseg = m.num_segments;
    std::vector<uint8_t> quantized[3];  // Q8_0, Q8_1, Q8_K
    std::vector<const void*> acts(static_cast<size_t>(nseg));
    for (int64_t s = 0; s < nseg; ++s) {
      const int64_t fmt = activation_format(m.segments[s].type);
      if (fmt == kF32) {
        acts[s] = x;
        continue;
      }
      std::vector<uint8_t>& buf = quantized[fmt == kQ8_0 ? 0 : fmt == kQ8_1 ? 1 : 2];
      const int64_t row_bytes = act_row_bytes(fmt, K);
      if (buf.empty() && T > 0 && row_bytes > 0) {
        buf.resize(static_cast<size_t>(T * row_bytes));
        quantize_rows(fmt, x, false, T, K, row_bytes, buf.data());
      }
      acts[s] = buf.data();
    }
    // GgufMatrix checked every segment's type and K, so no segment is refused here.
    product_rows(m.segments, nseg, K, acts.data(), T, store);
  }
};

}  // namespace

extern "C" {

// Version of this kernel's numerics and layouts; a change must change it.
int64_t selfspec_gguf_rows_version() { return 4; }

// 1 for the AVX-512 VNNI build (and the AMX one), 0 for the AVX2 one.
int64_t selfspec_gguf_rows_vnni() {
#ifdef SELFSPEC_GGUF_VNNI
  return 1;
#else
  return 0;
#endif
}

// 1 for the AMX build where Linux grants this process the tile state, 0 where it does not,
// -1 for the other builds.
int64_t selfspec_gguf_rows_amx() {
#ifdef SELFSPEC_GGUF_AMX
  return amx::permission() ? 1 : 0;
#else
  return -1;
#endif
}

// Bytes of one activation row of K inputs in format fmt (ggml type id: 8 Q8_0, 9 Q8_1, 15
// Q8_K), or -1 for another format or a K that is not a multiple of its block.
int64_t selfspec_gguf_act_row_bytes(int64_t fmt, int64_t K) { return act_row_bytes(fmt, K); }

// x: [M, K] fp32 (x_bf16 = 0) or bf16 -> out: [M, act_row_bytes(fmt, K)] blocks of fmt.
// Returns 0, or -1 (nothing written) for an unknown fmt or a K that does not fit it.
int64_t selfspec_gguf_quantize(int64_t fmt, const void* x, int64_t x_bf16, int64_t M, int64_t K,
                               uint8_t* out) {
  const int64_t row_bytes = act_row_bytes(fmt, K);
  if (row_bytes < 0) return -1;
  quantize_rows(fmt, x, x_bf16 != 0, M, K, row_bytes, out);
  return 0;
}

// out[t * ldo + n] (fp32, or bf16 where out_bf16) = weight row n . activation row t (+ bias[n])
// for t < M, n < N. w: [N, row bytes] blocks of type (ggml type id); act: for a quantized type,
// [M, act_row_bytes] in its activation format (selfspec_gguf_quantize), for F32/F16/BF16 the
// [M, K] fp32 input. K a multiple of the type's block. Returns 0, or -1 (nothing written) for
// an unsupported type or such a K.
int64_t selfspec_gguf_rows(int64_t type, const uint8_t* w, int64_t N, int64_t K, const void* act,
                           int64_t M, const float* bias, void* out, int64_t ldo, int64_t out_bf16) {
  const SelfspecGgufSegment seg{type, w, N, bias, 0};
  return product(&seg, 1, K, &act, M, out, ldo, out_bf16 != 0);
}

// The products of nseg segments (SelfspecGgufSegment) of one matrix of K inputs, segment s
// against acts[s] (as selfspec_gguf_rows' act), into their columns of out ([M, ldo]), in one
// parallel region. Returns 0, or -1 (nothing written) where a segment is refused.
int64_t selfspec_gguf_rows_segments(const SelfspecGgufSegment* segs, int64_t nseg, int64_t K,
                                    const void* const* acts, int64_t M, void* out, int64_t ldo,
                                    int64_t out_bf16) {
  return product(segs, nseg, K, acts, M, out, ldo, out_bf16 != 0);
}

// h_out = h_in + o(attention(RoPE(qkv(RMSNorm(h_in))))) on args->rows rows, appending their
// keys and values to the segments' caches first (fused_layers.h); matrices are
// SelfspecGgufMatrix.
void selfspec_gguf_attention(const AttentionArgs* args) { attention<GgufProduct>(*args); }

// h_out = h_in + down(SiLU(gate) * up), [gate, up] = gate_up(RMSNorm(h_in)).
void selfspec_gguf_mlp(const MlpArgs* args) { mlp<GgufProduct>(*args); }

}  // extern "C"
