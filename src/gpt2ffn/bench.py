"""`gpt2ffn bench`: gpt2ffn's FFN side by side with the peers a user would pick instead, in one process.

Every implementation is checked against the numpy reference first, then timed: median of repeats after
warm-up. The floor is the two bare GEMMs (no bias, no GELU) in the fastest library on this machine.
GFLOP/s counts 16 * tokens * d^2 per forward (two GEMMs of 2 * tokens * d * 4d each).
"""

import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from . import kernels, reference
from .config import Config
from .errors import Gpt2ffnError
from .ffn import FeedForward
from .tolerances import tolerance

FULL = {"d": [768, 1024, 1280, 1600], "tokens": [1, 8, 64, 512, 2048]}
QUICK = {"d": [768], "tokens": [1, 64, 512]}
PEERS = ["HF GPT2MLP", "book FeedForward", "Linear+GELU(tanh)+Linear", "torch.compile(Linear+GELU+Linear)",
         "numpy reference"]
OURS = "gpt2ffn"


class BookGELU(nn.Module):
    """Seed 000's GELU: the tanh formula in Python ops."""

    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * torch.pow(x, 3))))


def _linear_stack(ffn, gelu):
    d, hidden = ffn.c_fc.weight.shape
    seq = nn.Sequential(nn.Linear(d, hidden), gelu, nn.Linear(hidden, d))
    with torch.no_grad():  # nn.Linear stores [out, in]: the transpose of HF's Conv1D
        seq[0].weight.copy_(ffn.c_fc.weight.t())
        seq[0].bias.copy_(ffn.c_fc.bias)
        seq[2].weight.copy_(ffn.c_proj.weight.t())
        seq[2].bias.copy_(ffn.c_proj.bias)
    return seq


def machine() -> dict:
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from threadpoolctl import threadpool_info
    return {"cpu": cpu, "threads": torch.get_num_threads(), "python": platform.python_version(),
            "OPENBLAS_THREAD_TIMEOUT": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
            "torch": torch.__version__, "numpy": np.__version__,
            "blas": sorted({f"{i['internal_api']} {i.get('version') or ''}".strip() for i in threadpool_info()})}


def timeit(f, repeats: int, device="cpu") -> float:
    """Median milliseconds of f() over `repeats` runs, after warm-up."""
    return rounds({"f": f}, repeats, device)["f"]


def make_ffn(d: int, seed: int = 0, device="cpu") -> FeedForward:
    ffn = FeedForward(Config(n_embd=d, n_head=1, resid_pdrop=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ffn.named_parameters():
            p.copy_((0.1 if name.endswith("bias") else 0.02) * torch.randn(p.shape, generator=g))
    return ffn.to(device).eval()


def forward_impls(ffn, device):
    """name -> (callable on a torch input, takes numpy)."""
    impls = {OURS: (ffn, False)}
    try:
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
        d, hidden = ffn.c_fc.weight.shape
        mlp = GPT2MLP(hidden, GPT2Config(n_embd=d, n_head=1, resid_pdrop=0.0)).to(device).eval()
        mlp.load_state_dict(ffn.state_dict())
        impls["HF GPT2MLP"] = (mlp, False)
    except ImportError:
        pass
    impls["book FeedForward"] = (_linear_stack(ffn, BookGELU()).eval(), False)
    stack = _linear_stack(ffn, nn.GELU(approximate="tanh")).eval()
    impls["Linear+GELU(tanh)+Linear"] = (stack, False)
    impls["torch.compile(Linear+GELU+Linear)"] = (torch.compile(copy.deepcopy(stack), dynamic=False), False)
    if device == "cpu":
        impls["numpy reference"] = (reference.FFN.from_state_dict(ffn.state_dict()), True)
    return impls


def floors(ffn, device):
    w1, w2 = ffn.c_fc.weight.detach(), ffn.c_proj.weight.detach()
    out = {"floor (torch mm)": (lambda x: torch.mm(torch.mm(x, w1), w2), False)}
    if device == "cpu":
        w1n, w2n = w1.numpy(), w2.numpy()
        out["floor (numpy matmul)"] = (lambda x: (x @ w1n) @ w2n, True)
    return out


def rounds(fns: dict, repeats: int, device="cpu") -> dict:
    """Median ms of each function, timed in interleaved rounds (each round runs every function once, in
    order), so that load changes on a shared machine touch every entry alike. Two warm-up calls each."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for f in fns.values():
        f()
        f()
    sync()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            sync()
            times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def bench_forward(dims, tokens, repeats, device="cpu", log=print) -> list:
    rows = []
    for d in dims:
        ffn = make_ffn(d, device=device)
        impls, bare = forward_impls(ffn, device), floors(ffn, device)
        ref = reference.FFN.from_state_dict(ffn.state_dict())
        tol = tolerance(torch.float32)
        for T in tokens:
            x = torch.randn(T, d, generator=torch.Generator().manual_seed(T)).to(device)
            xn = x.cpu().numpy()
            expected = ref(xn)
            fns, correct = {}, {}
            with torch.no_grad():
                for name, (f, numpy_in) in {**impls, **bare}.items():
                    arg = xn if numpy_in else x
                    if name in impls:  # correctness first
                        y = f(arg)
                        y = y if numpy_in else y.cpu().numpy()
                        correct[name] = bool(np.allclose(y, expected, atol=tol.atol, rtol=tol.rtol))
                    fns[name] = (lambda f=f, arg=arg: f(arg))
                ms = rounds(fns, repeats, device)
            for name in fns:
                rows.append({"d": d, "tokens": T, "impl": name, "ms": ms[name], "correct": correct.get(name),
                             "gflops": 16 * T * d * d / ms[name] / 1e6})
            _finish_shape(rows, d, T)
            log(format_shape(rows, d, T))
    return rows


def _finish_shape(rows, d, T):
    shape = [r for r in rows if r["d"] == d and r["tokens"] == T]
    floor = min(r["ms"] for r in shape if r["impl"].startswith("floor"))
    ours = next(r["ms"] for r in shape if r["impl"] == OURS)
    for r in shape:
        r["x_floor"] = r["ms"] / floor
        r["ours_speedup"] = r["ms"] / ours


def format_shape(rows, d, T) -> str:
    shape = [r for r in rows if r["d"] == d and r["tokens"] == T]
    lines = [f"d={d}, tokens={T}", f"  {'implementation':<36}{'ms':>10}{'GFLOP/s':>10}{'x floor':>9}{'ours faster':>13}"]
    for r in shape:
        flag = "" if r["correct"] is not False else "  WRONG (failed the reference check)"
        lines.append(f"  {r['impl']:<36}{r['ms']:>10.3f}{r['gflops']:>10.1f}{r['x_floor']:>9.2f}"
                     f"{r['ours_speedup']:>12.2f}x{flag}")
    return "\n".join(lines)


def saved_bytes(fn, module) -> tuple:
    """(bytes of activations autograd saves for backward, fn's result): each storage once, weights (and
    views of them) not."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def bench_backward(dims, tokens, repeats, device="cpu", log=print) -> list:
    """forward + backward: ours (recompute-GELU Function) vs plain autograd of the peers' modules."""
    rows = []
    for d in dims:
        ffn = make_ffn(d, device=device).train()
        impls = {k: v for k, v in forward_impls(ffn, device).items()
                 if k in (OURS, "HF GPT2MLP", "Linear+GELU(tanh)+Linear", "book FeedForward")}
        for T in tokens:
            x = torch.randn(T, d, generator=torch.Generator().manual_seed(T)).to(device).requires_grad_()
            gy = torch.randn(T, d, generator=torch.Generator().manual_seed(T + 1)).to(device)
            for name, (m, _) in impls.items():
                m.train()
                nbytes, _ = saved_bytes(lambda: m(x), m)

                def step():
                    m(x).backward(gy)
                ms = timeit(step, repeats, device)
                rows.append({"d": d, "tokens": T, "impl": name, "ms": ms, "saved_bytes": nbytes})
            base = {r["impl"]: r for r in rows if r["d"] == d and r["tokens"] == T}
            lines = [f"d={d}, tokens={T} (forward + backward)",
                     f"  {'implementation':<28}{'ms':>10}{'saved MiB':>11}{'ours saved / theirs':>21}{'ours time / theirs':>20}"]
            for name, r in base.items():
                r["ours_saved_ratio"] = base[OURS]["saved_bytes"] / r["saved_bytes"]
                r["ours_time_ratio"] = base[OURS]["ms"] / r["ms"]
                lines.append(f"  {name:<28}{r['ms']:>10.2f}{r['saved_bytes'] / 2**20:>11.2f}"
                             f"{r['ours_saved_ratio']:>21.2f}{r['ours_time_ratio']:>20.2f}")
            log("\n".join(lines))
    return rows


def bench_generate(new_tokens=32, repeats=5, log=print) -> dict:
    """HF generate on random-init gpt2 (124M shape), greedy, with and without patch_hf."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from .hf import patch_hf
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    ids = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    out = {}
    for label in ("HF", "HF + patch_hf"):
        if label == "HF + patch_hf":
            patch_hf(model)
        with torch.no_grad():
            tokens = model.generate(ids, **kw)
            ms = timeit(lambda: model.generate(ids, **kw), repeats)
        out[label] = {"ms": ms, "tokens_per_s": new_tokens / ms * 1e3, "ids": tokens[0].tolist()}
    out["speedup"] = out["HF"]["ms"] / out["HF + patch_hf"]["ms"]
    out["same_tokens"] = out["HF"]["ids"] == out["HF + patch_hf"]["ids"]
    log(f"HF generate, random gpt2, {new_tokens} new tokens, greedy: {out['HF']['tokens_per_s']:.1f} tok/s; "
        f"with patch_hf {out['HF + patch_hf']['tokens_per_s']:.1f} tok/s ({out['speedup']:.3f}x), "
        f"same tokens: {out['same_tokens']}")
    return out


def plot(rows, path):
    from .plot import _pyplot
    plt = _pyplot()
    dims = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(1, len(dims), figsize=(5 * len(dims), 4), squeeze=False)
    for ax, d in zip(axes[0], dims):
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = [(r["tokens"], r["gflops"]) for r in rows if r["d"] == d and r["impl"] == impl]
            style = dict(linewidth=3, color="black") if impl == OURS else dict(linestyle="--") if "floor" in impl else {}
            ax.plot(*zip(*pts), marker="o", label=impl, **style)
        ax.set_xscale("log", base=2)
        ax.set_title(f"n_embd={d}")
        ax.set_xlabel("tokens")
        ax.set_ylabel("GFLOP/s (higher is better)")
        ax.grid(True)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run(args):
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise Gpt2ffnError("--device cuda: no CUDA device on this machine")
    grid = QUICK if args.quick else FULL
    dims = args.dims or grid["d"]
    tokens = args.tokens or grid["tokens"]
    repeats = max(args.repeats, 10)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(), "device": device, "repeats": repeats, "quick": args.quick}
    print(f"machine: {result['machine']}")
    if args.model:
        result["model"] = bench_model(repeats=repeats // 2)
        (out_dir / "bench-model.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out_dir / 'bench-model.json'}")
        return result
    result["forward"] = bench_forward(dims, tokens, repeats, device)
    result["dispatch"] = {str(k): v for k, v in kernels.choices().items()}
    if args.backward:
        bwd_dims = args.dims or ([768] if args.quick else [768, 1600])
        bwd_tokens = args.tokens or ([512] if args.quick else [64, 512, 2048])
        result["backward"] = bench_backward(bwd_dims, bwd_tokens, repeats, device)
    if args.generate:
        result["generate"] = bench_generate(repeats=3 if args.quick else 5)
    tag = f"{device}{'-quick' if args.quick else ''}"
    (out_dir / f"bench-{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    try:
        plot(result["forward"], out_dir / f"bench-{tag}.png")
    except Gpt2ffnError as e:
        print(f"no plot: {e}")
    print(f"wrote {out_dir / f'bench-{tag}.json'} and .png")
    return result


def summarize(result) -> str:
    """The README table: per shape, ours vs the floor and the fastest peer (median ms)."""
    fwd = result["forward"]
    lines = ["| d, tokens | floor ms | gpt2ffn ms | x floor | fastest peer | its ms | ours faster | vs HF GPT2MLP |",
             "|---|---|---|---|---|---|---|---|"]
    for d, T in dict.fromkeys((r["d"], r["tokens"]) for r in fwd):
        shape = {r["impl"]: r for r in fwd if r["d"] == d and r["tokens"] == T}
        floor = min(r["ms"] for k, r in shape.items() if k.startswith("floor"))
        ours = shape[OURS]
        peers = {k: r for k, r in shape.items() if k in PEERS and r["correct"]}
        best = min(peers, key=lambda k: peers[k]["ms"])
        hf = shape.get("HF GPT2MLP")
        lines.append(f"| {d}, {T} | {floor:.3f} | {ours['ms']:.3f} | {ours['ms'] / floor:.2f} | {best} | "
                     f"{peers[best]['ms']:.3f} | {peers[best]['ms'] / ours['ms']:.2f}x | "
                     f"{hf['ms'] / ours['ms']:.2f}x |" if hf else "")
    return "\n".join(lines)



def bench_model(prompt_tokens=128, new_tokens=64, repeats=5, log=print) -> dict:
    """Prefill ms and decode tokens/s: gpt2ffn's GPT2 vs HF GPT2LMHeadModel.generate (sdpa, KV cache), the
    same random gpt2 (124M shape) weights, greedy, in one process. Tokens are checked equal first."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from .generate import Sampling, generate
    from .model import GPT2, KVCache, random_weights_
    cfg = Config.from_name("gpt2")
    hf_cfg = GPT2Config(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "sdpa"
    hf = random_weights_(GPT2LMHeadModel(hf_cfg), 0).eval()
    hf.generation_config.eos_token_id = None
    ours = GPT2(cfg).eval()
    ours.load_state_dict(hf.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    s = Sampling(max_new_tokens=new_tokens)
    with torch.no_grad():
        hf_ids = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0, prompt_tokens:]
        same = generate(ours, [ids[0].tolist()], s)[0] == hf_ids.tolist()
        runs = {
            "gpt2ffn": (lambda: ours(ids, KVCache(cfg, 1, max_len=prompt_tokens + new_tokens), last_only=True),
                        lambda: generate(ours, [ids[0].tolist()], s)),
            "HF transformers": (lambda: hf(ids, use_cache=True),
                                lambda: hf.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)),
        }
        out = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "same_tokens": same,
               "decode_floor": decode_floor(ours, repeats)}
        for name, (prefill, gen) in runs.items():
            p_ms, g_ms = timeit(prefill, repeats), timeit(gen, max(3, repeats // 2))
            out[name] = {"prefill_ms": p_ms, "generate_ms": g_ms,
                         "decode_tokens_per_s": new_tokens / (g_ms - p_ms) * 1e3}
    a, b = out["gpt2ffn"], out["HF transformers"]
    out["decode_speedup"] = a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
    out["prefill_speedup"] = b["prefill_ms"] / a["prefill_ms"]
    log(f"gpt2 (124M shape, random weights), {prompt_tokens} prompt + {new_tokens} new tokens, greedy, "
        f"same tokens as HF: {same}")
    for name in ("gpt2ffn", "HF transformers"):
        r = out[name]
        log(f"  {name:<16} prefill {r['prefill_ms']:8.1f} ms   decode {r['decode_tokens_per_s']:6.1f} tokens/s")
    f = out["decode_floor"]
    log(f"  floor: bare GEMVs over every weight ({f['weight_mb']:.0f} MB fp32) {f['ms']:.1f} ms = "
        f"{f['tokens_per_s']:.1f} tokens/s ({f['gb_per_s']:.1f} GB/s)")
    log(f"  gpt2ffn vs HF: prefill {out['prefill_speedup']:.2f}x, decode {out['decode_speedup']:.2f}x")
    return out


def decode_floor(model, repeats=5) -> dict:
    """One decode step's unavoidable work: a bare (1, in) @ (in, out) GEMV over every weight matrix, in
    forward order, plus the (1, d) @ wte^T logits. Above the last-level cache this is DRAM bandwidth."""
    mats = []
    for block in model.transformer.h:
        mats += [block.attn.c_attn.weight, block.attn.c_proj.weight, block.mlp.c_fc.weight, block.mlp.c_proj.weight]
    mats = [m.detach() for m in mats]
    wte = model.transformer.wte.weight.detach()
    x = {m.shape[0]: torch.randn(1, m.shape[0]) for m in mats}

    def step():
        for m in mats:
            torch.mm(x[m.shape[0]], m)
        torch.mm(x[wte.shape[1]], wte.t())
    ms = timeit(step, repeats)
    nbytes = sum(m.numel() for m in mats) * 4 + wte.numel() * 4
    return {"ms": ms, "tokens_per_s": 1e3 / ms, "weight_mb": nbytes / 1e6, "gb_per_s": nbytes / ms / 1e6}


def read_bandwidth(gib: float = 1.0, repeats: int = 7) -> float:
    """DRAM read GB/s with torch's threads: the median time to sum a float32 tensor far larger than the L3."""
    t = torch.ones(int(gib * 2**30) // 4)
    ms = timeit(lambda: t.sum(), repeats)
    return t.nbytes / ms / 1e6


def _gpt2_layer_shapes(cfg: Config) -> list:
    d, h = cfg.n_embd, cfg.hidden
    return [(d, 3 * d), (d, d), (d, h), (h, d)]  # c_attn, attn.c_proj, c_fc, mlp.c_proj as (K, N)


def bench_kernels(layers: int = 12, repeats: int = 15, log=print) -> dict:
    """GB/s of weights read by one-token GEMVs over a chain of GPT-2 (124M) layers, per kernel and precision:
    torch's own kernels beside gpt2ffn's native ones, each checked against numpy float64 on its own rounded
    weights first. The chain (340 MB in fp32) is larger than any L3 here, as a decode step's weights are."""
    from .kernels import packed as kp
    from .precision import Packed
    g = torch.Generator().manual_seed(0)
    shapes = _gpt2_layer_shapes(Config.from_name("gpt2")) * layers
    ws = [0.02 * torch.randn(K, N, generator=g) for K, N in shapes]
    bs = [0.1 * torch.randn(N, generator=g) for _, N in shapes]
    xs = {K: torch.randn(1, K, generator=g) for K, _ in shapes}
    fp32_bytes = sum(w.nbytes for w in ws)
    chains, nbytes, checks = {}, {}, {}

    def add(name, calls, bytes_read, check):
        chains[name] = lambda: [f() for f in calls]
        nbytes[name] = bytes_read
        checks[name] = check

    def rel_err(y, want):
        return float((y.double() - want).abs().max() / want.abs().max())

    want0 = (xs[shapes[0][0]].double() @ ws[0].double() + bs[0].double())
    wts = [w.t().contiguous() for w in ws]
    add("fp32 F.linear (MKL)", [lambda x=xs[K], w=w, b=b: torch.nn.functional.linear(x, w, b)
                                for (K, _), w, b in zip(shapes, wts, bs)], fp32_bytes,
        lambda: rel_err(torch.nn.functional.linear(xs[shapes[0][0]], wts[0], bs[0]), want0))
    wn = [w.numpy() for w in ws]
    add("fp32 numpy (OpenBLAS)", [lambda x=xs[K].numpy(), w=w: x @ w for (K, _), w in zip(shapes, wn)], fp32_bytes,
        lambda: rel_err(torch.from_numpy(xs[shapes[0][0]].numpy() @ wn[0]) + bs[0], want0))
    if torch.backends.mkldnn.is_available():
        wp = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in wts]
        add("fp32 oneDNN prepacked", [lambda x=xs[K], w=w, b=b: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
                                      for (K, _), w, b in zip(shapes, wp, bs)], fp32_bytes,
            lambda: rel_err(torch.ops.mkldnn._linear_pointwise(xs[shapes[0][0]], wp[0], bs[0], "none", [], ""), want0))
        w16 = [w.bfloat16() for w in wts]
        wp16 = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in w16]
        xb = {K: x.bfloat16() for K, x in xs.items()}
        b16 = [b.bfloat16() for b in bs]
        add("bf16 oneDNN prepacked, bias + GELU fused", [
            lambda x=xb[K], w=w, b=b: torch.ops.mkldnn._linear_pointwise(x, w, b, "gelu", [], "tanh")
            for (K, _), w, b in zip(shapes, wp16, b16)], fp32_bytes // 2, lambda: float("nan"))
        add("bf16 F.linear (bf16 activations)", [lambda x=xb[K], w=w, b=b: torch.nn.functional.linear(x, w, b)
                                                 for (K, _), w, b in zip(shapes, w16, b16)], fp32_bytes // 2,
            lambda: rel_err(torch.nn.functional.linear(xb[shapes[0][0]], w16[0], b16[0]).float(), want0))
    q8 = []
    for w in wts:  # torch's int8 weight-only op: per output channel, bf16 activations
        s = w.abs().amax(1) / 127
        q8.append((torch.round(w / s[:, None]).to(torch.int8), s.bfloat16()))
    add("int8 aten._weight_int8pack_mm (bf16 activations)", [
        lambda x=xb[K], q=q, s=s: torch.ops.aten._weight_int8pack_mm(x, q, s) for (K, _), (q, s) in zip(shapes, q8)],
        sum(q.nbytes + s.nbytes for q, s in q8),
        lambda: rel_err(torch.ops.aten._weight_int8pack_mm(xb[shapes[0][0]], *q8[0]).float() + bs[0], want0))
    if kp.WHY_NOT_NATIVE is None:
        for precision in ("fp32", "bf16", "int8", "int4"):
            ps = [Packed(w, b, precision) for w, b in zip(ws, bs)]
            ref = kp.reference(xs[shapes[0][0]], ps[0], ws[0], bs[0])
            add(f"{precision} gpt2ffn native", [lambda x=xs[K], p=p: kp.linear(x, p, None, None, "native")
                                                for (K, _), p in zip(shapes, ps)], sum(p.nbytes for p in ps),
                lambda p=ps[0], ref=ref: rel_err(kp.linear(xs[shapes[0][0]], p, None, None, "native"),
                                                 torch.from_numpy(ref)))
    errors = {name: check() for name, check in checks.items()}
    ms = rounds(chains, repeats)
    dram = read_bandwidth()
    out = {"layers": layers, "fp32_mb": fp32_bytes / 1e6, "dram_read_gb_s": dram, "kernels": {}}
    log(f"one-token GEMV chain over {layers} GPT-2 layers ({fp32_bytes / 1e6:.0f} MB fp32), {torch.get_num_threads()} "
        f"threads; DRAM read {dram:.1f} GB/s")
    log(f"  {'kernel':<52}{'MB':>7}{'ms':>8}{'GB/s':>7}{'x DRAM':>8}{'rel err':>10}")
    for name in chains:
        gbs = nbytes[name] / ms[name] / 1e6
        out["kernels"][name] = {"mb": nbytes[name] / 1e6, "ms": ms[name], "gb_s": gbs, "of_dram": gbs / dram,
                                "rel_err_first_layer": errors[name]}
        log(f"  {name:<52}{nbytes[name] / 1e6:>7.0f}{ms[name]:>8.2f}{gbs:>7.1f}{gbs / dram:>8.2f}{errors[name]:>10.1e}")
    return out
