// The ggml types on the CPU, straight from GGUF bytes: per type, one row's dequantization (bit-exact:
// the f32 operations of ggml-quants.c dequantize_row_* / gguf-py, in the same order) and one row's dot
// product with NX activation rows at once (quant_act.h XRow in the type's format FMT; quant.cpp uses
// NX = 1..4 on avx2, 1..8 on avx512). Block layouts: ggml-common.h. The dots combine integers and
// scales as ggml's x86 vec_dot_*: per block exact int8 sums times the f32 product of the weight's
// and x's scales (here: F32, F16, BF16 and the 32-value types), or per 256 an int32 sum under the
// integer sub-block scales times d_w d_x (quant_ktypes.h: K-quants, IQ4_XS); only the order of the
// float additions differs.
#pragma once
#include "quant_act.h"

namespace qk {

// ---------------------------------------------------------------- F32, F16, BF16 (any K)
#ifdef __AVX512F__
using vf = __m512;
constexpr int VL = 16;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf load_f16(const uint8_t* p) { return _mm512_cvtph_ps(ld(p)); }
static inline vf load_bf16(const uint8_t* p) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ld(p)), 16)); }
#else
using vf = __m256;
constexpr int VL = 8;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline float vsum(vf v) { return hsum(v); }
static inline vf load_f16(const uint8_t* p) { return _mm256_cvtph_ps(ld16(p)); }
static inline vf load_bf16(const uint8_t* p) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(ld16(p)), 16)); }
#endif
static inline vf load_f32(const uint8_t* p) { return vload((const float*)p); }
static inline float f32_1(const uint8_t* p) { float f; memcpy(&f, p, 4); return f; }
static inline float f16_1(const uint8_t* p) { return fp16(p); }
static inline float bf16_1(const uint8_t* p) { const uint32_t b = (uint32_t)u16(p) << 16; float f; memcpy(&f, &b, 4); return f; }

// Float weights: VL values converted per load (exactly), x in f32 (F16/BF16: x rounded to f16/bf16,
// so each product is exact in f32, as in ggml's F16/BF16 dots).
template <int B, vf (*LOAD)(const uint8_t*), float (*ONE)(const uint8_t*), XFmt F>
struct FloatType {
  static constexpr int QK = 1, BYTES = B;
  static constexpr XFmt FMT = F;
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    int64_t i = 0;
    for (; i + VL <= K; i += VL) vstore(y + i, LOAD(w + i * B));
    for (; i < K; ++i) y[i] = ONE(w + i * B);
  }
  template <int NX> static void dot(const uint8_t* w, int64_t K, const XRow* x, float* y) {
    constexpr int A = NX == 1 ? 4 : 2;     // accumulators per x row: enough to cover the FMA latency
    vf acc[NX][A];
    FOR_X for (int a = 0; a < A; ++a) acc[r][a] = vzero();
    int64_t i = 0;
    for (; i + A * VL <= K; i += A * VL)
      _Pragma("GCC unroll 4") for (int a = 0; a < A; ++a) {
        const vf wv = LOAD(w + (i + a * VL) * B);
        FOR_X acc[r][a] = vfma(wv, vload(x[r].f + i + a * VL), acc[r][a]);
      }
    FOR_X {
      for (int a = 1; a < A; ++a) acc[r][0] += acc[r][a];
      float s = vsum(acc[r][0]);
      for (int64_t j = i; j < K; ++j) s += ONE(w + j * B) * x[r].f[j];
      y[r] = s;
    }
  }
};
using F32 = FloatType<4, load_f32, f32_1, X_F32>;
using F16 = FloatType<2, load_f16, f16_1, X_F16>;
using BF16 = FloatType<2, load_bf16, bf16_1, X_BF16>;

// ---------------------------------------------------------------- 32-value block types
// Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4 (x as Q8_0) and Q4_1, Q5_1 (x as Q8_1), taken 8 blocks (a unit of
// 256 values) at a time: per block j 32 codes, a float scale sc_j and offset coefficient of_j, with
//   W.x = sum_j (sc_j d_j) dot(code_j, q_j) - of_j s_j            (XRow d, s, q of block j)
// sc_j d_j is ggml's d_w * d_x (f16 x f16 or e8m0 x f16: exact in f32). Codes are unsigned as
// vpdpbusd / vpmaddubsw want them, their offset folded into of_j (e.g. Q4_0: u - 8, of = 8 d_w, and
// s = d_x sum(q): exact); vpmaddubsw's int16 pair sums saturate for codes above 128, so without VNNI
// Q8_0 and IQ4_NL keep signed codes (SIGNED, of 0). Q4_1/Q5_1: of = -m, s = Q8_1's f16 s.

// the f16 values at p, p + stride, ... (8 blocks)
static inline __m256 f16x8(const uint8_t* p, int stride) {
  return _mm256_cvtph_ps(_mm_setr_epi16(u16(p), u16(p + stride), u16(p + 2 * stride), u16(p + 3 * stride),
                                        u16(p + 4 * stride), u16(p + 5 * stride), u16(p + 6 * stride), u16(p + 7 * stride)));
}
// the same for e8m0 bytes (MXFP4)
static inline __m256 e8m0x8(const uint8_t* p, int stride) {
  return e8m0_half8(_mm256_setr_epi32(p[0], p[stride], p[2 * stride], p[3 * stride], p[4 * stride], p[5 * stride],
                                      p[6 * stride], p[7 * stride]));
}

constexpr int8_t KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int8_t KV_IQ4NL_128[16] = {1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75, -59, -39, -15};  // +128, as bytes
constexpr int8_t KV_IQ4NL_ABS[16] = {127, 104, 83, 65, 49, 35, 22, 10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int8_t KV_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};           // kvalues_mxfp4
constexpr int8_t KV_MXFP4_12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};      // +12

// Q8_0: f16 d, int8 q[32]; w = d q. With VNNI the codes are q + 128 (offset 128 d).
struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34, UNIT = 8 * BYTES;
  static constexpr XFmt FMT = X_Q8_0;
  static constexpr bool SIGNED = !VNNI;
  static float scale1(const uint8_t* p) { return fp16(p); }
  static float off1(const uint8_t* p) { return VNNI ? 128.f * fp16(p) : 0.f; }
  static void scales(const uint8_t* p, __m256& sc, __m256& off) {
    sc = f16x8(p, BYTES);
    off = _mm256_mul_ps(sc, _mm256_set1_ps(VNNI ? 128.f : 0.f));
  }
  static __m256i codes(const uint8_t* p, int j) {
    const __m256i q = ld(p + j * BYTES + 2);
    return VNNI ? _mm256_xor_si256(q, _mm256_set1_epi8(-128)) : q;
  }
#ifdef __AVX512F__
  static __m512i codes2(const uint8_t* p, int j) {
    return _mm512_xor_si512(join(ld(p + j * BYTES + 2), ld(p + (j + 1) * BYTES + 2)), _mm512_set1_epi8(-128));
  }
#endif
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES, y += QK) {
      const __m256 d = _mm256_set1_ps(fp16(w));
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(cvt8(w + 2 + 8 * i), d));
    }
  }
};

// 32-value blocks of 4-bit codes u (16 bytes, low nibbles = values 0..15) after a HEAD-byte header,
// [5-bit types: 4 bytes qh before the nibbles, bit j = 5th bit of value j]:
//   Q4_0:   f16 d;          w = d (u - 8)                 codes u          (of 8 d)
//   Q5_0:   f16 d, qh;      w = d (u - 16)                codes u          (of 16 d)
//   Q4_1:   f16 d, f16 m;   w = d u + m                   codes u          (of -m)
//   Q5_1:   f16 d, f16 m, qh; w = d u + m                 codes u          (of -m)
//   IQ4_NL: f16 d;          w = d kvalues_iq4nl[u]        codes kv (+128 with VNNI: of 128 d)
//   MXFP4:  e8m0 e;         w = e8m0_half(e) kvalues_mxfp4[u]   codes kv + 12 (of 12 d)
enum Nib { N_Q4_0, N_Q5_0, N_Q4_1, N_Q5_1, N_IQ4_NL, N_MXFP4 };
template <Nib N>
struct Nibble32 {
  static constexpr bool MX = N == N_MXFP4, IQ = N == N_IQ4_NL, Q5 = N == N_Q5_0 || N == N_Q5_1,
                        MIN = N == N_Q4_1 || N == N_Q5_1;
  static constexpr int QK = 32, HEAD = MX ? 1 : MIN ? 4 : 2, QS = HEAD + (Q5 ? 4 : 0), BYTES = QS + 16, UNIT = 8 * BYTES;
  static constexpr XFmt FMT = MIN ? X_Q8_1 : X_Q8_0;
  static constexpr bool SIGNED = IQ && !VNNI;
  static constexpr float OFF = N == N_Q4_0 ? 8.f : N == N_Q5_0 ? 16.f : MX ? 12.f : IQ && VNNI ? 128.f : 0.f;
  static float scale1(const uint8_t* p) { return MX ? e8m0_half(p[0]) : fp16(p); }
  static float off1(const uint8_t* p) { return MIN ? -fp16(p + 2) : OFF * scale1(p); }
  static void scales(const uint8_t* p, __m256& sc, __m256& off) {
    sc = MX ? e8m0x8(p, BYTES) : f16x8(p, BYTES);
    off = MIN ? _mm256_sub_ps(_mm256_setzero_ps(), f16x8(p + 2, BYTES)) : _mm256_mul_ps(sc, _mm256_set1_ps(OFF));
  }
  static __m256i codes(const uint8_t* p, int j) {
    const uint8_t* b = p + j * BYTES;
    const __m256i u = nib16(b + QS);
    if constexpr (Q5) return _mm256_or_si256(u, bits32_to_16(b + HEAD));
    if constexpr (MX) return _mm256_shuffle_epi8(table16(KV_MXFP4_12), u);
    if constexpr (IQ) return _mm256_shuffle_epi8(table16(VNNI ? KV_IQ4NL_128 : KV_IQ4NL), u);
    return u;
  }
#ifdef __AVX512F__
  static __m512i codes2(const uint8_t* p, int j) {
    const uint8_t *a = p + j * BYTES, *b = a + BYTES;
    const __m512i u = nib2x16(a + QS, b + QS);
    if constexpr (Q5) return _mm512_or_si512(u, join(bits32_to_16(a + HEAD), bits32_to_16(b + HEAD)));
    if constexpr (MX) return _mm512_shuffle_epi8(table64(KV_MXFP4_12), u);
    if constexpr (IQ) return _mm512_shuffle_epi8(table64(KV_IQ4NL_128), u);
    return u;
  }
#endif
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES, y += QK) {
      const __m256 d = _mm256_set1_ps(scale1(w));
      __m256i u = nib16(w + QS);
      if constexpr (Q5) u = _mm256_or_si256(u, bits32_to_16(w + HEAD));
      alignas(32) int8_t v[32];
      if constexpr (MX) u = _mm256_shuffle_epi8(table16(KV_MXFP4), u);
      else if constexpr (IQ) u = _mm256_shuffle_epi8(table16(KV_IQ4NL), u);
      else if constexpr (!MIN) u = _mm256_sub_epi8(u, _mm256_set1_epi8((int8_t)OFF));
      _mm256_store_si256((__m256i*)v, u);
      for (int i = 0; i < 4; ++i) {
        const __m256 c = MIN ? cvt8u((const uint8_t*)v + 8 * i) : cvt8((const uint8_t*)v + 8 * i);
        // Q4_1/Q5_1: x0 * d + m, two roundings as ggml; the rest: x0 * d
        _mm256_storeu_ps(y + 8 * i, MIN ? _mm256_add_ps(_mm256_mul_ps(c, d), _mm256_set1_ps(fp16(w + 2)))
                                        : _mm256_mul_ps(IQ || MX ? d : c, IQ || MX ? c : d));
      }
    }
  }
};
using Q4_0 = Nibble32<N_Q4_0>;
using Q5_0 = Nibble32<N_Q5_0>;
using Q4_1 = Nibble32<N_Q4_1>;
using Q5_1 = Nibble32<N_Q5_1>;
using IQ4_NL = Nibble32<N_IQ4_NL>;
using MXFP4 = Nibble32<N_MXFP4>;

// The dot over units (see above): y[r] = W row . x[r].
// Accumulators per x row: enough independent FMA chains to hide the FMA latency, few enough to stay
// in registers.
template <int NX> constexpr int ACCS = NX == 1 ? 4 : NX <= 4 ? 2 : 1;

// a unit kernel's int8 dot for a type's codes (signed codes move their sign onto x)
template <class T> static inline __m256i dot_codes(__m256i u, const int8_t* q) {
  return T::SIGNED ? dot4s(u, ld(q)) : dot4(u, ld(q));
}

template <class T, int NX, int A = ACCS<NX>>
static void dot_units(const uint8_t* w, int64_t K, const XRow* x, float* y) {
#ifdef __AVX512F__
  using acc_t = __m512;
#else
  using acc_t = __m256;
#endif
  acc_t acc[NX][A];
  __m256 off[NX];
  FOR_X {
    off[r] = _mm256_setzero_ps();
    for (int a = 0; a < A; ++a) acc[r][a] = acc_t{};
  }
  const auto unit = [&](const uint8_t* p, int64_t g) __attribute__((always_inline)) {
    __m256 sc, of, sv[NX];                      // sv: sc_j d_j of the unit's blocks
    T::scales(p, sc, of);
    FOR_X {
      sv[r] = _mm256_mul_ps(sc, _mm256_loadu_ps(x[r].d + g));
      off[r] = _mm256_fmadd_ps(of, _mm256_loadu_ps(x[r].s + g), off[r]);
    }
#ifdef __AVX512F__
    _Pragma("GCC unroll 4") for (int j = 0; j < 8; j += 2) {
      const __m512i u = T::codes2(p, j);
      FOR_X acc[r][j / 2 % A] = fma_dot(u, ld64(x[r].q + 32 * (g + j)), pair(sv[r], j), acc[r][j / 2 % A]);
    }
#else
    alignas(32) float s[NX][8];                 // broadcast from memory: a load, not a shuffle
    FOR_X _mm256_store_ps(s[r], sv[r]);
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j) {
      const __m256i u = T::codes(p, j);
      FOR_X acc[r][j % A] = fma_i(dot_codes<T>(u, x[r].q + 32 * (g + j)), _mm256_broadcast_ss(s[r] + j), acc[r][j % A]);
    }
#endif
  };
  const int64_t units = K / 256;
  for (int64_t i = 0; i < units; ++i) unit(w + i * T::UNIT, 8 * i);
  FOR_X {
    for (int a = 1; a < A; ++a) acc[r][0] = acc[r][0] + acc[r][a];
#ifdef __AVX512F__
    y[r] = _mm512_reduce_add_ps(acc[r][0]) - hsum(off[r]);
#else
    y[r] = hsum(acc[r][0]) - hsum(off[r]);
#endif
  }
  // the blocks after the last whole unit (gpt-oss rows: 90 = 11 units and 2), one by one, their
  // scales straight from the block: no store and reload on the way
  __m256 tacc[NX];
  float toff[NX];
  FOR_X { tacc[r] = _mm256_setzero_ps(); toff[r] = 0.f; }
  const uint8_t* p = w + units * T::UNIT;
  for (int64_t b = 8 * units; b < K / 32; ++b, p += T::BYTES) {
    const float sc = T::scale1(p), of = T::off1(p);
    const __m256i u = T::codes(p, 0);
    FOR_X {
      tacc[r] = fma_i(dot_codes<T>(u, x[r].q + 32 * b), _mm256_set1_ps(sc * x[r].d[b]), tacc[r]);
      toff[r] += of * x[r].s[b];
    }
  }
  FOR_X y[r] += hsum(tacc[r]) - toff[r];
}

template <class T> struct Units : T {
  template <int NX> static void dot(const uint8_t* w, int64_t K, const XRow* x, float* y) { dot_units<T, NX>(w, K, x, y); }
};

}  // namespace qk
