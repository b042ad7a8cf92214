// y[M, out] = x[M, in] @ w[out, in]^T (+ bias) in fp32 for a few rows, each weight read once.
// See cpu_linear.py for why it exists and when the engine calls it.
//
// A tile is ROWS rows of x against 8 consecutive weight rows (8 outputs): every weight
// vector loaded feeds ROWS multiply-adds, the tile's 8 x ROWS accumulators stay in
// registers over the whole `in` loop, and the 8 dot products of a row are reduced together
// (three rounds of shuffles) into one 8-float store. The tiles of one thread walk its share
// of the weight's rows in memory order, so the weight is one sequential stream per thread.
#include "../kernel_api.h"
#include "../vec_math.h"
#include <torch/library.h>  // the op inductor calls in compiled graphs
#include <omp.h>

#include <algorithm>

#if defined(__AVX512F__)
constexpr int ROWS = 3;  // 24 accumulators + 3 x vectors + 1 weight vector of 32 registers
#else
constexpr int ROWS = 1;  // 8 accumulators of 16 registers
#endif
constexpr int COLS = 8;
// Each block prefetches, line by line as its tiles go (they share the work, see block()),
// the block PREFETCH_AHEAD blocks further into L2: a block's 8 rows are 8 short streams
// (2-6 KB each) that the hardware prefetcher barely catches, so without it the more rows a
// tile computed per line loaded, the longer the memory stream sat idle (Xeon, 2 threads, the
// 113 MB lm_head: one row 3.89 -> 3.76 ms, 3 rows 4.99 -> 4.00, 5 rows 5.46 -> 4.56; 1 or 2
// blocks ahead, or into L1, were slower).
constexpr int PREFETCH_AHEAD = 4;
// Rows of x per pass over the weight when there are many: a chunk (CHUNK_ROWS x in floats,
// up to 768 KB) stays in L2 while every block of 8 weight rows reads it.
#ifndef CHUNK_ROWS
#define CHUNK_ROWS 128
#endif
// R rows of x [R, in] (row stride in) against w [8, in] -> y[r, 0..8) (row stride out);
// pf: a block to prefetch meanwhile (its rows c0..c1), or nullptr.
template <int R>
static inline void tile(const float* x, const float* w, const float* bias, float* y,
                        int64_t in, int64_t out, const float* pf, int c0, int c1) {
  vec acc[R][COLS] = {};
  for (int64_t k = 0; k < in; k += VW) {
    if (pf)
      for (int c = c0; c < c1; ++c) __builtin_prefetch(pf + c * in + k, 0, 2);
    vec xv[R];
    for (int r = 0; r < R; ++r) xv[r] = loadu(x + r * in + k);
    for (int c = 0; c < COLS; ++c) {
      vec wv = loadu(w + c * in + k);
      asm("" : "+v"(wv));  // one load into a register for all R rows, not a load per FMA
      for (int r = 0; r < R; ++r) acc[r][c] += xv[r] * wv;
    }
  }
  vec8 b = {};
  if (bias) __builtin_memcpy(&b, bias, sizeof b);
  for (int r = 0; r < R; ++r) {
    const vec8 s = reduce8(acc[r]) + b;
    __builtin_memcpy(y + r * out, &s, sizeof s);
  }
}

// Every row of x against one block of 8 weight rows (re-read from L1 by later row groups).
// Each of the block's tiles prefetches its share of the block ahead, so the memory stream
// keeps going while the later tiles compute from cache (EPYC, 2 threads, a whole SmolLM2
// step's products: 8 rows 25.7 -> 22.9 ms, 16 rows 30.0 -> 23.8 against the first tile
// prefetching it all; 1-3 rows, a single tile, unchanged).
static void block(const float* x, int64_t m, const float* w, const float* bias, float* y,
                  int64_t in, int64_t out, const float* pf) {
  const int tiles = static_cast<int>((m + ROWS - 1) / ROWS);
  int j = 0;
  int64_t r = 0;
  for (; r + ROWS <= m; r += ROWS, ++j)
    tile<ROWS>(x + r * in, w, bias, y + r * out, in, out, pf, j * COLS / tiles,
               (j + 1) * COLS / tiles);
  const int c0 = j * COLS / tiles, c1 = (j + 1) * COLS / tiles;
  if (m - r == 1) tile<1>(x + r * in, w, bias, y + r * out, in, out, pf, c0, c1);
  if constexpr (ROWS > 2) {
    if (m - r == 2) tile<2>(x + r * in, w, bias, y + r * out, in, out, pf, c0, c1);
  }
}

// x [M, in], w [out, in], bias [out] or None, all fp32 and contiguous; in % VW == 0 and
// out % 8 == 0 (cpu_linear.py checks) -> [M, out]. `threads` split the weight's rows.
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w,
                           const c10::optional<at::Tensor>& bias, int64_t threads) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, in], w [out, in]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "contiguous x and w");
  const int64_t m = x.size(0), in = x.size(1), out = w.size(0);
  TORCH_CHECK(in % VW == 0 && out % COLS == 0, "in % ", VW, " and out % ", COLS, " must be 0");
  const float* bp = bias_data(bias, out);
  auto y = at::empty({m, out}, x.options());
  if (m == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = out / COLS;
  // Below ~16 blocks per thread a thread's start costs more than its share of the work.
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, blocks / 16)));
  const int64_t chunk = std::min<int64_t>(m, CHUNK_ROWS);
#pragma omp parallel num_threads(nt)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t b0 = blocks * t / n, b1 = blocks * (t + 1) / n;
    // Threads own output columns, so they go through the row chunks without waiting for
    // each other; a chunk re-reads the thread's share of the weight (from L3 when it fits).
    for (int64_t r0 = 0; r0 < m; r0 += chunk) {
      const int64_t mr = std::min(chunk, m - r0);
      for (int64_t b = b0; b < b1; ++b)
        block(xp + r0 * in, mr, wp + b * COLS * in, bp ? bp + b * COLS : nullptr,
              yp + r0 * out + b * COLS, in, out,
              b + PREFETCH_AHEAD < b1 ? wp + (b + PREFETCH_AHEAD) * COLS * in : nullptr);
    }
  }
  return y;
}

// Registered with the dispatcher too, so that compiled graphs call it without a trip through
// Python (a Python custom op cost ~20 us a call: ~2.4 ms of a 121-product SmolLM2 step).
TORCH_LIBRARY_FRAGMENT(specheads, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias, int threads) -> Tensor");
}
TORCH_LIBRARY_IMPL(specheads, CPU, m) { m.impl("small_linear", &small_linear); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "y = x @ w.T (+ bias) for a few fp32 rows");
  m.def("vector_width", [] { return VW; }, "floats per vector this build uses");
}
