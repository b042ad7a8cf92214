// The decoder layer's elementwise steps in one pass each, fp32 on CPU: RMSNorm (with the
// residual add before it, optionally), SwiGLU's silu(gate) * up, and the rotary embedding
// of q and k split out of the fused qkv projection. See cpu_fused.py for why.
#include "../kernel_api.h"
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "../vec_math.h"

namespace {

// Below this many floats a call runs on one thread: a decode step's rows are a few KB, less
// than what starting the second thread costs.
constexpr int64_t kParallelFloats = 1 << 15;

int threads_for(int64_t floats, int64_t threads) {
  return static_cast<int>(floats < kParallelFloats ? 1 : std::max<int64_t>(1, threads));
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1,
              what, ": fp32 [rows, features] with contiguous features");
}

}  // namespace

// x [N, H] (rows may be strided), w [H] -> x / rms(x) * w [N, H]; with residual r [N, H]:
// s = x + r first, returns (s, norm(s)) (the decoder layer's add before its second norm).
std::vector<at::Tensor> rms_norm(at::Tensor x, at::Tensor w, double eps,
                                    c10::optional<at::Tensor> residual, int64_t threads) {
  check_rows(x, "rms_norm");
  const int64_t n = x.size(0), h = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == h,
              "rms_norm: weight [features] fp32");
  const bool add = residual.has_value();
  if (add) {
    check_rows(*residual, "rms_norm residual");
    TORCH_CHECK(residual->size(0) == n && residual->size(1) == h, "rms_norm: residual shape");
  }
  auto out = at::empty({n, h}, x.options());
  auto sum = add ? at::empty({n, h}, x.options()) : at::Tensor();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* rp = add ? residual->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  float* sp = add ? sum.data_ptr<float>() : nullptr;
  const int64_t xs = x.stride(0), rs = add ? residual->stride(0) : 0;
  const float e = static_cast<float>(eps);
#pragma omp parallel for num_threads(threads_for(n * h, threads)) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = xp + i * xs;
    float* oi = op + i * h;
    if (add) {  // the sum is written first and normalized from there
      float* si = sp + i * h;
      const float* ri = rp + i * rs;
      for (int64_t j = 0; j < h; ++j) si[j] = xi[j] + ri[j];
      xi = si;
    }
    float ss = 0.f;
    for (int64_t j = 0; j < h; ++j) ss += xi[j] * xi[j];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + e);
    for (int64_t j = 0; j < h; ++j) oi[j] = xi[j] * inv * wp[j];
  }
  if (add) return {sum, out};
  return {out};
}

// gate_up [N, 2I] (gate columns first) -> silu(gate) * up [N, I].
at::Tensor silu_mul(at::Tensor gate_up, int64_t threads) {
  check_rows(gate_up, "silu_mul");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * inter && inter % VW == 0,
              "silu_mul: an even number of columns, each half a multiple of ", VW);
  auto out = at::empty({n, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  constexpr float kLog2e = 1.4426950408889634f;
#pragma omp parallel for num_threads(threads_for(n * inter, threads)) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* g = gp + i * gs;
    const float* u = g + inter;
    float* o = op + i * inter;
    for (int64_t j = 0; j < inter; j += VW) {
      const vec x = loadu(g + j);
      storeu(o + j, x / (1.f + exp2v(x * -kLog2e)) * loadu(u + j));  // x sigmoid(x) up
    }
  }
  return out;
}

// qkv [T, (heads + 2 kv_heads) d] (rows may be strided), cos / sin [T, d] in the
// rotate-half layout -> q [T, heads, d], k [T, kv_heads, d] rotated, v [T, kv_heads, d],
// each contiguous: x' = x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]. With
// q_w / k_w [d] (a q/k-normed layer: Qwen3, DFlash), each head's q or k row is first
// RMS-normalized over d and scaled by its weight, as the layer's q_norm / k_norm do.
std::vector<at::Tensor> rope_split(at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                                      int64_t heads, int64_t kv_heads, int64_t d,
                                      int64_t threads, c10::optional<at::Tensor> q_w,
                                      c10::optional<at::Tensor> k_w, double eps) {
  check_rows(qkv, "rope_split");
  const int64_t t = qkv.size(0), half = d / 2;
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * d && d % 2 == 0,
              "rope_split: qkv columns must be (heads + 2 kv_heads) x an even head_dim");
  for (const auto& c : {cos, sin})
    TORCH_CHECK(c.scalar_type() == at::kFloat && c.is_contiguous() && c.dim() == 2 &&
                    c.size(0) == t && c.size(1) == d,
                "rope_split: cos / sin [T, head_dim] fp32, contiguous");
  TORCH_CHECK(q_w.has_value() == k_w.has_value(), "rope_split: q and k norm weights together");
  const bool normed = q_w.has_value();
  if (normed)
    for (const auto& w : {*q_w, *k_w})
      TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == d,
                  "rope_split: q / k norm weights [head_dim] fp32, contiguous");
  const float* qwp = normed ? q_w->data_ptr<float>() : nullptr;
  const float* kwp = normed ? k_w->data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  auto q = at::empty({t, heads, d}, qkv.options());
  auto k = at::empty({t, kv_heads, d}, qkv.options());
  auto v = at::empty({t, kv_heads, d}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const int64_t rs = qkv.stride(0);
#pragma omp parallel for num_threads(threads_for(t * (heads + 2 * kv_heads) * d, threads)) \
    schedule(static)
  for (int64_t i = 0; i < t; ++i) {
    const float* row = src + i * rs;
    const float* c = cp + i * d;
    const float* s = sp + i * d;
    std::vector<float> scratch(normed ? d : 0);
    auto rotate = [&](const float* x, float* y, const float* w) {
      if (w != nullptr) {  // RMSNorm of the head's row first, into scratch
        float ss = 0.f;
        for (int64_t j = 0; j < d; ++j) ss += x[j] * x[j];
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + e);
        for (int64_t j = 0; j < d; ++j) scratch[j] = x[j] * inv * w[j];
        x = scratch.data();
      }
      for (int64_t j = 0; j < half; ++j) {
        y[j] = x[j] * c[j] - x[j + half] * s[j];
        y[j + half] = x[j + half] * c[j + half] + x[j] * s[j + half];
      }
    };
    for (int64_t hd = 0; hd < heads; ++hd) rotate(row + hd * d, qp + (i * heads + hd) * d, qwp);
    for (int64_t hd = 0; hd < kv_heads; ++hd)
      rotate(row + (heads + hd) * d, kp + (i * kv_heads + hd) * d, kwp);
    std::copy_n(row + (heads + kv_heads) * d, kv_heads * d, vp + i * kv_heads * d);
  }
  return {q, k, v};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of fp32 rows, optionally after a residual add (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of fused gate/up rows (CPU)");
  m.def("rope_split", &rope_split, "q, k (normed) rotated and v split out of fused qkv rows (CPU)",
        pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("heads"),
        pybind11::arg("kv_heads"), pybind11::arg("d"), pybind11::arg("threads"),
        pybind11::arg("q_w") = pybind11::none(), pybind11::arg("k_w") = pybind11::none(),
        pybind11::arg("eps") = 1e-6);
  m.attr("vector_width") = VW;
}
