// gpt2ffn._C: packed-weight linear layers for CPU decode and prefill (see linear.h for the layout).
// This file holds the torch side: argument checks, threads (at::parallel_for over output super-blocks,
// torch's own OpenMP pool) and the choice of instruction set, made once from what the CPU reports.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <limits>
#include <vector>

#include "linear.h"

namespace gpt2ffn {
int64_t prefetch_bytes[6] = {0, 0, 0, 0, 0, 0};

namespace avx512 {
void linear_range(const LinearArgs& a, int64_t sb0, int64_t sb1);
void layer_norm_row(const float* x, const float* w, const float* b, double eps, int64_t d, float* y);
void add_row(float* x, const float* y, int64_t n);
void to_half_row(const float* x, uint16_t* y, int64_t n);
void exp_bins_row(const float* x, float* w, uint16_t* bin, int64_t n);
void cut_row(float* x, int64_t n, float cut);
void attend(const AttendArgs& a);
void attend_causal(const CausalArgs& a);
void qlinear_range(const LinearArgs& a, int64_t sb0, int64_t sb1);
void quantize_rows(const LinearArgs& a, int8_t* xq, float* xs, int32_t* xsum, int64_t m0, int64_t m1);
int64_t xq_bytes(int64_t M, int64_t K, int64_t G, int format);
void qlinear_range_amx(const LinearArgs& a, int64_t sb0, int64_t sb1);
bool amx_permitted();
const char* int8_dot();
const char* int8_dot_amx();
}
namespace avx2 {
void linear_range(const LinearArgs& a, int64_t sb0, int64_t sb1);
void layer_norm_row(const float* x, const float* w, const float* b, double eps, int64_t d, float* y);
void add_row(float* x, const float* y, int64_t n);
void to_half_row(const float* x, uint16_t* y, int64_t n);
void exp_bins_row(const float* x, float* w, uint16_t* bin, int64_t n);
void cut_row(float* x, int64_t n, float cut);
void attend(const AttendArgs& a);
void attend_causal(const CausalArgs& a);
void qlinear_range(const LinearArgs& a, int64_t sb0, int64_t sb1);
void quantize_rows(const LinearArgs& a, int8_t* xq, float* xs, int32_t* xsum, int64_t m0, int64_t m1);
int64_t xq_bytes(int64_t M, int64_t K, int64_t G, int format);
const char* int8_dot();
}
namespace avxvnni {
void qlinear_range(const LinearArgs& a, int64_t sb0, int64_t sb1);
void quantize_rows(const LinearArgs& a, int8_t* xq, float* xs, int32_t* xsum, int64_t m0, int64_t m1);
int64_t xq_bytes(int64_t M, int64_t K, int64_t G, int format);
const char* int8_dot();
}

using RangeFn = void (*)(const LinearArgs&, int64_t, int64_t);
using AttendFn = void (*)(const AttendArgs&);
using CausalFn = void (*)(const CausalArgs&);
using QuantFn = void (*)(const LinearArgs&, int8_t*, float*, int32_t*, int64_t, int64_t);

// The row operations of a step (linear_impl.h): LayerNorm, x += y, float -> fp16, and top-p's vector passes; the
// same bits in every build.
struct RowOps {
  void (*layer_norm)(const float* x, const float* w, const float* b, double eps, int64_t d, float* y);
  void (*add)(float* x, const float* y, int64_t n);
  void (*to_half)(const float* x, uint16_t* y, int64_t n);
  void (*exp_bins)(const float* x, float* w, uint16_t* bin, int64_t n);
  void (*cut)(float* x, int64_t n, float cut);
};
static const RowOps kRows512{avx512::layer_norm_row, avx512::add_row, avx512::to_half_row, avx512::exp_bins_row,
                             avx512::cut_row};
static const RowOps kRows256{avx2::layer_norm_row, avx2::add_row, avx2::to_half_row, avx2::exp_bins_row,
                             avx2::cut_row};

// One build per instruction set: the float kernels (linear_impl.h) and the integer ones (qlinear_impl.h).
struct Isa {
  const char* name;
  RangeFn range;
  AttendFn attend;
  CausalFn causal;
  RangeFn qrange;
  QuantFn quantize;
  const RowOps* rows;
  const char* (*int8_dot)();
  int64_t xr;  // rows the build's int8 activations interleave in a tile (qlinear_impl.h: xword): 1 or 8
  int64_t (*xq_bytes)(int64_t M, int64_t K, int64_t G, int format);  // the bytes quantize writes for M rows
};
// AVX-512 VNNI with AMX-INT8 (Intel Sapphire Rapids and later): the integer kernels' blocks of 16 rows on tiles
static const Isa kAvx512Amx{"avx512amx", avx512::linear_range, avx512::attend, avx512::attend_causal,
                            avx512::qlinear_range_amx, avx512::quantize_rows, &kRows512, avx512::int8_dot_amx, 1,
                            avx512::xq_bytes};
static const Isa kAvx512{"avx512", avx512::linear_range, avx512::attend, avx512::attend_causal, avx512::qlinear_range,
                        avx512::quantize_rows, &kRows512, avx512::int8_dot, 1, avx512::xq_bytes};
// AVX-512 without VNNI (Skylake-X): the float kernels at 512 bits, the integer ones on maddubs
static const Isa kAvx512NoVnni{"avx512novnni", avx512::linear_range, avx512::attend, avx512::attend_causal,
                               avx2::qlinear_range, avx2::quantize_rows, &kRows512, avx2::int8_dot, 8,
                               avx2::xq_bytes};
static const Isa kAvxVnni{"avxvnni", avx2::linear_range, avx2::attend, avx2::attend_causal, avxvnni::qlinear_range,
                         avxvnni::quantize_rows, &kRows256, avxvnni::int8_dot, 8,
                         avxvnni::xq_bytes};
static const Isa kAvx2{"avx2", avx2::linear_range, avx2::attend, avx2::attend_causal, avx2::qlinear_range,
                       avx2::quantize_rows, &kRows256, avx2::int8_dot, 8, avx2::xq_bytes};
static const Isa kNone{"none", nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, nullptr};

static bool supports(const Isa& i) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                      && __builtin_cpu_supports("avx512vl");
  if (&i == &kAvx512Amx)
    return avx512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("amx-tile")
           && __builtin_cpu_supports("amx-int8") && avx512::amx_permitted();
  if (&i == &kAvx512) return avx512 && __builtin_cpu_supports("avx512vnni");
  if (&i == &kAvx512NoVnni) return avx512;
  if (&i == &kAvxVnni) return avx2 && __builtin_cpu_supports("avxvnni");
  return &i == &kAvx2 ? avx2 : true;
}

// The best build this CPU runs, or the one GPT2FFN_ISA names (avx512amx, avx512, avx512novnni, avxvnni, avx2) if
// it runs it.
static const Isa* pick() {
  for (const Isa* i : {&kAvx512Amx, &kAvx512, &kAvx512NoVnni, &kAvxVnni, &kAvx2}) {
    const char* want = std::getenv("GPT2FFN_ISA");
    if (supports(*i) && (want == nullptr || std::strcmp(want, i->name) == 0)) return i;
  }
  return &kNone;
}

static const Isa* kIsa = pick();

std::string isa() { return kIsa->name; }

// The instruction the current build's integer sums run on, as that build was compiled.
std::string int8_dot() { return kIsa->int8_dot ? kIsa->int8_dot() : "none"; }

// Switches the kernels to another build (for tests: the AVX2 path on an AVX-512 CPU); returns the previous.
std::string set_isa(const std::string& name) {
  for (const Isa* i : {&kAvx512Amx, &kAvx512, &kAvx512NoVnni, &kAvxVnni, &kAvx2})
    if (name == i->name) {
      TORCH_CHECK(supports(*i), "this CPU cannot run the ", name, " kernels");
      const std::string old = kIsa->name;
      kIsa = i;
      return old;
    }
  TORCH_CHECK(false, "unknown instruction set ", name, "; known: avx512amx, avx512, avx512novnni, avxvnni, avx2");
}

// Decode's prefetch distance for a format (linear.h: prefetch_bytes); returns the previous. bytes < 0: only read it.
int64_t set_prefetch(int64_t format, int64_t bytes) {
  TORCH_CHECK(format >= F32 && format <= I4A8, "unknown format ", format);
  TORCH_CHECK(bytes < (int64_t{1} << 24), "prefetch distance ", bytes, " bytes is past any cache");
  const int64_t old = prefetch_bytes[format];
  if (bytes >= 0) prefetch_bytes[format] = bytes / 64 * 64;
  return old;
}

// act: "" (none), "tanh" (GELU's tanh form) or "relu", applied inside the kernels as y is stored; "none" (GELU's
// exact erf form), after them through aten.
static int act_code(const std::string& act) {
  if (act.empty()) return ACT_NONE;
  if (act == "tanh") return ACT_GELU_TANH;
  if (act == "relu") return ACT_RELU;
  TORCH_CHECK(act == "none", "unknown activation '", act, "'; known: '', 'tanh', 'relu', 'none' (exact GELU)");
  return ACT_NONE;
}

// The arguments of a packed layer of K inputs and N outputs (x, y and M left to the caller), checked: w and scale
// as Packed in gpt2ffn/precision.py writes them, bias padded to the super-blocks. nsuper: its super-blocks.
static LinearArgs layer_args(int64_t K, const torch::Tensor& w, const c10::optional<torch::Tensor>& scale,
                             const c10::optional<torch::Tensor>& bias, int64_t format, int64_t N, int64_t group,
                             int64_t& nsuper) {
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "w must be a contiguous CPU tensor");
  TORCH_CHECK(format >= F32 && format <= I4A8, "unknown format ", format);
  const bool int4 = format == I4 || format == I4A8;
  TORCH_CHECK(!int4 || K % 2 == 0, "int4 needs an even K, got ", K);
  const int64_t rows = int4 ? K / 2 : K;
  const int64_t esize = format == F32 ? 4 : format == BF16 ? 2 : 1;
  TORCH_CHECK(K > 0 && w.nbytes() % (rows * 64 * esize) == 0, "w holds ", w.nbytes(),
              " bytes, not whole super-blocks of K=", K);
  nsuper = w.nbytes() / (rows * 64 * esize);
  TORCH_CHECK(N <= nsuper * 64 && N > nsuper * 64 - 64, "w has ", nsuper,
              " super-blocks of 64, which does not fit N=", N);
  LinearArgs a{};
  if (format >= I8) {
    TORCH_CHECK(scale.has_value() && scale->is_contiguous() && scale->scalar_type() == at::kHalf,
                "scale must be float16");
    const int64_t step = format == I4A8 ? 8 : format == I8A8 ? 4 : int4 ? 2 : 1;  // k per weight word
    TORCH_CHECK(group > 0 && K % group == 0 && group % step == 0, "group ", group, " must divide K=", K,
                step > 1 ? " and be a multiple of " + std::to_string(step) : std::string());
    TORCH_CHECK(scale->numel() == nsuper * (K / group) * 64, "scale has ", scale->numel(), " elements, expected ",
                nsuper * (K / group) * 64);
    a.scale = reinterpret_cast<const uint16_t*>(scale->data_ptr<at::Half>());
    a.group = group;
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == nsuper * 64,
                "bias must be float32 with ", nsuper * 64, " elements (padded to the super-blocks)");
    a.bias = bias->data_ptr<float>();
  }
  a.K = K;
  a.w = w.data_ptr();
  a.ldy = nsuper * 64;
  a.nsuper = nsuper;
  a.format = static_cast<int>(format);
  return a;
}

// x (M, K) float32 -> act(y) (M, N) float32; `w` and `scale` as Packed in gpt2ffn/precision.py writes them.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& scale,
                     const c10::optional<torch::Tensor>& bias, int64_t format, int64_t N, int64_t group,
                     const std::string& act) {
  const Isa* isa = kIsa;
  TORCH_CHECK(isa->range != nullptr, "gpt2ffn._C.linear needs AVX2+FMA or AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.stride(1) == 1, "x must have unit stride along K");
  const int64_t M = x.size(0), K = x.size(1);
  int64_t nsuper = 0;
  LinearArgs a = layer_args(K, w, scale, bias, format, N, group, nsuper);
  const bool int8x = format == I8A8 || format == I4A8;
  auto y = torch::empty({M, nsuper * 64}, x.options());
  a.x = x.data_ptr<float>();
  a.ldx = x.stride(0);
  a.M = M;
  a.y = y.data_ptr<float>();
  a.act = act_code(act);
  RangeFn fn = isa->range;
  torch::Tensor xq, xs, xsum;
  if (int8x) {  // x to int8 per (row, group) first, then the integer kernels
    const int64_t ng = K / group;
    xq = torch::empty({isa->xq_bytes(M, K, group, format)}, x.options().dtype(at::kChar));  // whole tiles (linear.h)
    xs = torch::empty({M, ng}, x.options());
    xsum = torch::empty({M, ng}, x.options().dtype(at::kInt));
    a.xq = xq.data_ptr<int8_t>();
    a.xscale = xs.data_ptr<float>();
    a.xsum = xsum.data_ptr<int32_t>();
    at::parallel_for(0, (M + 7) / 8, 2, [&](int64_t t0, int64_t t1) {  // by tiles: no line written by two threads
      isa->quantize(a, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xsum.data_ptr<int32_t>(), t0 * 8,
                    std::min(M, t1 * 8));
    });
    fn = isa->qrange;
  }
  at::parallel_for(0, nsuper, 1, [&](int64_t s0, int64_t s1) { fn(a, s0, s1); });
  if (act == "none") at::gelu_(y, "none");
  return N == nsuper * 64 ? y : y.narrow(1, 0, N);
}

// x (M, K) float32 -> the int8 activations this build's integer kernels read: q (M, K) int8 (row-major here, whatever
// the build's own interleave), d (M, K / group) float32 and the sums of q (M, K / group) int32; for tests against
// gpt2ffn.kernels.formats.quantize_activations, bit for bit.
std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x, int64_t group) {
  const Isa* isa = kIsa;
  TORCH_CHECK(isa->quantize != nullptr, "gpt2ffn._C.quantize_activations needs AVX2+FMA or AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              "x must be a 2-D float32 CPU tensor with unit stride along K, got ", x.sizes(), " ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(group > 0 && group % 4 == 0 && K % group == 0, "group ", group,
              " must be a multiple of 4 dividing K=", K);
  const int64_t ng = K / group, xr = isa->xr;
  LinearArgs a{};
  a.x = x.data_ptr<float>(), a.ldx = x.stride(0), a.M = M, a.K = K, a.group = group;
  auto xq = torch::empty({(M + 7) / 8 * 8, K}, torch::dtype(at::kChar));
  auto d = torch::empty({M, ng}, torch::dtype(at::kFloat));
  auto sum = torch::empty({M, ng}, torch::dtype(at::kInt));
  isa->quantize(a, xq.data_ptr<int8_t>(), d.data_ptr<float>(), sum.data_ptr<int32_t>(), 0, M);
  auto q = torch::empty({M, K}, torch::dtype(at::kChar));
  const int8_t* src = xq.data_ptr<int8_t>();
  int8_t* dst = q.data_ptr<int8_t>();
  for (int64_t m = 0; m < M; m++)
    for (int64_t k = 0; k < K; k += 4) std::memcpy(dst + m * K + k, src + (m / xr) * xr * K + k * xr + (m % xr) * 4, 4);
  return {q, d, sum};
}

// A packed linear layer's arguments (w, scale, bias, format, N, group of a Packed; an empty scale: none).
struct Lin {
  torch::Tensor w, scale;
  c10::optional<torch::Tensor> bias;
  int64_t format = F32, N = 0, group = 0;
  torch::Tensor operator()(const torch::Tensor& x, const std::string& act = "") const {
    const auto s = scale.numel() ? c10::optional<torch::Tensor>(scale) : c10::nullopt;
    return linear(x, w, s, bias, format, N, group, act);
  }
};

// One block's arguments: ln_1 (weight, bias), ln_2 (weight, bias), eps, c_attn, attn.c_proj, c_fc, mlp.c_proj.
struct Block {
  std::vector<torch::Tensor> norms;
  double eps;
  Lin lin[4];
  float attn_scale = 0.0f;  // the factor on q k^T; 0: 1/sqrt(hd), GPT-2's own
};

static Block make_block(const std::vector<torch::Tensor>& norms, double eps, const std::vector<torch::Tensor>& ws,
                        const std::vector<torch::Tensor>& scales, const std::vector<torch::Tensor>& biases,
                        const std::vector<int64_t>& formats, const std::vector<int64_t>& ns,
                        const std::vector<int64_t>& groups) {
  TORCH_CHECK(norms.size() == 4 && ws.size() == 4 && scales.size() == 4 && biases.size() == 4 && formats.size() == 4
              && ns.size() == 4 && groups.size() == 4, "a block takes 2 LayerNorms and 4 linear layers");
  Block b{norms, eps, {}};
  for (int i = 0; i < 4; i++) b.lin[i] = Lin{ws[i], scales[i], biases[i], formats[i], ns[i], groups[i]};
  return b;
}

static float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// Rows of W^T of a packed layer, dequantized as Packed.weights(cols) does: out[t, k] = W[k, ids[t]] (for the tied
// lm_head, wte's embeddings of those tokens). Formats and layouts as linear.h.
torch::Tensor packed_rows(const torch::Tensor& ids_in, const torch::Tensor& w, const torch::Tensor& scale,
                          int64_t format, int64_t K, int64_t N, int64_t group) {
  TORCH_CHECK(ids_in.dim() == 1 && !ids_in.is_floating_point(), "ids must be a 1-D integer tensor");
  const auto ids = ids_in.to(at::kLong).contiguous();
  TORCH_CHECK(format >= F32 && format <= I4A8 && w.is_contiguous() && K > 0, "unknown format ", format);
  const int64_t T = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++) TORCH_CHECK(id[t] >= 0 && id[t] < N, "id ", id[t], " outside [0, ", N, ")");
  const bool quantized = format >= I8;
  const int64_t nsuper = (N + 63) / 64, esize = format == F32 ? 4 : format == BF16 ? 2 : 1;
  const bool int4 = format == I4 || format == I4A8;
  TORCH_CHECK(w.nbytes() * (int4 ? 2 : 1) == static_cast<size_t>(nsuper * K * 64 * esize), "w holds ", w.nbytes(),
              " bytes, not ", nsuper, " super-blocks of K=", K, " in format ", format);
  TORCH_CHECK(!quantized || (group > 0 && K % group == 0 && scale.numel() == (N + 63) / 64 * (K / group) * 64),
              "scale does not fit K=", K, " N=", N, " group=", group);
  auto out = torch::empty({T, K}, torch::dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* wb = static_cast<const uint8_t*>(w.data_ptr());
  const uint16_t* sc = quantized ? reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>()) : nullptr;
  const int64_t ng = quantized ? K / group : 0;
  for (int64_t t = 0; t < T; t++) {
    const int64_t s = id[t] / 64, j = id[t] % 64;
    float* row = o + t * K;
    for (int64_t k = 0; k < K; k++) {
      float v;
      switch (format) {
        case F32: v = reinterpret_cast<const float*>(wb)[(s * K + k) * 64 + j]; break;
        case BF16: {
          const uint16_t top = reinterpret_cast<const uint16_t*>(wb)[(s * K + k) * 64 + j];  // bf16: fp32's top half
          const uint32_t bits = static_cast<uint32_t>(top) << 16;
          std::memcpy(&v, &bits, 4);
          break;
        }
        case I8: v = static_cast<float>(reinterpret_cast<const int8_t*>(wb)[(s * K + k) * 64 + j]); break;
        case I4: {
          const uint8_t byte = wb[(s * (K / 2) + k / 2) * 64 + j];
          v = static_cast<float>(((k % 2) ? byte >> 4 : byte & 15) - 8);
          break;
        }
        case I8A8: v = static_cast<float>(wb[((s * (K / 4) + k / 4) * 64 + j) * 4 + k % 4] - 128); break;
        default: {  // I4A8: byte i of word k / 8 holds k = 8w + i (low nibble) and 8w + 4 + i (high)
          const uint8_t byte = wb[((s * (K / 8) + k / 8) * 64 + j) * 4 + k % 4];
          v = static_cast<float>(((k % 8) >= 4 ? byte >> 4 : byte & 15) - 8);
        }
      }
      row[k] = quantized ? v * half_to_float(sc[(s * ng + k / group) * 64 + j]) : v;
    }
  }
  return out;
}

// A layer of StepPlan, checked once: its LinearArgs less x, y and M.
struct StepLayer {
  LinearArgs a;
  int64_t N, nsuper;
  bool int8x, erf;  // int8 activations; the exact GELU after the kernels
};

static StepLayer step_layer(const Lin& l, int64_t K, const std::string& act) {
  StepLayer L{};
  L.a = layer_args(K, l.w, l.scale.numel() ? c10::optional<torch::Tensor>(l.scale) : c10::nullopt, l.bias, l.format,
                   l.N, l.group, L.nsuper);
  L.a.act = act_code(act);
  L.N = l.N;
  L.int8x = l.format == I8A8 || l.format == I4A8;
  L.erf = act == "none";
  return L;
}

// A whole decode step of a GPT-2 in one call: embeddings, every block, ln_f and the lm_head, with the arguments
// made and checked once (gpt2ffn.kernels.packed.DecodePlan builds it). All of it runs in one parallel region:
// LayerNorms and activation quantization split by rows, each layer's super-blocks in runs (a thread's own share
// first, in order, then what the others left) and the attention's (row, head) pairs handed out to whichever
// thread asks next, barriers between the phases. No thread waits on a serial phase or a fork, and a thread the
// machine slows takes less of the work. `watch` records tensors whose storage and version counter must not
// change (the Parameters the packed weights were made from); `valid` checks them in C++ (a Python loop over ~200
// tensors took ~0.2 ms a step).
class StepPlan {
 public:
  void add_block(const std::vector<torch::Tensor>& norms, double eps, const std::vector<torch::Tensor>& ws,
                 const std::vector<torch::Tensor>& scales, const std::vector<torch::Tensor>& biases,
                 const std::vector<int64_t>& formats, const std::vector<int64_t>& ns,
                 const std::vector<int64_t>& groups, const std::string& act,
                 const c10::optional<double>& attn_scale) {
    Block b = make_block(norms, eps, ws, scales, biases, formats, ns, groups);
    if (attn_scale) b.attn_scale = static_cast<float>(*attn_scale);
    const int64_t d = norms[0].numel();
    for (const auto& n : norms)
      TORCH_CHECK(n.numel() == d && n.is_contiguous() && n.scalar_type() == at::kFloat,
                  "LayerNorm weights and biases must be float32 of ", d);
    TORCH_CHECK(d_ == 0 || d == d_, "block of width ", d, " after blocks of ", d_);
    TORCH_CHECK(ns[0] == 3 * d && ns[1] == d && ns[3] == d, "a block of width ", d, " has c_attn -> ", 3 * d,
                ", c_proj -> ", d, ", mlp.c_proj -> ", d, " outputs; got ", ns[0], ", ", ns[1], ", ", ns[3]);
    d_ = d;
    std::array<StepLayer, 4> ls{step_layer(b.lin[0], d, ""), step_layer(b.lin[1], d, ""),
                                step_layer(b.lin[2], d, act), step_layer(b.lin[3], ns[2], "")};
    blocks_.push_back(std::move(b));
    layers_.push_back(ls);
  }
  // ln_f, the lm_head (w, scale, bias, format, N, group) and the embeddings: wpe (n_positions, d), and wte
  // either as a (vocab, d) float32 tensor or, if empty, read from the lm_head's packed weights (tied).
  void set_head(const torch::Tensor& lnf_w, const torch::Tensor& lnf_b, double eps, const torch::Tensor& w,
                const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias, int64_t format, int64_t N,
                int64_t group, const torch::Tensor& wpe, const torch::Tensor& wte) {
    TORCH_CHECK(d_ > 0, "StepPlan.set_head after the blocks");
    TORCH_CHECK(wpe.dim() == 2 && wpe.size(1) == d_ && wpe.scalar_type() == at::kFloat,
                "wpe must be (n_positions, ", d_, ") float32");
    TORCH_CHECK(wte.numel() == 0 || (wte.dim() == 2 && wte.size(0) == N && wte.size(1) == d_
                                     && wte.scalar_type() == at::kFloat), "wte must be (", N, ", ", d_, ") float32");
    TORCH_CHECK(lnf_w.numel() == d_ && lnf_b.numel() == d_ && lnf_w.is_contiguous() && lnf_b.is_contiguous(),
                "ln_f must have ", d_, " weights and biases");
    lnf_w_ = lnf_w, lnf_b_ = lnf_b, lnf_eps_ = eps, wpe_ = wpe, wte_ = wte;
    head_ = Lin{w, scale, bias, format, N, group};
    head_layer_ = step_layer(head_, d_, "");
  }
  void watch(const std::vector<torch::Tensor>& ts) {
    watched_ = ts;
    stamps_.clear();
    for (const auto& t : ts) stamps_.emplace_back(t.data_ptr(), t._version());
  }
  bool valid() const {
    for (size_t i = 0; i < watched_.size(); i++)
      if (watched_[i].data_ptr() != stamps_[i].first || watched_[i]._version() != stamps_[i].second) return false;
    return true;
  }
  bool requires_grad() const {
    for (const auto& t : watched_)
      if (t.requires_grad()) return true;
    return false;
  }

  // ids (B,) at positions (B,), row b's keys and values in slot slots[b] of every layer's ks[i], vs[i]
  // (slots, H, S, d/H), written at position positions[b] -> logits (B, vocab)
  torch::Tensor run(const torch::Tensor& ids_in, const torch::Tensor& positions_in, const torch::Tensor& slots_in,
                    const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs) const {
    TORCH_CHECK(!ids_in.is_floating_point() && !positions_in.is_floating_point() && !slots_in.is_floating_point(),
                "ids, positions and slots must be integer tensors");
    return forward(ids_in.to(at::kLong).contiguous(), positions_in.to(at::kLong).contiguous(),
                   slots_in.to(at::kLong).contiguous(), ks, vs, false);
  }

  // A prompt's prefill as one call: ids (T,), the new tokens of one sequence at positions past .. past + T - 1,
  // their keys and values written into slot `slot` of every layer's ks[i], vs[i], each token attending to the
  // slot's positions up to its own (causal) -> the last position's logits (1, vocab).
  torch::Tensor prefill(const torch::Tensor& ids_in, int64_t past, int64_t slot, const std::vector<torch::Tensor>& ks,
                        const std::vector<torch::Tensor>& vs) const {
    TORCH_CHECK(!ids_in.is_floating_point() && ids_in.dim() == 1 && ids_in.numel() > 0,
                "ids must be a non-empty 1-D integer tensor");
    const int64_t T = ids_in.numel();
    TORCH_CHECK(past >= 0, "past must be >= 0, got ", past);
    return forward(ids_in.to(at::kLong).contiguous(), torch::arange(past, past + T, torch::dtype(at::kLong)),
                   torch::full({T}, slot, torch::dtype(at::kLong)), ks, vs, true, {T});
  }

  // Chunks of several prompts as one call: ids (T,), chunk c's lengths[c] tokens (in order) at positions
  // pasts[c] .. pasts[c] + lengths[c] - 1 of slot slots[c] (one chunk a slot), each token attending to its own
  // slot's positions up to its own -> each chunk's last position's logits (chunks, vocab). The linear layers
  // read every weight once for all the chunks' rows, and each row's sums are the same as alone.
  torch::Tensor prefill_many(const torch::Tensor& ids_in, const std::vector<int64_t>& pasts,
                             const std::vector<int64_t>& slots, const std::vector<int64_t>& lengths,
                             const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs) const {
    const int64_t n = static_cast<int64_t>(lengths.size());
    TORCH_CHECK(n > 0 && pasts.size() == lengths.size() && slots.size() == lengths.size(),
                "one past, one slot and one length per chunk, at least one chunk");
    TORCH_CHECK(!ids_in.is_floating_point() && ids_in.dim() == 1, "ids must be a 1-D integer tensor");
    std::vector<int64_t> ends(n), sorted(slots);
    auto positions = torch::empty({ids_in.numel()}, torch::dtype(at::kLong));
    auto row_slots = torch::empty({ids_in.numel()}, torch::dtype(at::kLong));
    int64_t* pp = positions.data_ptr<int64_t>();
    int64_t* sp = row_slots.data_ptr<int64_t>();
    int64_t row = 0;
    for (int64_t c = 0; c < n; c++) {
      TORCH_CHECK(lengths[c] > 0 && pasts[c] >= 0, "chunk ", c, ": length ", lengths[c], " past ", pasts[c]);
      TORCH_CHECK(row + lengths[c] <= ids_in.numel(), "the chunks' lengths add up to more than the ", ids_in.numel(),
                  " ids");
      for (int64_t t = 0; t < lengths[c]; t++, row++) pp[row] = pasts[c] + t, sp[row] = slots[c];
      ends[c] = row;
    }
    TORCH_CHECK(row == ids_in.numel(), "the chunks' lengths add up to ", row, ", not the ", ids_in.numel(), " ids");
    std::sort(sorted.begin(), sorted.end());
    TORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), "two chunks share a cache slot");
    return forward(ids_in.to(at::kLong).contiguous(), positions, row_slots, ks, vs, true, ends);
  }

 private:
  // causal: the rows are chunks of consecutive positions, each in one slot, chunk c ending before row ends[c]
  // (prefill): every row's keys and values are written before any row attends, each (chunk, head)'s queries
  // attend as a block (attend_causal), and only each chunk's last row's logits are computed. Otherwise each row
  // has its own slot (decode).
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& slots,
                        const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs, bool causal,
                        const std::vector<int64_t>& ends = {}) const {
    const Isa* isa = kIsa;
    TORCH_CHECK(isa->attend != nullptr, "gpt2ffn._C.StepPlan needs AVX2+FMA or AVX-512");
    TORCH_CHECK(head_.w.defined(), "StepPlan.run before set_head");
    TORCH_CHECK(ks.size() == blocks_.size() && vs.size() == blocks_.size(), "one k and one v cache per layer: ",
                blocks_.size());
    TORCH_CHECK(ids.dim() == 1, "ids must be (B,)");
    const int64_t B = ids.numel(), d = d_, P = wpe_.size(0);
    TORCH_CHECK(positions.numel() == B && slots.numel() == B, "positions and slots must have one entry per id");
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; b++)
      TORCH_CHECK(pos[b] >= 0 && pos[b] < P, "position ", pos[b], " outside [0, ", P, ")");
    const auto& k0 = ks[0];
    TORCH_CHECK(k0.dim() == 4 && k0.size(1) * k0.size(3) == d && k0.size(3) % 16 == 0,
                "k and v caches must be (slots, H, S, hd) with H * hd = ", d, " and hd % 16 == 0, got ", k0.sizes());
    const int64_t H = k0.size(1), S = k0.size(2), hd = k0.size(3);
    const auto kv_type = k0.scalar_type();  // float32, or float16 (converted as it is written and read)
    TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kHalf, "k and v caches must be float32 or float16, got ",
                kv_type);
    for (size_t i = 0; i < ks.size(); i++)
      TORCH_CHECK(ks[i].sizes() == k0.sizes() && vs[i].sizes() == k0.sizes() && ks[i].is_contiguous()
                  && vs[i].is_contiguous() && ks[i].scalar_type() == kv_type && vs[i].scalar_type() == kv_type,
                  "layer ", i, ": k and v caches must be contiguous ", kv_type, " ", k0.sizes(), " as layer 0's");
    for (int64_t b = 0; b < B; b++)
      TORCH_CHECK(slot[b] >= 0 && slot[b] < k0.size(0) && pos[b] < S, "row ", b, ": slot ", slot[b], " position ",
                  pos[b], " outside the cache (", k0.size(0), ", ", S, ")");
    if (!causal) {
      std::vector<int64_t> sorted(slot, slot + B);  // a row writes its slot while attending to it: one row a slot
      std::sort(sorted.begin(), sorted.end());
      TORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), "two rows share a cache slot");
    }
    auto x = wte_.numel() ? wte_.index_select(0, ids)
                          : packed_rows(ids, head_.w, head_.scale, head_.format, d, head_.N, head_.group);
    x.add_(wpe_.index_select(0, positions));
    x = x.contiguous();

    // buffers: LayerNorm output, c_attn's, the heads', a projection's and c_fc's outputs, int8 activations
    int64_t ldq = 0, ldy = 0, ldh = 0, maxk = d;
    for (const auto& ls : layers_) {
      ldq = std::max(ldq, ls[0].nsuper * 64);
      ldy = std::max({ldy, ls[1].nsuper * 64, ls[3].nsuper * 64});
      ldh = std::max(ldh, ls[2].nsuper * 64);
      maxk = std::max(maxk, ls[3].a.K);
    }
    const auto f32 = torch::dtype(at::kFloat);
    auto hbuf = torch::empty({B, d}, f32), qkv = torch::empty({B, ldq}, f32), att = torch::empty({B, d}, f32);
    auto ybuf = torch::empty({B, ldy}, f32), hid = torch::empty({B, ldh}, f32);
    const int64_t R = causal ? static_cast<int64_t>(ends.size()) : B;  // rows of logits: each chunk's last one
    std::vector<int64_t> last(R), first(R);  // the rows the logits are of; a chunk's first row
    for (int64_t r = 0; r < R; r++) last[r] = causal ? ends[r] - 1 : r, first[r] = causal ? (r ? ends[r - 1] : 0) : r;
    int64_t longest = 0;  // keys a chunk's queries read, at most
    for (int64_t r = 0; causal && r < R; r++) {
      TORCH_CHECK(ends[r] > first[r] && ends[r] <= B, "chunk ", r, " has no rows");
      for (int64_t b = first[r]; b < ends[r]; b++)
        TORCH_CHECK(slot[b] == slot[first[r]] && pos[b] == pos[first[r]] + (b - first[r]),
                    "chunk ", r, ": rows must be consecutive positions of one slot");
      longest = std::max(longest, pos[last[r]] + 1);
    }
    auto logits = torch::empty({R, head_layer_.nsuper * 64}, f32);
    // int8 activations in whole tiles of 8 rows (linear.h), each tile quantized by one thread
    int64_t xq_bytes = 0;
    for (const auto& ls : layers_)
      for (const auto& L : ls) xq_bytes = std::max(xq_bytes, isa->xq_bytes(B, L.a.K, L.a.group, L.a.format));
    xq_bytes = std::max(xq_bytes, isa->xq_bytes(R, head_layer_.a.K, head_layer_.a.group, head_layer_.a.format));
    auto xq = torch::empty({xq_bytes}, torch::dtype(at::kChar)), xs = torch::empty({B, maxk}, f32);
    auto xsum = torch::empty({B, maxk}, torch::dtype(at::kInt));
    float *xp = x.data_ptr<float>(), *hp = hbuf.data_ptr<float>(), *qp = qkv.data_ptr<float>();
    float *ap = att.data_ptr<float>(), *yp = ybuf.data_ptr<float>(), *hidp = hid.data_ptr<float>();
    float *lp = logits.data_ptr<float>(), *xsp = xs.data_ptr<float>();
    int8_t* xqp = xq.data_ptr<int8_t>();
    int32_t* xsump = xsum.data_ptr<int32_t>();
    const bool f16 = kv_type == at::kHalf;
    const int64_t kv_bytes = f16 ? 2 : 4;
    std::vector<char*> kc(ks.size()), vc(vs.size());
    for (size_t i = 0; i < ks.size(); i++)
      kc[i] = static_cast<char*>(ks[i].data_ptr()), vc[i] = static_cast<char*>(vs[i].data_ptr());
    const RowOps& rows = *isa->rows;
    auto put = [&](char* dst, const float* src) {  // one head's new key or value into the cache
      if (f16) rows.to_half(src, reinterpret_cast<uint16_t*>(dst), hd);  // round to nearest even, as torch's copy_
      else std::memcpy(dst, src, hd * sizeof(float));
    };
    const int phases = static_cast<int>(blocks_.size()) * 5 + 1;  // 4 layers and the heads a block, the lm_head
    const float gpt2_scale = 1.0f / std::sqrt(static_cast<float>(hd));

    at::internal::lazy_init_num_threads();
    const int threads = at::get_num_threads();
    std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[phases * threads]);  // a phase's, a thread's
    for (int i = 0; i < phases * threads; i++) next[i].store(0);
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
      std::vector<float> scores(causal ? 0 : S + 16);  // attend pads to 16
      const int64_t Lp = (longest + 63) / 64 * 64;
      std::vector<float> kt(hd * Lp), probs(ATT_ROWS * Lp);  // attend_causal's K^T and scores
      int phase = 0;
      // the B rows of `in` (row stride d) normalized into hbuf, and quantized for `L` if it takes int8 activations
      auto norm = [&](const float* in, const float* w, const float* bias, double eps, const StepLayer& L) {
        for (int64_t m0 = tid * 8; m0 < B; m0 += 8 * nt) {  // by tiles of 8 rows, as xq holds them
          const int64_t m1 = std::min(B, m0 + 8);
          for (int64_t m = m0; m < m1; m++) rows.layer_norm(in + m * d, w, bias, eps, d, hp + m * d);
          if (L.int8x) {
            LinearArgs q = L.a;
            q.x = hp, q.ldx = d, q.M = B;
            isa->quantize(q, xqp, xsp, xsump, m0, m1);
          }
        }
      };
      auto quantize = [&](const StepLayer& L, const float* in, int64_t ldin) {
        if (!L.int8x) return;
        LinearArgs q = L.a;
        q.x = in, q.ldx = ldin, q.M = B;
        for (int64_t m0 = tid * 8; m0 < B; m0 += 8 * nt) isa->quantize(q, xqp, xsp, xsump, m0, std::min(B, m0 + 8));
      };
      // y = act(in @ W + b) by runs of super-blocks; then post(c0, c1) on the run's outputs c0..c1 of every row
      auto gemv = [&](const StepLayer& L, const float* in, int64_t ldin, float* out, int64_t ldout, auto&& post,
                      int64_t rows) {
        LinearArgs a = L.a;
        a.x = in, a.ldx = ldin, a.M = rows, a.y = out, a.ldy = ldout;
        a.xq = xqp, a.xscale = xsp, a.xsum = xsump;
        const RangeFn fn = L.int8x ? isa->qrange : isa->range;
        const int64_t chunk = std::max<int64_t>(1, L.nsuper / (8 * nt));  // ~8 runs a thread
        // Each thread's own share of the super-blocks first, run after run in order, then what the others have
        // left: a thread's runs mostly follow one another, so the kernels' fetch of the super-block after a run
        // is mostly of the one that thread takes next, and a thread the machine slows still takes less. A run
        // takes at most half of what is left of a share, so the last runs are of one super-block and the thread
        // that finishes first waits at the barrier for at most one, not for a whole run.
        std::atomic<int64_t>* taken = &next[phase++ * nt];
        for (int k = 0; k < nt; k++) {
          const int u = (tid + k) % nt;
          const int64_t begin = L.nsuper * u / nt, end = L.nsuper * (u + 1) / nt;
          for (int64_t done = taken[u].load(std::memory_order_relaxed); begin + done < end;) {
            const int64_t n = std::max<int64_t>(1, std::min(chunk, (end - begin - done) / 2));
            if (!taken[u].compare_exchange_weak(done, done + n, std::memory_order_relaxed)) continue;
            const int64_t s0 = begin + done, s1 = s0 + n;
            done += n;
            fn(a, s0, s1);
            post(s0 * 64, std::min(L.N, s1 * 64));
          }
        }
      };
      auto residual = [&](int64_t c0, int64_t c1) {  // x += y
        for (int64_t m = 0; m < B; m++) rows.add(xp + m * d + c0, yp + m * ldy + c0, c1 - c0);
      };
      auto nothing = [](int64_t, int64_t) {};
      auto project = [&](const StepLayer& L, const float* in, int64_t ldin) {  // x += in @ W + b
        if (L.int8x) {
          quantize(L, in, ldin);
#pragma omp barrier
        }
        gemv(L, in, ldin, yp, ldy, residual, B);
#pragma omp barrier
      };

      for (size_t i = 0; i < blocks_.size(); i++) {
        const Block& blk = blocks_[i];
        const auto& L = layers_[i];
        const float scale = blk.attn_scale ? blk.attn_scale : gpt2_scale;
        norm(xp, blk.norms[0].data_ptr<float>(), blk.norms[1].data_ptr<float>(), blk.eps, L[0]);
#pragma omp barrier
        gemv(L[0], hp, d, qp, ldq, nothing, B);
#pragma omp barrier
        std::atomic<int64_t>& heads = next[phase++ * nt];
        if (causal) {  // every row's keys and values first, then each head's queries as one block
          for (int64_t j = tid; j < B * H; j += nt) {
            const int64_t b = j / H, h = j % H, at = ((slot[b] * H + h) * S + pos[b]) * hd;
            put(kc[i] + at * kv_bytes, qp + b * ldq + d + h * hd);
            put(vc[i] + at * kv_bytes, qp + b * ldq + 2 * d + h * hd);
          }
#pragma omp barrier
          for (int64_t j; (j = heads.fetch_add(1)) < R * H;) {
            const int64_t c = j / H, h = j % H, r0 = first[c], base = (slot[r0] * H + h) * S * hd;
            isa->causal(CausalArgs{qp + r0 * ldq + h * hd, ldq, kc[i] + base * kv_bytes, vc[i] + base * kv_bytes,
                                   hd, hd, ends[c] - r0, pos[r0], hd, scale, kt.data(), probs.data(),
                                   ap + r0 * d + h * hd, d, f16});
          }
        } else {
          for (int64_t j; (j = heads.fetch_add(1)) < B * H;) {
            const int64_t b = j / H, h = j % H, base = (slot[b] * H + h) * S * hd, at = base + pos[b] * hd;
            put(kc[i] + at * kv_bytes, qp + b * ldq + d + h * hd);
            put(vc[i] + at * kv_bytes, qp + b * ldq + 2 * d + h * hd);
            isa->attend(AttendArgs{qp + b * ldq + h * hd, kc[i] + base * kv_bytes, vc[i] + base * kv_bytes,
                                   pos[b] + 1, hd, scale, scores.data(), ap + b * d + h * hd, f16});
          }
        }
#pragma omp barrier
        project(L[1], ap, d);
        norm(xp, blk.norms[2].data_ptr<float>(), blk.norms[3].data_ptr<float>(), blk.eps, L[2]);
#pragma omp barrier
        gemv(L[2], hp, d, hidp, ldh, [&](int64_t c0, int64_t c1) {
          if (!L[2].erf) return;  // the exact GELU, which the kernels do not apply
          for (int64_t m = 0; m < B; m++)
            for (int64_t c = c0; c < c1; c++) {
              const float v = hidp[m * ldh + c];
              hidp[m * ldh + c] = 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
            }
        }, B);
#pragma omp barrier
        project(L[3], hidp, ldh);
      }
      for (int64_t m0 = tid * 8; m0 < R; m0 += 8 * nt) {  // the rows whose logits are asked for, into hbuf 0..R-1
        const int64_t m1 = std::min(R, m0 + 8);
        for (int64_t m = m0; m < m1; m++)
          rows.layer_norm(xp + last[m] * d, lnf_w_.data_ptr<float>(), lnf_b_.data_ptr<float>(), lnf_eps_, d,
                          hp + m * d);
        if (head_layer_.int8x) {
          LinearArgs q = head_layer_.a;
          q.x = hp, q.ldx = d, q.M = R;
          isa->quantize(q, xqp, xsp, xsump, m0, m1);
        }
      }
#pragma omp barrier
      gemv(head_layer_, hp, d, lp, head_layer_.nsuper * 64, nothing, R);
    }
    return head_.N == head_layer_.nsuper * 64 ? logits : logits.narrow(1, 0, head_.N);
  }

  std::vector<Block> blocks_;
  std::vector<std::array<StepLayer, 4>> layers_;
  int64_t d_ = 0;
  torch::Tensor lnf_w_, lnf_b_, wpe_, wte_;
  double lnf_eps_ = 1e-5;
  Lin head_;
  StepLayer head_layer_{};
  std::vector<torch::Tensor> watched_;
  std::vector<std::pair<void*, uint32_t>> stamps_;
};

// Causal self-attention of T new tokens per sequence: q (B, H, T, hd), k and v (B, H, past + T, hd), each with
// unit stride along hd (views of c_attn's output and of the KV cache) -> (B, T, H * hd), the layout c_proj
// reads. Query i sees keys 0..past + i of its own sequence; every (sequence, head) pair is one task.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<double>& scale_in) {
  const CausalFn causal = kIsa->causal;
  TORCH_CHECK(causal != nullptr, "gpt2ffn._C.causal_attention needs AVX2+FMA or AVX-512");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kFloat && q.device().is_cpu()
              && k.device().is_cpu() && v.device().is_cpu(), "q, k, v must be 4-D CPU tensors, q float32");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf),
              "k and v must both be float32 or both float16, got ", k.scalar_type(), " and ", v.scalar_type());
  const bool f16 = k.scalar_type() == at::kHalf;
  const int64_t kv_bytes = f16 ? 2 : 4;
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = q.size(3), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == hd && v.sizes() == k.sizes() && L >= T,
              "k and v must be (", B, ", ", H, ", past + ", T, ", ", hd, "), got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(hd % 16 == 0 && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "head width ", hd, " must be a multiple of 16 with unit stride");
  auto out = torch::empty({B, T, H * hd}, q.options());
  const int64_t Lp = (L + 63) / 64 * 64;
  const float scale = scale_in ? static_cast<float>(*scale_in) : 1.0f / std::sqrt(static_cast<float>(hd));
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> kt(hd * Lp), p(ATT_ROWS * Lp);
    const char* kb = static_cast<const char*>(k.data_ptr());
    const char* vb = static_cast<const char*>(v.data_ptr());
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / H, h = i % H;
      causal(CausalArgs{q.data_ptr<float>() + b * q.stride(0) + h * q.stride(1), q.stride(2),
                        kb + (b * k.stride(0) + h * k.stride(1)) * kv_bytes,
                        vb + (b * v.stride(0) + h * v.stride(1)) * kv_bytes, k.stride(2), v.stride(2), T,
                        L - T, hd, scale, kt.data(), p.data(), out.data_ptr<float>() + b * T * H * hd + h * hd,
                        H * hd, f16});
    }
  });
  return out;
}

// The FFN in one call: c_proj(act(c_fc(x))), each a packed layer as StepPlan.add_block takes them (2 entries each).
torch::Tensor ffn(const torch::Tensor& x, const std::vector<torch::Tensor>& ws,
                  const std::vector<torch::Tensor>& scales, const std::vector<torch::Tensor>& biases,
                  const std::vector<int64_t>& formats, const std::vector<int64_t>& ns,
                  const std::vector<int64_t>& groups, const std::string& act) {
  TORCH_CHECK(ws.size() == 2 && scales.size() == 2 && biases.size() == 2 && formats.size() == 2 && ns.size() == 2
              && groups.size() == 2, "ffn takes 2 linear layers");
  const Lin fc{ws[0], scales[0], biases[0], formats[0], ns[0], groups[0]};
  const Lin proj{ws[1], scales[1], biases[1], formats[1], ns[1], groups[1]};
  return proj(fc(x, act));
}

// Nucleus (top-p) filtering in place, as serving/sampling.candidates keeps a row: its tokens in descending order
// of x (logits less their row's max), a token kept while the tokens before it weigh < top_p of the row (weights
// e^x), the likeliest always; the others set to -inf. With no sort of the row: a vector pass computes the
// weights and each x's bin (width 1/64 from the top, everything below -64 in the last: exp_bins_row), the
// weights are summed into their bins (in double) and the bins from the top until the target is reached, and only
// that bin's tokens are sorted to find the cut: the value of the last kept token and how many of its ties are
// kept; a vector pass drops everything below the cut (cut_row), and a scalar one only the ties beyond those kept
// when there are any. Exact whatever the bins hold (the cut's bin is sorted whole). False, x untouched, on a CPU
// without AVX2 (the caller sorts instead).
bool top_p_(torch::Tensor x, const torch::Tensor& top_p) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "top_p_: x must be a contiguous (R, V) float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(top_p.dim() == 1 && top_p.size(0) == x.size(0) && top_p.scalar_type() == torch::kFloat64 &&
              top_p.is_contiguous() && top_p.device().is_cpu(), "top_p_: top_p must be (", x.size(0),
              ",) float64 on the CPU, got ", top_p.sizes(), " ", top_p.scalar_type());
  const RowOps* ops = kIsa->rows;
  if (ops == nullptr) return false;
  const int64_t R = x.size(0), V = x.size(1);
  if (V == 0) return true;
  float* X = x.data_ptr<float>();
  const double* P = top_p.data_ptr<double>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<double> hist(TOP_P_BINS);
    std::vector<float> w(V);
    std::vector<uint16_t> bin(V);
    std::vector<std::pair<float, float>> cand;
    for (int64_t r = r0; r < r1; ++r) {
      float* row = X + r * V;
      ops->exp_bins(row, w.data(), bin.data(), V);
      std::fill(hist.begin(), hist.end(), 0.0);
      for (int64_t i = 0; i < V; ++i) hist[bin[i]] += w[i];
      double total = 0;
      for (int b = 0; b < TOP_P_BINS; ++b) total += hist[b];
      const double target = P[r] * total;
      int b = 0;  // the bin the cut is in: the likeliest token's when top_p is so small that target is 0
      double before = 0;
      if (target > 0) {
        while (b < TOP_P_BINS && before + hist[b] < target) before += hist[b++];
        if (b == TOP_P_BINS) continue;  // not reached (rounding at top_p near 1): every token
      } else {
        while (b < TOP_P_BINS - 1 && hist[b] == 0) ++b;  // the first bin with weight (or the last)
      }
      cand.clear();
      for (int64_t i = 0; i < V; ++i)
        if (bin[i] == b) cand.emplace_back(row[i], w[i]);
      std::sort(cand.begin(), cand.end(), [](const auto& p, const auto& q) { return p.first > q.first; });
      float cut = cand.empty() ? row[0] : cand[0].first;  // tokens above the cut are kept, and `ties` at it
      int64_t ties = 1;
      if (target > 0) {
        ties = 0;
        for (const auto& [v, wv] : cand) {
          if (before >= target) break;
          ties = v == cut ? ties + 1 : 1;
          cut = v;
          before += wv;
        }
      }
      int64_t at_cut = 0;
      for (const auto& c : cand) at_cut += c.first == cut;
      ops->cut(row, V, cut);
      if (ties < at_cut)  // keep only the first `ties` of the tokens equal to the cut
        for (int64_t i = 0; i < V; ++i)
          if (row[i] == cut && ties-- <= 0) row[i] = -std::numeric_limits<float>::infinity();
    }
  });
  return true;
}

}  // namespace gpt2ffn

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &gpt2ffn::linear, "y = x @ W + b on packed weights", py::arg("x"), py::arg("w"),
        py::arg("scale"), py::arg("bias"), py::arg("format"), py::arg("N"), py::arg("group"), py::arg("act") = "");
  m.def("ffn", &gpt2ffn::ffn, "c_proj(act(c_fc(x))) on packed weights in one call");
  m.def("causal_attention", &gpt2ffn::causal_attention,
        "causal self-attention of T new tokens against past + T cached keys -> (B, T, H * hd), scores q k^T * "
        "scale (None: 1/sqrt(hd))", py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale") = py::none());
  m.def("quantize_activations", &gpt2ffn::quantize_activations,
        "x (M, K) -> (q, d, sum of q) per (row, group) as this build's integer kernels quantize it");
  m.def("packed_rows", &gpt2ffn::packed_rows, "rows of W^T of a packed layer, dequantized: (T,) ids -> (T, K)");
  py::class_<gpt2ffn::StepPlan>(m, "StepPlan")
      .def(py::init<>())
      .def("add_block", &gpt2ffn::StepPlan::add_block)
      .def("set_head", &gpt2ffn::StepPlan::set_head)
      .def("watch", &gpt2ffn::StepPlan::watch)
      .def("valid", &gpt2ffn::StepPlan::valid)
      .def("requires_grad", &gpt2ffn::StepPlan::requires_grad)
      .def("run", &gpt2ffn::StepPlan::run, py::call_guard<py::gil_scoped_release>())
      .def("prefill", &gpt2ffn::StepPlan::prefill, py::call_guard<py::gil_scoped_release>())
      .def("prefill_many", &gpt2ffn::StepPlan::prefill_many, py::call_guard<py::gil_scoped_release>());
  m.def("top_p_", &gpt2ffn::top_p_, "nucleus filtering of (R, V) logits less their max in place, "
        "given (R,) top_p: the dropped set to -inf; False where the CPU has no AVX2",
        py::call_guard<py::gil_scoped_release>());
  m.def("isa", &gpt2ffn::isa, "the build the kernels run on: avx512amx (AVX-512 VNNI and AMX-INT8), avx512 (with "
        "VNNI), avx512novnni, avxvnni, avx2 or none");
  m.def("set_prefetch", &gpt2ffn::set_prefetch, "decode's prefetch distance in bytes for a format (0: none); "
        "returns the previous; a negative distance only reads it", py::arg("format"), py::arg("bytes") = -1);
  m.def("int8_dot", &gpt2ffn::int8_dot, "the instruction the current build's integer dot products run on");
  m.def("set_isa", &gpt2ffn::set_isa, "switch to another build this CPU runs (tests); returns the previous");
}
