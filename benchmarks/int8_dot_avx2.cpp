// The AVX2 integer tile's inner step, several ways, timed alone: what 32 int8 products cost, as in qtile8
// (csrc/qvec_avx2.h): a step loads weights from L1, prepares them once, and meets each row's activations (4
// bytes broadcast from L1); the sums stay in registers. Not part of the package or CI.
//
//   g++ -O2 -mavx2 -mfma -o /tmp/int8_dot_avx2 benchmarks/int8_dot_avx2.cpp && taskset -c 1 /tmp/int8_dot_avx2
//
// - 8 x 8, sign trick (ours, exact; llama.cpp's for q8_0 on AVX2): 8 rows, one register of 8 lanes; per step
//   vpxor + vpsignb on the weights, per row vpbroadcastd, vpsignb, vpmaddubsw, vpmaddwd, vpaddd;
// - 8 x 8, u8 x s8 with vpmaddubsw's 16-bit saturation (oneDNN's and ONNX Runtime's without VNNI): no vpsignb,
//   not exact;
// - 4 x 16, both ways: ONNX Runtime's MLAS tile (QgemmU8S8KernelAvx2: 4 rows, two registers, each broadcast
//   meets both);
// - int16 (exact): the weight bytes sign-extended to int16 once a step, each row's 4 k stored as int16 and
//   broadcast (vpbroadcastq), 2 x vpmaddwd + 2 x vpaddd a row;
// - rows in lanes (exact, 2 multiply-pipe instructions per 32 products, not 3): a register holds 8 rows' 4 k,
//   stored 16 times, once per sign pattern of 4 weights (pattern p negates bytes k % 4 in p's bits); per output
//   column, |q| broadcast and the copy for q's pattern loaded, then vpmaddubsw + vpmaddwd + vpaddd. |q| and the
//   pattern's byte offset are stored with the weights here, the best case for it.
// - |x| times q ^ s(x) (exact, what qvec_avx2.h's qgroup_xsign does): s(x) = 0xFF for x < 0, so the product is
//   x * q - |x| there, added back once a group; per row and step two broadcasts (|x|, and s(x) ^ 0x80 for the
//   stored q + 128), per register vpxor + vpmaddubsw + vpmaddwd + vpaddd, no vpsignb; as 8 x 8, 4 x 16, 2 x 32
//   (weights from memory or in registers) and 1 x 64 (one row, the 8 registers of a super-block).
// Each row's sum passes through an empty asm: without it GCC reassociated the rows' chains. Best of 5 runs.
// README ("AMD EPYC Zen 3, AVX2 only": "Why, layer by layer") quotes it.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>

constexpr int STEPS = 64;  // steps in the L1 buffers, walked round and round
alignas(64) uint8_t W[STEPS][64];
alignas(64) int8_t X[STEPS][8][4];
alignas(64) int16_t X16[STEPS][8][4];
alignas(64) int8_t XV[STEPS][16][32];  // rows in lanes: 8 rows' 4 k per sign pattern
alignas(64) uint8_t AQ[STEPS][32];     // |q| of 8 columns' 4 k
alignas(64) uint16_t OFF[STEPS][8];    // each column's pattern, as a byte offset into XV[step]
alignas(64) uint8_t XA[STEPS][8][4];   // |x|
alignas(64) uint8_t XM[STEPS][8][4];   // 0x80 ^ (x < 0 ? 0xFF : 0)

static inline __m256i xdot(__m256i c, __m256i u, __m256i q, __m256i f, __m256i one) {  // c + |x| * (q ^ s)
  return _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_xor_si256(q, f)), one));
}
static inline __m256i bcast(int s, int r) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(X[s][r])); }

// KIND: 0 8x8 sign trick, 1 8x8 saturating, 2 4x16 sign trick, 3 4x16 saturating, 4 int16, 5 rows in lanes
template <int KIND>
__attribute__((noinline)) __m256i run(long n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  const __m256i one = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (long it = 0; it < n; it++) {
    const int s = static_cast<int>(it & (STEPS - 1));
    const __m256i wb = _mm256_load_si256(reinterpret_cast<const __m256i*>(W[s]));
    if constexpr (KIND == 0 || KIND == 1) {
      const __m256i q = _mm256_xor_si256(wb, flip), aq = _mm256_sign_epi8(q, q);
      auto row = [&](__m256i& acc, int r) {
        const __m256i x = KIND == 0 ? _mm256_sign_epi8(bcast(s, r), q) : bcast(s, r);
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(KIND == 0 ? aq : wb, x), one));
        asm("" : "+x"(acc));
      };
      row(a0, 0), row(a1, 1), row(a2, 2), row(a3, 3), row(a4, 4), row(a5, 5), row(a6, 6), row(a7, 7);
    } else if constexpr (KIND == 2 || KIND == 3) {
      const __m256i wb1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(W[s] + 32));
      const __m256i q0 = _mm256_xor_si256(wb, flip), aq0 = _mm256_sign_epi8(q0, q0);
      const __m256i q1 = _mm256_xor_si256(wb1, flip), aq1 = _mm256_sign_epi8(q1, q1);
      auto row = [&](__m256i& acc0, __m256i& acc1, int r) {
        const __m256i x = bcast(s, r);
        const __m256i x0 = KIND == 2 ? _mm256_sign_epi8(x, q0) : x, x1 = KIND == 2 ? _mm256_sign_epi8(x, q1) : x;
        acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_maddubs_epi16(KIND == 2 ? aq0 : wb, x0), one));
        acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_maddubs_epi16(KIND == 2 ? aq1 : wb1, x1), one));
        asm("" : "+x"(acc0), "+x"(acc1));
      };
      row(a0, a1, 0), row(a2, a3, 1), row(a4, a5, 2), row(a6, a7, 3);
    } else if constexpr (KIND == 5) {
      const char* xv = reinterpret_cast<const char*>(XV[s]);
      auto col = [&](__m256i& acc, int c) {
        const __m256i w = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(AQ[s] + 4 * c));
        const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(xv + OFF[s][c]));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), one));
        asm("" : "+x"(acc));
      };
      col(a0, 0), col(a1, 1), col(a2, 2), col(a3, 3), col(a4, 4), col(a5, 5), col(a6, 6), col(a7, 7);
    } else if constexpr (KIND == 6) {
      auto row = [&](__m256i& acc, int r) {
        const __m256i ax = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(XA[s][r]));
        const __m256i mx = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(XM[s][r]));
        acc = xdot(acc, ax, wb, mx, one);
        asm("" : "+x"(acc));
      };
      row(a0, 0), row(a1, 1), row(a2, 2), row(a3, 3), row(a4, 4), row(a5, 5), row(a6, 6), row(a7, 7);
    } else if constexpr (KIND == 7) {  // 4 rows x 2 registers, xor trick
      const __m256i wb1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(W[s] + 32));
      auto row = [&](__m256i& acc0, __m256i& acc1, int r) {
        const __m256i ax = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(XA[s][r]));
        const __m256i mx = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(XM[s][r]));
        acc0 = xdot(acc0, ax, wb, mx, one);
        acc1 = xdot(acc1, ax, wb1, mx, one);
        asm("" : "+x"(acc0), "+x"(acc1));
      };
      row(a0, a1, 0), row(a2, a3, 1), row(a4, a5, 2), row(a6, a7, 3);
    } else if constexpr (KIND == 8) {  // 2 rows x 4 registers, xor trick, weights from memory
      const __m256i* wp = reinterpret_cast<const __m256i*>(W[s]);
      const __m256i* wp2 = reinterpret_cast<const __m256i*>(W[(s + 1) & (STEPS - 1)]);
      auto row = [&](__m256i& c0, __m256i& c1, __m256i& c2, __m256i& c3, int r) {
        const __m256i ax = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(XA[s][r]));
        const __m256i mx = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(XM[s][r]));
        c0 = xdot(c0, ax, _mm256_load_si256(wp), mx, one);
        c1 = xdot(c1, ax, _mm256_load_si256(wp + 1), mx, one);
        c2 = xdot(c2, ax, _mm256_load_si256(wp2), mx, one);
        c3 = xdot(c3, ax, _mm256_load_si256(wp2 + 1), mx, one);
        asm("" : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3));
      };
      row(a0, a1, a2, a3, 0), row(a4, a5, a6, a7, 1);
    } else if constexpr (KIND == 9) {  // 1 row x 8 registers, xor trick, weights from memory (4 steps' rows)
      const __m256i* wp = reinterpret_cast<const __m256i*>(W[s]);
      const __m256i* wq = reinterpret_cast<const __m256i*>(W[(s + 1) & (STEPS - 1)]);
      const __m256i* wr = reinterpret_cast<const __m256i*>(W[(s + 2) & (STEPS - 1)]);
      const __m256i* wt = reinterpret_cast<const __m256i*>(W[(s + 3) & (STEPS - 1)]);
      const __m256i ax = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(XA[s][0]));
      const __m256i mx = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(XM[s][0]));
      auto reg = [&](__m256i& c, const __m256i* w) {
        c = xdot(c, ax, _mm256_load_si256(w), mx, one);
        asm("" : "+x"(c));
      };
      reg(a0, wp), reg(a1, wp + 1), reg(a2, wq), reg(a3, wq + 1);
      reg(a4, wr), reg(a5, wr + 1), reg(a6, wt), reg(a7, wt + 1);
    } else if constexpr (KIND == 10) {  // 2 rows x 4 registers, xor trick, weights in registers
      const __m256i* wp = reinterpret_cast<const __m256i*>(W[s]);
      const __m256i* wq = reinterpret_cast<const __m256i*>(W[(s + 1) & (STEPS - 1)]);
      const __m256i w0 = _mm256_load_si256(wp), w1 = _mm256_load_si256(wp + 1), w2 = _mm256_load_si256(wq),
                    w3 = _mm256_load_si256(wq + 1);
      auto row = [&](__m256i& c0, __m256i& c1, __m256i& c2, __m256i& c3, int r) {
        const __m256i ax = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(XA[s][r]));
        const __m256i mx = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(XM[s][r]));
        c0 = xdot(c0, ax, w0, mx, one);
        c1 = xdot(c1, ax, w1, mx, one);
        c2 = xdot(c2, ax, w2, mx, one);
        c3 = xdot(c3, ax, w3, mx, one);
        asm("" : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3));
      };
      row(a0, a1, a2, a3, 0), row(a4, a5, a6, a7, 1);
    } else {
      const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(wb));
      const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(wb, 1));
      auto row = [&](__m256i& acc, int r) {
        const __m256i x = _mm256_set1_epi64x(*reinterpret_cast<const int64_t*>(X16[s][r]));
        acc = _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(lo, x), _mm256_madd_epi16(hi, x)));
        asm("" : "+x"(acc));
      };
      row(a0, 0), row(a1, 1), row(a2, 2), row(a3, 3), row(a4, 4), row(a5, 5), row(a6, 6), row(a7, 7);
    }
  }
  return _mm256_xor_si256(_mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)),
                          _mm256_xor_si256(_mm256_xor_si256(a4, a5), _mm256_xor_si256(a6, a7)));
}

template <int KIND>
void time_it(const char* name) {
  const long n = 20000000;  // steps; each is 8 x 32 products
  int bit = _mm256_extract_epi32(run<KIND>(n / 10), 0) & 1;
  double best = 1e9;
  for (int r = 0; r < 5; r++) {
    const auto t0 = std::chrono::steady_clock::now();
    bit ^= _mm256_extract_epi32(run<KIND>(n), 0) & 1;
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  printf("%-34s %.3f ns per 32 products (%d)\n", name, best / (n * 8.0) * 1e9, bit);
}

int main() {
  for (int s = 0; s < STEPS; s++) {
    for (int i = 0; i < 64; i++) W[s][i] = static_cast<uint8_t>(1 + (s * 37 + i * 11) % 255);
    for (int r = 0; r < 8; r++)
      for (int i = 0; i < 4; i++) {
        X[s][r][i] = X16[s][r][i] = static_cast<int8_t>((s * 13 + r * 7 + i * 5) % 255 - 127);
        XA[s][r][i] = static_cast<uint8_t>(X[s][r][i] < 0 ? -X[s][r][i] : X[s][r][i]);
        XM[s][r][i] = X[s][r][i] < 0 ? 0x7F : 0x80;
      }
    for (int p = 0; p < 16; p++)
      for (int i = 0; i < 32; i++) XV[s][p][i] = static_cast<int8_t>((p >> (i % 4) & 1 ? -1 : 1) * X[s][i / 4][i % 4]);
    for (int c = 0; c < 8; c++) {
      int p = 0;
      for (int i = 0; i < 4; i++) {
        const int q = W[s][4 * c + i] - 128;
        AQ[s][4 * c + i] = static_cast<uint8_t>(q < 0 ? -q : q);
        p |= (q < 0) << i;
      }
      OFF[s][c] = static_cast<uint16_t>(p * 32);
    }
  }
  time_it<0>("8 x 8 sign trick (ours, exact)");
  time_it<1>("8 x 8 u8s8 saturating");
  time_it<2>("4 x 16 sign trick (exact)");
  time_it<3>("4 x 16 u8s8 saturating (MLAS)");
  time_it<4>("8 x 8 int16 vpmaddwd (exact)");
  time_it<5>("rows in lanes, 16 signed copies (exact)");
  time_it<6>("8 x 8 |x| times q ^ sign(x) (exact)");
  time_it<7>("4 x 16 |x| times q ^ sign(x) (exact)");
  time_it<8>("2 x 32 |x| times q ^ sign(x) (exact)");
  time_it<9>("1 x 64 |x| times q ^ sign(x) (exact)");
  time_it<10>("2 x 32 in registers, q ^ sign(x) (exact)");
}
