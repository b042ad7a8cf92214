// y[M, out] = x[M, in] @ w[out, in]^T (+ bias) in fp32, w read from a 4- or 8-bit block code
// that reproduces its fp32 values exactly (GGUF's Q4_1 / Q8_0, which the embedded target
// ships; cpu_quant.py proves the code exact before using it). See cpu_quant.py for why.
//
// Same tiling as cpu_linear.cpp (a tile is ROWS rows of x against 8 weight rows, the 8 x ROWS
// accumulators stay in registers, the 8 dot products of a row are reduced together), but each
// weight vector is decoded from its block in registers: Q4_1 w = d * q + m (q 4-bit), Q8_0
// w = d * q (q int8), per block of 32 weights of one row. d * q is exact in fp32 (an fp16
// d times at most 8 bits), so one fused multiply-add gives the same float the dequantized
// weight holds, and every row's products run in the same order whatever M is.
#include "../kernel_api.h"
#include "../vec_math.h"
#include <torch/library.h>  // the op inductor calls in compiled graphs
#include <omp.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define SPECHEADS_X86_DECODE 1
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
constexpr int ROWS = 3;
constexpr int WIDE_ROWS = 6;  // 24 accumulators + 6 x vectors + 1 weight vector of 32 registers
#else
constexpr int ROWS = 1;
constexpr int WIDE_ROWS = 0;
#endif
constexpr int COLS = 8;
constexpr int BLOCK = 32;  // weights per block
constexpr int PREFETCH_AHEAD = 4;
#ifndef CHUNK_ROWS
#define CHUNK_ROWS 128
#endif

// Q4_1: a block is 16 bytes, byte j holding weight j (low nibble) and j + 16 (high nibble),
// and two floats (d, m). Vector v of the block (weights v*VW .. v*VW + VW) is the low or
// high nibbles of VW consecutive bytes.
struct Q4 {
  static constexpr int BYTES = BLOCK / 2, SCALES = 2;
  static inline vec decode(const uint8_t* q, const float* s, int v) {
    constexpr int per_half = 16 / VW;  // vectors per nibble half
#if defined(__AVX512F__)
    __m512i n = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    n = v < per_half ? _mm512_and_si512(n, _mm512_set1_epi32(15)) : _mm512_srli_epi32(n, 4);
    return (vec)_mm512_fmadd_ps(_mm512_cvtepi32_ps(n), _mm512_set1_ps(s[0]), _mm512_set1_ps(s[1]));
#elif defined(SPECHEADS_X86_DECODE)
    __m256i n = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (v % per_half) * VW)));
    n = v < per_half ? _mm256_and_si256(n, _mm256_set1_epi32(15)) : _mm256_srli_epi32(n, 4);
    return (vec)_mm256_fmadd_ps(_mm256_cvtepi32_ps(n), _mm256_set1_ps(s[0]), _mm256_set1_ps(s[1]));
#else  // any other CPU: the compiler's vectors
    typedef uint8_t u8v __attribute__((vector_size(VW)));
    u8v b;
    __builtin_memcpy(&b, q + (v % per_half) * VW, sizeof b);
    ivec n = __builtin_convertvector(b, ivec);
    n = v < per_half ? (n & 15) : (n >> 4);
    return __builtin_convertvector(n, vec) * s[0] + s[1];
#endif
  }
};

// Q8_0: a block is 32 signed bytes, weight j in byte j, and one float d.
struct Q8 {
  static constexpr int BYTES = BLOCK, SCALES = 1;
  static inline vec decode(const uint8_t* q, const float* s, int v) {
#if defined(__AVX512F__)
    const __m512i n = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + v * VW)));
    return (vec)_mm512_mul_ps(_mm512_cvtepi32_ps(n), _mm512_set1_ps(s[0]));
#elif defined(SPECHEADS_X86_DECODE)
    const __m256i n = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + v * VW)));
    return (vec)_mm256_mul_ps(_mm256_cvtepi32_ps(n), _mm256_set1_ps(s[0]));
#else
    typedef int8_t i8v __attribute__((vector_size(VW)));
    i8v b;
    __builtin_memcpy(&b, q + v * VW, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, ivec), vec) * s[0];
#endif
  }
};

// Already decoded fp32 rows (a block's scratch copy): "bytes" of a block are its 32 floats.
struct F32 {
  static constexpr int BYTES = BLOCK * 4, SCALES = 0;
  static inline vec decode(const uint8_t* q, const float*, int v) {
    return loadu(reinterpret_cast<const float*>(q) + v * VW);
  }
};

// The tiles' epilogue: each row's NC dot products reduced together (+ bias) -> y[r, 0..NC).
template <int R, int NC>
static inline void store(const vec (&acc)[R][COLS], const float* bias, float* y, int64_t out) {
  vec8 bv = {};
  if (bias) __builtin_memcpy(&bv, bias, NC * sizeof(float));
  for (int r = 0; r < R; ++r) {
    const vec8 t = reduce8(acc[r]) + bv;
    __builtin_memcpy(y + r * out, &t, NC * sizeof(float));
  }
}

// R rows of x [R, in] against NC (8 or 4) coded weight rows (q: row stride qrow bytes; s: row
// stride srow floats) -> y[r, 0..NC). pf: the same rows of the block to prefetch meanwhile,
// or nullptr. A 4-row-wide tile leaves the other 4 accumulators of reduce8 at zero: its lane
// folds never mix columns, so each output is summed in the same order either way.
template <class F, int R, int NC = COLS>
static inline void tile(const float* x, const uint8_t* q, const float* s, const float* bias,
                        float* y, int64_t in, int64_t out, int64_t qrow, int64_t srow,
                        const uint8_t* pf) {
  vec acc[R][COLS] = {};
  // One loop over k in vectors, as cpu_linear's tile runs it: the same products summed in
  // the same order, so both kernels give the same floats.
  for (int64_t k = 0; k < in; k += VW) {
    const int64_t b = k / BLOCK;
    const int v = static_cast<int>(k % BLOCK) / VW;
    if (pf && v == 0 && (b * F::BYTES) % 64 == 0)
      for (int c = 0; c < NC; ++c) __builtin_prefetch(pf + c * qrow + b * F::BYTES, 0, 2);
    vec xv[R];
    for (int r = 0; r < R; ++r) xv[r] = loadu(x + r * in + k);
    for (int c = 0; c < NC; ++c) {
      vec wv = F::decode(q + c * qrow + b * F::BYTES, s + c * srow + b * F::SCALES, v);
      asm("" : "+v"(wv));  // decoded once for all R rows
      for (int r = 0; r < R; ++r) acc[r][c] += xv[r] * wv;
    }
  }
  store<R, NC>(acc, bias, y, out);
}

#if defined(__AVX512F__)
// Q4_1 with a block of 32 weights = two vectors: one load and one widening of its 16 bytes
// give both (low nibbles: weights 0-15, high: 16-31), where tile<Q4> widens them twice, and d
// and m are broadcast once. Each accumulator still adds weight k before weight k + 16, so the
// floats are tile's to the bit.
template <int R, int NC>
static inline void tile_q4(const float* x, const uint8_t* q, const float* s, const float* bias,
                           float* y, int64_t in, int64_t out, int64_t qrow, int64_t srow,
                           const uint8_t* pf) {
  static_assert(VW * 2 == BLOCK, "a block is two vectors");
  vec acc[R][COLS] = {};
  const __m512i low = _mm512_set1_epi32(15);
  for (int64_t b = 0; b < in / BLOCK; ++b) {
    if (pf && (b * Q4::BYTES) % 64 == 0)
      for (int c = 0; c < NC; ++c) __builtin_prefetch(pf + c * qrow + b * Q4::BYTES, 0, 2);
    vec x0[R], x1[R];
    for (int r = 0; r < R; ++r) {
      x0[r] = loadu(x + r * in + b * BLOCK);
      x1[r] = loadu(x + r * in + b * BLOCK + VW);
    }
    for (int c = 0; c < NC; ++c) {
      const __m512i n = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * qrow + b * Q4::BYTES)));
      const float* sc = s + c * srow + b * Q4::SCALES;
      const __m512 d = _mm512_set1_ps(sc[0]), m = _mm512_set1_ps(sc[1]);
      vec w0 = (vec)_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(n, low)), d, m);
      vec w1 = (vec)_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(n, 4)), d, m);
      asm("" : "+v"(w0), "+v"(w1));
      // The barrier keeps the two adds apart: -fassociative-math would otherwise sum the two
      // products first, which cpu_linear's tile (one add per vector) never does.
      for (int r = 0; r < R; ++r) {
        acc[r][c] += x0[r] * w0;
        asm("" : "+v"(acc[r][c]));
      }
      for (int r = 0; r < R; ++r) acc[r][c] += x1[r] * w1;
    }
  }
  store<R, NC>(acc, bias, y, out);
}

#endif

// R rows (4..WIDE_ROWS) against a block of 8 coded rows as two 4-row-wide tiles: R x 4
// accumulators fit in registers where R x 8 do not, and each weight vector is still decoded
// once for all R rows (the x rows are read twice, from L1).
template <class F, int R>
static inline void halves(const float* x, const uint8_t* q, const float* s, const float* bias,
                          float* y, int64_t in, int64_t out, int64_t qrow, int64_t srow,
                          const uint8_t* pf) {
  constexpr int H = COLS / 2;
  tile<F, R, H>(x, q, s, bias, y, in, out, qrow, srow, pf);
  tile<F, R, H>(x, q + H * qrow, s + H * srow, bias ? bias + H : nullptr, y + H, in, out, qrow,
                srow, pf ? pf + H * qrow : nullptr);
}

// Every row of x against one block of 8 coded weight rows. Up to ROWS rows (one tile), and up
// to WIDE_ROWS as two 4-row-wide tiles, decode each weight vector in registers; more rows would
// decode it once per tile, so the block is decoded once into `scratch` (8 rows, L1/L2-resident)
// and the tiles read it as fp32.
template <class F>
static void block(const float* x, int64_t m, const uint8_t* q, const float* s, const float* bias,
                  float* y, int64_t in, int64_t out, int64_t qrow, int64_t srow,
                  const uint8_t* pf, std::vector<float>& scratch) {
#if defined(__AVX512F__)
  // 1-2 rows: tile_q4 (one widening per block; measured 7.6 vs 8.4 ms for a whole SmolLM2
  // step's products at 1 row). From 3 rows its second set of x vectors costs registers the
  // accumulators need (5 rows 17.4 vs 12.6 ms), so tile / halves serve.
  if constexpr (std::is_same_v<F, Q4>) {
    if (m == 1) return tile_q4<1, COLS>(x, q, s, bias, y, in, out, qrow, srow, pf);
    if (m == 2) return tile_q4<2, COLS>(x, q, s, bias, y, in, out, qrow, srow, pf);
  }
#endif
  if (m <= ROWS) {
    if (m == 1) tile<F, 1>(x, q, s, bias, y, in, out, qrow, srow, pf);
    if constexpr (ROWS > 1) {
      if (m == 2) tile<F, 2>(x, q, s, bias, y, in, out, qrow, srow, pf);
    }
    if constexpr (ROWS > 2) {
      if (m == 3) tile<F, 3>(x, q, s, bias, y, in, out, qrow, srow, pf);
    }
    return;
  }
  if constexpr (WIDE_ROWS > ROWS) {
    if (m <= WIDE_ROWS) {
      if (m == 4) halves<F, 4>(x, q, s, bias, y, in, out, qrow, srow, pf);
      if (m == 5) halves<F, 5>(x, q, s, bias, y, in, out, qrow, srow, pf);
      if (m == 6) halves<F, 6>(x, q, s, bias, y, in, out, qrow, srow, pf);
      return;
    }
  }
  scratch.resize(COLS * in);
  float* w = scratch.data();
  for (int c = 0; c < COLS; ++c)
    for (int64_t b = 0; b < in / BLOCK; ++b)
      for (int v = 0; v < BLOCK / VW; ++v) {
        const vec wv = F::decode(q + c * qrow + b * F::BYTES, s + c * srow + b * F::SCALES, v);
        __builtin_memcpy(w + c * in + b * BLOCK + v * VW, &wv, sizeof wv);
      }
  if (pf)
    for (int c = 0; c < COLS; ++c)
      for (int64_t k = 0; k < qrow; k += 64) __builtin_prefetch(pf + c * qrow + k, 0, 2);
  const auto* wb = reinterpret_cast<const uint8_t*>(w);
  const int64_t frow = in * 4;
  int64_t r = 0;
  for (; r + ROWS <= m; r += ROWS)
    tile<F32, ROWS>(x + r * in, wb, nullptr, bias, y + r * out, in, out, frow, 0, nullptr);
  if (m - r == 1) tile<F32, 1>(x + r * in, wb, nullptr, bias, y + r * out, in, out, frow, 0, nullptr);
  if constexpr (ROWS > 2) {
    if (m - r == 2) tile<F32, 2>(x + r * in, wb, nullptr, bias, y + r * out, in, out, frow, 0, nullptr);
  }
}

template <class F>
static void run(const float* xp, int64_t m, const uint8_t* qp, const float* sp, const float* bp,
                float* yp, int64_t in, int64_t out, int64_t threads) {
  const int64_t qrow = in / BLOCK * F::BYTES, srow = in / BLOCK * F::SCALES;
  const int64_t blocks = out / COLS;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, blocks / 16)));
  const int64_t chunk = std::min<int64_t>(m, CHUNK_ROWS);
#pragma omp parallel num_threads(nt)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t b0 = blocks * t / n, b1 = blocks * (t + 1) / n;
    std::vector<float> scratch;
    for (int64_t r0 = 0; r0 < m; r0 += chunk) {
      const int64_t mr = std::min(chunk, m - r0);
      for (int64_t b = b0; b < b1; ++b)
        block<F>(xp + r0 * in, mr, qp + b * COLS * qrow, sp + b * COLS * srow,
                 bp ? bp + b * COLS : nullptr, yp + r0 * out + b * COLS, in, out, qrow, srow,
                 b + PREFETCH_AHEAD < b1 ? qp + (b + PREFETCH_AHEAD) * COLS * qrow : nullptr,
                 scratch);
    }
  }
}

// x [M, in] fp32; codes [out, in / 32 * bytes] uint8 (fmt 4: Q4_1, 16 bytes a block; fmt 8:
// Q8_0, 32); scales [out, in / 32 * (2 or 1)] fp32; bias [out] or None -> [M, out].
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        int64_t fmt, const c10::optional<at::Tensor>& bias, int64_t threads) {
  TORCH_CHECK(fmt == 4 || fmt == 8, "quant_linear: fmt 4 (Q4_1) or 8 (Q8_0)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "quant_linear: x [M, in] fp32, contiguous");
  const int64_t m = x.size(0), in = x.size(1), out = codes.size(0);
  const int64_t bytes = fmt == 4 ? Q4::BYTES : Q8::BYTES, ns = fmt == 4 ? Q4::SCALES : Q8::SCALES;
  TORCH_CHECK(in % BLOCK == 0 && out % COLS == 0, "quant_linear: in % 32 and out % 8 must be 0");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2 &&
                  codes.size(1) == in / BLOCK * bytes,
              "quant_linear: codes [out, in / 32 * ", bytes, "] uint8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == out * (in / BLOCK) * ns,
              "quant_linear: scales [out, in / 32 * ", ns, "] fp32");
  const float* bp = bias_data(bias, out);
  auto y = at::empty({m, out}, x.options());
  if (m == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (fmt == 4)
    run<Q4>(xp, m, qp, sp, bp, yp, in, out, threads);
  else
    run<Q8>(xp, m, qp, sp, bp, yp, in, out, threads);
  return y;
}

TORCH_LIBRARY_FRAGMENT(specheads, m) {
  m.def("quant_linear(Tensor x, Tensor codes, Tensor scales, int fmt, Tensor? bias, int threads) -> Tensor");
}
TORCH_LIBRARY_IMPL(specheads, CPU, m) { m.impl("quant_linear", &quant_linear); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "y = x @ w.T (+ bias), w exactly block-coded (Q4_1 / Q8_0)");
}
