// The integer prefill (formats I8A8, I4A8 of linear.h) on AMX, Intel's tile matrix unit: 16 rows of int8
// activations times 16 output lanes of int8 weights per TDPBSSD (TDPBSUD for a call of one block, below), one
// group's products summed exactly in the int32 tile, then the same float epilogue as the AVX-512 VNNI kernels
// (qlinear_impl.h):
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
// benchmarks/results/prefill-ab-fetch-gpt2-medium-int8-xeon-amx.json). The run's last super-block fetches the
// one after the run too: the decode plan (ops.cpp, StepPlan) hands each thread its own share of a layer's
// super-blocks in order, so that is mostly the one this thread takes next (a prefill of runs of 1-6 super-blocks
// converted one in ~4 from memory; GPT-2 xl int8, 128 tokens, 387.3 -> 359.6 ms, large 198.7 -> 186.3,
// benchmarks/results/prefill-ab-runs-in-order-*.json). A call of one block of rows (16-31 tokens) converts
// nothing: its tiles read I8A8's packed q + 128 in place (a lane block's rows 256 bytes apart) through TDPBSUD
// (unsigned weights) and each sum starts from -128 * the group's activation sum, as the VNNI kernels' do (GPT-2
// xl int8 prefill of 16 tokens 106.7 -> 94.2 ms, large 53.2 -> 48.2, medium 25.4 -> 22.2).
//
// Each group's sums must leave the tiles for their own scales (a tile store, then 3 vector operations per 16
// sums): that epilogue, not the tile products, bounds the rate. Measured on the Intel Xeon (family 6 model 167,
// ~3.7 GHz), alone in a loop (benchmarks/amx_tile_timing.cpp): a TDPBSSD takes 16 cycles whether a group fills
// half its K (32) or all of it, a tile store 16 cycles, the epilogue ~2.5 cycles per 16 sums; and the tile
// loads and stores do not overlap the epilogue's vector work (each alone, then both: the times add). So the
// kernel keeps the tile unit's own chain short: a block of 16 rows runs the super-block's lanes in two halves
// of 32, group by group, with two pairs of sum tiles, so group g's products (tiles 0-1 or 2-3) are issued
// beside group g - 1's tile stores (the other pair) instead of after them, and earlier groups' sums, stored a
// step or two before, are scaled into acc (in memory) after both (tile_rows). Against the one pair of 4 sum
// tiles before it (4 lane blocks at once: products, the epilogue of the group before, then the stores), GPT-2
// xl int8 prefill of 128 tokens 425.1 -> 412.2 ms, medium int8 at 16 tokens 29.0 -> 27.0 (benchmarks/results/
// prefill-ab-amx-halves-*.json; per layer, layer-ab-amx-halves-*.json: 0.91-1.01x the time).
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
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
#define TILE_DPBSUD(c, a, b) __asm__ volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
// A group's products for two blocks of 16 lanes: activations x (rows K bytes apart) into tile a, weights b0 / b1
// through tiles 6 / 7 (rows `stride` bytes apart), sums into tiles c0 / c1, by DP (signed weights: TILE_DPBSSD,
// unsigned: TILE_DPBSUD); and a pair of sum tiles stored to sums[0], sums[1].
#define PAIR_PRODUCTS(c0, c1, a, x, K, b0, b1, stride, DP) \
  do {                                                     \
    TILE_LOAD(a, x, K);                                    \
    TILE_LOAD(6, b0, stride);                              \
    TILE_ZERO(c0);                                         \
    DP(c0, a, 6);                                          \
    TILE_LOAD(7, b1, stride);                              \
    TILE_ZERO(c1);                                         \
    DP(c1, a, 7);                                          \
  } while (0)
#define PAIR_STORE(c0, c1, sums)    \
  do {                              \
    TILE_STORE(c0, (sums)[0], 64);  \
    TILE_STORE(c1, (sums)[1], 64);  \
  } while (0)

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
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), low = _mm512_set1_epi8(15);
  const __m512i eight = _mm512_set1_epi8(8);
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

// Rows m0 .. m0 + 15 of super-block sb, its lanes in two halves of 32, each group by group: group g's
// activations into tile 4 (even g) or 5 (odd g; GPT-2 large int8 prefill of 128 tokens 207.2 -> 198.7 ms against
// tile 4 for every group, benchmarks/results/prefill-ab-amx-two-activation-tiles-*.json, though alone in a loop a
// load into the tile a product reads overlaps it as well as one into another tile), its weights for the half's two
// blocks of 16 lanes into tiles 6 and 7, its sums into tiles 0-1 (even g) or 2-3 (odd g), so that while one pair
// takes group g's products the other's (group g - 1) are stored, into cbuf[(g - 1) % 4]. The sums are scaled into
// acc (16 rows x 32 lanes, in memory) as qlinear_impl.h's epilogue does, acc = fma(float(sum), scale * d, acc)
// group by group in order. Where the block converts (two blocks of rows or more), two groups at a time, so that
// acc is read and written once per pair: at an odd step g, rows 0-7 of groups g - 3 and g - 2 (stored a step and
// two before), at the even step after, rows 8-15. The same floats as one group at a time in half the acc loads
// and stores (prefill of 128 tokens: GPT-2 xl int8 376.3 -> 357.8 ms, large 185.7 -> 181.5, benchmarks/results/
// prefill-ab-amx-paired-epilogue-*.json; a pair's 16 rows at once, every other step, took 1.07x the time). IN_PLACE
// keeps one group a step, group g - 2's at step g: pairs took it 1.08x the time (large, 16 tokens).
// The first block of rows (m0 0) converts each group's weights into ws just before its tiles read them.
// next0 .. next1: this block's share of the next super-block's packed weights, into L2 a piece each group.
// IN_PLACE (I8A8): the tiles read the packed weights where they lie, [K/4][64 lanes][4] bytes q + 128 (a lane
// block's tile: rows 256 bytes apart), through TDPBSUD (unsigned weights), and each sum gets -128 * the group's
// activation sum before it is scaled, as the VNNI kernels start theirs: the same int32, no scratch, no conversion.
constexpr int64_t PF_G = 4;  // IN_PLACE: groups ahead whose weights are fetched into L1 (1 and 4 measured alike)
template <bool IN_PLACE>
void tile_rows(const LinearArgs& a, int8_t* ws, int64_t sb, int64_t m0, int32_t (*cbuf)[2][MT * 16], float* acc,
               const char* next0, const char* next1) {
  const int64_t K = a.K, R = K / 4, G = a.group, ng = K / G, lines = (next1 - next0) / 64;
  const int8_t* xq = a.xq + m0 * K;
  const float* xs = a.xscale + m0 * ng;
  const int32_t* xsum = a.xsum + m0 * ng;
  const uint16_t* sc = a.scale + sb * ng * SUPER;
  const int8_t* packed = static_cast<const int8_t*>(a.w) + sb * R * SUPER * 4;
  for (int h = 0; h < 2; h++) {
    const int8_t* w0 = ws + 2 * h * R * 64;
    const int8_t* w1 = w0 + R * 64;
    auto issue = [&](int64_t g) {
      if (!IN_PLACE && m0 == 0)
        for (int j = 2 * h; j < 2 * h + 2; j++) signed_weights(a, sb, j, g, g + 1, ws);
      const int64_t t = h * ng + g;
      for (int64_t l = lines * t / (2 * ng); l < lines * (t + 1) / (2 * ng); l++)
        _mm_prefetch(next0 + l * 64, _MM_HINT_T1);
      const int8_t* x = xq + g * G;
      if (IN_PLACE) {
        const int8_t* b0 = packed + g * G / 4 * 256 + 2 * h * 64;
        if (g + PF_G < ng)
          for (int64_t r = 0; r < G / 4; r++) {
            _mm_prefetch(reinterpret_cast<const char*>(b0 + (PF_G * G / 4 + r) * 256), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(b0 + (PF_G * G / 4 + r) * 256 + 64), _MM_HINT_T0);
          }
        if (g & 1) {
          PAIR_PRODUCTS(2, 3, 5, x, K, b0, b0 + 64, 256, TILE_DPBSUD);
          PAIR_STORE(0, 1, cbuf[(g - 1) & 3]);
        } else {
          PAIR_PRODUCTS(0, 1, 4, x, K, b0, b0 + 64, 256, TILE_DPBSUD);
          if (g > 0) PAIR_STORE(2, 3, cbuf[(g - 1) & 3]);
        }
        return;
      }
      const int8_t *b0 = w0 + g * G * 16, *b1 = w1 + g * G * 16;
      if (g & 1) {
        PAIR_PRODUCTS(2, 3, 5, x, K, b0, b1, 64, TILE_DPBSSD);
        PAIR_STORE(0, 1, cbuf[(g - 1) & 3]);  // group g - 1's
      } else {
        PAIR_PRODUCTS(0, 1, 4, x, K, b0, b1, 64, TILE_DPBSSD);
        if (g > 0) PAIR_STORE(2, 3, cbuf[(g - 1) & 3]);
      }
    };
    // Groups g .. g + n - 1 (n 1 or 2) into acc, rows mb .. me - 1: acc read and written once, the groups in order.
    auto scale_groups = [&](auto n_, int64_t g, int mb, int me) {
      constexpr int n = decltype(n_)::value;
      V s0[n], s1[n];
      for (int i = 0; i < n; i++)
        s0[i] = vload_f16(sc + (g + i) * SUPER + h * 32), s1[i] = vload_f16(sc + (g + i) * SUPER + h * 32 + 16);
      for (int m = mb; m < me; m++) {
        float* p = acc + m * 32;
        V y0 = vload(p), y1 = vload(p + 16);
        for (int i = 0; i < n; i++) {
          const int32_t(*c)[MT * 16] = cbuf[(g + i) & 3];
          const V d = vset1(xs[m * ng + g + i]);
          __m512i c0 = _mm512_load_si512(c[0] + m * 16), c1 = _mm512_load_si512(c[1] + m * 16);
          if (IN_PLACE) {
            const __m512i off = _mm512_set1_epi32(-128 * xsum[m * ng + g + i]);
            c0 = _mm512_add_epi32(c0, off), c1 = _mm512_add_epi32(c1, off);
          }
          y0 = vfma({_mm512_cvtepi32_ps(c0)}, vmul(s0[i], d), y0);
          y1 = vfma({_mm512_cvtepi32_ps(c1)}, vmul(s1[i], d), y1);
        }
        vstore(p, y0);
        vstore(p + 16, y1);
      }
    };
    auto scale = [&](int64_t g) { scale_groups(std::integral_constant<int, 1>{}, g, 0, MT); };
    auto scale2 = [&](int64_t g, int mb, int me) { scale_groups(std::integral_constant<int, 2>{}, g, mb, me); };
    for (int64_t i = 0; i < MT * 32; i += 16) vstore(acc + i, vzero());
    int64_t done = 0;  // groups scaled into acc
    for (int64_t g = 0; g < ng; g++) {
      issue(g);
      if (IN_PLACE) {
        if (g >= 2) scale(g - 2), done = g - 1;
      } else {
        if ((g & 1) && g >= 3) scale2(g - 3, 0, MT / 2);
        if (!(g & 1) && g >= 4) scale2(g - 4, MT / 2, MT), done = g - 2;
      }
    }
    if ((ng - 1) & 1)
      PAIR_STORE(2, 3, cbuf[(ng - 1) & 3]);
    else
      PAIR_STORE(0, 1, cbuf[(ng - 1) & 3]);
    if (!IN_PLACE && (ng & 1) == 0 && ng >= 4) scale2(ng - 4, MT / 2, MT), done = ng - 2;  // the last odd step's
    for (; done + 1 < ng && !IN_PLACE; done += 2) scale2(done, 0, MT);
    for (; done < ng; done++) scale(done);
    for (int q = 0; q < 2; q++) {
      const int64_t col = sb * SUPER + h * 32 + q * 16;
      const V bv = a.bias ? vload(a.bias + col) : vzero();
      for (int m = 0; m < MT; m++)
        vstore(a.y + (m0 + m) * a.ldy + col, activate(vadd(vload(acc + m * 32 + q * 16), bv), a.act));
    }
  }
}

}  // namespace

const char* int8_dot_amx() {
  return "tdpbssd (AMX-INT8; tdpbsud for one block) on blocks of 16 rows, vpdpbusd (AVX-512 VNNI) on the rest";
}

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
  alignas(64) int32_t cbuf[4][2][MT * 16];  // four groups' sums for a half's 32 lanes
  alignas(64) float acc[MT * 32];
  TileConfig cfg;
  for (int c : {0, 1, 2, 3}) cfg.rows[c] = MT, cfg.colsb[c] = 64;         // int32 sums: 16 rows x 16 lanes
  for (int t : {4, 5}) cfg.rows[t] = MT, cfg.colsb[t] = G;                // activations: 16 rows x G bytes
  for (int t : {6, 7}) cfg.rows[t] = G / 4, cfg.colsb[t] = 64;            // weights: G / 4 k-quads x 16 lanes
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
  // The blocks of rows after the first share out the next super-block's packed weights, which come into L2
  // while they run, so that the first block's conversion of them reads L2, not memory.
  const int64_t sbytes = (a.format == I8A8 ? K : K / 2) * SUPER, later = M16 / MT - 1;
  // One block of rows (16-31 tokens) reads I8A8's weights in place: no later block would reuse a conversion.
  // From two blocks on, the later blocks' strided tile loads of the packed rows from L2 cost more than the
  // conversion saves (GPT-2 xl, 32 tokens 147.1 -> 155.3 ms, 128 tokens 380 -> 445).
  const bool in_place = a.format == I8A8 && later == 0;
  for (int64_t sb = sb0; sb < sb1; sb++) {
    const char* next = static_cast<const char*>(a.w) + (sb + 1) * sbytes;
    const int64_t nbytes = sb + 1 < a.nsuper && later > 0 ? sbytes : 0;  // the run's next, or the one after it
    for (int64_t m0 = 0; m0 < M16; m0 += MT) {
      const int64_t t = m0 / MT - 1;  // this block's share: none for the first
      const char* n0 = t < 0 ? next : next + nbytes * t / later / 64 * 64;
      const char* n1 = t < 0 ? next : next + nbytes * (t + 1) / later / 64 * 64;
      if (in_place)
        tile_rows<true>(a, scratch.data(), sb, m0, cbuf, acc, n0, n1);
      else
        tile_rows<false>(a, scratch.data(), sb, m0, cbuf, acc, n0, n1);
    }
  }
  __asm__ volatile("tilerelease" ::);
}

}  // namespace avx512
}  // namespace gpt2ffn
