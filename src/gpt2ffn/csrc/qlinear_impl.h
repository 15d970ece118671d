// Integer dot products on int8 activations (formats I8A8 and I4A8 of linear.h): the rows of x quantized per
// group to int8, each group's products summed exactly in int32, scaled into an fp32 sum group by group.
// An ISA file defines, in namespace gpt2ffn::ISA before including this header, the float helpers of
// linear_impl.h (V, vzero, vset1, vload, vload_f16, vfma, vmul, vadd, vstore) and the integer ones:
//   W wload_i8(p); VI dot_i8(acc, w, x4);  wload_i4(p, lo, hi); VI dot_i4(acc, lo, hi, x4lo, x4hi)
//   VI viset1(int32_t);  V vcvt(VI acc): float(acc);  INT8_DOT: the instruction's name;
//   quantize_group16(x, q, G, d, sum): one group of G (a multiple of 16) activations quantized as
//   quantize_rows' scalar loop does (and, defining GPT2FFN_QUANTIZE_16X32, quantize_16x32(x, q, d, sum): 16
//   groups of 32 at once, the same operations);  I8_OFFSET: what dot_i8 adds to q (128 when it sums (q + 128) * x as
//   vpdpbusd reads the stored bytes, 0 when it sums q * x); QMR x QNB: the prefill tile (then one of QMR / 2 rows),
//   QNB1 decode's
//   (the 256-bit builds define GPT2FFN_QRUN8 and no QMR / QNB: they prefill through their own qrun8).
// Each 4-byte word of a lane holds 4 consecutive k (I4A8: 8, as two nibbles), so one broadcast of 4 (8)
// activation bytes meets 16 lanes' weights in one instruction.
#pragma once
#include <cmath>
#include <cstring>
#include <vector>

#include "act_impl.h"
#include "linear.h"

namespace gpt2ffn {
namespace ISA {

constexpr int64_t SUPER = 64;  // lanes per super-block: 4 blocks of 16
#ifndef GPT2FFN_QRUN8
constexpr int64_t XR = 1;  // int8 activations row by row (the 256-bit builds interleave 8: qvec_avx2.h)
#endif

// Where row m's int8 activations k..k + 3 (k % 4 == 0) lie in xq: tiles of XR rows, each tile's rows
// interleaved 4 bytes (one weight word's k) at a time, (m / XR, k / 4, m % XR, k % 4); XR = 1 is row-major
// (M, K). xq holds whole tiles: M rounded up to 8 rows (linear.h).
static inline const int8_t* xword(const int8_t* xq, int64_t K, int64_t m, int64_t k) {
  return xq + (m / XR) * XR * K + k * XR + (m % XR) * 4;  // k * XR: (k / 4) * 4 * XR with no signed division
}

// Rows m0..m1 of x -> xq (int8, laid out as xword says), xscale and xsum per (row, group): d = max|x| / 127,
// q = round-half-even(x * (1 / d)), the same fp32 operations as gpt2ffn.kernels.formats.quantize_activations.
void quantize_rows(const LinearArgs& a, int8_t* xq, float* xs, int32_t* xsum, int64_t m0, int64_t m1) {
  const int64_t K = a.K, G = a.group, ng = K / G;
  thread_local std::vector<int8_t> row;  // XR > 1: a row before its words go to their places
  if constexpr (XR > 1) row.resize(K);
  for (int64_t m = m0; m < m1; m++) {
    int8_t* qrow = XR > 1 ? row.data() : xq + m * K;
    int64_t g = 0;
#ifdef GPT2FFN_QUANTIZE_16X32
    if (G == 32)  // 16 groups at a time, then the rest one by one
      for (; g + 16 <= ng; g += 16)
        quantize_16x32(a.x + m * a.ldx + g * G, qrow + g * G, xs + m * ng + g, xsum + m * ng + g);
#endif
    for (; g < ng; g++) {
      const float* x = a.x + m * a.ldx + g * G;
      int8_t* q = qrow + g * G;
      if (G % 16 == 0) {  // the same operations, 16 at a time
        quantize_group16(x, q, G, xs[m * ng + g], xsum[m * ng + g]);
        continue;
      }
      float amax = 0.0f;
      for (int64_t i = 0; i < G; i++) amax = std::fmax(amax, std::fabs(x[i]));
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t s = 0;
      for (int64_t i = 0; i < G; i++) {
        const float r = std::nearbyint(x[i] * id);
        q[i] = static_cast<int8_t>(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        s += q[i];
      }
      xs[m * ng + g] = d;
      xsum[m * ng + g] = s;
    }
    if (XR > 1)
      for (int64_t k = 0; k < K; k += 4) std::memcpy(const_cast<int8_t*>(xword(xq, K, m, k)), qrow + k, 4);
  }
#ifdef GPT2FFN_XSIGN
  if (xsign_layout(a) && m0 == 0)  // decode's one row: its blocks of |x|, masks and n too (qvec_avx2.h)
    for (int64_t g = 0; g < ng; g++)  // (group g's words start at k = g * G: byte g * G * XR of tile 0)
      xsign_tile(reinterpret_cast<const uint8_t*>(xq) + g * G * XR, G / 4,
                 const_cast<uint8_t*>(xsign_one(xq, K, G, g)));
#endif
}

// The bytes xq takes for M rows of a layer of K inputs in groups of G and format `format`: whole tiles of 8 rows
int64_t xq_bytes(int64_t M, int64_t K, int64_t G, int format) {
#ifdef GPT2FFN_XSIGN
  if (format == I8A8 && G <= 4 * XSIGN_STEPS && M == 1) return xsign_one_bytes(K, G);
#endif
  return (M + 7) / 8 * 8 * K;
}

// PF: the one-row tiles of decode prefetch a.w's rows prefetch_bytes[FMT] ahead (linear.h). Prefill's tiles
// (tile t of the nt over a super-block's rows) prefetch their blocks' lines of super-block sb + 1 into L2 for
// groups t, t + nt, ..., as the 256-bit builds' qtile8 does. GC: the group as a constant (0: a.group), so that
// a group's words unroll into one straight run of dot products; rolled, g++ 12 copied each of the MR x NB sums
// out of and back into its register every word (16 moves to 8 vpdpbusd in the 4 x 2 tile), ~1.2x the time.
template <int FMT, int MR, int NB, bool PF = false, int GC = 0>
static inline void qtile(const LinearArgs& a, int64_t m0, int64_t sb, int j0, int t = 0, int nt = 0) {
  constexpr int STEP = FMT == I4A8 ? 8 : 4;  // k per 4-byte word
  const char* pf = PF ? static_cast<const char*>(a.w) + prefetch_bytes[FMT] : nullptr;
  constexpr int32_t OFF = FMT == I4A8 ? 8 : I8_OFFSET;
  const int64_t K = a.K, G = GC > 0 ? GC : a.group, ng = K / G;
  const uint8_t* wsb = static_cast<const uint8_t*>(a.w) + sb * (K / STEP) * SUPER * 4;
  const int64_t next = (K / STEP) * SUPER * 4;  // bytes a super-block
  int until = nt > 0 && sb + 1 < a.nsuper ? t + 1 : -1;  // groups to the next prefetch (-1: none)
  V acc[MR][NB];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < NB; j++) acc[m][j] = vzero();
  for (int64_t g = 0; g < ng; g++) {
    // each group's int32 sum starts at -OFF * sum_k x_k, so the weights' unsigned offset is gone at its end
    VI part[MR][NB];
    for (int m = 0; m < MR; m++) {
      const VI start = viset1(-OFF * a.xsum[(m0 + m) * ng + g]);
      for (int j = 0; j < NB; j++) part[m][j] = start;
    }
    const uint8_t* wk = wsb + g * (G / STEP) * SUPER * 4 + j0 * 64;  // stepped: no signed k / STEP per step
    if (--until == 0) {
      for (int64_t i = 0; i < G / STEP; i++)
        for (int j = 0; j < NB; j++)
          _mm_prefetch(reinterpret_cast<const char*>(wk + next + i * SUPER * 4 + j * 64), _MM_HINT_T1);
      until = nt;
    }
#pragma GCC unroll 16
    for (int64_t i = 0; i < G / STEP; i++, wk += SUPER * 4) {
      const int64_t k = g * G + i * STEP;
      if constexpr (PF)
        for (int j = 0; j < NB; j++) _mm_prefetch(pf + (wk - static_cast<const uint8_t*>(a.w)) + j * 64, _MM_HINT_T0);
      if constexpr (FMT == I4A8) {
        W lo[NB], hi[NB];
        for (int j = 0; j < NB; j++) wload_i4(wk + j * 64, lo[j], hi[j]);
        for (int m = 0; m < MR; m++) {
          int32_t x4[2];
          std::memcpy(&x4[0], xword(a.xq, K, m0 + m, k), 4);
          std::memcpy(&x4[1], xword(a.xq, K, m0 + m, k + 4), 4);
          for (int j = 0; j < NB; j++) part[m][j] = dot_i4(part[m][j], lo[j], hi[j], x4[0], x4[1]);
        }
      } else {
        W w[NB];
        for (int j = 0; j < NB; j++) w[j] = wload_i8(wk + j * 64);
        for (int m = 0; m < MR; m++) {
          int32_t x4;
          std::memcpy(&x4, xword(a.xq, K, m0 + m, k), 4);
          for (int j = 0; j < NB; j++) part[m][j] = dot_i8(part[m][j], w[j], x4);
        }
      }
    }
    // acc += float(sum_k q_k x_k) * (d * scale)
    for (int j = 0; j < NB; j++) {
      const V s = vload_f16(a.scale + (sb * ng + g) * SUPER + (j0 + j) * 16);
      for (int m = 0; m < MR; m++)
        acc[m][j] = vfma(vcvt(part[m][j]), vmul(s, vset1(a.xscale[(m0 + m) * ng + g])), acc[m][j]);
    }
  }
  for (int j = 0; j < NB; j++) {
    const int64_t col = sb * SUPER + (j0 + j) * 16;
    const V b = a.bias ? vload(a.bias + col) : vzero();
    for (int m = 0; m < MR; m++) vstore(a.y + (m0 + m) * a.ldy + col, activate(vadd(acc[m][j], b), a.act));
  }
}

// qtile with the group of 32 (every GPT-2 width's) as the constant GC, any other as a.group
template <int FMT, int MR, int NB, bool PF = false>
static inline void qtile_g(const LinearArgs& a, int64_t m0, int64_t sb, int j0, int t = 0, int nt = 0) {
  a.group == 32 ? qtile<FMT, MR, NB, PF, 32>(a, m0, sb, j0, t, nt) : qtile<FMT, MR, NB, PF>(a, m0, sb, j0, t, nt);
}

#ifndef GPT2FFN_QRUN8
// One tile of MR rows over a super-block's 4 blocks of 16 lanes, QNB blocks at a time
template <int FMT, int MR>
static inline void tiles(const LinearArgs& a, int64_t m, int64_t sb, int t, int nt) {
  for (int j0 = 0; j0 < 4; j0 += QNB) qtile_g<FMT, MR, QNB>(a, m, sb, j0, t, nt);
}
#endif

// Rows in tiles of QMR (each weight word loaded once per tile and met by QMR rows' activations), then one of
// QMR / 2 if that many are left, outputs in blocks of QNB x 16 lanes; the rest one row at a time over the whole
// super-block.
template <int FMT>
static void qrun(const LinearArgs& a, int64_t sb0, int64_t sb1) {
#ifdef GPT2FFN_QRUN8
  if (a.M > 1) return qrun8<FMT>(a, sb0, sb1);  // the 256-bit builds' prefill (qvec_avx2.h)
#endif
  // decode: the weights come from memory once; fewer rows than a tile go row by row, the first prefetching
  // (the wider tiles kept their speed here at 4-8 rows, unlike the float kernels': linear.h, FEW_ROWS)
#ifdef GPT2FFN_QRUN8
  const bool stream = a.M == 1 && prefetch_bytes[FMT] > 0;
#else
  const bool stream = a.M < QMR / 2 && prefetch_bytes[FMT] > 0;
  // prefill's tiles a super-block: of QMR rows, then one of QMR / 2 (the rows left over do not prefetch)
  const int nt = static_cast<int>(a.M / QMR + (a.M % QMR >= QMR / 2));
#endif
  for (int64_t sb = sb0; sb < sb1; sb++) {
    int64_t m = 0;
#ifndef GPT2FFN_QRUN8  // (there M is 1 here)
    int t = 0;
    for (; m + QMR <= a.M; m += QMR, t++) tiles<FMT, QMR>(a, m, sb, t, nt);
    if (m + QMR / 2 <= a.M) tiles<FMT, QMR / 2>(a, m, sb, t, nt), m += QMR / 2;
#endif
#ifdef GPT2FFN_XSIGN
    if (FMT == I8A8 && xsign_layout(a)) {  // (M is 1)
      stream ? qtile1_xsign<true>(a, sb) : qtile1_xsign<false>(a, sb);
      continue;
    }
#endif
    for (; m < a.M; m++)
      for (int j0 = 0; j0 < 4; j0 += QNB1)
        stream && m == 0 ? qtile_g<FMT, 1, QNB1, true>(a, m, sb, j0) : qtile_g<FMT, 1, QNB1>(a, m, sb, j0);
  }
}

// The instruction this build's integer sums run on, as compiled (tests check it per build).
const char* int8_dot() { return INT8_DOT; }

void qlinear_range(const LinearArgs& a, int64_t sb0, int64_t sb1) {
  if (a.format == I4A8) qrun<I4A8>(a, sb0, sb1);
  else qrun<I8A8>(a, sb0, sb1);
}

}  // namespace ISA
}  // namespace gpt2ffn
