// SIMD helpers of the quant kernels (quant_act.h, quant_types.h, quant.cpp, decode.h). Compiled once
// per ISA variant: "avx2" (AVX2 + FMA + F16C) and "avx512" (adds AVX512 F/BW/VL/DQ/VNNI/BF16);
// __AVX512F__ / __AVX512VNNI__ pick the wider paths.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cmath>
#include <cstring>

namespace qk {

#ifdef __AVX512VNNI__
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

#define FOR_X _Pragma("GCC unroll 8") for (int r = 0; r < NX; ++r)

// GCC regroups an unrolled chain of integer vector adds (acc += a; acc += b; ...) into a tree that keeps every
// term live at once, and with several accumulators spills them all to the stack (x8 Q4_K at 4 x rows: 72 stores
// an inner loop). An empty asm on the accumulator after each step keeps the chain, and the registers, as written.
template <class V> static inline void pin(V& v) {
#ifdef __AVX512F__
  __asm__("" : "+v"(v));
#else
  __asm__("" : "+x"(v));
#endif
}

static inline uint16_t u16(const uint8_t* p) { uint16_t h; memcpy(&h, p, 2); return h; }
static inline float fp16(const uint8_t* p) { return _cvtsh_ss(u16(p)); }
// x rounded to the nearest f16 (ties to even), as ggml's GGML_CPU_FP32_TO_FP16 (F16C) stores it
static inline float round_f16(float x) { return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)); }

// MXFP4 block scale: e8m0 times 1/2, since kvalues_mxfp4 hold twice the e2m1 values (GGML_E8M0_TO_FP32_HALF)
static inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f; memcpy(&f, &bits, 4); return f;
}
static inline __m256 e8m0_half8(__m256i e) {       // the same for 8 int32 lanes
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i denormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, denormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

static inline __m256i ld(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline __m128i ld16(const void* p) { return _mm_loadu_si128((const __m128i*)p); }
static inline __m256 cvt8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline __m256 cvt8u(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}
static inline __m256i lo4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
static inline __m256i hi4(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
// 16 bytes of nibble pairs -> 32 codes: the low nibbles (values 0..15 of the block), then the high ones
static inline __m256i nib16(const uint8_t* p) {
  const __m128i t = ld16(p);
  return lo4(_mm256_set_m128i(_mm_srli_epi16(t, 4), t));
}
// the 32 bits of a little-endian uint32 as 32 bytes: 0x10 where the bit is set (Q5_0/Q5_1's 5th bits,
// bit j = value j; ggml's bytes_from_bits_32 masked to bit 4)
static inline __m256i bits32_to_16(const uint8_t* p) {
  uint32_t b;
  memcpy(&b, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)b),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}
// a 16-entry byte table in both 128-bit lanes, for vpshufb lookups of 4-bit codes
static inline __m256i table16(const int8_t* t) { return _mm256_broadcastsi128_si256(ld16(t)); }

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

#ifdef __AVX512F__
// 512-bit: two 32-value groups per vector (group j in the low 256 bits, j + 1 in the high)
static inline __m512i ld64(const void* p) { return _mm512_loadu_si512(p); }
static inline __m512i join(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
static inline __m512i lo4(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
static inline __m512i hi4(__m512i v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
// 32 bytes = the nibbles of two 16-byte groups A, B -> 64 codes: A low, A high, B low, B high
static inline __m512i nib32(__m256i t) {
  const __m512i u = join(t, _mm256_srli_epi16(t, 4));                    // A, B, A>>4, B>>4 (128-bit lanes)
  return lo4(_mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0)));
}
static inline __m512i nib2x16(const uint8_t* a, const uint8_t* b) { return nib32(_mm256_set_m128i(ld16(b), ld16(a))); }
static inline __m512i table64(const int8_t* t) { return _mm512_broadcast_i32x4(ld16(t)); }
// acc += (float)dpbusd(u, s) * scale
static inline __m512 fma_dot(__m512i u, __m512i s, __m512 scale, __m512 acc) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s)), scale, acc);
}
// [v[j] x 8, v[j+1] x 8] from 8 floats
static inline __m512 pair(__m256 v, int j) {
  return _mm512_permutexvar_ps(_mm512_inserti64x4(_mm512_set1_epi32(j), _mm256_set1_epi32(j + 1), 1), _mm512_castps256_ps512(v));
}
#endif

// ggml's vectorized SiLU (vec.h ggml_v_expf / ggml_v_silu: the "arm limited" exp, max error ~1.5 ulp), the
// one its swiglu uses: x / (1 + exp(-x)). The AVX2 and AVX-512 versions round differently (k + k j with
// one fma there, (1 + j) 2^n here), as llama.cpp's AVX2 and AVX-512 builds do.
static inline __m256 v_expf(__m256 x) {
  const __m256 r = _mm256_set1_ps(0x1.8p23f);
  const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
  const __m256 n = _mm256_sub_ps(z, r);
  const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
  const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
  const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1))));
  const __m256i c = _mm256_castps_si256(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n), _mm256_set1_ps(126), _CMP_GT_OQ));
  const __m256 u = _mm256_mul_ps(b, b);
  const __m256 j = _mm256_fmadd_ps(
      _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                      _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
      u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
  if (!_mm256_movemask_ps(_mm256_castsi256_ps(c))) return _mm256_fmadd_ps(j, k, k);
  const __m256i g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                     _mm256_set1_epi32((int)0x82000000u));
  const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
  const __m256i d = _mm256_castps_si256(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n), _mm256_set1_ps(192), _CMP_GT_OQ));
  return _mm256_or_ps(_mm256_and_ps(_mm256_castsi256_ps(d), _mm256_mul_ps(s1, s1)),
                      _mm256_andnot_ps(_mm256_castsi256_ps(d),
                                       _mm256_or_ps(_mm256_and_ps(_mm256_castsi256_ps(c), _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                                                    _mm256_andnot_ps(_mm256_castsi256_ps(c), _mm256_fmadd_ps(k, j, k)))));
}
static inline __m256 v_silu(__m256 x) {
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1), v_expf(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}
#ifdef __AVX512F__
static inline __m512 v_expf(__m512 x) {
  const __m512 r = _mm512_set1_ps(0x1.8p23f);
  const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r);
  const __m512 n = _mm512_sub_ps(z, r);
  const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
  const __mmask16 d = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
  const __m512 u = _mm512_mul_ps(b, b);
  const __m512 j = _mm512_fmadd_ps(
      _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)), u,
                      _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
      u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
  const __m512 res = _mm512_scalef_ps(j, n);
  if (_mm512_kortestz(d, d)) return res;
  const __m512 alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ),
                                          _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
  return _mm512_mask_blend_ps(d, res, alt);
}
static inline __m512 v_silu(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1), v_expf(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}
#endif

// n f32 -> bf16 bits, rounded to nearest even (NaN -> 0x7fc0, as c10::BFloat16), as ggml_cpu_fp32_to_bf16
static inline void to_bf16(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512BF16__
  for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i*)(y + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#else
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256i b = _mm256_castps_si256(v);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(b, 16), one))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    // packus leaves 4 values per 64 bits, twice per 128-bit lane: keep quadwords 0 and 2
    _mm_storeu_si128((__m128i*)(y + i), _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08)));
  }
#endif
  for (; i < n; ++i) {
    uint32_t b;
    memcpy(&b, x + i, 4);
    y[i] = x[i] != x[i] ? 0x7fc0 : (uint16_t)((b + 0x7fff + ((b >> 16) & 1)) >> 16);
  }
}

// n f32 -> f16 bits, rounded to nearest even (ggml_cpu_fp32_to_fp16 with F16C)
static inline void to_f16(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i*)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

}  // namespace qk
