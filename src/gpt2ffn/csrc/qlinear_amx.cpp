// The integer prefill (formats I8A8, I4A8 of linear.h) on AMX, Intel's tile matrix unit: 16 rows of int8
// activations times 16 output lanes of int8 weights per TDPBSSD, one group's products summed exactly in the
// int32 tile, then the same float epilogue as the AVX-512 VNNI kernels (qlinear_impl.h):
// acc = fma(float(sum), scale * d, acc) group by group in order, bias and activation as it is stored. The
// int32 sums are exact in both, so every output is bit for bit the VNNI kernels' (batch-invariant: a row's
// result does not depend on which kernel ran it). Rows left over from the blocks of 16 (and layers whose
// group does not fit a tile) run on the VNNI kernels.
//
// Per super-block of 64 lanes the packed weights are first turned into signed bytes in a per-thread scratch
// laid out as TDPBSSD's second operand, [4 lane blocks][K / 4][16 lanes][4 k]: I8A8's stored q + 128 back to q,
// I4A8's nibbles to q - 8, each k-quad of a lane one 4-byte word. Row r of it holds k = 4r .. 4r + 3 (I4A8's
// word w: low nibbles -> row 2w, high nibbles -> row 2w + 1), so a group's tile is G / 4 consecutive rows.
// One pass over a super-block's weights per call, against M / 16 x 4 x K / G tile products that read it.
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
#include <sys/syscall.h>
#include <unistd.h>

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

// Super-block sb's weights as signed bytes: out[j][r][n][b] = weight of lane 16 j + n at k = 4 r + b.
void signed_weights(const LinearArgs& a, int64_t sb, int8_t* out) {
  const int64_t K = a.K, R = K / 4;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), low = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
  if (a.format == I8A8) {  // [K/4][64][4] bytes q + 128
    const uint8_t* w = static_cast<const uint8_t*>(a.w) + sb * R * SUPER * 4;
    for (int64_t r = 0; r < R; r++)
      for (int j = 0; j < 4; j++)
        _mm512_storeu_si512(out + (j * R + r) * 64, _mm512_xor_si512(_mm512_loadu_si512(w + r * 256 + j * 64), flip));
  } else {  // I4A8: [K/8][64][4] bytes, byte b of lane n: q[8w + b] | q[8w + 4 + b] << 4
    const uint8_t* w = static_cast<const uint8_t*>(a.w) + sb * (K / 8) * SUPER * 4;
    for (int64_t v = 0; v < K / 8; v++)
      for (int j = 0; j < 4; j++) {
        const __m512i b = _mm512_loadu_si512(w + v * 256 + j * 64);
        const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(b, low), eight);
        const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(b, 4), low), eight);
        _mm512_storeu_si512(out + (j * R + 2 * v) * 64, lo);
        _mm512_storeu_si512(out + (j * R + 2 * v + 1) * 64, hi);
      }
  }
}

// acc[m] += float(c[m]) * (scale * d[m]) for the 16 rows of one group's int32 tile c, as qlinear_impl.h's
// epilogue. acc lives in registers: its address never reaches the tile instructions' memory clobbers.
static inline void scale_into(V (&acc)[MT], const int32_t* c, const V s, const float* d, int64_t ng) {
  for (int m = 0; m < MT; m++)
    acc[m] = vfma({_mm512_cvtepi32_ps(_mm512_load_si512(c + m * 16))}, vmul(s, vset1(d[m * ng])), acc[m]);
}

// Rows m0 .. m0 + 15, lanes 16 j .. 16 j + 15 of super-block sb, over every group: two groups in flight (tiles
// 0-2 and 3-5).
void tile_rows(const LinearArgs& a, const int8_t* ws, int64_t sb, int64_t m0, int j, int32_t (*cbuf)[MT * 16]) {
  const int64_t K = a.K, G = a.group, ng = K / G, R = K / 4;
  const int8_t* xq = a.xq + m0 * K;
  const int8_t* wj = ws + j * R * 64;
  const float* xs = a.xscale + m0 * ng;
  const uint16_t* sc = a.scale + sb * ng * SUPER + j * 16;
  V acc[MT];
  for (int m = 0; m < MT; m++) acc[m] = vzero();
  int64_t g = 0;
  for (; g + 2 <= ng; g += 2) {
    TILE_ZERO(0);
    TILE_ZERO(3);
    TILE_LOAD(1, xq + g * G, K);
    TILE_LOAD(2, wj + g * G * 16, 64);
    TILE_LOAD(4, xq + (g + 1) * G, K);
    TILE_LOAD(5, wj + (g + 1) * G * 16, 64);
    TILE_DPBSSD(0, 1, 2);
    TILE_DPBSSD(3, 4, 5);
    TILE_STORE(0, cbuf[0], 64);
    TILE_STORE(3, cbuf[1], 64);
    scale_into(acc, cbuf[0], vload_f16(sc + g * SUPER), xs + g, ng);
    scale_into(acc, cbuf[1], vload_f16(sc + (g + 1) * SUPER), xs + g + 1, ng);
  }
  if (g < ng) {
    TILE_ZERO(0);
    TILE_LOAD(1, xq + g * G, K);
    TILE_LOAD(2, wj + g * G * 16, 64);
    TILE_DPBSSD(0, 1, 2);
    TILE_STORE(0, cbuf[0], 64);
    scale_into(acc, cbuf[0], vload_f16(sc + g * SUPER), xs + g, ng);
  }
  const int64_t col = sb * SUPER + j * 16;
  const V b = a.bias ? vload(a.bias + col) : vzero();
  for (int m = 0; m < MT; m++) vstore(a.y + (m0 + m) * a.ldy + col, activate(vadd(acc[m], b), a.act));
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
  alignas(64) int32_t cbuf[2][MT * 16];
  TileConfig cfg;
  for (int c : {0, 3}) cfg.rows[c] = MT, cfg.colsb[c] = 64;               // int32 sums: 16 rows x 16 lanes
  for (int t : {1, 4}) cfg.rows[t] = MT, cfg.colsb[t] = G;                // activations: 16 rows x G bytes
  for (int t : {2, 5}) cfg.rows[t] = G / 4, cfg.colsb[t] = 64;            // weights: G / 4 k-quads x 16 lanes
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
  for (int64_t sb = sb0; sb < sb1; sb++) {
    signed_weights(a, sb, scratch.data());
    for (int64_t m0 = 0; m0 < M16; m0 += MT)
      for (int j = 0; j < 4; j++) tile_rows(a, scratch.data(), sb, m0, j, cbuf);
  }
  __asm__ volatile("tilerelease" ::);
}

}  // namespace avx512
}  // namespace gpt2ffn
