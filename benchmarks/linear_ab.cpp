// Two trees' AVX2 prefill kernels (each tree's csrc/linear_avx2.cpp, or with -DAB_INT8 its csrc/qlinear_avx2.cpp:
// the maddubs int8 build; compiled into one binary by linear_ab.sh, the second in namespace avx2b) timed call by
// call in turn on the same weights of one layer shape (fp32, or int8 I8A8 with int8 activations in groups of 32,
// each tree's quantize_rows laying out the same x as it reads it): M rows (128 unless given), one thread, weights
// and inputs on 2 MiB pages, COPIES (4) copies of the weights run in turn so that they come from DRAM as a
// model's prefill reads them, the super-blocks in runs of RUN (2) as a thread of the package takes them. Prints
// each tree's median rate, the median of the per-pair time ratios (B / A) and whether the two gave the same
// bits. Pairing the calls cancels most of a shared machine's drift, which moved best-of-20 rates of one binary
// by 20-30% between runs (benchmarks/linear_harness.cpp). Not part of the package or CI; see linear_ab.sh.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "huge_pages.h"
#include "linear.h"
namespace gpt2ffn {
int64_t prefetch_bytes[6] = {0, 0, 0, 0, 0, 0};  // ops.cpp's; decode's prefetch, unused by a prefill
}
#ifdef AB_INT8
#include "A/qlinear_avx2.cpp"
#undef ISA
#undef GPT2FFN_QRUN8
#include "B/qlinear_avx2.cpp"
using Weight = uint8_t;  // stored q + 128, q in [-127, 127]
static void range(int tree, const gpt2ffn::LinearArgs& a, int64_t s0, int64_t s1) {
  tree ? gpt2ffn::avx2b::qlinear_range(a, s0, s1) : gpt2ffn::avx2::qlinear_range(a, s0, s1);
}
#else
#include "A/linear_avx2.cpp"
#undef ISA
#undef GPT2FFN_UNROLL_K  // what a tree's linear_avx2.cpp defines for its linear_impl.h
#include "B/linear_avx2.cpp"
using Weight = float;
static void range(int tree, const gpt2ffn::LinearArgs& a, int64_t s0, int64_t s1) {
  tree ? gpt2ffn::avx2b::linear_range(a, s0, s1) : gpt2ffn::avx2::linear_range(a, s0, s1);
}
#endif

using namespace gpt2ffn;

static int64_t env(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoll(v) : fallback;
}

int main(int argc, char** argv) {
  if (argc < 3 || argc > 4) return std::fprintf(stderr, "usage: %s K N [rows]\n", argv[0]), 2;
  const int64_t K = std::atoll(argv[1]), N = std::atoll(argv[2]), M = argc == 4 ? std::atoll(argv[3]) : 128;
  const int64_t copies = env("COPIES", 4), reps = env("REPS", 30), run = env("RUN", 2), G = 32;
  if (K < G || K % G || N < 64 || N % 64 || M < 1 || copies < 1 || reps < 1 || run < 1)
    return std::fprintf(stderr, "K a multiple of 32, N of 64, rows, COPIES, REPS and RUN >= 1\n"), 2;
  Weight* w = huge<Weight>(K * N * copies);  // any values: the time does not depend on them
  for (int64_t i = 0; i < K * N * copies; i++)
    w[i] = std::is_same<Weight, float>::value ? static_cast<float>(std::rand() % 1000) * 1e-3f : 1 + std::rand() % 255;
  std::vector<float> bias(N, 0.0f), y[2] = {std::vector<float>(M * N), std::vector<float>(M * N)};
  LinearArgs a{};
  a.M = M, a.K = K, a.ldx = K, a.bias = bias.data(), a.ldy = N, a.act = ACT_NONE, a.nsuper = N / 64;
#ifdef AB_INT8
  // each tree quantizes the same x as its own quantize_rows lays it out (at most 4 bytes a value)
  const int64_t ng = K / G, rows8 = (M + 7) / 8 * 8;
  float* x = huge<float>(M * K);
  for (int64_t i = 0; i < M * K; i++) x[i] = static_cast<float>(std::rand() % 2001 - 1000) * 1e-3f;
  std::vector<uint16_t> scale(ng * N, 0x3c00);  // fp16 1.0
  a.format = I8A8, a.group = G, a.scale = scale.data(), a.x = x;
  int8_t* xq[2] = {huge<int8_t>(rows8 * K * 4), huge<int8_t>(rows8 * K * 4)};
  std::vector<float> xscale[2] = {std::vector<float>(M * ng), std::vector<float>(M * ng)};
  std::vector<int32_t> xsum[2] = {std::vector<int32_t>(M * ng), std::vector<int32_t>(M * ng)};
  gpt2ffn::avx2::quantize_rows(a, xq[0], xscale[0].data(), xsum[0].data(), 0, M);
  gpt2ffn::avx2b::quantize_rows(a, xq[1], xscale[1].data(), xsum[1].data(), 0, M);
  auto inputs = [&](int tree) { a.xq = xq[tree], a.xscale = xscale[tree].data(), a.xsum = xsum[tree].data(); };
#else
  float* x = huge<float>(M * K);
  for (int64_t i = 0; i < M * K; i++) x[i] = static_cast<float>(std::rand() % 1000) * 1e-3f;
  a.format = F32, a.x = x;
  auto inputs = [](int) {};
#endif
  auto call = [&](int tree) {
    inputs(tree);
    for (int64_t s = 0; s < a.nsuper; s += run) range(tree, a, s, std::min(a.nsuper, s + run));
  };
  std::vector<double> t[2], ratio;
  for (int64_t r = 0; r < reps; r++) {
    double dt[2];
    for (int tree = 0; tree < 2; tree++) {  // A then B, each on the next copy of the weights
      a.w = w + ((2 * r + tree) % copies) * K * N, a.y = y[tree].data();
      const auto t0 = std::chrono::steady_clock::now();
      call(tree);
      dt[tree] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      t[tree].push_back(dt[tree]);
    }
    ratio.push_back(dt[1] / dt[0]);
  }
  for (int tree = 0; tree < 2; tree++) a.w = w, a.y = y[tree].data(), call(tree);
  const bool same = std::memcmp(y[0].data(), y[1].data(), y[0].size() * sizeof(float)) == 0;
  auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  std::printf("%s K=%ld N=%ld rows=%ld: A %.1f, B %.1f G products/s (medians of %ld); B/A time %.3f (median of the "
              "pairs); bits %s\n", std::is_same<Weight, float>::value ? "fp32" : "int8", static_cast<long>(K),
              static_cast<long>(N), static_cast<long>(M), M * K * N / median(t[0]) / 1e9,
              M * K * N / median(t[1]) / 1e9, static_cast<long>(reps), median(ratio), same ? "the same" : "DIFFER");
}
