// The kernels of linear.h, on 16-wide float vectors `V` and helpers (vload, vfma, ...) that an ISA file
// defines in namespace gpt2ffn::ISA before including this header. The ISA files are compiled with their
// target pragma and include no torch header, so no inline function of torch's is ever built for an
// instruction set the CPU may lack.
#pragma once
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

template <int FMT, int MR, int NB>
static inline void tile(const LinearArgs& a, const float* x, float* y, int64_t sb, int j0) {
  const int64_t K = a.K, ldx = a.ldx;
  constexpr bool quantized = FMT == I8 || FMT == I4;
  const int64_t C = quantized ? a.group : CHUNK;
  const int64_t ngroups = quantized ? K / C : 0;
  const int64_t rows = FMT == I4 ? K / 2 : K;  // rows of 64 lanes in this super-block
  V acc[MR][NB], part[MR][NB];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < NB; j++) acc[m][j] = vzero();
  for (int64_t k0 = 0; k0 < K; k0 += C) {
    const int64_t k1 = k0 + C < K ? k0 + C : K;
    for (int m = 0; m < MR; m++)
      for (int j = 0; j < NB; j++) part[m][j] = vzero();
    if constexpr (FMT == I4) {
      for (int64_t k = k0; k < k1; k += 2) {
        V lo[NB], hi[NB];
        for (int j = 0; j < NB; j++)
          vload_s4(static_cast<const uint8_t*>(a.w) + (sb * rows + k / 2) * SUPER + (j0 + j) * 16, lo[j], hi[j]);
        for (int m = 0; m < MR; m++) {
          const V x0 = vset1(x[m * ldx + k]), x1 = vset1(x[m * ldx + k + 1]);
          for (int j = 0; j < NB; j++) part[m][j] = vfma(x1, hi[j], vfma(x0, lo[j], part[m][j]));
        }
      }
    } else {
      for (int64_t k = k0; k < k1; k++) {
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
    const V b = a.bias ? vload(a.bias + col) : vzero();
    for (int m = 0; m < MR; m++) vstore(y + m * a.ldy + col, activate(vadd(acc[m][j], b), a.act));
  }
}

// Rows in tiles of up to 6 (x reused from cache, each weight vector loaded once per tile); outputs in
// super-blocks of 64 lanes, as 4 chains for 1-2 rows and 2 x 2 for more.
template <int FMT>
static void run(const LinearArgs& a, int64_t sb0, int64_t sb1) {
  for (int64_t sb = sb0; sb < sb1; sb++) {
    for (int64_t m = 0; m < a.M;) {
      const float* x = a.x + m * a.ldx;
      float* y = a.y + m * a.ldy;
      const int64_t r = a.M - m;
      if (r >= 6) { tile<FMT, 6, 2>(a, x, y, sb, 0); tile<FMT, 6, 2>(a, x, y, sb, 2); m += 6; }
      else if (r >= 4) { tile<FMT, 4, 2>(a, x, y, sb, 0); tile<FMT, 4, 2>(a, x, y, sb, 2); m += 4; }
      else if (r == 3) { tile<FMT, 3, 2>(a, x, y, sb, 0); tile<FMT, 3, 2>(a, x, y, sb, 2); m += 3; }
      else if (r == 2) { tile<FMT, 2, 4>(a, x, y, sb, 0); m += 2; }
      else { tile<FMT, 1, 4>(a, x, y, sb, 0); m += 1; }
    }
  }
}

void attend(const AttendArgs& a) {
  const int64_t hd = a.hd, L = a.L;
  float mx = -3.4e38f;
  for (int64_t j = 0; j < L; j++) {
    V s = vzero();
    for (int64_t i = 0; i < hd; i += 16) s = vfma(vload(a.q + i), vload(a.k + j * hd + i), s);
    const float sj = vsum(s) * a.scale;
    a.scores[j] = sj;
    mx = sj > mx ? sj : mx;
  }
  float total = 0.0f;
  for (int64_t j = 0; j < L; j++) total += (a.scores[j] = std::exp(a.scores[j] - mx));
  const float inv = 1.0f / total;
  for (int64_t i = 0; i < hd; i += 16) {
    V o = vzero();
    for (int64_t j = 0; j < L; j++) o = vfma(vset1(a.scores[j]), vload(a.v + j * hd + i), o);
    vstore(a.out + i, vmul(o, vset1(inv)));
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
