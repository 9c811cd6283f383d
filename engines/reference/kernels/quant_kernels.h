// Per-type CPU kernels on GGUF weights as stored: one row's dot product against NX activation rows,
// and one row's dequantization. Block layouts: ggml-common.h; value formulas: ggml-quants.c
// dequantize_row_* (the f32 operations are done in the same order, so dequant is bit-exact).
//
// Compiled once per ISA (engines/reference/kernels/__init__.py): the avx2 build uses AVX2 + FMA + F16C;
// the avx512 build adds AVX512 F/BW/VL/DQ/VNNI/BF16, which turns every u8 x s8 dot into one vpdpbusd
// and widens the float kernels to 16 lanes.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace qk {

// One activation row as the kernels read it. Float weight types read f (K floats); block-quantized
// types read x quantized per 32 values (quantize_x): x[i] ~= d[i/32] * q[i].
struct XRow {
  const float* f;        // (K) f32
  const int8_t* q;       // (K) int8
  const float* d;        // (K/32) block scale
  const float* s;        // (K/32) d * sum(q) over the block: offset weights (Q4_0's -8, mins) need it
  const int16_t* s16;    // (K/16) sum(q) over each 16 values: Q6_K's -32 under per-16 scales
};

static inline float fp16(const uint8_t* p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

// MXFP4 block scale: e8m0 times 1/2, since kvalues_mxfp4 hold twice the e2m1 values (GGML_E8M0_TO_FP32_HALF)
static inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f; memcpy(&f, &bits, 4); return f;
}

static inline __m256i ld(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline __m256 cvt8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline __m256i lo4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
static inline __m256i hi4(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
// 16 bytes of nibble pairs -> 32 values: the low nibbles (values 0..15 of the block), then the high ones
static inline __m256i nib16(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128((const __m128i*)p);
  return lo4(_mm256_set_m128i(_mm_srli_epi16(t, 4), t));
}
// a 16-entry byte table in both 128-bit lanes, for vpshufb lookups of 4-bit codes
static inline __m256i table16(const int8_t* t) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)t)); }

// int32 lane j = sum of u[4j..4j+3] * s[4j..4j+3]: u unsigned bytes, s signed. Without VNNI it is
// maddubs (pairs into int16, which saturates above 32767: callers keep u <= 128) then madd.
static inline __m256i dot4(__m256i u, __m256i s) {
#ifdef __AVX512VNNI__
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
// the same for signed w: |w| times s with w's sign moved onto s
static inline __m256i dot4s(__m256i w, __m256i s) { return dot4(_mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w)); }

// acc += (float)dot * scale
static inline __m256 fma_i(__m256i dot, __m256 scale, __m256 acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc); }

// f(b, J) for blocks b = 0..nb-1, J = b % 2 as a compile-time constant: two accumulator sets, so
// consecutive blocks' FMAs do not wait on each other
template <int J> using I = std::integral_constant<int, J>;
template <class F> static inline __attribute__((always_inline)) void blocks2(int64_t nb, F&& f) {
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) { f(b, I<0>{}); f(b + 1, I<1>{}); }
  if (b < nb) f(b, I<0>{});
}

#define FOR_X _Pragma("GCC unroll 8") for (int r = 0; r < NX; ++r)

// ---------------------------------------------------------------- float types (any K)
#ifdef __AVX512F__
using vf = __m512;
constexpr int VL = 16;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf load_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline vf load_bf16(const uint8_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#else
using vf = __m256;
constexpr int VL = 8;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return hsum(v); }
static inline vf load_f16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline vf load_bf16(const uint8_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

static inline float f16_1(const uint8_t* p) { return fp16(p); }
static inline float bf16_1(const uint8_t* p) { uint32_t b = (uint32_t)(p[0] | p[1] << 8) << 16; float f; memcpy(&f, &b, 4); return f; }
static inline float f32_1(const uint8_t* p) { float f; memcpy(&f, p, 4); return f; }
static inline vf load_f32(const uint8_t* p) { return vload((const float*)p); }

// Float weights: VL values converted per load (exact), 4 vectors a step; x stays f32.
template <int B, vf (*LOAD)(const uint8_t*), float (*ONE)(const uint8_t*)>
struct FloatType {
  static constexpr int QK = 1, BYTES = B;
  static constexpr bool QUANT_X = false;
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    int64_t i = 0;
    for (; i + VL <= K; i += VL) vstore(y + i, LOAD(w + i * BYTES));
    for (; i < K; ++i) y[i] = ONE(w + i * BYTES);
  }
  template <int NX> static void dot(const uint8_t* w, int64_t K, const XRow* x, float* y) {
    constexpr int A = NX == 1 ? 4 : 2;     // accumulators per x row: enough to cover the FMA latency
    vf acc[NX][A];
    FOR_X for (int a = 0; a < A; ++a) acc[r][a] = vzero();
    int64_t i = 0;
    for (; i + A * VL <= K; i += A * VL)
      _Pragma("GCC unroll 4") for (int a = 0; a < A; ++a) {
        const vf wv = LOAD(w + (i + a * VL) * BYTES);
        FOR_X acc[r][a] = vfma(wv, vload(x[r].f + i + a * VL), acc[r][a]);
      }
    FOR_X {
      for (int a = 1; a < A; ++a) acc[r][0] += acc[r][a];
      float s = vsum(acc[r][0]);
      for (int64_t j = i; j < K; ++j) s += ONE(w + j * BYTES) * x[r].f[j];
      y[r] = s;
    }
  }
};
using F32 = FloatType<4, load_f32, f32_1>;
using F16 = FloatType<2, load_f16, f16_1>;
using BF16 = FloatType<2, load_bf16, bf16_1>;

// ---------------------------------------------------------------- 32-value blocks
// Q8_0: f16 d, int8 q[32]; w = d * q
struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34;
  static constexpr bool QUANT_X = true;
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES, y += QK) {
      const __m256 d = _mm256_set1_ps(fp16(w));
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(cvt8(w + 2 + 8 * i), d));
    }
  }
  template <int NX> static void dot(const uint8_t* w, int64_t K, const XRow* x, float* y) {
    __m256 acc[NX][2] = {};
    blocks2(K / QK, [&](int64_t b, auto J) {
      const uint8_t* p = w + b * BYTES;
      const float d = fp16(p);
      const __m256i q = ld(p + 2), aq = _mm256_sign_epi8(q, q);
      FOR_X acc[r][J] = fma_i(dot4(aq, _mm256_sign_epi8(ld(x[r].q + 32 * b), q)), _mm256_set1_ps(d * x[r].d[b]), acc[r][J]);
    });
    FOR_X y[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
  }
};

// Blocks of 32 4-bit codes u with one scale: w = d * (LUT[u] - OFF), LUT[u] unsigned. The dot takes
// LUT[u] as the unsigned operand and subtracts OFF * d * sum(q) per block (XRow::s) at the end.
//   Q4_0:  f16 d, 16 bytes of nibbles; w = d * (u - 8)                     (LUT = identity, OFF = 8)
//   MXFP4: e8m0 e, 16 bytes of nibbles; w = e8m0_half(e) * kvalues_mxfp4[u] (LUT = kvalues + 12, OFF = 12)
template <int B, int HEAD, int OFF, class Scale, bool LUT>
struct Nibble32 {
  static constexpr int QK = 32, BYTES = B;
  static constexpr bool QUANT_X = true;
  static constexpr int8_t kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};   // kvalues_mxfp4
  static constexpr int8_t lut[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};  // kv + 12
  static inline __m256i codes(const uint8_t* p) {
    const __m256i u = nib16(p + HEAD);
    return LUT ? _mm256_shuffle_epi8(table16(lut), u) : u;
  }
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    const __m256i sub = _mm256_set1_epi8(OFF);
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES, y += QK) {
      const __m256 d = _mm256_set1_ps(Scale()(w));
      alignas(32) int8_t v[32];
      _mm256_store_si256((__m256i*)v, LUT ? _mm256_shuffle_epi8(table16(kv), nib16(w + HEAD)) : _mm256_sub_epi8(codes(w), sub));
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(d, cvt8((const uint8_t*)v + 8 * i)));
    }
  }
  template <int NX> static void dot(const uint8_t* w, int64_t K, const XRow* x, float* y) {
    __m256 acc[NX][2] = {};
    float off[NX][2] = {};
    blocks2(K / QK, [&](int64_t b, auto J) {
      const uint8_t* p = w + b * BYTES;
      const float d = Scale()(p);
      const __m256i u = codes(p);
      FOR_X {
        acc[r][J] = fma_i(dot4(u, ld(x[r].q + 32 * b)), _mm256_set1_ps(d * x[r].d[b]), acc[r][J]);
        off[r][J] += d * x[r].s[b];
      }
    });
    FOR_X y[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) - OFF * (off[r][0] + off[r][1]);
  }
};
struct ScaleF16 { float operator()(const uint8_t* p) const { return fp16(p); } };
struct ScaleE8M0 { float operator()(const uint8_t* p) const { return e8m0_half(p[0]); } };
using Q4_0 = Nibble32<18, 2, 8, ScaleF16, false>;
using MXFP4 = Nibble32<17, 1, 12, ScaleE8M0, true>;

// ---------------------------------------------------------------- 256-value super-blocks
// The float vector (8 lanes, one per 32-value sub-block) of d * sub-block scale, times the x block
// scales of the same 8 sub-blocks: broadcast per sub-block from memory.
struct Scales8 {
  alignas(32) float v[8];
  Scales8(__m256 s) { _mm256_store_ps(v, s); }
  __m256 operator[](int j) const { return _mm256_broadcast_ss(v + j); }
};

// Q4_K / Q5_K: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, [Q5_K: 32 bytes of 5th bits],
// 128 bytes of nibbles: bytes 32c..32c+31 hold sub-block 2c (low nibbles) and 2c+1 (high).
// w = d * sc_j * u - dmin * m_j, u = nibble (+ 16 * 5th bit).
static inline void scales_k4(const uint8_t* p, __m256& sc, __m256& m) {    // ggml get_scale_min_k4, all 8 at once
  uint32_t u[4];
  memcpy(u, p, 12);
  const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  u[3] = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);   // mins 4..7
  const uint32_t m03 = u[1] & m6;                           // mins 0..3
  u[1] = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);           // scales 4..7
  u[2] = m03;
  u[0] &= m6;                                               // scales 0..3
  sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)u)));
  m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(u + 2))));
}
// bit b of each byte moved to bit 4 (the 5th bit of a Q5_K code); 16-bit shifts are safe after the mask
static inline __m256i bit_to_16(__m256i h, int b) {
  const __m256i t = b < 4 ? _mm256_slli_epi16(h, 4 - b) : _mm256_srli_epi16(h, b - 4);
  return _mm256_and_si256(t, _mm256_set1_epi8(16));
}

template <bool Q5>
struct QK_4_5 {
  static constexpr int QK = 256, BYTES = Q5 ? 176 : 144, QS = Q5 ? 48 : 16;
  static constexpr bool QUANT_X = true;
  // the codes of sub-blocks 2c and 2c+1
  static inline void codes(const uint8_t* p, int c, __m256i& a, __m256i& b) {
    const __m256i v = ld(p + QS + 32 * c);
    a = lo4(v); b = hi4(v);
    if (Q5) {
      const __m256i h = ld(p + 16);
      a = _mm256_or_si256(a, bit_to_16(h, 2 * c));
      b = _mm256_or_si256(b, bit_to_16(h, 2 * c + 1));
    }
  }
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES) {
      __m256 sc, m;
      scales_k4(w + 4, sc, m);
      const Scales8 d1(_mm256_mul_ps(_mm256_set1_ps(fp16(w)), sc)), m1(_mm256_mul_ps(_mm256_set1_ps(fp16(w + 2)), m));
      for (int c = 0; c < 4; ++c) {
        alignas(32) uint8_t u[64];
        __m256i a, bb;
        codes(w, c, a, bb);
        _mm256_store_si256((__m256i*)u, a);
        _mm256_store_si256((__m256i*)(u + 32), bb);
        for (int i = 0; i < 8; ++i) {
          const int j = 2 * c + i / 4;
          const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(u + 8 * i))));
          _mm256_storeu_ps(y + 8 * i, _mm256_sub_ps(_mm256_mul_ps(d1[j], q), m1[j]));
        }
        y += 64;
      }
    }
  }
  template <int NX> static void dot(const uint8_t* w, int64_t K, const XRow* x, float* y) {
    __m256 acc[NX][2] = {}, mins[NX] = {};
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES) {
      __m256 sc, m;
      scales_k4(w + 4, sc, m);
      const __m256 d = _mm256_set1_ps(fp16(w)), dmin = _mm256_set1_ps(fp16(w + 2));
      sc = _mm256_mul_ps(sc, d);
      m = _mm256_mul_ps(m, dmin);
      alignas(32) float sv[NX][8];     // d sc_j dx_j per x row
      FOR_X {
        _mm256_store_ps(sv[r], _mm256_mul_ps(sc, _mm256_loadu_ps(x[r].d + 8 * b)));
        mins[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(x[r].s + 8 * b), mins[r]);
      }
      _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c) {
        __m256i a, bb;
        codes(w, c, a, bb);
        FOR_X {
          const int8_t* q = x[r].q + 256 * b + 64 * c;
          acc[r][0] = fma_i(dot4(a, ld(q)), _mm256_broadcast_ss(sv[r] + 2 * c), acc[r][0]);
          acc[r][1] = fma_i(dot4(bb, ld(q + 32)), _mm256_broadcast_ss(sv[r] + 2 * c + 1), acc[r][1]);
        }
      }
    }
    FOR_X y[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) - hsum(mins[r]);
  }
};
using Q4_K = QK_4_5<false>;
using Q5_K = QK_4_5<true>;

// Q6_K: ql[128] low 4 bits, qh[64] high 2 bits, int8 scales[16] (one per 16 values), f16 d.
// Half h (128 values) uses ql[64h..], qh[32h..]; its 32-value group i: low nibble of ql[l] (i = 0),
// of ql[l+32] (1), high nibble of ql[l] (2), of ql[l+32] (3), plus bits 2i..2i+1 of qh[l] as bits 4..5.
// w = d * sc[16-group] * (u - 32).
struct Q6_K {
  static constexpr int QK = 256, BYTES = 210;
  static constexpr bool QUANT_X = true;
  static inline __m256i codes(const uint8_t* p, int g) {      // 32-value group g = 0..7 of the block, u in 0..63
    const int h = g / 4, i = g % 4;
    const __m256i l = ld(p + 64 * h + 32 * (i & 1)), qh = ld(p + 128 + 32 * h);
    const __m256i lo = i < 2 ? lo4(l) : hi4(l);
    const __m256i hb = _mm256_and_si256(2 * i < 4 ? _mm256_slli_epi16(qh, 4 - 2 * i) : _mm256_srli_epi16(qh, 2 * i - 4),
                                        _mm256_set1_epi8(0x30));
    return _mm256_or_si256(lo, hb);
  }
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES) {
      const __m256 d = _mm256_set1_ps(fp16(w + 208));
      alignas(32) float dl[16];
      _mm256_store_ps(dl, _mm256_mul_ps(d, cvt8(w + 192)));       // d * sc, as ggml and gguf-py compute it
      _mm256_store_ps(dl + 8, _mm256_mul_ps(d, cvt8(w + 200)));
      for (int g = 0; g < 8; ++g, y += 32) {
        alignas(32) int8_t v[32];
        _mm256_store_si256((__m256i*)v, _mm256_sub_epi8(codes(w, g), _mm256_set1_epi8(32)));
        for (int i = 0; i < 4; ++i)
          _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(_mm256_broadcast_ss(dl + 2 * g + i / 2), cvt8((const uint8_t*)v + 8 * i)));
      }
    }
  }
  template <int NX> static void dot(const uint8_t* w, int64_t K, const XRow* x, float* y) {
    __m256 acc[NX][2] = {}, off[NX] = {};
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES) {
      const float d = fp16(w + 208);
      const __m128i sc = _mm_loadu_si128((const __m128i*)(w + 192));
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc);
      alignas(32) float dd[NX][8];            // d * x block scale, per 32-value group
      FOR_X {
        const __m256 dx = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(x[r].d + 8 * b));
        _mm256_store_ps(dd[r], dx);
        // sum over groups of d dx (sc_a sum_a(q) + sc_b sum_b(q)): the -32 of every code
        off[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i*)(x[r].s16 + 16 * b)))), dx, off[r]);
      }
      _Pragma("GCC unroll 8") for (int g = 0; g < 8; ++g) {
        const __m256i u = codes(w, g);
        // int16 scale of each byte pair: group g's first 16 values use sc[2g], the second 16 sc[2g+1]
        const __m256i s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, _mm_set_epi64x(0x0101010101010101ll * (2 * g + 1), 0x0101010101010101ll * (2 * g))));
        FOR_X {
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, ld(x[r].q + 256 * b + 32 * g)), s);
          acc[r][g & 1] = fma_i(p, _mm256_broadcast_ss(dd[r] + g), acc[r][g & 1]);
        }
      }
    }
    FOR_X y[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) - 32 * hsum(off[r]);
  }
};

// IQ4_XS: f16 d, u16 scales_h, scales_l[4], 128 bytes of nibbles (16 per 32-value sub-block, low
// nibbles first). ls_j = 4 bits of scales_l (low nibble for even j) | 2 bits of scales_h << 4;
// w = d * (ls_j - 32) * kvalues_iq4nl[u].
struct IQ4_XS {
  static constexpr int QK = 256, BYTES = 136;
  static constexpr bool QUANT_X = true;
  static constexpr int8_t kv[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
#ifdef __AVX512VNNI__
  // vpdpbusd has no int16 step to saturate: the codes go in unsigned, as kvalues + 128
  static constexpr int8_t lut[16] = {1, 24, 45, 63, 79, 93, 106, 118, (int8_t)129, (int8_t)141, (int8_t)153, (int8_t)166,
                                     (int8_t)181, (int8_t)197, (int8_t)217, (int8_t)241};
#endif
  static inline __m256 scales(const uint8_t* p) {      // the 8 d * (ls_j - 32)
    uint16_t h; uint32_t l;
    memcpy(&h, p + 2, 2); memcpy(&l, p + 4, 4);
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(l), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)), _mm256_set1_epi32(15));
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), _mm256_set1_epi32(3));
    const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
    return _mm256_mul_ps(_mm256_set1_ps(fp16(p)), _mm256_cvtepi32_ps(ls));
  }
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES) {
      const Scales8 dl(scales(w));
      for (int j = 0; j < 8; ++j, y += 32) {
        alignas(32) int8_t v[32];
        _mm256_store_si256((__m256i*)v, _mm256_shuffle_epi8(table16(kv), nib16(w + 8 + 16 * j)));
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(dl[j], cvt8((const uint8_t*)v + 8 * i)));
      }
    }
  }
  template <int NX> static void dot(const uint8_t* w, int64_t K, const XRow* x, float* y) {
    __m256 acc[NX][2] = {}, off[NX] = {};
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES) {
      const __m256 dl = scales(w);
      alignas(32) float sv[NX][8];
      FOR_X {
        _mm256_store_ps(sv[r], _mm256_mul_ps(dl, _mm256_loadu_ps(x[r].d + 8 * b)));
#ifdef __AVX512VNNI__
        off[r] = _mm256_fmadd_ps(dl, _mm256_loadu_ps(x[r].s + 8 * b), off[r]);
#endif
      }
      _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j) {
        const __m256i u = nib16(w + 8 + 16 * j);
#ifdef __AVX512VNNI__
        const __m256i v = _mm256_shuffle_epi8(table16(lut), u);
        FOR_X acc[r][j & 1] = fma_i(dot4(v, ld(x[r].q + 256 * b + 32 * j)), _mm256_broadcast_ss(sv[r] + j), acc[r][j & 1]);
#else
        const __m256i v = _mm256_shuffle_epi8(table16(kv), u);
        FOR_X acc[r][j & 1] = fma_i(dot4s(v, ld(x[r].q + 256 * b + 32 * j)), _mm256_broadcast_ss(sv[r] + j), acc[r][j & 1]);
#endif
      }
    }
    FOR_X y[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) - 128 * hsum(off[r]);
  }
};

// x (K) f32 -> XRow's q, d, s, s16 (K % 32 == 0): per 32 values d = max|x| / 127, q = round(x / d),
// as ggml's quantize_row_q8_0 (d kept in f32 here, not rounded to f16).
static inline void quantize_x(const float* x, int64_t K, int8_t* q, float* d, float* s, int16_t* s16) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < K / 32; ++b, x += 32, q += 32) {
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i] = _mm256_loadu_ps(x + 8 * i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    d[b] = amax / 127.f;
    const __m256 id = _mm256_set1_ps(amax > 0 ? 127.f / amax : 0.f);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
    const int h0 = hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(i32[0], i32[1])));   // exact: |sum| <= 16 * 127
    const int h1 = hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(i32[2], i32[3])));
    s16[2 * b] = (int16_t)h0; s16[2 * b + 1] = (int16_t)h1;
    s[b] = d[b] * (float)(h0 + h1);
    // packs interleave the 128-bit lanes: (0 1 2 3 4 5 6 7) comes out as (0 4 1 5 2 6 3 7) in dwords
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
}

}  // namespace qk
