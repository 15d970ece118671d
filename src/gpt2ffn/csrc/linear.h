// y = x @ W + b on packed weights: the arguments and the layout, shared by ops.cpp and the kernels.
//
// Packed layout: outputs in super-blocks of 64 lanes (N padded to a multiple of 64); super-block s holds
// W[:, 64s:64s+64] row by row over K, so a thread streams its super-blocks front to back in one sequential
// read, and no sum ever crosses lanes:
//   F32  float    [nsuper][K][64]
//   BF16 uint16   [nsuper][K][64]            (the high half of the float: exact for bf16 values)
//   I8   int8     [nsuper][K][64]            w = q * scale[k / group]
//   I4   uint8    [nsuper][K/2][64]          low nibble k even, high nibble k odd; w = (q - 8) * scale[k / group]
//   scale float   [nsuper][K/group][64]      (I8, I4)
//
// Each output element is summed in one fixed order (fp32 FMAs over k in order, chunk by chunk), whatever the
// number of rows M or the tiling: results are bitwise independent of the batch (batch-invariant) and
// deterministic.
#pragma once
#include <cstdint>

namespace gpt2ffn {

enum Format : int { F32 = 0, BF16 = 1, I8 = 2, I4 = 3 };

struct LinearArgs {
  const float* x;       // (M, K) row-major, row stride ldx
  int64_t ldx, M, K;
  const void* w;        // packed weights
  const float* scale;   // (I8, I4) group scales
  int64_t group;        // (I8, I4) K per scale
  const float* bias;    // (nsuper * 64) or null
  float* y;             // (M, nsuper * 64) row-major, row stride ldy
  int64_t ldy;
  int format;
};

}  // namespace gpt2ffn

namespace gpt2ffn {

// One decode query per head against its cached keys and values (a sequence's own L positions, nothing
// else): out = softmax(q . K^T * scale) V, all fp32, the sum over positions in order.
struct AttendArgs {
  const float* q;    // (hd)
  const float* k;    // (L, hd), row stride hd
  const float* v;    // (L, hd)
  int64_t L, hd;
  float scale;
  float* scores;     // (L) scratch
  float* out;        // (hd)
};

}  // namespace gpt2ffn
