"""GPT-2's linear layers on packed weights: Conv1D (HF/OpenAI's [in, out] layout) and what every packable
layer shares (PackedLayer). gpt2ffn.quantize packs any module that has `pack`; the kernels are in kernels/."""

import torch
import torch.nn as nn

from .kernels.formats import Packed
from .kernels.packed import linear, regime


class PackedLayer:
    """What a linear layer needs to run on packed weights: `weight_kn`, `pack`, and `packed_forward` when
    `runs_packed`. A layer with keeps_int8 (the tied lm_head) is packed at int8 where the model asks for int4."""

    packed = None      # a Packed once quantize() has run
    keeps_int8 = False

    def weight_kn(self):
        """The weight as (K in, N out)."""
        raise NotImplementedError

    def pack(self, precision: str, group: int | None = None, activations: str = "fp32"):
        old = self.packed
        self.packed = Packed(self.weight_kn(), self.bias, precision, group, activations)
        if old is not None:
            on_cpu = self.weight.device.type == "cpu"
            self.packed.route = {k: r if on_cpu or r == "torch" else "torch" for k, r in old.route.items()}

    def runs_packed(self, x) -> bool:
        """eval(), fp32 input, and no gradient asked of this layer: the packed weights serve."""
        return (self.packed is not None and not self.training and x.dtype == torch.float32
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)))

    def current(self) -> Packed:
        """The packed weights, re-packed first if the Parameters changed since they were packed."""
        p = self.packed
        if p.stale(self.weight_kn(), self.bias):
            self.pack(p.precision, p.group, p.activations)
            p = self.packed
        return p

    def packed_forward(self, x2, gelu: str | None = None):
        """(M, K) -> (M, N) on the packed weights."""
        p = self.current()
        return linear(x2, p, self.weight_kn(), self.bias, p.route[regime(x2.shape[0])], gelu)


class Conv1D(PackedLayer, nn.Module):
    """GPT-2's linear layer: weight stored [in, out] (HF/OpenAI layout), y = x @ W + b.

    After gpt2ffn.quantize, eval() forward runs on packed weights at the chosen precision."""

    def __init__(self, n_in: int, n_out: int, std: float = 0.02):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))
        nn.init.normal_(self.weight, std=std)

    def weight_kn(self):
        return self.weight

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        if self.runs_packed(x):
            y = self.packed_forward(x2)
        else:
            y = torch.addmm(self.bias, x2, self.weight)  # (N, in) -> (N, out)
        return y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self):
        return f"n_in={self.weight.shape[0]}, n_out={self.weight.shape[1]}"
