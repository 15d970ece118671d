// The AVX-512 VNNI build of qlinear_impl.h: vpdpbusd, 16 lanes x 4 bytes per instruction.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")
#include "vec_avx512.h"

namespace gpt2ffn {
namespace avx512 {
struct VI { __m512i v; };
struct W { __m512i v; };
constexpr int32_t I8_OFFSET = 128;  // the stored bytes are q + 128, which vpdpbusd reads unsigned
constexpr int QMR = 4, QNB = 2, QNB1 = 4;
static inline VI vizero() { return {_mm512_setzero_si512()}; }
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
static inline V vcvt(VI a, int32_t minus) { return {_mm512_cvtepi32_ps(_mm512_sub_epi32(a.v, _mm512_set1_epi32(minus)))}; }
}  // namespace avx512
}  // namespace gpt2ffn

#define ISA avx512
#include "qlinear_impl.h"
