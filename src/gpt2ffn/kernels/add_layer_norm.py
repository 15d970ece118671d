"""The residual add and the next LayerNorm as one Triton kernel (CUDA): s = x + y, h = LayerNorm(s).

A decode step of GPT-2 adds each sublayer's output to the residual stream and then normalizes the sum for the
next sublayer (ln_2 after attention, the next block's ln_1 or ln_f after the FFN): two kernels of a few
microseconds each at batch 1, 24 adds of ~130 kernels a step (issue 18's profile on an H200). Here one program a
row reads x and y once, stores the sum rounded to their dtype (as torch's add does), and normalizes that rounded
sum in fp32 (as torch's LayerNorm does for bf16 input), so only the reduction order differs from the two ops.

`available(device)` says whether it runs there (CUDA, Triton importable, one small call compiled and right on the
device); elsewhere callers keep the two ops, as they do with GPT2FFN_ADD_NORM=0 (for A/B).
"""

import os

import torch

from .probe import runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs (CI)
    triton = None


ENABLED = os.environ.get("GPT2FFN_ADD_NORM", "1") != "0"


def available(device) -> bool:
    """Whether the kernel runs on `device` (kernels/probe.py; elsewhere its callers keep the add and the norm)."""
    return ENABLED and runs_on(device, _check, triton is not None)


def _check(dev) -> bool:
    g = torch.Generator(device=dev).manual_seed(0)
    x, y = (torch.randn(3, 40, device=dev, generator=g) for _ in range(2))
    w, b = torch.randn(40, device=dev, generator=g), torch.randn(40, device=dev, generator=g)
    s, h = add_layer_norm(x, y, w, b, 1e-5)
    want = torch.nn.functional.layer_norm(x + y, (40,), w, b, 1e-5)
    return torch.equal(s, x + y) and torch.allclose(h, want, atol=1e-5)


if triton is not None:

    @triton.jit
    def _add_ln_kernel(X, Y, W, B, S, H, d, eps, sx, sy, ss, sh, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < d
        x = tl.load(X + row * sx + cols, mask=m, other=0.0)
        y = tl.load(Y + row * sy + cols, mask=m, other=0.0)
        s = (x.to(tl.float32) + y.to(tl.float32)).to(x.dtype)  # the sum as the residual stream holds it
        tl.store(S + row * ss + cols, s, mask=m)
        f = s.to(tl.float32)
        mean = tl.sum(f, axis=0) / d
        c = tl.where(m, f - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(c * c, axis=0) / d + eps)
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(H + row * sh + cols, (c * rstd * w + b).to(H.dtype.element_ty), mask=m)


def add_layer_norm(x, y, weight, bias, eps: float):
    """x, y (..., d) of one dtype, contiguous in d -> (x + y, layer_norm(x + y) with weight, bias (d,))."""
    d = x.shape[-1]
    x2, y2 = x.reshape(-1, d), y.reshape(-1, d)
    if x2.stride(-1) != 1 or y2.stride(-1) != 1 or x.dtype != y.dtype:
        raise ValueError("add_layer_norm needs x and y of one dtype, contiguous in their last dimension")
    s, h = torch.empty_like(x2), torch.empty_like(x2)
    block = triton.next_power_of_2(d)
    _add_ln_kernel[(x2.shape[0],)](x2, y2, weight, bias, s, h, d, eps, x2.stride(0), y2.stride(0), s.stride(0),
                                   h.stride(0), BLOCK=block, num_warps=max(1, min(8, block // 256)))
    return s.view(x.shape), h.view(x.shape)
