// The AVX2 build of linear.h: two 256-bit registers per 16 lanes, for CPUs without AVX-512.
#pragma GCC target("avx2,fma,f16c")
#include "vec_avx2.h"

#define ISA avx2
#include "linear_impl.h"
