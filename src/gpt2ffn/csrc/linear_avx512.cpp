// The AVX-512 build of linear.h: one 512-bit register per 16 lanes.
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
#include "vec_avx512.h"

#define ISA avx512
#include "linear_impl.h"
