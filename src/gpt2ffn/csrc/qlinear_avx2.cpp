// The AVX2 build of qlinear_impl.h (maddubs + madd), for CPUs without VNNI.
#pragma GCC target("avx2,fma,f16c")
#define ISA avx2
#include "qvec_avx2.h"
