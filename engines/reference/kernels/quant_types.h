// The ggml types on the CPU, straight from GGUF bytes: per type, one row's dequantization (bit-exact:
// the f32 operations of ggml-quants.c dequantize_row_* / gguf-py, in the same order) and one row's dot
// product with NX activation rows at once (quant_simd.h XRow; quant.cpp uses NX = 1..4 on avx2,
// 1..8 on avx512). Block layouts: ggml-common.h.
#pragma once
#include "quant_simd.h"

namespace qk {

// ---------------------------------------------------------------- F32, F16, BF16 (any K)
#ifdef __AVX512F__
using vf = __m512;
constexpr int VL = 16;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf load_f16(const uint8_t* p) { return _mm512_cvtph_ps(ld(p)); }
static inline vf load_bf16(const uint8_t* p) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ld(p)), 16)); }
#else
using vf = __m256;
constexpr int VL = 8;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return hsum(v); }
static inline vf load_f16(const uint8_t* p) { return _mm256_cvtph_ps(ld16(p)); }
static inline vf load_bf16(const uint8_t* p) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(ld16(p)), 16)); }
#endif
static inline vf load_f32(const uint8_t* p) { return vload((const float*)p); }
static inline float f32_1(const uint8_t* p) { float f; memcpy(&f, p, 4); return f; }
static inline float f16_1(const uint8_t* p) { return fp16(p); }
static inline float bf16_1(const uint8_t* p) { const uint32_t b = (uint32_t)u16(p) << 16; float f; memcpy(&f, &b, 4); return f; }

// Float weights: VL values converted per load (exactly), x in f32.
template <int B, vf (*LOAD)(const uint8_t*), float (*ONE)(const uint8_t*)>
struct FloatType {
  static constexpr int QK = 1, BYTES = B;
  static constexpr bool QUANT_X = false;
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
using F32 = FloatType<4, load_f32, f32_1>;
using F16 = FloatType<2, load_f16, f16_1>;
using BF16 = FloatType<2, load_bf16, bf16_1>;

// ---------------------------------------------------------------- integer types
// Every block-quantized type but Q6_K is, for the dot, a sequence of units of 8 groups of 32 values
// (one 256-value super-block, or 8 consecutive 32-value blocks, UNIT bytes): per group j 32 codes and
// a float scale and offset, w = scale_j * code - offset_j. Then
//   W.x = sum_j scale_j d_j dot(code_j, q_j) - offset_j s_j         (XRow d, s, q of group j)
// Codes are unsigned, as vpdpbusd and vpmaddubsw want them; vpmaddubsw's int16 pair sums saturate
// for codes above 128, so without VNNI Q8_0 and IQ4_XS keep signed codes (SIGNED, offset 0).

// the f16 scales of 8 32-value blocks `stride` bytes apart
static inline __m256 f16x8(const uint8_t* p, int stride) {
  return _mm256_cvtph_ps(_mm_setr_epi16(u16(p), u16(p + stride), u16(p + 2 * stride), u16(p + 3 * stride),
                                        u16(p + 4 * stride), u16(p + 5 * stride), u16(p + 6 * stride), u16(p + 7 * stride)));
}
// the same for e8m0 bytes (MXFP4)
static inline __m256 e8m0x8(const uint8_t* p, int stride) {
  return e8m0_half8(_mm256_setr_epi32(p[0], p[stride], p[2 * stride], p[3 * stride], p[4 * stride], p[5 * stride],
                                      p[6 * stride], p[7 * stride]));
}

// Q8_0: f16 d, int8 q[32]; w = d q. With VNNI the codes are q + 128 (offset 128 d).
struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34, UNIT = 8 * BYTES;
  static constexpr bool QUANT_X = true, SIGNED = !VNNI;
  static constexpr float OFF = VNNI ? 128.f : 0.f;
  static float scale1(const uint8_t* p) { return fp16(p); }
  static void scales(const uint8_t* p, __m256& sc, __m256& off) {
    sc = f16x8(p, BYTES);
    off = _mm256_mul_ps(sc, _mm256_set1_ps(OFF));
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

// 32-value blocks of 4-bit codes u (16 bytes, low nibbles = values 0..15) after a HEAD-byte scale:
//   Q4_0:  f16 d;  w = d (u - 8)                              (offset 8 d)
//   MXFP4: e8m0 e; w = e8m0_half(e) kvalues_mxfp4[u]; codes kvalues + 12 (offset 12 d)
template <int B, int HEAD, int O, bool MX>
struct Nibble32 {
  static constexpr int QK = 32, BYTES = B, UNIT = 8 * B;
  static constexpr bool QUANT_X = true, SIGNED = false;
  static constexpr float OFF = O;
  static constexpr int8_t kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};   // kvalues_mxfp4
  static constexpr int8_t lut[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};  // kv + 12
  static float scale1(const uint8_t* p) { return MX ? e8m0_half(p[0]) : fp16(p); }
  static void scales(const uint8_t* p, __m256& sc, __m256& off) {
    sc = MX ? e8m0x8(p, B) : f16x8(p, B);
    off = _mm256_mul_ps(sc, _mm256_set1_ps(OFF));
  }
  static __m256i codes(const uint8_t* p, int j) {
    const __m256i u = nib16(p + j * B + HEAD);
    return MX ? _mm256_shuffle_epi8(table16(lut), u) : u;
  }
#ifdef __AVX512F__
  static __m512i codes2(const uint8_t* p, int j) {
    const __m512i u = nib2x16(p + j * B + HEAD, p + (j + 1) * B + HEAD);
    return MX ? _mm512_shuffle_epi8(table64(lut), u) : u;
  }
#endif
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    for (int64_t b = 0; b < K / QK; ++b, w += B, y += QK) {
      const __m256 d = _mm256_set1_ps(MX ? e8m0_half(w[0]) : fp16(w));
      const __m256i u = nib16(w + HEAD);
      alignas(32) int8_t v[32];
      _mm256_store_si256((__m256i*)v, MX ? _mm256_shuffle_epi8(table16(kv), u) : _mm256_sub_epi8(u, _mm256_set1_epi8(8)));
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(d, cvt8((const uint8_t*)v + 8 * i)));
    }
  }
};
using Q4_0 = Nibble32<18, 2, 8, false>;
using MXFP4 = Nibble32<17, 1, 12, true>;

// ggml get_scale_min_k4 for all 8 sub-blocks: the 6-bit scales and mins packed in 12 bytes
static inline void scales_k4(const uint8_t* p, __m256& sc, __m256& m) {
  uint32_t u[4];
  memcpy(u, p, 12);
  const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  u[3] = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);   // mins 4..7
  const uint32_t m03 = u[1] & m6;                           // mins 0..3
  u[1] = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);           // scales 4..7
  u[2] = m03;
  u[0] &= m6;                                               // scales 0..3
  sc = cvt8u((const uint8_t*)u);
  m = cvt8u((const uint8_t*)(u + 2));
}
// bit b of each byte moved to bit 4 (a Q5_K code's 5th bit); 16-bit shifts are safe after the mask
static inline __m256i bit_to_16(__m256i h, int b) {
  return _mm256_and_si256(b < 4 ? _mm256_slli_epi16(h, 4 - b) : _mm256_srli_epi16(h, b - 4), _mm256_set1_epi8(16));
}

// Q4_K / Q5_K: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, [Q5_K: qh[32], 5th bits: bit j
// of qh[l] belongs to value l of sub-block j], 128 bytes of nibbles: bytes 32c..32c+31 hold sub-block
// 2c (low nibbles) and 2c+1 (high). w = d sc_j u - dmin m_j.
template <bool Q5>
struct QK_4_5 {
  static constexpr int QK = 256, BYTES = Q5 ? 176 : 144, UNIT = BYTES, QS = Q5 ? 48 : 16;
  static constexpr bool QUANT_X = true, SIGNED = false;
  static void scales(const uint8_t* p, __m256& sc, __m256& off) {
    __m256 m;
    scales_k4(p + 4, sc, m);
    sc = _mm256_mul_ps(_mm256_set1_ps(fp16(p)), sc);
    off = _mm256_mul_ps(_mm256_set1_ps(fp16(p + 2)), m);
  }
  static __m256i codes(const uint8_t* p, int j) {
    const __m256i v = ld(p + QS + 32 * (j / 2)), u = j & 1 ? hi4(v) : lo4(v);
    return Q5 ? _mm256_or_si256(u, bit_to_16(ld(p + 16), j)) : u;
  }
#ifdef __AVX512F__
  static __m512i codes2(const uint8_t* p, int j) {          // j even: both nibbles of the same 32 bytes
    const __m256i v = ld(p + QS + 16 * j);
    const __m512i u = lo4(join(v, _mm256_srli_epi16(v, 4)));
    if (!Q5) return u;
    const __m256i h = ld(p + 16);
    const __m512i hh = join(h, _mm256_srli_epi16(h, 1));     // bit j + 1 of the high half at bit j
    const __m512i t = j < 4 ? _mm512_slli_epi16(hh, 4 - j) : _mm512_srli_epi16(hh, j - 4);
    return _mm512_or_si512(u, _mm512_and_si512(t, _mm512_set1_epi8(16)));
  }
#endif
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES) {
      __m256 sc, off;
      scales(w, sc, off);                       // d sc_j and dmin m_j, rounded as ggml does
      alignas(32) float d1[8], m1[8];
      _mm256_store_ps(d1, sc);
      _mm256_store_ps(m1, off);
      for (int j = 0; j < 8; ++j, y += 32) {
        alignas(32) uint8_t u[32];
        _mm256_store_si256((__m256i*)u, codes(w, j));
        for (int i = 0; i < 4; ++i)
          _mm256_storeu_ps(y + 8 * i, _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(d1[j]), cvt8u(u + 8 * i)), _mm256_set1_ps(m1[j])));
      }
    }
  }
};
using Q4_K = QK_4_5<false>;
using Q5_K = QK_4_5<true>;

// IQ4_XS: f16 d, u16 scales_h, scales_l[4], 128 bytes of nibbles (16 per sub-block, low nibbles
// first). ls_j = 4 bits of scales_l (low nibble for even j) | 2 bits of scales_h << 4;
// w = d (ls_j - 32) kvalues_iq4nl[u]. With VNNI the codes are kvalues + 128 (offset 128 d (ls_j - 32)).
struct IQ4_XS {
  static constexpr int QK = 256, BYTES = 136, UNIT = BYTES;
  static constexpr bool QUANT_X = true, SIGNED = !VNNI;
  static constexpr int8_t kv[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
  static constexpr int8_t lut[16] = {1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75, -59, -39, -15};  // kv + 128, as bytes
  static void scales(const uint8_t* p, __m256& sc, __m256& off) {
    uint32_t l;
    memcpy(&l, p + 4, 4);
    const __m256i lo = _mm256_srlv_epi32(_mm256_set1_epi32(l), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32(u16(p + 2)), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    const __m256i ls = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(15)),
                                       _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4));
    sc = _mm256_mul_ps(_mm256_set1_ps(fp16(p)), _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
    off = VNNI ? _mm256_mul_ps(sc, _mm256_set1_ps(128.f)) : _mm256_setzero_ps();
  }
  static __m256i codes(const uint8_t* p, int j) { return _mm256_shuffle_epi8(table16(VNNI ? lut : kv), nib16(p + 8 + 16 * j)); }
#ifdef __AVX512F__
  static __m512i codes2(const uint8_t* p, int j) { return _mm512_shuffle_epi8(table64(lut), nib32(ld(p + 8 + 16 * j))); }
#endif
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES) {
      __m256 sc, off;
      scales(w, sc, off);
      alignas(32) float dl[8];
      _mm256_store_ps(dl, sc);
      for (int j = 0; j < 8; ++j, y += 32) {
        alignas(32) int8_t v[32];
        _mm256_store_si256((__m256i*)v, _mm256_shuffle_epi8(table16(kv), nib16(w + 8 + 16 * j)));
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(_mm256_set1_ps(dl[j]), cvt8((const uint8_t*)v + 8 * i)));
      }
    }
  }
};

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
    __m256 sc, of, sv[NX];                      // sv: scale_j d_j of the unit's groups
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
  if constexpr (T::QK == 32) {
    // the blocks after the last whole unit (gpt-oss rows: 90 = 11 units and 2), one by one, their
    // scales straight from the block: no store and reload on the way
    __m256 tacc[NX];
    float toff[NX];
    FOR_X { tacc[r] = _mm256_setzero_ps(); toff[r] = 0.f; }
    const uint8_t* p = w + units * T::UNIT;
    for (int64_t b = 8 * units; b < K / 32; ++b, p += T::BYTES) {
      const float sc = T::scale1(p);
      const __m256i u = T::codes(p, 0);
      FOR_X {
        tacc[r] = fma_i(dot_codes<T>(u, x[r].q + 32 * b), _mm256_set1_ps(sc * x[r].d[b]), tacc[r]);
        toff[r] += sc * x[r].s[b];
      }
    }
    FOR_X y[r] += hsum(tacc[r]) - T::OFF * toff[r];
  }
}

template <class T> struct Units : T {
  template <int NX> static void dot(const uint8_t* w, int64_t K, const XRow* x, float* y) { dot_units<T, NX>(w, K, x, y); }
};

// Q6_K: ql[128] low 4 bits, qh[64] high 2 bits, int8 scales[16] (one per 16 values), f16 d.
// Half h (128 values) uses ql[64h..], qh[32h..]; its 32-value group i: low nibbles of ql[l] (i = 0),
// of ql[l+32] (1), high nibbles of ql[l] (2), of ql[l+32] (3), bits 2i..2i+1 of qh[l] as bits 4..5.
// w = d sc[16-value group] (u - 32). The -32 goes through x's per-16 sums (XRow s16).
struct Q6_K {
  static constexpr int QK = 256, BYTES = 210;
  static constexpr bool QUANT_X = true;
  static __m256i codes(const uint8_t* p, int g) {      // 32-value group g = 0..7, u in 0..63
    const int h = g / 4, i = g % 4;
    const __m256i l = ld(p + 64 * h + 32 * (i & 1)), qh = ld(p + 128 + 32 * h);
    const __m256i hb = _mm256_and_si256(i < 2 ? _mm256_slli_epi16(qh, 4 - 2 * i) : _mm256_srli_epi16(qh, 2 * i - 4),
                                        _mm256_set1_epi8(0x30));
    return _mm256_or_si256(i < 2 ? lo4(l) : hi4(l), hb);
  }
#ifdef __AVX512F__
  static __m512i codes2(const uint8_t* p, int g) {     // g even: groups g, g + 1 (i = 0, 1 or 2, 3)
    const int h = g / 4, i = g % 4;
    const __m512i l = ld64(p + 64 * h);
    const __m256i qh = ld(p + 128 + 32 * h);
    const __m512i hh = join(qh, _mm256_srli_epi16(qh, 2));
    const __m512i hb = _mm512_and_si512(i == 0 ? _mm512_slli_epi16(hh, 4) : hh, _mm512_set1_epi8(0x30));
    return _mm512_or_si512(i == 0 ? lo4(l) : hi4(l), hb);
  }
#endif
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES) {
      const __m256 d = _mm256_set1_ps(fp16(w + 208));
      alignas(32) float dl[16];
      _mm256_store_ps(dl, _mm256_mul_ps(d, cvt8(w + 192)));       // d sc, as ggml and gguf-py round it
      _mm256_store_ps(dl + 8, _mm256_mul_ps(d, cvt8(w + 200)));
      for (int g = 0; g < 8; ++g, y += 32) {
        alignas(32) int8_t v[32];
        _mm256_store_si256((__m256i*)v, _mm256_sub_epi8(codes(w, g), _mm256_set1_epi8(32)));
        for (int i = 0; i < 4; ++i)
          _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(_mm256_set1_ps(dl[2 * g + i / 2]), cvt8((const uint8_t*)v + 8 * i)));
      }
    }
  }
  template <int NX> static void dot(const uint8_t* w, int64_t K, const XRow* x, float* y) {
    constexpr int A = ACCS<NX>;
    __m256 acc[NX][A], off[NX];
    FOR_X { off[r] = _mm256_setzero_ps(); for (int a = 0; a < A; ++a) acc[r][a] = off[r]; }
#ifdef __AVX512F__
    __m512 acc2[NX][A];
    FOR_X for (int a = 0; a < A; ++a) acc2[r][a] = _mm512_setzero_ps();
#endif
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES) {
      const __m128i sc = ld16(w + 192);
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc);
      __m256 dd[NX];                            // d d_g per 32-value group
      FOR_X {
        dd[r] = _mm256_mul_ps(_mm256_set1_ps(fp16(w + 208)), _mm256_loadu_ps(x[r].d + 8 * b));
        // sum over groups of d d_g (sc_a sum_a(q) + sc_b sum_b(q)): the -32 of every code
        off[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sc16, ld(x[r].s16 + 16 * b))), dd[r], off[r]);
      }
#ifdef __AVX512F__
      const __m512i sc32 = _mm512_castsi256_si512(sc16);
      _Pragma("GCC unroll 4") for (int g = 0; g < 8; g += 2) {
        const __m512i u = codes2(w, g);
        // the int16 scale of each byte pair: sc[2g], sc[2g+1], sc[2g+2], sc[2g+3], 8 pairs each
        const __m512i s = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_set1_epi16(2 * g), _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)),
            _mm256_setr_epi16(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3), 1)), sc32);
        FOR_X {
          const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(u, ld64(x[r].q + 256 * b + 32 * g)), s);
          acc2[r][g / 2 % A] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), pair(dd[r], g), acc2[r][g / 2 % A]);
        }
      }
#else
      alignas(32) float ds[NX][8];
      FOR_X _mm256_store_ps(ds[r], dd[r]);
      _Pragma("GCC unroll 8") for (int g = 0; g < 8; ++g) {
        const __m256i u = codes(w, g);
        // the int16 scale of each byte pair: the group's first 16 values sc[2g], the second sc[2g+1]
        const int64_t ones = 0x0101010101010101ll;
        const __m256i s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, _mm_set_epi64x(ones * (2 * g + 1), ones * (2 * g))));
        FOR_X {
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, ld(x[r].q + 256 * b + 32 * g)), s);
          acc[r][g % A] = fma_i(p, _mm256_broadcast_ss(ds[r] + g), acc[r][g % A]);
        }
      }
#endif
    }
    FOR_X {
      for (int a = 1; a < A; ++a) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][a]);
      float t = hsum(acc[r][0]) - 32 * hsum(off[r]);
#ifdef __AVX512F__
      for (int a = 1; a < A; ++a) acc2[r][0] = _mm512_add_ps(acc2[r][0], acc2[r][a]);
      t += _mm512_reduce_add_ps(acc2[r][0]);
#endif
      y[r] = t;
    }
  }
};

}  // namespace qk
