// The integer prefill (formats I8A8, I4A8 of linear.h) on AMX, Intel's tile matrix unit: 16 rows of int8
// activations times 16 output lanes of int8 weights per TDPBSSD, one group's products summed exactly in the
// int32 tile, then the same float epilogue as the AVX-512 VNNI kernels (qlinear_impl.h):
// acc = fma(float(sum), scale * d, acc) group by group in order, bias and activation as it is stored. The
// int32 sums are exact in both, so every output is bit for bit the VNNI kernels' (batch-invariant: a row's
// result does not depend on which kernel ran it). Rows left over from the blocks of 16 (and layers whose
// group does not fit a tile) run on the VNNI kernels.
//
// The packed weights are turned into signed bytes in a per-thread scratch laid out as TDPBSSD's second
// operand, [4 lane blocks][K / 4][16 lanes][4 k]: I8A8's stored q + 128 back to q, I4A8's nibbles to q - 8,
// each k-quad of a lane one 4-byte word. Row r of it holds k = 4r .. 4r + 3 (I4A8's word w: low nibbles ->
// row 2w, high nibbles -> row 2w + 1), so a group's tile is G / 4 consecutive rows. The first block of 16 rows
// of a super-block converts each group just before its tiles read it; the other blocks find the scratch in L2,
// and share out the next super-block's packed weights into L2 (prefetcht1, a piece each group), so only a
// call's first super-block is converted from memory (GPT-2 medium int8 prefill of 128 tokens 109.0 -> 104.3 ms,
// benchmarks/results/prefill-ab-fetch-gpt2-medium-int8-xeon-amx.json).
//
// Each group's sums must leave the tiles for their own scales (a tile store, then 3 vector operations per 16
// sums): that epilogue, not the tile products, bounds the rate. A block of 16 rows runs the super-block's 4
// lane blocks at once (the activations' tile loaded once per group for 4 products) and keeps acc in memory.
// Against the earlier one lane block at a time with each group's epilogue right after its store, Intel Xeon
// (family 6 model 167), 1 thread, 128 rows, GPT-2 medium's layers: 252-271 -> 308-319 G products/s int8
// (benchmarks/layer_ab.py; results/layer-ab-amx-xeon-amx.json; README: "AMX for the integer prefill").
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "vec_avx512.h"

#define ISA avx512
#include "act_impl.h"

// The tile instructions, written out (GCC's intrinsics name no memory clobber: the epilogue reads what a tile
// store wrote, and a tile load reads what vector stores wrote). AT&T order: sources first.
#define TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define TILE_LOAD(t, p, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(p), "r"(static_cast<int64_t>(stride)) : "memory")
#define TILE_STORE(t, p, stride) \
  __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(p), "r"(static_cast<int64_t>(stride)) : "memory")
#define TILE_DPBSSD(c, a, b) __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

namespace gpt2ffn {
namespace avx512 {

void qlinear_range(const LinearArgs& a, int64_t sb0, int64_t sb1);

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t SUPER = 64, MT = 16;  // lanes per super-block; rows per tile

// Lane block j of super-block sb's weights for groups g0 .. g1 - 1, as signed bytes: out[j][r][n][b] = weight
// of lane 16 j + n at k = 4 r + b, prefetching the packed rows PF_ROWS ahead (a larger distance, or into L2,
// measured the same at 1.5B).
constexpr int64_t PF_ROWS = 32;
void signed_weights(const LinearArgs& a, int64_t sb, int j, int64_t g0, int64_t g1, int8_t* out) {
  const int64_t K = a.K, R = K / 4, G = a.group;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), low = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
  int8_t* o = out + j * R * 64;
  if (a.format == I8A8) {  // [K/4][64][4] bytes q + 128
    const uint8_t* w = static_cast<const uint8_t*>(a.w) + sb * R * SUPER * 4 + j * 64;
    const int64_t r1 = g1 * G / 4, end = R - PF_ROWS;
    for (int64_t r = g0 * G / 4; r < r1; r++) {
      if (r < end) _mm_prefetch(reinterpret_cast<const char*>(w + (r + PF_ROWS) * 256), _MM_HINT_T0);
      _mm512_storeu_si512(o + r * 64, _mm512_xor_si512(_mm512_loadu_si512(w + r * 256), flip));
    }
  } else {  // I4A8: [K/8][64][4] bytes, byte b of lane n: q[8w + b] | q[8w + 4 + b] << 4
    const uint8_t* w = static_cast<const uint8_t*>(a.w) + sb * (K / 8) * SUPER * 4 + j * 64;
    const int64_t v1 = g1 * G / 8, end = K / 8 - PF_ROWS;
    for (int64_t v = g0 * G / 8; v < v1; v++) {
      if (v < end) _mm_prefetch(reinterpret_cast<const char*>(w + (v + PF_ROWS) * 256), _MM_HINT_T0);
      const __m512i b = _mm512_loadu_si512(w + v * 256);
      _mm512_storeu_si512(o + 2 * v * 64, _mm512_sub_epi8(_mm512_and_si512(b, low), eight));
      _mm512_storeu_si512(o + (2 * v + 1) * 64, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(b, 4), low), eight));
    }
  }
}

// Group g's products for rows m0 .. m0 + 15 and the super-block's 4 blocks of 16 lanes: the activations into
// tile 4 once, block j's weights into tile 6 + j % 2, its sums into tile j; store() puts tiles 0-3 in c.
static inline void products(const int8_t* xq, const int8_t* ws, int64_t K, int64_t G, int64_t g) {
  const int64_t R = K / 4;
  const int8_t* w = ws + g * G * 16;
  TILE_LOAD(4, xq + g * G, K);
  TILE_LOAD(6, w, 64);
  TILE_ZERO(0);
  TILE_DPBSSD(0, 4, 6);
  TILE_LOAD(7, w + R * 64, 64);
  TILE_ZERO(1);
  TILE_DPBSSD(1, 4, 7);
  TILE_LOAD(6, w + 2 * R * 64, 64);
  TILE_ZERO(2);
  TILE_DPBSSD(2, 4, 6);
  TILE_LOAD(7, w + 3 * R * 64, 64);
  TILE_ZERO(3);
  TILE_DPBSSD(3, 4, 7);
}
static inline void store(int32_t (*c)[MT * 16]) {
  TILE_STORE(0, c[0], 64);
  TILE_STORE(1, c[1], 64);
  TILE_STORE(2, c[2], 64);
  TILE_STORE(3, c[3], 64);
}

// Rows m0 .. m0 + 15 of super-block sb, all 64 lanes, group by group, software-pipelined: group g + 1's
// products are issued, group g's sums (stored a step before) are scaled into acc (16 rows x 64 lanes, in
// memory) as qlinear_impl.h's epilogue does, acc = fma(float(sum), scale * d, acc) group by group in order, and
// only then are group g + 1's sums stored (placed before them, the epilogue's loads waited on those stores).
// The first block of rows (m0 0) converts each group's weights into ws just before its tiles read them.
// next0 .. next1: this block's share of the next super-block's packed weights, into L2 a piece each group.
void tile_rows(const LinearArgs& a, int8_t* ws, int64_t sb, int64_t m0, int32_t (*cbuf)[4][MT * 16], float* acc,
               const char* next0, const char* next1) {
  const int64_t K = a.K, G = a.group, ng = K / G, lines = (next1 - next0) / 64;
  const int8_t* xq = a.xq + m0 * K;
  const float* xs = a.xscale + m0 * ng;
  const uint16_t* sc = a.scale + sb * ng * SUPER;
  auto step = [&](int64_t g) {
    if (m0 == 0)
      for (int j = 0; j < 4; j++) signed_weights(a, sb, j, g, g + 1, ws);
    for (int64_t l = lines * g / ng; l < lines * (g + 1) / ng; l++) _mm_prefetch(next0 + l * 64, _MM_HINT_T1);
    products(xq, ws, K, G, g);
  };
  for (int64_t i = 0; i < MT * SUPER; i += 16) vstore(acc + i, vzero());
  step(0);
  store(cbuf[0]);
  for (int64_t g = 0, b = 0; g < ng; g++, b ^= 1) {
    if (g + 1 < ng) step(g + 1);
    V s[4];
    for (int j = 0; j < 4; j++) s[j] = vload_f16(sc + g * SUPER + j * 16);
    for (int m = 0; m < MT; m++) {
      const V d = vset1(xs[m * ng + g]);
      for (int j = 0; j < 4; j++) {
        float* p = acc + m * SUPER + j * 16;
        vstore(p, vfma({_mm512_cvtepi32_ps(_mm512_load_si512(cbuf[b][j] + m * 16))}, vmul(s[j], d), vload(p)));
      }
    }
    if (g + 1 < ng) store(cbuf[b ^ 1]);
  }
  for (int j = 0; j < 4; j++) {
    const int64_t col = sb * SUPER + j * 16;
    const V bv = a.bias ? vload(a.bias + col) : vzero();
    for (int m = 0; m < MT; m++)
      vstore(a.y + (m0 + m) * a.ldy + col, activate(vadd(vload(acc + m * SUPER + j * 16), bv), a.act));
  }
}

}  // namespace

const char* int8_dot_amx() { return "tdpbssd (AMX-INT8) on blocks of 16 rows, vpdpbusd (AVX-512 VNNI) on the rest"; }

// Whether this thread may use the tiles: Linux hands AMX's 8 KiB of tile state to a process only when asked
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); false where the kernel refuses or knows no AMX.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// qlinear_range on AMX for the rows in whole blocks of 16; the others on the VNNI kernels.
void qlinear_range_amx(const LinearArgs& a, int64_t sb0, int64_t sb1) {
  const int64_t G = a.group, K = a.K, ng = K / G, M16 = a.M / MT * MT;
  if (M16 == 0 || G > 64 || G % 4 != 0) {
    qlinear_range(a, sb0, sb1);
    return;
  }
  if (M16 < a.M) {  // the rows after the last whole block
    LinearArgs t = a;
    t.M = a.M - M16, t.x = a.x + M16 * a.ldx, t.y = a.y + M16 * a.ldy;
    t.xq = a.xq + M16 * K, t.xscale = a.xscale + M16 * ng, t.xsum = a.xsum + M16 * ng;
    qlinear_range(t, sb0, sb1);
  }
  static thread_local std::vector<int8_t> scratch;
  if (static_cast<int64_t>(scratch.size()) < K * SUPER) scratch.resize(K * SUPER);
  alignas(64) int32_t cbuf[2][4][MT * 16];  // two groups' sums: one being stored while the other is scaled
  alignas(64) float acc[MT * SUPER];
  TileConfig cfg;
  for (int c : {0, 1, 2, 3}) cfg.rows[c] = MT, cfg.colsb[c] = 64;         // int32 sums: 16 rows x 16 lanes
  cfg.rows[4] = MT, cfg.colsb[4] = G;                                     // activations: 16 rows x G bytes
  for (int t : {6, 7}) cfg.rows[t] = G / 4, cfg.colsb[t] = 64;            // weights: G / 4 k-quads x 16 lanes
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
  // The blocks of rows after the first share out the next super-block's packed weights, which come into L2
  // while they run, so that the first block's conversion of them reads L2, not memory.
  const int64_t sbytes = (a.format == I8A8 ? K : K / 2) * SUPER, later = M16 / MT - 1;
  for (int64_t sb = sb0; sb < sb1; sb++) {
    const char* next = static_cast<const char*>(a.w) + (sb + 1) * sbytes;
    const int64_t nbytes = sb + 1 < sb1 && later > 0 ? sbytes : 0;
    for (int64_t m0 = 0; m0 < M16; m0 += MT) {
      const int64_t t = m0 / MT - 1;  // this block's share: none for the first
      const char* n0 = t < 0 ? next : next + nbytes * t / later / 64 * 64;
      const char* n1 = t < 0 ? next : next + nbytes * (t + 1) / later / 64 * 64;
      tile_rows(a, scratch.data(), sb, m0, cbuf, acc, n0, n1);
    }
  }
  __asm__ volatile("tilerelease" ::);
}

}  // namespace avx512
}  // namespace gpt2ffn
