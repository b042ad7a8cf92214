// Causal (or tree-masked) attention of a few new query rows per request over its pages of the
// KV cache, on CPU, fp32: no gather of the history, no padding to the longest request.
// See cpu_paged.py for why it exists and when the torch backend calls it.
#include "../kernel_api.h"
#include "../vec_math.h"
#include <omp.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace {

// Keeps a value in its register as is: the compiler may not regroup the adds around it
// (-fassociative-math would otherwise split a key-order sum into partial sums).
#if defined(__x86_64__) || defined(__i386__)
#define PIN(x) asm("" : "+v"(x))
#else
#define PIN(x) asm("" : "+w"(x))  // AArch64: a SIMD / FP register
#endif

constexpr int64_t kAhead = 4;  // keys ahead whose rows are prefetched (pages sit anywhere)
constexpr int KB = 8;          // keys per score block: reduce8 folds their 8 dot products at once

inline void prefetch(const float* p, int64_t n) {
  for (int64_t x = 0; x < n; x += 16) __builtin_prefetch(p + x);
}

// The first w <= VW floats at p as a vector, -inf past them (a row's last, partial vector).
inline vec load_head(const float* p, int64_t w) {
  vec x = vec{} - std::numeric_limits<float>::infinity();
  __builtin_memcpy(&x, p, w * sizeof(float));
  return x;
}

// D = DV * VW floats a row when DV > 0 (the common head dims, unrolled in registers); DV == 0:
// any D, its whole vectors then a scalar tail.
template <int DV>
struct Rows {
  static constexpr int RG = DV == 0 ? 1 : (DV >= 4 ? 16 / DV : 4);  // rows whose sums fit registers
  // The dot products of query row q with key rows k[0 .. nk) (nk <= KB) -> s[c]: each a vector
  // sum over whole vectors folded by reduce8, plus the scalar tail. Each key's fold is its own,
  // whatever nk and the other keys are, so a score never depends on the step it is part of.
  static inline vec8 dots(const float* q, const float* const* k, int nk, int64_t D) {
    const int64_t nv = DV > 0 ? DV : D / VW;
    vec acc[KB];
    for (int c = 0; c < KB; ++c) {
      acc[c] = vec{};
      if (c < nk)
        for (int64_t v = 0; v < nv; ++v) acc[c] += loadu(q + v * VW) * loadu(k[c] + v * VW);
    }
    vec8 s = reduce8(acc);
    if constexpr (DV == 0)
      for (int c = 0; c < nk; ++c)
        for (int64_t d = nv * VW; d < D; ++d) s[c] += q[d] * k[c][d];
    return s;
  }

  // a[g] = sum over keys j of p[g * Np + j] * v_j for the G rows of p (G <= RG),
  // keys in order (a masked key's p is 0, which adds nothing: a row sums the same terms in
  // the same order whichever keys beside them it cannot see), then o[g] = a[g] * inv[g].
  // Value row j: v + slot[j] * stride (the kv head's offset already in v).
  static inline void values(const float* p, int64_t Np, const float* v, const int64_t* slot,
                            int64_t stride, int64_t n, int64_t D, int G, const float* inv,
                            float* const* o) {
    if constexpr (DV > 0) {
      vec a[RG][DV] = {};
      for (int64_t j = 0; j < n; ++j) {
        const float* vr = v + slot[j] * stride;
        if (j + kAhead < n) prefetch(v + slot[j + kAhead] * stride, D);
        for (int g = 0; g < RG; ++g) {
          if (g >= G) break;
          const vec pg = vec{} + p[g * Np + j];
          for (int x = 0; x < DV; ++x) {
            a[g][x] += pg * loadu(vr + x * VW);
            PIN(a[g][x]);  // one add per key, never regrouped across keys
          }
        }
      }
      for (int g = 0; g < G; ++g)
        for (int x = 0; x < DV; ++x) storeu(o[g] + x * VW, a[g][x] * inv[g]);
    } else {
      for (int g = 0; g < G; ++g) {  // any D: one row at a time, its sums in the output row
        float* og = o[g];
        std::fill_n(og, D, 0.f);
        for (int64_t j = 0; j < n; ++j) {
          const float pj = p[g * Np + j];
          const float* vr = v + slot[j] * stride;
          for (int64_t d = 0; d < D; ++d) og[d] += pj * vr[d];
        }
        for (int64_t d = 0; d < D; ++d) og[d] *= inv[g];
      }
    }
  }
};

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

  // A task is some query rows of one request's kv heads [h0, h0 + hs): every head (hs = KVH)
  // when there are requests enough to keep the threads busy, so each key and value row is
  // read whole and in order; one kv head otherwise, its rows split into several tasks when
  // even that leaves threads idle (batch 1: 3 kv heads on 2 threads). A row's result is its
  // own (its scores, softmax and values never mix with another row's), so how rows are
  // grouped into tasks, and which other rows a step carries, changes no bit.
  // `threads` is explicit (not torch's setting): engine steps keep torch at one thread
  // beside the BLAS, which left this kernel serial (a batch-64 decode step: 40 ms of 254).
  const int64_t hs = B >= 2 * threads ? KVH : 1;
  const int64_t pairs = B * (KVH / hs);
  const int64_t HS = hs * G;  // rows per query position and task head group
  struct Task { int64_t b, h0, r0, r1; };
  std::vector<Task> tasks;
  for (int64_t pr = 0; pr < pairs; ++pr) {
    const int64_t b = pr / (KVH / hs), h0 = pr % (KVH / hs) * hs;
    const int64_t R = (cu[b + 1] - cu[b]) * HS;
    // Split: ~8 tasks a thread, each at least one position's G rows (every task reads its
    // kv head's keys and values again: 1-row tasks measured slower on 2 threads than on 1).
    const int64_t per = pairs >= 2 * threads
                            ? R : std::max<int64_t>(G, (R * pairs + 8 * threads - 1) / (8 * threads));
    for (int64_t r0 = 0; r0 < R; r0 += per) tasks.push_back({b, h0, r0, std::min(R, r0 + per)});
  }
  // Every request's key slots once, page by page (no division per key and task).
  std::vector<int64_t> first(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + kl[b];
  std::vector<int64_t> slot(first[B]);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < kl[b]; j += page_size) {
      const int64_t base = bt[b * P + j / page_size] * page_size;
      for (int64_t x = 0; x < std::min<int64_t>(page_size, kl[b] - j); ++x)
        slot[first[b] + j + x] = base + x;
    }
  const int64_t stride = KVH * D;  // floats per cache slot
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks.size())));
  auto run = [&](auto rows) {
    using Rw = decltype(rows);
    constexpr int RG = Rw::RG;
#pragma omp parallel num_threads(nt)
    {
      std::vector<float> scores, inv;
      // Tasks differ in length (each request's own history), so threads take them as they go.
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) {
        const auto [b, h0, r0, r1] = tasks[t];
        const int64_t q0 = cu[b], n = kl[b], nq = cu[b + 1] - cu[b];
        const int64_t mw = masked ? mwid[b] : 0;
        // ctx: the keys every row sees (causal: the history before the step's rows; tree: the
        // keys before the masked last mw).
        const int64_t ctx = n - (mw > 0 ? mw : nq);
        const uint8_t* tree = mw > 0 ? mbits + moff[b] : nullptr;
        const int64_t R = r1 - r0;  // task row r is row r0 + r = i * HS + (h - h0) * G + g
        const int64_t Np = (n + KB - 1) / KB * KB;  // a row's keys, padded to whole blocks
        auto head_of = [&](int64_t r) { return (r0 + r) % HS / G; };
        auto row_at = [&](auto* base, int64_t r) {  // q or out row of task row r
          return base + ((q0 + (r0 + r) / HS) * H + h0 * G + (r0 + r) % HS) * D;
        };
        const int64_t* sl = slot.data() + first[b];
        // scores[r * Np + j]: row r's score of key j, -inf where it may not see the key.
        // Blocks of KB keys, every row against each (the block stays in L1).
        scores.resize(R * Np);
        for (int64_t j0 = 0; j0 < n; j0 += KB) {
          const int nk = static_cast<int>(std::min<int64_t>(KB, n - j0));
          for (int64_t j = j0 + KB; j < std::min(n, j0 + 2 * KB); ++j)
            prefetch(kp + sl[j] * stride + h0 * D, hs * D);
          const float* kr[KB];
          int64_t kr_head = -1;
          for (int64_t r = 0; r < R; ++r) {
            if (head_of(r) != kr_head) {
              kr_head = head_of(r);
              for (int c = 0; c < nk; ++c) kr[c] = kp + sl[j0 + c] * stride + (h0 + kr_head) * D;
            }
            const vec8 s8 = Rw::dots(row_at(qp, r), kr, nk, D);
            __builtin_memcpy(scores.data() + r * Np + j0, &s8, sizeof s8);
          }
        }
        const float c = sc * 1.4426950408889634f;  // log2(e): the softmax runs in base 2
        inv.resize(R);
        for (int64_t r = 0; r < R; ++r) {
          float* s = scores.data() + r * Np;
          const int64_t i = (r0 + r) / HS;
          // causal: row i sees keys up to ctx + i; a tree row its mask's keys after ctx.
          for (int64_t j = ctx; j < Np; ++j)
            if (j >= n || (tree ? tree[i * mw + j - ctx] == 0 : j > ctx + i)) s[j] = neg_inf;
          vec m = vec{} + neg_inf;
          for (int64_t j = 0; j < Np; j += VW) {  // Np may end half a vector past a block
            const vec x = load_head(s + j, std::min<int64_t>(VW, Np - j));
            m = x > m ? x : m;
          }
          float mr = neg_inf;
          for (int l = 0; l < VW; ++l) mr = std::max(mr, m[l]);
          mr = mr == neg_inf ? 0.f : mr;  // a row that sees no key: no NaN
          for (int64_t j = 0; j < Np; j += VW) {
            const int64_t w = std::min<int64_t>(VW, Np - j);
            const vec e = exp2v_nonpositive((load_head(s + j, w) - mr) * c);
            __builtin_memcpy(s + j, &e, w * sizeof(float));
          }
        }
        // Each row's sum adds its keys' weights in key order (a key it cannot see adds 0), so
        // a tree row, whose keys sit between its siblings', sums exactly what the same row
        // does in a plain causal step; RG rows at a time hide the adds' latency.
        for (int64_t r = 0; r < R; r += RG) {
          const int g = static_cast<int>(std::min<int64_t>(RG, R - r));
          float t[RG] = {};
          for (int64_t j = 0; j < n; ++j)
            for (int x = 0; x < g; ++x) {
              t[x] += scores[(r + x) * Np + j];
              PIN(t[x]);  // in key order: never split into partial sums
            }
          for (int x = 0; x < g; ++x) inv[r + x] = t[x] > 0.f ? 1.f / t[x] : 0.f;  // 0: sees no key
        }
        // Values: runs of up to RG rows of one kv head, their sums in registers over all keys.
        for (int64_t r = 0; r < R;) {
          int g = 1;
          while (g < RG && r + g < R && head_of(r + g) == head_of(r)) ++g;
          float* o[RG];
          for (int x = 0; x < g; ++x) o[x] = row_at(op, r + x);
          Rw::values(scores.data() + r * Np, Np, vp + (h0 + head_of(r)) * D, sl, stride, n, D,
                     g, inv.data() + r, o);
          r += g;
        }
      }
    }
  };
  // Head dims of whole vectors run unrolled (SmolLM2 and Llama-1B 64, Llama-8B 128), others
  // (MLA's latent rows) through the general code.
  if (D == VW) run(Rows<1>{});
  else if (D == 2 * VW) run(Rows<2>{});
  else if (D == 4 * VW) run(Rows<4>{});
  else if (D == 8 * VW) run(Rows<8>{});
  else run(Rows<0>{});
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "causal or tree-masked attention of packed query rows over paged fp32 KV (CPU)");
}
