"""The two tanh-GELU forms of FeedForward's CPU fp32 path, alone and inside the whole FFN, interleaved.

    PYTHONPATH=src .venv/bin/python benchmarks/gelu_forms.py --out benchmarks/results/gelu-forms-zen5.json

For each GPT-2 width and token count: the median time of aten's in-place tanh GELU and of the sigmoid form
(kernels/cpu.py: gelu_sigmoid_) on the (tokens, 4d) pre-activation, the whole FFN through each path, and how
far apart the two paths' outputs are (they round differently, so a path picked by timing changed the bits).
"""

import argparse
import json
import time

import torch

from gpt2ffn.bench import cpu_info
from gpt2ffn.kernels import cpu


def median_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def measure(d: int, T: int, rounds: int, calls: int) -> dict:
    g = torch.Generator().manual_seed(d * 10_000 + T)
    w1, w2 = torch.randn(d, 4 * d, generator=g) * 0.02, torch.randn(4 * d, d, generator=g) * 0.02
    b1, b2 = torch.randn(4 * d, generator=g) * 0.02, torch.randn(d, generator=g) * 0.02
    x = torch.randn(T, d, generator=g)
    h0 = torch.randn(T, 4 * d, generator=g) * 2
    h = h0.clone()
    fns = {f"gelu {name}": lambda gelu_=gelu_: gelu_(h.copy_(h0), "tanh") for name, gelu_ in cpu.GELUS.items()}
    for name in ("torch+aten", "torch+sigmoid"):
        fns[f"ffn {name}"] = lambda name=name: cpu.run_path(name, x, w1, b1, w2, b2, "tanh")
    for f in fns.values():  # warm-up
        f()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            times[k].append(median_ms(f, calls))
    diff = (cpu.run_path("torch+aten", x, w1, b1, w2, b2, "tanh")
            - cpu.run_path("torch+sigmoid", x, w1, b1, w2, b2, "tanh")).abs().max().item()
    return {"d": d, "tokens": T, "ms": {k: sorted(v)[len(v) // 2] for k, v in times.items()},
            "copy_ms": median_ms(lambda: h.copy_(h0), calls), "max_abs_diff": diff}  # the GELU rows include the copy


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[768, 1024, 1600])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for d in args.dims:
        for T in args.tokens:
            row = measure(d, T, args.rounds, args.calls)
            rows.append(row)
            print(d, T, {k: round(v, 3) for k, v in row["ms"].items()}, f"copy {row['copy_ms']:.3f}",
                  f"diff {row['max_abs_diff']:.2e}")
    result = {"machine": cpu_info(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "rounds": args.rounds, "calls": args.calls, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
