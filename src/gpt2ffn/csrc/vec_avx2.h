// 16-lane float vectors for AVX2 (two 256-bit registers), shared by the AVX2 builds (linear_avx2.cpp and
// the integer kernels' qlinear_avx2.cpp / qlinear_avxvnni.cpp). Include after the file's target pragma.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace gpt2ffn {
namespace avx2 {
struct V { __m256 lo, hi; };
static inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline V vload_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
static inline __m256 bf16x8(const uint16_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
static inline V vload_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
static inline __m256 i8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline V vload_i8(const int8_t* p) { return {i8x8(p), i8x8(p + 8)}; }
// 16 bytes of nibble pairs -> (q - 8) as floats, low and high nibbles.
static inline void vload_s4(const uint8_t* p, V& lo, V& hi) {
  const __m256i mask = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  lo = {_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(a, mask), eight)),
        _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, mask), eight))};
  hi = {_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(a, 4), eight)),
        _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight))};
}
static inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline V vadd(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline V vsub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline V vdiv(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
static inline V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline V vmin(V a, V b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
static inline V vround(V a) {
  constexpr int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, r), _mm256_round_ps(a.hi, r)};
}
static inline __m256 exp2i8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
// 2^n for whole n in [-126, 127], built as the float's exponent field
static inline V vexp2i(V n) { return {exp2i8(n.lo), exp2i8(n.hi)}; }
static inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
// rounded to the nearest even fp16, as torch's float -> half copy
static inline void vstore_f16(uint16_t* p, V a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8),
                   _mm256_cvtps_ph(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline float vsum(V a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
static inline float vhmax(V a) {
  const __m256 s = _mm256_max_ps(a.lo, a.hi);
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}
// a >= t ? x : other, lane by lane (a NaN: other)
static inline V vwhere_ge(V a, V t, V x, V other) {
  return {_mm256_blendv_ps(other.lo, x.lo, _mm256_cmp_ps(a.lo, t.lo, _CMP_GE_OQ)),
          _mm256_blendv_ps(other.hi, x.hi, _mm256_cmp_ps(a.hi, t.hi, _CMP_GE_OQ))};
}
// truncated to whole numbers, stored as 16 uint16 (a in [0, 65535])
static inline void vstore_u16(uint16_t* p, V a) {
  const __m256i lo = _mm256_cvttps_epi32(a.lo), hi = _mm256_cvttps_epi32(a.hi);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);  // packus works per 128 bits
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}
// An 8 x 8 block of 8-lane rows transposed in registers (pairs, quads, then the 128-bit halves).
static inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
// r[i][j] -> r[j][i] for 16 rows of 16 lanes: four 8 x 8 blocks, the off-diagonal two swapped.
static inline void vtranspose16(V (&r)[16]) {
  __m256 a[8], b[8], c[8], d[8];  // rows 0-7 lanes 0-7, rows 8-15 lanes 0-7, rows 0-7 lanes 8-15, rows 8-15 lanes 8-15
  for (int i = 0; i < 8; i++) a[i] = r[i].lo, b[i] = r[i + 8].lo, c[i] = r[i].hi, d[i] = r[i + 8].hi;
  transpose8(a), transpose8(b), transpose8(c), transpose8(d);
  for (int i = 0; i < 8; i++) r[i] = {a[i], b[i]}, r[i + 8] = {c[i], d[i]};
}
constexpr int VREGS = 8;  // 16-lane vectors the 16 ymm registers hold
constexpr int ATT_MQ = 2;  // queries a causal-attention block (linear_impl.h): 2 x 4 x 2 registers
}  // namespace avx2
}  // namespace gpt2ffn
