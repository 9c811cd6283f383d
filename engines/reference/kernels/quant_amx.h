// AMX tile products (the "amx" variant: Xeon 4th generation and later, amx_tile + amx_int8) of many activation
// rows with a Q4_K, IQ4_XS or IQ4_NL x8 weight, 16 weight rows (two groups) at a time. The x8 layout already is
// the tiles' VNNI order: a step's [8 rows][4 bytes] of a group, both groups side by side, is one 64-byte row of a
// B tile (4 consecutive values of 16 weight rows), so a block's B tiles are its nibbles unpacked (IQ4: through the
// code table), once for all x rows. The x rows (int8, gathered 16 to an A tile) go through one TDPBSUD (Q4_K:
// int8 x uint8) or TDPBSSD (IQ4: int8 x int8) per 32-value sub-block: the int32 dot the vpdpbusd kernels form
// (quant_x8.h, quant_x8_signed.h). Its tile is stored and the same integer and float steps follow as there: the
// sub-block scales times the dots summed in int32 (vpmulld), then per block acc += d_x d_w sum (Q4_K: minus
// d_x dmin sum_j m_j bsum_j), so the products equal the avx512 variant's bit for bit.
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

// The fewest x rows the tiles take of each type (a tile holds 16; fewer rows pad it with zeros), where they overtake
// vpdpbusd on 2 threads of a Xeon with AMX (matmul's rows path; 1536 x 2048 Q4_K, 1408 x 2816 IQ4_XS, 2816 x 704
// IQ4_NL; GFLOP/s avx512 -> amx): Q4_K 626 -> 630 at 32 rows, 696 -> 690 at 40, 650 -> 780 at 48; IQ4_XS 583 -> 588
// at 24, 589 -> 767 at 32; IQ4_NL 383 -> 717 at 16. Each sub-block's int32 tile goes through memory to be scaled:
// that store and the vector work after it, not the TMUL, bound the tiles here (not the TMUL's 8x over vpdpbusd).
constexpr int64_t AMX_MIN_N_Q4_K = 48, AMX_MIN_N_IQ4_XS = 24, AMX_MIN_N_IQ4_NL = 16;

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

// One block of 16 weight rows (groups g and g + gs) unpacked for the tiles: per 32-value sub-block u its B tile
// (8 x 64 bytes) and, where blocks hold several, its rows' integer scale; per block the rows' d (Q4_K: also dmin,
// and the mins as quant_x8.h's pairs)
template <class T> struct AmxW {
  static constexpr bool Q4K = std::is_same_v<T, Q4_K_X8>;
  static constexpr int64_t SB = T::QK / 32;        // 32-value sub-blocks a block
  std::vector<int8_t> b;
  std::vector<__m512i> sc, mn;
  std::vector<float> dw, dm;
  void unpack(const uint8_t* g, int64_t K) {
    const int64_t nb = K / T::QK, gs = nb * T::GBYTES;
    b.resize(K / 32 * 512);
    dw.resize(nb * 16);
    sc.resize(SB > 1 ? K / 32 : 0);
    int8_t* bt = b.data();
    const auto both = [](int8_t* t, int l, __m512i lo, __m512i hi, int step) {
      _mm512_storeu_si512(t + 64 * l, lo);
      _mm512_storeu_si512(t + step + 64 * l, hi);
    };
    if constexpr (Q4K) {
      dm.resize(nb * 16);
      mn.resize(nb * 4);
    }
    for (int64_t s = 0; s < nb; ++s, g += T::GBYTES) {
      _mm512_storeu_ps(dw.data() + 16 * s, V16::half(g, gs));
      if constexpr (Q4K) {
        // chunk c: low nibbles are sub-block 2c (values 64c + 4l..), high ones sub-block 2c + 1
        __m512i sm[4];
        scales_x8(V16::load(g + T::U, gs), V16::load(g + T::U + 32, gs), V16::load(g + T::U + 64, gs), sm, V16::and_,
                  V16::or_, V16::srl32, V16::sll32, V16::set1);
        _mm512_storeu_ps(dm.data() + 16 * s, V16::half(g + 16, gs));
        for (int j = 0; j < 8; ++j) sc[8 * s + j] = V16::shuffle(sm[j < 4 ? 0 : 2], V16::mask(X8_B32[j % 4]));
        for (int p = 0; p < 4; ++p) mn[4 * s + p] = V16::shuffle(sm[p < 2 ? 1 : 3], V16::mask(X8_PAIR[p % 2]));
        for (int c = 0; c < 4; ++c, bt += 1024)
          for (int l = 0; l < 8; ++l) {
            const __m512i w = V16::load(g + T::QS + 256 * c + 32 * l, gs);
            both(bt, l, lo4(w), hi4(w), 512);
          }
      } else {
        // step l of a 32-value block: low nibbles are values 4l.., high ones 16 + 4l..
        if constexpr (SB > 1) {
          const __m512i sh = V16::u16(g + T::SH, gs), sl = V16::load(g + T::SL, gs);
          for (int j = 0; j < 8; ++j) sc[8 * s + j] = T::template scale<V16>(sh, sl, j);
        }
        const __m512i kv = V16::mask(KV_IQ4NL);
        for (int j = 0; j < SB; ++j, bt += 512)
          for (int l = 0; l < 4; ++l) {
            const __m512i w = V16::load(g + T::QS + 128 * j + 32 * l, gs);
            both(bt, l, V16::shuffle(kv, lo4(w)), V16::shuffle(kv, hi4(w)), 256);
          }
      }
    }
  }
};

// The dots of sub-blocks u .. u + m - 1 (m <= 4) of the 16 x rows at a with B tiles bt, into c[0 .. m - 1]:
// TDPBSUD for Q4_K's unsigned nibbles, TDPBSSD for IQ4's signed codes
template <bool UNSIGNED>
static inline void amx_dots(const int8_t* a, int64_t K, const int8_t* bt, int m, int32_t (*c)[16][16]) {
#define AMX_DOT(C, A, B) if constexpr (UNSIGNED) _tile_dpbsud(C, A, B); else _tile_dpbssd(C, A, B)
  _tile_zero(0); _tile_loadd(4, a, K); _tile_loadd(6, bt, 64); AMX_DOT(0, 4, 6);
  if (m > 1) { _tile_zero(1); _tile_loadd(5, a + 32, K); _tile_loadd(7, bt + 512, 64); AMX_DOT(1, 5, 7); }
  if (m > 2) { _tile_zero(2); _tile_loadd(4, a + 64, K); _tile_loadd(6, bt + 1024, 64); AMX_DOT(2, 4, 6); }
  if (m > 3) { _tile_zero(3); _tile_loadd(5, a + 96, K); _tile_loadd(7, bt + 1536, 64); AMX_DOT(3, 5, 7); }
#undef AMX_DOT
  _tile_stored(0, c[0], 64);
  if (m > 1) _tile_stored(1, c[1], 64);
  if (m > 2) _tile_stored(2, c[2], 64);
  if (m > 3) _tile_stored(3, c[3], 64);
}

// Rows r .. r + 15 (r a multiple of 8, two whole groups) of an x8 weight of type T times the gathered x rows:
// out[t * ldo + r + lane] for t < n
template <class T>
void amx_block_of(const Weight& w, int64_t r, const AmxX& x, int64_t n, float* out, int64_t ldo) {
  constexpr bool Q4K = AmxW<T>::Q4K;
  constexpr int64_t SB = AmxW<T>::SB;
  thread_local AmxW<T> wb;
  const int64_t K = w.k, nu = K / 32, nb = K / T::QK;
  wb.unpack(w.row(r), K);
  alignas(64) int32_t c[4][16][16];
  for (int64_t t0 = 0; t0 < x.n16; t0 += 16) {
    __m512 acc[16];
    __m512i sum[16];
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps(), sum[t] = _mm512_setzero_si512();
    const int8_t* a = x.q.data() + t0 * K;
    for (int64_t u0 = 0; u0 < nu; u0 += 4) {
      const int m = (int)std::min<int64_t>(4, nu - u0);
      amx_dots<Q4K>(a + 32 * u0, K, wb.b.data() + 512 * u0, m, c);
      for (int i = 0; i < m; ++i) {
        const int64_t u = u0 + i, b = u / SB;
        if constexpr (SB > 1) {
          for (int t = 0; t < 16; ++t) sum[t] = V16::add(sum[t], V16::mullo(_mm512_load_si512(c[i][t]), wb.sc[u]));
          if (u % SB != SB - 1) continue;
        }
        const __m512 dw = _mm512_loadu_ps(wb.dw.data() + 16 * b);
        const __m512 dm = Q4K ? _mm512_loadu_ps(wb.dm.data() + 16 * b) : _mm512_setzero_ps();   // Q4_K's dmin
        for (int t = 0; t < 16; ++t) {
          const __m512 dx = V16::fset1(x.d[(t0 + t) * nb + b]);
          acc[t] = V16::fma(V16::mul(dx, dw), SB > 1 ? sum[t] : _mm512_load_si512(c[i][t]), acc[t]);
          if constexpr (Q4K) {
            const int32_t* bp = x.bp.data() + ((t0 + t) * nb + b) * 4;
            __m512i summ = _mm512_setzero_si512();
            for (int p = 0; p < 4; ++p) summ = V16::add(summ, V16::madd(wb.mn[4 * b + p], V16::set1(bp[p])));
            acc[t] = _mm512_fnmadd_ps(V16::mul(dx, dm), _mm512_cvtepi32_ps(summ), acc[t]);
          }
          if constexpr (SB > 1) sum[t] = _mm512_setzero_si512();
        }
      }
    }
    for (int64_t t = 0; t < std::min<int64_t>(16, n - t0); ++t) _mm512_storeu_ps(out + (t0 + t) * ldo + r, acc[t]);
  }
}

// The x8 types the tiles take: the block of 16 rows of each, and the fewest x rows it takes
using AmxBlockFn = void (*)(const Weight&, int64_t, const AmxX&, int64_t, float*, int64_t);
std::pair<AmxBlockFn, int64_t> amx_block(int64_t type) {
  switch (type) {
    case GGML_Q4_K_X8: return {amx_block_of<Q4_K_X8>, AMX_MIN_N_Q4_K};
    case GGML_IQ4_XS_X8: return {amx_block_of<IQ4_XS_X8>, AMX_MIN_N_IQ4_XS};
    case GGML_IQ4_NL_X8: return {amx_block_of<IQ4_NL_X8>, AMX_MIN_N_IQ4_NL};
    default: return {nullptr, 0};
  }
}

bool amx_takes(const Weight& w, int64_t n) {
  const auto [block, min_n] = amx_block(w.type);
  return block && n >= min_n && amx_ready();
}

// Rows r0.. of w times n x rows through the tiles, 16 rows at a time: out[i * ldo + r]. Returns the first row
// not done (r0 when the tiles do not take w or n; the caller's kernels do the rest).
int64_t amx_rows(const Weight& w, int64_t r0, int64_t r1, const XRow* xr, int64_t n, float* out, int64_t ldo) {
  if (r1 - r0 < 16 || !amx_takes(w, n)) return r0;
  const AmxBlockFn block = amx_block(w.type).first;
  thread_local AmxX x;
  x.gather(xr, n, w.k, w.kern->fmt == X_Q8_K ? 256 : 32, w.type == GGML_Q4_K_X8);
  static const TileConfig cfg;
  _tile_loadconfig(&cfg);
  int64_t r = r0;
  for (; r + 16 <= r1; r += 16) block(w, r, x, n, out, ldo);
  _tile_release();
  return r;
}
