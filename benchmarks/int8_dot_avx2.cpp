// The AVX2 integer tile's inner step, three ways, timed alone: what each 32 int8 products cost one row of
// qtile8 (csrc/qvec_avx2.h), as there: a step loads one register of weights (8 lanes x 4 k) from L1, prepares
// it once, and meets 8 rows' activations (each row's 4 bytes broadcast from L1), 8 rows' sums in registers.
// Not part of the package or CI.
//
//   g++ -O2 -mavx2 -mfma -o /tmp/int8_dot_avx2 benchmarks/int8_dot_avx2.cpp && taskset -c 1 /tmp/int8_dot_avx2
//
// - sign trick (ours, exact; llama.cpp's for q8_0 on AVX2): per step vpxor + vpsignb on the weights, per row
//   vpbroadcastd, vpsignb, vpmaddubsw, vpmaddwd, vpaddd;
// - u8 x s8 with vpmaddubsw's 16-bit saturation (what oneDNN does without VNNI): no vpsignb, not exact;
// - int16 (exact): the weight bytes zero-extended to int16 once a step (2 x vpmovzxbw), each row's 4 k as int16
//   broadcast (vpbroadcastq), 2 x (vpmaddwd + vpaddd) a row.
// The sums stay in registers: an earlier version fenced each step with a memory clobber, which kept them on the
// stack (a store and a reload per row and step) and timed that instead. README ("AMD EPYC Zen 3, AVX2 only")
// quotes it.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

constexpr int STEPS = 64;  // steps in the L1 buffers, walked round and round
alignas(64) uint8_t W[STEPS][32];
alignas(64) int8_t X[STEPS][8][4];
alignas(64) int16_t X16[STEPS][8][4];

template <int KIND>
__attribute__((noinline)) __m256i run(long n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;  // int16: the second half
  const __m256i one = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (long it = 0; it < n; it++) {
    const int s = static_cast<int>(it & (STEPS - 1));
    const __m256i wb = _mm256_load_si256(reinterpret_cast<const __m256i*>(W[s]));
    if constexpr (KIND == 0) {  // sign trick: |q| and q once, then vpsignb + vpmaddubsw + vpmaddwd + vpaddd a row
      const __m256i q = _mm256_xor_si256(wb, flip), aq = _mm256_sign_epi8(q, q);
#define ROW(acc, r) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aq, \
          _mm256_sign_epi8(_mm256_set1_epi32(*reinterpret_cast<const int32_t*>(X[s][r])), q)), one));
      ROW(a0, 0) ROW(a1, 1) ROW(a2, 2) ROW(a3, 3) ROW(a4, 4) ROW(a5, 5) ROW(a6, 6) ROW(a7, 7)
#undef ROW
    } else if constexpr (KIND == 1) {  // u8 x s8, saturating: vpmaddubsw + vpmaddwd + vpaddd a row
#define ROW(acc, r) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(wb, \
          _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(X[s][r]))), one));
      ROW(a0, 0) ROW(a1, 1) ROW(a2, 2) ROW(a3, 3) ROW(a4, 4) ROW(a5, 5) ROW(a6, 6) ROW(a7, 7)
#undef ROW
    } else {  // int16: lanes 0-3 and 4-7 zero-extended, 2 x (vpmaddwd + vpaddd) a row
      const __m256i lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(wb));
      const __m256i hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(wb, 1));
#define ROW(acc, acc2, r) { const __m256i x = _mm256_set1_epi64x(*reinterpret_cast<const int64_t*>(X16[s][r])); \
          acc = _mm256_add_epi32(acc, _mm256_madd_epi16(lo, x)); acc2 = _mm256_add_epi32(acc2, _mm256_madd_epi16(hi, x)); }
      ROW(a0, b0, 0) ROW(a1, b1, 1) ROW(a2, b2, 2) ROW(a3, b3, 3) ROW(a4, b4, 4) ROW(a5, b5, 5) ROW(a6, b6, 6)
      ROW(a7, b7, 7)
#undef ROW
    }
  }
  const __m256i a = _mm256_xor_si256(_mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)),
                                     _mm256_xor_si256(_mm256_xor_si256(a4, a5), _mm256_xor_si256(a6, a7)));
  const __m256i b = _mm256_xor_si256(_mm256_xor_si256(_mm256_xor_si256(b0, b1), _mm256_xor_si256(b2, b3)),
                                     _mm256_xor_si256(_mm256_xor_si256(b4, b5), _mm256_xor_si256(b6, b7)));
  return _mm256_xor_si256(a, b);
}

int main() {
  for (int s = 0; s < STEPS; s++) {
    for (int i = 0; i < 32; i++) W[s][i] = static_cast<uint8_t>(1 + (s * 37 + i * 11) % 255);
    for (int r = 0; r < 8; r++)
      for (int i = 0; i < 4; i++) X[s][r][i] = X16[s][r][i] = static_cast<int8_t>((s * 13 + r * 7 + i * 5) % 255 - 127);
  }
  const long n = 20000000;
  const char* names[3] = {"sign trick (vpsignb+maddubs+madd+add)", "u8s8 saturating (maddubs+madd+add)",
                          "int16 (2 x madd+add)"};
  for (int rep = 0; rep < 3; rep++)
    for (int k = 0; k < 3; k++) {
      auto t0 = std::chrono::steady_clock::now();
      const __m256i r = k == 0 ? run<0>(n) : k == 1 ? run<1>(n) : run<2>(n);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      printf("%-40s %.3f ns per row-step of 32 products (%d)\n", names[k], s / n / 8 * 1e9, _mm256_extract_epi32(r, 0) & 1);
    }
}
