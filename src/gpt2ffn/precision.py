"""Weight precisions for inference: fp32, bf16, int8 and int4 weights, packed once from the Parameters.

A layer's Parameters stay fp32 in HF's layout (state_dict() is unchanged); `quantize` derives a packed copy
that decode and prefill read instead. Activations, LayerNorm, attention and embeddings stay fp32 at every
precision; only the linear layers' weights (c_attn, attn.c_proj, c_fc, mlp.c_proj, and the lm_head tied to
wte) are rounded:

- fp32: exact; the packed copy only reorders the weights for the GEMV kernel.
- bf16: each weight rounded to bfloat16 (round to nearest even), products and sums in fp32.
- int8: symmetric, per group of `group` inputs per output channel: w = q * s, q in [-127, 127],
  s = max|w| / 127 stored as fp16 (with group 32: 8.5 bits a weight, llama.cpp's q8_0's bytes).
- int4 (the lm_head tied to wte stays int8, as q4_0 keeps it at q6_K): per group, as llama.cpp's q4_0 does it: w = (q - 8) * s, q in [0, 15], s = w_absmax_signed / -8
  as fp16, so the largest weight of the group is exact up to the scale's rounding (group 32: 4.5 bits a
  weight, q4_0's bytes).

The packed copy is never silently stale: every packed call checks the Parameter's version counter and data
pointer, and re-packs after `load_state_dict`, `copy_`, an optimizer step or `.to()`. In train() mode, or
when autograd needs gradients, layers run on the fp32 Parameters.
"""

import torch

from .errors import ConfigError

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


def _stamp(weight, bias):
    """What identifies the values a Packed was made from: storage, version counter, dtype of each tensor."""
    return tuple((t.data_ptr(), t._version, t.dtype) if t is not None else None for t in (weight, bias))


def packable(module) -> list:
    """The linear layers of `module` that a precision applies to, with their (K, N) weight: every Conv1D
    (c_attn, attn.c_proj, c_fc, mlp.c_proj) and a GPT-2 lm_head."""
    from .ffn import Conv1D
    from .model import LMHead
    return [m for m in module.modules() if isinstance(m, (Conv1D, LMHead))]


def quantize(module, precision: str, group: int | None = None):
    """Give every linear layer of `module` (a FeedForward, a GPT2, a Block, ...) packed weights at
    `precision` ('fp32', 'bf16', 'int8', 'int4'), for inference; returns the module.

    The fp32 Parameters stay (state_dict() is HF's layout, and train() runs on them); eval() forward then
    reads the packed weights through the kernel route the probe measured fastest on this machine. For
    bf16/int8/int4 the Parameters stop asking for gradients, so no_grad or not, eval() computes at the
    chosen precision; call requires_grad_() to train."""
    from .kernels.packed import probe
    check_precision(precision)
    if group is not None and precision not in GROUP:
        raise ConfigError(f"group applies to int8 and int4, not {precision}")
    layers = packable(module)
    if not layers:
        raise ConfigError(f"{type(module).__name__} has no GPT-2 linear layers (Conv1D, lm_head) to quantize")
    for m in layers:
        if m.weight.dtype != torch.float32:
            raise ConfigError(f"precision {precision!r} packs fp32 Parameters; {type(m).__name__} weight is "
                              f"{m.weight.dtype} (load with dtype=torch.float32)")
    from .model import LMHead
    for m in layers:
        # int4 keeps the tied lm_head (= wte, the most sensitive matrix) at int8, as llama.cpp's q4_0 keeps it
        # at q6_K: measured on random:gpt2, mean KLD vs fp32 0.301 -> 0.287 (q4_0: 0.294)
        head8 = precision == "int4" and isinstance(m, LMHead)
        m.pack("int8" if head8 else precision, None if head8 else group)
        if precision != "fp32":
            for p in m.parameters():
                p.requires_grad_(False)
    choice = probe([(m.packed, m.weight_kn(), m.bias) for m in layers], precision, layers[0].weight.device)
    for m in layers:
        m.packed.route = choice
    module.precision = precision
    return module


class PackedLayer:
    """What Conv1D and LMHead share: packing their weights, and running on the packed copy when they can."""

    packed = None  # a Packed once quantize() has run

    def weight_kn(self):
        """The weight as (K in, N out)."""
        raise NotImplementedError

    def pack(self, precision: str, group: int | None = None):
        old = self.packed
        self.packed = Packed(self.weight_kn(), self.bias, precision, group)
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
            self.pack(p.precision, p.group)
            p = self.packed
        return p

    def packed_forward(self, x2, gelu: str | None = None):
        """(M, K) -> (M, N) on the packed weights."""
        from .kernels.packed import linear, regime
        p = self.current()
        return linear(x2, p, self.weight_kn(), self.bias, p.route[regime(x2.shape[0])], gelu)
