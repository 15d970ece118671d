// 16-lane float vectors for AVX-512 (one 512-bit register), shared by linear_avx512.cpp and
// qlinear_avx512.cpp. Include after the file's target pragma.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace gpt2ffn {
namespace avx512 {
struct V { __m512 v; };
static inline V vzero() { return {_mm512_setzero_ps()}; }
static inline V vset1(float x) { return {_mm512_set1_ps(x)}; }
static inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline V vload_f16(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
static inline V vload_bf16(const uint16_t* p) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(h, 16))};
}
static inline V vload_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// 16 bytes of nibble pairs -> (q - 8) as floats, low and high nibbles, through a 16-entry table (vpermps).
static inline void vload_s4(const uint8_t* p, V& lo, V& hi) {
  const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = {_mm512_permutexvar_ps(b, table)};  // vpermps reads the index's low 4 bits
  hi = {_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table)};
}
static inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline V vsub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline V vdiv(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
static inline V vmax(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline V vmin(V a, V b) { return {_mm512_min_ps(a.v, b.v)}; }
static inline V vround(V a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// 2^n for whole n in [-126, 127], built as the float's exponent field
static inline V vexp2i(V n) {
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
}
static inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a.v); }
// rounded to the nearest even fp16, as torch's float -> half copy
static inline void vstore_f16(uint16_t* p, V a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline float vsum(V a) { return _mm512_reduce_add_ps(a.v); }
static inline float vhmax(V a) { return _mm512_reduce_max_ps(a.v); }
// a >= t ? x : other, lane by lane (a NaN: other)
static inline V vwhere_ge(V a, V t, V x, V other) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, t.v, _CMP_GE_OQ), other.v, x.v)};
}
// truncated to whole numbers, stored as 16 uint16 (a in [0, 65535])
static inline void vstore_u16(uint16_t* p, V a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_cvttps_epi32(a.v)));
}
// r[i][j] -> r[j][i]: a 16 x 16 block transposed in registers (pairs, then quads within 128 bits, then the
// 128-bit lanes), 64 shuffles where a scalar copy takes 256 loads and stores
static inline void vtranspose16(V (&r)[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i].v, r[i + 1].v);
    t[i + 1] = _mm512_unpackhi_ps(r[i].v, r[i + 1].v);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; i++) {
    r[i].v = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8].v = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}
constexpr int VREGS = 32;  // vector registers of 16 lanes
constexpr int ATT_MQ = 8;  // queries a causal-attention block (linear_impl.h): 8 x 2 accumulators
}  // namespace avx512
}  // namespace gpt2ffn
