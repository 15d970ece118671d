"""One-token decode attention over a slot cache, as one Triton kernel (CUDA), capturable in a CUDA graph.

For each row b and head h: write the new key and value into the row's cache slot (b, or slots[b]) at position
p_b, then attend the query to keys 0..p_b of that slot (online softmax in fp32, the new key from registers), and
write the output as (B, 1, H*D), the layout c_proj reads. Each program reads only its row's p_b + 1 keys, not a
padded span, and nothing builds a mask: SDPA with a boolean mask over the padded span read every position of the
span and ran cutlass's 64x64 memory-efficient tile for one query row (issue 18: 102 us a layer at batch 256 on
an H200, 3x the bytes' time).

`available(device)` says whether it runs there (CUDA, Triton importable, and one small call compiled and right on
the device); elsewhere callers use SDPA.

Each program loops over its row's keys a block at a time, each trip two dependent loads: at batch 256 there are
thousands of programs to hide that, at batch 1 twelve (~10 us a layer on an H200, latency, not bandwidth). So
for few programs (B * H up to twice the GPU's SMs) a wide configuration (up to 256 keys a trip, 8 warps) is timed
against the default once per shape, on scratch caches, and the faster kept (`choices()`; never while a CUDA
graph is captured: the engine's warm-up makes the choice first). GPT2FFN_DECODE_BLOCK=default|wide forces one.
"""

import functools
import os

import torch

from .probe import runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs (CI): callers keep SDPA
    triton = None


def available(device) -> bool:
    """Whether the kernel runs on `device` (kernels/probe.py; elsewhere its callers use SDPA)."""
    return runs_on(device, _check, triton is not None)


def _check(dev) -> bool:
    g = torch.Generator(device=dev).manual_seed(0)
    kc, vc = (torch.randn(2, 1, 8, 16, device=dev, generator=g) for _ in range(2))
    q, k, v = (torch.randn(2, 1, 1, 16, device=dev, generator=g) for _ in range(3))
    out = decode_attention(q, k, v, kc, vc, torch.tensor([0, 5], device=dev), block="default")
    keys, vals = kc[1, 0, :6].clone(), vc[1, 0, :6].clone()
    want = torch.softmax(keys @ q[1, 0, 0] / 4, 0) @ vals
    return torch.allclose(out[0, 0], v[0, 0, 0], atol=1e-5) and torch.allclose(out[1, 0], want, atol=1e-4)


if triton is not None:

    @triton.jit
    def _decode_kernel(Q, KN, VN, KC, VC, POS, PAST, SLOT, O, scale,
                       s_qb, s_qh, s_kb, s_kh, s_vb, s_vh,      # q, new k, new v: (B, H, D) strides, d stride 1
                       s_cs, s_ch, s_cn, s_ob,                   # cache (slots, H, max_len, D); out (B, H * D)
                       D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)  # offsets past 2^31 elements in a large cache
        h = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, DP)
        dm = d < D
        pos = tl.load(POS + b).to(tl.int32)
        past = tl.load(PAST + b).to(tl.int32)
        slot = tl.load(SLOT + b).to(tl.int64)
        q = tl.load(Q + b * s_qb + h * s_qh + d, mask=dm, other=0.0).to(tl.float32) * scale
        kn = tl.load(KN + b * s_kb + h * s_kh + d, mask=dm, other=0.0)
        vn = tl.load(VN + b * s_vb + h * s_vh + d, mask=dm, other=0.0)
        base = slot * s_cs + h * s_ch
        tl.store(KC + base + pos * s_cn + d, kn.to(KC.dtype.element_ty), mask=dm)
        tl.store(VC + base + pos * s_cn + d, vn.to(VC.dtype.element_ty), mask=dm)
        # the new key first, from registers (as stored: the cache's dtype), then keys 0..past-1 from the cache
        m = tl.sum(q * kn.to(KC.dtype.element_ty).to(tl.float32), axis=0)
        l = tl.full([], 1.0, tl.float32)
        acc = vn.to(VC.dtype.element_ty).to(tl.float32)
        for start in range(0, past, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            valid = n < past
            offs = base + n[:, None] * s_cn + d[None, :]
            k = tl.load(KC + offs, mask=valid[:, None] & dm[None, :], other=0.0).to(tl.float32)
            s = tl.where(valid, tl.sum(k * q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(VC + offs, mask=valid[:, None] & dm[None, :], other=0.0).to(tl.float32)
            l = l * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = m_new
        tl.store(O + b * s_ob + h * D + d, (acc / l).to(O.dtype.element_ty), mask=dm)


@functools.cache
def _block_n(D: int) -> int:
    return max(16, min(128, 4096 // triton.next_power_of_2(D)))


def block_config(name: str, D: int) -> tuple:
    """(BLOCK_N, num_warps) of configuration `name`: "default", or "wide" (more keys a trip, more warps)."""
    if name == "wide":
        return max(_block_n(D), min(256, 16384 // triton.next_power_of_2(D))), 8
    return _block_n(D), 2


_CHOICES = {}  # (device index, B, H, D, q dtype, cache dtype) -> "default" | "wide"
FORCED = os.environ.get("GPT2FFN_DECODE_BLOCK")


def choices() -> dict:
    """The configurations chosen so far, for reports."""
    return {f"cuda:{k[0]} B={k[1]} H={k[2]} D={k[3]} {k[4]} cache {k[5]}": v for k, v in _CHOICES.items()}


def _choose(q, k_cache) -> str:
    """The configuration for this call's shape: forced, chosen before, the default where there are enough programs
    (or off CUDA, or while a graph is captured: then kept, so later calls of the shape match the graph), else the
    faster of the two on scratch caches (256 positions, every row reading 255 keys), timed once as the engine runs
    it: 20 calls captured in a CUDA graph and replayed (launched one by one, a few-microsecond kernel would time
    its launches)."""
    if FORCED in ("default", "wide"):
        return FORCED
    B, H, _, D = q.shape
    if q.device.type != "cuda":
        return "default"
    key = (q.device.index, B, H, D, q.dtype, k_cache.dtype)
    name = _CHOICES.get(key)
    if name is not None:
        return name
    if B * H > 2 * torch.cuda.get_device_properties(q.device).multi_processor_count:
        return _CHOICES.setdefault(key, "default")
    if torch.cuda.is_current_stream_capturing():
        return _CHOICES.setdefault(key, "default")
    L = min(256, k_cache.shape[2])
    kc, vc = (torch.zeros(B, H, L, D, dtype=k_cache.dtype, device=q.device) for _ in range(2))
    x = torch.zeros(B, H, 1, D, dtype=q.dtype, device=q.device)
    pos = torch.full((B,), L - 1, device=q.device)
    slots = torch.arange(B, device=q.device)
    times = {}
    for name in ("default", "wide"):
        run = functools.partial(decode_attention, x, x, x, kc, vc, pos, slots=slots, block=name)
        try:
            run()  # compiled and warm, outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    run()
        except Exception:  # noqa: BLE001 -- a configuration this GPU cannot build (resources) is not a candidate
            continue
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        end.synchronize()
        times[name] = start.elapsed_time(end)
    _CHOICES[key] = min(times, key=times.get) if times else "default"
    return _CHOICES[key]


def decode_attention(q, k, v, k_cache, v_cache, positions, scale=None, past=None, slots=None, block=None):
    """q, k, v: (B, H, 1, D), the new token of rows 0..B-1 (any strides with d contiguous); k_cache, v_cache:
    (slots, H, max_len, D) contiguous, row b's slot is b (or slots[b], slots (B,) int64); positions (B,) int64,
    each row's new position.
    Writes k, v into the cache at (b, :, positions[b]) and returns the attention output (B, 1, H * D) over the
    new key and keys 0..past[b] - 1 of the slot (past: (B,) int64, default positions; a padding row's 0 reads
    nothing: the static steps' padding rows sit at the slot's last position, and would read every key). block:
    "default" or "wide" (block_config), else chosen per shape (_choose)."""
    B, H, T, D = q.shape
    if T != 1:
        raise ValueError(f"decode_attention takes one new token per row, got q of shape {tuple(q.shape)}")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("decode_attention needs k_cache and v_cache with the same strides and d contiguous")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("decode_attention needs q, k and v with d contiguous")
    for name, t in (("positions", positions), ("past", past), ("slots", slots)):
        if t is not None and (t.dim() != 1 or t.shape[0] != B or t.stride(0) != 1 or t.device != q.device):
            raise ValueError(f"decode_attention: {name} must be ({B},) contiguous on {q.device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    scale = D ** -0.5 if scale is None else scale
    out = torch.empty(B, 1, H * D, dtype=q.dtype, device=q.device)
    sc = k_cache.stride()
    if slots is None:
        slots = torch.arange(B, device=q.device)
    block_n, warps = block_config(block or _choose(q, k_cache), D)
    _decode_kernel[(B, H)](
        q, k, v, k_cache, v_cache, positions, positions if past is None else past, slots, out, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        sc[0], sc[1], sc[2], out.stride(0),
        D=D, DP=triton.next_power_of_2(D), BLOCK_N=block_n, num_warps=warps)
    return out
