// The integer helpers of qlinear_impl.h on two 256-bit registers per 16 lanes, in namespace gpt2ffn::ISA:
// with AVX-VNNI (GPT2FFN_AVXVNNI, set by qlinear_avxvnni.cpp) vpdpbusd as on AVX-512; without it the
// maddubs path, llama.cpp's for q8_0 / q4_0 on AVX2: int8 weights by the sign trick (|q| unsigned times x
// with q's sign) in decode's one row, by |x| against q ^ sign(x) in more rows (qgroup_xsign), int4 nibbles
// directly as the unsigned operand.
#pragma once
#include <algorithm>

#include "vec_avx2.h"
namespace gpt2ffn::ISA {
using namespace gpt2ffn::avx2;
}
#include "act_impl.h"

namespace gpt2ffn {
namespace ISA {
using namespace gpt2ffn::avx2;
struct VI { __m256i lo, hi; };
struct W { __m256i lo, hi; };
// Decode's one-row tile covers the whole super-block (4 blocks of 16 lanes), so each step's 256 bytes of weights
// are read in order. With 2 blocks a pass read 2 of every 4 lines and came back for the others, which the
// hardware prefetchers did not follow: on an AMD EPYC Zen 3 (AVX2 only) the 48 int8 layers of GPT-2 124M took
// 4.60-5.17 -> 3.87-4.43 ms a decode step, int4 2.81-2.97 -> 2.33-2.61 ms (benchmarks/decode_chain.py, 3 runs
// each, interleaved; the loads had stalled; the float sums now live on the stack, touched once a group).
constexpr int QNB1 = 4;  // decode's blocks of 16 lanes (prefill: qrun8 below)
constexpr int64_t XR = 8;  // rows a tile of int8 activations interleaves (qlinear_impl.h: xword)
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
  const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
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

// Prefill on 256-bit registers: tiles of MR rows x 8 lanes (one register), each weight word loaded (and, for
// maddubs, made into |q| and q) once per MR rows, each row's 4 (int4: 8) activation bytes broadcast from
// memory. With 16 ymm registers the 2 x 32 tile of qtile spilled its int32 sums to the stack on every step;
// here MR sums, the weight word, a broadcast and a product are live. The float side is qtile's, operation for
// operation, so every build still gives the same bits.
#ifdef GPT2FFN_AVXVNNI
struct Q8 { __m256i u; };
static inline Q8 q8load(const uint8_t* p) { return {load32(p)}; }
static inline __m256i q8dot(__m256i acc, const Q8& w, const uint8_t* x) {
  return dot4(acc, w.u, _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x)));
}
#else
struct Q8 { __m256i q, a; };  // q and |q|
static inline Q8 q8load(const uint8_t* p) {
  const __m256i q = _mm256_xor_si256(load32(p), _mm256_set1_epi8(static_cast<char>(0x80)));
  return {q, _mm256_sign_epi8(q, q)};
}
static inline __m256i q8dot(__m256i acc, const Q8& w, const uint8_t* x) {
  const __m256i s = _mm256_sign_epi8(_mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x)), w.q);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w.a, s), _mm256_set1_epi16(1)));
}
#endif

// The float side of a group, shared by qtile8 and qgroup_xsign (so both give the same bits): the scales of
// super-block sb's register v for group g, and acc += float(sum_k q_k x_k) * (scale * d), as qtile does.
static inline __m256 qscale8(const LinearArgs& a, int64_t sb, int64_t ng, int64_t g, int v) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.scale + (sb * ng + g) * 64 + v * 8)));
}
static inline void qacc8(float* acc, __m256i sum, __m256 s, float d) {
  _mm256_store_ps(acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(s, _mm256_set1_ps(d)),
                                       _mm256_load_ps(acc)));
}

#ifndef GPT2FFN_AVXVNNI
// int8 x int8 without VNNI, exactly, and with no vpsignb: for an activation x and a weight q,
// |x| * (q ^ s) = x * q - (x < 0 ? |x| : 0), where s is 0xFF for x < 0 and 0 otherwise (q ^ 0xFF = -q - 1).
// So vpmaddubsw takes |x| (unsigned, <= 127) against q ^ s (signed, -128..127: a pair sums to within +-32512,
// no saturation), and a row's group sum starts at n = the sum of |x| over its negative x. The stored bytes
// are q ^ 0x80, so a row's mask word is s ^ 0x80. 32 products take vpxor, vpmaddubsw, vpmaddwd and vpaddd,
// where the sign trick (q8dot) takes vpsignb, vpmaddubsw, vpmaddwd and vpaddd: on Zen 3 vpsignb competes with
// the two products for their pipes, vpxor does not. A pass is one row over the super-block's 8 registers
// (a row's two broadcasts meet 8 of them; the weights come from L1 as memory operands of vpxor). One thread,
// one layer, 128 rows, AMD EPYC Zen 3 (benchmarks/linear_ab.sh --int8, against the sign trick): 0.84-0.91x the
// time; 4 rows x 2 registers and 2 x 4 were 0.93-0.97x (benchmarks/int8_dot_avx2.cpp times the bare steps).
//
// A tile's |x|, masks and n for a group lie in a block of G / 4 + 1 lines: line s holds step s's |x| words (row
// m's at byte 4m) and then its mask words (at 32 + 4m), the last line each row's n (int32, at 4m). Prefill makes
// each block on the stack from the tile's words (xsign_tile), once for the tile's passes over a super-block; for
// decode's one row quantize_rows makes the blocks once, after the words (GPT2FFN_XSIGN), so the one-row tile
// (qtile1_xsign) takes this form too, where it took the sign trick (vpsignb twice per 32 products).
#define GPT2FFN_XSIGN 1
constexpr int64_t XSIGN_STEPS = 64;  // groups of up to 256 (larger ones take the sign trick)
static inline bool xsign(const LinearArgs& a) { return a.format == I8A8 && a.group <= 4 * XSIGN_STEPS; }
// Decode's one row: quantize_rows makes its blocks once (xsign_tile), after its words
static inline bool xsign_layout(const LinearArgs& a) { return xsign(a) && a.M == 1; }
// Decode's one row: its group g block, after tile 0's words (quantize_rows makes both; xq_bytes counts both)
static inline const uint8_t* xsign_one(const int8_t* xq, int64_t K, int64_t G, int64_t g) {
  return reinterpret_cast<const uint8_t*>(xq) + XR * K + g * 64 * (G / 4 + 1);
}
static inline int64_t xsign_one_bytes(int64_t K, int64_t G) { return XR * K + (K / G) * 64 * (G / 4 + 1); }

// One row's group over a super-block's 8 registers: p[j] = n + the sum of |x| * (q ^ s) (wp: the group's
// weights, b: the row's words in its block)
template <bool PF = false>
static inline void qrow_xsign(const uint8_t* wp, const uint8_t* b, int64_t steps, __m256i* p, int64_t pf = 0) {
  const __m256i n = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(b + 64 * steps));
  for (int j = 0; j < 8; j++) p[j] = n;
  const __m256i one = _mm256_set1_epi16(1);
  for (int64_t s = 0; s < steps; s++, wp += 256, b += 64) {
    if constexpr (PF)
      for (int j = 0; j < 4; j++) _mm_prefetch(reinterpret_cast<const char*>(wp + pf + 64 * j), _MM_HINT_T0);
    const __m256i u = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(b));
    const __m256i f = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(b + 32));
    for (int j = 0; j < 8; j++) {
      const __m256i q = _mm256_xor_si256(load32(wp + 32 * j), f);  // q or -q - 1
      p[j] = _mm256_add_epi32(p[j], _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), one));
    }
  }
}

// The block of group g of an 8-row tile's interleaved words (xw: the tile's words of the group's first step),
// into b (each row's lanes on their own: a tile's rows past M give lanes no one reads)
static inline void xsign_tile(const uint8_t* xw, int64_t steps, uint8_t* b) {
  const __m256i zero = _mm256_setzero_si256(), top = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i neg = zero;  // lane m: -n of row m (vpmaddubsw of |x| with the mask's -1s)
  for (int64_t s = 0; s < steps; s++) {
    const __m256i x = load32(xw + s * 32), ax = _mm256_abs_epi8(x), sx = _mm256_cmpgt_epi8(zero, x);
    _mm256_store_si256(reinterpret_cast<__m256i*>(b + 64 * s), ax);
    _mm256_store_si256(reinterpret_cast<__m256i*>(b + 64 * s + 32), _mm256_xor_si256(sx, top));
    neg = _mm256_add_epi32(neg, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sx), _mm256_set1_epi16(1)));
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(b + 64 * steps), _mm256_sub_epi32(zero, neg));
}

// Group g of the MR rows from m0 (xt: their 8-row tile's words) over super-block sb, into acc by qacc8 (the
// int32 sums are the sign trick's, so the bits are too). The tile's block is made here, on the stack, once for
// its MR passes. Written once a layer by quantize_rows for every row instead (2.25 bytes an activation, not 1),
// the blocks saved nothing at 128 rows (0.985-1.015x the time of a layer) and took 1.15x at 512 rows of K = 6400
// (benchmarks/linear_ab.sh --int8, AMD EPYC Zen 3): their reads cost what the preparation here does.
template <int MR>
__attribute__((optimize("no-tree-pre"))) static void qgroup_xsign(const LinearArgs& a, const uint8_t* wsb,
                                                                    const uint8_t* xt, int64_t m0, int64_t sb,
                                                                    int64_t g, int64_t ng, float (*acc)[MR][8]) {
  const int64_t steps = a.group / 4;  // <= XSIGN_STEPS
  alignas(64) uint8_t b[(XSIGN_STEPS + 1) * 64];
  xsign_tile(xt + g * steps * 4 * XR, steps, b);
  __m256 sv[8];
  for (int v = 0; v < 8; v++) sv[v] = qscale8(a, sb, ng, g, v);
  for (int m = 0; m < MR; m++) {
    __m256i p[8];
    qrow_xsign(wsb + g * steps * 256, b + 4 * (m0 % XR + m), steps, p);
    for (int v = 0; v < 8; v++) qacc8(acc[v][m], p[v], sv[v], a.xscale[(m0 + m) * ng + g]);
  }
}

// Decode's one row over super-block sb, the same sums and float steps as qtile<I8A8, 1, QNB1> (so the same
// bits), each step's 4 lines prefetched prefetch_bytes ahead if PF.
template <bool PF>
static void qtile1_xsign(const LinearArgs& a, int64_t sb) {
  const int64_t K = a.K, G = a.group, ng = K / G, steps = G / 4;
  const uint8_t* wsb = static_cast<const uint8_t*>(a.w) + sb * (K / 4) * 256;
  const int64_t pf = PF ? prefetch_bytes[I8A8] : 0;
  alignas(32) float acc[8][1][8];
  for (int v = 0; v < 8; v++) _mm256_store_ps(acc[v][0], _mm256_setzero_ps());
  for (int64_t g = 0; g < ng; g++) {
    __m256i p[8];
    qrow_xsign<PF>(wsb + g * steps * 256, xsign_one(a.xq, K, G, g), steps, p, pf);
    for (int v = 0; v < 8; v++) qacc8(acc[v][0], p[v], qscale8(a, sb, ng, g, v), a.xscale[g]);
  }
  for (int v = 0; v < 8; v += 2) {
    const int64_t col = sb * 64 + v * 8;
    const V b = a.bias ? vload(a.bias + col) : vzero();
    const V y = activate(vadd(V{_mm256_load_ps(acc[v][0]), _mm256_load_ps(acc[v + 1][0])}, b), a.act);
    _mm256_storeu_ps(a.y + col, y.lo);
    _mm256_storeu_ps(a.y + col + 8, y.hi);
  }
}
#endif

// The int8 activations of these builds lie in tiles of XR = 8 rows interleaved word by word (qlinear_impl.h:
// xword): a tile's step of 4 k (I4A8: two steps) is 32 consecutive bytes, row m's word at byte 4m, so one
// pointer walks every row (8 row pointers took the general registers the loop needs).
//
// A tile runs group by group, and within a group over the super-block's 8 registers of lanes v: the group's
// weights (G / 4 steps of 256 bytes, 2 KB for int8 at G = 32; int4 half that) and its rows' activations stay in
// L1 while the 8 passes read them, and a few rows' decode step streams each group's weights from memory in
// order. With v outermost (each pass the whole of K for one register) a tile read the super-block 8 times over,
// 32 bytes of every 256, and the activations as often. AMD EPYC Zen 3, 2 threads, before -> after
// (benchmarks/decode_chain.py --rows N, the 48 layers of GPT-2 124M, int8 activations, 2 runs each;
// benchmarks/results/decode-chain-rows-zen3.json):
// 2 rows int8 12.8-13.3 -> 9.6-10.6 ms, int4 7.4-8.7 -> 4.5-5.3; 4 rows int8 14.7-15.0 -> 11.8-13.6, int4
// 8.8-9.8 -> 6.6-6.7; 8 rows int8 15.0-15.5 -> 11.5-13.2, int4 10.3-11.0 -> 6.2. A 128-token prefill
// (benchmarks/prefill_ab.py, 7 rounds): int4 133.0 -> 114.1 ms, int8 144.7 -> 138.7 (within the noise). The
// float sums, 8 x MR registers, live on the stack, touched once a group.
//
// GCC's partial redundancy elimination hoisted every row's broadcast above the first product, 8 live copies
// that pushed the sums to the stack; without it each row's chain runs in order in 4 registers.
//
// The weights of super-block sb + 1 come into L2 while sb's are computed: the tiles over sb's rows (tile t of
// nt) share its lines out, each prefetching a whole group's lines, one super-block on, for groups t, t + nt, ...
// (outside the inner loop: a prefetch there slowed it). A prefill's weights came from memory as the first tile
// read them.
template <int FMT, int MR>
__attribute__((optimize("no-tree-pre"))) static void qtile8(const LinearArgs& a, int64_t m0, int64_t sb, int t,
                                                             int nt) {
#ifdef GPT2FFN_AVXVNNI
  [[maybe_unused]] constexpr bool XSIGN = false;
#else
  constexpr bool XSIGN = FMT == I8A8;  // qgroup_xsign
#endif
  constexpr int STEP = FMT == I4A8 ? 8 : 4;
  constexpr int32_t OFF = FMT == I4A8 ? 8 : I8_OFFSET;
  const int64_t K = a.K, G = a.group, ng = K / G, next = (K / STEP) * 256;
  const uint8_t* wsb = static_cast<const uint8_t*>(a.w) + sb * next;
  int until = sb + 1 < a.nsuper ? t + 1 : -1;  // groups to the next prefetch (-1: none)
  const uint8_t* x = reinterpret_cast<const uint8_t*>(a.xq) + (m0 / XR) * XR * K + (m0 % XR) * 4;  // xword(m0, 0)
  alignas(32) float acc[8][MR][8];
  for (int v = 0; v < 8; v++)
    for (int m = 0; m < MR; m++) _mm256_store_ps(acc[v][m], _mm256_setzero_ps());
  for (int64_t g = 0; g < ng; g++) {
    if (--until == 0) {  // this group's lines of super-block sb + 1
      const char* p = reinterpret_cast<const char*>(wsb + next + g * (G / STEP) * 256);
      for (int64_t i = 0; i < G / STEP * 4; i++) _mm_prefetch(p + i * 64, _MM_HINT_T1);
      until = nt;
    }
#ifndef GPT2FFN_AVXVNNI
    if (XSIGN && G <= 4 * XSIGN_STEPS) {
      qgroup_xsign<MR>(a, wsb, x - (m0 % XR) * 4, m0, sb, g, ng, acc);
      continue;
    }
#endif
    for (int v = 0; v < 8; v++) {
      const uint8_t* w = wsb + v * 32;
      __m256i part[MR];
      for (int m = 0; m < MR; m++) part[m] = _mm256_set1_epi32(-OFF * a.xsum[(m0 + m) * ng + g]);
      if constexpr (FMT == I4A8) {
        const __m256i mask = _mm256_set1_epi8(15);
#ifdef GPT2FFN_AVXVNNI
        const uint8_t* wp = w + g * (G / 8) * 256;
        const uint8_t* xw = x + g * (G / 4) * 4 * XR;
        for (int64_t k = g * G; k < (g + 1) * G; k += 8, wp += 256, xw += 8 * XR) {
          const __m256i b = load32(wp);
          const __m256i lo = _mm256_and_si256(b, mask), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
          for (int m = 0; m < MR; m++) {
            const uint8_t* xm = xw + 4 * m;
            part[m] = dot4(dot4(part[m], lo, _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xm))), hi,
                           _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xm + 4 * XR)));
          }
        }
#else
        // q <= 15, |x| <= 127: one step adds at most 4 x 15 x 127 = 7620 to a 16-bit pair sum, so 4 steps
        // (32 k) add in 16 bits before one madd widens them
        for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += 32) {
          __m256i p16[MR];
          for (int m = 0; m < MR; m++) p16[m] = _mm256_setzero_si256();
          const uint8_t* wp = w + (k0 / 8) * 256;
          const uint8_t* xw = x + (k0 / 4) * 4 * XR;
          for (int64_t k = k0; k < std::min(k0 + 32, (g + 1) * G); k += 8, wp += 256, xw += 8 * XR) {
            const __m256i b = load32(wp);
            const __m256i lo = _mm256_and_si256(b, mask), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
            for (int m = 0; m < MR; m++) {
              const int32_t* xm = reinterpret_cast<const int32_t*>(xw + 4 * m);
              const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xm[0]));
              const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xm[XR]));
              p16[m] = _mm256_add_epi16(p16[m], _mm256_add_epi16(pl, ph));
            }
          }
          for (int m = 0; m < MR; m++)
            part[m] = _mm256_add_epi32(part[m], _mm256_madd_epi16(p16[m], _mm256_set1_epi16(1)));
        }
#endif
      } else {
        // pointers stepped, not (k / 4) * 256 recomputed: a signed division's 7 scalar instructions a step
        // took ports the vector instructions need
        const uint8_t* wp = w + g * (G / 4) * 256;
        const uint8_t* xw = x + g * (G / 4) * 4 * XR;
        for (int64_t k = g * G; k < (g + 1) * G; k += 4, wp += 256, xw += 4 * XR) {
          const Q8 q = q8load(wp);
          for (int m = 0; m < MR; m++) part[m] = q8dot(part[m], q, xw + 4 * m);
        }
      }
      const __m256 s = qscale8(a, sb, ng, g, v);
      for (int m = 0; m < MR; m++) qacc8(acc[v][m], part[m], s, a.xscale[(m0 + m) * ng + g]);
    }
  }
  for (int v = 0; v < 8; v++) {
    const int64_t col = sb * 64 + v * 8;
    const __m256 b = a.bias ? _mm256_loadu_ps(a.bias + col) : _mm256_setzero_ps();
    for (int m = 0; m < MR; m += 2) {  // rows in pairs through the 16-lane activation
      const int m1 = m + 1 < MR ? m + 1 : m;
      const V y = activate(V{_mm256_add_ps(_mm256_load_ps(acc[v][m]), b), _mm256_add_ps(_mm256_load_ps(acc[v][m1]), b)},
                           a.act);
      _mm256_storeu_ps(a.y + (m0 + m) * a.ldy + col, y.lo);
      if (m1 != m) _mm256_storeu_ps(a.y + (m0 + m1) * a.ldy + col, y.hi);
    }
  }
}

// Rows in tiles of 8 (then 4, 2, 1), each over the whole super-block.
template <int FMT>
static void qrun8(const LinearArgs& a, int64_t sb0, int64_t sb1) {
  const int nt = static_cast<int>(a.M / 8 + (a.M % 8 >= 4) + (a.M % 4 >= 2) + (a.M % 2));  // tiles a super-block
  for (int64_t sb = sb0; sb < sb1; sb++) {
    int64_t m = 0;
    int t = 0;
    for (; m + 8 <= a.M; m += 8, t++) qtile8<FMT, 8>(a, m, sb, t, nt);
    if (m + 4 <= a.M) qtile8<FMT, 4>(a, m, sb, t, nt), m += 4, t++;
    if (m + 2 <= a.M) qtile8<FMT, 2>(a, m, sb, t, nt), m += 2, t++;
    if (m < a.M) qtile8<FMT, 1>(a, m, sb, t, nt);
  }
}
#define GPT2FFN_QRUN8 1
}  // namespace ISA
}  // namespace gpt2ffn

#include "qlinear_impl.h"
