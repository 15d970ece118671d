// The AVX2 build of linear.h: two 256-bit registers per 16 lanes, for CPUs without AVX-512.
#pragma GCC target("avx2,fma,f16c")
#include "vec_avx2.h"

// Prefill's tiles take 4 k a pass (linear_impl.h: tile; one k of the 6-row tile is 2 loads, 6 broadcasts and 12
// FMAs). One layer, one thread, against the loop as written (benchmarks/linear_ab.sh, AMD EPYC Zen 3, medians of
// 30 paired calls): 128 rows 0.84-0.97x the time at GPT-2 large and xl's shapes, 16 rows 0.75x. Decode's tiles
// keep their loop (unrolled, 8-sequence steps took 0.84x the rate), and so does the AVX-512 build, not measured
// on a CPU that has it. The order of every sum is unchanged.
#define GPT2FFN_UNROLL_K
#define ISA avx2
#include "linear_impl.h"
