// Q4_K with 8 rows interleaved (QTensor layout "x8", made once at load in place of the file's bytes):
// the products read 8 weight rows with one 32-byte load and form their int8 dots with x at once
// (vpdpbusd with AVX512-VNNI, 16 rows a zmm; vpmaddubsw + vpmaddwd on AVX2). A group of 8 rows holds per
// 256-value super-block exactly the bytes of its 8 blocks (1152 = 8 x 144), reordered:
//   d[8], dmin[8]          f16, one per row
//   u0[8], u1[8], u2[8]    the 12 bytes of 6-bit scales and mins of each row, as three 32-bit words
//                          (bytes 0-3, 4-7, 8-11): ggml's get_scale_min_k4 then runs on 8 rows at once
//   qs[4 chunks c][8 steps l][8 rows][4 bytes]: bytes 32c + 4l .. 32c + 4l + 3 of each row's qs (low
//        nibbles: values 64c + 4l.. of sub-block 2c; high nibbles: values 64c + 32 + 4l.. of sub-block 2c + 1)
// The integers and scales multiplied are ggml's (vec_dot_q4_K_q8_K): per super-block and row an int32
// sum_j sc_j dot(u_j, q_j) times d_x d_w, minus d_x dmin_w sum_j m_j bsum_j; only the float additions'
// order differs. Repacking is a permutation of bytes: unpack gives the file's bytes back.
// Also here, for every x8 layout (quant_x8_q6.h, quant_x8_mx.h, quant_x8_signed.h): the vector ops on 8 or 16 rows
// (V8, V16) and X8Layout (pack, unpack and dequant_lane from a layout's map of where each piece of a row's block goes).
#pragma once
#include "quant_ktypes.h"

namespace qk {

// vpshufb masks on the scale words (one 32-bit word per row): byte b of each word zero-extended to 32 bits
// (a sub-block's scale for vpmulld), to two int16 (the scale for vpmaddwd on both pair sums), and bytes
// 2q, 2q + 1 as two int16 (a pair of mins for vpmaddwd with the pair of x's 32-value sums)
#define X8_MASK(a, b, c, d) {a, b, c, d, 4 + a, 4 + b, 4 + c, 4 + d, 8 + a, 8 + b, 8 + c, 8 + d, 12 + a, 12 + b, 12 + c, 12 + d}
#define Z (-128)
alignas(16) constexpr int8_t X8_B32[4][16] = {X8_MASK(0, Z, Z, Z), X8_MASK(1, Z, Z, Z), X8_MASK(2, Z, Z, Z), X8_MASK(3, Z, Z, Z)};
alignas(16) constexpr int8_t X8_B16[4][16] = {X8_MASK(0, Z, 0, Z), X8_MASK(1, Z, 1, Z), X8_MASK(2, Z, 2, Z), X8_MASK(3, Z, 3, Z)};
alignas(16) constexpr int8_t X8_PAIR[2][16] = {X8_MASK(0, Z, 1, Z), X8_MASK(2, Z, 3, Z)};
#undef Z

// get_scale_min_k4 on 32-bit words u0, u1, u2 of several rows at once (__m256i: 8 rows, __m512i: 16):
// scales 0-3, mins 0-3, scales 4-7, mins 4-7, a byte per sub-block in each row's word
template <class V, class A, class O, class SR, class SL, class S1>
static inline void scales_x8(V u0, V u1, V u2, V out[4], A and_, O or_, SR srl, SL sll, S1 set1) {
  const V m6 = set1(0x3f3f3f3f), m4 = set1(0x0f0f0f0f), m2 = set1(0x03030303);
  out[0] = and_(u0, m6);
  out[1] = and_(u1, m6);
  out[2] = or_(and_(u2, m4), sll(and_(srl(u0, 6), m2), 4));
  out[3] = or_(and_(srl(u2, 4), m4), sll(and_(srl(u1, 6), m2), 4));
}

// The vector ops the x8 kernels use, on 8 rows (one group, __m256i) or 16 (two groups, __m512i: the
// second group gs bytes after the first)
struct V8 {
  using I = __m256i;
  using F = __m256;
  static I load(const uint8_t* p, int64_t) { return ld(p); }
  static F half(const uint8_t* p, int64_t) { return _mm256_cvtph_ps(ld16(p)); }
  static I mask(const int8_t* m) { return _mm256_broadcastsi128_si256(ld16(m)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I srl16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I sll16(I a, int n) { return _mm256_slli_epi16(a, n); }
  static I sra16(I a, int n) { return _mm256_srai_epi16(a, n); }
  static I sll32(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I srl32(I a, int n) { return _mm256_srli_epi32(a, n); }
  static I sra32(I a, int n) { return _mm256_srai_epi32(a, n); }
  static I shuffle(I a, I m) { return _mm256_shuffle_epi8(a, m); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I madd(I a, I b) { return _mm256_madd_epi16(a, b); }
  static I maddubs(I u, I s) { return _mm256_maddubs_epi16(u, s); }
  static I sign8(I a, I s) { return _mm256_sign_epi8(a, s); }    // a negated where s < 0 (where s == 0: 0)
  static I abs8(I a) { return _mm256_abs_epi8(a); }
  static I u16(const uint8_t* p, int64_t) { return _mm256_cvtepu16_epi32(ld16(p)); }
#ifdef __AVX512VNNI__
  static constexpr bool DPBUSD = true;
  static I dpbusd(I acc, I u, I s) { return _mm256_dpbusd_epi32(acc, u, s); }
#else
  static constexpr bool DPBUSD = false;
  static I dpbusd(I acc, I, I) { return acc; }
#endif
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset1(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, I b, F c) { return _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(b), c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm256_add_ps(a, b); }
  static F fmaf(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F e8m0(const uint8_t* p, int64_t) { return e8m0_half8(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
#ifdef __AVX512F__
struct V16 {
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p, int64_t gs) { return join(ld(p), ld(p + gs)); }
  static F half(const uint8_t* p, int64_t gs) { return _mm512_cvtph_ps(_mm256_set_m128i(ld16(p + gs), ld16(p))); }
  static I mask(const int8_t* m) { return _mm512_broadcast_i32x4(ld16(m)); }
  static I zero() { return _mm512_setzero_si512(); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I srl16(I a, int n) { return _mm512_srli_epi16(a, n); }
  static I sll16(I a, int n) { return _mm512_slli_epi16(a, n); }
  static I sra16(I a, int n) { return _mm512_srai_epi16(a, n); }
  static I sll32(I a, int n) { return _mm512_slli_epi32(a, n); }
  static I srl32(I a, int n) { return _mm512_srli_epi32(a, n); }
  static I sra32(I a, int n) { return _mm512_srai_epi32(a, n); }
  static I shuffle(I a, I m) { return _mm512_shuffle_epi8(a, m); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I madd(I a, I b) { return _mm512_madd_epi16(a, b); }
  static I maddubs(I u, I s) { return _mm512_maddubs_epi16(u, s); }
  static I sign8(I a, I s) { return _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(s), _mm512_setzero_si512(), a); }
  static I abs8(I a) { return _mm512_abs_epi8(a); }
  static I u16(const uint8_t* p, int64_t gs) { return _mm512_cvtepu16_epi32(_mm256_set_m128i(ld16(p + gs), ld16(p))); }
  static constexpr bool DPBUSD = true;
  static I dpbusd(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, I b, F c) { return _mm512_fmadd_ps(a, _mm512_cvtepi32_ps(b), c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm512_add_ps(a, b); }
  static F fmaf(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F e8m0(const uint8_t* p, int64_t gs) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(V8::e8m0(p, 0)), V8::e8m0(p + gs, 0), 1);
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

// A layout given by where each piece of a row's block goes (T::pieces(r, f): f(offset in the file's block, offset
// in the group's block, bytes) for row r): its pack, unpack and dequant_lane, and the group kernels' entry points
// on T::dot_v, 8 rows (dot) or 16 (dot2, avx512; DOT2 says whether a layout has one). Src: the file's type (its
// dequant_row).
template <class T, class Src> struct X8Layout {
  static void pack(const uint8_t* src, int64_t rb, int64_t K, uint8_t* dst) {
    for (int64_t b = 0; b < K / T::QK; ++b, dst += T::GBYTES)
      for (int r = 0; r < T::G; ++r) {
        const uint8_t* p = src + r * rb + b * T::SRC;
        T::pieces(r, [&](int s, int d, int n) { memcpy(dst + d, p + s, n); });
      }
  }
  static void unpack(const uint8_t* g, int lane, int64_t K, uint8_t* dst) {
    for (int64_t b = 0; b < K / T::QK; ++b, g += T::GBYTES, dst += T::SRC)
      T::pieces(lane, [&](int s, int d, int n) { memcpy(dst + s, g + d, n); });
  }
  static void dequant_lane(const uint8_t* g, int lane, int64_t K, float* y) {
    alignas(32) uint8_t blk[T::SRC];
    for (int64_t b = 0; b < K / T::QK; ++b, g += T::GBYTES, y += T::QK) {
      unpack(g, lane, T::QK, blk);
      Src::dequant_row(blk, T::QK, y);
    }
  }
  template <int NX> static void dot(const uint8_t* g, int64_t K, const XRow* x, float* out, int64_t ldo) {
    T::template dot_v<V8, NX>(g, K, x, out, ldo);
  }
#ifdef __AVX512F__
  static constexpr bool DOT2 = true;
  template <int NX> static void dot2(const uint8_t* g, int64_t K, const XRow* x, float* out, int64_t ldo) {
    T::template dot_v<V16, NX>(g, K, x, out, ldo);
  }
#else
  static constexpr bool DOT2 = false;
#endif
};

struct Q4_K_X8 : X8Layout<Q4_K_X8, Q4_K> {     // its own dot and dot2 (one per ISA) hide X8Layout's
  static constexpr int G = 8, QK = 256, SRC = 144, GBYTES = G * SRC, BYTES = SRC;
  static constexpr int U = 32, QS = 128;
  static constexpr XFmt FMT = X_Q8_K;

  template <class F> static void pieces(int r, const F& f) {
    f(0, 2 * r, 2);
    f(2, 16 + 2 * r, 2);
    for (int i = 0; i < 3; ++i) f(4 + 4 * i, U + 32 * i + 4 * r, 4);
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 8; ++l) f(16 + 32 * c + 4 * l, QS + 256 * c + 32 * l + 4 * r, 4);
  }
  // x's 32-value sums of sub-blocks 2p, 2p + 1 as two int16 in one int32 (for vpmaddwd with a pair of mins)
  static inline int32_t bsum_pair(const int16_t* bs, int p) {
    return (int32_t)((uint32_t)(uint16_t)(bs[4 * p] + bs[4 * p + 1]) | (uint32_t)(uint16_t)(bs[4 * p + 2] + bs[4 * p + 3]) << 16);
  }

  // out[r * ldo + lane] = row lane of the group . x[r], r < NX
  template <int NX> static void dot(const uint8_t* g, int64_t K, const XRow* x, float* out, int64_t ldo) {
    __m256 acc[NX];
    FOR_X acc[r] = _mm256_setzero_ps();
    const auto mask = [](const int8_t* m) { return _mm256_broadcastsi128_si256(ld16(m)); };
    for (int64_t b = 0; b < K / QK; ++b, g += GBYTES) {
      __m256i sm[4];                                   // scales 0-3, mins 0-3, scales 4-7, mins 4-7
      scales_x8(ld(g + U), ld(g + U + 32), ld(g + U + 64), sm, _mm256_and_si256, _mm256_or_si256,
                [](__m256i v, int n) { return _mm256_srli_epi32(v, n); }, [](__m256i v, int n) { return _mm256_slli_epi32(v, n); },
                [](int v) { return _mm256_set1_epi32(v); });
      const int8_t* q[NX];
      __m256i sumi[NX];
      FOR_X { q[r] = x[r].q + QK * b; sumi[r] = _mm256_setzero_si256(); }
      const uint8_t* qs = g + QS;
      for (int c = 0; c < 4; ++c, qs += 256) {
        const __m256i sc = sm[c < 2 ? 0 : 2];          // sub-blocks 2c, 2c + 1: bytes (2c) % 4, (2c + 1) % 4
        const int j0 = (2 * c) % 4;
#ifdef __AVX512VNNI__
        // one int32 dot per sub-block (8 steps of 4 values), then times its 8 rows' scales
        __m256i lo[NX], hi[NX];
        FOR_X lo[r] = hi[r] = _mm256_setzero_si256();
        _Pragma("GCC unroll 8") for (int l = 0; l < 8; ++l) {
          const __m256i w = ld(qs + 32 * l), wl = lo4(w), wh = hi4(w);
          FOR_X {
            int32_t a, h;
            memcpy(&a, q[r] + 64 * c + 4 * l, 4);
            memcpy(&h, q[r] + 64 * c + 32 + 4 * l, 4);
            lo[r] = _mm256_dpbusd_epi32(lo[r], wl, _mm256_set1_epi32(a));
            hi[r] = _mm256_dpbusd_epi32(hi[r], wh, _mm256_set1_epi32(h));
          }
        }
        const __m256i s0 = _mm256_shuffle_epi8(sc, mask(X8_B32[j0])), s1 = _mm256_shuffle_epi8(sc, mask(X8_B32[j0 + 1]));
        FOR_X sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(_mm256_mullo_epi32(lo[r], s0), _mm256_mullo_epi32(hi[r], s1)));
#else
        // a sub-block's 8 steps of vpmaddubsw pair sums added as int16 (|8 x 2 x 15 x 128| = 30720 fits), then
        // one vpmaddwd with the row's scale as two int16: 2 vpmaddwd a sub-block instead of 16
        __m256i lo[NX], hi[NX];
        FOR_X lo[r] = hi[r] = _mm256_setzero_si256();
        _Pragma("GCC unroll 8") for (int l = 0; l < 8; ++l) {
          const __m256i w = ld(qs + 32 * l), wl = lo4(w), wh = hi4(w);
          FOR_X {
            int32_t a, h;
            memcpy(&a, q[r] + 64 * c + 4 * l, 4);
            memcpy(&h, q[r] + 64 * c + 32 + 4 * l, 4);
            lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(wl, _mm256_set1_epi32(a)));
            hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(wh, _mm256_set1_epi32(h)));
          }
          FOR_X { pin(lo[r]); pin(hi[r]); }
        }
        const __m256i s0 = _mm256_shuffle_epi8(sc, mask(X8_B16[j0])), s1 = _mm256_shuffle_epi8(sc, mask(X8_B16[j0 + 1]));
        FOR_X sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(_mm256_madd_epi16(lo[r], s0), _mm256_madd_epi16(hi[r], s1)));
#endif
      }
      // mins: sum_j m_j bsum_j, pairs of mins (j = 2p, 2p + 1) against pairs of x's sums
      const __m256i mn[4] = {_mm256_shuffle_epi8(sm[1], mask(X8_PAIR[0])), _mm256_shuffle_epi8(sm[1], mask(X8_PAIR[1])),
                             _mm256_shuffle_epi8(sm[3], mask(X8_PAIR[0])), _mm256_shuffle_epi8(sm[3], mask(X8_PAIR[1]))};
      const __m256 dw = _mm256_cvtph_ps(ld16(g)), dm = _mm256_cvtph_ps(ld16(g + 16));
      FOR_X {
        const int16_t* bs = x[r].bs + 16 * b;
        __m256i summ = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) summ = _mm256_add_epi32(summ, _mm256_madd_epi16(mn[p], _mm256_set1_epi32(bsum_pair(bs, p))));
        const __m256 dx = _mm256_set1_ps(x[r].d[b]);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dx, dw), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dx, dm), _mm256_cvtepi32_ps(summ), acc[r]);
      }
    }
    FOR_X _mm256_storeu_ps(out + r * ldo, acc[r]);
  }

#ifdef __AVX512F__
  // two groups at once, g and the next one (g + gs bytes): 16 rows in the lanes of one zmm, each x
  // broadcast feeding 16 rows. out[r * ldo + lane], lane < 16
  template <int NX> static void dot2(const uint8_t* g, int64_t K, const XRow* x, float* out, int64_t ldo) {
    const int64_t gs = K / QK * GBYTES;
    const auto both = [&](const uint8_t* p) { return join(ld(p), ld(p + gs)); };
    const auto mask = [](const int8_t* m) { return _mm512_broadcast_i32x4(ld16(m)); };
    __m512 acc[NX];
    FOR_X acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / QK; ++b, g += GBYTES) {
      __m512i sm[4];
      scales_x8(both(g + U), both(g + U + 32), both(g + U + 64), sm, _mm512_and_si512, _mm512_or_si512,
                [](__m512i v, int n) { return _mm512_srli_epi32(v, n); }, [](__m512i v, int n) { return _mm512_slli_epi32(v, n); },
                [](int v) { return _mm512_set1_epi32(v); });
      const int8_t* q[NX];
      __m512i sumi[NX];
      FOR_X { q[r] = x[r].q + QK * b; sumi[r] = _mm512_setzero_si512(); }
      const uint8_t* qs = g + QS;
      for (int c = 0; c < 4; ++c, qs += 256) {
        __m512i lo[NX], hi[NX];
        FOR_X lo[r] = hi[r] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int l = 0; l < 8; ++l) {
          const __m512i w = both(qs + 32 * l), wl = lo4(w), wh = hi4(w);
          FOR_X {
            int32_t a, h;
            memcpy(&a, q[r] + 64 * c + 4 * l, 4);
            memcpy(&h, q[r] + 64 * c + 32 + 4 * l, 4);
            lo[r] = _mm512_dpbusd_epi32(lo[r], wl, _mm512_set1_epi32(a));
            hi[r] = _mm512_dpbusd_epi32(hi[r], wh, _mm512_set1_epi32(h));
          }
        }
        const __m512i sc = sm[c < 2 ? 0 : 2];
        const int j0 = (2 * c) % 4;
        const __m512i s0 = _mm512_shuffle_epi8(sc, mask(X8_B32[j0])), s1 = _mm512_shuffle_epi8(sc, mask(X8_B32[j0 + 1]));
        FOR_X sumi[r] = _mm512_add_epi32(sumi[r], _mm512_add_epi32(_mm512_mullo_epi32(lo[r], s0), _mm512_mullo_epi32(hi[r], s1)));
      }
      const __m512i mn[4] = {_mm512_shuffle_epi8(sm[1], mask(X8_PAIR[0])), _mm512_shuffle_epi8(sm[1], mask(X8_PAIR[1])),
                             _mm512_shuffle_epi8(sm[3], mask(X8_PAIR[0])), _mm512_shuffle_epi8(sm[3], mask(X8_PAIR[1]))};
      const __m512 dw = _mm512_cvtph_ps(_mm256_set_m128i(ld16(g + gs), ld16(g))),
                   dm = _mm512_cvtph_ps(_mm256_set_m128i(ld16(g + gs + 16), ld16(g + 16)));
      FOR_X {
        const int16_t* bs = x[r].bs + 16 * b;
        __m512i summ = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p) summ = _mm512_add_epi32(summ, _mm512_madd_epi16(mn[p], _mm512_set1_epi32(bsum_pair(bs, p))));
        const __m512 dx = _mm512_set1_ps(x[r].d[b]);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dx, dw), _mm512_cvtepi32_ps(sumi[r]), acc[r]);
        acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dx, dm), _mm512_cvtepi32_ps(summ), acc[r]);
      }
    }
    FOR_X _mm512_storeu_ps(out + r * ldo, acc[r]);
  }
#endif
};

}  // namespace qk
