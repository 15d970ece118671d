// The float prefill as the package runs it (csrc/linear_avx2.cpp's linear_range, compiled in here), fp32 weights of
// one layer shape in the packed layout, M rows (128 unless given), one thread, weights and inputs on 2 MiB pages:
// ms and G products/s, best of 20 calls. Builds with another GPT2FFN_KBLOCK (or a copy of src/gpt2ffn/csrc named
// by -I, such as a `git worktree` of an earlier commit) are timed against each other without Python. Not part of
// the package or CI.
//
//   g++ -O3 -ffp-contract=off -fopenmp -Isrc/gpt2ffn/csrc -o /tmp/lh benchmarks/linear_harness.cpp
//   g++ -O3 -ffp-contract=off -fopenmp -DGPT2FFN_KBLOCK=512 -Isrc/gpt2ffn/csrc -o /tmp/lh512 benchmarks/linear_harness.cpp
//   taskset -c 1 /tmp/lh 1024 4096; taskset -c 1 /tmp/lh 6400 1600 128
//
// README ("AMD EPYC Zen 3, AVX2 only") and csrc/linear_impl.h (run: the K block) quote it.
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
#include "linear_avx2.cpp"

using namespace gpt2ffn;

int main(int argc, char** argv) {
  if (argc < 3 || argc > 4) return std::fprintf(stderr, "usage: %s K N [rows]\n", argv[0]), 2;
  const int64_t K = std::atoll(argv[1]), N = std::atoll(argv[2]), M = argc == 4 ? std::atoll(argv[3]) : 128;
  if (K < 1 || N < 64 || N % 64 || M < 1) return std::fprintf(stderr, "K >= 1, N a multiple of 64, rows >= 1\n"), 2;
  float* w = huge<float>(K * N);  // any values: the time does not depend on them
  for (int64_t i = 0; i < K * N; i++) w[i] = static_cast<float>(std::rand() % 1000) * 1e-3f;
  float* x = huge<float>(M * K);
  for (int64_t i = 0; i < M * K; i++) x[i] = static_cast<float>(std::rand() % 1000) * 1e-3f;
  std::vector<float> bias(N, 0.0f), y(M * N);
  LinearArgs a{};
  a.x = x, a.ldx = K, a.M = M, a.K = K, a.w = w, a.bias = bias.data(), a.y = y.data(), a.ldy = N, a.format = F32;
  a.act = ACT_NONE, a.nsuper = N / 64;
  double best = 1e9;
  for (int r = 0; r < 20; r++) {
    const auto t0 = std::chrono::steady_clock::now();
    avx2::linear_range(a, 0, a.nsuper);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("fp32 K=%ld N=%ld rows=%ld (KBLOCK %ld, halved for a small L2): %.3f ms, %.1f G products/s\n", static_cast<long>(K),
              static_cast<long>(N), static_cast<long>(M), static_cast<long>(KBLOCK), best * 1e3, M * K * N / best / 1e9);
}
