// The integer prefill as the package runs it (csrc/qlinear_avx512.cpp's qlinear_range, compiled in here; -DAVX2
// or -DAVXVNNI: that 256-bit build's instead), on synthetic int8 or int4 weights and int8 activations of one layer
// shape, 128 rows, one thread, the weights and activations on 2 MiB pages as the package packs them: ms and G
// products/s, best of 30 calls. A kernel variant is a copy of src/gpt2ffn/csrc edited and named by -I, built and
// timed in seconds, without Python. On 4 KiB pages the same code read ~240 G/s where the layer read ~300 (TLB
// misses), so the pages matter. One layer stays in L3 (32 MiB on a Zen 5); [layers] > 1 runs that many copies in
// turn, so that the weights come from DRAM as a model's prefill reads them. Not part of the package or CI.
//
//   g++ -O3 -ffp-contract=off -fopenmp -Isrc/gpt2ffn/csrc -o /tmp/qh benchmarks/qlinear_harness.cpp
//   taskset -c 1 /tmp/qh 1024 4096; taskset -c 1 /tmp/qh 1600 6400 [int8|int4 [layers]]
//
// README ("AMD EPYC Zen 5") quotes it.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "huge_pages.h"
#include "linear.h"
namespace gpt2ffn {
int64_t prefetch_bytes[6] = {0, 0, 0, 0, 0, 0};  // ops.cpp's; decode's prefetch, unused by a prefill
}
#if defined(AVX2)  // -DAVX2 or -DAVXVNNI: that 256-bit build (a stand-in on a CPU with more)
#include "qlinear_avx2.cpp"
#define BUILD avx2
#elif defined(AVXVNNI)
#include "qlinear_avxvnni.cpp"
#define BUILD avxvnni
#else
#include "qlinear_avx512.cpp"
#define BUILD avx512
#endif

using namespace gpt2ffn;

int main(int argc, char** argv) {
  if (argc < 3 || argc > 5) return std::fprintf(stderr, "usage: %s K N [int8|int4] [layers]\n", argv[0]), 2;
  const bool int4 = argc >= 4 && std::strcmp(argv[3], "int4") == 0;
  const int64_t layers = argc == 5 ? std::atoll(argv[4]) : 1;  // > 1: as many copies, run in turn (from DRAM)
  if ((argc >= 4 && !int4 && std::strcmp(argv[3], "int8") != 0) || layers < 1)
    return std::fprintf(stderr, "format must be int8 or int4 and layers at least 1\n"), 2;
  const int64_t K = std::atoll(argv[1]), N = std::atoll(argv[2]), M = 128, G = 32, ng = K / G, nsuper = N / 64;
  const int64_t wbytes = int4 ? K * N / 2 : K * N;  // int8's stored q + 128 or int4's two nibbles: any bytes
  uint8_t* w = huge<uint8_t>(wbytes * layers);
  for (int64_t i = 0; i < wbytes * layers; i++) w[i] = std::rand() & 255;
  int8_t* xq = huge<int8_t>(M * K);
  for (int64_t i = 0; i < M * K; i++) xq[i] = std::rand() % 255 - 127;
  std::vector<uint16_t> scale(ng * N, 0x3c00);  // fp16 1.0
  std::vector<float> bias(N, 0.0f), y(M * N), xscale(M * ng, 0.01f);
  std::vector<int32_t> xsum(M * ng, 3);
  LinearArgs a{};
  a.ldx = K, a.M = M, a.K = K, a.w = w, a.scale = scale.data(), a.group = G, a.bias = bias.data();
  a.y = y.data(), a.ldy = N, a.format = int4 ? I4A8 : I8A8, a.act = ACT_NONE, a.xq = xq, a.xscale = xscale.data();
  a.xsum = xsum.data(), a.nsuper = nsuper;
  double best = 1e9;
  for (int r = 0; r < 30; r++) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t l = 0; l < layers; l++) {
      a.w = w + l * wbytes;
      BUILD::qlinear_range(a, 0, nsuper);
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / layers);
  }
  std::printf("%s K=%ld N=%ld: %.3f ms, %.0f G products/s\n", int4 ? "int4" : "int8", static_cast<long>(K), static_cast<long>(N), best * 1e3,
              M * K * N / best / 1e9);
}
