// The kernels of linear.h, on 16-wide float vectors `V` and helpers (vload, vfma, ...) that an ISA file
// defines in namespace gpt2ffn::ISA before including this header. The ISA files are compiled with their
// target pragma and include no torch header, so no inline function of torch's is ever built for an
// instruction set the CPU may lack.
#pragma once
#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "act_impl.h"
#include "linear.h"

namespace gpt2ffn {
namespace ISA {

// Sums run in chunks of CHUNK inputs (a quantized layer's group): each chunk into its own accumulator,
// added to the total at the chunk's end. The rounding error of a K-long sum then grows with
// CHUNK + K / CHUNK instead of K (fp32 logits of GPT-2 stay within 1e-6 of max|logits| of HF's).
constexpr int64_t CHUNK = 64;
constexpr int64_t SUPER = 64;  // lanes per super-block: 4 blocks of 16

// The lines of one row of weights, `pf` bytes ahead of `row` (linear.h: prefetch_bytes).
static inline void prefetch_row(const void* row, int64_t bytes, int64_t pf) {
  const char* p = static_cast<const char*>(row) + pf;
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// PF: the one- and two-row tiles of decode prefetch a.w's rows prefetch_bytes[FMT] ahead. ahead: prefill's
// first tile over a block that meets its weights in memory prefetches the next chunk's rows into L2 as it starts
// a chunk (the whole next super-block, as the integer kernels prefetch, crowded L2 out here: fp32's is 768 KB at
// K = 3072; slower). next0 .. next1: this tile's share of the next K block's weights (run), into L2 a piece each
// chunk.
// kb0 .. kb1: the inputs this call sums (prefill's K blocks, linear.h: KBLOCK; whole chunks): the first block
// starts from zero, a later one from the running sums it finds in y, and only the last one adds the bias and
// applies the activation. The sums pass through y as fp32, so each output's chain of operations is unchanged.
template <int FMT, int MR, int NB, bool PF = false>
static inline void tile(const LinearArgs& a, const float* x, float* y, int64_t sb, int j0, bool ahead = false,
                        int64_t kb0 = 0, int64_t kb1 = -1, const char* next0 = nullptr, const char* next1 = nullptr) {
  const int64_t K = kb1 < 0 ? a.K : kb1, ldx = a.ldx;
  const bool resume = kb0 > 0, finish = K == a.K;
  constexpr bool quantized = FMT == I8 || FMT == I4;
  constexpr int64_t esize = FMT == F32 ? 4 : FMT == BF16 ? 2 : 1;
  const int64_t pf = PF ? prefetch_bytes[FMT] : 0;
  const int64_t C = quantized ? a.group : CHUNK;
  const int64_t ngroups = quantized ? a.K / C : 0;
  const int64_t rows = FMT == I4 ? a.K / 2 : a.K;  // rows of 64 lanes in this super-block
  V acc[MR][NB], part[MR][NB];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < NB; j++) acc[m][j] = resume ? vload(y + m * a.ldy + sb * SUPER + (j0 + j) * 16) : vzero();
  const int64_t nchunks = (K - kb0 + C - 1) / C;
  for (int64_t k0 = kb0; k0 < K; k0 += C) {
    const int64_t k1 = k0 + C < K ? k0 + C : K;
    if (next0 != next1) {  // this tile's share of the next block's lines into L2, a piece each chunk
      const int64_t c = (k0 - kb0) / C, lines = (next1 - next0) / 64;
      for (int64_t l = lines * c / nchunks; l < lines * (c + 1) / nchunks; l++)
        _mm_prefetch(next0 + l * 64, _MM_HINT_T1);
    }
    if (ahead) {  // the next chunk's rows of the tile's lanes into L2
      const int64_t r0 = FMT == I4 ? k1 / 2 : k1, r1 = FMT == I4 ? (k1 + C) / 2 : k1 + C;
      const char* base = static_cast<const char*>(a.w) + (sb * rows * SUPER + j0 * 16) * esize;
      for (int64_t r = r0; r < r1 && r < rows; r++)
        for (int64_t b = 0; b < NB * 16 * esize; b += 64) _mm_prefetch(base + r * SUPER * esize + b, _MM_HINT_T1);
    }
    for (int m = 0; m < MR; m++)
      for (int j = 0; j < NB; j++) part[m][j] = vzero();
    if constexpr (FMT == I4) {
      for (int64_t k = k0; k < k1; k += 2) {
        if constexpr (PF)
          prefetch_row(static_cast<const uint8_t*>(a.w) + (sb * rows + k / 2) * SUPER + j0 * 16, NB * 16, pf);
        V lo[NB], hi[NB];
        for (int j = 0; j < NB; j++)
          vload_s4(static_cast<const uint8_t*>(a.w) + (sb * rows + k / 2) * SUPER + (j0 + j) * 16, lo[j], hi[j]);
        for (int m = 0; m < MR; m++) {
          const V x0 = vset1(x[m * ldx + k]), x1 = vset1(x[m * ldx + k + 1]);
          for (int j = 0; j < NB; j++) part[m][j] = vfma(x1, hi[j], vfma(x0, lo[j], part[m][j]));
        }
      }
    } else {
      auto step = [&](int64_t k) {  // row k of the tile's weights into the MR rows' sums
        if constexpr (PF)
          prefetch_row(static_cast<const uint8_t*>(a.w) + ((sb * rows + k) * SUPER + j0 * 16) * esize, NB * 16 * esize,
                       pf);
        V w[NB];
        for (int j = 0; j < NB; j++) {
          const int64_t off = (sb * rows + k) * SUPER + (j0 + j) * 16;
          if constexpr (FMT == F32) w[j] = vload(static_cast<const float*>(a.w) + off);
          else if constexpr (FMT == BF16) w[j] = vload_bf16(static_cast<const uint16_t*>(a.w) + off);
          else w[j] = vload_i8(static_cast<const int8_t*>(a.w) + off);
        }
        for (int m = 0; m < MR; m++) {
          const V xb = vset1(x[m * ldx + k]);
          for (int j = 0; j < NB; j++) part[m][j] = vfma(xb, w[j], part[m][j]);
        }
      };
#ifdef GPT2FFN_UNROLL_K
      constexpr bool unroll = MR >= 3;  // prefill's tiles in the AVX2 build, 4 k a pass (linear_avx2.cpp)
#else
      constexpr bool unroll = false;
#endif
      if constexpr (unroll) {
#pragma GCC unroll 4
        for (int64_t k = k0; k < k1; k++) step(k);
      } else {
        for (int64_t k = k0; k < k1; k++) step(k);
      }
    }
    if constexpr (quantized) {  // the group's scale, once per chunk: acc += s * sum_k x_k q_k
      for (int j = 0; j < NB; j++) {
        const V s = vload_f16(a.scale + (sb * ngroups + k0 / C) * SUPER + (j0 + j) * 16);
        for (int m = 0; m < MR; m++) acc[m][j] = vfma(part[m][j], s, acc[m][j]);
      }
    } else {
      for (int m = 0; m < MR; m++)
        for (int j = 0; j < NB; j++) acc[m][j] = vadd(acc[m][j], part[m][j]);
    }
  }
  for (int j = 0; j < NB; j++) {
    const int64_t col = sb * SUPER + (j0 + j) * 16;
    if (!finish) {
      for (int m = 0; m < MR; m++) vstore(y + m * a.ldy + col, acc[m][j]);
      continue;
    }
    const V b = a.bias ? vload(a.bias + col) : vzero();
    for (int m = 0; m < MR; m++) vstore(y + m * a.ldy + col, activate(vadd(acc[m][j], b), a.act));
  }
}

// Rows in tiles of up to 6 (x reused from cache, each weight vector loaded once per tile); outputs in
// super-blocks of 64 lanes, as 4 chains for 1-2 rows and 2 x 2 for more. AVX2 holds 8 16-lane vectors (16 ymm),
// so rows go 6 x 1 there (12 ymm of sums, the weight's 2 and a broadcast: the classic 6 x 16 AVX2 kernel), the
// last 3-5 rows 3 x 1. A 6 x 2 tile's 24 accumulators spilled (measured on AMD EPYC Zen 4 with the AVX2 build,
// 128 rows, 3 x 1 instead: fp32 0.90x, int8 0.88x, bf16 0.92x the time; int4, whose nibble pairs need two
// vectors a lane, 1.15x, so it keeps the wide tiles); 6 x 1 then took GPT-2 124M's prefill of 128 tokens
// from 167.4 to 145.6 ms in fp32 and 178.6 to 141.1 ms in bf16 (Intel Xeon, GPT2FFN_ISA=avx2). AVX-512's 32
// registers hold 6 rows x the whole super-block (24 zmm of sums; int4 needs two vectors a lane and keeps 6 x 2
// twice): the same prefill in its build, fp32 91.1 -> 86.4 ms, bf16 94.8 -> 89.0. One or two rows keep the
// whole super-block per pass: halves of it read 2 x 128 of every 256 bytes and slowed decode (bf16 1.9x).
// The tiling never changes an output's order of operations.
// The L2 cache of the core this runs on, in bytes (0 where the C library cannot tell).
static int64_t l2_bytes() {
  static const int64_t bytes = std::max<long>(sysconf(_SC_LEVEL2_CACHE_SIZE), 0);
  return bytes;
}

template <int FMT>
static void run(const LinearArgs& a, int64_t sb0, int64_t sb1) {
  const bool stream = a.M <= 2 && prefetch_bytes[FMT] > 0;  // decode: the weights come from memory once
  const bool few = (FMT == F32 || FMT == BF16) && a.M <= FEW_ROWS;  // int8/int4 widen per pass: they keep the tiles
  // prefill of a long K in blocks of up to KBLOCK inputs (whole chunks), every row's sums over one block before the
  // next: the block's weights and the rows' inputs stay in L2 while the tiles reread them. The block is halved (to
  // 256 inputs at least) while two blocks of a super-block's weights take more than half of this core's L2, so
  // that the next block comes in beside it (fetch, below): on an AMD EPYC Zen 3 (512 KB of L2) fp32 sums in blocks
  // of 512; an L2 of 1 MB or more keeps 1024 for every format. One layer, 128 rows, one thread
  // (benchmarks/linear_harness.cpp on the parent commit built with GPT2FFN_KBLOCK 1024 and 512, Zen 3, G products/s,
  // two runs): 1024 x 4096 25.9 / 26.5 -> 35.7 / 27.9, 4096 x 1024 28.0 / 26.9 -> 32.8 / 38.0, 5120 x 1280 33.3 /
  // 32.2 -> 37.9 / 38.4, 1600 x 6400 26.7 / 27.0 -> 37.6 / 30.1, 6400 x 1600 32.5 / 31.6 -> 38.2 / 28.5, 1280 x 5120
  // 32.7 / 31.1 -> 30.1 / 33.2 (README: "fp32 sums K in blocks sized by the L2"). A block's sums pass through y,
  // so every output's chain of operations stays the same.
  constexpr int64_t esize = FMT == F32 ? 4 : FMT == BF16 ? 2 : 1, FETCH_ROWS = 32;
  const int64_t C = FMT == I8 || FMT == I4 ? a.group : CHUNK, l2 = l2_bytes();
  int64_t kmax = KBLOCK;
  while (l2 > 0 && kmax > 256 && 4 * (FMT == I4 ? kmax / 2 : kmax) * SUPER * esize > l2) kmax /= 2;
  const int64_t kblock = a.M > FEW_ROWS && a.K > kmax ? std::max<int64_t>(kmax / C, 1) * C : a.K;
  // Prefill brings the next block's weights (the bytes right after this block's: the next K block, or the next
  // super-block's first) into L2 while this block's tiles run, each tile a share of its lines in proportion to
  // its rows, where this block, the next and the rows' inputs fit in L2 together and there are at least
  // FETCH_ROWS rows, whose tiles take long enough to hide the next block's reads. Intel Xeon, 2 MB L2, GPT-2
  // medium fp32 (benchmarks/results/prefill-ab-fetch-gpt2-medium-fp32-rows-xeon-amx.json): 12 / 16 / 32 / 64
  // rows 1.06 / 1.02 / 0.98 / 0.91x the time with it; xl 128 rows 0.91x; 512 rows, where the rows' inputs fill
  // L2, 1.04x (an AMD Zen 3's 512 KB L2 took none at 1024 x 64 fp32: hence its blocks of 512). Then only a
  // call's first block meets its weights in memory.
  const int64_t rows = FMT == I4 ? a.K / 2 : a.K, brows = FMT == I4 ? kblock / 2 : kblock;
  const bool fetch = !few && a.M >= FETCH_ROWS && 2 * brows * SUPER * esize + a.M * kblock * 4 <= l2;
  for (int64_t sb = sb0; sb < sb1; sb++)
    for (int64_t kb0 = 0; kb0 < a.K; kb0 += kblock) {
      const int64_t kb1 = std::min(a.K, kb0 + kblock);
      const int64_t r1 = FMT == I4 ? kb1 / 2 : kb1;
      const int64_t nrows = kb1 < a.K ? std::min(rows, r1 + brows) - r1 : sb + 1 < sb1 ? std::min(rows, brows) : 0;
      const char* next = static_cast<const char*>(a.w) + (sb * rows + r1) * SUPER * esize;
      const int64_t nbytes = fetch ? nrows * SUPER * esize : 0;
      const bool fetched = fetch && (sb > sb0 || kb0 > 0);  // this block came in under the one before
      for (int64_t m = 0; m < a.M;) {
        const float* x = a.x + m * a.ldx;
        float* y = a.y + m * a.ldy;
        const int64_t r = a.M - m;
        // prefill's first tile over a block reads it from memory unless it was fetched (a decode step of a few
        // rows keeps its way)
        const bool ahead = m == 0 && a.M > 2 && !few && !fetched;
        // the next block's lines for rows m .. m + mr - 1
        const char* n0 = next + nbytes * m / a.M / 64 * 64;
        auto n1 = [&](int64_t mr) { return next + nbytes * (m + mr) / a.M / 64 * 64; };
        if (few && r >= 2) {
          stream ? tile<FMT, 2, 4, true>(a, x, y, sb, 0) : tile<FMT, 2, 4>(a, x, y, sb, 0, ahead, kb0, kb1);
          m += 2;
        }
        else if (VREGS < 32 && FMT != I4 && r >= 6) {
          for (int j = 0; j < 4; j++)
            tile<FMT, 6, 1>(a, x, y, sb, j, ahead, kb0, kb1, j ? nullptr : n0, j ? nullptr : n1(6));
          m += 6;
        } else if (VREGS < 32 && FMT != I4 && r >= 3) {
          for (int j = 0; j < 4; j++)
            tile<FMT, 3, 1>(a, x, y, sb, j, ahead, kb0, kb1, j ? nullptr : n0, j ? nullptr : n1(3));
          m += 3;
        } else if (FMT != I4 && r >= 6) { tile<FMT, 6, 4>(a, x, y, sb, 0, ahead, kb0, kb1, n0, n1(6)); m += 6; }
        else if (r >= 6) {
          tile<FMT, 6, 2>(a, x, y, sb, 0, ahead, kb0, kb1, n0, n1(6));
          tile<FMT, 6, 2>(a, x, y, sb, 2, ahead, kb0, kb1);
          m += 6;
        } else if (r >= 4) {
          tile<FMT, 4, 2>(a, x, y, sb, 0, ahead, kb0, kb1, n0, n1(4));
          tile<FMT, 4, 2>(a, x, y, sb, 2, ahead, kb0, kb1);
          m += 4;
        } else if (r == 3) {
          tile<FMT, 3, 2>(a, x, y, sb, 0, ahead, kb0, kb1, n0, n1(3));
          tile<FMT, 3, 2>(a, x, y, sb, 2, ahead, kb0, kb1);
          m += 3;
        }
        else if (r == 2) {
          stream ? tile<FMT, 2, 4, true>(a, x, y, sb, 0)
                 : tile<FMT, 2, 4>(a, x, y, sb, 0, false, kb0, kb1, n0, n1(2));
          m += 2;
        }
        else {
          stream ? tile<FMT, 1, 4, true>(a, x, y, sb, 0)
                 : tile<FMT, 1, 4>(a, x, y, sb, 0, false, kb0, kb1, n0, n1(1));
          m += 1;
        }
      }
    }
}

// Rows r < MQ of out[:, 0 : 16 NV] = sum_j p[r][j] v[j, 0 : 16 NV] * inv[r] over the keys each query sees, in
// order: every query the first nall keys, query r the first nall + r (the causal block's diagonal; n = nall +
// MQ - 1). Each value vector is loaded once for the MQ queries of the block. A query skips the keys it does not
// see rather than weigh them by 0: an inf there (a value past 65504 in an fp16 cache) would make 0 * inf = NaN
// of an earlier token's output. For finite values the sums are the same (a zero sum may keep its sign).
static inline V vload_kv(const float* p) { return vload(p); }
static inline V vload_kv(const uint16_t* p) { return vload_f16(p); }
static inline float kv_float(float x) { return x; }
static inline float kv_float(uint16_t bits) { return _cvtsh_ss(bits); }

template <int MQ, int NV, typename T = float>
static inline void weigh_values(const float* p, int64_t ldp, const T* v, int64_t ldv, int64_t n,
                                const float* inv, float* out, int64_t ldo) {
  V acc[MQ][NV];
  for (int r = 0; r < MQ; r++)
    for (int c = 0; c < NV; c++) acc[r][c] = vzero();
  auto weigh = [&](int64_t j, int r0) {  // key j into queries r0 .. MQ - 1
    V vj[NV];
    for (int c = 0; c < NV; c++) vj[c] = vload_kv(v + j * ldv + 16 * c);
    for (int r = 0; r < MQ; r++) {
      if (r < r0) continue;
      const V pj = vset1(p[r * ldp + j]);
      for (int c = 0; c < NV; c++) acc[r][c] = vfma(pj, vj[c], acc[r][c]);
    }
  };
  const int64_t nall = n - (MQ - 1);
  for (int64_t j = 0; j < nall; j++) weigh(j, 0);
  for (int64_t j = nall; j < n; j++) weigh(j, static_cast<int>(j - nall + 1));  // the diagonal
  for (int r = 0; r < MQ; r++)
    for (int c = 0; c < NV; c++) vstore(out + r * ldo + 16 * c, vmul(acc[r][c], vset1(inv[r])));
}

// Queries i0 .. i0 + MQ - 1: scores against the keys the last of them sees, 32 keys x MQ queries a step over
// hd (each K^T vector loaded once for the block), softmax per query over its own keys, then the values.
template <int MQ, typename T>
static void attend_block(const CausalArgs& a, int64_t i0, int64_t Lp) {
  const int64_t hd = a.hd, nmax = a.past + i0 + MQ, ldp = Lp;
  for (int64_t j0 = 0; j0 < nmax; j0 += 32) {
    V s[MQ][2];
    for (int r = 0; r < MQ; r++) s[r][0] = s[r][1] = vzero();
    for (int64_t d = 0; d < hd; d++) {
      const float* row = a.kt + d * Lp + j0;
      const V k0 = vload(row), k1 = vload(row + 16);
      for (int r = 0; r < MQ; r++) {
        const V qd = vset1(a.q[(i0 + r) * a.ldq + d]);
        s[r][0] = vfma(qd, k0, s[r][0]);
        s[r][1] = vfma(qd, k1, s[r][1]);
      }
    }
    for (int r = 0; r < MQ; r++)
      for (int c = 0; c < 2; c++) vstore(a.p + r * ldp + j0 + 16 * c, vmul(s[r][c], vset1(a.scale)));
  }
  float inv[MQ];
  for (int r = 0; r < MQ; r++) {
    float* p = a.p + r * ldp;
    const int64_t n = a.past + i0 + r + 1, n16 = n / 16 * 16;  // the keys query i0 + r sees
    V m = vset1(p[0]);
    for (int64_t j = 0; j < n16; j += 16) m = vmax(m, vload(p + j));
    float mx = vhmax(m);
    for (int64_t j = n16; j < n; j++) mx = p[j] > mx ? p[j] : mx;
    V total = vzero();
    for (int64_t j = 0; j < n16; j += 16) {
      const V e = vexp(vsub(vload(p + j), vset1(mx)));
      vstore(p + j, e);
      total = vadd(total, e);
    }
    float tail = 0.0f;
    if (n16 < n) {  // the last, partial vector: exp of all 16, of which the keys before n count
      vstore(p + n16, vexp(vsub(vload(p + n16), vset1(mx))));
      for (int64_t j = n16; j < n; j++) tail += p[j];
    }
    inv[r] = 1.0f / (vsum(total) + tail);
  }
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    const T* v = static_cast<const T*>(a.v) + d0;
    float* out = a.out + i0 * a.ldo + d0;
    switch ((hd - d0 >= 64 ? 64 : hd - d0) / 16) {
      case 4:
        if constexpr (MQ * 4 > 16) {  // at most 16 accumulators: two passes of 32 lanes
          weigh_values<MQ, 2>(a.p, ldp, v, a.ldv, nmax, inv, out, a.ldo);
          weigh_values<MQ, 2>(a.p, ldp, v + 32, a.ldv, nmax, inv, out + 32, a.ldo);
        } else {
          weigh_values<MQ, 4>(a.p, ldp, v, a.ldv, nmax, inv, out, a.ldo);
        }
        break;
      case 3: weigh_values<MQ, 3>(a.p, ldp, v, a.ldv, nmax, inv, out, a.ldo); break;
      case 2: weigh_values<MQ, 2>(a.p, ldp, v, a.ldv, nmax, inv, out, a.ldo); break;
      default: weigh_values<MQ, 1>(a.p, ldp, v, a.ldv, nmax, inv, out, a.ldo); break;
    }
  }
}

// One decode query against its L cached keys: scores one dot product a key, softmax with the vector exp
// (scores padded to 16 with -3e38, whose weight is zeroed), then the values, one accumulator per 16 lanes.
template <typename T>
static void attend_kv(const AttendArgs& a) {
  const int64_t hd = a.hd, L = a.L, L16 = (L + 15) / 16 * 16;
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  float mx = -3.4e38f;
  for (int64_t j = 0; j < L; j++) {
    V s = vzero();
    for (int64_t i = 0; i < hd; i += 16) s = vfma(vload(a.q + i), vload_kv(k + j * hd + i), s);
    const float sj = vsum(s) * a.scale;
    a.scores[j] = sj;
    mx = sj > mx ? sj : mx;
  }
  for (int64_t j = L; j < L16; j++) a.scores[j] = -3.0e38f;
  V total = vzero();
  for (int64_t j = 0; j < L16; j += 16) {
    const V e = vexp(vsub(vload(a.scores + j), vset1(mx)));
    vstore(a.scores + j, e);
    if (j + 16 <= L) total = vadd(total, e);
  }
  float tail = 0.0f;
  for (int64_t j = L / 16 * 16; j < L; j++) tail += a.scores[j];
  const float inv = 1.0f / (vsum(total) + tail);
  const float invs[1] = {inv};
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    switch ((hd - d0 >= 64 ? 64 : hd - d0) / 16) {
      case 4: weigh_values<1, 4>(a.scores, 0, v + d0, hd, L, invs, a.out + d0, 0); break;
      case 3: weigh_values<1, 3>(a.scores, 0, v + d0, hd, L, invs, a.out + d0, 0); break;
      case 2: weigh_values<1, 2>(a.scores, 0, v + d0, hd, L, invs, a.out + d0, 0); break;
      default: weigh_values<1, 1>(a.scores, 0, v + d0, hd, L, invs, a.out + d0, 0); break;
    }
  }
}

void attend(const AttendArgs& a) {
  if (a.f16) attend_kv<uint16_t>(a);
  else attend_kv<float>(a);
}

template <typename T>
static void attend_causal_kv(const CausalArgs& a) {
  static_assert(ATT_MQ <= ATT_ROWS, "a block's scores need ATT_MQ rows of the scratch a.p");
  const int64_t L = a.past + a.T, hd = a.hd, Lp = (L + 63) / 64 * 64;
  const T* k = static_cast<const T*>(a.k);
  for (int64_t d = 0; d < hd; d++)  // K^T, so 16 keys' scores are one vector: q_d times row d, summed over d
    for (int64_t j = L; j < Lp; j++) a.kt[d * Lp + j] = 0.0f;
  const int64_t L16 = L / 16 * 16;
  for (int64_t j0 = 0; j0 < L16; j0 += 16)  // blocks of 16 keys x 16 lanes through the registers (hd % 16 == 0)
    for (int64_t d0 = 0; d0 < hd; d0 += 16) {
      V r[16];
      for (int i = 0; i < 16; i++) r[i] = vload_kv(k + (j0 + i) * a.ldk + d0);
      vtranspose16(r);
      for (int i = 0; i < 16; i++) vstore(a.kt + (d0 + i) * Lp + j0, r[i]);
    }
  for (int64_t j = L16; j < L; j++)  // the keys after the last 16
    for (int64_t d = 0; d < hd; d++) a.kt[d * Lp + j] = kv_float(k[j * a.ldk + d]);
  int64_t i = 0;
  for (; i + ATT_MQ <= a.T; i += ATT_MQ) attend_block<ATT_MQ, T>(a, i, Lp);
  if constexpr (ATT_MQ > 4)
    for (; i + 4 <= a.T; i += 4) attend_block<4, T>(a, i, Lp);
  for (; i < a.T; i++) attend_block<1, T>(a, i, Lp);
}

void attend_causal(const CausalArgs& a) {
  if (a.f16) attend_causal_kv<uint16_t>(a);
  else attend_causal_kv<float>(a);
}

// One row of d: y = (x - mean) / sqrt(var + eps) * w + b. The moments: float sums per lane, the 16 lanes and the
// last d % 16 elements added in double in index order; the rest in float, the same operations in every build (no
// FMA), so the builds agree bit for bit.
void layer_norm_row(const float* x, const float* w, const float* b, double eps, int64_t d, float* y) {
  const int64_t d16 = d / 16 * 16;
  float lane[16];
  V acc = vzero();
  for (int64_t c = 0; c < d16; c += 16) acc = vadd(acc, vload(x + c));
  vstore(lane, acc);
  double sum = 0.0;
  for (int i = 0; i < 16; i++) sum += lane[i];
  for (int64_t c = d16; c < d; c++) sum += x[c];
  const float m = static_cast<float>(sum / d);
  acc = vzero();
  for (int64_t c = 0; c < d16; c += 16) {
    const V t = vsub(vload(x + c), vset1(m));
    acc = vadd(acc, vmul(t, t));
  }
  vstore(lane, acc);
  double sq = 0.0;
  for (int i = 0; i < 16; i++) sq += lane[i];
  for (int64_t c = d16; c < d; c++) {
    const float t = x[c] - m;
    sq += static_cast<double>(t * t);
  }
  const float rstd = static_cast<float>(1.0 / std::sqrt(sq / d + eps));
  for (int64_t c = 0; c < d16; c += 16)
    vstore(y + c, vadd(vmul(vmul(vsub(vload(x + c), vset1(m)), vset1(rstd)), vload(w + c)), vload(b + c)));
  for (int64_t c = d16; c < d; c++) {
    const float t = (x[c] - m) * rstd;  // as the vectors: no contraction into an FMA
    const float u = t * w[c];
    y[c] = u + b[c];
  }
}

// x[0 .. n) += y[0 .. n)
void add_row(float* x, const float* y, int64_t n) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) vstore(x + c, vadd(vload(x + c), vload(y + c)));
  for (; c < n; c++) x[c] += y[c];
}

// y[0 .. n) = x[0 .. n) rounded to IEEE fp16 (nearest even), as bits
void to_half_row(const float* x, uint16_t* y, int64_t n) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) vstore_f16(y + c, vload(x + c));
  for (; c < n; c++) y[c] = _cvtss_sh(x[c], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// Top-p's two vector passes over a row of logits less their max (ops.cpp: top_p_ does the rest, in scalar code
// built for any x86-64). exp_bins_row: w = e^x (0 below -87, where e^x < 2e-38, and for -inf and NaN) and each
// x's bin of width 1 / TOP_P_PER_UNIT from the top (bin 0 at x >= 0; TOP_P_BINS - 1 at the bottom, and for NaN).
// cut_row: every x below `cut` (or NaN) -> -inf. A row's last n % 16 go through the same vector code, padded.
static inline void exp_bins16(const float* x, float* w, uint16_t* bin) {
  const V v = vload(x), zero = vzero();
  vstore(w, vwhere_ge(v, vset1(-87.0f), vexp(v), zero));
  vstore_u16(bin, vmax(vmin(vmul(v, vset1(-TOP_P_PER_UNIT)), vset1(float(TOP_P_BINS - 1))), zero));  // min(NaN, b) = b
}

void exp_bins_row(const float* x, float* w, uint16_t* bin, int64_t n) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) exp_bins16(x + c, w + c, bin + c);
  if (c < n) {
    float xt[16], wt[16];
    uint16_t bt[16];
    for (int i = 0; i < 16; i++) xt[i] = c + i < n ? x[c + i] : -INFINITY;
    exp_bins16(xt, wt, bt);
    for (int64_t i = 0; c + i < n; i++) w[c + i] = wt[i], bin[c + i] = bt[i];
  }
}

void cut_row(float* x, int64_t n, float cut) {
  const V t = vset1(cut), drop = vset1(-INFINITY);
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const V v = vload(x + c);
    vstore(x + c, vwhere_ge(v, t, v, drop));
  }
  for (; c < n; c++)
    if (!(x[c] >= cut)) x[c] = -INFINITY;
}

void linear_range(const LinearArgs& a, int64_t sb0, int64_t sb1) {
  switch (a.format) {
    case F32: run<F32>(a, sb0, sb1); break;
    case BF16: run<BF16>(a, sb0, sb1); break;
    case I8: run<I8>(a, sb0, sb1); break;
    case I4: run<I4>(a, sb0, sb1); break;
  }
}

}  // namespace ISA
}  // namespace gpt2ffn
