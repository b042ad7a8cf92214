// Causal (or tree-masked) attention of a few new query rows per request over its pages of the
// KV cache, on CPU, fp32: no gather of the history, no padding to the longest request.
// See cpu_paged.py for why it exists and when the torch backend calls it.
#include "../kernel_api.h"
#include "../vec_math.h"
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECHEADS_AVX2 1
#endif

namespace {

// s[g] = <q[g], k> for g < G; q rows D apart.
inline void dots(const float* q, const float* k, int64_t G, int64_t D, float* s) {
#ifdef SPECHEADS_AVX2
  if (D % 8 == 0) {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {  // four rows at a time share each k load
      const int64_t gn = std::min<int64_t>(4, G - g0);
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                       _mm256_setzero_ps()};
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 kv = _mm256_loadu_ps(k + d);
        for (int64_t g = 0; g < gn; ++g)
          acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (g0 + g) * D + d), kv, acc[g]);
      }
      for (int64_t g = 0; g < gn; ++g) {
        __m128 x = _mm_add_ps(_mm256_castps256_ps128(acc[g]), _mm256_extractf128_ps(acc[g], 1));
        x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        x = _mm_add_ss(x, _mm_movehdup_ps(x));
        s[g0 + g] = _mm_cvtss_f32(x);
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) {
    float t = 0.f;
    for (int64_t d = 0; d < D; ++d) t += q[g * D + d] * k[d];
    s[g] = t;
  }
}

// a[g] += p[g] * v for g < G; a rows D apart.
inline void axpys(const float* p, const float* v, int64_t G, int64_t D, float* a) {
#ifdef SPECHEADS_AVX2
  if (D % 8 == 0) {
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 vv = _mm256_loadu_ps(v + d);
      for (int64_t g = 0; g < G; ++g) {
        float* ag = a + g * D + d;
        _mm256_storeu_ps(ag, _mm256_fmadd_ps(_mm256_set1_ps(p[g]), vv, _mm256_loadu_ps(ag)));
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) a[g * D + d] += p[g] * v[d];
}

constexpr int64_t kAhead = 4;  // keys ahead whose rows are prefetched (pages sit anywhere)

inline void prefetch(const float* p, int64_t n) {
  for (int64_t x = 0; x < n; x += 16) __builtin_prefetch(p + x);
}

}  // namespace

// q [T, H, D] packed rows (request b owns rows cu_q[b] .. cu_q[b+1]); k_cache / v_cache
// [S, KVH, D] (S = pages * page_size, slot = page * page_size + offset); block_tables [B, P]
// int64 page ids; kv_lens [B] (keys in the cache after this step's rows were appended).
// Query row i of request b (q_len rows) sees keys 0 .. kv_len - q_len + i. -> [T, H, D].
// k_new / v_new [T, KVH, D] are this step's rows, written first to their slots [T].
// Tree masks (mask_w of B entries, or empty for all causal): request b with m = mask_w[b] > 0
// reads its mask as uint8 [q_len, m] at mask_bits + mask_off[b], over its LAST m keys (1 = may
// attend); its earlier keys are visible to every row. m = 0 keeps b causal.
at::Tensor paged_attention(at::Tensor q, at::Tensor k_new, at::Tensor v_new,
                              at::Tensor slots, at::Tensor k_cache, at::Tensor v_cache,
                              at::Tensor block_tables, at::Tensor cu_q,
                              at::Tensor kv_lens, int64_t page_size, double scale,
                              int64_t threads, at::Tensor mask_bits, at::Tensor mask_off,
                              at::Tensor mask_w) {
  for (const auto& t : {q, k_new, v_new, k_cache, v_cache})
    TORCH_CHECK(t.scalar_type() == at::kFloat, "paged_attention: fp32 only");
  TORCH_CHECK(k_new.is_contiguous() && v_new.is_contiguous() && slots.is_contiguous() &&
                  k_new.sizes() == v_new.sizes() && k_new.size(0) == slots.size(0) &&
                  k_new.size(1) == k_cache.size(1) && k_new.size(2) == k_cache.size(2),
              "paged_attention: new rows must be contiguous [T, kv_heads, head_dim], one slot each");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && cu_q.is_contiguous() && kv_lens.is_contiguous(),
              "paged_attention: contiguous inputs only");
  const bool masked = mask_w.numel() > 0;
  TORCH_CHECK(!masked || (mask_w.numel() == kv_lens.numel() && mask_off.numel() == kv_lens.numel() &&
                          mask_bits.scalar_type() == at::kByte && mask_bits.is_contiguous() &&
                          mask_w.is_contiguous() && mask_off.is_contiguous()),
              "paged_attention: tree masks need uint8 bits and one offset and width per request");
  const uint8_t* mbits = masked ? mask_bits.data_ptr<uint8_t>() : nullptr;
  const int64_t* moff = masked ? mask_off.data_ptr<int64_t>() : nullptr;
  const int64_t* mwid = masked ? mask_w.data_ptr<int64_t>() : nullptr;
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(2) == D, "paged_attention: head shapes disagree");
  const int64_t G = H / KVH, B = kv_lens.size(0), P = block_tables.size(1);
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* kp = k_cache.data_ptr<float>();
  float* vp = v_cache.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cu = cu_q.data_ptr<int64_t>();
  const int64_t* kl = kv_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  {  // append: one row of KVH * D floats per new token (a latent cache writes k twice)
    const int64_t row = KVH * D;
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < slots.size(0); ++t) {
      std::copy_n(k_new.data_ptr<float>() + t * row, row, kp + sl[t] * row);
      std::copy_n(v_new.data_ptr<float>() + t * row, row, vp + sl[t] * row);
    }
  }
  const float sc = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // A task is one request's kv heads [h0, h0 + hs): every head (hs = KVH) when there are
  // requests enough to keep the threads busy, so each key and value row is read whole and
  // in order; one kv head per task otherwise (batch 1 still splits over the threads).
  // `threads` is explicit (not torch's setting): engine steps keep torch at one thread
  // beside the BLAS, which left this kernel serial (a batch-64 decode step: 40 ms of 254).
  const int64_t hs = B >= 2 * threads ? KVH : 1;
  const int64_t tasks = B * (KVH / hs);
  const int64_t HS = hs * G;  // query heads per task and query row
  auto slot_of = [&](int64_t b, int64_t j) {
    return bt[b * P + j / page_size] * page_size + j % page_size;
  };
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> scores, acc, mx, sum;
    // Tasks differ in length (each request's own history), so threads take them as they go.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / (KVH / hs), h0 = task % (KVH / hs) * hs;
      const int64_t q0 = cu[b], nq = cu[b + 1] - cu[b], n = kl[b];
      const int64_t mw = masked ? mwid[b] : 0;
      // ctx: the keys every row sees (causal: the history before the step's rows; tree: the
      // keys before the masked last mw).
      const int64_t ctx = n - (mw > 0 ? mw : nq);
      const uint8_t* tree = mw > 0 ? mbits + moff[b] : nullptr;
      const int64_t R = nq * HS;  // row r = i * HS + (h - h0) * G + g
      const int64_t Rp = (R + VW - 1) / VW * VW;  // rows padded to whole vectors
      // scores[j * Rp + r]: key j's scores for every row, adjacent, so the softmax runs
      // across rows in vectors; -inf where row r may not see key j.
      scores.assign(n * Rp, 0.f);
      acc.assign(R * D, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const float* krow = kp + (slot_of(b, j) * KVH + h0) * D;
        if (j + kAhead < n) prefetch(kp + (slot_of(b, j + kAhead) * KVH + h0) * D, hs * D);
        for (int64_t i = tree ? 0 : std::max<int64_t>(0, j - ctx); i < nq; ++i)
          for (int64_t h = 0; h < hs; ++h)
            dots(qp + ((q0 + i) * H + (h0 + h) * G) * D, krow + h * D, G, D,
                 scores.data() + j * Rp + i * HS + h * G);
      }
      for (int64_t j = ctx; j < n; ++j)  // causal: row i sees keys up to ctx + i
        for (int64_t i = 0; i < nq; ++i)
          if (tree ? tree[i * mw + j - ctx] == 0 : j > ctx + i)
            std::fill_n(scores.data() + j * Rp + i * HS, HS, neg_inf);
      // Softmax in base 2 over every key, VW rows at a time; 1 / sum is applied to the
      // output rows instead of to every probability.
      const float c = sc * 1.4426950408889634f;  // log2(e)
      mx.assign(Rp, neg_inf);
      sum.assign(Rp, 0.f);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t r = 0; r < Rp; r += VW) {
          const vec x = loadu(scores.data() + j * Rp + r), m = loadu(mx.data() + r);
          storeu(mx.data() + r, x > m ? x : m);
        }
      for (float& m : mx) m = m == neg_inf ? 0.f : m;  // a row that sees no key: no NaN
      for (int64_t j = 0; j < n; ++j)
        for (int64_t r = 0; r < Rp; r += VW) {
          float* sj = scores.data() + j * Rp + r;
          const vec e = exp2v_nonpositive((loadu(sj) - loadu(mx.data() + r)) * c);
          storeu(sj, e);
          storeu(sum.data() + r, loadu(sum.data() + r) + e);
        }
      for (int64_t j = 0; j < n; ++j) {
        const float* vrow = vp + (slot_of(b, j) * KVH + h0) * D;
        if (j + kAhead < n) prefetch(vp + (slot_of(b, j + kAhead) * KVH + h0) * D, hs * D);
        for (int64_t i = tree ? 0 : std::max<int64_t>(0, j - ctx); i < nq; ++i)
          for (int64_t h = 0; h < hs; ++h)
            axpys(scores.data() + j * Rp + i * HS + h * G, vrow + h * D, G, D,
                  acc.data() + (i * HS + h * G) * D);
      }
      for (int64_t r = 0; r < R; ++r) {  // out row = acc row / sum (0 for a row seeing no key)
        const float inv = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
        const int64_t i = r / HS, hg = r % HS;
        float* o = op + ((q0 + i) * H + h0 * G + hg) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
      }
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "causal or tree-masked attention of packed query rows over paged fp32 KV (CPU)");
}
