// gpt2ffn._C: packed-weight linear layers for CPU decode and prefill (see linear.h for the layout).
// This file holds the torch side: argument checks, threads (at::parallel_for over output super-blocks,
// torch's own OpenMP pool) and the choice of instruction set, made once from what the CPU reports.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "linear.h"

namespace gpt2ffn {
namespace avx512 {
void linear_range(const LinearArgs& a, int64_t sb0, int64_t sb1);
void attend(const AttendArgs& a);
void attend_causal(const CausalArgs& a);
void qlinear_range(const LinearArgs& a, int64_t sb0, int64_t sb1);
void quantize_rows(const LinearArgs& a, int8_t* xq, float* xs, int32_t* xsum, int64_t m0, int64_t m1);
}
namespace avx2 {
void linear_range(const LinearArgs& a, int64_t sb0, int64_t sb1);
void attend(const AttendArgs& a);
void attend_causal(const CausalArgs& a);
void qlinear_range(const LinearArgs& a, int64_t sb0, int64_t sb1);
void quantize_rows(const LinearArgs& a, int8_t* xq, float* xs, int32_t* xsum, int64_t m0, int64_t m1);
}
namespace avxvnni {
void qlinear_range(const LinearArgs& a, int64_t sb0, int64_t sb1);
void quantize_rows(const LinearArgs& a, int8_t* xq, float* xs, int32_t* xsum, int64_t m0, int64_t m1);
}

using RangeFn = void (*)(const LinearArgs&, int64_t, int64_t);
using AttendFn = void (*)(const AttendArgs&);
using CausalFn = void (*)(const CausalArgs&);
using QuantFn = void (*)(const LinearArgs&, int8_t*, float*, int32_t*, int64_t, int64_t);

// One build per instruction set: the float kernels (linear_impl.h) and the integer ones (qlinear_impl.h).
struct Isa {
  const char* name;
  RangeFn range;
  AttendFn attend;
  CausalFn causal;
  RangeFn qrange;
  QuantFn quantize;
};
static const Isa kAvx512{"avx512", avx512::linear_range, avx512::attend, avx512::attend_causal, avx512::qlinear_range,
                        avx512::quantize_rows};
// AVX-512 without VNNI (Skylake-X): the float kernels at 512 bits, the integer ones on maddubs
static const Isa kAvx512NoVnni{"avx512novnni", avx512::linear_range, avx512::attend, avx512::attend_causal, avx2::qlinear_range,
                               avx2::quantize_rows};
static const Isa kAvxVnni{"avxvnni", avx2::linear_range, avx2::attend, avx2::attend_causal, avxvnni::qlinear_range,
                         avxvnni::quantize_rows};
static const Isa kAvx2{"avx2", avx2::linear_range, avx2::attend, avx2::attend_causal, avx2::qlinear_range,
                       avx2::quantize_rows};
static const Isa kNone{"none", nullptr, nullptr, nullptr, nullptr, nullptr};

static bool supports(const Isa& i) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                      && __builtin_cpu_supports("avx512vl");
  if (&i == &kAvx512) return avx512 && __builtin_cpu_supports("avx512vnni");
  if (&i == &kAvx512NoVnni) return avx512;
  if (&i == &kAvxVnni) return avx2 && __builtin_cpu_supports("avxvnni");
  return &i == &kAvx2 ? avx2 : true;
}

// The best build this CPU runs, or the one GPT2FFN_ISA names (avx512, avx512novnni, avxvnni, avx2) if it runs it.
static const Isa* pick() {
  for (const Isa* i : {&kAvx512, &kAvx512NoVnni, &kAvxVnni, &kAvx2}) {
    const char* want = std::getenv("GPT2FFN_ISA");
    if (supports(*i) && (want == nullptr || std::strcmp(want, i->name) == 0)) return i;
  }
  return &kNone;
}

static const Isa* kIsa = pick();

std::string isa() { return kIsa->name; }

// Switches the kernels to another build (for tests: the AVX2 path on an AVX-512 CPU); returns the previous.
std::string set_isa(const std::string& name) {
  for (const Isa* i : {&kAvx512, &kAvx512NoVnni, &kAvxVnni, &kAvx2})
    if (name == i->name) {
      TORCH_CHECK(supports(*i), "this CPU cannot run the ", name, " kernels");
      const std::string old = kIsa->name;
      kIsa = i;
      return old;
    }
  TORCH_CHECK(false, "unknown instruction set ", name, "; known: avx512, avx512novnni, avxvnni, avx2");
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

// x (M, K) float32 -> act(y) (M, N) float32; `w` and `scale` as Packed in gpt2ffn/precision.py writes them.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& scale,
                     const c10::optional<torch::Tensor>& bias, int64_t format, int64_t N, int64_t group,
                     const std::string& act) {
  const Isa* isa = kIsa;
  TORCH_CHECK(isa->range != nullptr, "gpt2ffn._C.linear needs AVX2+FMA or AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.stride(1) == 1, "x must have unit stride along K");
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "w must be a contiguous CPU tensor");
  TORCH_CHECK(format >= F32 && format <= I4A8, "unknown format ", format);
  const bool int8x = format == I8A8 || format == I4A8;
  const int64_t M = x.size(0), K = x.size(1);
  const bool int4 = format == I4 || format == I4A8;
  TORCH_CHECK(!int4 || K % 2 == 0, "int4 needs an even K, got ", K);
  const int64_t rows = int4 ? K / 2 : K;
  const int64_t esize = format == F32 ? 4 : format == BF16 ? 2 : 1;
  TORCH_CHECK(K > 0 && w.nbytes() % (rows * 64 * esize) == 0, "w holds ", w.nbytes(), " bytes, not whole super-blocks of K=", K);
  const int64_t nsuper = w.nbytes() / (rows * 64 * esize);
  TORCH_CHECK(N <= nsuper * 64 && N > nsuper * 64 - 64, "w has ", nsuper, " super-blocks of 64, which does not fit N=", N);
  LinearArgs a{};
  if (format >= I8) {
    TORCH_CHECK(scale.has_value() && scale->is_contiguous() && scale->scalar_type() == at::kHalf, "scale must be float16");
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
  auto y = torch::empty({M, nsuper * 64}, x.options());
  a.x = x.data_ptr<float>();
  a.ldx = x.stride(0);
  a.M = M;
  a.K = K;
  a.w = w.data_ptr();
  a.y = y.data_ptr<float>();
  a.ldy = nsuper * 64;
  a.format = static_cast<int>(format);
  a.act = act_code(act);
  RangeFn fn = isa->range;
  torch::Tensor xq, xs, xsum;
  if (int8x) {  // x to int8 per (row, group) first, then the integer kernels
    const int64_t ng = K / group;
    xq = torch::empty({M, K}, x.options().dtype(at::kChar));
    xs = torch::empty({M, ng}, x.options());
    xsum = torch::empty({M, ng}, x.options().dtype(at::kInt));
    a.xq = xq.data_ptr<int8_t>();
    a.xscale = xs.data_ptr<float>();
    a.xsum = xsum.data_ptr<int32_t>();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      isa->quantize(a, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xsum.data_ptr<int32_t>(), m0, m1);
    });
    fn = isa->qrange;
  }
  at::parallel_for(0, nsuper, 1, [&](int64_t s0, int64_t s1) { fn(a, s0, s1); });
  if (act == "none") at::gelu_(y, "none");
  return N == nsuper * 64 ? y : y.narrow(1, 0, N);
}

// One GPT-2 block for one new token per row, the whole of it in one call (decode: no Python between ops):
//   x1 = x + attn.c_proj(attend(c_attn(ln_1(x)))),  out = x1 + mlp.c_proj(act(c_fc(ln_2(x1))))
// Row b's new key and value go to position lens[b] of cache slot slots[b], and its query attends to that
// slot's positions 0..lens[b] only. Each linear layer is (w, scale, bias, format, N, group) of a Packed;
// an empty scale tensor stands for none.
torch::Tensor decode_block(const torch::Tensor& x, const torch::Tensor& slots, const torch::Tensor& lens,
                           const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const std::vector<torch::Tensor>& norms, double eps,
                           const std::vector<torch::Tensor>& ws, const std::vector<torch::Tensor>& scales,
                           const std::vector<torch::Tensor>& biases, const std::vector<int64_t>& formats,
                           const std::vector<int64_t>& ns, const std::vector<int64_t>& groups,
                           const std::string& act) {
  const AttendFn attend = kIsa->attend;
  TORCH_CHECK(attend != nullptr, "gpt2ffn._C.decode_block needs AVX2+FMA or AVX-512");
  TORCH_CHECK(norms.size() == 4 && ws.size() == 4 && scales.size() == 4 && biases.size() == 4 && formats.size() == 4
              && ns.size() == 4 && groups.size() == 4, "decode_block takes 2 LayerNorms and 4 linear layers");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (B, d) float32");
  const int64_t B = x.size(0), d = x.size(1);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous()
              && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == at::kFloat,
              "k_cache and v_cache must be contiguous float32 (slots, H, S, hd)");
  const int64_t H = k_cache.size(1), S = k_cache.size(2), hd = k_cache.size(3);
  TORCH_CHECK(H * hd == d && hd % 16 == 0, "cache heads ", H, " x ", hd, " do not fit d=", d, " (hd % 16 == 0)");
  TORCH_CHECK(slots.numel() == B && lens.numel() == B && slots.scalar_type() == at::kLong
              && lens.scalar_type() == at::kLong, "slots and lens must be int64 with one entry per row");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < k_cache.size(0) && len[b] >= 0 && len[b] < S,
                "row ", b, ": slot ", slot[b], " position ", len[b], " outside the cache (", k_cache.size(0), ", ", S, ")");
  auto lin = [&](const torch::Tensor& in, int i, const std::string& act = "") {
    return linear(in, ws[i], scales[i].numel() ? c10::optional<torch::Tensor>(scales[i]) : c10::nullopt,
                  biases[i], formats[i], ns[i], groups[i], act);
  };
  const auto qkv = lin(at::layer_norm(x, {d}, norms[0], norms[1], eps), 0);  // (B, 3d)
  const float* qkvp = qkv.data_ptr<float>();
  const int64_t ldq = qkv.stride(0);
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t at = ((slot[b] * H + h) * S + len[b]) * hd;
      std::memcpy(kc + at, qkvp + b * ldq + d + h * hd, hd * sizeof(float));
      std::memcpy(vc + at, qkvp + b * ldq + 2 * d + h * hd, hd * sizeof(float));
    }
  auto att = torch::empty({B, d}, x.options());
  float* attp = att.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(S + 16);  // attend pads to 16
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / H, h = i % H, base = (slot[b] * H + h) * S * hd;
      attend(AttendArgs{qkvp + b * ldq + h * hd, kc + base, vc + base, len[b] + 1, hd, scale, scores.data(),
                         attp + b * d + h * hd});
    }
  });
  auto x1 = lin(att, 1).add_(x);                                     // (B, d) residual
  const auto hidden = lin(at::layer_norm(x1, {d}, norms[2], norms[3], eps), 2, act);  // act(c_fc(...))
  return lin(hidden, 3).add_(x1);
}

// Causal self-attention of T new tokens per sequence: q (B, H, T, hd), k and v (B, H, past + T, hd), each with
// unit stride along hd (views of c_attn's output and of the KV cache) -> (B, T, H * hd), the layout c_proj
// reads. Query i sees keys 0..past + i of its own sequence; every (sequence, head) pair is one task.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const CausalFn causal = kIsa->causal;
  TORCH_CHECK(causal != nullptr, "gpt2ffn._C.causal_attention needs AVX2+FMA or AVX-512");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kFloat
              && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && q.device().is_cpu()
              && k.device().is_cpu() && v.device().is_cpu(), "q, k, v must be 4-D float32 CPU tensors");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = q.size(3), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == hd && v.sizes() == k.sizes() && L >= T,
              "k and v must be (", B, ", ", H, ", past + ", T, ", ", hd, "), got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(hd % 16 == 0 && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "head width ", hd, " must be a multiple of 16 with unit stride");
  auto out = torch::empty({B, T, H * hd}, q.options());
  const int64_t Lp = (L + 63) / 64 * 64;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> kt(hd * Lp), p(4 * Lp);  // p: ATT_MQ (<= 4) rows
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / H, h = i % H;
      causal(CausalArgs{q.data_ptr<float>() + b * q.stride(0) + h * q.stride(1), q.stride(2),
                        k.data_ptr<float>() + b * k.stride(0) + h * k.stride(1),
                        v.data_ptr<float>() + b * v.stride(0) + h * v.stride(1), k.stride(2), v.stride(2), T,
                        L - T, hd, scale, kt.data(), p.data(), out.data_ptr<float>() + b * T * H * hd + h * hd,
                        H * hd});
    }
  });
  return out;
}

// The FFN in one call: c_proj(act(c_fc(x))), each a packed layer as in decode_block (2 entries each).
torch::Tensor ffn(const torch::Tensor& x, const std::vector<torch::Tensor>& ws, const std::vector<torch::Tensor>& scales,
                  const std::vector<torch::Tensor>& biases, const std::vector<int64_t>& formats,
                  const std::vector<int64_t>& ns, const std::vector<int64_t>& groups, const std::string& act) {
  TORCH_CHECK(ws.size() == 2 && scales.size() == 2 && biases.size() == 2 && formats.size() == 2 && ns.size() == 2
              && groups.size() == 2, "ffn takes 2 linear layers");
  auto lin = [&](const torch::Tensor& in, int i, const std::string& act = "") {
    return linear(in, ws[i], scales[i].numel() ? c10::optional<torch::Tensor>(scales[i]) : c10::nullopt,
                  biases[i], formats[i], ns[i], groups[i], act);
  };
  return lin(lin(x, 0, act), 1);
}

}  // namespace gpt2ffn

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &gpt2ffn::linear, "y = x @ W + b on packed weights", py::arg("x"), py::arg("w"),
        py::arg("scale"), py::arg("bias"), py::arg("format"), py::arg("N"), py::arg("group"), py::arg("act") = "");
  m.def("ffn", &gpt2ffn::ffn, "c_proj(act(c_fc(x))) on packed weights in one call");
  m.def("causal_attention", &gpt2ffn::causal_attention,
        "causal self-attention of T new tokens against past + T cached keys -> (B, T, H * hd)");
  m.def("decode_block", &gpt2ffn::decode_block, "one GPT-2 block for one new token per row, KV cache by slot");
  m.def("isa", &gpt2ffn::isa, "the build the kernels run on: avx512 (with VNNI), avx512novnni, avxvnni, avx2 or none");
  m.def("set_isa", &gpt2ffn::set_isa, "switch to another build this CPU runs (tests); returns the previous");
}
