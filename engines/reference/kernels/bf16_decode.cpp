#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <algorithm>

using bf16 = at::BFloat16;

// W[n, :] . x for n in [n0, n1), fp32 accumulation. One row at a time with 4 accumulators keeps
// the weight reads one sequential stream (measured: 4 rows interleaved reach only ~2/3 of the DRAM
// bandwidth the hardware prefetcher gives a single stream); the K % 32 tail is a masked load.
static void matvec_rows(const bf16* W, int64_t K, const bf16* x, float* out, int64_t n0, int64_t n1) {
  const __mmask32 tail = (__mmask32)((1ull << (K % 32)) - 1);
  for (int64_t n = n0; n < n1; ++n) {
    const bf16* w = W + n * K;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + k + 32), (__m512bh)_mm512_loadu_si512(x + k + 32));
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + k + 64), (__m512bh)_mm512_loadu_si512(x + k + 64));
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + k + 96), (__m512bh)_mm512_loadu_si512(x + k + 96));
    }
    for (; k + 32 <= K; k += 32)
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
    if (k < K)
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(tail, w + k), (__m512bh)_mm512_maskz_loadu_epi16(tail, x + k));
    out[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
}

static const int64_t GRAIN = 64;   // rows per task: fewer would not amortize the fork

// x: (K) or (1, K) bf16 or f32 (cast here); W: (N, K) bf16 contiguous -> (1, N) f32
at::Tensor matvec(at::Tensor x, at::Tensor W) {
  TORCH_CHECK(W.dim() == 2 && W.scalar_type() == at::kBFloat16 && W.is_contiguous(), "W: (N, K) contiguous bf16");
  const int64_t N = W.size(0), K = W.size(1);
  TORCH_CHECK(x.numel() == K, "x must hold K elements");
  x = x.to(at::kBFloat16).contiguous();
  auto y = at::empty({1, N}, W.options().dtype(at::kFloat));
  const bf16* w = W.data_ptr<bf16>(); const bf16* xv = x.data_ptr<bf16>(); float* out = y.data_ptr<float>();
  at::parallel_for(0, N, GRAIN, [&](int64_t b, int64_t e) { matvec_rows(w, K, xv, out, b, e); });
  return y;
}

// The k routed experts of one token: x (1, D) bf16; gate_up (E, 2F, D), down (E, D, F) bf16
// contiguous (gate rows then up rows); ids (1, k) int64; w (1, k) f32
// -> (1, D) f32 = sum_j w_j * down_j(silu(gate_j x) * up_j x).
at::Tensor moe_decode(at::Tensor x, at::Tensor gate_up, at::Tensor down, at::Tensor ids, at::Tensor w) {
  TORCH_CHECK(gate_up.is_contiguous() && down.is_contiguous() && gate_up.scalar_type() == at::kBFloat16 &&
              down.scalar_type() == at::kBFloat16, "expert stacks: contiguous bf16");
  const int64_t D = gate_up.size(2), F2 = gate_up.size(1), F = F2 / 2, k = ids.numel();
  TORCH_CHECK(down.size(1) == D && down.size(2) == F && x.numel() == D, "shape mismatch");
  x = x.to(at::kBFloat16).contiguous();
  ids = ids.to(at::kLong).contiguous(); w = w.to(at::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>(); const float* wt = w.data_ptr<float>();
  const bf16* gu = gate_up.data_ptr<bf16>(); const bf16* dn = down.data_ptr<bf16>(); const bf16* xv = x.data_ptr<bf16>();
  for (int64_t j = 0; j < k; ++j) TORCH_CHECK(id[j] >= 0 && id[j] < gate_up.size(0), "expert id out of range");
  std::vector<float> h(k * F2);          // (k, 2F): the k gate_up products, one row space
  at::parallel_for(0, k * F2, GRAIN, [&](int64_t b, int64_t e) {
    while (b < e) {                       // a task may span experts: split at expert borders
      int64_t j = b / F2, end = std::min(e, (j + 1) * F2);
      matvec_rows(gu + id[j] * F2 * D, D, xv, h.data() + j * F2, b - j * F2, end - j * F2);
      b = end;
    }
  });
  std::vector<bf16> act(k * F);           // (k, F) silu(gate) * up, rounded to bf16 for vdpbf16ps
  for (int64_t j = 0; j < k; ++j)
    for (int64_t i = 0; i < F; ++i) {
      float g = h[j * F2 + i], u = h[j * F2 + F + i];
      act[j * F + i] = bf16(g / (1.f + std::exp(-g)) * u);
    }
  auto y = at::empty({1, D}, x.options().dtype(at::kFloat));
  float* out = y.data_ptr<float>();
  at::parallel_for(0, D, GRAIN, [&](int64_t b, int64_t e) {
    std::vector<float> tmp(e - b);
    for (int64_t d = b; d < e; ++d) out[d] = 0.f;
    for (int64_t j = 0; j < k; ++j) {     // the weighted sum over experts, fused per row block
      matvec_rows(dn + id[j] * D * F, F, act.data() + j * F, tmp.data() - b, b, e);
      for (int64_t d = b; d < e; ++d) out[d] += wt[j] * tmp[d - b];
    }
  });
  return y;
}

// y = x / sqrt(mean(x^2) + eps) * w (w may be null) over one row of d floats; y may be x.
static void norm_row(const float* x, const float* w, float* y, int64_t d, double eps) {
  double ss = 0;
  for (int64_t i = 0; i < d; ++i) ss += (double)x[i] * x[i];
  const float scale = (float)(1.0 / std::sqrt(ss / d + eps));
  for (int64_t i = 0; i < d; ++i) y[i] = x[i] * scale * (w ? w[i] : 1.f);
}

static const float* f32_or_null(const c10::optional<at::Tensor>& w, int64_t n, const char* what) {
  if (!w.has_value() || !w->defined()) return nullptr;
  TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == n, what, ": contiguous f32 of ", n);
  return w->data_ptr<float>();
}

// RMSNorm of each row of x (.., d) f32 contiguous, times w (d) f32 when given -> f32, like F.rms_norm.
// Why: ATen's CPU rms_norm runs as ~8 small ops (~28 us a call for one 1024-wide row); decode calls
// it ~25 times a token.
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous f32");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  const float* wp = f32_or_null(w, d, "w");
  auto y = at::empty_like(x);
  for (int64_t r = 0; r < rows; ++r) norm_row(x.data_ptr<float>() + r * d, wp, y.data_ptr<float>() + r * d, d, eps);
  return y;
}

static float dot_f32(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// One layer's attention for one token, the math of model.attention's n == 1 branch in one call
// (there ~35 ATen ops, ~0.27 ms a layer on `small`, against ~0.04 ms of weight reads):
// x (1, D) f32 residual -> (1, D) f32. h = rms_norm(x) * attn_norm; qkv = Wqkv h (+ bqkv);
// q and k normed in groups of qn's and kn's length (qwen3moe: per head; olmoe: the whole projection);
// RoPE at pos from model.rope_tables' cos/sin (n_ctx, hd): y = x cos + rotate(x) sin, rotate swapping
// each pair (i, i + hd/2) for NEOX, (2i, 2i+1) otherwise; k and v written to Kc, Vc (Hkv, n_ctx, hd) f32
// at pos; per head softmax(q K^T / sqrt(hd)) V over positions 0..pos, head h reading kv head
// h / (H / Hkv); then Wo o. Weights bf16 (N, K) contiguous; o is rounded to bf16 for Wo, like F.linear.
at::Tensor attn_decode(at::Tensor x, at::Tensor attn_norm, double eps, at::Tensor wqkv, c10::optional<at::Tensor> bqkv,
                       c10::optional<at::Tensor> qn, c10::optional<at::Tensor> kn, at::Tensor Kc, at::Tensor Vc,
                       at::Tensor cos, at::Tensor sin, int64_t pos, bool neox, int64_t H, at::Tensor wo) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous f32");
  TORCH_CHECK(Kc.dim() == 3 && Kc.sizes() == Vc.sizes() && Kc.scalar_type() == at::kFloat && Vc.scalar_type() == at::kFloat &&
              Kc.is_contiguous() && Vc.is_contiguous(), "Kc, Vc: (Hkv, n_ctx, hd) contiguous f32");
  const int64_t D = x.numel(), Hkv = Kc.size(0), n_ctx = Kc.size(1), hd = Kc.size(2);
  const int64_t qd = H * hd, kvd = Hkv * hd, NQ = qd + 2 * kvd;
  TORCH_CHECK(H > 0 && H % Hkv == 0 && hd % 2 == 0, "H must be a multiple of Hkv, hd even");
  for (const at::Tensor* w : {&wqkv, &wo})
    TORCH_CHECK(w->dim() == 2 && w->scalar_type() == at::kBFloat16 && w->is_contiguous(), "weights: contiguous bf16");
  TORCH_CHECK(wqkv.size(0) == NQ && wqkv.size(1) == D && wo.size(0) == D && wo.size(1) == qd, "projection shapes");
  TORCH_CHECK(pos >= 0 && pos < n_ctx && cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && cos.numel() >= n_ctx * hd && sin.numel() >= n_ctx * hd, "pos / rope tables");
  const float* an = f32_or_null(attn_norm, D, "attn_norm");
  at::Tensor bias = bqkv.has_value() && bqkv->defined() ? bqkv->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!bias.defined() || bias.numel() == NQ, "bqkv: q + 2 kv values");
  const int64_t gq = qn.has_value() && qn->defined() ? qn->numel() : 0, gk = kn.has_value() && kn->defined() ? kn->numel() : 0;
  TORCH_CHECK((gq == 0 || qd % gq == 0) && (gk == 0 || kvd % gk == 0), "q/k norm length must divide the projection");
  const float* qw = f32_or_null(qn, gq, "q_norm"); const float* kw = f32_or_null(kn, gk, "k_norm");

  std::vector<float> h(D), qkv(NQ);
  std::vector<bf16> hb(D);
  norm_row(x.data_ptr<float>(), an, h.data(), D, eps);
  for (int64_t i = 0; i < D; ++i) hb[i] = bf16(h[i]);
  const bf16* wq = wqkv.data_ptr<bf16>();
  at::parallel_for(0, NQ, GRAIN, [&](int64_t b, int64_t e) { matvec_rows(wq, D, hb.data(), qkv.data(), b, e); });
  if (bias.defined())
    for (int64_t i = 0; i < NQ; ++i) qkv[i] += bias.data_ptr<float>()[i];
  float *q = qkv.data(), *k = q + qd, *v = k + kvd;
  for (int64_t o = 0; qw && o < qd; o += gq) norm_row(q + o, qw, q + o, gq, eps);
  for (int64_t o = 0; kw && o < kvd; o += gk) norm_row(k + o, kw, k + o, gk, eps);
  const float *c = cos.data_ptr<float>() + pos * hd, *s = sin.data_ptr<float>() + pos * hd;
  std::vector<float> r(hd);
  for (int64_t head = 0; head < H + Hkv; ++head) {          // q heads, then k heads (contiguous in qkv)
    float* t = q + head * hd;
    for (int64_t i = 0; i < hd; ++i)
      r[i] = t[i] * c[i] + (neox ? t[i < hd / 2 ? i + hd / 2 : i - hd / 2] : t[i ^ 1]) * s[i];
    std::copy(r.begin(), r.end(), t);
  }
  float *K = Kc.data_ptr<float>(), *V = Vc.data_ptr<float>();
  for (int64_t g = 0; g < Hkv; ++g) {
    std::copy(k + g * hd, k + (g + 1) * hd, K + (g * n_ctx + pos) * hd);
    std::copy(v + g * hd, v + (g + 1) * hd, V + (g * n_ctx + pos) * hd);
  }
  const int64_t T = pos + 1, G = H / Hkv;
  const float scale = 1.f / std::sqrt((float)hd);
  std::vector<bf16> ob(qd);
  at::parallel_for(0, H, 1, [&](int64_t b, int64_t e) {
    std::vector<float> p(T), o(hd);
    for (int64_t head = b; head < e; ++head) {
      const float* qh = q + head * hd;
      const float *Kg = K + head / G * n_ctx * hd, *Vg = V + head / G * n_ctx * hd;
      float mx = -INFINITY, sum = 0.f;
      for (int64_t t = 0; t < T; ++t) mx = std::max(mx, p[t] = dot_f32(qh, Kg + t * hd, hd) * scale);
      for (int64_t t = 0; t < T; ++t) sum += p[t] = std::exp(p[t] - mx);
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < hd; ++i) o[i] += p[t] * Vg[t * hd + i];
      for (int64_t i = 0; i < hd; ++i) ob[head * hd + i] = bf16(o[i] / sum);
    }
  });
  auto y = at::empty({1, D}, x.options());
  const bf16* wop = wo.data_ptr<bf16>();
  at::parallel_for(0, D, GRAIN, [&](int64_t b, int64_t e) { matvec_rows(wop, qd, ob.data(), y.data_ptr<float>(), b, e); });
  return y;
}

// A token's routing, the math of model.route after the ffn norm, in one call (there ~8 ATen ops):
// x (1, D) f32 residual -> [h (1, D) f32 = rms_norm(x) * ffn_norm, w (1, k) f32, ids (1, k) int64].
// logits = router h (router (E, D) f32); norm_topk: softmax over the k largest logits (== softmax over
// all, top-k, renormalized), else the top-k of the softmax over all; w scaled by `scale` unless 0 or 1.
std::vector<at::Tensor> route_decode(at::Tensor x, at::Tensor ffn_norm, double eps, at::Tensor router, int64_t k,
                                     bool norm_topk, double scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous f32");
  TORCH_CHECK(router.dim() == 2 && router.scalar_type() == at::kFloat && router.is_contiguous(), "router: (E, D) contiguous f32");
  const int64_t D = x.numel(), E = router.size(0);
  TORCH_CHECK(router.size(1) == D && k >= 1 && k <= E, "router shape / k");
  auto h = at::empty({1, D}, x.options());
  norm_row(x.data_ptr<float>(), f32_or_null(ffn_norm, D, "ffn_norm"), h.data_ptr<float>(), D, eps);
  std::vector<float> logit(E);
  const float *r = router.data_ptr<float>(), *hp = h.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e) logit[e] = dot_f32(r + e * D, hp, D);
  std::vector<int64_t> order(E);
  for (int64_t e = 0; e < E; ++e) order[e] = e;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return logit[a] > logit[b] || (logit[a] == logit[b] && a < b); });
  const float mx = logit[order[0]];
  float sum = 0.f;
  for (int64_t e = 0; e < (norm_topk ? k : E); ++e) sum += std::exp(logit[norm_topk ? order[e] : e] - mx);
  auto w = at::empty({1, k}, x.options());
  auto ids = at::empty({1, k}, x.options().dtype(at::kLong));
  const float sc = (scale == 0.0 || scale == 1.0) ? 1.f : (float)scale;
  for (int64_t j = 0; j < k; ++j) {
    ids.data_ptr<int64_t>()[j] = order[j];
    w.data_ptr<float>()[j] = std::exp(logit[order[j]] - mx) / sum * sc;
  }
  return {h, w, ids};
}
