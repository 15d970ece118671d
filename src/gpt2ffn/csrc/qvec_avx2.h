// The integer helpers of qlinear_impl.h on two 256-bit registers per 16 lanes, in namespace gpt2ffn::ISA:
// with AVX-VNNI (GPT2FFN_AVXVNNI, set by qlinear_avxvnni.cpp) vpdpbusd as on AVX-512; without it the
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
static inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline void wload_i4(const uint8_t* p, W& lo, W& hi) {
  const __m256i m = _mm256_set1_epi8(15), a = load32(p), b = load32(p + 32);
  lo = {_mm256_and_si256(a, m), _mm256_and_si256(b, m)};
  hi = {_mm256_and_si256(_mm256_srli_epi16(a, 4), m), _mm256_and_si256(_mm256_srli_epi16(b, 4), m)};
}
#ifdef GPT2FFN_AVXVNNI  // qlinear_avxvnni.cpp (a target pragma defines no feature macro)
constexpr int32_t I8_OFFSET = 128;  // the stored bytes are q + 128, which vpdpbusd reads unsigned
constexpr const char* INT8_DOT = "vpdpbusd (AVX-VNNI, 256-bit)";
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
constexpr const char* INT8_DOT = "vpmaddubsw + vpmaddwd (AVX2)";
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
static inline VI viset1(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
static inline V vcvt(VI a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
static inline void quantize_group16(const float* x, int8_t* q, int64_t G, float& d, int32_t& sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int64_t i = 0; i < G; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  d = _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1))) / 127.0f;
  const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  __m256i s = _mm256_setzero_si256();
  for (int64_t i = 0; i < G; i += 16) {
    __m256i v[2];
    for (int h = 0; h < 2; h++) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * h), id),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v[h] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
      s = _mm256_add_epi32(s, v[h]);
    }
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[1]), 0xD8);  // 16 x int16 in order
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i),
                     _mm_packs_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
  }
  __m128i u = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
  sum = _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1)));
}
}  // namespace ISA
}  // namespace gpt2ffn

#include "qlinear_impl.h"
