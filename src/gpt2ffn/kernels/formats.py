"""Weight formats the kernels read: fp32, bf16, int8 and int4, packed once from a (K in, N out) weight.

- fp32: exact; the packed copy only reorders the weights for the GEMV kernel.
- bf16: each weight rounded to bfloat16 (round to nearest even), products and sums in fp32.
- int8: symmetric, per group of `group` inputs per output channel: w = q * s, q in [-127, 127],
  s = max|w| / 127 stored as fp16 (with group 32: 8.5 bits a weight, llama.cpp's q8_0's bytes).
- int4: per group, as llama.cpp's q4_0 does it: w = (q - 8) * s, q in [0, 15], s = w_absmax_signed / -8
  as fp16, so the largest weight of the group is exact up to the scale's rounding (group 32: 4.5 bits a
  weight, q4_0's bytes).

Activations: "fp32" (each weight is turned back into a float and meets the fp32 activation in an fp32 FMA) or,
for int8 and int4, "int8": each row of x quantized per group of the weights' `group` inputs to int8 with its
own fp32 scale (d = max|x| / 127, q = round(x / d)), as llama.cpp's q8_0 / q4_0 and ONNX Runtime's int8 do, and
each group's products summed exactly in int32 (vpdpbusd / maddubs), then scaled by d * s into fp32.

The layout (super-blocks of 64 outputs, row by row over K) is gpt2ffn/csrc/linear.h's. A Packed remembers
what it was made from (`stale`), so a layer can re-pack after its Parameters change.
"""

import contextlib
import ctypes
import ctypes.util
import math
import mmap
import threading

import torch

from ..errors import ConfigError

PRECISIONS = ("fp32", "bf16", "int8", "int4")
FORMATS = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}
ACTIVATIONS = ("fp32", "int8")
INT8_FORMATS = {"int8": 4, "int4": 5}  # the int8-activation layouts (linear.h's I8A8, I4A8)
# The activations each precision runs with unless asked otherwise (README, "Integer dot products").
DEFAULT_ACTIVATIONS = {"fp32": "fp32", "bf16": "fp32", "int8": "int8", "int4": "int8"}
# k per 4-byte word of the int8-activation layouts: a group must hold whole words
WORD = {"int8": 4, "int4": 8}
# Group sizes (inputs per scale), measured on random:gpt2 over 1024 positions (README, "Accuracy"): group 32
# has the lowest mean KLD vs fp32 of 32, 64, 128 (and per channel) for both, at q8_0's / q4_0's bytes.
GROUP = {"int8": 32, "int4": 32}
SUPER = 64  # outputs per super-block, the kernel's unit of work
_GENERATION = [0]  # bumped whenever a layer's packed weights or their route change (see generation())


def generation() -> int:
    """A number that changes whenever any layer gets new packed weights (PackedLayer.packed) or a Packed a new
    route: what a plan built from them checks (kernels/packed.DecodePlan) instead of walking every layer."""
    return _GENERATION[0]


def changed():
    _GENERATION[0] += 1


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not supported; known: {', '.join(PRECISIONS)}")
    return precision


def check_activations(precision: str, activations: str) -> str:
    if activations not in ACTIVATIONS:
        raise ConfigError(f"activations {activations!r} is not supported; known: {', '.join(ACTIVATIONS)}")
    if activations == "int8" and precision not in INT8_FORMATS:
        raise ConfigError(f"int8 activations need int8 or int4 weights, not {precision}")
    return activations


def group_for(K: int, precision: str, group: int | None = None, activations: str = "fp32") -> int:
    """Inputs per scale for a layer of K inputs: `group` if given (it must divide K), else GROUP[precision], or
    for a width it does not divide, the largest divisor of K below it (even for int4, whose bytes hold pairs;
    with int8 activations a multiple of WORD[precision], the k one 4-byte word holds)."""
    if precision not in GROUP:
        return 0
    step = WORD[precision] if activations == "int8" else 2 if precision == "int4" else 1
    rule = f"be a multiple of {step} and " if step > 1 else ""
    with_act = " with int8 activations" if activations == "int8" else ""
    if group is not None:
        if group < 1 or K % group or group % step:
            raise ConfigError(f"{precision}{with_act} group size {group} must {rule}divide the layer's {K} inputs")
        return group
    for g in range(GROUP[precision], 0, -1):
        if K % g == 0 and g % step == 0:
            return g
    if activations == "int8":
        why, other = (f"a 4-byte word holds {step} weights", f"with fp32 activations {precision} takes "
                      f"{'any width' if precision == 'int8' else 'an even one'}")
    else:
        why, other = "a byte holds two int4 weights", "int8 and bf16 take any width"
    raise ConfigError(f"{precision}{with_act} needs a number of inputs per layer divisible by {step} ({why}); "
                      f"this layer has {K} (n_embd or n_inner): {other}")


def _blocks(w, fill=0, dtype=None, place=False):
    """(K, N) -> (nsuper, K, 64) in `dtype` (default w's; a float conversion rounds as .to() does): N padded with
    `fill` to a multiple of 64, each super-block of 64 outputs row by row over K (gpt2ffn/csrc/linear.h). place:
    written straight where on_huge_pages would copy it (a layer's final tensor), not in fresh memory first."""
    K, N = w.shape
    full, rest = divmod(N, SUPER)
    shape, dtype = (full + (rest > 0), K, SUPER), dtype or w.dtype
    out = empty_on_huge_pages(shape, dtype) if place else torch.empty(shape, dtype=dtype)
    out[:full].copy_(w[:, :full * SUPER].view(K, full, SUPER).permute(1, 0, 2))
    if rest:
        out[full, :, :rest].copy_(w[:, full * SUPER:])
        out[full, :, rest:].fill_(fill)
    return out


def quantize_groups(w, precision: str, group: int):
    """(K, N) float weight -> (q, scale): q int8 (K, N), scale float32 (K // group, N). See the module doc."""
    K, N = w.shape
    if K % group:
        raise ConfigError(f"{precision} group size {group} does not divide the layer's {K} inputs")
    wg = w.detach().float().view(K // group, group, N)
    q = torch.empty(K // group, group, N, dtype=torch.int8)
    scale = torch.empty(K // group, N)
    # A few groups' rows at a time through one float buffer, written in place: each pass then finds its data in the
    # cache, and no pass takes fresh memory (first-touch page faults were most of the time: GPT-2 xl's int8 packing
    # ~20 s). The same operations on every element as whole-tensor ones, so the same bits.
    step = max(1, (1 << 18) // (group * N))
    buf = torch.empty(min(step, K // group), group, N)
    for g0 in range(0, K // group, step):
        part = wg[g0:g0 + step]
        b = buf[:part.shape[0]]
        if precision == "int8":
            s = (torch.abs(part, out=b).amax(dim=1) / 127).half().float()  # fp16 scales; q is rounded against them
            torch.div(part, torch.where(s == 0, 1.0, s)[:, None], out=b).round_().clamp_(-127, 127)
        else:
            s = (_first_of_largest_magnitude(part) / -8).half().float()
            torch.div(part, torch.where(s == 0, 1.0, s)[:, None], out=b).add_(8).round_().clamp_(0, 15)
        q[g0:g0 + step] = b
        scale[g0:g0 + step] = s
    return q.view(K, N), scale


def _first_of_largest_magnitude(part):
    """Per group (dim 1) and column: the value of largest |w|, the first such where +m and -m both occur (as
    part.gather(1, part.abs().argmax(1)), whose strided argmax took two thirds of int4 packing): from the group's
    max and min, m = max(max, -min) is +m or -m when only one of them is in the group (max == m,
    or min == -m, not both); a tie, a group of zeros (+0 and -0) or a NaN takes the argmax."""
    mx, mn = part.amax(dim=1), part.amin(dim=1)  # (torch.aminmax over this dim: 2.7x int8's abs + amax, here)
    m = torch.maximum(mx, -mn)
    pos, neg = mx == m, mn == -m
    value = torch.where(pos, m, -m)
    either = pos ^ neg
    if not bool(either.all()):
        first = part.gather(1, part.abs().argmax(dim=1, keepdim=True))[:, 0]
        value = torch.where(either, value, first)
    return value


def quantize_activations(x, group: int):
    """(M, K) float -> (q int8 (M, K), d float32 (M, K // group)): per row and group, d = max|x| / 127 and
    q = round-half-even(x * (1 / d)), in the same fp32 operations as the native kernels (qlinear_impl.h)."""
    M, K = x.shape
    if K % group:
        raise ConfigError(f"activations have {K} inputs, not a multiple of the group size {group}")
    xg = x.detach().float().reshape(M, K // group, group)
    d = xg.abs().amax(dim=-1) / 127
    inv = torch.where(d == 0, 0.0, 1.0 / torch.where(d == 0, 1.0, d))
    q = torch.round(xg * inv[..., None]).clamp_(-127, 127)
    return q.view(M, K).to(torch.int8), d


def fake_quantize_activations(x, group: int):
    """x as the int8-activation kernels see it, back in float32 (M, K): q * d."""
    q, d = quantize_activations(x, group)
    M, K = x.shape
    return (q.float().view(M, K // group, group) * d[..., None]).view(M, K)


def dequantize(q, scale, precision: str):
    """The weights a quantized layer computes with, as float32 (K, N): the reference for the kernels."""
    K, N = q.shape
    G = K // scale.shape[0]
    qf = q.float() - (8 if precision == "int4" else 0)
    return (qf.view(-1, G, N) * scale[:, None]).view(K, N)


class Packed:
    """A linear layer's weights in the kernel's layout (gpt2ffn/csrc/linear.h), with its bias padded."""

    def __init__(self, weight, bias, precision: str, group: int | None = None, activations: str = "fp32"):
        self.activations = check_activations(precision, activations)
        self.precision = precision
        self.format = INT8_FORMATS[precision] if activations == "int8" else FORMATS[precision]
        K, self.N = weight.shape
        self.K = K
        self.group = group_for(K, precision, group, activations)
        self.source = _stamp(weight, bias)
        w = weight.detach().float()
        self.scale = None
        if precision == "fp32":
            self.w = _blocks(w, place=True)
        elif precision == "bf16":
            self.w = _blocks(w, dtype=torch.bfloat16, place=True).view(torch.int16)
        else:
            q, s = quantize_groups(w, precision, self.group)
            self.scale = _blocks(s, fill=0.0, dtype=torch.float16, place=True)
            if activations == "int8":
                self.w = _words(q, precision)
            elif precision == "int8":
                self.w = _blocks(q, place=True)
            else:
                qb = _blocks(q, fill=8).view(-1, K // 2, 2, SUPER).to(torch.uint8)
                self.w = on_huge_pages(qb[:, :, 0] | (qb[:, :, 1] << 4))
        self._route = {"decode": "torch", "prefill": "torch"}  # set by quantize()'s probe
        self.bias = None
        if bias is not None:
            b = bias.detach().float()
            self.bias = torch.cat([b, b.new_zeros(-self.N % SUPER)]).contiguous()

    def __getstate__(self):
        """pickle, torch.save, copy.deepcopy: each tensor on a storage of its own (in a packing arena they share
        one under different dtypes, which torch.save refuses); they load back as ordinary tensors."""
        state = self.__dict__.copy()
        for k in ("w", "scale", "bias"):
            if isinstance(state.get(k), torch.Tensor):
                state[k] = state[k].clone()
        return state

    @property
    def route(self) -> dict:
        """The kernel route per regime ({"decode": ..., "prefill": ...}); assigning a new dict counts as a change
        (generation())."""
        return self._route

    @route.setter
    def route(self, route: dict):
        self._route = route
        changed()

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
        if self.activations == "int8":                          # _words' layout: (T, K/4 or K/8, 4) bytes
            if self.precision == "int8":
                w = w.reshape(len(cols), self.K).float() - 128
            else:                                               # byte i of word j: k 8j + i low, 8j + 4 + i high
                w = torch.stack((w & 15, w >> 4), dim=-2).reshape(len(cols), self.K).float() - 8
            scale = self.scale[s, :, j].float()
            return (w.view(len(cols), -1, self.group) * scale[..., None]).view(len(cols), self.K)
        if self.precision == "fp32":
            return w
        if self.precision == "bf16":
            return w.view(torch.bfloat16).float()
        if self.precision == "int4":                            # low nibble: even k, high nibble: odd k
            w = torch.stack((w & 15, w >> 4), dim=-1).view(len(cols), self.K).float() - 8
        scale = self.scale[s, :, j].float()                      # (T, K / group)
        return (w.float().view(len(cols), -1, self.group) * scale[..., None]).view(len(cols), self.K)


HUGE_PAGE = 2 << 20
PAGE = mmap.PAGESIZE
CHUNK = 32 << 20  # bytes of one arena region (packing_arena): layers are packed into it one after another
_ARENA = threading.local()


def _advised(nbytes: int):
    """(uint8 tensor of nbytes at a 2 MiB boundary, advised for transparent huge pages) or None where this
    system has no such mapping or advice."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf = torch.frombuffer(mm, dtype=torch.uint8)  # holds mm: the pages live as long as a view of them
        off = -buf.data_ptr() % HUGE_PAGE
        mm.madvise(mmap.MADV_HUGEPAGE, off, nbytes // HUGE_PAGE * HUGE_PAGE)
    except (OSError, ValueError, AttributeError):
        return None
    return buf[off:off + nbytes]


@contextlib.contextmanager
def packing_arena():
    """Inside, packed tensors on the CPU go one after another into shared regions of CHUNK bytes (see
    on_huge_pages), so small layers (GPT-2 124M's attn.c_proj at int8: 0.6 MiB) sit on huge pages too. A region
    lives as long as a tensor in it; what was never written is never resident."""
    depth = getattr(_ARENA, "depth", 0)
    if not depth:
        _ARENA.chunk, _ARENA.used, _ARENA.off = None, 0, False
    _ARENA.depth = depth + 1
    try:
        yield
    finally:
        _ARENA.depth = depth
        if not depth:
            _ARENA.chunk = None  # the regions now belong to the tensors in them


def _placed(nbytes: int):
    """uint8 memory of nbytes where on_huge_pages puts a tensor of that size (see there), or None: it stays
    where it is."""
    if getattr(_ARENA, "depth", 0):
        if _ARENA.off:  # no huge pages here: ordinary tensors for the rest of the arena
            return None
        start = (_ARENA.used + 63) // 64 * 64
        if _ARENA.chunk is None or start + nbytes > _ARENA.chunk.numel():
            _ARENA.chunk, start = _advised(max(CHUNK, nbytes)), 0
            if _ARENA.chunk is None:
                _ARENA.off = True
                return None
        _ARENA.used = start + nbytes
        return _ARENA.chunk[start:start + nbytes]
    return _advised(nbytes) if nbytes >= HUGE_PAGE else None


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """t (a CPU tensor, any strides) copied into memory Linux may back with 2 MiB pages (transparent huge pages,
    asked for with madvise: the common "madvise" setting gives them to no one who does not ask), else t made
    contiguous. A decode step streams every weight from DRAM; with 4 KiB pages each 4 KiB costs a TLB miss and a
    page walk. Measured on AMD EPYC Zen 4 (2 threads, GPT-2 124M, decode tokens/s, same process, interleaved):
    fp32 1.37x, bf16 1.27x; llama.cpp gets the same from the page cache of its mmapped GGUF. Inside
    packing_arena() tensors share regions; outside, a tensor under 2 MiB stays where it is, and of a larger
    one only the whole 2 MiB blocks are advised, so no page past its end becomes resident."""
    n = t.nbytes
    out = _placed(n) if t.device.type == "cpu" and n else None
    if out is None:
        return t.contiguous()
    out = out.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def empty_on_huge_pages(shape, dtype) -> torch.Tensor:
    """An uninitialized CPU tensor where on_huge_pages would have copied one of this shape and dtype: a layer's
    packed weights are written there once, with no copy in fresh memory first."""
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    out = _placed(n) if n else None
    return torch.empty(shape, dtype=dtype) if out is None else out.view(dtype).view(shape)


def huge_zeros(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """torch.zeros(shape) that Linux may back with transparent huge pages (CPU, from 2 MiB up): a fresh anonymous
    mapping, zero until written and resident only where written. For the KV cache, which decode attention
    streams as the weights are streamed: at 4 KiB pages the hardware prefetcher stops at every page."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = _advised(n) if n >= HUGE_PAGE else None
    if buf is None:
        return torch.zeros(shape, dtype=dtype)
    return buf.view(dtype).view(shape)


MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python's mmap module names it only from 3.12 (as mmap.MADV_POPULATE_WRITE)


def make_resident(t: torch.Tensor) -> bool:
    """Fault in every page of t (a CPU tensor) now rather than on its first write, leaving what it holds as it is:
    madvise(MADV_POPULATE_WRITE), the kernel zeroing fresh pages in one call. False where this system cannot
    (a kernel before 5.14, another OS), or off the CPU."""
    if t.device.type != "cpu" or t.nbytes == 0 or not t.is_contiguous():
        return False
    start = t.data_ptr() // PAGE * PAGE
    length = -(-(t.data_ptr() + t.nbytes - start) // PAGE) * PAGE
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(start, length, MADV_POPULATE_WRITE) == 0
    except (OSError, AttributeError):
        return False


def release_freed_memory():
    """Give the pages of freed fp32 weights back to the OS (glibc's malloc_trim): big tensors freed after
    packing can sit in malloc's arenas, still resident, until then. A no-op where libc has no malloc_trim."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _words(q, precision: str):
    """int8 (K, N) quantized weights -> the int8-activation layout (linear.h's I8A8 / I4A8): per super-block,
    4-byte words of consecutive k per lane, as vpdpbusd reads them. int8: q + 128 (unsigned bytes); int4: q's
    nibbles, k 8j + i low and 8j + 4 + i high in byte i of word j. Written once, where it will live (q, this
    packing's own, is overwritten), from q's rows: through _blocks and whole-tensor steps each in fresh memory
    GPT-2 xl's int8 layers took ~5 s of its load."""
    K, N = q.shape
    if precision == "int8":  # q ^ 0x80 is q + 128 as an unsigned byte
        u, fill = q.view(torch.uint8).bitwise_xor_(0x80).view(K // 4, 4, N), 128  # (K/4 words, byte i, N)
    else:
        v = q.view(torch.uint8).view(K // 8, 2, 4, N)                             # k = 8j + 4h + i
        u, fill = v[:, 0] | (v[:, 1] << 4), 8 | 8 << 4                             # (K/8 words, byte i, N)
    full, rest = divmod(N, SUPER)
    out = empty_on_huge_pages((full + (rest > 0), u.shape[0], SUPER, 4), torch.uint8)  # (nsuper, words, 64, 4)
    out[:full].copy_(u[..., :full * SUPER].view(u.shape[0], 4, full, SUPER).permute(2, 0, 3, 1))
    if rest:
        out[full, :, :rest].copy_(u[..., full * SUPER:].permute(0, 2, 1))
        out[full, :, rest:] = fill
    return out


def _stamp(weight, bias):
    """What identifies the values a Packed was made from: storage, version counter, dtype of each tensor."""
    return tuple((t.data_ptr(), -1 if t.is_inference() else t._version, t.dtype) if t is not None else None
                 for t in (weight, bias))  # an inference-mode tensor has no version counter
