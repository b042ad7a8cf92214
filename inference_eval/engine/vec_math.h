// Vector helpers shared by the engine's C++ CPU kernels (attention/cpu_causal.cpp,
// model/cpu_fused.cpp, model/cpu_linear.cpp, model/cpu_quant.cpp): GCC vector types of the
// machine's widest fp32 vector, unaligned loads and stores, 2^x, and the 8-way lane sum of
// the product kernels' tiles.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector
#else
constexpr int VW = 8;
#endif

typedef float vec __attribute__((vector_size(VW * 4)));
typedef int ivec __attribute__((vector_size(VW * 4)));
typedef float vec8 __attribute__((vector_size(32)));

inline vec loadu(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void storeu(float* p, vec v) { __builtin_memcpy(p, &v, sizeof v); }

// 2^t for e^t's Taylor series to t^6 (|t| <= 0.35: relative error ~1e-7) times 2^n.
inline vec exp2_parts(vec t, ivec n) {
  vec p = 1.f / 720 + t * (1.f / 5040);
  p = 1.f / 120 + t * p;
  p = 1.f / 24 + t * p;
  p = 1.f / 6 + t * p;
  p = 0.5f + t * p;
  p = 1.f + t * p;
  p = 1.f + t * p;
  const ivec bits = (n + 127) << 23;
  vec scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// 2^x for x <= 0 (softmax scores minus their maximum), exactly 0 below -126 (a masked
// score, -inf, included): n = trunc(x) >= x, 2^(x - n) = 2^g / sqrt(2), g in (-0.5, 0.5].
inline vec exp2v_nonpositive(vec x) {
  const auto below = x < -126.f;
  x = below ? vec{} - 126.f : x;
  const ivec n = __builtin_convertvector(x, ivec);
  const vec t = ((x - __builtin_convertvector(n, vec)) + 0.5f) * 0.6931471805599453f;
  return below ? vec{} : exp2_parts(t, n) * 0.7071067811865476f;
}

// 2^x for any x, clamped to [2^-126, 2^126]: n = floor(x), 2^(x - n) = 2^g * sqrt(2).
inline vec exp2v(vec x) {
  x = x < -126.f ? vec{} - 126.f : x;
  x = x > 126.f ? vec{} + 126.f : x;
  ivec n = __builtin_convertvector(x, ivec);  // toward zero
  n += __builtin_convertvector(n, vec) > x;   // true is -1: floor for negative x
  const vec t = ((x - __builtin_convertvector(n, vec)) - 0.5f) * 0.6931471805599453f;
  return exp2_parts(t, n) * 1.4142135623730951f;
}

// a[c] summed over its lanes, c = 0..7, as one vector: pairwise folds that keep, after round
// r, 2^r accumulators interleaved per vector (lane pattern a b / a b c d / a..h).
inline vec8 reduce8(const vec* a) {
#if defined(__AVX512F__)
#define F1(x, y) (__builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) + \
                  __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#define F2(x, y) (__builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) + \
                  __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
#define F3(x, y) (__builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) + \
                  __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
  const vec u = F3(F2(F1(a[0], a[1]), F1(a[2], a[3])), F2(F1(a[4], a[5]), F1(a[6], a[7])));
  return __builtin_shufflevector(u, u, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(u, u, 8, 9, 10, 11, 12, 13, 14, 15);
#else
#define F1(x, y) (__builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14) + \
                  __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15))
#define F2(x, y) (__builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + \
                  __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15))
#define F3(x, y) (__builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + \
                  __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15))
  return F3(F2(F1(a[0], a[1]), F1(a[2], a[3])), F2(F1(a[4], a[5]), F1(a[6], a[7])));
#endif
#undef F1
#undef F2
#undef F3
}
