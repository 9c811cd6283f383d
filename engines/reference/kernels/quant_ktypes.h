// The 256-value super-block types (x as Q8_K): Q4_K, Q5_K, Q6_K, IQ4_XS. Dequantization and dots as in
// quant_types.h, their integers and scales combined as ggml's x86 vec_dot_*_q8_K.
#pragma once
#include "quant_types.h"

namespace qk {

// Q4_K, Q5_K, Q6_K, IQ4_XS as ggml's x86 dots: per super-block an int32 sum of code . q under the
// integer sub-block scales (vpmaddubsw pairs, then vpmaddwd / vpdpwssd with the scales), times
// d = d_x * d_w; Q4_K/Q5_K add (-d_x dmin_w) sum_j m_j (bsums of group j); Q6_K's -32 and IQ4_XS's
// signed values stay inside the int32 sum. A type supplies: prep (the block's d, dmin and integer
// scales), codes(j) (32 unsigned codes of group j; IQ4_XS: signed kvalues) and scale16(j) (the int16
// scale of each byte pair of group j); on avx512 codes2/scale16x2 for groups j, j + 1.

struct KBlock {
  float d, dmin;                 // d_w, dmin_w (f16 values)
  __m128i sc;                    // Q4_K/Q5_K/IQ4_XS: 8 int16 sub-block scales; Q6_K: 16 int8 (one per 16 values)
  __m256i mins;                  // Q4_K/Q5_K: m_j twice each (int16), to pair with x's 16 bsums
};

// vpshufb masks picking int16 lane j of a 128-bit lane (16 times): the scale of group j for vpmaddwd
alignas(64) constexpr int8_t PICK16[8][32] = {
#define P(j) {2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, \
               2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, \
               2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1}
    P(0), P(1), P(2), P(3), P(4), P(5), P(6), P(7)
#undef P
};
// int16 scale of every byte pair of group j (8 sub-block scales sc as int16)
static inline __m256i pick16(__m128i sc, int j) {
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(sc), _mm256_load_si256((const __m256i*)PICK16[j]));
}
#ifdef __AVX512F__
// the same for groups j (low 256 bits) and j + 1 (high)
static inline __m512i pick16x2(__m128i sc, int j) {
  return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(sc), join(ld(PICK16[j]), ld(PICK16[j + 1])));
}
#endif

// ggml get_scale_min_k4 for all 8 sub-blocks: the 6-bit scales and mins packed in 12 bytes
static inline void scales_k4(const uint8_t* p, uint8_t* sc, uint8_t* m) {
  uint32_t u[4];
  memcpy(u, p, 12);
  const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  u[3] = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);   // mins 4..7
  const uint32_t m03 = u[1] & m6;                           // mins 0..3
  u[1] = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);           // scales 4..7
  u[2] = m03;
  u[0] &= m6;                                               // scales 0..3
  memcpy(sc, u, 8);
  memcpy(m, u + 2, 8);
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
  static constexpr int QK = 256, BYTES = Q5 ? 176 : 144, QS = Q5 ? 48 : 16;
  static constexpr XFmt FMT = X_Q8_K;
  static constexpr bool SIGNED = false, MINS = true, Q6 = false;
  static void prep(const uint8_t* p, KBlock& k) {
    alignas(16) uint8_t sm[16];                              // 8 scales, then 8 mins
    scales_k4(p + 4, sm, sm + 8);
    k.d = fp16(p);
    k.dmin = fp16(p + 2);
    const __m256i both = _mm256_cvtepu8_epi16(ld16(sm));
    k.sc = _mm256_castsi256_si128(both);
    const __m128i m16 = _mm256_extracti128_si256(both, 1);                                          // m_0..m_7
    k.mins = _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16));        // m_j, m_j
  }
  static __m256i codes(const uint8_t* p, int j) {
    const __m256i v = ld(p + QS + 32 * (j / 2)), u = j & 1 ? hi4(v) : lo4(v);
    return Q5 ? _mm256_or_si256(u, bit_to_16(ld(p + 16), j)) : u;
  }
  static __m256i scale16(const KBlock& k, int j) { return pick16(k.sc, j); }
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
  static __m512i scale16x2(const KBlock& k, int j) { return pick16x2(k.sc, j); }
#endif
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES) {
      alignas(16) uint8_t sc[8], m[8];
      scales_k4(w + 4, sc, m);
      const float d = fp16(w), dmin = fp16(w + 2);
      for (int j = 0; j < 8; ++j, y += 32) {
        const __m256 d1 = _mm256_set1_ps(d * sc[j]), m1 = _mm256_set1_ps(dmin * m[j]);   // rounded as ggml does
        alignas(32) uint8_t u[32];
        _mm256_store_si256((__m256i*)u, codes(w, j));
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_sub_ps(_mm256_mul_ps(d1, cvt8u(u + 8 * i)), m1));
      }
    }
  }
};
using Q4_K = QK_4_5<false>;
using Q5_K = QK_4_5<true>;

// Q6_K: ql[128] low 4 bits, qh[64] high 2 bits, int8 scales[16] (one per 16 values), f16 d.
// Half h (128 values) uses ql[64h..], qh[32h..]; its 32-value group i: low nibbles of ql[l] (i = 0),
// of ql[l+32] (1), high nibbles of ql[l] (2), of ql[l+32] (3), bits 2i..2i+1 of qh[l] as bits 4..5.
// w = d sc[16-value group] (u - 32); the -32 is 32 sum_g sc_g bsums_g inside the int32 sum.
struct Q6_K {
  static constexpr int QK = 256, BYTES = 210;
  static constexpr XFmt FMT = X_Q8_K;
  static constexpr bool SIGNED = false, MINS = false, Q6 = true;
  static void prep(const uint8_t* p, KBlock& k) {
    k.d = fp16(p + 208);
    k.sc = ld16(p + 192);
  }
  static __m256i codes(const uint8_t* p, int g) {      // 32-value group g = 0..7, u in 0..63
    const int h = g / 4, i = g % 4;
    const __m256i l = ld(p + 64 * h + 32 * (i & 1)), qh = ld(p + 128 + 32 * h);
    const __m256i hb = _mm256_and_si256(i < 2 ? _mm256_slli_epi16(qh, 4 - 2 * i) : _mm256_srli_epi16(qh, 2 * i - 4),
                                        _mm256_set1_epi8(0x30));
    return _mm256_or_si256(i < 2 ? lo4(l) : hi4(l), hb);
  }
  // the group's first 16 values sc[2g], the second sc[2g+1]
  static __m256i scale16(const KBlock& k, int g) {
    const int64_t ones = 0x0101010101010101ll;
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(k.sc, _mm_set_epi64x(ones * (2 * g + 1), ones * (2 * g))));
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
  static __m512i scale16x2(const KBlock& k, int g) {   // sc[2g], sc[2g+1], sc[2g+2], sc[2g+3], 8 pairs each
    const int64_t ones = 0x0101010101010101ll;
    const __m256i idx = _mm256_set_epi64x(ones * (2 * g + 3), ones * (2 * g + 2), ones * (2 * g + 1), ones * (2 * g));
    return _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(k.sc), idx));
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
};

// IQ4_XS: f16 d, u16 scales_h, scales_l[4], 128 bytes of nibbles (16 per sub-block, low nibbles
// first). ls_j = 4 bits of scales_l (low nibble for even j) | 2 bits of scales_h << 4;
// w = d (ls_j - 32) kvalues_iq4nl[u]: signed values, |kv| <= 127 (avx2: the sign moves onto x;
// avx512: |kv| times x negated where kv < 0, i.e. code < 8).
struct IQ4_XS {
  static constexpr int QK = 256, BYTES = 136;
  static constexpr XFmt FMT = X_Q8_K;
  static constexpr bool SIGNED = true, MINS = false, Q6 = false;
  static void prep(const uint8_t* p, KBlock& k) {
    uint32_t l;
    memcpy(&l, p + 4, 4);
    k.d = fp16(p);
    const __m256i lo = _mm256_srlv_epi32(_mm256_set1_epi32((int)l), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32(u16(p + 2)), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(15)),
                                                        _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4)),
                                        _mm256_set1_epi32(32));
    k.sc = _mm_packs_epi32(_mm256_castsi256_si128(ls), _mm256_extracti128_si256(ls, 1));     // 8 int16
  }
  static __m256i nibbles(const uint8_t* p, int j) { return nib16(p + 8 + 16 * j); }
  static __m256i codes(const uint8_t* p, int j) { return _mm256_shuffle_epi8(table16(KV_IQ4NL), nibbles(p, j)); }
  static __m256i scale16(const KBlock& k, int j) { return pick16(k.sc, j); }
#ifdef __AVX512F__
  static __m512i codes2(const uint8_t* p, int j) { return nib32(ld(p + 8 + 16 * j)); }   // the 4-bit codes
  static __m512i scale16x2(const KBlock& k, int j) { return pick16x2(k.sc, j); }
#endif
  static void dequant_row(const uint8_t* w, int64_t K, float* y) {
    for (int64_t b = 0; b < K / QK; ++b, w += BYTES) {
      KBlock k;
      prep(w, k);
      alignas(16) int16_t ls[8];
      _mm_store_si128((__m128i*)ls, k.sc);
      for (int j = 0; j < 8; ++j, y += 32) {
        const __m256 dl = _mm256_set1_ps(k.d * (float)ls[j]);
        alignas(32) int8_t v[32];
        _mm256_store_si256((__m256i*)v, codes(w, j));
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(dl, cvt8((const uint8_t*)v + 8 * i)));
      }
    }
  }
};

template <class T, int NX>
static void dot_k(const uint8_t* w, int64_t K, const XRow* x, float* y) {
  constexpr int A = NX <= 2 ? 2 : 1;            // int32 chains per x row (vpdpwssd's latency)
  __m256 acc[NX], accm[NX];
  FOR_X { acc[r] = _mm256_setzero_ps(); accm[r] = acc[r]; }
#ifdef __AVX512F__
  __m512 acc2[NX];
  FOR_X acc2[r] = _mm512_setzero_ps();
#endif
  for (int64_t b = 0; b < K / 256; ++b, w += T::BYTES) {
    KBlock k;
    T::prep(w, k);
    const int8_t* q[NX];
    FOR_X q[r] = x[r].q + 256 * b;
#ifdef __AVX512F__
    __m512i sumi[NX][A];
    FOR_X for (int a = 0; a < A; ++a) sumi[r][a] = _mm512_setzero_si512();
    _Pragma("GCC unroll 4") for (int j = 0; j < 8; j += 2) {
      const __m512i c = T::codes2(w, j), s = T::scale16x2(k, j);
      if constexpr (T::SIGNED) {
        const __m512i u = _mm512_shuffle_epi8(table64(KV_IQ4NL_ABS), c);
        const __mmask64 neg = _mm512_cmplt_epu8_mask(c, _mm512_set1_epi8(8));
        FOR_X {
          const __m512i qv = ld64(q[r] + 32 * j);
          const __m512i p = _mm512_maddubs_epi16(u, _mm512_mask_sub_epi8(qv, neg, _mm512_setzero_si512(), qv));
          sumi[r][j / 2 % A] = _mm512_dpwssd_epi32(sumi[r][j / 2 % A], p, s);
        }
      } else {
        FOR_X sumi[r][j / 2 % A] = _mm512_dpwssd_epi32(sumi[r][j / 2 % A], _mm512_maddubs_epi16(c, ld64(q[r] + 32 * j)), s);
      }
    }
    FOR_X {
      __m512i si = sumi[r][0];
      for (int a = 1; a < A; ++a) si = _mm512_add_epi32(si, sumi[r][a]);
      if constexpr (T::Q6)      // -32 sum_g sc_g bsums_g
        si = _mm512_sub_epi32(si, _mm512_zextsi256_si512(_mm256_slli_epi32(
                 _mm256_madd_epi16(ld(x[r].bs + 16 * b), _mm256_cvtepi8_epi16(k.sc)), 5)));
      acc2[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r].d[b] * k.d), _mm512_cvtepi32_ps(si), acc2[r]);
    }
#else
    __m256i sumi[NX];
    FOR_X sumi[r] = _mm256_setzero_si256();
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j) {
      const __m256i c = T::codes(w, j), s = T::scale16(k, j);
      FOR_X {
        const __m256i qv = ld(q[r] + 32 * j);
        const __m256i p = T::SIGNED ? _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(qv, c))
                                    : _mm256_maddubs_epi16(c, qv);
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, s));
      }
    }
    FOR_X {
      if constexpr (T::Q6)
        sumi[r] = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(_mm256_madd_epi16(ld(x[r].bs + 16 * b), _mm256_cvtepi8_epi16(k.sc)), 5));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r].d[b] * k.d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
#endif
    if constexpr (T::MINS)
      FOR_X accm[r] = _mm256_fmadd_ps(_mm256_set1_ps(-x[r].d[b] * k.dmin), _mm256_cvtepi32_ps(_mm256_madd_epi16(ld(x[r].bs + 16 * b), k.mins)), accm[r]);
  }
  FOR_X {
    float t = hsum(acc[r]) + hsum(accm[r]);
#ifdef __AVX512F__
    t += _mm512_reduce_add_ps(acc2[r]);
#endif
    y[r] = t;
  }
}

template <class T> struct KUnits : T {
  template <int NX> static void dot(const uint8_t* w, int64_t K, const XRow* x, float* y) { dot_k<T, NX>(w, K, x, y); }
};

}  // namespace qk
