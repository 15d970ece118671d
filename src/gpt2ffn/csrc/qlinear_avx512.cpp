// The AVX-512 VNNI build of qlinear_impl.h: vpdpbusd, 16 lanes x 4 bytes per instruction.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")
#include "vec_avx512.h"

namespace gpt2ffn {
namespace avx512 {
struct VI { __m512i v; };
struct W { __m512i v; };
constexpr int32_t I8_OFFSET = 128;  // the stored bytes are q + 128, which vpdpbusd reads unsigned
constexpr const char* INT8_DOT = "vpdpbusd (AVX-512 VNNI)";
constexpr int QMR = 8, QNB = 2, QNB1 = 4;  // prefill's tiles: 8 rows (the rest: one of 4); decode's
static inline W wload_i8(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
static inline VI dot_i8(VI acc, const W& w, int32_t x4) {
  return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(x4))};
}
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
  const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
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

// 16 lane-vectors a[i] -> one whose lane i is op over a[i]'s 16 lanes: four rounds that each halve the lanes
// a vector covers (two vpermt2 and one op per pair of vectors), 45 instructions for 16 reductions.
template <class T, class Op, class Perm>
static inline T reduce16(T (&a)[16], Op op, Perm perm) {
  alignas(64) static const int32_t idx[4][2][16] = {
      {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
       {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
      {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
       {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}},
      {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
       {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}},
      {{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
       {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}}};
  for (int level = 0, n = 16; level < 4; level++, n /= 2) {
    const __m512i lo = _mm512_load_si512(idx[level][0]), hi = _mm512_load_si512(idx[level][1]);
    for (int i = 0; i < n / 2; i++) a[i] = op(perm(a[2 * i], lo, a[2 * i + 1]), perm(a[2 * i], hi, a[2 * i + 1]));
  }
  return a[0];
}

// 16 groups of 32 activations (x[0..511]) quantized at once, the same IEEE operations as quantize_group16 on
// each (max|x|, d = max / 127, 1 / d, round to nearest even, clamp, sum), with each group's horizontal max and
// sum done 16 at a time (reduce16) and d and 1 / d one vector division each, for 16 groups. The same bits for
// finite x (tested against the definition, _C.quantize_activations); a NaN's group comes out as garbage in every
// build, though not the same garbage (max takes its operands in another order here).
#define GPT2FFN_QUANTIZE_16X32
static inline void quantize_16x32(const float* x, int8_t* q, float* d, int32_t* sum) {
  __m512 m[16];
  for (int g = 0; g < 16; g++)
    m[g] = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + 32 * g)), _mm512_abs_ps(_mm512_loadu_ps(x + 32 * g + 16)));
  const __m512 amax = reduce16(m, [](__m512 u, __m512 v) { return _mm512_max_ps(u, v); },
                               [](__m512 u, __m512i i, __m512 v) { return _mm512_permutex2var_ps(u, i, v); });
  const __m512 dv = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
  const __mmask16 nz = _mm512_cmp_ps_mask(dv, _mm512_setzero_ps(), _CMP_NEQ_UQ);  // d != 0, as the scalar test
  const __m512 idv = _mm512_maskz_div_ps(nz, _mm512_set1_ps(1.0f), dv);  // 0 where d is 0
  _mm512_storeu_ps(d, dv);
  const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
  __m512i s[16];
  for (int g = 0; g < 16; g++) {
    const __m512 id = _mm512_permutexvar_ps(_mm512_set1_epi32(g), idv);
    __m512i v[2];
    for (int h = 0; h < 2; h++) {
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * g + 16 * h), id),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v[h] = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * g + 16 * h), _mm512_cvtepi32_epi8(v[h]));
    }
    s[g] = _mm512_add_epi32(v[0], v[1]);
  }
  auto add = [](__m512i u, __m512i v) { return _mm512_add_epi32(u, v); };
  auto permute = [](__m512i u, __m512i i, __m512i v) { return _mm512_permutex2var_epi32(u, i, v); };
  _mm512_storeu_si512(sum, reduce16(s, add, permute));
}
}  // namespace avx512
}  // namespace gpt2ffn

#define ISA avx512
#include "qlinear_impl.h"
