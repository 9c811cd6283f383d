// AMX tile products (the "amx" variant: Xeon 4th generation and later, amx_tile + amx_int8) of many activation
// rows with a Q4_K, IQ4_XS or IQ4_NL x8 weight, 16 weight rows (two groups) at a time. The x8 layout already is
// the tiles' VNNI order: a step's [8 rows][4 bytes] of a group, both groups side by side, is one 64-byte row of a
// B tile (4 consecutive values of 16 weight rows), so a block's B tiles are its nibbles unpacked (IQ4: through the
// code table), once for all x rows. The x rows (int8, gathered 16 to an A tile) go through one TDPBSUD (Q4_K:
// int8 x uint8) or TDPBSSD (IQ4: int8 x int8) per 32-value sub-block, whose int32 tile is stored and scaled.
// Q4_K scales each sub-block's tile in f32 by its rows' d sc_j: the integers multiplied are ggml's
// (vec_dot_q4_K_q8_K), as in quant_x8.h, the scales applied per sub-block in f32 instead of summed in int32 first,
// a rounding difference of ~1e-7 relative.
// Included inside quant.cpp's anonymous namespace (Weight, XRow, ...) when built with -mamx-int8.
#pragma once

// Linux hands a process the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); false: no AMX here
bool amx_ready() {
  static const bool ok = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// The fewest x rows the tiles take (a tile holds 16; fewer rows pad it with zeros). Measured on 2 threads of a
// Xeon with AMX (benchmarks/kernels.py --types Q4_K --isa avx512,amx, moe_prefill of 512 tokens, ~32 rows an
// expert): 370 GFLOP/s against vpdpbusd's 329. Each 32-value sub-block's int32 tile goes through memory to be
// scaled: that store, not the TMUL, bounds the tiles here (~2x at most over vpdpbusd, not the TMUL's 8x).
constexpr int64_t AMX_MIN_N = 16;

// tmm0-3: int32 results (16 x rows x 16 weight rows); tmm4-5: A (16 x rows x 32 int8 values);
// tmm6-7: B (8 rows of 4 values x 16 weight rows)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 32, 32, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 8, 8};
};

// x rows n (any count) gathered for tiles: int8 values 16 rows to a tile (zero rows pad the last), each row's d
// per block of qk values (Q8_K: 256, Q8_0: 32) and, for Q4_K, its pairs of 32-value sums as quant_x8.h's bsum_pair
struct AmxX {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> bp;
  int64_t n16 = 0;
  void gather(const XRow* x, int64_t n, int64_t K, int64_t qk, bool pairs) {
    const int64_t nb = K / qk;
    n16 = (n + 15) / 16 * 16;
    q.resize(n16 * K);
    d.resize(n16 * nb);
    std::fill(q.begin() + n * K, q.end(), 0);            // the padding rows; rows < n are written below
    std::fill(d.begin() + n * nb, d.end(), 0.f);
    for (int64_t t = 0; t < n; ++t) {
      memcpy(q.data() + t * K, x[t].q, K);
      memcpy(d.data() + t * nb, x[t].d, nb * sizeof(float));
    }
    if (!pairs) return;
    bp.resize(n16 * nb * 4);
    std::fill(bp.begin() + n * nb * 4, bp.end(), 0);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t b = 0; b < nb; ++b)
        for (int p = 0; p < 4; ++p) bp[(t * nb + b) * 4 + p] = Q4_K_X8::bsum_pair(x[t].bs + 16 * b, p);
  }
};

// One block of 16 weight rows (groups g and g + gs) unpacked for the tiles: per 32-value sub-block j its B tile
// (8 x 64 bytes) and its rows' d sc_j; per super-block the rows' dmin and mins as quant_x8.h's pairs
struct AmxQ4K {
  std::vector<uint8_t> b;
  std::vector<float> ws, dm;
  std::vector<__m512i> mn;
  void unpack(const uint8_t* g, int64_t K) {
    using Q = Q4_K_X8;
    const int64_t nb = K / Q::QK, gs = nb * Q::GBYTES;
    b.resize(nb * 8 * 512);
    ws.resize(nb * 8 * 16);
    dm.resize(nb * 16);
    mn.resize(nb * 4);
    for (int64_t s = 0; s < nb; ++s, g += Q::GBYTES) {
      __m512i sm[4];
      scales_x8(V16::load(g + Q::U, gs), V16::load(g + Q::U + 32, gs), V16::load(g + Q::U + 64, gs), sm, V16::and_,
                V16::or_, V16::srl32, V16::sll32, V16::set1);
      const __m512 dw = V16::half(g, gs);
      _mm512_storeu_ps(dm.data() + 16 * s, V16::half(g + 16, gs));
      for (int j = 0; j < 8; ++j) {
        const __m512i sc = V16::shuffle(sm[j < 4 ? 0 : 2], V16::mask(X8_B32[j % 4]));
        _mm512_storeu_ps(ws.data() + (8 * s + j) * 16, _mm512_mul_ps(dw, _mm512_cvtepi32_ps(sc)));
      }
      for (int p = 0; p < 4; ++p) mn[4 * s + p] = V16::shuffle(sm[p < 2 ? 1 : 3], V16::mask(X8_PAIR[p % 2]));
      const uint8_t* qs = g + Q::QS;
      for (int c = 0; c < 4; ++c, qs += 256)
        for (int l = 0; l < 8; ++l) {
          const __m512i w = V16::load(qs + 32 * l, gs);
          _mm512_storeu_si512(b.data() + (8 * s + 2 * c) * 512 + 64 * l, lo4(w));
          _mm512_storeu_si512(b.data() + (8 * s + 2 * c + 1) * 512 + 64 * l, hi4(w));
        }
    }
  }
};

// Rows r .. r + 15 (r a multiple of 8, two whole groups) of a Q4_K x8 weight times the gathered x rows:
// out[t * ldo + r + lane] for t < n
void amx_q4k_block(const Weight& w, int64_t r, const AmxX& x, int64_t n, float* out, int64_t ldo) {
  thread_local AmxQ4K wb;
  const int64_t K = w.k, nb = K / 256;
  wb.unpack(w.row(r), K);
  alignas(64) int32_t c[4][16][16];
  alignas(64) float acc[16][16];
  for (int64_t t0 = 0; t0 < x.n16; t0 += 16) {
    memset(acc, 0, sizeof acc);
    const int8_t* a = x.q.data() + t0 * K;
    for (int64_t s = 0; s < nb; ++s) {
      __m512 tmp[16];
      for (int t = 0; t < 16; ++t) tmp[t] = _mm512_setzero_ps();
      for (int j0 = 0; j0 < 8; j0 += 4) {
        const uint8_t* bt = wb.b.data() + (8 * s + j0) * 512;
        const int8_t* at = a + 256 * s + 32 * j0;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(4, at, K);       _tile_loadd(6, bt, 64);        _tile_dpbsud(0, 4, 6);
        _tile_loadd(5, at + 32, K);  _tile_loadd(7, bt + 512, 64);  _tile_dpbsud(1, 5, 7);
        _tile_loadd(4, at + 64, K);  _tile_loadd(6, bt + 1024, 64); _tile_dpbsud(2, 4, 6);
        _tile_loadd(5, at + 96, K);  _tile_loadd(7, bt + 1536, 64); _tile_dpbsud(3, 5, 7);
        _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64); _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
        const float* wsj = wb.ws.data() + (8 * s + j0) * 16;
        for (int t = 0; t < 16; ++t)
          for (int jj = 0; jj < 4; ++jj)
            tmp[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[jj][t])), _mm512_loadu_ps(wsj + 16 * jj), tmp[t]);
      }
      const __m512 dm = _mm512_loadu_ps(wb.dm.data() + 16 * s);
      for (int t = 0; t < 16; ++t) {
        const int32_t* bp = x.bp.data() + ((t0 + t) * nb + s) * 4;
        __m512i summ = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p) summ = _mm512_add_epi32(summ, _mm512_madd_epi16(wb.mn[4 * s + p], _mm512_set1_epi32(bp[p])));
        const __m512 v = _mm512_fnmadd_ps(dm, _mm512_cvtepi32_ps(summ), tmp[t]);
        _mm512_store_ps(acc[t], _mm512_fmadd_ps(v, _mm512_set1_ps(x.d[(t0 + t) * nb + s]), _mm512_load_ps(acc[t])));
      }
    }
    for (int64_t t = 0; t < std::min<int64_t>(16, n - t0); ++t) _mm512_storeu_ps(out + (t0 + t) * ldo + r, _mm512_load_ps(acc[t]));
  }
}

// IQ4_XS and IQ4_NL x8 (quant_x8_signed.h): their codes through kvalues_iq4nl are signed int8, as x's are, so
// TDPBSSD gives each 32-value block's int32 dot that offset_dots forms with vpdpbusd, and the same integer and
// float steps follow (IQ4_XS: sum_j (ls_j - 32) dot_j per super-block; then acc += d_w d_x sum per block): the
// products equal the avx512 variant's bit for bit. One block of 16 weight rows unpacked: per 32-value sub-block u
// its B tile (8 x 64 bytes: steps 0-3's low nibbles through the table, then their high ones), per block the rows'
// d and, IQ4_XS, per sub-block the rows' ls_j - 32.
template <class T> struct AmxIQ4 {
  static constexpr int64_t SB = T::QK / 32;        // 32-value sub-blocks a block
  std::vector<int8_t> b;
  std::vector<float> dw;
  std::vector<__m512i> sc;
  void unpack(const uint8_t* g, int64_t K) {
    const int64_t nb = K / T::QK, gs = nb * T::GBYTES;
    b.resize(K / 32 * 512);
    dw.resize(nb * 16);
    sc.resize(SB > 1 ? K / 32 : 0);
    const __m512i kv = V16::mask(KV_IQ4NL);
    int8_t* bt = b.data();
    for (int64_t s = 0; s < nb; ++s, g += T::GBYTES) {
      _mm512_storeu_ps(dw.data() + 16 * s, V16::half(g, gs));
      if constexpr (SB > 1) {
        const __m512i sh = V16::u16(g + T::SH, gs), sl = V16::load(g + T::SL, gs);
        for (int j = 0; j < 8; ++j) sc[8 * s + j] = T::template scale<V16>(sh, sl, j);
      }
      for (int j = 0; j < SB; ++j, bt += 512)
        for (int l = 0; l < 4; ++l) {
          const __m512i w = V16::load(g + T::QS + 128 * j + 32 * l, gs);
          _mm512_storeu_si512(bt + 64 * l, V16::shuffle(kv, lo4(w)));
          _mm512_storeu_si512(bt + 64 * (4 + l), V16::shuffle(kv, hi4(w)));
        }
    }
  }
};

// TDPBSSD of sub-blocks u .. u + m - 1 (m <= 4) of the 16 x rows at a, into c[0 .. m - 1]
static inline void amx_iq4_dots(const int8_t* a, int64_t K, const int8_t* bt, int m, int32_t (*c)[16][16]) {
  _tile_zero(0); _tile_loadd(4, a, K);       _tile_loadd(6, bt, 64);        _tile_dpbssd(0, 4, 6);
  if (m > 1) { _tile_zero(1); _tile_loadd(5, a + 32, K);  _tile_loadd(7, bt + 512, 64);  _tile_dpbssd(1, 5, 7); }
  if (m > 2) { _tile_zero(2); _tile_loadd(4, a + 64, K);  _tile_loadd(6, bt + 1024, 64); _tile_dpbssd(2, 4, 6); }
  if (m > 3) { _tile_zero(3); _tile_loadd(5, a + 96, K);  _tile_loadd(7, bt + 1536, 64); _tile_dpbssd(3, 5, 7); }
  _tile_stored(0, c[0], 64);
  if (m > 1) _tile_stored(1, c[1], 64);
  if (m > 2) _tile_stored(2, c[2], 64);
  if (m > 3) _tile_stored(3, c[3], 64);
}

// Rows r .. r + 15 of an IQ4_XS or IQ4_NL x8 weight times the gathered x rows: out[t * ldo + r + lane] for t < n
template <class T>
void amx_iq4_block(const Weight& w, int64_t r, const AmxX& x, int64_t n, float* out, int64_t ldo) {
  thread_local AmxIQ4<T> wb;
  constexpr int64_t SB = AmxIQ4<T>::SB;
  const int64_t K = w.k, nu = K / 32, nb = K / T::QK;
  wb.unpack(w.row(r), K);
  alignas(64) int32_t c[4][16][16];
  for (int64_t t0 = 0; t0 < x.n16; t0 += 16) {
    __m512 acc[16];
    __m512i sum[16];
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps(), sum[t] = _mm512_setzero_si512();
    const int8_t* a = x.q.data() + t0 * K;
    const float* dx = x.d.data() + t0 * nb;
    for (int64_t u0 = 0; u0 < nu; u0 += 4) {
      const int m = (int)std::min<int64_t>(4, nu - u0);
      amx_iq4_dots(a + 32 * u0, K, wb.b.data() + 512 * u0, m, c);
      for (int i = 0; i < m; ++i) {
        const int64_t u = u0 + i, b = u / SB;
        if constexpr (SB > 1)
          for (int t = 0; t < 16; ++t) sum[t] = V16::add(sum[t], V16::mullo(_mm512_load_si512(c[i][t]), wb.sc[u]));
        if (SB > 1 && u % SB != SB - 1) continue;
        const __m512 d = _mm512_loadu_ps(wb.dw.data() + 16 * b);
        for (int t = 0; t < 16; ++t) {
          const __m512i v = SB > 1 ? sum[t] : _mm512_load_si512(c[i][t]);
          acc[t] = V16::fma(V16::mul(d, V16::fset1(dx[t * nb + b])), v, acc[t]);
          if constexpr (SB > 1) sum[t] = _mm512_setzero_si512();
        }
      }
    }
    for (int64_t t = 0; t < std::min<int64_t>(16, n - t0); ++t) _mm512_storeu_ps(out + (t0 + t) * ldo + r, acc[t]);
  }
}

// The x8 types the tiles take, and the block of 16 rows of each
using AmxBlockFn = void (*)(const Weight&, int64_t, const AmxX&, int64_t, float*, int64_t);
AmxBlockFn amx_block(int64_t type) {
  switch (type) {
    case GGML_Q4_K_X8: return amx_q4k_block;
    case GGML_IQ4_XS_X8: return amx_iq4_block<IQ4_XS_X8>;
    case GGML_IQ4_NL_X8: return amx_iq4_block<IQ4_NL_X8>;
    default: return nullptr;
  }
}

bool amx_takes(const Weight& w, int64_t n) { return amx_block(w.type) && n >= AMX_MIN_N && amx_ready(); }

// Rows r0.. of w times n x rows through the tiles, 16 rows at a time: out[i * ldo + r]. Returns the first row
// not done (r0 when the tiles do not take w or n; the caller's kernels do the rest).
int64_t amx_rows(const Weight& w, int64_t r0, int64_t r1, const XRow* xr, int64_t n, float* out, int64_t ldo) {
  if (r1 - r0 < 16 || !amx_takes(w, n)) return r0;
  const AmxBlockFn block = amx_block(w.type);
  const bool q4k = w.type == GGML_Q4_K_X8;
  thread_local AmxX x;
  x.gather(xr, n, w.k, q4k || w.type == GGML_IQ4_XS_X8 ? 256 : 32, q4k);
  static const TileConfig cfg;
  _tile_loadconfig(&cfg);
  int64_t r = r0;
  for (; r + 16 <= r1; r += 16) block(w, r, x, n, out, ldo);
  _tile_release();
  return r;
}
