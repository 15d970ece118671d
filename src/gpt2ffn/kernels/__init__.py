"""Fast paths for FeedForward, chosen by one small dispatcher.

- autograd needed: `RecomputeGELU`, a custom autograd Function that keeps only x and the pre-activation
  and recomputes GELU in backward (less activation memory than plain autograd).
- CPU fp32 inference: `cpu.DEFAULT` (torch's GEMMs, the sigmoid form of the tanh GELU), the same path in every
  process, so the same input gives the same bits in every run.
- CUDA inference with the tanh GELU: c_fc's bias and GELU in cuBLASLt's epilogue where that is checked to be
  the tanh form, or in one Triton kernel (`gemm_gelu.py`, bf16 / fp16, from 1,024 tokens), where measured
  faster than the plain ops (`cuda.py`), else plain ops.
- anything else (torch.compile tracing, other dtypes or devices): plain traceable torch ops.

GPT2FFN_PATH=<path name> (or "plain") forces one path, for benchmarks and debugging.
"""

import os

import torch
import torch.nn.functional as F

from . import cpu, cuda, gemm_gelu

_FORCED = os.environ.get("GPT2FFN_PATH")
# Decode: at this many tokens or fewer the GEMMs are weight-bandwidth bound and per-op overhead is what
# is left to save, so the path with the fewest ops runs without a dispatch look-up.
DECODE_TOKENS = 16


def activation(h, approximate):
    """The activation out of place: 'tanh' / 'none' GELU, or 'relu'."""
    return F.relu(h) if approximate == "relu" else F.gelu(h, approximate=approximate)


def plain(x2, w1, b1, w2, b2, approximate):
    """Traceable reference ops: what torch.compile sees."""
    return torch.addmm(b2, activation(torch.addmm(b1, x2, w1), approximate), w2)


class RecomputeGELU(torch.autograd.Function):
    """c_fc -> GELU -> c_proj that saves (x, pre-activation) and recomputes GELU in backward."""

    @staticmethod
    def forward(ctx, x2, w1, b1, w2, b2, approximate):
        h = torch.addmm(b1, x2, w1)                      # (N, d) -> (N, hidden), saved
        g = activation(h, approximate)                   # (N, hidden), not saved
        ctx.approximate = approximate
        ctx.save_for_backward(x2, h, w1, w2)
        return torch.addmm(b2, g, w2)                    # (N, hidden) -> (N, d)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2, h, w1, w2 = ctx.saved_tensors
        a = ctx.approximate
        g = activation(h, a)                             # recompute GELU(h)
        dg = dy @ w2.t()                                 # (N, d) -> (N, hidden)
        if a == "relu":
            dh = dg * (h > 0)
        else:
            dh = torch.ops.aten.gelu_backward(dg, h, approximate=a)
        dx = dh @ w1.t() if ctx.needs_input_grad[0] else None
        return (dx, x2.t() @ dh, dh.sum(0), g.t() @ dy, dy.sum(0), None)


def bucket(n: int) -> int:
    """Token-count bucket: the next power of two (1, 2, 4, ..., 2048, 4096, ...)."""
    return 1 << max(n - 1, 0).bit_length()


def choose() -> str:
    """The CPU fp32 path: GPT2FFN_PATH's, else cpu.DEFAULT.

    Not the faster by timing: the two GELU forms round differently (by up to 1.2e-6 at GPT-2 xl's width) and
    took turns winning within the noise (the FFN's GEMMs are 98% of its time), so a per-process race gave
    different bits in different runs."""
    return _FORCED or cpu.DEFAULT


def choices() -> dict:
    """The CPU fp32 path that inference above DECODE_TOKENS runs, for reports."""
    return {"cpu fp32": choose()}


def ffn(x2, w1, b1, w2, b2, approximate):
    """(N, d) -> (N, d) through the right path; x2 is 2-D."""
    if torch.compiler.is_compiling():
        return plain(x2, w1, b1, w2, b2, approximate)
    if torch.is_grad_enabled() and (x2.requires_grad or w1.requires_grad or b1.requires_grad
                                    or w2.requires_grad or b2.requires_grad):
        return RecomputeGELU.apply(x2, w1, b1, w2, b2, approximate)
    if x2.is_cuda and approximate == "tanh":
        name = cuda.choose(x2, w1, b1, w2, b2, plain, bucket(x2.shape[0]))
        if name == "fused":
            return cuda.fused(x2, w1, b1, w2, b2)
        if name == "triton" and gemm_gelu.available(x2):  # (a forced choice below its token floor runs plain)
            return gemm_gelu.fused(x2, w1, b1, w2, b2)
        return plain(x2, w1, b1, w2, b2, approximate)
    if x2.dtype != torch.float32 or x2.device.type != "cpu":
        return plain(x2, w1, b1, w2, b2, approximate)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if x2.shape[0] <= DECODE_TOKENS and not _FORCED:  # decode: the fewest ops, no look-up
        return plain(x2, w1, b1, w2, b2, approximate)
    name = choose()
    if name == "plain":
        return plain(x2, w1, b1, w2, b2, approximate)
    return cpu.run_path(name, x2, w1, b1, w2, b2, approximate)
