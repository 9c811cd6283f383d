// Activation rows as the quant kernels multiply them: x converted once per product to the type ggml's
// CPU backend converts it to for the weight's type (its vec_dot_type, ggml-cpu.c type_traits_cpu), with
// ggml's own rounding, so every int8 value and every scale equals ggml's:
//   F32 weights: x as is;  F16: x rounded to f16;  BF16: x rounded to bf16
//   Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4: Q8_0 (per 32 values: d = f16(amax / 127), q = rint(x * 127 / amax))
//   Q4_1, Q5_1: Q8_1 (Q8_0 plus s = f16(d_f32 * sum(q)) per 32)
//   Q4_K, Q5_K, Q6_K, IQ4_XS: Q8_K (per 256: max = the x of largest |x|, iscale = -127 / max,
//                              q = rint(iscale x), d = 1 / iscale f32; per 16 sums of q)
// The Q8_0/Q8_1 quantizer is arch/x86/quants.c quantize_row_q8_0/_q8_1 (AVX2), Q8_K is
// ggml-quants.c quantize_row_q8_K_ref (what the x86 build calls).
#pragma once
#include <cmath>
#include <vector>
#include "quant_simd.h"

namespace qk {

enum XFmt : int { X_F32, X_F16, X_BF16, X_Q8_0, X_Q8_1, X_Q8_K, X_COUNT };

// One activation row in one format. Float formats read f; the int8 formats q and their scales.
struct XRow {
  const float* f = nullptr;        // (K) f32: x, or x rounded to f16 / bf16 (exact as f32)
  const int8_t* q = nullptr;       // (K) int8
  const float* d = nullptr;        // Q8_0/Q8_1: (K/32) the f16 d as f32; Q8_K: (K/256) d
  const float* s = nullptr;        // Q8_0: (K/32) d * sum(q) (exact in f32); Q8_1: (K/32) its f16 s
  const int16_t* bs = nullptr;     // Q8_K: (K/16) sums of q over 16 values
  const float* src = nullptr;      // (K) the f32 row it was converted from
};

// Q8_0 / Q8_1 (q8_1: s is f16(d_f32 sum(q)), else d sum(q)) of x (K), K % 32 == 0
static inline void quant_q8_0(const float* x, int64_t K, int8_t* q, float* d, float* s, bool q8_1) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < K / 32; ++b, x += 32, q += 32) {
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i] = _mm256_loadu_ps(x + 8 * i)));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float df = amax / 127.f;
    const __m256 id = _mm256_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i)
      i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const int sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3])));
    d[b] = round_f16(df);
    s[b] = q8_1 ? round_f16(df * (float)sum) : d[b] * (float)sum;     // f16 x 12-bit int: exact
    // the packs interleave 128-bit lanes: dwords come out as 0 4 1 5 2 6 3 7
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
}

// Q8_K of x (K), K % 256 == 0
static inline void quant_q8_K(const float* x, int64_t K, int8_t* q, float* d, int16_t* bs) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < K / 256; ++b, x += 256, q += 256, bs += 16) {
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 32; ++i) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    if (!(amax > 0.f)) {
      d[b] = 0.f;
      memset(q, 0, 256);
      memset(bs, 0, 32);
      continue;
    }
    const auto at_max = [&](int i) {                   // bit l: |x[i + l]| == amax
      return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), _mm256_set1_ps(amax), _CMP_EQ_OQ));
    };
    int j = 0, m;                                      // the first value of largest |x| keeps its sign
    while (!(m = at_max(j))) j += 8;
    j += __builtin_ctz(m);
    const float iscale = -127.f / x[j];
    const __m256 is = _mm256_set1_ps(iscale);
    for (int g = 0; g < 8; ++g) {                      // 32 values: 4 x 8 int32, packed as quant_q8_0 does
      __m256i i32[4];
      for (int i = 0; i < 4; ++i)
        i32[i] = _mm256_min_epi32(_mm256_set1_epi32(127), _mm256_cvtps_epi32(_mm256_round_ps(
            _mm256_mul_ps(_mm256_loadu_ps(x + 32 * g + 8 * i), is), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      bs[2 * g] = (int16_t)hsum_i32(_mm256_add_epi32(i32[0], i32[1]));
      bs[2 * g + 1] = (int16_t)hsum_i32(_mm256_add_epi32(i32[2], i32[3]));
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
      _mm256_storeu_si256((__m256i*)(q + 32 * g), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    d[b] = 1.f / iscale;
  }
}

// x rounded to f16 / bf16 and widened back to f32 (exact): what ggml's F16 / BF16 dots multiply
static inline void round_rows(const float* x, int64_t K, float* y, XFmt fmt) {
  std::vector<uint16_t> h(K);
  if (fmt == X_F16) {
    to_f16(x, h.data(), K);
    int64_t i = 0;
    for (; i + 8 <= K; i += 8) _mm256_storeu_ps(y + i, _mm256_cvtph_ps(ld16(h.data() + i)));
    for (; i < K; ++i) y[i] = _cvtsh_ss(h[i]);
  } else {
    to_bf16(x, h.data(), K);
    for (int64_t i = 0; i < K; ++i) { const uint32_t b = (uint32_t)h[i] << 16; memcpy(y + i, &b, 4); }
  }
}

// An activation row's values as the products see them, back in f32 (ggml's dequantize of the vec_dot_type):
// what the GEMM path multiplies the dequantized weights with
static inline void values(const XRow& x_r, XFmt fmt, int64_t K, float* y) {
  if (fmt == X_Q8_0 || fmt == X_Q8_1 || fmt == X_Q8_K) {
    const int64_t blk = fmt == X_Q8_K ? 256 : 32;
    for (int64_t i = 0; i < K; i += 8)
      _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_set1_ps(x_r.d[i / blk]), cvt8((const uint8_t*)x_r.q + i)));
  } else {
    memcpy(y, x_r.f, K * sizeof(float));
  }
}

// n activation rows of K values in format fmt: the storage behind their XRows
struct XBuf {
  std::vector<XRow> rows;
  std::vector<float> f, d, s;
  std::vector<int8_t> q;
  std::vector<int16_t> bs;

  // quantize row r of x (K values) into slot r; build() sizes the slots first
  void build(XFmt fmt, const float* x, int64_t n, int64_t K) {
    rows.assign(n, XRow{});
    const bool q8 = fmt == X_Q8_0 || fmt == X_Q8_1;
    if (fmt == X_F16 || fmt == X_BF16) f.resize(n * K);
    if (q8 || fmt == X_Q8_K) q.resize(n * K);
    if (q8) { d.resize(n * K / 32); s.resize(n * K / 32); }
    if (fmt == X_Q8_K) { d.resize(n * K / 256); bs.resize(n * K / 16); }
    for (int64_t r = 0; r < n; ++r) {
      XRow& x_r = rows[r];
      switch (fmt) {
        case X_F32: x_r.f = x + r * K; break;
        case X_F16: case X_BF16: x_r.f = &f[r * K]; break;
        case X_Q8_0: case X_Q8_1: x_r = {nullptr, &q[r * K], &d[r * K / 32], &s[r * K / 32], nullptr}; break;
        case X_Q8_K: x_r = {nullptr, &q[r * K], &d[r * K / 256], nullptr, &bs[r * K / 16]}; break;
        default: break;
      }
      x_r.src = x + r * K;
    }
  }
  void fill(XFmt fmt, const float* x, int64_t r, int64_t K) {
    XRow& x_r = rows[r];
    switch (fmt) {
      case X_F16: case X_BF16: round_rows(x + r * K, K, (float*)x_r.f, fmt); break;
      case X_Q8_0: case X_Q8_1: quant_q8_0(x + r * K, K, (int8_t*)x_r.q, (float*)x_r.d, (float*)x_r.s, fmt == X_Q8_1); break;
      case X_Q8_K: quant_q8_K(x + r * K, K, (int8_t*)x_r.q, (float*)x_r.d, (int16_t*)x_r.bs); break;
      default: break;
    }
  }
};

}  // namespace qk
