"""Weight formats the kernels read: fp32, bf16, int8 and int4, packed once from a (K in, N out) weight.

- fp32: exact; the packed copy only reorders the weights for the GEMV kernel.
- bf16: each weight rounded to bfloat16 (round to nearest even), products and sums in fp32.
- int8: symmetric, per group of `group` inputs per output channel: w = q * s, q in [-127, 127],
  s = max|w| / 127 stored as fp16 (with group 32: 8.5 bits a weight, llama.cpp's q8_0's bytes).
- int4: per group, as llama.cpp's q4_0 does it: w = (q - 8) * s, q in [0, 15], s = w_absmax_signed / -8
  as fp16, so the largest weight of the group is exact up to the scale's rounding (group 32: 4.5 bits a
  weight, q4_0's bytes).

The layout (super-blocks of 64 outputs, row by row over K) is gpt2ffn/csrc/linear.h's. A Packed remembers
what it was made from (`stale`), so a layer can re-pack after its Parameters change.
"""

import ctypes
import ctypes.util

import torch

from ..errors import ConfigError

PRECISIONS = ("fp32", "bf16", "int8", "int4")
FORMATS = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}
# Group sizes (inputs per scale), measured on random:gpt2 over 1024 positions (README, "Accuracy"): group 32
# has the lowest mean KLD vs fp32 of 32, 64, 128 (and per channel) for both, at q8_0's / q4_0's bytes.
GROUP = {"int8": 32, "int4": 32}
SUPER = 64  # outputs per super-block, the kernel's unit of work


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not supported; known: {', '.join(PRECISIONS)}")
    return precision


def group_for(K: int, precision: str, group: int | None = None) -> int:
    """Inputs per scale for a layer of K inputs: `group` if given (it must divide K), else GROUP[precision], or
    for a width it does not divide, the largest divisor of K below it (even for int4, whose bytes hold pairs)."""
    if precision not in GROUP:
        return 0
    step = 2 if precision == "int4" else 1
    if group is not None:
        if group < 1 or K % group or group % step:
            raise ConfigError(f"{precision} group size {group} must {'be even and ' if step == 2 else ''}divide the "
                              f"layer's {K} inputs")
        return group
    for g in range(GROUP[precision], 0, -1):
        if K % g == 0 and g % step == 0:
            return g
    raise ConfigError(f"{precision} needs an even number of inputs per layer; this layer has {K}")


def _blocks(w, fill=0):
    """(K, N) -> (nsuper, K, 64): N padded with `fill` to a multiple of 64, each super-block of 64 outputs
    row by row over K (gpt2ffn/csrc/linear.h)."""
    K, N = w.shape
    pad = -N % SUPER
    if pad:
        w = torch.cat([w, w.new_full((K, pad), fill)], dim=1)
    return w.view(K, -1, SUPER).permute(1, 0, 2).contiguous()


def quantize_groups(w, precision: str, group: int):
    """(K, N) float weight -> (q, scale): q int8 (K, N), scale float32 (K // group, N). See the module doc."""
    K, N = w.shape
    if K % group:
        raise ConfigError(f"{precision} group size {group} does not divide the layer's {K} inputs")
    wg = w.detach().float().view(K // group, group, N)
    if precision == "int8":
        scale = (wg.abs().amax(dim=1) / 127).half().float()  # fp16 scales; q is rounded against them
        q = torch.round(wg / torch.where(scale == 0, 1.0, scale)[:, None]).clamp_(-127, 127)
    else:
        idx = wg.abs().argmax(dim=1, keepdim=True)
        scale = (wg.gather(1, idx)[:, 0] / -8).half().float()
        q = torch.round(wg / torch.where(scale == 0, 1.0, scale)[:, None] + 8).clamp_(0, 15)
    return q.view(K, N).to(torch.int8), scale


def dequantize(q, scale, precision: str):
    """The weights a quantized layer computes with, as float32 (K, N): the reference for the kernels."""
    K, N = q.shape
    G = K // scale.shape[0]
    qf = q.float() - (8 if precision == "int4" else 0)
    return (qf.view(-1, G, N) * scale[:, None]).view(K, N)


class Packed:
    """A linear layer's weights in the kernel's layout (gpt2ffn/csrc/linear.h), with its bias padded."""

    def __init__(self, weight, bias, precision: str, group: int | None = None):
        self.precision, self.format = precision, FORMATS[precision]
        K, self.N = weight.shape
        self.K = K
        self.group = group_for(K, precision, group)
        self.source = _stamp(weight, bias)
        w = weight.detach().float()
        self.scale = None
        if precision == "fp32":
            self.w = _blocks(w)
        elif precision == "bf16":
            self.w = _blocks(w.to(torch.bfloat16).view(torch.int16))
        else:
            q, s = quantize_groups(w, precision, self.group)
            self.scale = _blocks(s.half(), fill=0.0)
            if precision == "int8":
                self.w = _blocks(q)
            else:
                qb = _blocks(q, fill=8).view(-1, K // 2, 2, SUPER).to(torch.uint8)
                self.w = (qb[:, :, 0] | (qb[:, :, 1] << 4)).contiguous()
        self.route = {"decode": "torch", "prefill": "torch"}  # set by quantize()'s probe
        self.bias = None
        if bias is not None:
            b = bias.detach().float()
            self.bias = torch.cat([b, b.new_zeros(-self.N % SUPER)]).contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads for this layer: weights and scales."""
        return self.w.nbytes + (self.scale.nbytes if self.scale is not None else 0)

    def stale(self, weight, bias) -> bool:
        return _stamp(weight, bias) != self.source

    def made_from(self, weight, bias):
        """Record (weight, bias) as what this was packed from: after a layer lets its fp32 weight go."""
        self.source = _stamp(weight, bias)

    def weights(self, cols=None) -> torch.Tensor:
        """The weights this layer computes with, unpacked to float32: (K, N), or with `cols` (T,) int64 the
        (T, K) rows of W^T for those outputs (for a tied lm_head: the embeddings of those token ids). fp32 and
        bf16 read back exactly what was packed; int8 and int4 the dequantized values q * s."""
        if cols is None:
            return self.weights(torch.arange(self.N, device=self.w.device)).t()
        s, j = cols // SUPER, cols % SUPER
        w = self.w[s, :, j]                                     # (T, K) or, for int4, (T, K/2) byte pairs
        if self.precision == "fp32":
            return w
        if self.precision == "bf16":
            return w.view(torch.bfloat16).float()
        if self.precision == "int4":                            # low nibble: even k, high nibble: odd k
            w = torch.stack((w & 15, w >> 4), dim=-1).view(len(cols), self.K).float() - 8
        scale = self.scale[s, :, j].float()                      # (T, K / group)
        return (w.float().view(len(cols), -1, self.group) * scale[..., None]).view(len(cols), self.K)


def release_freed_memory():
    """Give the pages of freed fp32 weights back to the OS (glibc's malloc_trim): big tensors freed after
    packing can sit in malloc's arenas, still resident, until then. A no-op where libc has no malloc_trim."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _stamp(weight, bias):
    """What identifies the values a Packed was made from: storage, version counter, dtype of each tensor."""
    return tuple((t.data_ptr(), t._version, t.dtype) if t is not None else None for t in (weight, bias))
