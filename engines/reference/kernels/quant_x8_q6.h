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

// vpshufb masks on a row's 32-bit scale word: byte b moved to the top of its word (then an arithmetic shift
// right by 24 sign-extends it: a scale for vpmulld); to the high byte of both int16 (>> 8: the scale twice,
// for vpmaddwd); bytes 2q, 2q + 1 to the high bytes of the two int16 (>> 8: a pair of scales)
#define Z (-128)
alignas(16) constexpr int8_t X8_TOP32[4][16] = {X8_MASK(Z, Z, Z, 0), X8_MASK(Z, Z, Z, 1), X8_MASK(Z, Z, Z, 2), X8_MASK(Z, Z, Z, 3)};
alignas(16) constexpr int8_t X8_HI16[4][16] = {X8_MASK(Z, 0, Z, 0), X8_MASK(Z, 1, Z, 1), X8_MASK(Z, 2, Z, 2), X8_MASK(Z, 3, Z, 3)};
alignas(16) constexpr int8_t X8_HIPAIR[2][16] = {X8_MASK(Z, 0, Z, 1), X8_MASK(Z, 2, Z, 3)};
#undef Z

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
    // the 6-bit codes of stream s in the step at st: nibbles of ql (low for s < 2), bits 2s..2s+1 of qh as bits 4-5
    const auto code = [&](const uint8_t* st, int s) {
      const I lq = V::load(st + 32 * (s % 2), gs), hb = V::load(st + 64, gs);
      const I hi = s == 0 ? V::sll16(hb, 4) : s == 1 ? V::sll16(hb, 2) : s == 2 ? hb : V::srl16(hb, 2);
      return V::or_(V::and_(s < 2 ? lq : V::srl16(lq, 4), m4), V::and_(hi, m3));
    };
    for (int64_t b = 0; b < K / QK; ++b, g += GBYTES) {
      const int8_t* q[NX];
      I sumi[NX];
      FOR_X { q[r] = x[r].q + QK * b; sumi[r] = V::zero(); }
      const auto xq = [&](int r, int h, int s, int l) {      // x's 4 values of row r facing a step's stream s
        int32_t v;
        memcpy(&v, q[r] + 128 * h + 32 * s + 4 * l, 4);
        return v;
      };
      I scw[4];
      for (int i = 0; i < 4; ++i) scw[i] = V::load(g + SC + 32 * i, gs);
      for (int h = 0; h < 2; ++h)
        for (int half = 0; half < 2; ++half) {          // steps 4 half .. 4 half + 3: one 16-value sub-block a stream
          // sub-block of stream s: 8h + 2s + half (scale word (8h + 2s + half) / 4, byte (2s + half) % 4)
          I sc[4];
          for (int s = 0; s < 4; ++s) {
            const I w = scw[2 * h + s / 2];
            sc[s] = V::DPBUSD ? V::sra32(V::shuffle(w, V::mask(X8_TOP32[(2 * s + half) % 4])), 24)
                              : V::sra16(V::shuffle(w, V::mask(X8_HI16[(2 * s + half) % 4])), 8);
          }
          if constexpr (V::DPBUSD) {        // a stream's int32 dot over the 4 steps, then times its scale
            I a[NX][4];
            FOR_X for (int s = 0; s < 4; ++s) a[r][s] = V::zero();
            _Pragma("GCC unroll 4") for (int l = 4 * half; l < 4 * half + 4; ++l) {
              const uint8_t* st = g + ST + STEP * (8 * h + l);
              const I u[4] = {code(st, 0), code(st, 1), code(st, 2), code(st, 3)};
              FOR_X for (int s = 0; s < 4; ++s) a[r][s] = V::dpbusd(a[r][s], u[s], V::set1(xq(r, h, s, l)));
            }
            FOR_X for (int s = 0; s < 4; ++s) sumi[r] = V::add(sumi[r], V::mullo(a[r][s], sc[s]));
          } else {
            // stream by stream, so that only the NX sums stay live: a pair of steps' vpmaddubsw pair sums added
            // as int16 (|2 x 2 x 63 x 128| = 32256 fits), then vpmaddwd with the sub-block's scale
            for (int l = 4 * half; l < 4 * half + 4; l += 2) {
              const uint8_t* st = g + ST + STEP * (8 * h + l);
              for (int s = 0; s < 4; ++s) {
                const I u0 = code(st, s), u1 = code(st + STEP, s);
                FOR_X sumi[r] = V::add(sumi[r], V::madd(V::add16(V::maddubs(u0, V::set1(xq(r, h, s, l))),
                                                                 V::maddubs(u1, V::set1(xq(r, h, s, l + 1)))), sc[s]));
                FOR_X pin(sumi[r]);
              }
            }
          }
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
