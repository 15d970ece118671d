"""CPU inference paths for the FFN: fp32, 2-D contiguous input (N, d) -> (N, d), no autograd.

Each path writes c_fc's output into a hidden buffer reused across calls (one per thread, so two threads
calling the same module never share one), applies bias and GELU in place on it, and writes c_proj into a
fresh output tensor (the caller may keep it). Paths differ in the GEMM library and the GELU formula:

- GEMM "torch": torch.addmm (MKL/oneDNN) with the bias fused as beta * bias.
- GEMM "numpy": numpy.matmul (OpenBLAS) on zero-copy numpy views of the same memory.
- GELU "aten": F.gelu(approximate="tanh") semantics through aten.gelu_ in place.
- GELU "sigmoid": the same tanh form rewritten as x * sigmoid(2u), since 0.5(1 + tanh(u)) = sigmoid(2u);
  torch's CPU sigmoid is several times faster than its tanh, and the rewrite is exact in real arithmetic
  (fp32 error 5e-7 against float64, as aten's own).
"""

import math
import threading

import numpy as np
import torch

_C2 = 2.0 * math.sqrt(2.0 / math.pi)  # 2u = C2 * (x + 0.044715 x^3)


class _Buffers(threading.local):
    """Per-thread scratch tensors, one per (tag, cols), grown to the most rows asked for; views are returned."""

    def get(self, tag, rows, cols):
        store = self.__dict__.setdefault("store", {})
        buf = store.get((tag, cols))
        if buf is None or buf.shape[0] < rows:
            buf = torch.empty(max(rows, 1), cols)
            store[(tag, cols)] = buf
        return buf[:rows]


BUFFERS = _Buffers()


def gelu_sigmoid_(h, approximate):
    """tanh GELU in place as h * sigmoid(C2 (h + 0.044715 h^3)); exact and relu go to aten."""
    if approximate != "tanh":
        return activate_(h, approximate)
    t = BUFFERS.get("gelu", h.shape[0], h.shape[1])
    torch.mul(h, h, out=t)
    t.mul_(0.044715 * _C2).add_(_C2).mul_(h)  # 2u
    torch.sigmoid(t, out=t)
    return h.mul_(t)


def activate_(h, approximate):
    """The activation in place: 'tanh' / 'none' GELU, or 'relu'."""
    if approximate == "relu":
        return h.relu_()
    return torch.ops.aten.gelu_(h, approximate=approximate)


GELUS = {"aten": activate_, "sigmoid": gelu_sigmoid_}


def ffn_torch(x, w1, b1, w2, b2, approximate, gelu_):
    h = BUFFERS.get("hidden", x.shape[0], w1.shape[1])
    torch.addmm(b1, x, w1, out=h)            # (N, d) -> (N, hidden), bias fused
    gelu_(h, approximate)
    return torch.addmm(b2, h, w2)            # (N, hidden) -> (N, d), a fresh tensor


def ffn_numpy(x, w1, b1, w2, b2, approximate, gelu_):
    h = BUFFERS.get("hidden", x.shape[0], w1.shape[1])
    hn = h.numpy()
    np.matmul(x.detach().numpy(), w1.detach().numpy(), out=hn)  # OpenBLAS, writing into torch's buffer
    h.add_(b1)
    gelu_(h, approximate)
    y = torch.empty(x.shape[0], w2.shape[1])
    np.matmul(hn, w2.detach().numpy(), out=y.numpy())
    return y.add_(b2)


GEMMS = {"torch": ffn_torch, "numpy": ffn_numpy}
# Every (gemm, gelu) pair is a path, runnable by name (GPT2FFN_PATH=numpy+sigmoid).
PATHS = {f"{g}+{a}": (GEMMS[g], GELUS[a]) for g in GEMMS for a in GELUS}
# The path FeedForward's CPU fp32 inference runs above DECODE_TOKENS (kernels.choose): torch's GEMMs and the sigmoid
# form, whose GELU takes half aten's time (0.49 against 1.02 ms at 512 x 3072, AMD EPYC Zen 5;
# benchmarks/gelu_forms.py). The two forms used to race per process ("torch+aten" against this one), but they round
# differently and won by turns within the noise (the GEMMs are ~98% of the time), so two runs could give different
# bits. numpy's OpenBLAS is not taken: after each call its worker threads busy-wait (~0.1 s) and take both cores
# from torch's OpenMP pool, so one numpy GEMM slows every torch op around it (measured: torch.mm at 768x64 from 2.4
# to 6.6 ms; HF generate with the numpy path chosen fell to 0.15x).
DEFAULT = "torch+sigmoid"


def run_path(name, x, w1, b1, w2, b2, approximate):
    gemm, gelu_ = PATHS[name]
    return gemm(x, w1, b1, w2, b2, approximate, gelu_)
