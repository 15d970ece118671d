// The bf16 decode tile (csrc/linear_impl.h, the AVX-512 build, compiled in here) over GPT-2 xl's layers (48 blocks
// and the lm_head, 3.1 GB of bf16 on 2 MiB pages), 2 OpenMP threads, each layer's super-blocks split in halves
// with a barrier after it, timed against a plain 2-thread read of the same bytes just before and after: per pair,
// each prefetch distance's GB/s over the reads' mean. Distance -1: the same per-layer split read plainly (the
// barriers' and layer starts' cost alone). Pairs whose reads differ by more than 10% are left out of the medians.
// Measured with it on an AMD EPYC Zen 5 (2026-11-27): on a fast host (~80 GB/s reads) T0 prefetch 4096 bytes ahead
// read at 0.95-0.96x the plain read against 0.88-0.90 with none; on a slow one (~48) every distance ~1.0x. Not part
// of the package or CI.
//
//   g++ -O3 -ffp-contract=off -fopenmp -Isrc/gpt2ffn/csrc -o /tmp/dh benchmarks/decode_prefetch_harness.cpp
//   /tmp/dh 48 200 -1 0 2048 4096 8192     # blocks, pairs, distances (bytes)
#include <sys/mman.h>
#include <omp.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "linear.h"
namespace gpt2ffn { int64_t prefetch_bytes[6] = {0, 0, 0, 0, 0, 0}; }
#include "linear_avx512.cpp"
using namespace gpt2ffn;
template <class T> static T* huge(size_t n) {
  const size_t page = size_t{2} << 20, bytes = (n * sizeof(T) + page - 1) / page * page;
  void* p = std::aligned_alloc(page, bytes); madvise(p, bytes, MADV_HUGEPAGE); std::memset(p, 0, bytes);
  return static_cast<T*>(p);
}
struct L { int64_t K, N; uint16_t* w; };
int main(int argc, char** argv) {
  const int blocks = argc > 1 ? atoi(argv[1]) : 48, pairs = argc > 2 ? atoi(argv[2]) : 10;
  std::vector<int64_t> pfs; for (int i = 3; i < argc; i++) pfs.push_back(atoll(argv[i])); if (pfs.empty()) pfs.push_back(0);
  const int64_t d = 1600;
  std::vector<std::pair<int64_t,int64_t>> shapes;
  for (int b = 0; b < blocks; b++) { shapes.push_back({d, 3*d}); shapes.push_back({d, d}); shapes.push_back({d, 4*d}); shapes.push_back({4*d, d}); }
  shapes.push_back({d, 50304});
  size_t total = 0; for (auto& s : shapes) total += s.first * s.second;
  uint16_t* all = huge<uint16_t>(total);
  for (size_t i = 0; i < total; i++) all[i] = 0x3c00 + (i * 2654435761u >> 20 & 255);
  std::vector<L> ls; size_t off = 0;
  for (auto& s : shapes) { ls.push_back({s.first, s.second, all + off}); off += s.first * s.second; }
  float* x = huge<float>(4 * d); for (int i = 0; i < 4 * d; i++) x[i] = 0.001f * (i % 97);
  float* y = huge<float>(50304);
  const double gb = total * 2 / 1e9;
  auto step = [&]() {
#pragma omp parallel num_threads(2)
    { const int t = omp_get_thread_num();
      for (auto& l : ls) {
        LinearArgs a{}; a.x = x; a.ldx = l.K; a.M = 1; a.K = l.K; a.w = l.w; a.y = y; a.ldy = l.N; a.format = BF16; a.nsuper = l.N / 64;
        const int64_t ns = l.N / 64;
        if (prefetch_bytes[BF16] >= 0) avx512::linear_range(a, ns * t / 2, ns * (t + 1) / 2);
        else {  // plain read of the same share
          const char* p = reinterpret_cast<const char*>(l.w) + ns * t / 2 * l.K * 128, *e = reinterpret_cast<const char*>(l.w) + ns * (t + 1) / 2 * l.K * 128;
          __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
          for (; p < e; p += 256) { s0 = _mm512_add_ps(s0, _mm512_load_ps((const float*)p)); s1 = _mm512_add_ps(s1, _mm512_load_ps((const float*)(p+64))); s2 = _mm512_add_ps(s2, _mm512_load_ps((const float*)(p+128))); s3 = _mm512_add_ps(s3, _mm512_load_ps((const float*)(p+192))); }
          y[t] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
        }
#pragma omp barrier
      } }
  };
  auto read = [&]() {
    float tot = 0;
    const char* p = reinterpret_cast<const char*>(all); const size_t n = total * 2 / 256 * 256;
#pragma omp parallel num_threads(2) reduction(+ : tot)
    { const size_t t = omp_get_thread_num(), blocks = n / 256, a = blocks * t / 2 * 256, b = blocks * (t + 1) / 2 * 256;
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      for (size_t i = a; i < b; i += 256) { s0 = _mm512_add_ps(s0, _mm512_load_ps((const float*)(p+i))); s1 = _mm512_add_ps(s1, _mm512_load_ps((const float*)(p+i+64))); s2 = _mm512_add_ps(s2, _mm512_load_ps((const float*)(p+i+128))); s3 = _mm512_add_ps(s3, _mm512_load_ps((const float*)(p+i+192))); }
      tot += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3))); }
    return tot;
  };
  auto sec = [](auto f) { auto t0 = std::chrono::steady_clock::now(); f(); return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  step(); read();
  std::vector<std::vector<double>> rs(pfs.size());
  for (int i = 0; i < pairs; i++) {
    double r1 = sec(read); std::vector<double> st;
    for (auto pf : pfs) { prefetch_bytes[BF16] = pf; st.push_back(sec(step)); }
    double r2 = sec(read), rr = gb / ((r1 + r2) / 2);
    bool ok = fabs(r1 - r2) / std::min(r1, r2) <= 0.1;
    printf("read %5.1f", rr);
    for (size_t j = 0; j < pfs.size(); j++) { printf("  pf %4ld %.3f", (long)pfs[j], gb / st[j] / rr); if (ok) rs[j].push_back(gb / st[j] / rr); }
    printf("%s\n", ok ? "" : " (reads differ)");
  }
  for (size_t j = 0; j < pfs.size(); j++) { auto& r = rs[j]; std::sort(r.begin(), r.end()); if (r.size()) printf("pf %ld median ratio %.3f of %zu\n", (long)pfs[j], r[r.size() / 2], r.size()); }
}
