// AMX tile products (the "amx" variant: Xeon 4th generation and later, amx_tile + amx_int8) of many activation
// rows with a Q4_K x8 weight, 16 weight rows (two groups) at a time. The x8 layout already is the tiles'
// VNNI order: a step's [8 rows][4 bytes] of a group, both groups side by side, is one 64-byte row of a B tile
// (4 consecutive values of 16 weight rows), so a block's B tiles are its nibbles unpacked, once for all x rows.
// The x rows (Q8_K int8, gathered 16 to an A tile) go through TDPBSUD (int8 x uint8 -> int32) per 32-value
// sub-block, and each sub-block's int32 tile is scaled in f32 by its rows' d sc_j: the integers multiplied are
// ggml's (vec_dot_q4_K_q8_K), as in quant_x8.h; the scales are applied per sub-block in f32 instead of summed
// in int32 first (a tile has no int32 multiply), a rounding difference of ~1e-7 relative.
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

// x rows n (any count) gathered for tiles: int8 values 16 rows to a tile (zero rows pad the last), each row's
// Q8_K d per super-block, and its pairs of 32-value sums as quant_x8.h's bsum_pair
struct AmxX {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> bp;
  int64_t n16 = 0;
  void gather(const XRow* x, int64_t n, int64_t K) {
    const int64_t nb = K / 256;
    n16 = (n + 15) / 16 * 16;
    q.resize(n16 * K);
    d.resize(n16 * nb);
    bp.resize(n16 * nb * 4);
    std::fill(q.begin() + n * K, q.end(), 0);            // the padding rows; rows < n are written below
    std::fill(d.begin() + n * nb, d.end(), 0.f);
    std::fill(bp.begin() + n * nb * 4, bp.end(), 0);
    for (int64_t t = 0; t < n; ++t) {
      memcpy(q.data() + t * K, x[t].q, K);
      for (int64_t b = 0; b < nb; ++b) {
        d[t * nb + b] = x[t].d[b];
        for (int p = 0; p < 4; ++p) bp[(t * nb + b) * 4 + p] = Q4_K_X8::bsum_pair(x[t].bs + 16 * b, p);
      }
    }
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

bool amx_takes(const Weight& w, int64_t n) { return w.type == GGML_Q4_K_X8 && n >= AMX_MIN_N && amx_ready(); }

// Rows r0.. of w times n x rows through the tiles, 16 rows at a time: out[i * ldo + r]. Returns the first row
// not done (r0 when the tiles do not take w or n; the caller's kernels do the rest).
int64_t amx_rows(const Weight& w, int64_t r0, int64_t r1, const XRow* xr, int64_t n, float* out, int64_t ldo) {
  if (r1 - r0 < 16 || !amx_takes(w, n)) return r0;
  thread_local AmxX x;
  x.gather(xr, n, w.k);
  static const TileConfig cfg;
  _tile_loadconfig(&cfg);
  int64_t r = r0;
  for (; r + 16 <= r1; r += 16) amx_q4k_block(w, r, x, n, out, ldo);
  _tile_release();
  return r;
}
