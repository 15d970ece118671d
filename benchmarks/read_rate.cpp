// The machine's DRAM read rate as a decode step meets it: T threads (OpenMP; 2 unless given) each summing its share
// of a buffer far larger than the L3 with 512-bit loads (AVX2's 256-bit where the CPU has no AVX-512), on 2 MiB
// pages (says so on stderr where Linux refuses them); GB/s of each pass, one line a pass.
// benchmarks/decode_vs_read.py runs it around decode steps, as one process that allocates once (passes "-"): each
// line on stdin asks for a pass over its first GB (at most the buffer's). A new process a pass made the kernel map,
// zero and free ~3 GB each time, work that took a core from the decode it was to bracket. Not part of the package.
//
//   g++ -O3 -march=native -fopenmp -o /tmp/read_rate benchmarks/read_rate.cpp && /tmp/read_rate 3.1 5 2  # GB passes T
//   /tmp/read_rate 3.2 - 2    # then "3.1" on stdin: one pass over 3.1 GB, its GB/s on stdout
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#ifdef __AVX512F__
using Vec = __m512;
static inline Vec vload(const char* p) { return _mm512_load_ps(reinterpret_cast<const float*>(p)); }
static inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
static inline Vec vzero() { return _mm512_setzero_ps(); }
static inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
constexpr size_t W = 64;
#else
using Vec = __m256;
static inline Vec vload(const char* p) { return _mm256_load_ps(reinterpret_cast<const float*>(p)); }
static inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
static inline Vec vzero() { return _mm256_setzero_ps(); }
static inline float vsum(Vec a) {
  alignas(32) float f[8];
  _mm256_store_ps(f, a);
  return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];
}
constexpr size_t W = 32;
#endif

int main(int argc, char** argv) {
  const double gb = argc > 1 ? std::atof(argv[1]) : 3.1;
  const bool ask = argc > 2 && std::strcmp(argv[2], "-") == 0;  // a pass per line on stdin
  const int passes = ask ? 0 : argc > 2 ? std::atoi(argv[2]) : 5, threads = argc > 3 ? std::atoi(argv[3]) : 2;
  const size_t page = size_t{2} << 20, whole = static_cast<size_t>(gb * 1e9) / (8 * W) * (8 * W);
  char* p = static_cast<char*>(std::aligned_alloc(page, (whole + page - 1) / page * page));
  if (madvise(p, whole, MADV_HUGEPAGE) != 0) std::perror("read_rate: madvise(MADV_HUGEPAGE), on 4 KiB pages");
  std::memset(p, 1, whole);
  char line[64];
  for (int r = 0; ask || r < passes; r++) {
    size_t n = whole;
    if (ask) {
      if (!std::fgets(line, sizeof line, stdin)) break;
      n = std::min(whole, static_cast<size_t>(std::atof(line) * 1e9) / (8 * W) * (8 * W));
    }
    const auto t0 = std::chrono::steady_clock::now();
    float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      const size_t t = omp_get_thread_num(), nt = omp_get_num_threads(), blocks = n / (4 * W);
      const size_t a = blocks * t / nt * (4 * W), b = blocks * (t + 1) / nt * (4 * W);
      Vec s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();  // 4 independent sums: the loads, not the adds
      for (size_t i = a; i < b; i += 4 * W) {
        s0 = vadd(s0, vload(p + i));
        s1 = vadd(s1, vload(p + i + W));
        s2 = vadd(s2, vload(p + i + 2 * W));
        s3 = vadd(s3, vload(p + i + 3 * W));
      }
      total += vsum(vadd(vadd(s0, s1), vadd(s2, s3)));
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%.1f GB/s%s\n", n / s / 1e9, total == 42.0f ? " " : "");  // (total kept, not printed)
    std::fflush(stdout);
  }
}
