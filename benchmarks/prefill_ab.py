"""A prompt's prefill (prompt -> first logits, as generate.stream runs it) for two trees of gpt2ffn, interleaved:
this checkout against another (a `git worktree` of an earlier commit, its native library built in place), one
process per tree and round, so that a kernel change is timed against its parent on the same noisy machine.

    git worktree add /tmp/base HEAD~1 && (cd /tmp/base && python setup.py build_ext --inplace)
    python benchmarks/prefill_ab.py --against /tmp/base --model DIR --precision int8 [--tokens 16 128]
                                    [--rounds 5] [--isa avx2] [--out benchmarks/results/prefill-ab.json]

DIR is an HF GPT-2 checkpoint (config.json + weights; no tokenizer needed). --isa sets GPT2FFN_ISA for both
trees (which native build runs: avx512amx, avx512, avxvnni, avx2). Each process times --repeats prefills per
prompt length after two warm-ups and reports its median; the table shows the medians across rounds.
"""

import json
import statistics
import sys
import time
from pathlib import Path

from trees import ab_parser, run_in_tree

ROOT = Path(__file__).resolve().parents[1]

ONE = """
import json, statistics, sys, time
import torch
torch.set_num_threads({threads})
from gpt2ffn.generate import load
from gpt2ffn.serving.kv_cache import KVCache
model, _, _ = load({model!r}, precision={precision!r}, need_tokenizer=False)
g = torch.Generator().manual_seed(0)
out = {{}}
for T in {tokens!r}:
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=g)
    def run():
        cache = KVCache(model.config, 1, getattr(model, "kv_dtype", torch.float32), max_len=T + 1)
        with torch.inference_mode():
            model(ids, cache=cache, last_only=True)
    run(); run()
    ts = []
    for _ in range({repeats}):
        t0 = time.perf_counter(); run(); ts.append(time.perf_counter() - t0)
    out[T] = statistics.median(ts) * 1e3
import gpt2ffn, gpt2ffn._C as C
print(json.dumps({{"ms": out, "isa": C.isa(), "package": gpt2ffn.__file__}}))
"""


def one(src: Path, args) -> dict:
    code = ONE.format(threads=args.threads, model=str(args.model), precision=args.precision,
                      tokens=args.tokens, repeats=args.repeats)
    return run_in_tree(src, code, args.isa)


def main():
    p = ab_parser(__doc__.splitlines()[0], rounds=5, repeats=12, threads=2)
    p.add_argument("--model", type=Path, required=True, help="an HF GPT-2 checkpoint directory")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 128])
    args = p.parse_args()
    trees = {"this": ROOT, "against": args.against.resolve()}
    runs = {name: [] for name in trees}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for name, src in trees.items():
            runs[name].append(one(src, args))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {[round(x['ms'][str(T)], 1) for T in args.tokens]}"
            for n, x in ((n, v[-1]) for n, v in runs.items())), file=sys.stderr)
    rows = []
    print(f"| prompt tokens | {args.against} ms | this tree ms | ratio |\n|---:|---:|---:|---:|")
    for T in args.tokens:
        med = {n: statistics.median(x["ms"][str(T)] for x in v) for n, v in runs.items()}
        rows.append({"tokens": T, "this_ms": med["this"], "against_ms": med["against"],
                     "ratio": med["this"] / med["against"],
                     "this_rounds": [x["ms"][str(T)] for x in runs["this"]],
                     "against_rounds": [x["ms"][str(T)] for x in runs["against"]]})
        print(f"| {T} | {med['against']:.1f} | {med['this']:.1f} | {med['this'] / med['against']:.3f} |")
    if args.out:
        from gpt2ffn.bench import cpu_info
        args.out.write_text(json.dumps({
            "machine": {"cpu": cpu_info(), "threads": args.threads, "isa": runs["this"][0]["isa"]},
            "model": str(args.model), "precision": args.precision, "against": str(args.against),
            "rounds": args.rounds, "repeats_per_process": args.repeats, "wall_s": time.perf_counter() - t0,
            "results": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
