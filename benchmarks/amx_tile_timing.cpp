// What the AMX integer prefill's pieces cost, timed alone and together: the tile products of one group of 32
// (or 64) inputs, the tile stores that take each group's int32 sums out, and the float epilogue that scales them
// (as csrc/qlinear_amx.cpp and qlinear_impl.h: acc = fma(float(sum), scale * d, acc)). Everything sits in L1;
// nanoseconds per call of each loop body, best of 5 runs. Not part of the package or CI.
//
//   g++ -O2 -march=sapphirerapids -ffp-contract=off -o /tmp/amx_tile_timing benchmarks/amx_tile_timing.cpp
//   taskset -c 1 /tmp/amx_tile_timing
//
// - "4 products": 4 x TDPBSSD, 16 rows x 16 lanes each, tiles already loaded (K 32: a q8_0 group; K 64: a full
//   tile row);
// - "4 stores": 4 x TILESTORED of 16 x 16 int32;
// - "4 products, then their 4 stores": the same tiles, so each waits on the other (the kernel before the halves);
// - "epilogue, 16 x 32 sums": one half's scaling, acc in memory;
// - "tile loads + 2 products + 2 stores": a step of the halves' schedule (products into one pair of sum tiles,
//   the other pair stored, the pairs swapping each call); "both in one step": that step, then the epilogue on a
//   buffer no tile store wrote, against the sum of the two alone.
// README ("AMX for the integer prefill") quotes it; results/amx-tile-timing-xeon-amx.txt.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>

#define TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define TILE_LOAD(t, p, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(p), "r"(static_cast<int64_t>(stride)) : "memory")
#define TILE_STORE(t, p) __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(p), "r"(int64_t{64}) : "memory")
#define TILE_DPBSSD(c, a, b) __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

alignas(64) int8_t A[16 * 64], B[2][16 * 64];
alignas(64) int32_t C[2][2][256], D[2][256];
alignas(64) float acc[16 * 32];
float xs[16];
uint16_t sc[32];

void configure(int k) {  // sums 0-3: 16 x 16 int32; activations 4, 5: 16 x k bytes; weights 6, 7: k / 4 x 64 bytes
  TileConfig c;
  for (int t = 0; t < 4; t++) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t = 4; t < 6; t++) c.rows[t] = 16, c.colsb[t] = static_cast<uint16_t>(k);
  for (int t = 6; t < 8; t++) c.rows[t] = static_cast<uint8_t>(k / 4), c.colsb[t] = 64;
  __asm__ volatile("ldtilecfg %0" ::"m"(c));
}

void epilogue(const int32_t (*sums)[256]) {  // one half: 16 rows x 2 blocks of 16 lanes
  const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
  const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16)));
  for (int m = 0; m < 16; m++) {
    const __m512 d = _mm512_set1_ps(xs[m]);
    float* p = acc + m * 32;
    _mm512_store_ps(p, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[0] + m * 16)), _mm512_mul_ps(s0, d),
                                       _mm512_load_ps(p)));
    _mm512_store_ps(p + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[1] + m * 16)),
                                            _mm512_mul_ps(s1, d), _mm512_load_ps(p + 16)));
  }
}

// Products into sum tiles c0, c1 (activations 4, weights 6, 7), then sum tiles s0, s1 stored to dst.
#define PRODUCTS_THEN_STORE(c0, c1, s0, s1, dst) \
  do {                                           \
    TILE_ZERO(c0);                               \
    TILE_DPBSSD(c0, 4, 6);                       \
    TILE_ZERO(c1);                               \
    TILE_DPBSSD(c1, 4, 7);                       \
    TILE_STORE(s0, (dst)[0]);                    \
    TILE_STORE(s1, (dst)[1]);                    \
  } while (0)

void half_step(int b) {  // the halves' step: loads, products into pair b, stores of the other pair
  TILE_LOAD(4, A, 64);
  TILE_LOAD(6, B[0], 64);
  TILE_LOAD(7, B[1], 64);
  if (b)
    PRODUCTS_THEN_STORE(2, 3, 0, 1, C[0]);
  else
    PRODUCTS_THEN_STORE(0, 1, 2, 3, C[1]);
}

template <typename F>
double ns(F body) {  // ns per call of body(i & 1), best of 5 runs of 1M calls
  constexpr long N = 1000000;
  double best = 1e30;
  for (int run = 0; run < 5; run++) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < N; i++) body(static_cast<int>(i & 1));
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / N * 1e9);
  }
  return best;
}

int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    std::puts("no AMX tile state granted here");
    return 1;
  }
  for (int i = 0; i < 16; i++) xs[i] = 0.01f * (i + 1);
  for (int i = 0; i < 32; i++) sc[i] = _cvtss_sh(0.02f, 0);
  for (int k : {32, 64}) {
    configure(k);
    TILE_LOAD(4, A, 64);
    TILE_LOAD(6, B[0], 64);
    TILE_LOAD(7, B[1], 64);
    std::printf("K %d: 4 products %.1f ns, 4 stores %.1f, 4 products then their 4 stores %.1f\n", k, ns([](int) {
      TILE_DPBSSD(0, 4, 6);
      TILE_DPBSSD(1, 4, 7);
      TILE_DPBSSD(2, 4, 6);
      TILE_DPBSSD(3, 4, 7);
    }), ns([](int) {
      TILE_STORE(0, C[0][0]);
      TILE_STORE(1, C[0][1]);
      TILE_STORE(2, C[1][0]);
      TILE_STORE(3, C[1][1]);
    }), ns([](int) {
      TILE_DPBSSD(0, 4, 6);
      TILE_DPBSSD(1, 4, 7);
      TILE_DPBSSD(2, 4, 6);
      TILE_DPBSSD(3, 4, 7);
      TILE_STORE(0, C[0][0]);
      TILE_STORE(1, C[0][1]);
      TILE_STORE(2, C[1][0]);
      TILE_STORE(3, C[1][1]);
    }));
  }
  configure(32);
  const double tiles = ns(half_step), epi = ns([](int) { epilogue(D); });
  const double both = ns([](int b) {
    half_step(b);
    epilogue(D);
  });
  std::printf("K 32: tile loads + 2 products + 2 stores %.1f ns, epilogue of 16 x 32 sums %.1f, both in one step %.1f "
              "(sum of the two %.1f)\n", tiles, epi, both, tiles + epi);
  // What overlaps a product (tile 0 from activations 4 and weights 6): a load of the activation tile it reads
  // (4) against one into another tile (5), a store of another sum tile (3).
  std::printf("K 32: 1 product %.2f ns; then a load into its own activation tile %.2f, into another %.2f; "
              "then a store of another sum tile %.2f (a store alone %.2f)\n",
              ns([](int) { TILE_DPBSSD(0, 4, 6); }), ns([](int) {
                TILE_DPBSSD(0, 4, 6);
                TILE_LOAD(4, A, 64);
              }), ns([](int) {
                TILE_DPBSSD(0, 4, 6);
                TILE_LOAD(5, A, 64);
              }), ns([](int) {
                TILE_DPBSSD(0, 4, 6);
                TILE_STORE(3, C[1][1]);
              }), ns([](int) { TILE_STORE(3, C[1][1]); }));
  __asm__ volatile("tilerelease" ::);
}
