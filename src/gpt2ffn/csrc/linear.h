// y = x @ W + b on packed weights: the arguments and the layout, shared by ops.cpp and the kernels.
//
// Packed layout: outputs in super-blocks of 64 lanes (N padded to a multiple of 64); super-block s holds
// W[:, 64s:64s+64] row by row over K, so a thread streams its super-blocks front to back in one sequential
// read, and no sum ever crosses lanes:
//   F32  float    [nsuper][K][64]
//   BF16 uint16   [nsuper][K][64]            (the high half of the float: exact for bf16 values)
//   I8   int8     [nsuper][K][64]            w = q * scale[k / group]
//   I4   uint8    [nsuper][K/2][64]          low nibble k even, high nibble k odd; w = (q - 8) * scale[k / group]
//   scale fp16    [nsuper][K/group][64]      (I8, I4; as ggml's q8_0 / q4_0 keep theirs)
// and for the integer dot products on int8 activations (qlinear_impl.h), 4 bytes per lane per step, as
// vpdpbusd / maddubs read them (unsigned weight byte times signed activation byte):
//   I8A8 uint8    [nsuper][K/4][64][4]       byte i of lane n: q[4j + i] + 128 (q in [-127, 127])
//   I4A8 uint8    [nsuper][K/8][64][4]       byte i of lane n: q[8j + i] | q[8j + 4 + i] << 4 (q in [0, 15])
//   scale fp16    [nsuper][K/group][64]      as I8 / I4
//
// Float formats: each output element is summed in one fixed order (fp32 FMAs over k in order, chunk by chunk),
// whatever the number of rows M or the tiling: results are bitwise independent of the batch (batch-invariant) and
// deterministic. Integer formats: x is quantized per row and group to int8 (xq = round(x / d), d = max|x| / 127),
// each group's products summed exactly in int32, then y += float(sum) * (d * scale) group by group in order:
// batch-invariant too.
#pragma once
#include <cstdint>

namespace gpt2ffn {

enum Format : int { F32 = 0, BF16 = 1, I8 = 2, I4 = 3, I8A8 = 4, I4A8 = 5 };

// Decode (one or two rows: every weight read once, from memory) prefetches each row of weights this many bytes
// ahead, per format: 0, none (the hardware prefetcher's reach). Set per machine by the probe
// (gpt2ffn.kernels.packed.probe: _C.set_prefetch), which times the candidates on the model's own layers.
extern int64_t prefetch_bytes[6];

// The fp32 and bf16 kernels (linear_impl.h) take up to FEW_ROWS rows (a decode step of a few sequences) two at a
// time through the whole super-block, as decode's own tiles: the first pair streams the weights from memory in
// order, the next pairs find them in L2. The wider prefill tiles read a super-block in column halves, which the
// hardware prefetcher follows badly when the weights come from memory (GPT-2 124M, a step of 4 rows: fp32 25.4 ->
// 19.8 ms, bf16 16.0 -> 15.0; of 8: 29.7 -> 25.2 and 21.2 -> 19.6; Intel Xeon, 2 threads). int8/int4 weights
// with fp32 activations (int8's lm_head) widen every weight per pass, so they keep the wide tiles. The tiling
// never changes an output's order of operations.
constexpr int64_t FEW_ROWS = 8;
// Prefill of the float kernels sums K in blocks of at most this many inputs (rounded down to whole chunks; halved
// where two blocks of weights would fill more than half of L2), every row over one block before the next
// (linear_impl.h: run).
#ifndef GPT2FFN_KBLOCK
#define GPT2FFN_KBLOCK 1024
#endif
constexpr int64_t KBLOCK = GPT2FFN_KBLOCK;
enum Act : int { ACT_NONE = 0, ACT_GELU_TANH = 1, ACT_RELU = 2 };
// Top-p's bins of the logits (ops.cpp: top_p_; linear_impl.h: exp_bins_row): width 1/64 from the top, the last
// one holding everything below -64
constexpr int TOP_P_BINS = 4096;
constexpr float TOP_P_PER_UNIT = 64.0f;

struct LinearArgs {
  const float* x;       // (M, K) row-major, row stride ldx
  int64_t ldx, M, K;
  const void* w;        // packed weights
  const uint16_t* scale;  // (I8, I4) group scales, IEEE fp16
  int64_t group;        // (I8, I4) K per scale
  const float* bias;    // (nsuper * 64) or null
  float* y;             // (M, nsuper * 64) row-major, row stride ldy
  int64_t ldy;
  int format;
  int act;              // applied to x @ W + b as it is stored: ACT_NONE, ACT_GELU_TANH or ACT_RELU
  // I8A8 / I4A8: x quantized per (row, group): int8 values in tiles of 8 rows (M rounded up; each build lays a
  // tile out as its quantize_rows writes it: qlinear_impl.h, xword; the maddubs build's decode of one row adds
  // blocks of |x| and sign masks, qvec_avx2.h: xsign_one; xq_bytes says how many bytes), the scale d and the sum of q
  const int8_t* xq;
  const float* xscale;  // (M, K / group)
  const int32_t* xsum;  // (M, K / group)
  int64_t nsuper;       // super-blocks in w (the 256-bit builds' prefill prefetches the next one's weights)
};

}  // namespace gpt2ffn

namespace gpt2ffn {

// One decode query per head against its cached keys and values (a sequence's own L positions, nothing
// else): out = softmax(q . K^T * scale) V, all fp32 arithmetic, the sum over positions in order. The cache
// holds fp32 or IEEE fp16 (f16: each value widened exactly to fp32 as it is read).
struct AttendArgs {
  const float* q;    // (hd)
  const void* k;     // (L, hd), row stride hd: float, or uint16_t fp16 bits if f16
  const void* v;     // (L, hd)
  int64_t L, hd;
  float scale;
  float* scores;     // (L rounded up to 16) scratch
  float* out;        // (hd)
  bool f16;
};

// Causal attention of T new queries of one sequence and head against its L = past + T keys: query i (at
// position past + i) sees keys 0..past + i. out row i = softmax(q_i . K^T * scale) V, fp32, sums in key order.
// The keys and values are fp32 or IEEE fp16 (f16: each widened exactly to fp32 as it is read).
struct CausalArgs {
  const float* q;          // (T, hd), row stride ldq
  int64_t ldq;
  const void* k;           // (L, hd), row stride ldk: float, or uint16_t fp16 bits if f16
  const void* v;           // (L, hd), row stride ldv
  int64_t ldk, ldv, T, past, hd;
  float scale;
  float* kt;               // scratch (hd, Lp): K transposed, Lp = L rounded up to 64, zero past L
  float* p;                // scratch (ATT_ROWS, Lp): a block of queries' scores, then weights
  float* out;              // (T, hd), row stride ldo
  int64_t ldo;
  bool f16;
};
constexpr int64_t ATT_ROWS = 8;  // the most queries a causal-attention block takes (every build's ATT_MQ <= 8)

}  // namespace gpt2ffn
