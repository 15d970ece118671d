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
from .errors import ConfigError, Gpt2ffnError
from .ffn import FeedForward
from .kernels.packed import cpuinfo
from .tolerances import tolerance

FULL = {"d": [768, 1024, 1280, 1600], "tokens": [1, 8, 64, 512, 2048]}
QUICK = {"d": [768], "tokens": [1, 64, 512]}
PEERS = ["HF GPT2MLP", "book FeedForward", "Linear+GELU(tanh)+Linear", "torch.compile(Linear+GELU+Linear)",
         "numpy reference"]
OURS = "gpt2ffn"
CUDA_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the dtypes the GPU benchmarks run


class BookGELU(nn.Module):
    """Seed 000's GELU: the tanh formula in Python ops."""

    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * torch.pow(x, 3))))


def _linear_stack(ffn, gelu):
    d, hidden = ffn.c_fc.weight.shape
    seq = nn.Sequential(nn.Linear(d, hidden), gelu, nn.Linear(hidden, d)).to(ffn.c_fc.weight.device,
                                                                           ffn.c_fc.weight.dtype)
    with torch.no_grad():  # nn.Linear stores [out, in]: the transpose of HF's Conv1D
        seq[0].weight.copy_(ffn.c_fc.weight.t())
        seq[0].bias.copy_(ffn.c_fc.bias)
        seq[2].weight.copy_(ffn.c_proj.weight.t())
        seq[2].bias.copy_(ffn.c_proj.bias)
    return seq


def cpu_info() -> dict:
    """/proc/cpuinfo's model name, family/model (with AMD's Zen generation: "AMD EPYC" names none) and the
    vector extensions that pick a kernel: enough to tell which machine a number came from."""
    fields = cpuinfo()
    if not fields:
        return {"cpu": platform.processor() or "unknown", "isa": []}
    family, model = int(fields.get("cpu family", -1)), int(fields.get("model", -1))
    zen = None
    if fields.get("vendor_id") == "AuthenticAMD":
        zen = {23: "Zen/Zen 2", 26: "Zen 5"}.get(family)
        if family == 25:
            zen = "Zen 4" if 0x10 <= model <= 0x1f or 0x60 <= model <= 0xaf else "Zen 3"
    flags = set(fields.get("flags", "").split())
    isa = [f for f in ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                       "amx_tile") if f in flags]
    name = fields.get("model name", "unknown")
    return {"cpu": f"{name} (family {family} model {model}{', ' + zen if zen else ''})", "isa": isa}


def machine() -> dict:
    from threadpoolctl import threadpool_info
    return {**cpu_info(), "threads": torch.get_num_threads(), "python": platform.python_version(),
            "OPENBLAS_THREAD_TIMEOUT": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
            "torch": torch.__version__, "numpy": np.__version__,
            "blas": sorted({f"{i['internal_api']} {i.get('version') or ''}".strip() for i in threadpool_info()})}


def timeit(f, repeats: int, device="cpu", what: str = "f") -> float:
    """Median milliseconds of f() over `repeats` runs, after warm-up (its spread in SPREAD as `what`)."""
    return rounds({what: f}, repeats, device)[what]


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
        mlp = GPT2MLP(hidden, GPT2Config(n_embd=d, n_head=1, resid_pdrop=0.0)).to(device, ffn.c_fc.weight.dtype).eval()
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
    elif kernels.cuda.epilogue_gelu_is_tanh(device, ffn.c_fc.weight.dtype):  # else not GPT-2's GELU there
        impls["addmm + cuBLASLt GELU epilogue"] = (_on_weights(ffn, kernels.cuda.fused), False)
    if device != "cpu" and kernels.gemm_gelu.triton is not None and ffn.c_fc.weight.dtype in (torch.bfloat16,
                                                                                              torch.float16):
        impls["Triton GEMM+GELU, then addmm"] = (_on_weights(ffn, kernels.gemm_gelu.fused), False)
    return impls


def _on_weights(ffn, fn):
    """x -> fn(x2, w1, b1, w2, b2) on ffn's weights, x of any leading shape."""
    p = {k: v.detach() for k, v in ffn.state_dict().items()}
    return lambda x: fn(x.reshape(-1, x.shape[-1]), p["c_fc.weight"], p["c_fc.bias"], p["c_proj.weight"],
                        p["c_proj.bias"]).view(x.shape)


def floors(ffn, device):
    w1, w2 = ffn.c_fc.weight.detach(), ffn.c_proj.weight.detach()
    out = {"floor (torch mm)": (lambda x: torch.mm(torch.mm(x, w1), w2), False)}
    if device == "cpu":
        w1n, w2n = w1.numpy(), w2.numpy()
        out["floor (numpy matmul)"] = (lambda x: (x @ w1n) @ w2n, True)
    return out


def cuda_event_ms(f, calls: int) -> float:
    """Milliseconds of one call of f on the current CUDA stream: events around `calls` back-to-back calls."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        f()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / calls


# Each timed entry's spread over its repeats this run (interquartile range / median, the worst where an entry is
# timed more than once): run() says so in one line when the machine moved the timings (NOISY and up).
SPREAD = {}
NOISY = 0.10


def rounds(fns: dict, repeats: int, device="cpu", calls: int = 1, self_timed: bool = False, what: str = "") -> dict:
    """Median ms of each function, timed in interleaved rounds (each round runs every function once, in
    order), so that load changes on a shared machine touch every entry alike. Two warm-up calls each.
    calls > 1 (CUDA): each timing is CUDA events around that many back-to-back calls, divided. self_timed
    (CPU): each function times its own part and returns its seconds (a decode loop after an untimed prefill).
    Each entry's spread goes into SPREAD, under `what` and its name."""
    cuda = str(device).startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for f in fns.values():
        f()
        f()
    sync()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            if calls > 1 and cuda:
                times[k].append(cuda_event_ms(f, calls) / 1e3)
                continue
            if self_timed:
                times[k].append(f())
                continue
            t0 = time.perf_counter()
            f()
            sync()
            times[k].append(time.perf_counter() - t0)
    for k, v in times.items():
        if len(v) >= 2 and statistics.median(v) > 0:
            q = statistics.quantiles(v, n=4)
            key = f"{what} {k}".strip()
            SPREAD[key] = max(SPREAD.get(key, 0.0), (q[2] - q[0]) / statistics.median(v))
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def noise(log=print) -> dict:
    """The worst spread rounds() saw since SPREAD was cleared ({} if none), said in one line when it is NOISY or
    more: a busy machine's timings, to be read as ratios within the run."""
    if not SPREAD:
        return {}
    where, worst = max(SPREAD.items(), key=lambda kv: kv[1])
    if worst >= NOISY:
        log(f"note: timings moved between repeats by up to {worst:.0%} of their median (interquartile range, "
            f"{where}): the machine was busy; compare entries of this run by their ratios, or raise --repeats")
    return {"max_iqr_over_median": round(worst, 4), "where": where, "entries": len(SPREAD)}


def greedy_steps(step, logits, n: int) -> float:
    """Seconds that n single-token greedy steps take after a prefill's last logits: step(token) -> logits."""
    t0 = time.perf_counter()
    for _ in range(n):
        logits = step(int(logits.argmax()))
    return time.perf_counter() - t0


def decode_seconds(model, ids, new_tokens: int) -> float:
    """Seconds of new_tokens single-token greedy steps of a gpt2ffn GPT2 after an untimed prefill of ids (1, T),
    in a KV cache of its own: decode timed by itself."""
    from .serving.kv_cache import KVCache
    cache = KVCache(model.config, 1, model.kv_dtype, max_len=ids.shape[1] + new_tokens)
    return greedy_steps(lambda token: model(torch.tensor([[token]]), cache, last_only=True)[0, -1],
                        model(ids, cache, last_only=True)[0, -1], new_tokens)


def bench_forward(dims, tokens, repeats, device="cpu", log=print, dtypes=("fp32",)) -> list:
    """The FFN's implementations per d, token count and dtype (fp32, bf16: bf16 on CUDA only), each checked
    against the numpy reference at that dtype's tolerance first. On CUDA each timing is CUDA events around 20
    back-to-back calls (one call's launch and sync would hide a 50 us GEMM)."""
    rows = []
    calls = 20 if str(device).startswith("cuda") else 1
    for dt in dtypes:
        dtype = CUDA_DTYPES[dt]
        tol = tolerance(dtype)
        for d in dims:
            ffn = make_ffn(d, device=device).to(dtype)
            impls, bare = forward_impls(ffn, device), floors(ffn, device)
            ref = reference.FFN.from_state_dict({k: v.float() for k, v in ffn.state_dict().items()})
            for T in tokens:
                x = torch.randn(T, d, generator=torch.Generator().manual_seed(T)).to(device, dtype)
                xn = x.float().cpu().numpy()
                expected = ref(xn)
                fns, correct = {}, {}
                with torch.no_grad():
                    for name, (f, numpy_in) in {**impls, **bare}.items():
                        arg = xn if numpy_in else x
                        if name in impls:  # correctness first
                            y = f(arg)
                            y = y if numpy_in else y.float().cpu().numpy()
                            correct[name] = bool(np.allclose(y, expected, atol=tol.atol, rtol=tol.rtol))
                        fns[name] = (lambda f=f, arg=arg: f(arg))
                    ms = rounds(fns, repeats, device, calls, what=f"d={d} tokens={T} {dt}")
                for name in fns:
                    rows.append({"d": d, "tokens": T, "dtype": dt, "impl": name, "ms": ms[name],
                                 "correct": correct.get(name), "gflops": 16 * T * d * d / ms[name] / 1e6})
                _finish_shape(rows, d, T, dt)
                log(format_shape(rows, d, T, dt))
    return rows


def _shape(rows, d, T, dt):
    return [r for r in rows if r["d"] == d and r["tokens"] == T and r.get("dtype", "fp32") == dt]


def _finish_shape(rows, d, T, dt="fp32"):
    shape = _shape(rows, d, T, dt)
    floor = min(r["ms"] for r in shape if r["impl"].startswith("floor"))
    ours = next(r["ms"] for r in shape if r["impl"] == OURS)
    for r in shape:
        r["x_floor"] = r["ms"] / floor
        r["ours_speedup"] = r["ms"] / ours


def format_shape(rows, d, T, dt="fp32") -> str:
    lines = [f"d={d}, tokens={T}" + ("" if dt == "fp32" else f", {dt}"),
             f"  {'implementation':<36}{'ms':>10}{'GFLOP/s':>10}{'x floor':>9}{'ours faster':>13}"]
    for r in _shape(rows, d, T, dt):
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
                nbytes, _ = saved_bytes(lambda m=m, x=x: m(x), m)

                def step(m=m, x=x, gy=gy):
                    m(x).backward(gy)
                ms = timeit(step, repeats, device, what=f"backward d={d} tokens={T} {name}")
                rows.append({"d": d, "tokens": T, "impl": name, "ms": ms, "saved_bytes": nbytes})
            base = {r["impl"]: r for r in rows if r["d"] == d and r["tokens"] == T}
            lines = [f"d={d}, tokens={T} (forward + backward)",
                     f"  {'implementation':<28}{'ms':>10}{'saved MiB':>11}{'ours saved / theirs':>21}"
                     f"{'ours time / theirs':>20}"]
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
            ms = timeit(lambda: model.generate(ids, **kw), repeats, what=f"generate {label}")
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
        for impl, dt in dict.fromkeys((r["impl"], r.get("dtype", "fp32")) for r in rows):
            pts = [(r["tokens"], r["gflops"]) for r in rows
                   if r["d"] == d and r["impl"] == impl and r.get("dtype", "fp32") == dt]
            style = (dict(linewidth=3, color="black") if impl == OURS else dict(linestyle="--") if "floor" in impl
                     else {})
            if dt != "fp32":
                style = {**style, "alpha": 0.6}
            ax.plot(*zip(*pts), marker="o", label=impl + ("" if dt == "fp32" else f" ({dt})"), **style)
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
    from .loading import resolve_device
    device = resolve_device(args.device)
    grid = QUICK if args.quick else FULL
    dims = args.dims or grid["d"]
    tokens = args.tokens or grid["tokens"]
    repeats = max(args.repeats, 10)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = {"kernels": args.kernels, "model": args.model, "accuracy": args.accuracy}
    cuda = str(device).startswith("cuda")
    if not any(parts.values()):  # the FFN grid: fp32 on the CPU; on CUDA fp32 and bf16 (--precision picks)
        if not cuda and args.precision and args.precision != ["fp32"]:
            raise Gpt2ffnError("the FFN bench on the CPU is fp32 (--precision is for --model, or the FFN on CUDA)")
        ffn_dtypes = args.precision or (["fp32", "bf16"] if cuda else ["fp32"])
        if any(p not in ("fp32", "bf16") for p in ffn_dtypes):
            raise Gpt2ffnError(f"the FFN bench runs fp32 or bf16, got {', '.join(ffn_dtypes)}")
    result = {"machine": machine(), "device": device, "repeats": repeats, "quick": args.quick}
    print(f"machine: {result['machine']}")
    SPREAD.clear()
    if any(parts.values()):
        if device != "cpu" and (args.kernels or args.accuracy):
            raise Gpt2ffnError("--kernels and --accuracy measure the CPU kernels and formats: use --device cpu")
        precisions = args.precision or (["fp32"] if args.model else ["fp32", "bf16", "int8", "int4"])
        for part in (k for k, on in parts.items() if on):
            if part == "kernels":
                result[part] = bench_kernels(repeats=repeats)
            elif part == "model":
                result[part] = bench_model(precisions, repeats=max(5, repeats // 2), weights=args.weights,
                                           device=device, batches=args.batch)
            else:
                result[part] = bench_accuracy(args.weights, precisions)
            size = "" if part != "model" or args.weights == "random:gpt2" else "-" + args.weights.split(":")[1]
            file = out_dir / ("accuracy.json" if part == "accuracy" else f"bench-{part}{size}.json")
            spread = noise() if part != "accuracy" else {}
            SPREAD.clear()
            file.write_text(json.dumps({"machine": result["machine"], part: result[part],
                                        **({"noise": spread} if spread else {})}, indent=1) + "\n")
            print(f"wrote {file}")
        return result
    result["forward"] = bench_forward(dims, tokens, repeats, device, dtypes=ffn_dtypes)
    result["dispatch"] = {str(k): v for k, v in kernels.choices().items()}
    if cuda:
        result["cuda_ffn"] = kernels.cuda.choices()
    if args.backward:
        bwd_dims = args.dims or ([768] if args.quick else [768, 1600])
        bwd_tokens = args.tokens or ([512] if args.quick else [64, 512, 2048])
        result["backward"] = bench_backward(bwd_dims, bwd_tokens, repeats, device)
    if args.generate:
        result["generate"] = bench_generate(repeats=3 if args.quick else 5)
    result["noise"] = noise()
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
    for d, T, dt in dict.fromkeys((r["d"], r["tokens"], r.get("dtype", "fp32")) for r in fwd):
        shape = {r["impl"]: r for r in _shape(fwd, d, T, dt)}
        floor = min(r["ms"] for k, r in shape.items() if k.startswith("floor"))
        ours = shape[OURS]
        peers = {k: r for k, r in shape.items() if k in PEERS and r["correct"]}
        best = min(peers, key=lambda k: peers[k]["ms"])
        hf = shape.get("HF GPT2MLP")
        lines.append(f"| {d}, {T}{'' if dt == 'fp32' else ', ' + dt} | {floor:.3f} | {ours['ms']:.3f} | "
                     f"{ours['ms'] / floor:.2f} | {best} | "
                     f"{peers[best]['ms']:.3f} | {peers[best]['ms'] / ours['ms']:.2f}x | "
                     f"{hf['ms'] / ours['ms']:.2f}x |" if hf else "")
    return "\n".join(lines)



def random_hf(weights: str):
    """(Config, name, HF GPT2LMHeadModel with sdpa) of `random:<preset>[:seed]`: what bench --model times."""
    from .model import parse_random, random_hf_model
    if not weights.startswith("random:"):
        raise Gpt2ffnError(f"bench --model times random weights (random:<preset>[:seed]), not {weights!r}")
    cfg, seed, name = parse_random(weights)
    return cfg, name, random_hf_model(cfg, seed, "sdpa")


def fit(cfg, spec: str, prompt_tokens: int, new_tokens: int, what: str) -> tuple:
    """(prompt_tokens, new_tokens) cut to a smaller context: half of it each at most (random:tiny has 128
    positions, not 128 + 64)."""
    if cfg.n_positions < 2:
        raise Gpt2ffnError(f"{what} needs a context of 2 positions at least (a prompt and a new token); "
                           f"{spec} has n_positions={cfg.n_positions}")
    prompt_tokens = min(prompt_tokens, cfg.n_positions // 2)
    return prompt_tokens, min(new_tokens, cfg.n_positions - prompt_tokens)


def bench_model(precisions=("fp32",), prompt_tokens=128, new_tokens=64, repeats=5, log=print,
                weights="random:gpt2", device="cpu", batches=None) -> dict:
    """Prefill ms and decode tokens/s of gpt2ffn's GPT2 at each precision, beside HF GPT2LMHeadModel (sdpa, KV
    cache, fp32), the same random weights (`weights`: random:<preset>[:seed], default the 124M shape;
    gpt2-medium / -large / -xl for the others; a smaller context cuts the prompt and the new tokens to half of it
    each at most), greedy, interleaved rounds in one process. fp32's tokens are checked equal to HF's generate's
    first. Decode is timed by itself: new_tokens single-token steps after an untimed prefill (not generate's
    time less prefill's, two medians whose difference a tiny model's noise can swamp: it once came out <= 0).
    Each precision's floor: the bytes a decode step must read (its packed weights, lm_head included) over the
    DRAM read bandwidth measured in the same run. The per-step overhead: a decode step of a 1-layer model with
    tiny widths, where weights cost nothing.
    On CUDA: gpt2ffn and HF both in plain torch per dtype (fp32, bf16) and batch (default 1, 32, 256), HF also
    with its static cache."""
    if device != "cpu":
        return bench_model_cuda(precisions, prompt_tokens, new_tokens, repeats, log, device, weights,
                                batches or (1, 32, 256))
    if batches:
        raise Gpt2ffnError("--batch is for --model --device cuda (on the CPU --model times batch 1)")
    from .generate import Sampling, generate
    from .model import GPT2
    from .precision import packable, quantize
    from .serving.kv_cache import KVCache
    cfg, name, hf = random_hf(weights)
    prompt_tokens, new_tokens = fit(cfg, weights, prompt_tokens, new_tokens, "bench --model")
    hf.generation_config.eos_token_id = None
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    s = Sampling(max_new_tokens=new_tokens)
    out = {"model": name, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "engines": {}}
    runs = {}
    with torch.no_grad():
        hf_ids = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)[0, prompt_tokens:].tolist()
        def hf_decode():
            o = hf(ids, use_cache=True)
            # transformers 5.2x names the cache `cache` (its output and argument), earlier ones past_key_values
            kw = "cache" if "cache" in o else "past_key_values"
            cache = o[kw]  # updated in place by each step

            def step(token):
                return hf(torch.tensor([[token]]), use_cache=True, **{kw: cache}).logits[0, -1]
            return greedy_steps(step, o.logits[0, -1], new_tokens)

        runs["HF transformers fp32"] = (lambda: hf(ids, use_cache=True), hf_decode)
        nbytes = {}
        for precision in precisions:
            model = GPT2(cfg).eval()
            model.load_state_dict(hf.state_dict())
            quantize(model, precision)
            got = generate(model, [ids[0].tolist()], s)[0]
            same = [a == b for a, b in zip(got, hf_ids)]
            out["engines"][f"gpt2ffn {precision}"] = {"greedy_same_as_hf": sum(same) / len(same)}
            if precision == "fp32" and not all(same):
                raise Gpt2ffnError(f"gpt2ffn fp32 greedy tokens differ from HF's at position {same.index(False)}")
            nbytes[precision] = sum(m.packed.nbytes for m in packable(model))
            runs[f"gpt2ffn {precision}"] = (
                lambda m=model: m(ids, KVCache(cfg, 1, m.kv_dtype, max_len=prompt_tokens + new_tokens), last_only=True),
                lambda m=model: decode_seconds(m, ids, new_tokens))
        prefill = rounds({k: v[0] for k, v in runs.items()}, repeats, what="prefill")
        steps = rounds({k: v[1] for k, v in runs.items()}, max(3, repeats // 2), self_timed=True, what="decode")
        overhead = step_overhead(precisions, repeats=max(repeats, 50))
    dram = read_bandwidth()
    out["dram_read_gb_s"] = dram
    log(f"{name} (random weights), {prompt_tokens} prompt + {new_tokens} new tokens, greedy; "
        f"DRAM read {dram:.1f} GB/s")
    log(f"  {'engine':<22}{'prefill ms':>11}{'decode tok/s':>14}{'floor tok/s':>13}{'x floor':>9}"
        f"{'step overhead us':>18}")
    for name in runs:
        e = out["engines"].setdefault(name, {})
        e["prefill_ms"], e["decode_ms"] = prefill[name], steps[name]
        e["decode_tokens_per_s"] = new_tokens / steps[name] * 1e3
        precision = name.split()[-1]
        if name.startswith("gpt2ffn"):
            e["weight_mb"] = nbytes[precision] / 1e6
            e["floor_tokens_per_s"] = dram * 1e9 / nbytes[precision]
            e["of_floor"] = e["decode_tokens_per_s"] / e["floor_tokens_per_s"]
            e["step_overhead_us"] = overhead[precision]
        log(f"  {name:<22}{e['prefill_ms']:>11.1f}{e['decode_tokens_per_s']:>14.1f}"
            + (f"{e['floor_tokens_per_s']:>13.1f}{e['of_floor']:>9.2f}{e['step_overhead_us']:>18.0f}"
               if "floor_tokens_per_s" in e else ""))
    return out


def bench_model_cuda(precisions, prompt_tokens, new_tokens, repeats, log, device, weights="random:gpt2",
                     batches=(1, 32, 256)) -> dict:
    """bench_model on a GPU: per dtype ('fp32', 'bf16') and batch, gpt2ffn's engine (its decode steps as CUDA
    graphs, captured once per engine, the time reported) and HF generate (dynamic cache; static cache up to
    batch 32), the same random prompts of prompt_tokens, new_tokens greedy tokens each (no EOS), synchronized
    end-to-end timings (prefill included), interleaved rounds. At batch 1 gpt2ffn's tokens are compared with
    HF's. HF's static cache runs without the torch.compile transformers would add (disable_compile)."""
    from transformers import GPT2LMHeadModel

    from .model import GPT2
    from .serving.engine import Request
    from .serving.sampling import Sampling
    from .serving.tp import make_engine
    bad = [p for p in precisions if p not in CUDA_DTYPES]
    if bad:
        raise Gpt2ffnError(f"on CUDA --precision is the dtype: fp32 or bf16, got {', '.join(bad)}")
    if not batches or min(batches) < 1:
        raise Gpt2ffnError(f"batch sizes must be >= 1, got {list(batches)}")
    cfg, name, base = random_hf(weights)
    prompt_tokens, new_tokens = fit(cfg, weights, prompt_tokens, new_tokens, "bench --model")
    hf_cfg = base.config
    prompts = torch.randint(0, cfg.vocab_size, (max(batches), prompt_tokens),
                            generator=torch.Generator().manual_seed(0)).to(device)
    s = Sampling(max_new_tokens=new_tokens)
    out = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
           "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "batches": list(batches), "engines": {}}
    runs, engines = {}, []
    with torch.no_grad():
        for p in precisions:
            hf = GPT2LMHeadModel(hf_cfg).to(device, CUDA_DTYPES[p]).eval()
            hf.load_state_dict(base.state_dict())
            hf.generation_config.eos_token_id = None
            ours = GPT2(cfg).to(device, CUDA_DTYPES[p]).eval()
            ours.load_state_dict(base.state_dict())
            for B in batches:
                ids = prompts[:B]
                engine = make_engine(ours, max_batch=B, max_waiting=B, max_len=prompt_tokens + new_tokens,
                                     kv_tokens=B * (prompt_tokens + new_tokens),
                                     offline=True)  # as generate's
                engines.append(engine)
                key = f"gpt2ffn {p} batch {B}"
                e = out["engines"][key] = {"batch": B}
                if engine.graph_capture is not None:
                    e["graphs_captured"], e["graph_shapes"], e["capture_s"] = engine.graph_capture
                rows = ids.tolist()
                runs[key] = lambda engine=engine, rows=rows: engine.run([Request(list(r), s) for r in rows])
                if B == 1:
                    want = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                       pad_token_id=0)[0, prompt_tokens:]
                    got = runs[key]()[0].output
                    e["greedy_same_as_hf"] = sum(a == b for a, b in zip(got, want.tolist())) / new_tokens
                runs[f"HF transformers {p} batch {B}"] = lambda m=hf, ids=ids: m.generate(
                    ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
                if B <= 32:
                    runs[f"HF transformers {p} static cache batch {B}"] = lambda m=hf, ids=ids: m.generate(
                        ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, cache_implementation="static",
                        disable_compile=True)
        ms = rounds(runs, max(3, repeats // 2), device)
    log(f"{name} (random weights) on {out['device']}, torch {torch.__version__}, {prompt_tokens} prompt + "
        f"{new_tokens} new, greedy")
    for key, t in ms.items():
        e = out["engines"].setdefault(key, {})
        B = int(key.rsplit(" ", 1)[1])
        e["generate_ms"], e["tokens_per_s"] = t, B * new_tokens / t * 1e3
        extra = (f"  ({e['graphs_captured']}/{e['graph_shapes']} graphs in {e['capture_s']:.1f} s)"
                 if "capture_s" in e else "")
        log(f"  {key:<48}{t:>10.1f} ms{e['tokens_per_s']:>12.1f} tok/s (prompt + new, end to end){extra}")
    from .kernels import decode_attention
    out["decode_attention"] = decode_attention.choices()  # the kernel's configuration per shape, where chosen
    if out["decode_attention"]:
        log(f"  decode attention configurations: {out['decode_attention']}")
    return out


def step_overhead(precisions, repeats=50) -> dict:
    """Microseconds of one decode step on a 1-layer GPT-2 with tiny widths (d=64, vocab 256), per precision:
    what a step costs beyond reading weights (Python, dispatch, threads, allocation)."""
    from .model import GPT2
    from .precision import quantize
    from .serving.kv_cache import KVCache
    cfg = Config(n_embd=64, n_layer=1, n_head=4, n_positions=256, vocab_size=256)
    out = {}
    for precision in precisions:
        model = quantize(GPT2(cfg).eval(), precision)
        cache = KVCache(cfg, 1, model.kv_dtype)
        model(torch.tensor([[1, 2, 3]]), cache)
        nxt = torch.tensor([[5]])

        def step(model=model, cache=cache, nxt=nxt):
            cache.length = 3
            model(nxt, cache, last_only=True)
        out[precision] = 1e3 * timeit(step, repeats, what=f"step overhead {precision}")
    return out


def read_bandwidth(gib: float = 1.0, repeats: int = 7) -> float:
    """DRAM read GB/s with torch's threads: the median time to sum a float32 tensor far larger than the L3."""
    t = torch.ones(int(gib * 2**30) // 4)
    ms = timeit(lambda: t.sum(), repeats, what="read bandwidth")
    return t.nbytes / ms / 1e6


def _gpt2_layer_shapes(cfg: Config) -> list:
    d, h = cfg.n_embd, cfg.hidden
    return [(d, 3 * d), (d, d), (d, h), (h, d)]  # c_attn, attn.c_proj, c_fc, mlp.c_proj as (K, N)


def bench_kernels(layers: int = 12, repeats: int = 15, log=print) -> dict:
    """GB/s of weights read by one-token GEMVs over a chain of GPT-2 (124M) layers, per kernel and precision:
    torch's own kernels beside gpt2ffn's native ones, each checked against numpy float64 on its own rounded
    weights first. The chain (340 MB in fp32) is larger than any L3 here, as a decode step's weights are."""
    from .kernels import packed as kp
    from .kernels.formats import Packed
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
    wn, xn = [w.numpy() for w in ws], {K: x.numpy() for K, x in xs.items()}
    add("fp32 numpy (OpenBLAS)", [lambda x=xn[K], w=w: x @ w for (K, _), w in zip(shapes, wn)], fp32_bytes,
        lambda: rel_err(torch.from_numpy(xs[shapes[0][0]].numpy() @ wn[0]) + bs[0], want0))
    if torch.backends.mkldnn.is_available():
        wp = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in wts]
        add("fp32 oneDNN prepacked",
            [lambda x=xs[K], w=w, b=b: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
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
    if kp.WHY_NOT_NATIVE is None:
        from .precision import quantize
        for precision in ("fp32", "bf16", "int8", "int4"):  # the FFN alone, through FeedForward.forward
            ffns = [quantize(make_ffn(768, seed=i), precision) for i in range(layers)]
            x1 = torch.randn(1, 768, generator=g)
            ref = reference.FFN.from_state_dict(ffns[0].state_dict())
            add(f"FFN {precision} (c_fc + GELU + c_proj), FeedForward", [lambda f=f, x1=x1: f(x1) for f in ffns],
                sum(f.c_fc.packed.nbytes + f.c_proj.packed.nbytes for f in ffns),
                lambda f=ffns[0], ref=ref, x1=x1: rel_err(f(x1), torch.from_numpy(ref(x1.double().numpy()))))
    errors = {name: check() for name, check in checks.items()}
    with torch.no_grad():
        ms = rounds(chains, repeats, what="kernels")
    dram = read_bandwidth()
    out = {"layers": layers, "fp32_mb": fp32_bytes / 1e6, "dram_read_gb_s": dram, "kernels": {}}
    log(f"one-token GEMV chain over {layers} GPT-2 layers ({fp32_bytes / 1e6:.0f} MB fp32), {torch.get_num_threads()} "
        f"threads; DRAM read {dram:.1f} GB/s")
    log(f"  {'kernel':<52}{'MB':>7}{'ms':>8}{'GB/s':>7}{'x DRAM':>8}{'rel err':>10}  (rel err: vs numpy float64 on "
        f"the kernel's own rounded weights; FFN rows: vs fp32 weights)")
    for name in chains:
        gbs = nbytes[name] / ms[name] / 1e6
        out["kernels"][name] = {"mb": nbytes[name] / 1e6, "ms": ms[name], "gb_s": gbs, "of_dram": gbs / dram,
                                "rel_err_first_layer": errors[name]}
        log(f"  {name:<52}{nbytes[name] / 1e6:>7.0f}{ms[name]:>8.2f}{gbs:>7.1f}{gbs / dram:>8.2f}{errors[name]:>10.1e}")
    return out


def distribution_metrics(ref, got) -> dict:
    """llama.cpp perplexity --kl-divergence's measures of `got` logits against `ref` (both (P, vocab)):
    mean and max KL(p_ref || p_got) in float64, top-1 agreement, max |logit diff|."""
    lp = torch.log_softmax(ref.double(), -1)
    lq = torch.log_softmax(got.double(), -1)
    kld = (lp.exp() * (lp - lq)).sum(-1).clamp(min=0)  # >= 0: a sum of ~1e-17 rounding is not a gain
    return {"mean_kld": float(kld.mean()), "max_kld": float(kld.max()),
            "top1_agree": float((ref.argmax(-1) == got.argmax(-1)).double().mean()),
            "max_abs_logit_diff": float((got.double() - ref.double()).abs().max())}


def greedy_ids(model, prompt: list, new_tokens: int) -> list:
    from .generate import Sampling, generate
    return generate(model, [prompt], Sampling(max_new_tokens=new_tokens))[0]


def bench_accuracy(spec: str = "random:gpt2", precisions=("fp32", "bf16", "int8", "int4"), positions: int | None = None,
                   prompt_tokens: int = 128, new_tokens: int = 64, log=print) -> dict:
    """Each precision's next-token distributions against fp32 (plain torch modules, HF's numerics within
    1e-5) over `positions` positions of a fixed token sequence (seeded random ids; default one context
    window, n_positions: 1024 for GPT-2), and its greedy tokens over `new_tokens` after a `prompt_tokens`
    prompt (both cut to fit a smaller context: half of it each at most). The reference's greedy path is
    reported too: a model whose path is one repeated token would make agreement meaningless."""
    from .model import load_model
    ref_model = load_model(spec, precision=None)
    cfg = ref_model.config
    positions = positions or cfg.n_positions
    if positions > cfg.n_positions:
        raise Gpt2ffnError(f"{positions} positions exceed the context of {cfg.n_positions}")
    prompt_tokens, new_tokens = fit(cfg, spec, prompt_tokens, new_tokens, "bench --accuracy")
    ids = torch.randint(0, cfg.vocab_size, (1, positions), generator=torch.Generator().manual_seed(0))
    prompt = ids[0, :prompt_tokens].tolist()
    with torch.no_grad():
        ref = ref_model(ids)[0]
        ref_greedy = greedy_ids(ref_model, prompt, new_tokens)
    out = {"model": spec, "positions": positions, "reference": "fp32, plain torch modules",
           "reference_greedy_distinct_tokens": len(set(ref_greedy)), "precisions": {}}
    log(f"accuracy vs fp32 on {spec}: {positions} positions; greedy {new_tokens} tokens after {prompt_tokens} "
        f"(reference path has {len(set(ref_greedy))} distinct tokens)")
    log(f"  {'precision':<10}{'mean KLD':>12}{'max KLD':>12}{'top-1 %':>9}{'max |dlogit|':>14}{'greedy same':>13}"
        f"{'first diff':>11}")
    del ref_model
    for precision in precisions:
        try:
            model = load_model(spec, precision=precision)
        except ConfigError as e:  # a precision this model's widths do not take: said, and the others measured
            out["precisions"][precision] = {"skipped": str(e)}
            log(f"  {precision:<10}skipped: {e}")
            continue
        with torch.no_grad():
            m = distribution_metrics(ref, model(ids)[0])
            greedy = greedy_ids(model, prompt, new_tokens)
        same = [a == b for a, b in zip(greedy, ref_greedy)]
        m["greedy_same"] = sum(same) / len(same)
        m["greedy_first_diff"] = same.index(False) if False in same else None
        m["group"] = model.lm_head.packed.group
        out["precisions"][precision] = m
        log(f"  {precision:<10}{m['mean_kld']:>12.3e}{m['max_kld']:>12.3e}{100 * m['top1_agree']:>9.2f}"
            f"{m['max_abs_logit_diff']:>14.3e}{100 * m['greedy_same']:>12.1f}%{str(m['greedy_first_diff']):>11}")
        del model
    return out
