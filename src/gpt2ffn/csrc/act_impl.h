// The activations the kernels apply as they store x @ W + b (LinearArgs::act), on the V helpers of an ISA
// file, in namespace gpt2ffn::ISA: the same IEEE operations in every build, so every build gives the same bits.
#pragma once
#include "linear.h"

namespace gpt2ffn {
namespace ISA {

// e^z: z = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' degree-7 polynomial (expf's), times 2^n; relative error
// ~1e-7. Below -87 it is e^-87; from ~88.4 up it is +inf (n = 128 is the exponent field of infinity).
static inline V vexp(V z) {
  z = vmin(vmax(z, vset1(-87.0f)), vset1(89.0f));
  const V n = vround(vmul(z, vset1(1.44269504088896341f)));
  V r = vfma(n, vset1(-0.693359375f), z);  // ln2 in two parts: n * 0.693359375 is exact
  r = vfma(n, vset1(2.12194440e-4f), r);
  V p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  const V e = vadd(vfma(p, vmul(r, r), r), vset1(1.0f));
  return vmul(e, vexp2i(n));
}

// GELU, tanh form: 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3): no
// cancellation in 1 + tanh(u) for x < 0 (relative error ~1e-6 everywhere); for x below ~-10, e^(-2u) is +inf
// and the result -0.
static inline V vgelu_tanh(V x) {
  const V z = vmul(x, vfma(vmul(x, x), vset1(-0.0713548162726009f), vset1(-1.5957691216057308f)));
  return vdiv(x, vadd(vset1(1.0f), vexp(z)));
}

static inline V activate(V y, int act) {
  if (act == ACT_GELU_TANH) return vgelu_tanh(y);
  if (act == ACT_RELU) return vmax(y, vzero());
  return y;
}

}  // namespace ISA
}  // namespace gpt2ffn
