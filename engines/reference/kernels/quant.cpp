// Products with GGUF weights as stored (engines/reference/qtensor.py): no float copy of a matrix is
// ever made, only a per-tile scratch in matmul. A weight is (raw uint8 bytes, byte offset, ggml type,
// n_rows, k): n_rows rows of k values, each row k / block * block_bytes bytes, one after another.
// Block-quantized types multiply with x quantized to int8 per 32 values (quant_simd.h quantize_x);
// F32/F16/BF16 with x in f32. Rows are split over torch's intra-op threads (at::parallel_for).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <utility>
#include <vector>

#include "quant_types.h"

namespace {
using namespace qk;

using DotFn = void (*)(const uint8_t*, int64_t, const XRow*, float*);
using RowFn = void (*)(const uint8_t*, int64_t, float*);

// Activation rows one weight row is multiplied with at once: the accumulators fill 16 registers
// (avx2), 32 (avx512).
#ifdef __AVX512F__
constexpr int NX_MAX = 8;
#else
constexpr int NX_MAX = 4;
#endif

// A ggml type's kernels: dot[n - 1] multiplies a row with n = 1..NX_MAX activation rows.
struct Kernel {
  int64_t qk, bytes;
  bool quant_x;
  DotFn dot[NX_MAX];
  RowFn dequant_row;
};

template <class T, size_t... N> Kernel kernel(std::index_sequence<N...>) {
  return {T::QK, T::BYTES, T::QUANT_X, {&T::template dot<N + 1>...}, &T::dequant_row};
}
template <class T> Kernel kernel() { return kernel<T>(std::make_index_sequence<NX_MAX>()); }

enum : int64_t { GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13,
                 GGML_Q6_K = 14, GGML_IQ4_XS = 23, GGML_BF16 = 30, GGML_MXFP4 = 39 };

const Kernel& kernel_of(int64_t type) {
  static const Kernel f32 = kernel<F32>(), f16 = kernel<F16>(), bf16 = kernel<BF16>(), q8_0 = kernel<Units<Q8_0>>(),
                      q4_0 = kernel<Units<Q4_0>>(), mxfp4 = kernel<Units<MXFP4>>(), q4_k = kernel<Units<Q4_K>>(),
                      q5_k = kernel<Units<Q5_K>>(), q6_k = kernel<Q6_K>(), iq4_xs = kernel<Units<IQ4_XS>>();
  switch (type) {
    case GGML_F32: return f32;       case GGML_F16: return f16;       case GGML_BF16: return bf16;
    case GGML_Q8_0: return q8_0;     case GGML_Q4_0: return q4_0;     case GGML_MXFP4: return mxfp4;
    case GGML_Q4_K: return q4_k;     case GGML_Q5_K: return q5_k;     case GGML_Q6_K: return q6_k;
    case GGML_IQ4_XS: return iq4_xs;
  }
  TORCH_CHECK_VALUE(false, "unsupported ggml type ", type);
}

// A matrix (or an expert stack: `count` matrices `stride` bytes apart) inside raw, checked to lie
// within raw's bytes: GGUF files are untrusted input.
struct Weight {
  const Kernel* kern;
  const uint8_t* base;
  int64_t n, k, rb, stride;
  const uint8_t* row(int64_t r, int64_t expert = 0) const { return base + expert * stride + r * rb; }
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
  return {&kern, raw.data_ptr<uint8_t>() + off, n, k, rb, stride};
}

// Activation rows as the kernels take them: n rows of k floats (the caller keeps them), and when
// `quant` (k % 32 == 0) their int8 form: per row k q, k/32 d and s, k/16 s16.
struct Acts {
  std::vector<XRow> rows;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int16_t> s16;
  Acts(const float* x, int64_t n, int64_t k, bool quant) : rows(n) {
    if (quant) { q.resize(n * k); d.resize(n * k / 32); s.resize(n * k / 32); s16.resize(n * k / 16); }
    for (int64_t r = 0; r < n; ++r)
      rows[r] = quant ? XRow{x + r * k, &q[r * k], &d[r * k / 32], &s[r * k / 32], &s16[r * k / 16]} : XRow{x + r * k};
    if (quant)
      at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) quantize_x(x + r * k, k, &q[r * k], &d[r * k / 32], &s[r * k / 32], &s16[r * k / 16]);
      });
  }
};

at::Tensor f32_rows(const at::Tensor& x, int64_t k, const char* what) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == k,
                    what, ": f32 CPU tensor with last dim ", k);
  return x.reshape({-1, k}).contiguous();
}

const int64_t GRAIN = 16;   // rows per task: a few KiB of weights each, enough to amortize the fork

// y (n_rows) = W x: x (k) f32
at::Tensor matvec(at::Tensor raw, int64_t off, int64_t type, int64_t n_rows, int64_t k, at::Tensor x) {
  const Weight w = weight(raw, off, type, n_rows, k);
  x = f32_rows(x, k, "x");
  TORCH_CHECK_VALUE(x.size(0) == 1, "x: one row");
  const Acts a(x.data_ptr<float>(), 1, k, w.kern->quant_x);
  auto y = at::empty({n_rows}, x.options());
  float* out = y.data_ptr<float>();
  at::parallel_for(0, n_rows, GRAIN, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) w.kern->dot[0](w.row(r), k, a.rows.data(), out + r);
  });
  return y;
}

// rows r0..r0+n-1 of W into out (n, k) f32 or bf16, contiguous: bit-exact ggml dequantize_row_*
// (bf16: those f32 values rounded to nearest even).
void dequant_rows(const Weight& w, int64_t r0, int64_t n, at::Tensor& out) {
  const bool bf = out.scalar_type() == at::kBFloat16;
  at::parallel_for(0, n, GRAIN, [&](int64_t b, int64_t e) {
    std::vector<float> tmp(bf ? w.k : 0);
    for (int64_t r = b; r < e; ++r) {
      if (!bf) {
        w.kern->dequant_row(w.row(r0 + r), w.k, out.data_ptr<float>() + r * w.k);
        continue;
      }
      w.kern->dequant_row(w.row(r0 + r), w.k, tmp.data());
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

// Whether matmul's scratch is bf16 for oneDNN's bf16 GEMM (avx512_bf16; ~4x ATen's f32 GEMM here)
#ifdef __AVX512BF16__
const bool BF16_GEMM = true;
#else
const bool BF16_GEMM = false;
#endif

// n activation rows at once: each weight row is read from memory once, and each dot decodes its
// blocks once for NX_MAX x rows. Blocks of ROWS weight rows stay in L2 while every x group passes
// by, so x (n k bytes, past L2 for large n) is read n_rows / ROWS times, not n_rows. out (n, n_rows).
void matmul_rows(const Weight& w, const Acts& a, int64_t n, float* out) {
  const int64_t ROWS = 16;
  at::parallel_for(0, w.n, GRAIN, [&](int64_t b, int64_t e) {
    float y[NX_MAX];
    for (int64_t r0 = b; r0 < e; r0 += ROWS)
      for (int64_t i = 0; i < n; i += NX_MAX) {
        const int64_t m = std::min<int64_t>(NX_MAX, n - i);
        for (int64_t r = r0; r < std::min(e, r0 + ROWS); ++r) {
          w.kern->dot[m - 1](w.row(r), w.k, a.rows.data() + i, y);
          for (int64_t j = 0; j < m; ++j) out[(i + j) * w.n + r] = y[j];
        }
      }
  });
}

// out (n, n_rows) f32 = x W^T, x (n, k) f32. n <= rows_max_n: matmul_rows (int8 x for quantized
// types); else W in tiles of rows dequantized into a scratch (f32, or bf16 on avx512_bf16) and ATen's
// GEMM; F32 weights (and BF16 with the bf16 GEMM) go to the GEMM as they are.
at::Tensor matmul(at::Tensor raw, int64_t off, int64_t type, int64_t n_rows, int64_t k, at::Tensor x, int64_t rows_max_n) {
  const Weight w = weight(raw, off, type, n_rows, k);
  x = f32_rows(x, k, "x");
  const int64_t n = x.size(0);
  if (n <= rows_max_n) {
    auto out = at::empty({n, n_rows}, x.options());
    matmul_rows(w, Acts(x.data_ptr<float>(), n, k, w.kern->quant_x), n, out.data_ptr<float>());
    return out;
  }
  // F32 and BF16 weights as they are: a view of the bytes (when aligned for the element type)
  const auto whole = [&](at::ScalarType t) {
    return at::from_blob((void*)w.base, {n_rows, k}, at::TensorOptions().dtype(t));
  };
  const bool aligned = reinterpret_cast<uintptr_t>(w.base) % w.kern->bytes == 0;
  if (type == GGML_F32 && aligned) return at::mm(x, whole(at::kFloat).t());
  const at::ScalarType st = BF16_GEMM ? at::kBFloat16 : at::kFloat;
  const at::Tensor xs = x.to(st);
  if (type == GGML_BF16 && BF16_GEMM && aligned) return at::mm(xs, whole(at::kBFloat16).t()).to(at::kFloat);
  auto out = at::empty({n, n_rows}, x.options());
  // ~4 MiB of scratch: the GEMM reads it from L3 right after the dequant wrote it
  const int64_t tile = std::max<int64_t>(64, (4 << 20) / (k * at::elementSize(st)) / 64 * 64);
  at::Tensor scratch = at::empty({std::min(tile, n_rows), k}, x.options().dtype(st));
  for (int64_t r0 = 0; r0 < n_rows; r0 += tile) {
    const int64_t m = std::min(tile, n_rows - r0);
    at::Tensor s = scratch.narrow(0, 0, m);
    dequant_rows(w, r0, m, s);
    out.narrow(1, r0, m).copy_(at::mm(xs, s.t()));
  }
  return out;
}

const float* bias_of(const std::optional<at::Tensor>& b, int64_t rows, int64_t cols, const char* what) {
  if (!b.has_value() || !b->defined()) return nullptr;
  TORCH_CHECK_VALUE(b->device().is_cpu() && b->scalar_type() == at::kFloat && b->is_contiguous() && b->numel() == rows * cols,
                    what, ": contiguous f32 (", rows, ", ", cols, ")");
  return b->data_ptr<float>();
}

// ggml_gelu_f32's tanh approximation
float gelu_tanh(float g) { return 0.5f * g * (1.f + std::tanh(0.79788456080286535588f * g * (1.f + 0.044715f * g * g))); }

// One token's routed experts: y (D) = sum_j w_j (down_e (act(gate_e x + gb_e, up_e x + ub_e)) + db_e), e = ids[j].
// gate, up: (E, ff, D) stacks, expert e at off + e * stride (a fused (E, 2 ff, D) gate_up is two views:
// up at off + ff * row_bytes, both with stride 2 ff row_bytes); down (E, D, ff). act: 0 SiLU,
// 1 GELU (tanh), 2 gpt-oss SwiGLU: g = min(g, limit), u = clamp(u, -limit, limit), g sigmoid(alpha g) (u + 1).
at::Tensor moe_decode(at::Tensor x, at::Tensor ids, at::Tensor wts, int64_t n_expert, int64_t ff,
                      at::Tensor g_raw, int64_t g_off, int64_t g_stride, int64_t g_type,
                      at::Tensor u_raw, int64_t u_off, int64_t u_stride, int64_t u_type,
                      at::Tensor d_raw, int64_t d_off, int64_t d_stride, int64_t d_type,
                      int64_t act, double alpha, double limit, std::optional<at::Tensor> gate_bias,
                      std::optional<at::Tensor> up_bias, std::optional<at::Tensor> down_bias) {
  const int64_t D = x.numel();
  x = f32_rows(x, D, "x");
  TORCH_CHECK_VALUE(act >= 0 && act <= 2, "act: 0 (SiLU), 1 (GELU) or 2 (SwiGLU-OAI)");
  const Weight gate = weight(g_raw, g_off, g_type, ff, D, n_expert, g_stride);
  const Weight up = weight(u_raw, u_off, u_type, ff, D, n_expert, u_stride);
  const Weight down = weight(d_raw, d_off, d_type, D, ff, n_expert, d_stride);
  TORCH_CHECK_VALUE(ids.device().is_cpu() && wts.device().is_cpu() && ids.numel() == wts.numel() && ids.numel() >= 1,
                    "ids, w: the same number (>= 1) of CPU values");
  const at::Tensor idc = ids.to(at::kLong).contiguous(), wc = wts.to(at::kFloat).contiguous();
  const int64_t K = idc.numel(), *id = idc.data_ptr<int64_t>();
  const float* wt = wc.data_ptr<float>();
  for (int64_t j = 0; j < K; ++j) TORCH_CHECK_VALUE(id[j] >= 0 && id[j] < n_expert, "expert id ", id[j], " out of range");
  const float* gb = bias_of(gate_bias, n_expert, ff, "gate_bias");
  const float* ub = bias_of(up_bias, n_expert, ff, "up_bias");
  const float* db = bias_of(down_bias, n_expert, D, "down_bias");

  // (K, 2 ff): expert j's gate rows then its up rows, one row space split over the threads
  const Acts xa(x.data_ptr<float>(), 1, D, gate.kern->quant_x || up.kern->quant_x);
  std::vector<float> h(K * 2 * ff);
  at::parallel_for(0, K * 2 * ff, GRAIN, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t j = r / (2 * ff), i = r % (2 * ff);
      const Weight& m = i < ff ? gate : up;
      m.kern->dot[0](m.row(i % ff, id[j]), D, xa.rows.data(), h.data() + r);
    }
  });
  std::vector<float> a(K * ff);         // (K, ff) activations, the down products' x rows
  const float lim = (float)limit, al = (float)alpha;
  for (int64_t j = 0; j < K; ++j)
    for (int64_t i = 0; i < ff; ++i) {
      float g = h[j * 2 * ff + i] + (gb ? gb[id[j] * ff + i] : 0.f);
      float u = h[j * 2 * ff + ff + i] + (ub ? ub[id[j] * ff + i] : 0.f);
      if (act == 0) a[j * ff + i] = g / (1.f + std::exp(-g)) * u;
      else if (act == 1) a[j * ff + i] = gelu_tanh(g) * u;
      else {
        g = std::min(g, lim);
        u = std::clamp(u, -lim, lim);
        a[j * ff + i] = g / (1.f + std::exp(al * -g)) * (u + 1.f);
      }
    }
  const Acts aa(a.data(), K, ff, down.kern->quant_x);
  auto y = at::zeros({D}, x.options());
  float* out = y.data_ptr<float>();
  at::parallel_for(0, D, GRAIN, [&](int64_t b, int64_t e) {
    std::vector<float> t(e - b);
    for (int64_t j = 0; j < K; ++j) {         // expert by expert: each a sequential stream of rows b..e
      for (int64_t d = b; d < e; ++d) down.kern->dot[0](down.row(d, id[j]), ff, aa.rows.data() + j, t.data() + d - b);
      for (int64_t d = b; d < e; ++d) out[d] += wt[j] * (t[d - b] + (db ? db[id[j] * D + d] : 0.f));
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("matvec", &matvec);
  m.def("matmul", &matmul);
  m.def("dequant", &dequant);
  m.def("moe_decode", &moe_decode);
  m.attr("BF16_GEMM") = BF16_GEMM;
}
