// The vector helpers shared by metrale's CPU kernels (`cpu_moe.cpp`, `cpu_attention.cpp`): one
// float vector type `vec` of W lanes and the few operations the kernels use on it, for the ISA
// the library is compiled for (`cpu_kernels.FLAGS`):
//
//   AVX-512 (__AVX512F__, -mavx512f -mavx512dq -mfma): __m512, W = 16, masks are __mmask16
//   AVX2 + FMA (__AVX2__ and __FMA__, -mavx2 -mfma):   __m256, W = 8, masks are lanes of all ones
//
// Each operation is the same IEEE single-precision operation on every lane in both (fused
// multiply-add, add, multiply, divide, max, round to nearest even), so the kernels, written
// in these operations with W-independent orders of summation, give the same bits on either ISA.
#pragma once

#include <immintrin.h>
#include <cstdint>

namespace metrale_simd {

#if defined(__AVX512F__)

constexpr int W = 16;  // float lanes in a vector
using vec = __m512;
using mask = __mmask16;

inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec set1(float x) { return _mm512_set1_ps(x); }
inline vec zero() { return _mm512_setzero_ps(); }
inline vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }  // a·b + c, one rounding
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec div(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec min(vec a, vec b) { return _mm512_min_ps(a, b); }
inline vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec round(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec pow2i(vec k) {  // 2^k for whole k in [-126, 127], built in the exponent bits
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23));
}
inline float reduce_max(vec v) { return _mm512_reduce_max_ps(v); }

// lanes [0, left) of a vector (none if left <= 0, all if left >= W)
inline mask tail(int64_t left) {
  return left >= W ? static_cast<mask>(0xFFFF) : left <= 0 ? static_cast<mask>(0) : static_cast<mask>((1u << left) - 1);
}
// W bfloat16 values (their bits) as floats: each one's 16 bits are a float's upper half, exactly
inline vec load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline vec maskz_load(mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }  // no access off the mask
inline vec maskz(mask m, vec v) { return _mm512_maskz_mov_ps(m, v); }                 // v on the mask, else 0
inline vec mask_max(vec a, mask m, vec b) { return _mm512_mask_max_ps(a, m, a, b); }  // max(a, b) on the mask, else a

#elif defined(__AVX2__) && defined(__FMA__)

constexpr int W = 8;  // float lanes in a vector
using vec = __m256;
using mask = __m256i;  // a lane of all ones is on, of zeros off

inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec set1(float x) { return _mm256_set1_ps(x); }
inline vec zero() { return _mm256_setzero_ps(); }
inline vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }  // a·b + c, one rounding
inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec div(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec min(vec a, vec b) { return _mm256_min_ps(a, b); }
inline vec max(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec round(vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec pow2i(vec k) {  // 2^k for whole k in [-126, 127], built in the exponent bits
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
}
inline float reduce_max(vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// lanes [0, left) of a vector (none if left <= 0, all if left >= W)
inline mask tail(int64_t left) {
  const int n = left >= W ? W : left <= 0 ? 0 : static_cast<int>(left);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
// W bfloat16 values (their bits) as floats: each one's 16 bits are a float's upper half, exactly
inline vec load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline vec maskz_load(mask m, const float* p) { return _mm256_maskload_ps(p, m); }  // no access off the mask
inline vec maskz(mask m, vec v) { return _mm256_and_ps(_mm256_castsi256_ps(m), v); }  // v on the mask, else 0
inline vec mask_max(vec a, mask m, vec b) {  // max(a, b) on the mask, else a
  return _mm256_blendv_ps(a, _mm256_max_ps(a, b), _mm256_castsi256_ps(m));
}

#else
#error "metrale's CPU kernels need AVX-512 (-mavx512f -mavx512dq -mfma) or AVX2 with FMA (-mavx2 -mfma)"
#endif

// e^x on every lane: Cody-Waite reduction by ln 2, degree-6 Taylor polynomial (|rel err| < 2e-7)
inline vec exp(vec x) {
  x = min(max(x, set1(-87.3f)), set1(88.3f));
  const vec k = round(mul(x, set1(1.44269504088896341f)));
  vec r = fmadd(k, set1(-0.693145751953125f), x);
  r = fmadd(k, set1(-1.428606765330187045e-06f), r);
  vec p = set1(1.0f / 720);
  p = fmadd(p, r, set1(1.0f / 120));
  p = fmadd(p, r, set1(1.0f / 24));
  p = fmadd(p, r, set1(1.0f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  return mul(p, pow2i(k));
}

}  // namespace metrale_simd
