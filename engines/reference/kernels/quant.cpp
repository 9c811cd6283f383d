// Products with GGUF weights as stored (engines/reference/qtensor.py): no float copy of a matrix is
// ever made, only a per-tile scratch in matmul. A weight is (raw uint8 bytes, byte offset, ggml type,
// n_rows, k): n_rows rows of k values, each row k / block * block_bytes bytes, one after another.
// x is converted once per product to the weight type's ggml vec_dot_type (quant_act.h). Rows are
// split over torch's intra-op threads (at::parallel_for); products smaller than MIN_TASK_BYTES of
// weights per thread run on the calling thread (a fork/join costs more than it saves there).
// The fused one-token steps of a transformer block are in decode.h.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <cmath>
#include <algorithm>
#include <utility>
#include <vector>
#ifdef __AMX_INT8__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "quant_x8_signed.h"

namespace {
using namespace qk;

using DotFn = void (*)(const uint8_t*, int64_t, const XRow*, float*);
using RowFn = void (*)(const uint8_t*, int64_t, float*);
// interleaved layouts (quant_x8.h): a group of G rows times n x rows -> out[r * ldo + lane]; one row of a group
using GroupDotFn = void (*)(const uint8_t*, int64_t, const XRow*, float*, int64_t);
using LaneFn = void (*)(const uint8_t*, int, int64_t, float*);
using PackFn = void (*)(const uint8_t*, int64_t, int64_t, uint8_t*);        // 8 file rows (rb apart), K -> a group
using UnpackFn = void (*)(const uint8_t*, int, int64_t, uint8_t*);          // a group's row lane, K -> file bytes
constexpr int GNX = 4;      // x rows a group kernel takes at once (its accumulators fill the registers)

// Activation rows one weight row is multiplied with at once: the accumulators fill 16 registers
// (avx2), 32 (avx512).
#ifdef __AVX512F__
constexpr int NX_MAX = 8;
#else
constexpr int NX_MAX = 4;
#endif

// A ggml type's kernels: dot[n - 1] multiplies a row with n = 1..NX_MAX activation rows in format fmt.
// An interleaved layout (group > 1 rows stored together, quant_x8.h) has gdot[n - 1] for a group times
// n = 1..GNX x rows and lane (one row of a group as f32) instead; bytes is then a row's share of a group.
struct Kernel {
  int64_t qk, bytes;
  XFmt fmt;
  DotFn dot[NX_MAX];
  RowFn dequant_row;
  int64_t group = 1;
  GroupDotFn gdot[GNX] = {};
  LaneFn lane = nullptr;
  GroupDotFn gdot2[GNX] = {};       // two adjacent groups at once, n >= 2 (avx512: 16 rows a zmm; F16 on avx2), or null
  PackFn pack = nullptr;
  UnpackFn unpack = nullptr;
};

template <class T, size_t... N> Kernel kernel(std::index_sequence<N...>) {
  return {T::QK, T::BYTES, T::FMT, {&T::template dot<N + 1>...}, &T::dequant_row};
}
template <class T> Kernel kernel() { return kernel<T>(std::make_index_sequence<NX_MAX>()); }
template <class T, int NX> constexpr GroupDotFn two_groups() {
  if constexpr (NX > 1) return &T::template dot2<NX>;
  else return nullptr;
}
template <class T, size_t... N> Kernel group_kernel(std::index_sequence<N...>) {
  Kernel k{T::QK, T::BYTES, T::FMT, {}, nullptr, T::G, {&T::template dot<N + 1>...}, &T::dequant_lane, {}, &T::pack,
           &T::unpack};
  if constexpr (T::DOT2) ((k.gdot2[N] = two_groups<T, N + 1>()), ...);
  return k;
}

enum : int64_t { GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
                 GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_IQ4_NL = 20, GGML_IQ4_XS = 23, GGML_BF16 = 30,
                 GGML_MXFP4 = 39,
                 // interleaved layouts: LAYOUT_X8 + the ggml type (engines/reference/qtensor.py LAYOUTS)
                 LAYOUT_X8 = 1000, GGML_Q4_K_X8 = LAYOUT_X8 + GGML_Q4_K, GGML_Q6_K_X8 = LAYOUT_X8 + GGML_Q6_K,
                 GGML_MXFP4_X8 = LAYOUT_X8 + GGML_MXFP4, GGML_Q8_0_X8 = LAYOUT_X8 + GGML_Q8_0,
                 GGML_F16_X8 = LAYOUT_X8 + GGML_F16,
                 GGML_IQ4_NL_X8 = LAYOUT_X8 + GGML_IQ4_NL, GGML_IQ4_XS_X8 = LAYOUT_X8 + GGML_IQ4_XS };

const Kernel& kernel_of(int64_t type) {
  static const Kernel f32 = kernel<F32>(), f16 = kernel<F16>(), bf16 = kernel<BF16>(), q8_0 = kernel<Units<Q8_0>>(),
      q4_0 = kernel<Units<Q4_0>>(), q4_1 = kernel<Units<Q4_1>>(), q5_0 = kernel<Units<Q5_0>>(),
      q5_1 = kernel<Units<Q5_1>>(), iq4_nl = kernel<Units<IQ4_NL>>(), mxfp4 = kernel<Units<MXFP4>>(),
      q4_k = kernel<KUnits<Q4_K>>(), q5_k = kernel<KUnits<Q5_K>>(), q6_k = kernel<KUnits<Q6_K>>(),
      iq4_xs = kernel<KUnits<IQ4_XS>>(), q4_k_x8 = group_kernel<Q4_K_X8>(std::make_index_sequence<GNX>()),
      q6_k_x8 = group_kernel<Q6_K_X8>(std::make_index_sequence<GNX>()),
      mxfp4_x8 = group_kernel<MXFP4_X8>(std::make_index_sequence<GNX>()),
      q8_0_x8 = group_kernel<Q8_0_X8>(std::make_index_sequence<GNX>()),
      f16_x8 = group_kernel<F16_X8>(std::make_index_sequence<GNX>()),
      iq4_nl_x8 = group_kernel<IQ4_NL_X8>(std::make_index_sequence<GNX>()),
      iq4_xs_x8 = group_kernel<IQ4_XS_X8>(std::make_index_sequence<GNX>());
  switch (type) {
    case GGML_F32: return f32;       case GGML_F16: return f16;       case GGML_BF16: return bf16;
    case GGML_Q8_0: return q8_0;     case GGML_Q4_0: return q4_0;     case GGML_Q4_1: return q4_1;
    case GGML_Q5_0: return q5_0;     case GGML_Q5_1: return q5_1;     case GGML_IQ4_NL: return iq4_nl;
    case GGML_MXFP4: return mxfp4;   case GGML_Q4_K: return q4_k;     case GGML_Q5_K: return q5_k;
    case GGML_Q6_K: return q6_k;     case GGML_IQ4_XS: return iq4_xs; case GGML_Q4_K_X8: return q4_k_x8;
    case GGML_Q6_K_X8: return q6_k_x8;          case GGML_MXFP4_X8: return mxfp4_x8;     case GGML_Q8_0_X8: return q8_0_x8;
    case GGML_IQ4_NL_X8: return iq4_nl_x8;      case GGML_IQ4_XS_X8: return iq4_xs_x8;   case GGML_F16_X8: return f16_x8;
  }
  TORCH_CHECK_VALUE(false, "unsupported ggml type ", type);
}

// A matrix (or an expert stack: `count` matrices `stride` bytes apart) inside raw, checked to lie
// within raw's bytes: GGUF files are untrusted input.
struct Weight {
  const Kernel* kern;
  int64_t type;
  const uint8_t* base;
  int64_t n, k, rb, stride;
  const uint8_t* row(int64_t r, int64_t expert = 0) const { return base + expert * stride + r * rb; }
  Weight expert(int64_t e) const { Weight w = *this; w.base += e * stride; return w; }
};

Weight weight(const at::Tensor& raw, int64_t off, int64_t type, int64_t n, int64_t k, int64_t count = 1, int64_t stride = 0) {
  TORCH_CHECK_VALUE(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 1 && raw.is_contiguous(),
                    "raw: 1-D contiguous uint8 CPU tensor");
  const Kernel& kern = kernel_of(type);
  TORCH_CHECK_VALUE(k > 0 && k % kern.qk == 0, "k = ", k, " is not a positive multiple of the type's block of ", kern.qk);
  TORCH_CHECK_VALUE(n >= 0 && off >= 0 && count >= 1 && stride >= 0, "negative size, offset or stride");
  const int64_t rb = k / kern.qk * kern.bytes, have = raw.numel();
  // off + (count - 1) * stride + n * rb <= have, written so that no product can overflow
  TORCH_CHECK_VALUE(off <= have && (n == 0 || rb <= (have - off) / n) &&
                    (count == 1 || stride <= (have - off - n * rb) / (count - 1)),
                    "weight: ", count, " x ", n, " rows of ", rb, " bytes at offset ", off, " do not fit in ", have, " bytes");
  TORCH_CHECK_VALUE(kern.group == 1 || (n % kern.group == 0 && off % (kern.group * rb) == 0 && stride % (kern.group * rb) == 0),
                    "an interleaved layout of ", kern.group, " rows needs whole groups, got ", n, " rows");
  return {&kern, type, raw.data_ptr<uint8_t>() + off, n, k, rb, stride};
}

// A weight as the Python side passes it: (raw, offset, ggml type, n_rows, k)
using WArg = std::tuple<at::Tensor, int64_t, int64_t, int64_t, int64_t>;
Weight weight(const WArg& a) { return weight(std::get<0>(a), std::get<1>(a), std::get<2>(a), std::get<3>(a), std::get<4>(a)); }
// An expert stack (n_expert matrices of n rows) as the Python side passes it: (raw, offset, stride, ggml type)
using SArg = std::tuple<at::Tensor, int64_t, int64_t, int64_t>;
Weight weight(const SArg& a, int64_t n, int64_t k, int64_t n_expert) {
  return weight(std::get<0>(a), std::get<1>(a), std::get<3>(a), n, k, n_expert, std::get<2>(a));
}

// Fewest weight bytes a thread's share of a product should read: below it the fork/join of the
// second thread (a few us when it spins, a scheduler wake-up when it sleeps) costs more than the
// share saves at ~30 GB/s a core (256 KiB: ~8 us).
constexpr int64_t MIN_TASK_BYTES = 256 << 10;
int64_t grain(int64_t bytes_per_item) { return std::max<int64_t>(1, MIN_TASK_BYTES / std::max<int64_t>(1, bytes_per_item)); }

// n activation rows of k f32 values (the caller keeps them), converted on first use to each format
// a product asks for (quant_act.h): once per format, however many weights read them.
class Acts {
  const float* x_;
  int64_t n_, k_;
  XBuf buf_[X_COUNT];
  bool ready_[X_COUNT] = {};

 public:
  Acts(const float* x, int64_t n, int64_t k) : x_(x), n_(n), k_(k) {}
  const XRow* rows(XFmt f) {
    if (!ready_[f]) {
      buf_[f].build(f, x_, n_, k_);
      if (f != X_F32)
        at::parallel_for(0, n_, grain(k_ * 4), [&](int64_t b, int64_t e) {
          for (int64_t r = b; r < e; ++r) buf_[f].fill(f, x_, r, k_);
        });
      ready_[f] = true;
    }
    return buf_[f].rows.data();
  }
};

at::Tensor f32_rows(const at::Tensor& x, int64_t k, const char* what) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == k,
                    what, ": f32 CPU tensor with last dim ", k);
  return x.reshape({-1, k}).contiguous();
}

// groups r0.. (whole groups up to r1) times n <= GNX x rows: out[i * ldo + r - r0], two groups at a time where
// the kernel has gdot2[n - 1] (n > 1). One x row (decode) streams one group at a time: on a Zen 4 EPYC, 2 threads, the
// two-group kernels read one token's routed experts at 28 GB/s against 32-40 one group at a time (every x8 type),
// and a 4096 x 4096 F16 matvec at 29 against 38 (benchmarks/kernels.py)
inline void group_dots(const Weight& w, int64_t r0, int64_t r1, const XRow* x, int64_t n, float* out, int64_t ldo) {
  const Kernel& kn = *w.kern;
  const int64_t g = kn.group;
  int64_t r = r0;
  if (kn.gdot2[n - 1])
    for (; r + 2 * g <= r1; r += 2 * g) kn.gdot2[n - 1](w.row(r), w.k, x, out + r - r0, ldo);
  for (; r < r1; r += g) kn.gdot[n - 1](w.row(r), w.k, x, out + r - r0, ldo);
}

// out[r - r0] = W row r . x, r in [r0, r1) (whole groups of an interleaved layout)
void row_dots(const Weight& w, int64_t r0, int64_t r1, const XRow* x, float* out) {
  const Kernel& kn = *w.kern;
  if (kn.group == 1)
    for (int64_t r = r0; r < r1; ++r) kn.dot[0](w.row(r), w.k, x, out + r - r0);
  else
    group_dots(w, r0, r1, x, 1, out, 1);
}

// parallel_for over the rows of w in whole groups: f(first row, end row)
template <class F> void for_rows(const Weight& w, int64_t grain_rows, const F& f) {
  const int64_t g = w.kern->group;
  at::parallel_for(0, w.n / g, std::max<int64_t>(1, grain_rows / g), [&](int64_t b, int64_t e) { f(b * g, e * g); });
}

// out[r] = W row r . x, r in [0, w.n): one activation row, split over the threads by weight bytes
void matvec_into(const Weight& w, Acts& a, float* out) {
  const XRow* xr = a.rows(w.kern->fmt);
  for_rows(w, grain(w.rb), [&](int64_t b, int64_t e) { row_dots(w, b, e, xr, out + b); });
}

// y (n_rows) = W x: x (k) f32
at::Tensor matvec(at::Tensor raw, int64_t off, int64_t type, int64_t n_rows, int64_t k, at::Tensor x) {
  const Weight w = weight(raw, off, type, n_rows, k);
  x = f32_rows(x, k, "x");
  TORCH_CHECK_VALUE(x.size(0) == 1, "x: one row");
  Acts a(x.data_ptr<float>(), 1, k);
  auto y = at::empty({n_rows}, x.options());
  matvec_into(w, a, y.data_ptr<float>());
  return y;
}

// One row of w as f32 (any layout)
void dequant_row(const Weight& w, int64_t r, float* y) {
  const int64_t g = w.kern->group;
  if (g == 1) w.kern->dequant_row(w.row(r), w.k, y);
  else w.kern->lane(w.row(r - r % g), (int)(r % g), w.k, y);
}

// rows r0..r0+n-1 of W into out (n, k) f32 or bf16, contiguous: bit-exact ggml dequantize_row_*
// (bf16: those f32 values rounded to nearest even).

void dequant_rows(const Weight& w, int64_t r0, int64_t n, at::Tensor& out) {
  const bool bf = out.scalar_type() == at::kBFloat16;
  at::parallel_for(0, n, grain(w.rb), [&](int64_t b, int64_t e) {
    std::vector<float> tmp(bf ? w.k : 0);
    for (int64_t r = b; r < e; ++r) {
      if (!bf) {
        dequant_row(w, r0 + r, out.data_ptr<float>() + r * w.k);
        continue;
      }
      dequant_row(w, r0 + r, tmp.data());
      to_bf16(tmp.data(), (uint16_t*)out.data_ptr<at::BFloat16>() + r * w.k, w.k);
    }
  });
}

void dequant(at::Tensor raw, int64_t off, int64_t type, int64_t n_rows, int64_t k, at::Tensor out) {
  const Weight w = weight(raw, off, type, n_rows, k);
  TORCH_CHECK_VALUE(out.device().is_cpu() && (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) &&
                    out.is_contiguous() && out.numel() == n_rows * k, "out: contiguous f32 or bf16 of n_rows * k values");
  dequant_rows(w, 0, n_rows, out);
}

// rows ids (n) of W (n_rows, k) dequantized: (n, k) f32 (an embedding lookup)
at::Tensor embed(at::Tensor raw, int64_t off, int64_t type, int64_t n_rows, int64_t k, at::Tensor ids) {
  const Weight w = weight(raw, off, type, n_rows, k);
  TORCH_CHECK_VALUE(ids.device().is_cpu() && !at::isFloatingType(ids.scalar_type()), "ids: integer CPU tensor");
  const at::Tensor idc = ids.to(at::kLong).contiguous();
  const int64_t n = idc.numel(), *id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK_VALUE(id[i] >= 0 && id[i] < n_rows, "id ", id[i], " out of range");
  auto out = at::empty({n, k}, at::TensorOptions().dtype(at::kFloat));
  at::parallel_for(0, n, grain(w.rb), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dequant_row(w, id[i], out.data_ptr<float>() + i * k);
  });
  return out;
}

// n_rows rows of k values (whole groups) from layout `from` in src to layout `to` in out: a ggml type and its
// interleaved layout (kernel_of codes: the types of qtensor.LAYOUT_TYPES <-> LAYOUT_X8 + them), a permutation of
// the bytes
void repack(at::Tensor src, int64_t from, int64_t to, int64_t n_rows, int64_t k, at::Tensor out) {
  const bool pack = to == from + LAYOUT_X8;
  TORCH_CHECK_VALUE((pack || from == to + LAYOUT_X8) && (pack ? to : from) >= LAYOUT_X8 && kernel_of(pack ? to : from).pack,
                    "repack: a type to its x8 layout or back, not ", from, " to ", to);
  TORCH_CHECK_VALUE(out.is_cpu() && out.scalar_type() == at::kByte && out.dim() == 1 && out.is_contiguous(), "out: uint8 CPU");
  const Kernel& il = kernel_of(pack ? to : from);
  const int64_t G = il.group;
  TORCH_CHECK_VALUE(n_rows % G == 0, "repack: ", n_rows, " rows are not whole groups of ", G);
  const Weight a = weight(src, 0, from, n_rows, k), b = weight(out, 0, to, n_rows, k);
  TORCH_CHECK_VALUE(a.n * a.rb == src.numel() && b.n * b.rb == out.numel(), "repack: src and out must hold exactly the rows");
  at::parallel_for(0, n_rows / G, grain(G * a.rb), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (pack) il.pack(a.row(G * g), a.rb, k, (uint8_t*)b.row(G * g));
      else for (int lane = 0; lane < G; ++lane) il.unpack(a.row(G * g), lane, k, (uint8_t*)b.row(G * g + lane));
    }
  });
}

// Whether matmul's GEMM runs in bf16 by default: oneDNN's bf16 GEMM (avx512_bf16; ~4x ATen's f32 GEMM here)
#ifdef __AVX512BF16__
const bool BF16_GEMM = true;
#else
const bool BF16_GEMM = false;
#endif

// Rows r0..r1-1 of W times n activation rows: out[i * ldo + r]. Each weight row is read from memory once,
// and each dot decodes its blocks once for NX_MAX x rows. Blocks of ROWS weight rows stay in L2 while
// every x group passes by, so x (n k bytes, past L2 for large n) is read (r1 - r0) / ROWS times, not r1 - r0.
#ifdef __AMX_INT8__
#include "quant_amx.h"
#else
bool amx_takes(const Weight&, int64_t) { return false; }
int64_t amx_rows(const Weight&, int64_t r0, int64_t, const XRow*, int64_t, float*, int64_t) { return r0; }
#endif

void rows_block(const Weight& w, int64_t r0, int64_t r1, const XRow* xr, int64_t n, float* out, int64_t ldo) {
  const int64_t ROWS = 16;
  if (w.kern->group > 1) {      // interleaved: AMX tiles where they take it, else groups of rows times GNX x rows
    r0 = amx_rows(w, r0, r1, xr, n, out, ldo);
    for (int64_t b = r0; b < r1; b += ROWS)
      for (int64_t i = 0; i < n; i += GNX)
        group_dots(w, b, std::min(r1, b + ROWS), xr + i, std::min<int64_t>(GNX, n - i), out + i * ldo + b, ldo);
    return;
  }
  float y[NX_MAX];
  for (int64_t b = r0; b < r1; b += ROWS)
    for (int64_t i = 0; i < n; i += NX_MAX) {
      const int64_t m = std::min<int64_t>(NX_MAX, n - i);
      for (int64_t r = b; r < std::min(r1, b + ROWS); ++r) {
        w.kern->dot[m - 1](w.row(r), w.k, xr + i, y);
        for (int64_t j = 0; j < m; ++j) out[(i + j) * ldo + r] = y[j];
      }
    }
}

// out (n, w.n) = x W^T through W in tiles of rows dequantized into a scratch and ATen's GEMM, in
// dtype st: bf16 (x's f32 source, W and the results rounded to bf16) or f32 with x as the rows kernel sees it (quantized
// and dequantized back: every product of the GEMM is one ggml's dot forms, rounded differently). F32 weights
// (and BF16 with the bf16 GEMM) go to the GEMM as they are. out may be a strided view (ld > w.n).
void gemm_into(const Weight& w, const XRow* xr, int64_t n, at::ScalarType st, at::Tensor out) {
  const int64_t k = w.k;
  // oneDNN (the bf16 GEMM) keeps a compiled primitive per shape, ~1 MiB each: x's rows padded with zeros to a
  // multiple of 32 hold the experts' many row counts to a few shapes (small:f16, 128 experts: 65 MiB less RSS)
  const int64_t np = st == at::kBFloat16 ? (n + 31) / 32 * 32 : n;
  at::Tensor xv = at::empty({np, k}, at::TensorOptions().dtype(at::kFloat));
  xv.narrow(0, n, np - n).zero_();
  at::parallel_for(0, n, grain(k * 4), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* y = xv.data_ptr<float>() + r * k;
      if (st == at::kFloat) values(xr[r], w.kern->fmt, k, y);
      else memcpy(y, xr[r].src, k * sizeof(float));
    }
  });
  // F32 and BF16 weights as they are: a view of the bytes (when aligned for the element type)
  const auto whole = [&](at::ScalarType t) {
    return at::from_blob((void*)w.base, {w.n, k}, at::TensorOptions().dtype(t));
  };
  const bool aligned = reinterpret_cast<uintptr_t>(w.base) % w.kern->bytes == 0;
  if (w.type == GGML_F32 && st == at::kFloat && aligned) return (void)out.copy_(at::mm(xv, whole(at::kFloat).t()));
  const at::Tensor xs = xv.to(st);
  if (w.type == GGML_BF16 && st == at::kBFloat16 && aligned)
    return (void)out.copy_(at::mm(xs, whole(at::kBFloat16).t()).narrow(0, 0, n));
  // ~4 MiB of scratch: the GEMM reads it from L3 right after the dequant wrote it
  const int64_t tile = std::max<int64_t>(64, (4 << 20) / (k * at::elementSize(st)) / 64 * 64);
  at::Tensor scratch = at::empty({std::min(tile, w.n), k}, at::TensorOptions().dtype(st));
  for (int64_t r0 = 0; r0 < w.n; r0 += tile) {
    const int64_t m = std::min(tile, w.n - r0);
    at::Tensor s = scratch.narrow(0, 0, m);
    dequant_rows(w, r0, m, s);
    out.narrow(1, r0, m).copy_(at::mm(xs, s.t()).narrow(0, 0, n));
  }
}

// The GEMM's dtype for a bf16 request: > 0 bf16, 0 f32, < 0 the variant's default (bf16 on avx512_bf16)
at::ScalarType gemm_dtype(int64_t bf16) { return (bf16 < 0 ? BF16_GEMM : bf16 > 0) ? at::kBFloat16 : at::kFloat; }

// The format x is converted to for products with w: its vec_dot_type where the rows kernel or the f32 GEMM
// (rows: some go to the rows kernel) reads it; a bf16 GEMM alone reads the f32 rows (XRow src), X_F32: no copy
XFmt x_format(const Weight& w, bool rows, at::ScalarType st) { return rows || st == at::kFloat ? w.kern->fmt : X_F32; }

// out (n, n_rows) f32 = x W^T, x (n, k) f32. n <= rows_max_n: the rows kernel (x in the type's format, as
// matvec); else gemm_into in gemm_dtype(bf16).
at::Tensor matmul(at::Tensor raw, int64_t off, int64_t type, int64_t n_rows, int64_t k, at::Tensor x, int64_t rows_max_n,
                  int64_t bf16) {
  const Weight w = weight(raw, off, type, n_rows, k);
  x = f32_rows(x, k, "x");
  const int64_t n = x.size(0);
  Acts a(x.data_ptr<float>(), n, k);
  const bool rows = n <= rows_max_n;
  const at::ScalarType st = gemm_dtype(bf16);
  const XRow* xr = a.rows(x_format(w, rows, st));
  auto out = at::empty({n, n_rows}, x.options());
  if (rows)
    for_rows(w, std::max<int64_t>(1, grain(w.rb) / n), [&](int64_t b, int64_t e) {
      rows_block(w, b, e, xr, n, out.data_ptr<float>(), n_rows);
    });
  else
    gemm_into(w, xr, n, st, out);
  return out;
}

const float* f32_or_null(const std::optional<at::Tensor>& b, int64_t n, const char* what) {
  if (!b.has_value() || !b->defined()) return nullptr;
  TORCH_CHECK_VALUE(b->device().is_cpu() && b->scalar_type() == at::kFloat && b->is_contiguous() && b->numel() == n,
                    what, ": contiguous f32 CPU tensor of ", n, " values");
  return b->data_ptr<float>();
}

// x (n, k) f32 in activation format fmt (quant_act.h XFmt), as the bytes of ggml's vec_dot_type
// blocks (block_q8_0, block_q8_1, block_q8_K, f16, bf16, f32): what tests compare with ggml's from_float
at::Tensor quantize_x(at::Tensor x, int64_t fmt) {
  TORCH_CHECK_VALUE(fmt >= 0 && fmt < X_COUNT, "fmt: 0..", X_COUNT - 1);
  TORCH_CHECK_VALUE(x.dim() == 2, "x: (n, k)");
  const int64_t n = x.size(0), k = x.size(1);
  x = f32_rows(x, k, "x");
  const XFmt f = (XFmt)fmt;
  const int64_t blk = f == X_Q8_K ? 256 : (f == X_Q8_0 || f == X_Q8_1) ? 32 : 1;
  TORCH_CHECK_VALUE(k % blk == 0, "k must be a multiple of ", blk);
  const int64_t bytes = f == X_F32 ? 4 : f == X_F16 || f == X_BF16 ? 2 : f == X_Q8_0 ? 34 : f == X_Q8_1 ? 36 : 292;
  Acts a(x.data_ptr<float>(), n, k);
  const XRow* xr = a.rows(f);
  auto out = at::empty({n, k / blk * bytes}, x.options().dtype(at::kByte));
  for (int64_t r = 0; r < n; ++r) {
    uint8_t* o = out.data_ptr<uint8_t>() + r * out.size(1);
    for (int64_t b = 0; b < k / blk; ++b, o += bytes) {
      const uint16_t dh = _cvtss_sh(xr[r].d ? xr[r].d[b] : 0.f, _MM_FROUND_TO_NEAREST_INT);
      if (f == X_Q8_0 || f == X_Q8_1) {
        memcpy(o, &dh, 2);
        const uint16_t sh = _cvtss_sh(xr[r].s[b], _MM_FROUND_TO_NEAREST_INT);
        if (f == X_Q8_1) memcpy(o + 2, &sh, 2);
        memcpy(o + bytes - 32, xr[r].q + 32 * b, 32);
      } else if (f == X_Q8_K) {
        memcpy(o, xr[r].d + b, 4);
        memcpy(o + 4, xr[r].q + 256 * b, 256);
        memcpy(o + 260, xr[r].bs + 16 * b, 32);
      } else if (f == X_F32) {
        memcpy(o, xr[r].f + b, 4);
      } else {
        float v = xr[r].f[b];
        uint32_t u;
        memcpy(&u, &v, 4);
        const uint16_t h = f == X_F16 ? _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT) : (uint16_t)(u >> 16);
        memcpy(o, &h, 2);
      }
    }
  }
  return out;
}

}  // namespace

#include "decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("matvec", &matvec);
  m.def("matmul", &matmul);
  m.def("dequant", &dequant);
  m.def("repack", &repack);
  m.def("embed", &embed);
  m.def("moe_decode", &moe_decode);
  m.def("moe_prefill", &moe_prefill);
  m.def("quantize_x", &quantize_x);
  m.def("act", &act);
  m.def("attn_decode", &attn_decode);
  m.def("attend", &attend);
  m.def("norm_rope_", &norm_rope_);
  m.def("rms_norm", &rms_norm);
  m.def("route_decode", &route_decode);
  m.attr("BF16_GEMM") = BF16_GEMM;
  m.attr("X_FORMATS") = std::vector<std::string>{"F32", "F16", "BF16", "Q8_0", "Q8_1", "Q8_K"};
}
