// The AVX2 integer tile's inner step, three ways, timed alone: what each 32 int8 products cost one row of
// qtile8 (csrc/qvec_avx2.h), 8 rows' sums in flight as there. Not part of the package or CI.
//
//   g++ -O2 -mavx2 -mfma -o /tmp/int8_dot_avx2 benchmarks/int8_dot_avx2.cpp && taskset -c 1 /tmp/int8_dot_avx2
//
// - sign trick (ours, exact; llama.cpp's for q8_0 on AVX2): vpsignb, vpmaddubsw, vpmaddwd, vpaddd;
// - u8 x s8 with vpmaddubsw's 16-bit saturation (what oneDNN does without VNNI): no vpsignb, not exact;
// - int16 weights, vpmaddwd alone: exact, two per 32 products.
// README ("AMD EPYC Zen 3, AVX2 only") quotes it.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
template <int KIND> __attribute__((noinline)) __m256i run(long n, __m256i w, __m256i aw, __m256i w16a, __m256i w16b, const int* x) {
  __m256i acc[8]; for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
  const __m256i one = _mm256_set1_epi16(1);
  for (long it = 0; it < n; it++) {
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) {
      __m256i xb = _mm256_set1_epi32(x[(it + r) & 63]);
      if (KIND == 0) {  // sign trick: vpsignb + vpmaddubsw + vpmaddwd + vpaddd
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, w)), one));
      } else if (KIND == 1) {  // u8 x s8, saturating: vpmaddubsw + vpmaddwd + vpaddd
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, xb), one));
      } else {  // int16 weights: 2 x (vpmaddwd + vpaddd) per 32 products
        __m256i xq = _mm256_set1_epi64x(((long long)x[(it + r) & 63] << 32) | (unsigned)x[(it + r + 1) & 63]);
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(w16a, xq));
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(w16b, xq));
      }
    }
    asm volatile("" ::: "memory");
  }
  __m256i s = acc[0]; for (int i = 1; i < 8; i++) s = _mm256_xor_si256(s, acc[i]); return s;
}
int main() {
  alignas(64) int x[64]; for (int i = 0; i < 64; i++) x[i] = 0x01020304 * (i + 1);
  __m256i w = _mm256_set1_epi8(3), aw = _mm256_set1_epi8(5), a = _mm256_set1_epi16(7), b = _mm256_set1_epi16(9);
  const long n = 20000000;
  const char* names[3] = {"sign trick (vpsignb+maddubs+madd+add)", "u8s8 saturating (maddubs+madd+add)", "int16 (2x madd+add)"};
  for (int rep = 0; rep < 3; rep++)
    for (int k = 0; k < 3; k++) {
      auto t0 = std::chrono::steady_clock::now();
      __m256i r = k == 0 ? run<0>(n, w, aw, a, b, x) : k == 1 ? run<1>(n, w, aw, a, b, x) : run<2>(n, w, aw, a, b, x);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      printf("%-40s %.3f ns per row-step of 32 products (%d)\n", names[k], s / n / 8 * 1e9, _mm256_extract_epi32(r, 0) & 1);
    }
}
