"""Linear layers on packed weights (kernels/formats.py): the routes that can run them and the probe that picks.

Routes, each computing the same numbers for a precision (validated against numpy before any timing):
- "native": gpt2ffn._C.linear, our AVX-512 / AVX2 GEMV and small-GEMM kernels on the packed layout
  (gpt2ffn/csrc). Every output is one fp32 FMA chain over K in order: batch-invariant and deterministic.
- "torch":  torch.addmm (MKL / oneDNN through aten) on the layer's fp32 weights (fp32: the Parameter;
  bf16/int8/int4: a dense fp32 copy of the rounded weights, made when this route is first needed); with int8
  activations, on x quantized and dequantized as the native kernels quantize it (the same values; the sums
  are fp32 instead of exact int32).
- "onednn": fp32 only: oneDNN's prepacked weights (mkldnn._reorder_linear_weight) with bias, and for c_fc
  GELU, fused into the GEMM's epilogue (mkldnn._linear_pointwise).

Which route runs is chosen per (precision, regime) by `probe`: decode (<= DECODE_TOKENS rows: GEMV, bound
by weight bandwidth) and prefill (more rows: GEMM, bound by compute), timing a chain over the model's own
layers, once per machine; the choice is cached on disk (GPT2FFN_CACHE, default ~/.cache/gpt2ffn).
GPT2FFN_ROUTE=<route> forces one.
"""

import json
import os
import platform
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from . import DECODE_TOKENS
from .formats import DEFAULT_ACTIVATIONS, Packed, dequantize, fake_quantize_activations, generation, quantize_groups

try:
    from .. import _C
    ISA = _C.isa()
    WHY_NOT_NATIVE = None if ISA != "none" else "this CPU has neither AVX-512 nor AVX2 with FMA"
except ImportError as e:  # not built: see setup.py
    _C, ISA, WHY_NOT_NATIVE = None, "none", f"gpt2ffn._C is not built ({e})"

_FORCED = os.environ.get("GPT2FFN_ROUTE")
# The routes that read nothing but the packed weights: the only ones a layer holding its weights once
# (linear.PackedLayer, quantize's default) is given, since any other would need a second, fp32 copy.
PACKED_ROUTES = ("native",)
_LOCK = threading.Lock()


def default_activations(precision: str) -> str:
    """DEFAULT_ACTIVATIONS[precision] on every build: int8 and int4 weights take int8 activations (their lm_heads
    as precision.pack_layer says). The maddubs builds (avx2, avx512novnni) once kept fp32 activations for int8;
    with their 8-row prefill tiles int8 activations prefill 1.5x faster there and decode as fast (Intel Xeon,
    AVX2 build), and one default on every build gives the same bits on every CPU: README, "Integer dot
    products"."""
    return DEFAULT_ACTIVATIONS[precision]


def routes(precision: str, device) -> list:
    """The routes that can run `precision` on `device`, in the order they are tried."""
    out = []
    if _C is not None and WHY_NOT_NATIVE is None and torch.device(device).type == "cpu":
        out.append("native")
    out.append("torch")
    if precision == "fp32" and torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available():
        out.append("onednn")
    return out


def dense(p: Packed, weight) -> torch.Tensor:
    """The (K, N) fp32 weights p's precision computes with, on weight's device (cached on p). weight None:
    the layer holds its weights once, packed, and they are unpacked from there."""
    if p.precision == "fp32" and weight is not None:
        return weight
    if getattr(p, "_dense", None) is None:
        if weight is None:
            p._dense = p.weights()
            return p._dense
        w = weight.detach().float()
        if p.precision == "bf16":
            p._dense = w.to(torch.bfloat16).float()
        else:
            p._dense = dequantize(*quantize_groups(w, p.precision, p.group), p.precision)
    return p._dense


def _onednn(p: Packed, weight, bias, batch: int, post: str):
    """(prepacked weight, bias) for oneDNN, made once per (batch hint, post-op)."""
    cache = p.__dict__.setdefault("_onednn", {})
    key = (batch, post)
    if key not in cache:
        b = bias.detach() if bias is not None else None
        cache[key] = (torch.ops.mkldnn._reorder_linear_weight(dense(p, weight).detach().t().contiguous(), batch), b)
    return cache[key]


_EMPTY = torch.empty(0)


def regime(rows: int) -> str:
    """'decode' (GEMV, weight bandwidth bound) or 'prefill' (GEMM, compute bound): the key of Packed.route."""
    return "decode" if rows <= DECODE_TOKENS else "prefill"


def native_args(ps) -> list:
    """The per-layer argument lists gpt2ffn._C.ffn / StepPlan.add_block take for packed layers `ps` (an empty tensor
    stands for no scale)."""
    return [[p.w for p in ps], [p.scale if p.scale is not None else _EMPTY for p in ps], [p.bias for p in ps],
            [p.format for p in ps], [p.N for p in ps], [p.group for p in ps]]


def runs_causal_attention(q, k, v, dropout: float) -> bool:
    """Whether gpt2ffn._C.causal_attention serves this call: native kernels, fp32 queries on the CPU with fp32 or
    fp16 keys and values (a KV cache's), a head width that is a multiple of 16, no dropout and no gradient asked
    (SDPA does the rest, and what torch.compile traces: it cannot trace into the native call)."""
    return (WHY_NOT_NATIVE is None and not dropout and q.device.type == "cpu" and q.shape[-1] % 16 == 0
            and not torch.compiler.is_compiling()
            and q.dtype == torch.float32 and k.dtype == v.dtype and k.dtype in (torch.float32, torch.float16)
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)))


def causal_attention(q, k, v, scale=None):
    """q (B, H, T, hd) against k, v (B, H, past + T, hd) -> (B, T, H * hd): query i sees keys 0..past + i of
    its own row, scores q k^T * scale (None: 1/sqrt(hd)); fp32 arithmetic (fp16 keys and values widened exactly
    as they are read), per (row, head) one task (csrc/linear_impl.h: attend_causal)."""
    return _C.causal_attention(q, k, v, scale)


def top_p_(x, top_p: list) -> bool:
    """Nucleus filtering of the rows of x (R, V), logits less their row's max, in place: each row keeps its
    likeliest tokens while those before weigh < its top_p, the rest go to -inf (csrc/ops.cpp: the weights
    summed into bins of the logit, only the cut's bin sorted). False, x untouched, where gpt2ffn._C is not built,
    the CPU has no AVX2, or x is not contiguous fp32 on the CPU."""
    if _C is None or x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return False
    return _C.top_p_(x, torch.tensor(top_p, dtype=torch.float64))


def unit_k(x2):
    """x2 (M, K) as the native kernels read it, each row's K values side by side: a view whose rows are not (a
    transposed input, (B, C, T).transpose(1, 2)) copied, as torch's matmul would."""
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] == 1 else x2.contiguous()


def ffn(x2, p1: Packed, p2: Packed, act: str):
    """c_proj(act(c_fc(x2))) in one native call: no Python between the two layers."""
    return _C.ffn(unit_k(x2), *native_args((p1, p2)), act)


def linear(x2, p: Packed, weight, bias, route: str, gelu: str | None = None):
    """(M, K) fp32 -> (M, N): x2 @ W + b through `route`; with gelu ('tanh' or 'none'), GELU applied too."""
    if route == "native":  # GELU inside the kernels (tanh form) or right after them (exact)
        return _C.linear(unit_k(x2), p.w, p.scale, p.bias, p.format, p.N, p.group, gelu or "")
    if route == "onednn":
        post = "gelu" if gelu else "none"
        wp, b = _onednn(p, weight, bias, 1 if x2.shape[0] <= DECODE_TOKENS else 128, post)
        return torch.ops.mkldnn._linear_pointwise(x2, wp, b, post, [], gelu or "")
    else:
        w = dense(p, weight)
        if p.activations == "int8":
            x2 = fake_quantize_activations(x2, p.group)
        y = torch.addmm(bias, x2, w) if bias is not None else x2 @ w
    if gelu:
        torch.ops.aten.gelu_(y, approximate=gelu)
    return y


def reference(x2, p: Packed, weight, bias) -> np.ndarray:
    """numpy float64 x @ W + b with the precision's weights (and int8 activations, quantized as the kernels
    do): what every route is validated against."""
    if p.activations == "int8":
        x2 = fake_quantize_activations(x2.cpu(), p.group)
    w = (p.weights() if weight is None else dense(p, weight)).detach().cpu().double().numpy()  # not cached
    y = x2.detach().cpu().double().numpy() @ w
    return y + bias.detach().cpu().double().numpy() if bias is not None else y


def _cache_file() -> Path:
    root = os.environ.get("GPT2FFN_CACHE") or Path.home() / ".cache" / "gpt2ffn"
    return Path(root) / "routes.json"


def cpuinfo() -> dict:
    """The first processor's fields of /proc/cpuinfo (model name, cpu family, model, flags, ...); {} where there is
    none."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor's block
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def machine_key() -> str:
    """What a cached probe result holds for: the CPU (model name with family and model: "AMD EPYC" alone names
    Zen 3, 4 and 5 alike), torch, threads, the kernel build picked, and that build's file (size and mtime), so
    that rebuilt kernels are timed again instead of inheriting the old ones' routes and prefetch distances."""
    fields = cpuinfo()
    cpu = fields.get("model name") or platform.processor()
    if "cpu family" in fields:
        cpu += f" (family {fields['cpu family']} model {fields.get('model')})"
    build = ""
    if _C is not None:
        try:
            st = os.stat(_C.__file__)
            build = f"|build {st.st_size}-{st.st_mtime_ns}"
        except (OSError, AttributeError, TypeError):
            pass
    return f"{cpu}|torch {torch.__version__}|threads {torch.get_num_threads()}|isa {ISA}{build}"


def _cached(key: str, compute) -> dict:
    """The probe cache's entry for key (GPT2FFN_CACHE/routes.json), computed and written if absent."""
    file = _cache_file()
    with _LOCK, torch.no_grad():
        try:
            cached = json.loads(file.read_text())
        except (OSError, ValueError):
            cached = {}
        if key in cached:
            return cached[key]
        cached[key] = entry = compute()
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(json.dumps(cached, indent=1) + "\n")
        except OSError:
            pass  # a read-only home: probe again next time
        return entry


def _best_of(chains: dict, rounds: int = 3) -> dict:
    """{name: least ms} of each chain, after a warm-up, over interleaved rounds (a shared machine only ever adds
    time, so the minimum)."""
    for run in chains.values():
        run()
    ms = {name: [] for name in chains}
    for _ in range(rounds):
        for name, run in chains.items():
            t0 = time.perf_counter()
            run()
            ms[name].append(1e3 * (time.perf_counter() - t0))
    return {name: min(v) for name, v in ms.items()}


def probe(layers: list, precision: str, device="cpu", log=None, only=None) -> dict:
    """{"decode": route, "prefill": route} for these packed layers [(Packed, weight, bias), ...]: each route is
    checked against numpy on the first layer, then timed as a chain over all of them (1 row for decode, 128
    for prefill), the best of 3 interleaved rounds after a warm-up; cached on disk by machine, precision and
    layer shapes. only: the routes allowed (PACKED_ROUTES for layers that hold their weights once). Where the
    native kernels decode, their prefetch distance is tuned too (tune_prefetch)."""
    cands = [r for r in routes(precision, device) if only is None or r in only]
    if _FORCED:
        if _FORCED not in cands:
            raise ConfigError(f"GPT2FFN_ROUTE={_FORCED!r} cannot run {precision} on {device}; possible: {cands}")
        choice = {"decode": _FORCED, "prefill": _FORCED}
    elif len(cands) == 1:
        choice = {"decode": cands[0], "prefill": cands[0]}
    else:
        entry = _cached(_key(layers, precision) + (f"|{','.join(cands)}" if only else ""),
                        lambda: _time_routes(layers, cands, device))
        choice = entry["choice"]
        if log:
            log(f"kernel probe ({precision}): {entry['ms']} -> {choice}")
    if choice["decode"] == "native":
        tune_prefetch(layers, precision, log)
    return choice


def _key(layers, precision: str) -> str:
    shapes = sorted({(p.K, p.N) for p, _, _ in layers})
    acts = {p.activations for p, _, _ in layers}
    return (f"{machine_key()}|{precision}|{shapes}|{len(layers)} layers"
            + ("|int8 activations" if "int8" in acts else ""))


def _time_routes(layers, cands, device) -> dict:
    choice, times = {}, {}
    g = torch.Generator().manual_seed(0)
    for regime, rows in (("decode", 1), ("prefill", 128)):
        xs = {K: torch.randn(rows, K, generator=g).to(device) for K in {p.K for p, _, _ in layers}}
        ok = []
        for route in cands:
            p, w, b = layers[0]
            want = reference(xs[p.K], p, w, b)
            got = linear(xs[p.K], p, w, b, route).detach().cpu().double().numpy()
            if np.allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max())):
                ok.append(route)
            else:
                times[f"{regime} {route}"] = "WRONG"

        def chain(route, xs=xs):
            for p, w, b in layers:
                linear(xs[p.K], p, w, b, route)
        ms = _best_of({route: (lambda r=route: chain(r)) for route in ok})
        times.update({f"{regime} {route}": t for route, t in ms.items()})
        choice[regime] = min(ok, key=ms.get)
    return {"choice": choice, "ms": times}


# Decode's prefetch distances tried (bytes ahead in a layer's weights; 0: the hardware prefetcher alone). Measured
# on an Intel Xeon (AMX), GPT-2 124M decode tok/s, none -> 8 KiB: bf16 91 -> 106, int8 205 -> 294, int4 380 -> 466,
# and fp32 63.3 -> 56 (any prefetch slowed it): a property of the machine, so it is timed, not assumed.
PREFETCH = (0, 2048, 8192, 16384)


def tune_prefetch(layers: list, precision: str, log=None) -> int:
    """Times the native decode chain over these layers (1 row) at each PREFETCH distance and sets the fastest for
    their formats (_C.set_prefetch); cached on disk with the routes. GPT2FFN_PREFETCH=<bytes> sets it untimed."""
    formats = {p.format for p, _, _ in layers}
    forced = os.environ.get("GPT2FFN_PREFETCH")
    if forced is not None:
        if not forced.isdigit():
            raise ConfigError(f"GPT2FFN_PREFETCH={forced} must be a distance in bytes, 0 or more (0: no prefetch)")
        best = int(forced)
    else:
        xs = {K: torch.randn(1, K, generator=torch.Generator().manual_seed(0)) for K in {p.K for p, _, _ in layers}}

        def chain(distance):
            for f in formats:
                _C.set_prefetch(f, distance)
            for p, w, b in layers:
                linear(xs[p.K], p, w, b, "native")

        entry = _cached(_key(layers, precision) + "|prefetch",
                        lambda: {"ms": {str(d): t for d, t in _best_of({d: (lambda d=d: chain(d))
                                                                         for d in PREFETCH}).items()}})
        best = int(min(entry["ms"], key=entry["ms"].get))
        if log:
            log(f"decode prefetch ({precision}): {entry['ms']} ms -> {best} bytes")
    for f in formats:
        _C.set_prefetch(f, best)
    return best


class DecodePlan:
    """A decode step of a GPT-2 as one native call (gpt2ffn._C.StepPlan: embeddings, every block, ln_f, lm_head),
    its arguments made once, with what they were made from: a step checks that no layer was re-packed or re-routed
    since (kernels.formats.generation()) and the Parameters are unchanged (storage and version counter, in C++),
    in a few microseconds instead of rebuilding ~20 arguments per block."""

    def __init__(self, native, made_at: int):
        self.native, self.made_at = native, made_at

    @classmethod
    def build(cls, model) -> "DecodePlan | None":
        """The plan for a GPT-2 (HF's module names: transformer.h[i].ln_1, attn.c_attn, ..., lm_head), re-packing
        stale layers first; None if a step cannot run fused (no native kernels, a head width the kernel does not
        take, weights not fp32 on the CPU, a layer or the lm_head not packed for the native decode route)."""
        cfg, tr, head = model.config, model.transformer, model.lm_head
        if (WHY_NOT_NATIVE is not None or cfg.n_embd // cfg.n_head % 16 or tr.wte.weight.dtype != torch.float32
                or tr.wte.weight.device.type != "cpu" or tr.wpe.weight.dtype != torch.float32):
            return None
        native, watched = _C.StepPlan(), []
        for i, block in enumerate(tr.h):
            mods = (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
            if any(m.packed is None or m.packed.route["decode"] != "native" for m in mods):
                return None
            ps = [m.current() for m in mods]
            norms = [block.ln_1.weight, block.ln_1.bias, block.ln_2.weight, block.ln_2.bias]
            watched += [t for m in mods for t in (m.weight, m.bias)] + norms
            native.add_block(norms, block.ln_1.eps, *native_args(ps), block.mlp.config.gelu_approximate,
                             block.attn.scale(i))
        if head.packed is None or head.packed.route["decode"] != "native":
            return None
        hp = head.current()
        # wte as TiedEmbedding.forward reads it: from the lm_head's packed weights when that is the only copy
        from_head = head.dropped or (head.hold_once and not head.training)
        wte = torch.empty(0) if from_head else tr.wte.weight.detach()
        native.set_head(tr.ln_f.weight, tr.ln_f.bias, tr.ln_f.eps, hp.w, hp.scale if hp.scale is not None else _EMPTY,
                        hp.bias, hp.format, hp.N, hp.group, tr.wpe.weight.detach(), wte)
        native.watch(watched + [t for t in (head.weight, head.bias, tr.ln_f.weight, tr.ln_f.bias, tr.wpe.weight,
                                            tr.wte.weight) if t is not None])
        return cls(native, generation())  # after current(), which may have re-packed

    def valid(self) -> bool:
        return self.made_at == generation() and self.native.valid()

    def run(self, ids, positions, slots, k, v):
        """ids (B,) at positions (B,), row b's keys and values in slot slots[b] of every layer's k[i], v[i]
        (slots, H, S, d/H) -> logits (B, vocab)."""
        return self.native.run(ids, positions, slots, k, v)

    def prefill(self, ids, past: int, slot: int, k, v):
        """ids (T,): one sequence's new tokens at positions past .. past + T - 1, their keys and values written
        into slot `slot` of every layer's k[i], v[i], each attending causally -> the last position's logits
        (1, vocab)."""
        return self.native.prefill(ids, past, slot, k, v)

    def prefill_many(self, ids, pasts: list, slots: list, lengths: list, k, v):
        """ids (T,): chunks of several sequences in order, chunk c's lengths[c] tokens at positions pasts[c] ..
        in slot slots[c] (one chunk a slot) -> each chunk's last position's logits (chunks, vocab)."""
        return self.native.prefill_many(ids, pasts, slots, lengths, k, v)
