// AMX int8 tiles for Q4_K and Q6_K rows (gguf_rows.cpp's AMX build, SELFSPEC_GGUF_AMX; it
// includes this after its own helpers: load32, u16, k_scales, BlockQ8_K, TypeQ4_K, TypeQ6_K).
//
// Why: on the VNNI build a call of M activation rows costs about M times the integer
// multiplies of one (a verification block of 8 tokens cost 2.2-3.7 one-token calls on
// Qwen2.5-1.5B's Q4_K / Q6_K matrices; prefill was compute-bound). An AMX tile multiply takes
// up to 16 activation rows against 16 weight rows at once.
//
// Scheme, per group of 16 weight rows and per 256-input block:
// - Calls of more than T::kSmallMax rows (group, group_q4k): the weights are decoded once into
//   B tiles in AMX's VNNI layout (row r: 16 weight rows x 4 consecutive codes; the 16 rows'
//   code dwords transposed in registers, transpose16x8). The activations (Q8_K, llama.cpp's
//   reference rounding, as in the other builds) are A tiles of up to 16 token rows (mc),
//   taken from a padded copy of their codes. Q4_K folds each sub-block's 6-bit scale into its
//   codes, split in two int8 halves (sl q, sh q), so a block is 8 tile multiplies into two
//   accumulators: S = C_lo + 8 C_hi. Q6_K (int8 scales, 6-bit codes: no int8 fold) takes one
//   multiply per sub-block of 16, each sum scaled by vpmulld: S = sum_i sc_i C_i.
// - Smaller calls (small_group): each weight row decoded and multiplied as the VNNI build does
//   (its exact integer block sums over 16 lanes), row after row, the lanes summed exactly.
// - Both: the block's integer sum S (and, Q4_K, the minima's sum_j m_j (bsum_2j + bsum_2j+1))
//   is exact; then per (token, weight row) in fp32, in this order: acc = fma(S, d dx, acc) and,
//   Q4_K, acc = fnma(Mn, dmin dx, acc) (Q4K::apply / Q6K::apply).
//
// Row consistency: S and Mn are exact integers and the fp32 steps act on each (token, weight
// row) lane alone in a fixed order, so a result is the same bits whatever M, the path, the
// tile height, the padding and the thread split. This build's numerics differ from the VNNI
// build's (which sums scaled blocks in 16 fp32 lanes) in the last bits.

// amx.h: included by gguf_rows.cpp at file scope.

// Calls of up to this many activation rows take small_group (measured: below, tiles cost more
// than they save).
#ifndef SELFSPEC_AMX_SMALL_Q4K
#define SELFSPEC_AMX_SMALL_Q4K 3
#endif
#ifndef SELFSPEC_AMX_SMALL_Q6K
#define SELFSPEC_AMX_SMALL_Q6K 4
#endif

namespace amx {

constexpr int kGroup = 16;  // weight rows a group: the 16 int32 columns of a C tile

using selfspec_amx::permission;
using selfspec_amx::TileConfig;

// Tiles 0 / 3: C (mc token rows of 16 int32); 1 / 4: A (mc token rows of ks codes); 2 / 5:
// B (ks / 4 rows of 16 weight rows x 4 codes). Two of each, so that a sub-block's multiply
// overlaps the previous one's scaling.
inline void configure(int mc, int ks) {
  TileConfig c;
  memset(&c, 0, sizeof(c));
  c.palette = 1;
  for (int t : {0, 3}) { c.rows[t] = static_cast<uint8_t>(mc); c.colsb[t] = 64; }
  for (int t : {1, 4}) {
    c.rows[t] = static_cast<uint8_t>(mc);
    c.colsb[t] = static_cast<uint16_t>(ks);
  }
  for (int t : {2, 5}) { c.rows[t] = static_cast<uint8_t>(ks / 4); c.colsb[t] = 64; }
  selfspec_amx::load_config(c);
}

// z[r] int32 lane n = dword r of the 32 bytes at rows[n] + off (n < 16, r < 8): the rows
// paired into zmm (row i with i + 4, 8 + i with 12 + i) so that after two unpack stages one
// vshufi32x4 puts the lanes in row order.
inline void transpose16x8(const uint8_t* const* rows, int64_t off, __m512i z[8]) {
  __m512i x[8];
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm512_inserti64x4(_mm512_castsi256_si512(load32(rows[i] + off)),
                              load32(rows[i + 4] + off), 1);
    x[4 + i] = _mm512_inserti64x4(_mm512_castsi256_si512(load32(rows[8 + i] + off)),
                                  load32(rows[12 + i] + off), 1);
  }
  __m512i u[8];
  for (int h = 0; h < 2; ++h) {
    const __m512i* s = x + 4 * h;
    const __m512i t0 = _mm512_unpacklo_epi32(s[0], s[1]), t1 = _mm512_unpackhi_epi32(s[0], s[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(s[2], s[3]), t3 = _mm512_unpackhi_epi32(s[2], s[3]);
    u[4 * h + 0] = _mm512_unpacklo_epi64(t0, t2);
    u[4 * h + 1] = _mm512_unpackhi_epi64(t0, t2);
    u[4 * h + 2] = _mm512_unpacklo_epi64(t1, t3);
    u[4 * h + 3] = _mm512_unpackhi_epi64(t1, t3);
  }
  for (int e = 0; e < 4; ++e) {
    z[e] = _mm512_shuffle_i32x4(u[e], u[4 + e], _MM_SHUFFLE(2, 0, 2, 0));
    z[4 + e] = _mm512_shuffle_i32x4(u[e], u[4 + e], _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// 16 fp16 values at rows[n] + off -> fp32 lanes.
inline __m512 gather_fp16(const uint8_t* const* rows, int64_t off) {
  alignas(32) uint16_t h[16];
  for (int n = 0; n < 16; ++n) h[n] = u16(rows[n] + off);
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h)));
}

// The activations of one call, in the tiles' layout: token rows padded to a multiple of mc.
struct Act {
  int64_t M = 0, mc = 1, mpad = 0, K = 0, nb = 0;
  bool small = false;          // M <= the type's kSmallMax: small_group, no tiles
  const uint8_t* raw = nullptr;  // the Q8_K rows themselves ([M, nb] blocks)
  std::vector<int8_t> qs;      // [mpad, K] codes (zero past M)
  std::vector<float> dx;       // [mpad, nb] Q8_K scales
  std::vector<int32_t> bpair;  // [mpad, nb, 4]: int16 (bsum32_2p, bsum32_2p+1), p < 4
};

// Q8_K rows act ([M, nb] blocks) -> Act.
inline std::shared_ptr<Act> prepare(const uint8_t* act, int64_t M, int64_t K, bool small) {
  auto a = std::make_shared<Act>();
  a->M = M;
  a->K = K;
  a->nb = K / 256;
  a->small = small;
  a->raw = act;
  a->mc = M <= 1 ? 1 : M <= 2 ? 2 : M <= 4 ? 4 : M <= 8 ? 8 : 16;
  a->mpad = (M + a->mc - 1) / a->mc * a->mc;
  if (!small) a->qs.assign(static_cast<size_t>(a->mpad * K), 0);
  a->dx.assign(static_cast<size_t>(a->mpad * a->nb), 0.f);
  a->bpair.assign(static_cast<size_t>(a->mpad * a->nb * 4), 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < a->nb; ++b) {
      const auto* blk = reinterpret_cast<const BlockQ8_K*>(act) + m * a->nb + b;
      if (!small) memcpy(a->qs.data() + m * K + 256 * b, blk->qs, 256);
      a->dx[m * a->nb + b] = blk->d;
      for (int p = 0; p < 4; ++p) {
        const int s0 = blk->bsums[4 * p] + blk->bsums[4 * p + 1];  // |s| <= 32 * 127
        const int s1 = blk->bsums[4 * p + 2] + blk->bsums[4 * p + 3];
        a->bpair[(m * a->nb + b) * 4 + p] =
            static_cast<int32_t>((static_cast<uint32_t>(s0) & 0xffffu) |
                                 (static_cast<uint32_t>(s1) << 16));
      }
    }
  return a;
}

// Q4_K (144 bytes: fp16 d, dmin, 12 bytes of 6-bit scales / minima, 128 bytes of nibbles).
struct Q4K {
  static constexpr int kSub = 8, kKs = 64;  // kKs: inputs an A tile row (Q4K: 64)
  static constexpr int64_t kSmallMax = SELFSPEC_AMX_SMALL_Q4K;
  static constexpr int64_t kBytes = 144;
  using Vnni = TypeQ4_K;  // the VNNI build's type: small calls (small_group)
  struct Scales {
    __m512i sc[kSub];  // int32 scale per weight row
    __m512i minp[4];   // int16 (m_2p, m_2p+1) per weight row
    __m512 d, dmin;
  };
  // B tiles per 64 inputs c (rows 0-7: sub-block 2c, 8-15: 2c + 1) with each sub-block's
  // 6-bit scale split sc = 8 sh + sl (sl, sh < 8) and folded into the codes: lo = sl q, hi =
  // sh q (<= 105, int8), so that S = C_lo + 8 C_hi sums a whole block in two tiles.
  struct Decoded {
    alignas(64) int8_t lo[4][16 * 64];
    alignas(64) int8_t hi[4][16 * 64];
    Scales s;
  };
  // rows[n]: weight row n's block.
  static void decode(const uint8_t* const* rows, Decoded& w) {
    scales(rows, w.s);
    // per sub-block, sl and sh in both int16 halves of each row's dword: one vpmullw scales
    // two code bytes, exactly (q s <= 105 stays within its byte)
    __m512i sl[kSub], sh[kSub];
    const __m512i seven = _mm512_set1_epi32(7);
    for (int j = 0; j < kSub; ++j) {
      const __m512i l = _mm512_and_si512(w.s.sc[j], seven), h = _mm512_srli_epi32(w.s.sc[j], 3);
      sl[j] = _mm512_or_si512(l, _mm512_slli_epi32(l, 16));
      sh[j] = _mm512_or_si512(h, _mm512_slli_epi32(h, 16));
    }
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < 4; ++c) {  // 64 inputs: low nibbles sub-block 2c, high 2c + 1
      __m512i z[8];
      transpose16x8(rows, 16 + 32 * c, z);
      for (int r = 0; r < 8; ++r) {
        const __m512i q0 = _mm512_and_si512(z[r], low4);
        const __m512i q1 = _mm512_and_si512(_mm512_srli_epi16(z[r], 4), low4);
        _mm512_store_si512(w.lo[c] + 64 * r, _mm512_mullo_epi16(q0, sl[2 * c]));
        _mm512_store_si512(w.lo[c] + 64 * (8 + r), _mm512_mullo_epi16(q1, sl[2 * c + 1]));
        _mm512_store_si512(w.hi[c] + 64 * r, _mm512_mullo_epi16(q0, sh[2 * c]));
        _mm512_store_si512(w.hi[c] + 64 * (8 + r), _mm512_mullo_epi16(q1, sh[2 * c + 1]));
      }
    }
  }
  // The block heads transposed (bytes 0-31: z[0] = d | dmin << 16, z[1..3] the 12 scale
  // bytes), then get_scale_min_k4 on every row at once: for j < 4, sc_j = byte j of z[1] & 63,
  // m_j = byte j of z[2] & 63; sc_j+4 = (byte j of z[3] & 15) | (byte j of z[1] >> 6) << 4,
  // m_j+4 = (byte j of z[3] >> 4) | (byte j of z[2] >> 6) << 4.
  static void scales(const uint8_t* const* rows, Scales& w) {
    __m512i z[8];
    transpose16x8(rows, 0, z);
    const __m512i b63 = _mm512_set1_epi32(63), b15 = _mm512_set1_epi32(15),
                  b3 = _mm512_set1_epi32(3);
    __m512i m[kSub];
    for (int j = 0; j < 4; ++j) {
      const __m512i s1 = _mm512_srli_epi32(z[1], 8 * j), s2 = _mm512_srli_epi32(z[2], 8 * j),
                    s3 = _mm512_srli_epi32(z[3], 8 * j);
      w.sc[j] = _mm512_and_si512(s1, b63);
      m[j] = _mm512_and_si512(s2, b63);
      const __m512i top_sc = _mm512_and_si512(_mm512_srli_epi32(s1, 6), b3),
                    top_m = _mm512_and_si512(_mm512_srli_epi32(s2, 6), b3);
      w.sc[j + 4] = _mm512_or_si512(_mm512_and_si512(s3, b15), _mm512_slli_epi32(top_sc, 4));
      m[j + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s3, 4), b15),
                                 _mm512_slli_epi32(top_m, 4));
    }
    for (int p = 0; p < 4; ++p)
      w.minp[p] = _mm512_or_si512(m[2 * p], _mm512_slli_epi32(m[2 * p + 1], 16));
    const __m512i h = _mm512_set1_epi32(0xffff);
    w.d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(z[0], h)));
    w.dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(z[0], 16)));
  }
  static void small_scales(const uint8_t* const* rows, Scales& w) { scales(rows, w); }
  static void finish(const Scales& w, const Act& a, int64_t m, int64_t b, __m512i s,
                     float* acc) {
    const int32_t* bp = a.bpair.data() + (m * a.nb + b) * 4;
    __m512i mn = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) mn = _mm512_dpwssd_epi32(mn, w.minp[p], _mm512_set1_epi32(bp[p]));
    apply(w.d, w.dmin, s, mn, a.dx[m * a.nb + b], acc);
  }
  // acc = fma(S, d dx, acc), then fnma(Mn, dmin dx): the only fp32 steps, lane by lane.
  static void apply(__m512 d, __m512 dmin, __m512i s, __m512i mn, float dx, float* acc) {
    const __m512 x = _mm512_set1_ps(dx);
    __m512 v = _mm512_load_ps(acc);
    v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, x), v);
    v = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mn), _mm512_mul_ps(dmin, x), v);
    _mm512_store_ps(acc, v);
  }
};

// Q6_K (210 bytes: ql[128], qh[64], int8 scales[16], fp16 d); see gguf_rows.cpp's TypeQ6_K.
struct Q6K {
  static constexpr int kSub = 16, kKs = 16;
  static constexpr int64_t kSmallMax = SELFSPEC_AMX_SMALL_Q6K;
  static constexpr int64_t kBytes = 210;
  using Vnni = TypeQ6_K;
  struct Scales {
    __m512i sc[kSub];
    __m512 d;
  };
  struct Decoded {
    alignas(64) int8_t b[kSub][4 * 64];
    Scales s;
  };
  static void decode(const uint8_t* const* rows, Decoded& w) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30),
                  off = _mm512_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {  // 128 inputs: ql 64 bytes, qh 32
      __m512i ql0[8], ql1[8], qh[8];
      transpose16x8(rows, 64 * h, ql0);
      transpose16x8(rows, 64 * h + 32, ql1);
      transpose16x8(rows, 128 + 32 * h, qh);
      for (int k = 0; k < 4; ++k)  // inputs 128h + 32k + l: ql[l + 32 (k & 1)], qh bits 2k, 2k + 1
        for (int r = 0; r < 8; ++r) {
          __m512i lo = (k & 1) ? ql1[r] : ql0[r];
          if (k >= 2) lo = _mm512_srli_epi16(lo, 4);
          // bits 2k, 2k + 1 of each byte to bits 4, 5 (16-bit shifts: the mask keeps each
          // byte's own bits)
          const __m512i hi = k == 0 ? _mm512_slli_epi16(qh[r], 4)
                             : k == 1 ? _mm512_slli_epi16(qh[r], 2)
                             : k == 2 ? qh[r]
                                      : _mm512_srli_epi16(qh[r], 2);
          const __m512i u =
              _mm512_or_si512(_mm512_and_si512(lo, low4), _mm512_and_si512(hi, bits45));
          _mm512_store_si512(w.b[8 * h + 2 * k + r / 4] + 64 * (r % 4), _mm512_sub_epi8(u, off));
        }
    }
    scales(rows, w.s);
  }
  static void scales(const uint8_t* const* rows, Scales& w) {
    __m512i z[8];
    transpose16x8(rows, 176, z);  // bytes 176..207: z[4..7] are the 16 scales
    for (int i = 0; i < kSub; ++i)
      w.sc[i] = _mm512_srai_epi32(_mm512_slli_epi32(z[4 + i / 4], 24 - 8 * (i % 4)), 24);
    w.d = gather_fp16(rows, 208);
  }
  // The small path's sums include the sub-blocks' scales: d only.
  static void small_scales(const uint8_t* const* rows, Scales& w) { w.d = gather_fp16(rows, 208); }
  static void finish(const Scales& w, const Act& a, int64_t m, int64_t b, __m512i s,
                     float* acc) {
    apply(w.d, w.d, s, s, a.dx[m * a.nb + b], acc);
  }
  static void apply(__m512 d, __m512, __m512i s, __m512i, float dx, float* acc) {
    const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx));
    _mm512_store_ps(acc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, _mm512_load_ps(acc)));
  }
};

// acc ([a.mpad, 16] fp32, zeroed by the caller) = weight rows wrows[0..15] (each nb blocks of
// T) . every activation row; tiles configured for (MC, T::kKs).
template <class T, int MC>
void group(const uint8_t* const* wrows, const Act& a, float* acc) {
  typename T::Decoded w;
  alignas(64) int32_t cbuf[2][16][16];
  const uint8_t* rows[16];
  for (int64_t b = 0; b < a.nb; ++b) {
    for (int n = 0; n < 16; ++n) {
      rows[n] = wrows[n] + b * T::kBytes;
      for (int64_t o = 0; o < T::kBytes; o += 64)  // the next block of each row
        _mm_prefetch(reinterpret_cast<const char*>(rows[n] + T::kBytes + o), _MM_HINT_T0);
    }
    T::decode(rows, w);
    for (int64_t m0 = 0; m0 < a.mpad; m0 += MC) {
      const int8_t* aq = a.qs.data() + m0 * a.K + 256 * b;
      __m512i s[MC];
      for (int m = 0; m < MC; ++m) s[m] = _mm512_setzero_si512();
      for (int j = 0; j < T::kSub; j += 2) {
        _tile_loadd(1, aq + T::kKs * j, a.K);
        _tile_loadd(2, w.b[j], 64);
        _tile_zero(0);
        _tile_dpbssd(0, 1, 2);
        _tile_loadd(4, aq + T::kKs * (j + 1), a.K);
        _tile_loadd(5, w.b[j + 1], 64);
        _tile_zero(3);
        _tile_dpbssd(3, 4, 5);
        _tile_stored(0, cbuf[0], 64);
        for (int m = 0; m < MC; ++m)
          s[m] = _mm512_add_epi32(s[m],
                                  _mm512_mullo_epi32(_mm512_load_si512(cbuf[0][m]), w.s.sc[j]));
        _tile_stored(3, cbuf[1], 64);
        for (int m = 0; m < MC; ++m)
          s[m] = _mm512_add_epi32(
              s[m], _mm512_mullo_epi32(_mm512_load_si512(cbuf[1][m]), w.s.sc[j + 1]));
      }
      for (int m = 0; m < MC; ++m) T::finish(w.s, a, m0 + m, b, s[m], acc + (m0 + m) * 16);
    }
  }
}

// r lane n = the sum of v[n]'s 16 int32 lanes (exact): pairwise unpack-adds, then 128-bit
// lane shuffles.
inline __m512i reduce16(const __m512i* v) {
  __m512i r[8], q[4];
  for (int i = 0; i < 8; ++i)
    r[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    q[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(r[2 * i], r[2 * i + 1]),
                            _mm512_unpackhi_epi64(r[2 * i], r[2 * i + 1]));
  // q[i] 128-bit lane L: lane L's partial sums of v[4i .. 4i + 3]
  const __m512i p = _mm512_add_epi32(_mm512_shuffle_i32x4(q[0], q[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_i32x4(q[0], q[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i o = _mm512_add_epi32(_mm512_shuffle_i32x4(q[2], q[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_i32x4(q[2], q[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(p, o, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(p, o, _MM_SHUFFLE(3, 1, 3, 1)));
}

// As group, for MT = a.M <= 4 activation rows without tiles: each weight row decoded and
// multiplied as in the VNNI build (T::Vnni's exact integer block sums over 16 lanes), row
// after row (memory read in order, as the VNNI build: interleaving the 16 rows' blocks cost
// up to 45% at one row), the lanes then summed exactly (reduce16) and T::finish applied per
// block: the same bits as group.
// A thread's buffer for small_group, kept across its groups (grown, never shrunk).
struct Scratch {
  std::vector<__m512i> sums;
};

template <class T, int MT>
void small_group(const uint8_t* const* wrows, const Act& a, float* acc, Scratch& scratch) {
  using V = typename T::Vnni;
  typename V::Decoded dw;
  const int64_t nb = a.nb;
  // [MT, nb, 16 rows]: block sums (16 lanes)
  scratch.sums.resize(std::max<size_t>(scratch.sums.size(), MT * nb * 16));
  __m512i* sums = scratch.sums.data();
  const auto* x = reinterpret_cast<const BlockQ8_K*>(a.raw);
  for (int n = 0; n < 16; ++n) {
    const uint8_t* row = wrows[n];
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* ahead = row + b * T::kBytes + kPrefetch;
      for (int64_t o = 0; o < T::kBytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
      V::decode(row + b * T::kBytes, dw, 1);
      for (int t = 0; t < MT; ++t) sums[(t * nb + b) * 16 + n] = V::isum(dw, x[t * nb + b]);
    }
  }
  // The scales (Q4_K's minima: their sums per token by vpdpwssd over the 16 rows, as group
  // does) from the block heads, read again while cached.
  typename T::Scales sc;
  const uint8_t* rows[16];
  for (int64_t b = 0; b < nb; ++b) {
    for (int n = 0; n < 16; ++n) rows[n] = wrows[n] + b * T::kBytes;
    T::small_scales(rows, sc);
    for (int t = 0; t < MT; ++t)
      T::finish(sc, a, t, b, reduce16(&sums[(t * nb + b) * 16]), acc + t * 16);
  }
}

// group for Q4_K: per block, four 64-input steps into two accumulators (C_lo, C_hi), one
// store each (tiles: 0 C_lo, 3 C_hi, 1 A, 2 B_lo, 5 B_hi).
template <int MC>
void group_q4k(const uint8_t* const* wrows, const Act& a, float* acc) {
  Q4K::Decoded w;
  alignas(64) int32_t cbuf[2][16][16];
  const uint8_t* rows[16];
  for (int64_t b = 0; b < a.nb; ++b) {
    for (int n = 0; n < 16; ++n) {
      rows[n] = wrows[n] + b * Q4K::kBytes;
      for (int64_t o = 0; o < Q4K::kBytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rows[n] + 2 * Q4K::kBytes + o), _MM_HINT_T0);
    }
    Q4K::decode(rows, w);
    for (int64_t m0 = 0; m0 < a.mpad; m0 += MC) {
      const int8_t* aq = a.qs.data() + m0 * a.K + 256 * b;
      _tile_zero(0);
      _tile_zero(3);
      for (int c = 0; c < 4; ++c) {
        _tile_loadd(1, aq + 64 * c, a.K);
        _tile_loadd(2, w.lo[c], 64);
        _tile_loadd(5, w.hi[c], 64);
        _tile_dpbssd(0, 1, 2);
        _tile_dpbssd(3, 1, 5);
      }
      _tile_stored(0, cbuf[0], 64);
      _tile_stored(3, cbuf[1], 64);
      for (int m = 0; m < MC; ++m) {
        const __m512i s = _mm512_add_epi32(_mm512_load_si512(cbuf[0][m]),
                                           _mm512_slli_epi32(_mm512_load_si512(cbuf[1][m]), 3));
        Q4K::finish(w.s, a, m0 + m, b, s, acc + (m0 + m) * 16);
      }
    }
  }
}

template <class T>
void run(const uint8_t* const* wrows, const Act& a, float* acc, Scratch& scratch) {
  if (a.small) {
    switch (a.M) {
      case 4: small_group<T, 4>(wrows, a, acc, scratch); return;
      case 3: small_group<T, 3>(wrows, a, acc, scratch); return;
      case 2: small_group<T, 2>(wrows, a, acc, scratch); return;
      default: small_group<T, 1>(wrows, a, acc, scratch); return;
    }
  }
  if constexpr (std::is_same<T, Q4K>::value) {
    switch (a.mc) {
      case 16: group_q4k<16>(wrows, a, acc); break;
      case 8: group_q4k<8>(wrows, a, acc); break;
      case 4: group_q4k<4>(wrows, a, acc); break;
      case 2: group_q4k<2>(wrows, a, acc); break;
      default: group_q4k<1>(wrows, a, acc); break;
    }
  } else {
    switch (a.mc) {
      case 16: group<T, 16>(wrows, a, acc); break;
      case 8: group<T, 8>(wrows, a, acc); break;
      case 4: group<T, 4>(wrows, a, acc); break;
      case 2: group<T, 2>(wrows, a, acc); break;
      default: group<T, 1>(wrows, a, acc); break;
    }
  }
}

}  // namespace amx
