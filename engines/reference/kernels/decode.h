// The routed experts of many tokens in one call (moe_prefill: grouped by expert, no per-expert ATen ops),
// and one token's steps, each one call instead of dozens of ATen ops (decode is bound by per-op overhead,
// not by the weight bytes: preset:small q4_k_m reads ~45 MB a token, ~0.65 ms at the machine's
// bandwidth, against ~2.6 ms a token through the ATen ops): the routed experts (moe_decode: gate/up
// products, activation, down products and the weighted sum, for any architecture), and the attention
// and the routing of the common MoE transformer block (engines/reference/models/transformer.py Transformer). The
// products are quant.cpp's (x converted to each weight's vec_dot_type once), so fused and unfused
// decode agree to float rounding. What the block steps implement is kernels.FUSED_FEATURES: RoPE NEOX
// or NORM, q/k norms per head or over the whole projection, qkv biases, renormalized top-k, and the
// sigmoid gate of a shared expert (the expert itself runs through moe_decode as a one-expert stack).
// Included by quant.cpp (its anonymous namespace: Weight, Acts, matvec_into, f32_or_null, ...).
#pragma once

namespace {

// ggml's CPU GELU (vec.h, GGML_GELU_FP16): the tanh GELU of x rounded to f16, looked up in a table of
// f16 results made once from ggml_gelu_f32 (ggml-cpu.c ggml_cpu_init); 0 at or below -10, x at or above 10.
const uint16_t* gelu_table() {
  static const std::vector<uint16_t> t = [] {
    std::vector<uint16_t> t(1 << 16);
    for (int i = 0; i < (1 << 16); ++i) {
      const float x = _cvtsh_ss((uint16_t)i);
      // 1 + a x x as one fma: how gcc -O3 -mfma (ggml's native builds) compiles ggml_gelu_f32
      const float inner = std::fma(0.044715f * x, x, 1.0f);
      t[i] = _cvtss_sh(0.5f * x * (1.0f + tanhf(0.79788456080286535587989211986876f * x * inner)), _MM_FROUND_TO_NEAREST_INT);
    }
    return t;
  }();
  return t.data();
}
inline float gelu_ggml(float x, const uint16_t* table) {
  return x <= -10.f ? 0.f : x >= 10.f ? x : _cvtsh_ss(table[_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)]);
}

// The gated activation of routed experts: 0 SiLU silu(g) u (ggml's swiglu: its vectorized SiLU, scalar
// x / (1 + expf(-x)) for a tail), 1 ggml's GELU(g) u, 2 gpt-oss SwiGLU: g = min(g, limit),
// u = clamp(u, -limit, limit), g sigmoid(alpha g) (u + 1). One row: y (n) from g, u (n) and their biases.
struct Act {
  int64_t kind;
  float alpha, limit;
  const uint16_t* table = gelu_table();
  float one(float g, float u) const {
    if (kind == 0) return g / (1.f + std::exp(-g)) * u;
    if (kind == 1) return gelu_ggml(g, table) * u;
    g = std::min(g, limit);
    u = std::clamp(u, -limit, limit);
    return g / (1.f + std::exp(alpha * -g)) * (u + 1.f);
  }
  void row(const float* g, const float* u, const float* gb, const float* ub, float* y, int64_t n) const {
    std::vector<float> gs, us;
    if (gb) { gs.resize(n); for (int64_t i = 0; i < n; ++i) gs[i] = g[i] + gb[i]; g = gs.data(); }
    if (ub) { us.resize(n); for (int64_t i = 0; i < n; ++i) us[i] = u[i] + ub[i]; u = us.data(); }
    int64_t i = 0;
    if (kind == 0) {
#ifdef __AVX512F__
      for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(v_silu(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
#else
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(v_silu(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
#endif
    }
    for (; i < n; ++i) y[i] = one(g[i], u[i]);
  }
};

// y = act(g, u) elementwise over f32 tensors of one shape (kind: Act), as moe_decode computes it (tests)
at::Tensor act(at::Tensor g, at::Tensor u, int64_t kind, double alpha, double limit) {
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 2, "act: 0 (SiLU), 1 (GELU) or 2 (SwiGLU-OAI)");
  TORCH_CHECK_VALUE(g.device().is_cpu() && u.device().is_cpu() && g.scalar_type() == at::kFloat &&
                    u.scalar_type() == at::kFloat && g.sizes() == u.sizes(), "g, u: f32 CPU tensors of one shape");
  g = g.contiguous(), u = u.contiguous();
  auto y = at::empty_like(g);
  Act{kind, (float)alpha, (float)limit}.row(g.data_ptr<float>(), u.data_ptr<float>(), nullptr, nullptr, y.data_ptr<float>(), g.numel());
  return y;
}

// One token's routed experts into out (D): out += sum_j w_j (down_e (act(gate_e x + gb_e, up_e x + ub_e)) + db_e),
// e = id[j]. gate, up: (E, ff, D) stacks (up may be the second half of a fused gate_up: same bytes, its
// own offset), down (E, D, ff); x the one activation row (D).
void experts_into(Acts& xa, const int64_t* id, const float* wt, int64_t K, const Weight& gate, const Weight& up,
                  const Weight& down, const Act& act, const float* gb, const float* ub, const float* db, float* out) {
  const int64_t ff = gate.n, D = down.n;
  // (K, 2 ff): expert j's gate rows then its up rows, one row space split over the threads
  const XRow* xg = xa.rows(gate.kern->fmt);
  const XRow* xu = xa.rows(up.kern->fmt);
  std::vector<float> h(K * 2 * ff);
  const int64_t G = std::max(gate.kern->group, up.kern->group);      // whole groups of an interleaved layout
  at::parallel_for(0, K * 2 * ff / G, std::max<int64_t>(1, grain(gate.rb) / G), [&](int64_t b, int64_t e) {
    for (int64_t r = b * G; r < e * G; r += G) {
      const int64_t j = r / (2 * ff), i = r % (2 * ff);
      if (i < ff) row_dots(gate.expert(id[j]), i, i + G, xg, h.data() + r);
      else row_dots(up.expert(id[j]), i - ff, i - ff + G, xu, h.data() + r);
    }
  });
  std::vector<float> a(K * ff);         // (K, ff) activations, the down products' x rows
  for (int64_t j = 0; j < K; ++j)
    act.row(h.data() + j * 2 * ff, h.data() + j * 2 * ff + ff, gb ? gb + id[j] * ff : nullptr, ub ? ub + id[j] * ff : nullptr,
            a.data() + j * ff, ff);
  Acts aa(a.data(), K, ff);
  const XRow* xd = aa.rows(down.kern->fmt);
  for_rows(down, grain(K * down.rb), [&](int64_t b, int64_t e) {
    std::vector<float> t(e - b);
    for (int64_t j = 0; j < K; ++j) {         // expert by expert: each a sequential stream of rows b..e
      row_dots(down.expert(id[j]), b, e, xd + j, t.data());
      for (int64_t d = b; d < e; ++d) out[d] += wt[j] * (t[d - b] + (db ? db[id[j] * D + d] : 0.f));
    }
  });
}

// The checked ids (K int64) and weights (K f32) of a token's experts
std::pair<at::Tensor, at::Tensor> routing(const at::Tensor& ids, const at::Tensor& wts, int64_t n_expert) {
  TORCH_CHECK_VALUE(ids.device().is_cpu() && wts.device().is_cpu() && ids.numel() == wts.numel() && ids.numel() >= 1,
                    "ids, w: the same number (>= 1) of CPU values");
  at::Tensor idc = ids.to(at::kLong).contiguous(), wc = wts.to(at::kFloat).contiguous();
  for (int64_t j = 0; j < idc.numel(); ++j)
    TORCH_CHECK_VALUE(idc.data_ptr<int64_t>()[j] >= 0 && idc.data_ptr<int64_t>()[j] < n_expert,
                      "expert id ", idc.data_ptr<int64_t>()[j], " out of range");
  return {idc, wc};
}

// The expert stacks and biases moe_decode and moe_prefill take (see moe_decode), checked
struct Stacks {
  Weight gate, up, down;
  const float *gb, *ub, *db;
  Act act;
};
Stacks stacks(int64_t n_expert, int64_t ff, int64_t D, const SArg& g, const SArg& u, const SArg& d, int64_t act,
              double alpha, double limit, const std::optional<at::Tensor>& gate_bias,
              const std::optional<at::Tensor>& up_bias, const std::optional<at::Tensor>& down_bias) {
  TORCH_CHECK_VALUE(act >= 0 && act <= 2, "act: 0 (SiLU), 1 (GELU) or 2 (SwiGLU-OAI)");
  return {weight(g, ff, D, n_expert), weight(u, ff, D, n_expert), weight(d, D, ff, n_expert),
          f32_or_null(gate_bias, n_expert * ff, "gate_bias"), f32_or_null(up_bias, n_expert * ff, "up_bias"),
          f32_or_null(down_bias, n_expert * D, "down_bias"), Act{act, (float)alpha, (float)limit}};
}

// One token's routed experts: y (x's shape, D values) = [residual +] sum_j w_j (down_e (act(gate_e x + gb_e,
// up_e x + ub_e)) + db_e), e = ids[j]. gate, up: (E, ff, D) stacks (raw, off, stride, type), expert e at
// off + e * stride (a fused (E, 2 ff, D) gate_up is two views: up at off + ff * row_bytes, both with stride
// 2 ff row_bytes); down (E, D, ff). act: 0 SiLU, 1 GELU (ggml's f16 table), 2 gpt-oss SwiGLU.
at::Tensor moe_decode(at::Tensor x, at::Tensor ids, at::Tensor wts, int64_t n_expert, int64_t ff, SArg gate, SArg up,
                      SArg down, int64_t act, double alpha, double limit, std::optional<at::Tensor> gate_bias,
                      std::optional<at::Tensor> up_bias, std::optional<at::Tensor> down_bias,
                      std::optional<at::Tensor> residual) {
  const int64_t D = x.numel();
  const auto shape = x.sizes().vec();
  x = f32_rows(x, D, "x");
  const Stacks st = stacks(n_expert, ff, D, gate, up, down, act, alpha, limit, gate_bias, up_bias, down_bias);
  const auto [idc, wc] = routing(ids, wts, n_expert);
  const float* res = f32_or_null(residual, D, "residual");
  auto y = res ? residual->reshape(shape).clone() : at::zeros(shape, x.options());
  Acts xa(x.data_ptr<float>(), 1, D);
  experts_into(xa, idc.data_ptr<int64_t>(), wc.data_ptr<float>(), idc.numel(), st.gate, st.up, st.down, st.act,
               st.gb, st.ub, st.db, y.data_ptr<float>());
  return y;
}

// For each expert e, the cnt[e] activation rows xr[start[e]..] (grouped by expert) times W_e^T into
// out[(start[e] + i) * ldo + r]. Experts of at most rows_max rows share one parallel region: tasks of 16
// weight rows (128 where AMX tiles take them: each task gathers its x rows) x all the expert's x rows, taken by
// the threads as they come free (the experts' row counts differ, a fixed split would leave threads idle); larger
// ones go through gemm_into one after another.
void grouped_product(const Weight& w, const std::vector<int64_t>& start, const std::vector<int64_t>& cnt, const XRow* xr,
                     float* out, int64_t ldo, int64_t rows_max, at::ScalarType st) {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> tasks;          // (expert, first row, end row)
  for (size_t e = 0; e < cnt.size(); ++e) {
    if (!cnt[e]) continue;
    if (cnt[e] > rows_max) {
      at::Tensor o = at::from_blob(out + start[e] * ldo, {cnt[e], w.n}, {ldo, 1}, at::TensorOptions().dtype(at::kFloat));
      gemm_into(w.expert(e), xr + start[e], cnt[e], st, o);
      continue;
    }
    for (int64_t r = 0, block = amx_takes(w, cnt[e]) ? 128 : 16; r < w.n; r += block)
      tasks.emplace_back(e, r, std::min(w.n, r + block));
  }
  std::atomic<size_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (size_t t; (t = next.fetch_add(1)) < tasks.size();) {
      const auto [e, r, r1] = tasks[t];
      rows_block(w.expert(e), r, r1, xr + start[e], cnt[e], out + start[e] * ldo, ldo);
    }
  });
}

// Many tokens' routed experts (the host path of a prefill): y (n, D) = sum_j w[t, j] (down_e act(gate_e x_t +
// gb_e, up_e x_t + ub_e) + db_e), e = ids[t, j]. The (token, slot) pairs are grouped by expert; x is converted once
// per format for all tokens, and each expert's products read its weight rows once for all its rows
// (grouped_product). Arguments as moe_decode; rows_max_gu / rows_max_down: the most rows of one expert that go to
// the rows kernel (more: dequantized tiles and a GEMM in gemm_dtype(bf16)), as matmul's rows_max_n.
at::Tensor moe_prefill(at::Tensor x, at::Tensor ids, at::Tensor wts, int64_t n_expert, int64_t ff, SArg gate_a,
                       SArg up_a, SArg down_a, int64_t act, double alpha, double limit,
                       std::optional<at::Tensor> gate_bias, std::optional<at::Tensor> up_bias,
                       std::optional<at::Tensor> down_bias, int64_t rows_max_gu, int64_t rows_max_down, int64_t bf16) {
  TORCH_CHECK_VALUE(x.dim() == 2 && ids.dim() == 2 && ids.size(0) == x.size(0) && wts.sizes() == ids.sizes(),
                    "x (n, D), ids and w (n, k)");
  const int64_t n = x.size(0), D = x.size(1), K = ids.size(1), S = n * K;
  x = f32_rows(x, D, "x");
  const Stacks sk = stacks(n_expert, ff, D, gate_a, up_a, down_a, act, alpha, limit, gate_bias, up_bias, down_bias);
  const Weight &gate = sk.gate, &up = sk.up, &down = sk.down;
  const float *gb = sk.gb, *ub = sk.ub, *db = sk.db;
  const auto [idc, wc] = routing(ids, wts, n_expert);
  const int64_t* id = idc.data_ptr<int64_t>();
  const float* wt = wc.data_ptr<float>();
  const at::ScalarType st = gemm_dtype(bf16);

  // slots s = t K + j grouped by expert: the slot at grouped position p is slot_at[p]
  std::vector<int64_t> cnt(n_expert, 0), start(n_expert, 0), slot_at(S);
  for (int64_t s = 0; s < S; ++s) ++cnt[id[s]];
  for (int64_t e = 1; e < n_expert; ++e) start[e] = start[e - 1] + cnt[e - 1];
  std::vector<int64_t> fill(start);
  for (int64_t s = 0; s < S; ++s) slot_at[fill[id[s]]++] = s;

  const auto fmt = [&](const Weight& w, int64_t rows_max) {          // x_format: does any expert take the rows kernel?
    bool rows = false;
    for (int64_t e = 0; e < n_expert && !rows; ++e) rows = cnt[e] && cnt[e] <= rows_max;
    return x_format(w, rows, st);
  };
  Acts xa(x.data_ptr<float>(), n, D);
  const XRow* xg = xa.rows(fmt(gate, rows_max_gu));
  const XRow* xu = xa.rows(fmt(up, rows_max_gu));
  const XFmt down_fmt = fmt(down, rows_max_down);
  std::vector<XRow> gx(S), ux(S);                       // each grouped row's token, as pointers: no copy of x
  for (int64_t p = 0; p < S; ++p) gx[p] = xg[slot_at[p] / K], ux[p] = xu[slot_at[p] / K];

  // A run of whole experts at a time: gate and up products (h), the activations (a: the down products' x rows), the
  // down products (ys), each row's weighted output added into its token's y. The run's buffers stay near RUN_BYTES
  // instead of S x (3 ff + D) floats (gemma-4's 512 tokens: 80 MiB). A token's experts are added in expert order
  // (ggml adds them in slot order: the same terms, their float additions in another order).
  constexpr int64_t RUN_BYTES = 4 << 20;
  const int64_t row_bytes = (3 * ff + D) * 4;
  auto y = at::zeros({n, D}, x.options());
  float* yp = y.data_ptr<float>();
  std::vector<float> h, a, ys;
  const Act& fn = sk.act;
  for (int64_t e0 = 0, e1; e0 < n_expert; e0 = e1) {
    int64_t rows = cnt[e0];
    for (e1 = e0 + 1; e1 < n_expert && (rows + cnt[e1]) * row_bytes <= RUN_BYTES; ++e1) rows += cnt[e1];
    if (!rows) continue;
    const int64_t p0 = start[e0];
    std::vector<int64_t> c(n_expert, 0), s(n_expert, 0);   // the run's experts, their rows from p0
    for (int64_t e = e0; e < e1; ++e) c[e] = cnt[e], s[e] = start[e] - p0;
    h.resize(rows * 2 * ff);
    a.resize(rows * ff);
    ys.resize(rows * D);
    grouped_product(gate, s, c, gx.data() + p0, h.data(), 2 * ff, rows_max_gu, st);
    grouped_product(up, s, c, ux.data() + p0, h.data() + ff, 2 * ff, rows_max_gu, st);
    at::parallel_for(0, rows, std::max<int64_t>(1, grain(ff * 8)), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t ex = id[slot_at[p0 + i]];
        fn.row(h.data() + i * 2 * ff, h.data() + i * 2 * ff + ff, gb ? gb + ex * ff : nullptr,
               ub ? ub + ex * ff : nullptr, a.data() + i * ff, ff);
      }
    });
    Acts aa(a.data(), rows, ff);
    grouped_product(down, s, c, aa.rows(down_fmt), ys.data(), D, rows_max_down, st);
    // threads split y's columns: a token's rows of the run (one an expert) land in one thread's columns in turn
    at::parallel_for(0, D, std::max<int64_t>(16, grain(rows * 8)), [&](int64_t d0, int64_t d1) {
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t sl = slot_at[p0 + i];
        const float *yr = ys.data() + i * D, wj = wt[sl];
        float* yt = yp + sl / K * D;
        if (db)
          for (int64_t d = d0, o = id[sl] * D; d < d1; ++d) yt[d] += wj * (yr[d] + db[o + d]);
        else
          for (int64_t d = d0; d < d1; ++d) yt[d] += wj * yr[d];
      }
    });
  }
  return y;
}

// y = x / sqrt(mean(x^2) + eps) * w (w may be null) over one row of d floats; y may be x
void norm_row(const float* x, const float* w, float* y, int64_t d, double eps) {
  double ss = 0;                // as ggml's rms_norm: f32 squares summed in double, the mean and scale in f32
  for (int64_t i = 0; i < d; ++i) ss += (double)(x[i] * x[i]);
  const float mean = (float)(ss / d);
  const float scale = 1.f / std::sqrt(mean + (float)eps);
  for (int64_t i = 0; i < d; ++i) y[i] = x[i] * scale * (w ? w[i] : 1.f);
}

// RMS norm of each row of x (..., d) f32 contiguous, times w (d) or none: a new tensor
at::Tensor rms_norm(at::Tensor x, std::optional<at::Tensor> w, double eps) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.is_contiguous(),
                    "x: contiguous f32 CPU tensor");
  const int64_t d = x.size(-1), n = d ? x.numel() / d : 0;
  const float* wp = f32_or_null(w, d, "w");
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, grain(d * 16)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xp + r * d, wp, yp + r * d, d, eps);
  });
  return y;
}

// One position's q or k projection t (heads * hd values) in place: each group of g values RMS-normed with w
// (g = hd: per head, qwen3moe; g = the whole projection: olmoe; w null: no norm), then each head rotated by
// RoPE with that position's cos/sin (hd): y = x cos + rotate(x) sin (one fma onto the rounded x cos, as
// model.apply_rope's addcmul), rotate swapping each pair (i, i + hd/2) for NEOX, (2i, 2i+1) otherwise. rot: hd
// floats of scratch.
void norm_rope_row(float* t, int64_t len, const float* w, int64_t g, double eps, const float* c, const float* s,
                   bool neox, int64_t hd, float* rot) {
  for (int64_t o = 0; w && o < len; o += g) norm_row(t + o, w, t + o, g, eps);
  for (float* h = t; h < t + len; h += hd) {
    for (int64_t i = 0; i < hd; ++i)
      rot[i] = std::fma(neox ? h[i < hd / 2 ? i + hd / 2 : i - hd / 2] : h[i ^ 1], s[i], h[i] * c[i]);
    std::copy(rot, rot + hd, h);
  }
}

// model.attention's q/k norm and RoPE for n positions pos.. in place: t (n, heads * hd) f32 contiguous, norm
// (g values dividing heads * hd) or none, cos/sin: model.rope_tables (n_ctx, hd)
void norm_rope_(at::Tensor t, std::optional<at::Tensor> norm, double eps, at::Tensor cos, at::Tensor sin, int64_t pos,
                bool neox, int64_t hd) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous(),
                    "t: (n, heads * hd) contiguous f32 CPU tensor");
  const int64_t n = t.size(0), len = t.size(1);
  TORCH_CHECK_VALUE(hd > 0 && hd % 2 == 0 && len % hd == 0, "head size even and dividing the row");
  TORCH_CHECK_VALUE(pos >= 0 && cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                    sin.scalar_type() == at::kFloat && cos.numel() >= (pos + n) * hd && sin.numel() >= (pos + n) * hd,
                    "pos / rope tables");
  const int64_t g = norm.has_value() && norm->defined() ? norm->numel() : len;
  TORCH_CHECK_VALUE(g > 0 && len % g == 0, "norm length must divide the row");
  const float* w = f32_or_null(norm, g, "norm");
  float* tp = t.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, grain(len * 16)), [&](int64_t b, int64_t e) {
    std::vector<float> rot(hd);
    for (int64_t r = b; r < e; ++r)
      norm_rope_row(tp + r * len, len, w, g, eps, cos.data_ptr<float>() + (pos + r) * hd,
                    sin.data_ptr<float>() + (pos + r) * hd, neox, hd, rot.data());
  });
}

// a . b over n values, b f32 or f16 (a row of the KV cache)
float dot_f32(const float* a, const float* b, int64_t n) {
  vf acc = vzero();
  int64_t i = 0;
  for (; i + VL <= n; i += VL) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += p v over n values, v f32 or f16
// A KV cache's values (f32, or f16 bits) as f32: VL at a time, or one
vf load_kv(const float* p) { return vload(p); }
vf load_kv(const uint16_t* p) { return load_f16((const uint8_t*)p); }
float kv1(const float* p) { return *p; }
float kv1(const uint16_t* p) { return _cvtsh_ss(*p); }

// NB query heads (q: NB rows of hd) that read one kv head (K, V: T rows of hd) -> o (NB rows of hd) =
// softmax(q K^T scale) V; p: NB x T scratch. Each K and V row is loaded and converted once for the NB heads,
// whose independent FMA chains hide each other's latency; the exponentials are ggml's vectorized v_expf.
// sink (NB values, or null): one more score per head that takes its share of the softmax and adds no value row
// (gpt-oss; ggml's soft_max with sinks).
template <int NB, class KV>
void attend_heads(const float* q, const KV* K, const KV* V, int64_t T, int64_t hd, float scale, const float* sink,
                  float* p, float* o) {
  for (int64_t t = 0; t < T; ++t, K += hd) {
    vf acc[NB];
    for (int j = 0; j < NB; ++j) acc[j] = vzero();
    int64_t i = 0;
    for (; i + VL <= hd; i += VL) {
      const vf k = load_kv(K + i);
      for (int j = 0; j < NB; ++j) acc[j] = vfma(vload(q + j * hd + i), k, acc[j]);
    }
    for (int j = 0; j < NB; ++j) {
      float s = vsum(acc[j]);
      for (int64_t r = i; r < hd; ++r) s += q[j * hd + r] * kv1(K + r);
      p[j * T + t] = s * scale;
    }
  }
  for (int j = 0; j < NB; ++j) {            // p_j = softmax(p_j)
    float* pj = p + j * T;
    const float mx = std::max(*std::max_element(pj, pj + T), sink ? sink[j] : -INFINITY);
    vf vs = vzero();
    int64_t t = 0;
    for (; t + VL <= T; t += VL) {
      const vf e = v_expf(vsub(vload(pj + t), vset1(mx)));
      vstore(pj + t, e);
      vs = vadd(vs, e);
    }
    float sum = vsum(vs) + (sink ? std::exp(sink[j] - mx) : 0.f);
    for (; t < T; ++t) sum += pj[t] = std::exp(pj[t] - mx);
    const float inv = 1.f / sum;
    for (t = 0; t < T; ++t) pj[t] *= inv;
  }
  // o_j = sum_t p_j[t] V_t, VL columns at a time: the NB sums stay in registers over all T rows
  int64_t i = 0;
  for (; i + VL <= hd; i += VL) {
    vf acc[NB];
    for (int j = 0; j < NB; ++j) acc[j] = vzero();
    for (int64_t t = 0; t < T; ++t) {
      const vf v = load_kv(V + t * hd + i);
      for (int j = 0; j < NB; ++j) acc[j] = vfma(vset1(p[j * T + t]), v, acc[j]);
    }
    for (int j = 0; j < NB; ++j) vstore(o + j * hd + i, acc[j]);
  }
  for (; i < hd; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = 0.f;
      for (int64_t t = 0; t < T; ++t) s += p[j * T + t] * kv1(V + t * hd + i);
      o[j * hd + i] = s;
    }
}

// n values of x into a KV cache row: f32 as they are, f16 rounded to nearest even (as a torch copy and ggml's
// F16C conversion round them)
void store_kv(const float* x, float* y, int64_t n) { std::copy(x, x + n, y); }
void store_kv(const float* x, uint16_t* y, int64_t n) { to_f16(x, y, n); }

// One token's attention over rows lo..end-1 of a layer's KV cache K, V (Hkv, n_ctx, hd; f32, or f16 bits):
// o (H * hd) = per head h softmax(q_h K^T scale [, sinks_h]) V, head h reading kv head h / (H / Hkv)
template <class KV>
void attend_window(const float* q, const KV* K, const KV* V, int64_t H, int64_t Hkv, int64_t n_ctx, int64_t hd,
                   int64_t lo, int64_t end, float scale, const float* sinks, float* o) {
  // tasks: a kv head's query heads in blocks of up to HB
  constexpr int64_t HB = 4;
  const int64_t G = H / Hkv, T = end - lo, blocks = (G + HB - 1) / HB;
  at::parallel_for(0, Hkv * blocks, grain(2 * T * hd * 4), [&](int64_t b, int64_t e) {
    std::vector<float> p(HB * T);
    for (int64_t task = b; task < e; ++task) {
      const int64_t g = task / blocks, h0 = g * G + task % blocks * HB, nb = std::min(HB, (g + 1) * G - h0);
      const KV *Kg = K + (g * n_ctx + lo) * hd, *Vg = V + (g * n_ctx + lo) * hd;
      const float *qh = q + h0 * hd, *sk = sinks ? sinks + h0 : nullptr;
      float* oh = o + h0 * hd;
      if (nb == 4) attend_heads<4>(qh, Kg, Vg, T, hd, scale, sk, p.data(), oh);
      else if (nb == 3) attend_heads<3>(qh, Kg, Vg, T, hd, scale, sk, p.data(), oh);
      else if (nb == 2) attend_heads<2>(qh, Kg, Vg, T, hd, scale, sk, p.data(), oh);
      else attend_heads<1>(qh, Kg, Vg, T, hd, scale, sk, p.data(), oh);
    }
  });
}

// The checked KV cache of a layer: Kc, Vc (Hkv, n_ctx, hd) contiguous f16 or f32 CPU tensors; true for f16
bool kv_cache(const at::Tensor& Kc, const at::Tensor& Vc) {
  const bool half = Kc.scalar_type() == at::kHalf;
  TORCH_CHECK_VALUE(Kc.dim() == 3 && Kc.sizes() == Vc.sizes() && (half || Kc.scalar_type() == at::kFloat) &&
                    Vc.scalar_type() == Kc.scalar_type() && Kc.is_contiguous() && Vc.is_contiguous() &&
                    Kc.device().is_cpu() && Vc.device().is_cpu(), "Kc, Vc: (Hkv, n_ctx, hd) contiguous f16 or f32 CPU tensors");
  return half;
}

// attend_window as the models' one-token branches call it: q (H * hd values) f32, Kc, Vc their layer's cache,
// window lo..end-1, sinks (H) f32 or none -> (1, H * hd) f32
at::Tensor attend(at::Tensor q, at::Tensor Kc, at::Tensor Vc, int64_t lo, int64_t end, double scale,
                  std::optional<at::Tensor> sinks) {
  const bool half = kv_cache(Kc, Vc);
  const int64_t Hkv = Kc.size(0), n_ctx = Kc.size(1), hd = Kc.size(2);
  TORCH_CHECK_VALUE(q.device().is_cpu() && q.scalar_type() == at::kFloat && Hkv > 0 && hd > 0 && q.numel() % (Hkv * hd) == 0,
                    "q: f32 CPU tensor of a multiple of Hkv * hd = ", Hkv * hd, " values");
  TORCH_CHECK_VALUE(0 <= lo && lo < end && end <= n_ctx, "window ", lo, "..", end, " outside the cache's ", n_ctx, " rows");
  const int64_t H = q.numel() / hd;
  q = q.contiguous();
  const float* sk = f32_or_null(sinks, H, "sinks");
  auto o = at::empty({1, H * hd}, q.options());
  if (half) attend_window(q.data_ptr<float>(), (const uint16_t*)Kc.data_ptr<at::Half>(), (const uint16_t*)Vc.data_ptr<at::Half>(),
                          H, Hkv, n_ctx, hd, lo, end, (float)scale, sk, o.data_ptr<float>());
  else attend_window(q.data_ptr<float>(), Kc.data_ptr<float>(), Vc.data_ptr<float>(), H, Hkv, n_ctx, hd, lo, end,
                     (float)scale, sk, o.data_ptr<float>());
  return o;
}

// One layer's attention for one token, model.attention's n == 1 branch in one call:
// x (1, D) f32 residual -> x + Wo attn (1, D) f32. h = rms_norm(x) * attn_norm; q, k, v = Wq h, Wk h,
// Wv h (+ biases); q and k normed in groups of q_norm's and k_norm's length (qwen3moe: per head;
// olmoe: the whole projection); RoPE at pos from model.rope_tables' cos/sin (n_ctx, hd): y = x cos +
// rotate(x) sin, rotate swapping each pair (i, i + hd/2) for NEOX, (2i, 2i+1) otherwise; k and v
// written to Kc, Vc (Hkv, n_ctx, hd; f16 or f32) at pos; per head softmax(q K^T / sqrt(hd)) V over positions
// 0..pos, head h reading kv head h / (H / Hkv); then Wo o.
at::Tensor attn_decode(at::Tensor x, std::optional<at::Tensor> attn_norm, double eps, WArg wq_a, WArg wk_a, WArg wv_a,
                       std::optional<at::Tensor> bq, std::optional<at::Tensor> bk, std::optional<at::Tensor> bv,
                       std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm, at::Tensor Kc, at::Tensor Vc,
                       at::Tensor cos, at::Tensor sin, int64_t pos, bool neox, int64_t H, WArg wo_a) {
  const int64_t D = x.numel();
  x = f32_rows(x, D, "x");
  const bool half = kv_cache(Kc, Vc);
  const int64_t Hkv = Kc.size(0), n_ctx = Kc.size(1), hd = Kc.size(2), qd = H * hd, kvd = Hkv * hd;
  TORCH_CHECK_VALUE(H > 0 && Hkv > 0 && H % Hkv == 0 && hd % 2 == 0, "H must be a multiple of Hkv, head size even");
  const Weight wq = weight(wq_a), wk = weight(wk_a), wv = weight(wv_a), wo = weight(wo_a);
  TORCH_CHECK_VALUE(wq.n == qd && wk.n == kvd && wv.n == kvd && wq.k == D && wk.k == D && wv.k == D && wo.n == D && wo.k == qd,
                    "projection shapes: q (", qd, ", ", D, "), k and v (", kvd, ", ", D, "), output (", D, ", ", qd, ")");
  TORCH_CHECK_VALUE(pos >= 0 && pos < n_ctx && cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                    sin.scalar_type() == at::kFloat && cos.numel() >= n_ctx * hd && sin.numel() >= n_ctx * hd, "pos / rope tables");
  const float* an = f32_or_null(attn_norm, D, "attn_norm");
  const float *b_q = f32_or_null(bq, qd, "bq"), *b_k = f32_or_null(bk, kvd, "bk"), *b_v = f32_or_null(bv, kvd, "bv");
  const int64_t gq = q_norm.has_value() && q_norm->defined() ? q_norm->numel() : 0;
  const int64_t gk = k_norm.has_value() && k_norm->defined() ? k_norm->numel() : 0;
  TORCH_CHECK_VALUE((gq == 0 || qd % gq == 0) && (gk == 0 || kvd % gk == 0), "q/k norm length must divide the projection");
  const float *qw = f32_or_null(q_norm, gq, "q_norm"), *kw = f32_or_null(k_norm, gk, "k_norm");

  std::vector<float> h(D), qkv(qd + 2 * kvd);
  norm_row(x.data_ptr<float>(), an, h.data(), D, eps);
  Acts ha(h.data(), 1, D);
  const Weight* mats[3] = {&wq, &wk, &wv};
  const XRow* xr[3];
  int64_t rg = 1;                             // q, k and v rows split over the threads in whole groups
  for (int m = 0; m < 3; ++m) {
    xr[m] = ha.rows(mats[m]->kern->fmt);     // every format before the threads start
    rg = std::max(rg, mats[m]->kern->group);
  }
  TORCH_CHECK_VALUE(qd % rg == 0 && kvd % rg == 0, "q, k, v rows in whole groups of ", rg);
  const int64_t starts[4] = {0, qd, qd + kvd, qd + 2 * kvd};
  at::parallel_for(0, starts[3] / rg, std::max<int64_t>(1, grain((wq.rb + wk.rb) / 2) / rg), [&](int64_t b, int64_t e) {
    for (int64_t r = b * rg; r < e * rg; r += rg) {
      const int m = r < qd ? 0 : r < qd + kvd ? 1 : 2;
      row_dots(*mats[m], r - starts[m], r - starts[m] + rg, xr[m], qkv.data() + r);
    }
  });
  float *q = qkv.data(), *k = q + qd, *v = k + kvd;
  for (int64_t i = 0; b_q && i < qd; ++i) q[i] += b_q[i];
  for (int64_t i = 0; b_k && i < kvd; ++i) k[i] += b_k[i];
  for (int64_t i = 0; b_v && i < kvd; ++i) v[i] += b_v[i];
  const float *c = cos.data_ptr<float>() + pos * hd, *s = sin.data_ptr<float>() + pos * hd;
  std::vector<float> rot(hd);
  norm_rope_row(q, qd, qw, gq, eps, c, s, neox, hd, rot.data());
  norm_rope_row(k, kvd, kw, gk, eps, c, s, neox, hd, rot.data());
  std::vector<float> o(qd);
  const auto store_and_attend = [&](auto* K, auto* V) {        // float* or uint16_t* (f16 bits)
    for (int64_t g = 0; g < Hkv; ++g) {
      store_kv(k + g * hd, K + (g * n_ctx + pos) * hd, hd);
      store_kv(v + g * hd, V + (g * n_ctx + pos) * hd, hd);
    }
    attend_window(q, K, V, H, Hkv, n_ctx, hd, 0, pos + 1, 1.f / std::sqrt((float)hd), nullptr, o.data());
  };
  if (half) store_and_attend((uint16_t*)Kc.data_ptr<at::Half>(), (uint16_t*)Vc.data_ptr<at::Half>());
  else store_and_attend(Kc.data_ptr<float>(), Vc.data_ptr<float>());
  auto y = at::empty({1, D}, x.options());
  Acts oa(o.data(), 1, qd);
  matvec_into(wo, oa, y.data_ptr<float>());
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < D; ++i) y.data_ptr<float>()[i] += xp[i];
  return y;
}

// A token's ffn norm and routing, model.route after the norm, in one call: x (1, D) f32 residual ->
// [h (1, D) = rms_norm(x) * ffn_norm, w (1, k) f32, ids (1, k) int64, shared-expert gate (1,) f32
// (sigmoid(h . shexp_gate) when given, else an empty tensor)]. logits = router h; norm_topk: softmax
// over the k largest logits (== softmax over all, top-k, renormalized), else the top-k of the softmax
// over all; w times `scale` unless it is 0 or 1.
std::vector<at::Tensor> route_decode(at::Tensor x, std::optional<at::Tensor> ffn_norm, double eps, WArg router_a, int64_t k,
                                     bool norm_topk, double scale, std::optional<at::Tensor> shexp_gate) {
  const int64_t D = x.numel();
  x = f32_rows(x, D, "x");
  const Weight router = weight(router_a);
  const int64_t E = router.n;
  TORCH_CHECK_VALUE(router.k == D && k >= 1 && k <= E, "router (", E, ", ", router.k, ") for D = ", D, ", k = ", k);
  auto h = at::empty({1, D}, x.options());
  norm_row(x.data_ptr<float>(), f32_or_null(ffn_norm, D, "ffn_norm"), h.data_ptr<float>(), D, eps);
  std::vector<float> logit(E);
  Acts ha(h.data_ptr<float>(), 1, D);
  matvec_into(router, ha, logit.data());
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
  at::Tensor gate = at::empty({0}, x.options());
  if (const float* g = f32_or_null(shexp_gate, D, "shexp_gate")) {
    gate = at::empty({1}, x.options());
    gate.data_ptr<float>()[0] = 1.f / (1.f + std::exp(-dot_f32(h.data_ptr<float>(), g, D)));
  }
  return {h, w, ids, gate};
}

}  // namespace
