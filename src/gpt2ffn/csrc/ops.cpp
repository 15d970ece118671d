// gpt2ffn._C: packed-weight linear layers for CPU decode and prefill (see linear.h for the layout).
// This file holds the torch side: argument checks, threads (at::parallel_for over output super-blocks,
// torch's own OpenMP pool) and the choice of instruction set, made once from what the CPU reports.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "linear.h"

namespace gpt2ffn {
namespace avx512 { void linear_range(const LinearArgs& a, int64_t sb0, int64_t sb1); }
namespace avx2 { void linear_range(const LinearArgs& a, int64_t sb0, int64_t sb1); }

using RangeFn = void (*)(const LinearArgs&, int64_t, int64_t);

static RangeFn pick() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return avx512::linear_range;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return avx2::linear_range;
  return nullptr;
}

static const RangeFn kRange = pick();

std::string isa() {
  return kRange == avx512::linear_range ? "avx512" : kRange == avx2::linear_range ? "avx2" : "none";
}

// x (M, K) float32 -> y (M, N) float32; `w` and `scale` as pack() in gpt2ffn/precision.py writes them.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& scale,
                     const c10::optional<torch::Tensor>& bias, int64_t format, int64_t N, int64_t group) {
  TORCH_CHECK(kRange != nullptr, "gpt2ffn._C.linear needs AVX2+FMA or AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.stride(1) == 1, "x must have unit stride along K");
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "w must be a contiguous CPU tensor");
  TORCH_CHECK(format >= F32 && format <= I4, "unknown format ", format);
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t per_lane_k = format == I4 ? K / 2 : K;
  const int64_t esize = format == F32 ? 4 : format == BF16 ? 2 : 1;
  TORCH_CHECK(w.nbytes() % (per_lane_k * 16 * esize) == 0, "w holds ", w.nbytes(), " bytes, not whole blocks of K=", K);
  const int64_t nblocks = w.nbytes() / (per_lane_k * 16 * esize);
  TORCH_CHECK(nblocks % 4 == 0 && N <= nblocks * 16 && N > nblocks * 16 - 64,
              "w has ", nblocks, " blocks of 16, which does not fit N=", N);
  LinearArgs a{};
  if (format == I8 || format == I4) {
    TORCH_CHECK(scale.has_value() && scale->is_contiguous() && scale->scalar_type() == at::kFloat, "scale must be float32");
    TORCH_CHECK(group > 0 && K % group == 0 && (format == I8 || group % 2 == 0), "group ", group, " must divide K=", K,
                format == I4 ? " and be even" : "");
    TORCH_CHECK(scale->numel() == nblocks * (K / group) * 16, "scale has ", scale->numel(), " elements, expected ",
                nblocks * (K / group) * 16);
    a.scale = scale->data_ptr<float>();
    a.group = group;
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == nblocks * 16,
                "bias must be float32 with ", nblocks * 16, " elements (padded to the blocks)");
    a.bias = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, nblocks * 16}, x.options());
  a.x = x.data_ptr<float>();
  a.ldx = x.stride(0);
  a.M = M;
  a.K = K;
  a.w = w.data_ptr();
  a.y = y.data_ptr<float>();
  a.ldy = nblocks * 16;
  a.format = static_cast<int>(format);
  const RangeFn fn = kRange;
  at::parallel_for(0, nblocks / 4, 1, [&](int64_t b0, int64_t b1) { fn(a, b0, b1); });
  return N == nblocks * 16 ? y : y.narrow(1, 0, N);
}

}  // namespace gpt2ffn

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &gpt2ffn::linear, "y = x @ W + b on packed weights", py::arg("x"), py::arg("w"),
        py::arg("scale"), py::arg("bias"), py::arg("format"), py::arg("N"), py::arg("group"));
  m.def("isa", &gpt2ffn::isa, "the instruction set the kernels run on: avx512, avx2 or none");
}
