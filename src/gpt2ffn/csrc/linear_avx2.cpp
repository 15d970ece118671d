// The AVX2 build of linear.h: two 256-bit registers per 16 lanes, for CPUs without AVX-512.
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include <cstdint>

namespace gpt2ffn {
namespace avx2 {
struct V { __m256 lo, hi; };
static inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline __m256 bf16x8(const uint16_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
static inline V vload_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
static inline __m256 i8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline V vload_i8(const int8_t* p) { return {i8x8(p), i8x8(p + 8)}; }
static inline void vload_u4(const uint8_t* p, V& lo, V& hi) {
  const __m256i mask = _mm256_set1_epi32(15);
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(a, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(b, mask))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
}
static inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline V vadd(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
}  // namespace avx2
}  // namespace gpt2ffn

#define ISA avx2
#include "linear_impl.h"
