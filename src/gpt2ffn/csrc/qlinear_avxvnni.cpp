// The AVX-VNNI build of qlinear_impl.h (256-bit vpdpbusd), for CPUs with AVX-VNNI but not AVX-512 VNNI.
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define ISA avxvnni
// GCC's target pragma enables the instructions but defines no __AVXVNNI__: qvec_avx2.h asks for this instead (it
// tested __AVXVNNI__ before, so this build ran the maddubs path until an AVX-VNNI CPU was profiled).
#define GPT2FFN_AVXVNNI 1
#include "qvec_avx2.h"
