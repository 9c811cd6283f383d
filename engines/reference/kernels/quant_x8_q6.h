// Q6_K with 8 rows interleaved (QTensor layout "x8", the rest of a Q4_K_M file's experts: its ffn_down in
// the layers llama.cpp's use_more_bits picks), as quant_x8.h does for Q4_K. A group of 8 rows holds per
// 256-value super-block exactly the bytes of its 8 blocks (1680 = 8 x 210), reordered:
//   d[8]                     f16, one per row
//   sc[4 words i][8 rows]    int8 scales 4i..4i+3 of each row (one per 16 values), a 32-bit word a row
//   steps[2 halves h][8 steps l]: 96 bytes a step, read in this order (one sequential stream, as the
//        hardware prefetcher wants it): ql[64h + 4l ..], ql[64h + 32 + 4l ..] and qh[32h + 4l ..], each as
//        [8 rows][4 bytes]
// A step's three loads give 8 rows x 4 values of four 32-value streams: values 128h + 32s + 4l.. (s = 0..3;
// low nibbles of ql i2 = s % 2 for s < 2, high for s >= 2, bits 2s..2s+1 of qh as bits 4-5). As ggml's
// vec_dot_q6_K_q8_K: per super-block and row an int32 sum_g sc_g dot(u_g, q_g) - 32 sum_g sc_g bsum_g (u the
// 6-bit codes, g the 16-value sub-blocks), times d_x d_w.
#pragma once
#include "quant_x8.h"

namespace qk {

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
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I srl16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I sll16(I a, int n) { return _mm256_slli_epi16(a, n); }
  static I sra16(I a, int n) { return _mm256_srai_epi16(a, n); }
  static I sll32(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I sra32(I a, int n) { return _mm256_srai_epi32(a, n); }
  static I shuffle(I a, I m) { return _mm256_shuffle_epi8(a, m); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I madd(I a, I b) { return _mm256_madd_epi16(a, b); }
  static I maddubs(I u, I s) { return _mm256_maddubs_epi16(u, s); }
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
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I srl16(I a, int n) { return _mm512_srli_epi16(a, n); }
  static I sll16(I a, int n) { return _mm512_slli_epi16(a, n); }
  static I sra16(I a, int n) { return _mm512_srai_epi16(a, n); }
  static I sll32(I a, int n) { return _mm512_slli_epi32(a, n); }
  static I sra32(I a, int n) { return _mm512_srai_epi32(a, n); }
  static I shuffle(I a, I m) { return _mm512_shuffle_epi8(a, m); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I madd(I a, I b) { return _mm512_madd_epi16(a, b); }
  static I maddubs(I u, I s) { return _mm512_maddubs_epi16(u, s); }
  static constexpr bool DPBUSD = true;
  static I dpbusd(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, I b, F c) { return _mm512_fmadd_ps(a, _mm512_cvtepi32_ps(b), c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmaf(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F e8m0(const uint8_t* p, int64_t gs) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(V8::e8m0(p, 0)), V8::e8m0(p + gs, 0), 1);
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

// vpshufb masks on a row's 32-bit scale word: byte b moved to the top of its word (then an arithmetic shift
// right by 24 sign-extends it: a scale for vpmulld); to the high byte of both int16 (>> 8: the scale twice,
// for vpmaddwd); bytes 2q, 2q + 1 to the high bytes of the two int16 (>> 8: a pair of scales)
#define Z (-128)
alignas(16) constexpr int8_t X8_TOP32[4][16] = {X8_MASK(Z, Z, Z, 0), X8_MASK(Z, Z, Z, 1), X8_MASK(Z, Z, Z, 2), X8_MASK(Z, Z, Z, 3)};
alignas(16) constexpr int8_t X8_HI16[4][16] = {X8_MASK(Z, 0, Z, 0), X8_MASK(Z, 1, Z, 1), X8_MASK(Z, 2, Z, 2), X8_MASK(Z, 3, Z, 3)};
alignas(16) constexpr int8_t X8_HIPAIR[2][16] = {X8_MASK(Z, 0, Z, 1), X8_MASK(Z, 2, Z, 3)};
#undef Z

// A layout given by where each piece of a row's block goes (T::pieces(r, f): f(offset in the file's block, offset
// in the group's block, bytes) for row r): its pack, unpack and dequant_lane, and the group kernels' entry points
// on T::dot_v, 8 rows (dot) or 16 (dot2, avx512). Src: the file's type (its dequant_row).
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
  template <int NX> static void dot2(const uint8_t* g, int64_t K, const XRow* x, float* out, int64_t ldo) {
    T::template dot_v<V16, NX>(g, K, x, out, ldo);
  }
#endif
};

struct Q6_K_X8 : X8Layout<Q6_K_X8, Q6_K> {
  static constexpr int G = 8, QK = 256, SRC = 210, GBYTES = G * SRC, BYTES = SRC;
  static constexpr int SC = 16, ST = 144, STEP = 96;
  static constexpr XFmt FMT = X_Q8_K;

  template <class F> static void pieces(int r, const F& f) {
    f(208, 2 * r, 2);
    for (int i = 0; i < 4; ++i) f(192 + 4 * i, SC + 32 * i + 4 * r, 4);
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 8; ++l) {
        const int step = ST + STEP * (8 * h + l);
        for (int i2 = 0; i2 < 2; ++i2) f(64 * h + 32 * i2 + 4 * l, step + 32 * i2 + 4 * r, 4);
        f(128 + 32 * h + 4 * l, step + 64 + 4 * r, 4);
      }
  }

  // out[r * ldo + lane] = row lane . x[r]: 8 rows (V8) or 16 (V16, two groups gs bytes apart)
  template <class V, int NX> static void dot_v(const uint8_t* g, int64_t K, const XRow* x, float* out, int64_t ldo) {
    using I = typename V::I;
    const int64_t gs = K / QK * GBYTES;
    typename V::F acc[NX];
    FOR_X acc[r] = V::fzero();
    const I m4 = V::set1(0x0f0f0f0f), m3 = V::set1(0x30303030);
    for (int64_t b = 0; b < K / QK; ++b, g += GBYTES) {
      const int8_t* q[NX];
      I sumi[NX];
      FOR_X { q[r] = x[r].q + QK * b; sumi[r] = V::zero(); }
      I scw[4];
      for (int i = 0; i < 4; ++i) scw[i] = V::load(g + SC + 32 * i, gs);
      for (int h = 0; h < 2; ++h)
        for (int half = 0; half < 2; ++half) {          // steps 4 half .. 4 half + 3: one 16-value sub-block a stream
          I a[NX][4];           // a stream's dot: int32 over 4 steps (vpdpbusd), else int16 pair sums over 2
          FOR_X for (int s = 0; s < 4; ++s) a[r][s] = V::zero();
          // sub-block of stream s: 8h + 2s + half (scale word (8h + 2s + half) / 4, byte (2s + half) % 4)
          I sc[4];
          for (int s = 0; s < 4; ++s) {
            const I w = scw[2 * h + s / 2];
            sc[s] = V::DPBUSD ? V::sra32(V::shuffle(w, V::mask(X8_TOP32[(2 * s + half) % 4])), 24)
                              : V::sra16(V::shuffle(w, V::mask(X8_HI16[(2 * s + half) % 4])), 8);
          }
          _Pragma("GCC unroll 4") for (int l = 4 * half; l < 4 * half + 4; ++l) {
            const uint8_t* st = g + ST + STEP * (8 * h + l);
            const I l0 = V::load(st, gs), l1 = V::load(st + 32, gs), hb = V::load(st + 64, gs);
            const I u[4] = {V::or_(V::and_(l0, m4), V::and_(V::sll16(hb, 4), m3)),
                            V::or_(V::and_(l1, m4), V::and_(V::sll16(hb, 2), m3)),
                            V::or_(V::and_(V::srl16(l0, 4), m4), V::and_(hb, m3)),
                            V::or_(V::and_(V::srl16(l1, 4), m4), V::and_(V::srl16(hb, 2), m3))};
            FOR_X for (int s = 0; s < 4; ++s) {
              int32_t xv;
              memcpy(&xv, q[r] + 128 * h + 32 * s + 4 * l, 4);
              if constexpr (V::DPBUSD) {
                a[r][s] = V::dpbusd(a[r][s], u[s], V::set1(xv));
              } else {          // two steps' vpmaddubsw pair sums added as int16 (|2 x 2 x 63 x 128| = 32256 fits)
                a[r][s] = V::add16(a[r][s], V::maddubs(u[s], V::set1(xv)));
                if (l % 2) {
                  sumi[r] = V::add(sumi[r], V::madd(a[r][s], sc[s]));
                  a[r][s] = V::zero();
                }
              }
            }
          }
          if constexpr (V::DPBUSD) FOR_X for (int s = 0; s < 4; ++s) sumi[r] = V::add(sumi[r], V::mullo(a[r][s], sc[s]));
        }
      // -32 sum_g sc_g bsum_g: pairs of scales (int16) against pairs of x's 16-value sums
      I sp[8];
      for (int p = 0; p < 8; ++p) sp[p] = V::sra16(V::shuffle(scw[p / 2], V::mask(X8_HIPAIR[p % 2])), 8);
      const typename V::F dw = V::half(g, gs);
      FOR_X {
        const int16_t* bs = x[r].bs + 16 * b;
        I m = V::zero();
        for (int p = 0; p < 8; ++p) {
          int32_t pair;
          memcpy(&pair, bs + 2 * p, 4);
          m = V::add(m, V::madd(sp[p], V::set1(pair)));
        }
        acc[r] = V::fma(V::mul(V::fset1(x[r].d[b]), dw), V::sub(sumi[r], V::sll32(m, 5)), acc[r]);
      }
    }
    FOR_X V::store(out + r * ldo, acc[r]);
  }
};

}  // namespace qk
