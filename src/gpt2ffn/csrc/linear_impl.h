// The kernels of linear.h, on 16-wide float vectors `V` and helpers (vload, vfma, ...) that an ISA file
// defines in namespace gpt2ffn::ISA before including this header. The ISA files are compiled with their
// target pragma and include no torch header, so no inline function of torch's is ever built for an
// instruction set the CPU may lack.
#pragma once
#include "linear.h"

namespace gpt2ffn {
namespace ISA {

// Sums run in chunks of CHUNK inputs (a quantized layer's group): each chunk into its own accumulator,
// added to the total at the chunk's end. The rounding error of a K-long sum then grows with
// CHUNK + K / CHUNK instead of K (fp32 logits of GPT-2 stay within 1e-6 of max|logits| of HF's).
constexpr int64_t CHUNK = 64;

template <int FMT, int MR, int NB>
static inline void tile(const LinearArgs& a, const float* x, float* y, int64_t blk) {
  const int64_t K = a.K, ldx = a.ldx;
  constexpr bool quantized = FMT == I8 || FMT == I4;
  const int64_t C = quantized ? a.group : CHUNK;
  const int64_t ngroups = quantized ? K / C : 0;
  V acc[MR][NB], part[MR][NB];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < NB; j++) acc[m][j] = vzero();
  for (int64_t k0 = 0; k0 < K; k0 += C) {
    const int64_t k1 = k0 + C < K ? k0 + C : K;
    for (int m = 0; m < MR; m++)
      for (int j = 0; j < NB; j++) part[m][j] = vzero();
    if constexpr (!quantized) {
      for (int64_t k = k0; k < k1; k++) {
        V w[NB];
        for (int j = 0; j < NB; j++) {
          const int64_t off = ((blk + j) * K + k) * 16;
          if constexpr (FMT == F32) w[j] = vload(static_cast<const float*>(a.w) + off);
          else w[j] = vload_bf16(static_cast<const uint16_t*>(a.w) + off);
        }
        for (int m = 0; m < MR; m++) {
          const V xb = vset1(x[m * ldx + k]);
          for (int j = 0; j < NB; j++) part[m][j] = vfma(xb, w[j], part[m][j]);
        }
      }
    } else {
      const int64_t g = k0 / C;
      V s[NB];
      for (int j = 0; j < NB; j++) s[j] = vload(a.scale + ((blk + j) * ngroups + g) * 16);
      if constexpr (FMT == I8) {
        for (int64_t k = k0; k < k1; k++) {
          V w[NB];
          for (int j = 0; j < NB; j++)
            w[j] = vmul(vload_i8(static_cast<const int8_t*>(a.w) + ((blk + j) * K + k) * 16), s[j]);
          for (int m = 0; m < MR; m++) {
            const V xb = vset1(x[m * ldx + k]);
            for (int j = 0; j < NB; j++) part[m][j] = vfma(xb, w[j], part[m][j]);
          }
        }
      } else {
        V o[NB];
        for (int j = 0; j < NB; j++) o[j] = vmul(s[j], vset1(-8.0f));
        for (int64_t k = k0; k < k1; k += 2) {
          V lo[NB], hi[NB];
          for (int j = 0; j < NB; j++) {
            vload_u4(static_cast<const uint8_t*>(a.w) + ((blk + j) * (K / 2) + k / 2) * 16, lo[j], hi[j]);
            lo[j] = vfma(lo[j], s[j], o[j]);  // (q - 8) * s
            hi[j] = vfma(hi[j], s[j], o[j]);
          }
          for (int m = 0; m < MR; m++) {
            const V x0 = vset1(x[m * ldx + k]);
            for (int j = 0; j < NB; j++) part[m][j] = vfma(x0, lo[j], part[m][j]);
          }
          for (int m = 0; m < MR; m++) {
            const V x1 = vset1(x[m * ldx + k + 1]);
            for (int j = 0; j < NB; j++) part[m][j] = vfma(x1, hi[j], part[m][j]);
          }
        }
      }
    }
    for (int m = 0; m < MR; m++)
      for (int j = 0; j < NB; j++) acc[m][j] = vadd(acc[m][j], part[m][j]);
  }
  for (int j = 0; j < NB; j++) {
    const V b = a.bias ? vload(a.bias + (blk + j) * 16) : vzero();
    for (int m = 0; m < MR; m++) vstore(y + m * a.ldy + (blk + j) * 16, vadd(acc[m][j], b));
  }
}

// Rows in tiles of up to 6 (x reused from cache, each weight vector loaded once per tile); outputs in
// super-blocks of 4 blocks (64 lanes), as 4 chains for 1-2 rows and 2 x 2 for more.
template <int FMT>
static void run(const LinearArgs& a, int64_t sb0, int64_t sb1) {
  for (int64_t sb = sb0; sb < sb1; sb++) {
    const int64_t blk = 4 * sb;
    for (int64_t m = 0; m < a.M;) {
      const float* x = a.x + m * a.ldx;
      float* y = a.y + m * a.ldy;
      const int64_t r = a.M - m;
      if (r >= 6) { tile<FMT, 6, 2>(a, x, y, blk); tile<FMT, 6, 2>(a, x, y, blk + 2); m += 6; }
      else if (r >= 4) { tile<FMT, 4, 2>(a, x, y, blk); tile<FMT, 4, 2>(a, x, y, blk + 2); m += 4; }
      else if (r == 3) { tile<FMT, 3, 2>(a, x, y, blk); tile<FMT, 3, 2>(a, x, y, blk + 2); m += 3; }
      else if (r == 2) { tile<FMT, 2, 4>(a, x, y, blk); m += 2; }
      else { tile<FMT, 1, 4>(a, x, y, blk); m += 1; }
    }
  }
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
