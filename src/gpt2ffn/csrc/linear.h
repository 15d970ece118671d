// y = x @ W + b on packed weights: the arguments and the layout, shared by ops.cpp and the kernels.
//
// Packed layout: outputs in blocks of 16 ("lanes"); block b holds W[:, 16b:16b+16] row by row over K, so a
// decode step streams each block once, front to back, and never reduces across lanes:
//   F32  float    [nblocks][K][16]
//   BF16 uint16   [nblocks][K][16]            (the high half of the float: exact for bf16 values)
//   I8   int8     [nblocks][K][16]            w = q * scale[g]
//   I4   uint8    [nblocks][K/2][16]          low nibble k even, high nibble k odd; w = (q - 8) * scale[g]
//   scale float   [nblocks][K/group][16]      (I8, I4)
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
  const float* bias;    // (nblocks * 16) or null
  float* y;             // (M, nblocks * 16) row-major, row stride ldy
  int64_t ldy;
  int format;
};

}  // namespace gpt2ffn
