// The AVX-VNNI build of qlinear_impl.h (256-bit vpdpbusd), for CPUs with AVX-VNNI but not AVX-512 VNNI.
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define ISA avxvnni
#include "qvec_avx2.h"
