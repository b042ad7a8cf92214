// Vector helpers shared by the engine's C++ CPU kernels (attention/cpu_causal.cpp,
// model/cpu_fused.cpp): GCC vector types of the machine's widest fp32 vector, unaligned
// loads and stores, and 2^x.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector
#else
constexpr int VW = 8;
#endif

typedef float vec __attribute__((vector_size(VW * 4)));
typedef int ivec __attribute__((vector_size(VW * 4)));

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
