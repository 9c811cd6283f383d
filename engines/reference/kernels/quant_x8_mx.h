// MXFP4 with 8 rows interleaved (QTensor layout "x8": gpt-oss's experts), as quant_x8_q6.h does for Q6_K.
// A group of 8 rows holds per 32-value block exactly the bytes of its 8 blocks (136 = 8 x 17), reordered:
//   e[8]                       the e8m0 scale of each row
//   qs[4 steps l][8 rows][4 bytes]: qs[4l ..] of each row (low nibbles: values 4l.., high: values 16 + 4l..)
// Codes are kvalues_mxfp4 + 12 (unsigned, as vpmaddubsw and vpdpbusd want them), the offset taken back with
// x's block sum: per block and row e8m0_half(e) (d_x sum_i c_i q_i - 12 s_x), s_x = d_x sum(q) (quant_act.h),
// the int8 products of ggml's vec_dot_mxfp4_q8_0. The scale conversion and the int32 -> float step run once
// for 8 rows (16 on avx512) instead of once a row, which is what the file layout's kernel spends most on.
#pragma once
#include "quant_x8_q6.h"

namespace qk {

struct MXFP4_X8 : X8Layout<MXFP4_X8, MXFP4> {
  static constexpr int G = 8, QK = 32, SRC = 17, GBYTES = G * SRC, BYTES = SRC, QS = 8;
  static constexpr XFmt FMT = X_Q8_0;

  template <class F> static void pieces(int r, const F& f) {
    f(0, r, 1);
    for (int l = 0; l < 4; ++l) f(1 + 4 * l, QS + 32 * l + 4 * r, 4);
  }

  // out[r * ldo + lane] = row lane . x[r]: 8 rows (V8) or 16 (V16, two groups gs bytes apart)
  template <class V, int NX> static void dot_v(const uint8_t* g, int64_t K, const XRow* x, float* out, int64_t ldo) {
    using I = typename V::I;
    const int64_t gs = K / QK * GBYTES;
    typename V::F acc[NX];
    FOR_X acc[r] = V::fzero();
    const I m4 = V::set1(0x0f0f0f0f), kv = V::mask(KV_MXFP4_12), ones = V::set1(0x00010001);
    for (int64_t b = 0; b < K / QK; ++b, g += GBYTES) {
      I sum[NX], shi[NX];      // vpdpbusd: low and high nibbles in two chains (a decode's one x row waits on its latency)
      FOR_X sum[r] = shi[r] = V::zero();
      for (int half = 0; half < 2; ++half) {
        I s16[NX];               // two steps of vpmaddubsw pair sums: |2 x 2 x 2 x 24 x 128| = 24576 fits int16
        FOR_X s16[r] = V::zero();
        for (int l = 2 * half; l < 2 * half + 2; ++l) {
          const I w = V::load(g + QS + 32 * l, gs);
          const I lo = V::shuffle(kv, V::and_(w, m4)), hi = V::shuffle(kv, V::and_(V::srl16(w, 4), m4));
          FOR_X {
            int32_t a, h;
            memcpy(&a, x[r].q + QK * b + 4 * l, 4);
            memcpy(&h, x[r].q + QK * b + 16 + 4 * l, 4);
            if constexpr (V::DPBUSD) { sum[r] = V::dpbusd(sum[r], lo, V::set1(a)); shi[r] = V::dpbusd(shi[r], hi, V::set1(h)); }
            else s16[r] = V::add16(s16[r], V::add16(V::maddubs(lo, V::set1(a)), V::maddubs(hi, V::set1(h))));
          }
        }
        if constexpr (!V::DPBUSD) FOR_X sum[r] = V::add(sum[r], V::madd(s16[r], ones));
      }
      if constexpr (V::DPBUSD) FOR_X sum[r] = V::add(sum[r], shi[r]);
      const typename V::F sc = V::e8m0(g, gs);
      FOR_X acc[r] = V::fmaf(sc, V::fma(V::fset1(x[r].d[b]), sum[r], V::fset1(-12.f * x[r].s[b])), acc[r]);
    }
    FOR_X V::store(out + r * ldo, acc[r]);
  }
};

}  // namespace qk
