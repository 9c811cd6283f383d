// The types with signed codes with 8 rows interleaved (QTensor layout "x8"): Q8_0, and IQ4_NL and IQ4_XS (every
// matrix of an IQ4_XS file such as gemma-4's), as quant_x8_mx.h does for MXFP4. A group of 8 rows holds per
// block exactly the bytes of its 8 blocks, reordered:
//   Q8_0 (272 = 8 x 34):     d[8] f16; qs[8 steps l][8 rows][4 bytes]: each row's qs[4l ..]
//   IQ4_NL (144 = 8 x 18):   d[8] f16; qs[4 steps l][8 rows][4 bytes]
//   IQ4_XS (1088 = 8 x 136): d[8] f16; scales_h[8] u16; scales_l[8] (4 bytes each);
//                            qs[8 sub-blocks j][4 steps l][8 rows][4 bytes]
// Step l of an IQ4 32-value block holds each row's qs[4l ..]: low nibbles are values 4l.., high ones 16 + 4l...
// The codes (Q8_0's qs, IQ4's kvalues_iq4nl) are signed: vpmaddubsw takes |w| and x negated where w < 0
// (ggml's mul_sum_i8_pairs), and as |w| <= 128 a pair sum can reach 32512, so each step's pair sums go
// straight into vpmaddwd with the block's scale (1, or IQ4_XS's ls_j - 32): the integers of ggml's
// vec_dot_q8_0_q8_0 / vec_dot_iq4_nl_q8_0 / vec_dot_iq4_xs_q8_K, times d_x d_w per block (super-block).
#pragma once
#include <tuple>
#include "quant_x8_mx.h"

namespace qk {

// sum[r] += sum over the 32-value block at qs (4 steps, group stride gs) of kv . q[r][0..31], each step's
// pair sums times sc (an int16 pair per row)
template <class V, int NX>
static inline void iq4_block(const uint8_t* qs, int64_t gs, const int8_t* const* q, typename V::I sc, typename V::I* sum) {
  using I = typename V::I;
  const I m4 = V::set1(0x0f0f0f0f), kv = V::mask(KV_IQ4NL), ka = V::mask(KV_IQ4NL_ABS);
  _Pragma("GCC unroll 4") for (int l = 0; l < 4; ++l) {
    const I w = V::load(qs + 32 * l, gs), nl = V::and_(w, m4), nh = V::and_(V::srl16(w, 4), m4);
    const I sl = V::shuffle(kv, nl), sh = V::shuffle(kv, nh), ul = V::shuffle(ka, nl), uh = V::shuffle(ka, nh);
    FOR_X {
      int32_t a, h;
      memcpy(&a, q[r] + 4 * l, 4);
      memcpy(&h, q[r] + 16 + 4 * l, 4);
      const I pl = V::maddubs(ul, V::sign8(V::set1(a), sl)), ph = V::maddubs(uh, V::sign8(V::set1(h), sh));
      sum[r] = V::add(sum[r], V::add(V::madd(pl, sc), V::madd(ph, sc)));
    }
    FOR_X pin(sum[r]);
  }
}

// With VNNI: dot[r] = the int32 dot of a block's codes with x row q[r] in S steps, the codes + 128 (unsigned:
// vpdpbusd's side) against x, started at -128 times x's sum xs[r] so that the offset comes back off: two
// instructions a step and x row, against vpmaddubsw's five. step(l) gives the step's two code vectors and the
// offsets of the 4 x bytes each faces; two chains per x row for the instruction's latency.
template <class V, int NX, int S, class Step>
static inline void offset_dots(const int8_t* const* q, const int32_t* xs, typename V::I* dot, const Step& step) {
  typename V::I hi[NX];
  FOR_X { dot[r] = V::set1(-128 * xs[r]); hi[r] = V::zero(); }
  _Pragma("GCC unroll 4") for (int l = 0; l < S; ++l) {
    const auto [u0, o0, u1, o1] = step(l);
    FOR_X {
      int32_t a, h;
      memcpy(&a, q[r] + o0, 4);
      memcpy(&h, q[r] + o1, 4);
      dot[r] = V::dpbusd(dot[r], u0, V::set1(a));
      hi[r] = V::dpbusd(hi[r], u1, V::set1(h));
    }
  }
  FOR_X dot[r] = V::add(dot[r], hi[r]);
}

// offset_dots on a 32-value IQ4 block at qs: step l's low nibbles face x's values 4l.., its high ones 16 + 4l..
template <class V, int NX>
static inline void iq4_dots(const uint8_t* qs, int64_t gs, const int8_t* const* q, const int32_t* xs, typename V::I* dot) {
  using I = typename V::I;
  const I m4 = V::set1(0x0f0f0f0f), ku = V::mask(KV_IQ4NL_128);
  offset_dots<V, NX, 4>(q, xs, dot, [&](int l) {
    const I w = V::load(qs + 32 * l, gs);
    return std::make_tuple(V::shuffle(ku, V::and_(w, m4)), 4 * l, V::shuffle(ku, V::and_(V::srl16(w, 4), m4)), 16 + 4 * l);
  });
}

// The sum of a Q8_0 x row's codes in block b: its s = d sum(q) is exact in f32, so s / d is too
static inline int32_t q8_0_sum(const XRow& x, int64_t b) {
  return x.d[b] != 0.f ? (int32_t)std::lrint(x.s[b] / x.d[b]) : 0;
}

// out[r * ldo + lane] = row lane . x[r] for a layout whose blocks start with the rows' f16 d: per block b
// block(g, gs, b, sum) adds each row's int32 sum, then acc[r] += d_w d_x sum[r]
template <class T, class V, int NX, class Block>
static inline void scaled_blocks(const uint8_t* g, int64_t K, const XRow* x, float* out, int64_t ldo, const Block& block) {
  const int64_t gs = K / T::QK * T::GBYTES;
  typename V::F acc[NX];
  FOR_X acc[r] = V::fzero();
  for (int64_t b = 0; b < K / T::QK; ++b, g += T::GBYTES) {
    typename V::I sum[NX];
    FOR_X sum[r] = V::zero();
    block(g, gs, b, sum);
    const typename V::F dw = V::half(g, gs);
    FOR_X acc[r] = V::fma(V::mul(dw, V::fset1(x[r].d[b])), sum[r], acc[r]);
  }
  FOR_X V::store(out + r * ldo, acc[r]);
}

struct Q8_0_X8 : X8Layout<Q8_0_X8, Q8_0> {
  static constexpr int G = 8, QK = 32, SRC = 34, GBYTES = G * SRC, BYTES = SRC, QS = 16;
  static constexpr XFmt FMT = X_Q8_0;

  template <class F> static void pieces(int r, const F& f) {
    f(0, 2 * r, 2);
    for (int l = 0; l < 8; ++l) f(2 + 4 * l, QS + 32 * l + 4 * r, 4);
  }

  template <class V, int NX> static void dot_v(const uint8_t* g, int64_t K, const XRow* x, float* out, int64_t ldo) {
    using I = typename V::I;
    const I ones = V::set1(0x00010001);
    scaled_blocks<Q8_0_X8, V, NX>(g, K, x, out, ldo, [&](const uint8_t* blk, int64_t gs, int64_t b, I* sum) {
      if constexpr (V::DPBUSD) {        // offset_dots: steps of two loads, codes + 128 by flipping the sign bit
        const I k128 = V::set1((int32_t)0x80808080);
        const int8_t* q[NX];
        int32_t xs[NX];
        FOR_X { q[r] = x[r].q + QK * b; xs[r] = q8_0_sum(x[r], b); }
        offset_dots<V, NX, 4>(q, xs, sum, [&](int l) {
          return std::make_tuple(V::xor_(V::load(blk + QS + 64 * l, gs), k128), 8 * l,
                                 V::xor_(V::load(blk + QS + 64 * l + 32, gs), k128), 8 * l + 4);
        });
        return;
      }
      _Pragma("GCC unroll 8") for (int l = 0; l < 8; ++l) {
        const I w = V::load(blk + QS + 32 * l, gs), u = V::abs8(w);
        FOR_X {
          int32_t a;
          memcpy(&a, x[r].q + QK * b + 4 * l, 4);
          sum[r] = V::add(sum[r], V::madd(V::maddubs(u, V::sign8(V::set1(a), w)), ones));
        }
        FOR_X pin(sum[r]);
      }
    });
  }
};

struct IQ4_NL_X8 : X8Layout<IQ4_NL_X8, IQ4_NL> {
  static constexpr int G = 8, QK = 32, SRC = 18, GBYTES = G * SRC, BYTES = SRC, QS = 16;
  static constexpr XFmt FMT = X_Q8_0;

  template <class F> static void pieces(int r, const F& f) {
    f(0, 2 * r, 2);
    for (int l = 0; l < 4; ++l) f(2 + 4 * l, QS + 32 * l + 4 * r, 4);
  }

  template <class V, int NX> static void dot_v(const uint8_t* g, int64_t K, const XRow* x, float* out, int64_t ldo) {
    using I = typename V::I;
    const I ones = V::set1(0x00010001);
    scaled_blocks<IQ4_NL_X8, V, NX>(g, K, x, out, ldo, [&](const uint8_t* blk, int64_t gs, int64_t b, I* sum) {
      const int8_t* q[NX];
      FOR_X q[r] = x[r].q + QK * b;
      if constexpr (V::DPBUSD) {
        int32_t xs[NX];
        FOR_X xs[r] = q8_0_sum(x[r], b);
        iq4_dots<V, NX>(blk + QS, gs, q, xs, sum);
      } else {
        iq4_block<V, NX>(blk + QS, gs, q, ones, sum);
      }
    });
  }
};

struct IQ4_XS_X8 : X8Layout<IQ4_XS_X8, IQ4_XS> {
  static constexpr int G = 8, QK = 256, SRC = 136, GBYTES = G * SRC, BYTES = SRC, SH = 16, SL = 32, QS = 64;
  static constexpr XFmt FMT = X_Q8_K;

  template <class F> static void pieces(int r, const F& f) {
    f(0, 2 * r, 2);
    f(2, SH + 2 * r, 2);
    f(4, SL + 4 * r, 4);
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 4; ++l) f(8 + 16 * j + 4 * l, QS + 128 * j + 32 * l + 4 * r, 4);
  }

  // ls_j - 32 (ggml's dequantize_row_iq4_xs) of each row in its 32-bit lane, from its scale bits sh and sl there
  template <class V> static typename V::I scale(typename V::I sh, typename V::I sl, int j) {
    const typename V::I lo = V::and_(V::srl32(sl, 4 * j), V::set1(15)), hi = V::and_(V::srl32(sh, 2 * j), V::set1(3));
    return V::sub(V::or_(lo, V::sll32(hi, 4)), V::set1(32));
  }

  template <class V, int NX> static void dot_v(const uint8_t* g, int64_t K, const XRow* x, float* out, int64_t ldo) {
    using I = typename V::I;
    const I m16 = V::set1(0xffff);
    scaled_blocks<IQ4_XS_X8, V, NX>(g, K, x, out, ldo, [&](const uint8_t* blk, int64_t gs, int64_t b, I* sum) {
      const I sh = V::u16(blk + SH, gs), sl = V::load(blk + SL, gs);     // a row's scale bits in its 32-bit lane
      for (int j = 0; j < 8; ++j) {
        const I sc = scale<V>(sh, sl, j);
        const int8_t* q[NX];
        FOR_X q[r] = x[r].q + QK * b + 32 * j;
        if constexpr (V::DPBUSD) {
          int32_t xs[NX];
          I dot[NX];
          FOR_X xs[r] = x[r].bs[16 * b + 2 * j] + x[r].bs[16 * b + 2 * j + 1];
          iq4_dots<V, NX>(blk + QS + 128 * j, gs, q, xs, dot);
          FOR_X sum[r] = V::add(sum[r], V::mullo(dot[r], sc));
        } else {
          iq4_block<V, NX>(blk + QS + 128 * j, gs, q, V::or_(V::and_(sc, m16), V::sll32(sc, 16)), sum);
        }
      }
    });
  }
};

// F16 (x8 unless the GEMM is bf16: kernels.host_layout): per 8 values of the 8 rows, [8 values k][8 rows] f16
// (128 = 8 x 16 bytes).
// One load converts value k of 8 rows (16 with V16) and each x row's x_k broadcast multiplies it: no per-row
// horizontal sum and no dequantized copy for the many-row products, where the file layout's rows lose to
// dequantized tiles and the f32 GEMM. Every product is exact in f32 (x rounded to f16, X_F16); the sums run in A
// chains per row (k mod A), then added.
struct F16_X8 : X8Layout<F16_X8, F16> {
  static constexpr int G = 8, QK = 8, SRC = 16, GBYTES = G * SRC, BYTES = SRC;
  static constexpr XFmt FMT = X_F16;

  template <class F> static void pieces(int r, const F& f) {
    for (int k = 0; k < 8; ++k) f(2 * k, 16 * k + 2 * r, 2);
  }
  static void dequant_lane(const uint8_t* g, int lane, int64_t K, float* y) {     // one f16 every 16 bytes
    for (int64_t i = 0; i < K; ++i) y[i] = fp16(g + 16 * i + 2 * lane);
  }

  template <class V, int NX> static void dot_v(const uint8_t* g, int64_t K, const XRow* x, float* out, int64_t ldo) {
    // chains per x row: enough to cover the FMA latency; 16 rows (avx512's dot2, n > 1) one, as avx2's dot2 adds
    // each row, so that both variants' products stay bit-identical
    constexpr int A = NX == 1 ? 4 : sizeof(typename V::F) == 64 ? 1 : 2;
    const int64_t gs = K * SRC;
    typename V::F acc[NX][A];
    FOR_X for (int a = 0; a < A; ++a) acc[r][a] = V::fzero();
    for (int64_t i = 0; i < K; i += A)      // K % 8 == 0
      _Pragma("GCC unroll 4") for (int a = 0; a < A; ++a) {
        const typename V::F w = V::half(g + SRC * (i + a), gs);
        FOR_X acc[r][a] = V::fmaf(w, V::fset1(x[r].f[i + a]), acc[r][a]);
      }
    FOR_X {
      for (int a = 1; a < A; ++a) acc[r][0] = V::fadd(acc[r][0], acc[r][a]);
      V::store(out + r * ldo, acc[r][0]);
    }
  }
#ifndef __AVX512F__
  // Two adjacent groups a call (out lanes 0-15) for 2 or more x rows: each x broadcast feeds two FMAs, and the 2 NX
  // chains cover the FMA latency. On an AVX2 EPYC, L1-resident, a core: 76 GFLOP/s with one group and 4 x rows, 93
  // with two (FMA peak 102).
  static constexpr bool DOT2 = true;
  template <int NX> static void dot2(const uint8_t* g, int64_t K, const XRow* x, float* out, int64_t ldo) {
    const int64_t gs = K * SRC;
    __m256 acc[NX][2];
    FOR_X acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < K; ++i) {
      const uint8_t* p = g + SRC * i;
      const __m256 w0 = V8::half(p, 0), w1 = V8::half(p + gs, 0);
      FOR_X {
        const __m256 xv = _mm256_set1_ps(x[r].f[i]);
        acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
      }
    }
    FOR_X for (int j = 0; j < 2; ++j) _mm256_storeu_ps(out + r * ldo + 8 * j, acc[r][j]);
  }
#endif
};

}  // namespace qk
