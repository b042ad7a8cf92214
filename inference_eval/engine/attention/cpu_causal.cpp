// Causal attention of whole fresh sequences packed in rows (precompute's batches, prompt
// prefills) on CPU, fp32, flash-style: blocks of BQ query rows (each with the G query heads
// that share one kv head, stacked, so every key block feeds BQ * G rows) walk the key blocks
// up to their diagonal with an online softmax; no score matrix beyond one block, no mask
// tensor, no block above the diagonal. See cpu_causal.py for why it exists.
#include "../kernel_api.h"
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../vec_math.h"

#if defined(__AVX512F__)
constexpr int CV = 4;  // vectors per micro-tile row: 6 x 4 accumulators + 4 + 1 of 32 registers
#else
constexpr int CV = 2;  // 6 x 2 accumulators + 2 + 1 of 16 registers
#endif
constexpr int R = 6;     // keys (scores) or query rows (output) per micro-tile
constexpr int BK = 64;   // keys per block
constexpr int BQ = 32;   // query rows per block
constexpr int DV = CV * VW;  // head_dim must be a multiple of this (cpu_causal.py checks)

namespace {

// st[j][m] = k[j] . q[m] for keys j < NR and the NC * VW rows m from m0: k rows kstride
// apart, qt the block's queries transposed [D][mp], st rows mp apart. Scores are kept
// transposed (a key per row, query rows along the vector) so that the softmax's maxima and
// sums over keys are vector operations, never a reduction across a vector's lanes.
template <int NR, int NC>
void qk_tile(const float* k, int64_t kstride, const float* qt, int64_t mp, int64_t m0,
             int64_t D, float* st) {
  vec acc[NR][NC] = {};
  for (int64_t d = 0; d < D; ++d) {
    vec qv[NC];
    for (int c = 0; c < NC; ++c) {
      qv[c] = loadu(qt + d * mp + m0 + c * VW);
      asm("" : "+v"(qv[c]));  // one load for all NR keys, not one per multiply-add
    }
    for (int r = 0; r < NR; ++r) {
      const vec b = vec{} + k[r * kstride + d];
      for (int c = 0; c < NC; ++c) acc[r][c] += b * qv[c];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) storeu(st + r * mp + m0 + c * VW, acc[r][c]);
}

// o[r] = o[r] * alpha[r] + sum_{j < nk} pt[j][r] v[j] for query rows r < NR: pt the
// transposed probabilities (rows mp apart, column 0 is row r = 0 here), v rows vstride
// apart, o rows D apart.
template <int NR>
void pv_tile(const float* pt, int64_t mp, const float* v, int64_t vstride, int64_t nk,
             int64_t D, const float* alpha, float* o) {
  for (int64_t d0 = 0; d0 < D; d0 += DV) {
    vec acc[NR][CV];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < CV; ++c) acc[r][c] = loadu(o + r * D + d0 + c * VW) * alpha[r];
    for (int64_t j = 0; j < nk; ++j) {
      vec vv[CV];
      for (int c = 0; c < CV; ++c) {
        vv[c] = loadu(v + j * vstride + d0 + c * VW);
        asm("" : "+v"(vv[c]));
      }
      for (int r = 0; r < NR; ++r) {
        const vec b = vec{} + pt[j * mp + r];
        for (int c = 0; c < CV; ++c) acc[r][c] += b * vv[c];
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < CV; ++c) storeu(o + r * D + d0 + c * VW, acc[r][c]);
  }
}

using QK = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*);
using PV = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, const float*,
                    float*);
#define SPECHEADS_QK_ROW(n) {nullptr, qk_tile<n, 1>, qk_tile<n, 2>, qk_tile<n, 3>, qk_tile<n, 4>}
constexpr QK kQK[R + 1][5] = {{}, SPECHEADS_QK_ROW(1), SPECHEADS_QK_ROW(2), SPECHEADS_QK_ROW(3),
                              SPECHEADS_QK_ROW(4), SPECHEADS_QK_ROW(5), SPECHEADS_QK_ROW(6)};
#undef SPECHEADS_QK_ROW
static_assert(CV <= 4, "kQK holds tiles of up to 4 vectors");
constexpr PV kPV[R + 1] = {nullptr, pv_tile<1>, pv_tile<2>, pv_tile<3>, pv_tile<4>, pv_tile<5>, pv_tile<6>};

struct Buffers {
  std::vector<float> qt, st, o, m, l, alpha;
  Buffers(int64_t mp, int64_t D)
      : qt(D * mp), st(BK * mp), o(mp * D), m(mp), l(mp), alpha(mp) {}
};

}  // namespace

// q [T, H, D], k / v [T, KVH, D] packed fp32 rows, contiguous; sequence b owns rows
// cu[b] .. cu[b+1] and its row i sees its keys 0 .. i. -> [T, H, D].
at::Tensor causal_attention(at::Tensor q, at::Tensor k, at::Tensor v,
                               at::Tensor cu_seqlens, double scale, int64_t threads) {
  for (const auto& t : {q, k, v})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 3,
                "causal_attention: contiguous fp32 [T, heads, head_dim] rows only");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "causal_attention: q, k and v disagree in rows or head_dim");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous(),
              "causal_attention: cu_seqlens int64");
  const int64_t H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(H % KVH == 0, "causal_attention: query heads must be a multiple of kv heads");
  TORCH_CHECK(D % DV == 0, "causal_attention: head_dim must be a multiple of ", DV);
  const int64_t G = H / KVH, B = cu_seqlens.size(0) - 1;
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(B >= 0 && cu[0] == 0 && cu[B] == q.size(0), "causal_attention: cu_seqlens must "
              "run from 0 to the row count");
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();

  // Tasks: (sequence, kv head, query block), the costliest (most key blocks) first so the
  // dynamic schedule ends with short ones.
  struct Task { int64_t b, h, i0, cost; };
  std::vector<Task> tasks;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(cu[b + 1] >= cu[b], "causal_attention: cu_seqlens must not decrease");
    for (int64_t i0 = 0; i0 < cu[b + 1] - cu[b]; i0 += BQ)
      for (int64_t h = 0; h < KVH; ++h) tasks.push_back({b, h, i0, i0 / BK + 1});
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& c) { return a.cost > c.cost; });
  const float c = static_cast<float>(scale / std::log(2.0));  // exp(x * scale) = 2^(x * c)
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t mp = (BQ * G + VW - 1) / VW * VW;  // a block's query rows, padded to vectors
  const int64_t kstride = KVH * D;
  const int nt = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(threads, static_cast<int64_t>(tasks.size()))));
#pragma omp parallel num_threads(nt)
  {
    Buffers buf(mp, D);
#pragma omp for schedule(dynamic, 1)
    for (size_t ti = 0; ti < tasks.size(); ++ti) {
      const Task& task = tasks[ti];
      const int64_t s0 = cu[task.b], h = task.h, i0 = task.i0;
      const int64_t nq = std::min<int64_t>(BQ, cu[task.b + 1] - s0 - i0), M = nq * G;
      const int64_t mv = (M + VW - 1) / VW;  // vectors of query rows in this block
      // Query row m = i * G + g: row i0 + i, head h * G + g, scaled for exp2, transposed
      // into qt [D][mp]; padding rows are zero (their scores stay finite and are dropped).
      std::fill(buf.qt.begin(), buf.qt.end(), 0.f);
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const float* src = qp + ((s0 + i0 + i) * H + h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) buf.qt[d * mp + i * G + g] = src[d] * c;
        }
      std::fill_n(buf.o.begin(), mp * D, 0.f);
      std::fill_n(buf.m.begin(), mp, neg_inf);
      std::fill_n(buf.l.begin(), mp, 0.f);
      const int64_t kend = i0 + nq;  // keys below this may be visible to some row
      for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int64_t nk = std::min<int64_t>(BK, kend - k0);
        const float* kb = kp + ((s0 + k0) * KVH + h) * D;
        float* st = buf.st.data();
        for (int64_t j0 = 0; j0 < nk; j0 += R) {
          const int nr = static_cast<int>(std::min<int64_t>(R, nk - j0));
          for (int64_t c0 = 0; c0 < mv; c0 += CV) {
            const int nc = static_cast<int>(std::min<int64_t>(CV, mv - c0));
            kQK[nr][nc](kb + j0 * kstride, kstride, buf.qt.data(), mp, c0 * VW, D, st + j0 * mp);
          }
        }
        // Key k0 + j is visible to rows m >= (k0 + j - i0) * G: mask the rows before.
        for (int64_t j = 0; j < nk; ++j)
          std::fill_n(st + j * mp, std::clamp<int64_t>((k0 + j - i0) * G, 0, mv * VW), neg_inf);
        for (int64_t v0 = 0; v0 < mv * VW; v0 += VW) {
          vec mx = loadu(st + v0);
          for (int64_t j = 1; j < nk; ++j) {
            const vec t = loadu(st + j * mp + v0);
            mx = mx > t ? mx : t;
          }
          const vec m_old = loadu(buf.m.data() + v0);
          const vec m_new = m_old > mx ? m_old : mx;  // finite: key 0 is seen by every row
          vec sum = {};
          for (int64_t j = 0; j < nk; ++j) {
            const vec e = exp2v_nonpositive(loadu(st + j * mp + v0) - m_new);
            storeu(st + j * mp + v0, e);
            sum += e;
          }
          const vec alpha = exp2v_nonpositive(m_old - m_new);  // 0 on the first block (m_old = -inf)
          storeu(buf.alpha.data() + v0, alpha);
          storeu(buf.l.data() + v0, loadu(buf.l.data() + v0) * alpha + sum);
          storeu(buf.m.data() + v0, m_new);
        }
        const float* vb = vp + ((s0 + k0) * KVH + h) * D;
        for (int64_t m0 = 0; m0 < M; m0 += R) {
          const int nr = static_cast<int>(std::min<int64_t>(R, M - m0));
          kPV[nr](st + m0, mp, vb, kstride, nk, D, buf.alpha.data() + m0, buf.o.data() + m0 * D);
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        const float inv = 1.f / buf.l[m];
        float* dst = op + ((s0 + i0 + m / G) * H + h * G + m % G) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = buf.o[m * D + d] * inv;
      }
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("causal_attention", &causal_attention,
        "causal attention of whole packed fp32 sequences (CPU, flash-style blocks)");
  m.attr("head_dim_multiple") = DV;
}
