"""The FFN on CUDA: c_fc's bias and GELU in cuBLASLt's epilogue, where that is GPT-2's GELU and faster.

`torch._addmm_activation(b, x, w, use_gelu=True)` computes x @ w + b and applies GELU as the GEMM stores its
output (cuBLASLt's GELU_BIAS epilogue), which saves a pass over the (N, hidden) tensor. Which GELU that is
depends on the device: the CPU's kernel computes the exact form, and cuBLASLt's epilogue a tanh form, maybe
approximated. So before it is used on a device, one call is measured against both forms, once: fp32, on
inputs that are exact in TF32, through an identity weight, so only the activation can differ. It serves a
dtype where it is within that dtype's bound of the tanh form everywhere (fp32: 2e-6, inside the 1e-5 the FFN
is held to; bf16 / fp16: 1e-4, far inside their rounding) and at least 3e-4 from the exact form somewhere
(they differ by up to 4.7e-4). On an H200 (torch 2.11+cu130) it failed the fp32 bound; the errors it measured
are now kept for reports (`choices()`). Then, per dtype, shape and token bucket, the fused call is timed
against the plain ops and the faster is kept. No check or timing runs while a CUDA graph is being captured:
there the plain ops run until a choice exists (the engine's warm-up makes it first).
Where the epilogue does not serve, kernels/gemm_gelu.py (c_fc and GELU in one Triton kernel, bf16 / fp16, from
1,024 tokens) is the third candidate. GPT2FFN_CUDA_FFN=fused|triton|plain forces one.
"""

import os
import threading
import time

import torch
import torch.nn.functional as F

from . import gemm_gelu

_ERRORS = {}   # device -> (max |epilogue - tanh GELU|, max |epilogue - exact GELU|)
_CHOICES = {}  # (device index, dtype, (d, hidden), token bucket) -> "fused" | "triton" | "plain"
_LOCK = threading.Lock()
FORCED = os.environ.get("GPT2FFN_CUDA_FFN")
TANH_BOUND = {torch.float32: 2e-6, torch.bfloat16: 1e-4, torch.float16: 1e-4}  # per dtype, see the docstring


def fused(x2, w1, b1, w2, b2):
    """c_fc with bias and GELU in the GEMM's epilogue, then c_proj with its bias."""
    return torch.addmm(b2, torch._addmm_activation(b1, x2, w1, use_gelu=True), w2)


def epilogue_gelu_errors(device) -> tuple:
    """(max |epilogue - tanh form|, max |epilogue - exact form|) of torch._addmm_activation's GELU on `device`,
    measured once per device in fp32 over [-6.4, 6.4]."""
    device = torch.device(device)
    if device not in _ERRORS:
        x = (torch.arange(64 * 16, dtype=torch.float32) - 512).reshape(64, 16) / 80  # [-6.4, 6.4], exact in TF32
        x = x.to(device)
        y = torch._addmm_activation(torch.zeros(16, device=device), x, torch.eye(16, device=device), use_gelu=True)
        _ERRORS[device] = ((y - F.gelu(x, approximate="tanh")).abs().max().item(),
                           (y - F.gelu(x)).abs().max().item())
    return _ERRORS[device]


def epilogue_gelu_is_tanh(device, dtype=torch.float32) -> bool:
    """Whether torch._addmm_activation's GELU on `device` is the tanh form, within `dtype`'s bound."""
    tanh, exact = epilogue_gelu_errors(device)
    return tanh <= TANH_BOUND.get(dtype, 0.0) and exact >= 3e-4


def _time(f, repeats: int = 10) -> float:
    f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        f()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def choose(x2, w1, b1, w2, b2, plain, bucket: int) -> str:
    """'fused' (cuBLASLt's epilogue), 'triton' (kernels/gemm_gelu.py) or 'plain' for this call's device, dtype,
    shape and token bucket (tanh GELU only): the fastest of those that serve it, timed once."""
    if FORCED in ("fused", "plain", "triton"):
        return FORCED
    key = (x2.get_device(), x2.dtype, w1.shape, bucket)  # (the cheapest fields: this runs every call)
    name = _CHOICES.get(key)
    if name is not None:
        return name
    if not x2.is_cuda or torch.cuda.is_current_stream_capturing():
        return "plain"
    with _LOCK:
        if key not in _CHOICES:
            paths = {"plain": lambda: plain(x2, w1, b1, w2, b2, "tanh")}
            if epilogue_gelu_is_tanh(x2.device, x2.dtype):
                paths["fused"] = lambda: fused(x2, w1, b1, w2, b2)
            if gemm_gelu.available(x2):
                paths["triton"] = lambda: gemm_gelu.fused(x2, w1, b1, w2, b2)
            times = {name: _time(f) for name, f in paths.items()}
            _CHOICES[key] = min(times, key=times.get)
    return _CHOICES[key]


def choices() -> dict:
    """What has been checked and chosen so far, for reports."""
    return {"epilogue_gelu_errors": {str(k): {"max_vs_tanh": t, "max_vs_exact": e} for k, (t, e) in _ERRORS.items()},
            "ffn": {f"cuda:{k[0]} {k[1]} {k[2][0]}x{k[2][1]} tokens<={k[3]}": v for k, v in _CHOICES.items()}}
