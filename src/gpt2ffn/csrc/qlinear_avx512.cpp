// The AVX-512 VNNI build of qlinear_impl.h: vpdpbusd, 16 lanes x 4 bytes per instruction.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")
#include "vec_avx512.h"

namespace gpt2ffn {
namespace avx512 {
struct VI { __m512i v; };
struct W { __m512i v; };
constexpr int32_t I8_OFFSET = 128;  // the stored bytes are q + 128, which vpdpbusd reads unsigned
constexpr const char* INT8_DOT = "vpdpbusd (AVX-512 VNNI)";
constexpr int QMR = 4, QNB = 2, QNB1 = 4;
static inline W wload_i8(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
static inline VI dot_i8(VI acc, const W& w, int32_t x4) { return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(x4))}; }
static inline void wload_i4(const uint8_t* p, W& lo, W& hi) {
  const __m512i b = _mm512_loadu_si512(p), m = _mm512_set1_epi8(15);
  lo = {_mm512_and_si512(b, m)};
  hi = {_mm512_and_si512(_mm512_srli_epi16(b, 4), m)};
}
static inline VI dot_i4(VI acc, const W& lo, const W& hi, int32_t xlo, int32_t xhi) {
  return {_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc.v, lo.v, _mm512_set1_epi32(xlo)), hi.v, _mm512_set1_epi32(xhi))};
}
static inline VI viset1(int32_t x) { return {_mm512_set1_epi32(x)}; }
static inline V vcvt(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
static inline void quantize_group16(const float* x, int8_t* q, int64_t G, float& d, int32_t& sum) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t i = 0; i < G; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  d = _mm512_reduce_max_ps(m) / 127.0f;
  const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
  __m512i s = _mm512_setzero_si512();
  for (int64_t i = 0; i < G; i += 16) {
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), id),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i v = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
    s = _mm512_add_epi32(s, v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(v));
  }
  sum = _mm512_reduce_add_epi32(s);
}
}  // namespace avx512
}  // namespace gpt2ffn

#define ISA avx512
#include "qlinear_impl.h"
