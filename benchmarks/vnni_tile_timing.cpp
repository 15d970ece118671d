// The AVX-512 VNNI prefill tile (csrc/qlinear_impl.h: qtile, int8 weights on int8 activations) as a
// microbenchmark: one core, one GPT-2 layer's super-block (64 lanes x K inputs, 64 KiB at K = 1024: L2, not L1)
// read by every tile of MR rows over 128 rows (the rows a whole number of tiles covers), G products per second
// per tile shape (MR rows x NB blocks of 16 lanes). "epilogue": each group of 32's float scaling as the kernel
// does it (fp16 scale, cvt, multiply, FMA); "no epilogue": one add in its place. Left out: the kernel's prefetch
// of the next super-block and its bias / activation store. EMB: the activations' 4 bytes as vpdpbusd's embedded
// broadcast ({1to16}, inline asm) instead of a vpbroadcastd the row's NB products share. Not part of the
// package or CI.
//
//   g++ -O3 -march=native -ffp-contract=off -DKK=1024 -o /tmp/vnni_tile benchmarks/vnni_tile_timing.cpp
//   g++ -O3 -march=native -ffp-contract=off -DKK=1024 -DEMB -o /tmp/vnni_tile_emb benchmarks/vnni_tile_timing.cpp
//   taskset -c 1 /tmp/vnni_tile; taskset -c 1 /tmp/vnni_tile_emb
//
// README ("AMD EPYC Zen 5") quotes it; results/vnni-tile-timing-zen5.txt.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <algorithm>
#ifndef KK
#define KK 1024
#endif
constexpr int K = KK, NG = K / 32, SUPER = 64, M = 128; volatile int GV = 32;
alignas(64) uint8_t Wt[(K / 4) * SUPER * 4];
alignas(64) int8_t X[M * K];
alignas(64) float XS[M * NG]; alignas(64) int32_t XSUM[M * NG];
alignas(64) uint16_t SC[NG * SUPER];
alignas(64) float Y[M * SUPER];
static inline __m512i dpb(__m512i acc, __m512i w, const int8_t* x) {
#ifdef EMB
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)x));
  return acc;
#else
  int32_t x4; std::memcpy(&x4, x, 4); return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4));
#endif
}
template <int MR, int NB, bool EPI>
__attribute__((noinline)) void tile(int m0, int j0) { const int G = GV;
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; m++) for (int j = 0; j < NB; j++) acc[m][j] = _mm512_setzero_ps();
  for (int g = 0; g < NG; g++) {
    __m512i part[MR][NB];
    for (int m = 0; m < MR; m++) { __m512i s = _mm512_set1_epi32(-128 * XSUM[(m0 + m) * NG + g]); for (int j = 0; j < NB; j++) part[m][j] = s; }
    const uint8_t* wk = Wt + g * (G / 4) * SUPER * 4 + j0 * 64;
    for (int k = g * G; k < (g + 1) * G; k += 4, wk += SUPER * 4) {
      __m512i w[NB];
      for (int j = 0; j < NB; j++) w[j] = _mm512_loadu_si512(wk + j * 64);
      for (int m = 0; m < MR; m++) {
        for (int j = 0; j < NB; j++) part[m][j] = dpb(part[m][j], w[j], X + (m0 + m) * K + k);
      }
    }
    if (EPI) {
      for (int j = 0; j < NB; j++) {
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(SC + g * SUPER + (j0 + j) * 16)));
        for (int m = 0; m < MR; m++)
          acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[m][j]), _mm512_mul_ps(s, _mm512_set1_ps(XS[(m0 + m) * NG + g])), acc[m][j]);
      }
    } else {
      for (int m = 0; m < MR; m++) for (int j = 0; j < NB; j++) acc[m][j] = _mm512_add_ps(acc[m][j], _mm512_castsi512_ps(part[m][j]));
    }
  }
  for (int m = 0; m < MR; m++) for (int j = 0; j < NB; j++) _mm512_storeu_ps(Y + (m0 + m) * SUPER + (j0 + j) * 16, acc[m][j]);
}
template <int MR, int NB, bool EPI>
void run(const char* name) {
  const int reps = 2000 * 256 / K;
  double best = 1e30;
  for (int r = 0; r < 5; r++) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; i++) for (int m0 = 0; m0 + MR <= M; m0 += MR) for (int j0 = 0; j0 < 4; j0 += NB) tile<MR, NB, EPI>(m0, j0);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
  }
  double macs = double(reps) * (M / MR * MR) * K * SUPER;
  printf("%-26s %6.1f G products/s\n", name, macs / best / 1e9);
}
int main() {
  for (auto& v : Wt) v = 100; for (auto& v : X) v = 3; for (auto& v : XS) v = 0.01f; for (auto& v : SC) v = 0x3c00;
#define R(a, b) run<a, b, true>(#a "x" #b " epilogue"); run<a, b, false>(#a "x" #b " no epilogue");
  R(4, 2) R(6, 2) R(8, 2) R(4, 4) R(2, 4) R(5, 2) R(3, 4) R(12, 1) R(8, 1)
}
