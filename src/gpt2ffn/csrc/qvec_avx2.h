// The integer helpers of qlinear_impl.h on two 256-bit registers per 16 lanes, in namespace gpt2ffn::ISA:
// with AVX-VNNI (__AVXVNNI__, set by the file's target pragma) vpdpbusd as on AVX-512; without it the
// maddubs path, llama.cpp's for q8_0 / q4_0 on AVX2: int8 weights by the sign trick (|q| unsigned times x
// with q's sign), int4 nibbles directly as the unsigned operand.
#pragma once
#include "vec_avx2.h"

namespace gpt2ffn {
namespace ISA {
using namespace gpt2ffn::avx2;
struct VI { __m256i lo, hi; };
struct W { __m256i lo, hi; };
constexpr int QMR = 2, QNB = 2, QNB1 = 2;
static inline VI vizero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline void wload_i4(const uint8_t* p, W& lo, W& hi) {
  const __m256i m = _mm256_set1_epi8(15), a = load32(p), b = load32(p + 32);
  lo = {_mm256_and_si256(a, m), _mm256_and_si256(b, m)};
  hi = {_mm256_and_si256(_mm256_srli_epi16(a, 4), m), _mm256_and_si256(_mm256_srli_epi16(b, 4), m)};
}
#ifdef __AVXVNNI__
constexpr int32_t I8_OFFSET = 128;  // the stored bytes are q + 128, which vpdpbusd reads unsigned
static inline __m256i dot4(__m256i acc, __m256i u, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, u, x); }
static inline W wload_i8(const uint8_t* p) { return {load32(p), load32(p + 32)}; }
static inline VI dot_i8(VI acc, const W& w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {dot4(acc.lo, w.lo, x), dot4(acc.hi, w.hi, x)};
}
static inline __m256i dot_u4(__m256i acc, __m256i lo, __m256i hi, __m256i xl, __m256i xh) {
  return dot4(dot4(acc, lo, xl), hi, xh);
}
#else
constexpr int32_t I8_OFFSET = 0;  // dot_i8 sums q * x itself
static inline W wload_i8(const uint8_t* p) {  // the stored q + 128 back to q: flip the top bit
  const __m256i f = _mm256_set1_epi8(static_cast<char>(0x80));
  return {_mm256_xor_si256(load32(p), f), _mm256_xor_si256(load32(p + 32), f)};
}
// |q| <= 127 and |x| <= 127: each 16-bit pair sum of maddubs is at most 32258, no saturation
static inline __m256i dot_s8(__m256i acc, __m256i q, __m256i x) {
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
static inline VI dot_i8(VI acc, const W& w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {dot_s8(acc.lo, w.lo, x), dot_s8(acc.hi, w.hi, x)};
}
// q <= 15, |x| <= 127: a pair sum is at most 3810, so the low and high nibbles' add in 16 bits
static inline __m256i dot_u4(__m256i acc, __m256i lo, __m256i hi, __m256i xl, __m256i xh) {
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif
static inline VI dot_i4(VI acc, const W& lo, const W& hi, int32_t xlo, int32_t xhi) {
  const __m256i xl = _mm256_set1_epi32(xlo), xh = _mm256_set1_epi32(xhi);
  return {dot_u4(acc.lo, lo.lo, hi.lo, xl, xh), dot_u4(acc.hi, lo.hi, hi.hi, xl, xh)};
}
static inline V vcvt(VI a, int32_t minus) {
  const __m256i s = _mm256_set1_epi32(minus);
  return {_mm256_cvtepi32_ps(_mm256_sub_epi32(a.lo, s)), _mm256_cvtepi32_ps(_mm256_sub_epi32(a.hi, s))};
}
}  // namespace ISA
}  // namespace gpt2ffn

#include "qlinear_impl.h"
