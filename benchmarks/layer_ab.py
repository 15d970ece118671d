"""One linear layer's prefill (M rows through `kernels.packed.linear`, native route) for two trees of gpt2ffn,
interleaved: this checkout against another (a `git worktree` of an earlier commit, its native library built in
place), one process per tree and round (the order alternating), products per second per layer shape. What
prefill_ab.py shows for a whole prompt, layer by layer, so a kernel change can be timed on the shapes it targets.
The time is the whole `_C.linear` call: the output's allocation, int8 / int4's activation quantization, the threads'
fork and join and the GEMM.

    git worktree add /tmp/base HEAD~1 && (cd /tmp/base && python setup.py build_ext --inplace)
    python benchmarks/layer_ab.py --against /tmp/base --precision int8 --shapes 1024x4096 4096x1024
                                  [--rows 128] [--threads 1] [--rounds 3] [--isa avx512amx] [--out FILE]

Shapes are K x N (GPT-2 medium's layers: 1024x3072 1024x1024 1024x4096 4096x1024; xl's: 1600x4800 1600x1600
1600x6400 6400x1600). Random weights (std 0.02), packed at --precision (int8 / int4 on int8 activations, their
default); each process times --repeats calls per shape after a warm-up and reports its least (a shared machine
only adds time); the table shows the medians across rounds.
"""

import json
import statistics
import sys
import time
from pathlib import Path

from trees import ab_parser, commit, run_in_tree

ROOT = Path(__file__).resolve().parents[1]

ONE = """
import json, time, torch
torch.set_num_threads({threads})
from gpt2ffn.kernels.formats import DEFAULT_ACTIVATIONS, Packed
from gpt2ffn.kernels.packed import linear
import gpt2ffn, gpt2ffn._C as C
g = torch.Generator().manual_seed(0)
out = {{}}
with torch.inference_mode():
    for K, N in {shapes!r}:
        w, b = torch.randn(K, N, generator=g) * 0.02, torch.randn(N, generator=g) * 0.01
        p = Packed(w, b, {precision!r}, activations=DEFAULT_ACTIVATIONS[{precision!r}])
        x = torch.randn({rows}, K, generator=g)
        linear(x, p, None, p.bias, "native")
        ts = []
        for _ in range({repeats}):
            t0 = time.perf_counter(); linear(x, p, None, p.bias, "native"); ts.append(time.perf_counter() - t0)
        out[f"{{K}}x{{N}}"] = min(ts) * 1e3
print(json.dumps({{"ms": out, "isa": C.isa(), "package": gpt2ffn.__file__}}))
"""


def one(src: Path, args, shapes) -> dict:
    code = ONE.format(threads=args.threads, shapes=shapes, precision=args.precision, rows=args.rows,
                      repeats=args.repeats)
    return run_in_tree(src, code, args.isa)


def main():
    p = ab_parser(__doc__.splitlines()[0], rounds=3, repeats=20, threads=1)
    p.add_argument("--shapes", nargs="+", default=["1024x3072", "1024x1024", "1024x4096", "4096x1024"],
                   help="K x N of each layer")
    p.add_argument("--rows", type=int, default=128)
    args = p.parse_args()
    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
        assert all(len(s) == 2 and min(s) > 0 for s in shapes)
    except (ValueError, AssertionError):
        p.error(f"--shapes takes K x N pairs such as 1024x4096, got {' '.join(args.shapes)}")
    trees = {"this": ROOT, "against": args.against.resolve()}
    runs = {name: [] for name in trees}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for name in (("this", "against") if r % 2 == 0 else ("against", "this")):
            runs[name].append(one(trees[name], args, shapes))
        print(f"round {r + 1}/{args.rounds} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    rows = []
    print(f"| K x N | {args.against} ms | G products/s | this tree ms | G products/s | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for K, N in shapes:
        key = f"{K}x{N}"
        med = {n: statistics.median(x["ms"][key] for x in v) for n, v in runs.items()}
        gps = {n: args.rows * K * N / ms / 1e6 for n, ms in med.items()}
        rows.append({"shape": key, "this_ms": med["this"], "against_ms": med["against"], "this_gps": gps["this"],
                     "against_gps": gps["against"], "ratio": med["this"] / med["against"],
                     "this_rounds": [x["ms"][key] for x in runs["this"]],
                     "against_rounds": [x["ms"][key] for x in runs["against"]]})
        print(f"| {key} | {med['against']:.3f} | {gps['against']:.0f} | {med['this']:.3f} | {gps['this']:.0f} | "
              f"{med['this'] / med['against']:.3f} |")
    if args.out:
        from gpt2ffn.bench import cpu_info
        args.out.write_text(json.dumps({
            "machine": {"cpu": cpu_info(), "threads": args.threads},
            "trees": {n: {"path": str(src), "commit": commit(src), "isa": runs[n][0]["isa"]}
                      for n, src in trees.items()},
            "precision": args.precision, "rows": args.rows, "rounds": args.rounds,
            "repeats_per_process": args.repeats, "wall_s": time.perf_counter() - t0, "results": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
