// SIMD helpers and the activation-row format of the quant kernels (quant_types.h, quant.cpp).
// Compiled once per ISA variant: "avx2" (AVX2 + FMA + F16C) and "avx512" (adds AVX512 F/BW/VL/DQ/
// VNNI/BF16); __AVX512F__ / __AVX512VNNI__ pick the wider paths.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace qk {

#ifdef __AVX512VNNI__
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

// One activation row as the kernels read it. Float weight types read f (K floats); block-quantized
// types read x quantized per 32 values (quantize_x): x[i] ~= d[i/32] * q[i].
struct XRow {
  const float* f = nullptr;        // (K) f32
  const int8_t* q = nullptr;       // (K) int8
  const float* d = nullptr;        // (K/32) block scale
  const float* s = nullptr;        // (K/32) d * sum(q) over the block: offset codes (Q4_0's -8, K-quant mins)
  const int16_t* s16 = nullptr;    // (K/16) sum(q) over each 16 values: Q6_K's -32 under its per-16 scales
};

#define FOR_X _Pragma("GCC unroll 8") for (int r = 0; r < NX; ++r)

static inline uint16_t u16(const uint8_t* p) { uint16_t h; memcpy(&h, p, 2); return h; }
static inline float fp16(const uint8_t* p) { return _cvtsh_ss(u16(p)); }

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
static inline __m256i lo4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
static inline __m256i hi4(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
// 16 bytes of nibble pairs -> 32 codes: the low nibbles (values 0..15 of the block), then the high ones
static inline __m256i nib16(const uint8_t* p) {
  const __m128i t = ld16(p);
  return lo4(_mm256_set_m128i(_mm_srli_epi16(t, 4), t));
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

// n f32 -> bf16 bits, rounded to nearest even (NaN -> 0x7fc0, as c10::BFloat16)
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
    const int h0 = (int)hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(i32[0], i32[1])));   // exact: |sum| <= 16 * 127
    const int h1 = (int)hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(i32[2], i32[3])));
    s16[2 * b] = (int16_t)h0;
    s16[2 * b + 1] = (int16_t)h1;
    s[b] = d[b] * (float)(h0 + h1);
    // the packs interleave 128-bit lanes: dwords come out as 0 4 1 5 2 6 3 7
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
}

}  // namespace qk
