"""A prompt's prefill (prompt -> first logits, as generate.stream runs it) for two trees of gpt2ffn, interleaved:
this checkout against another (a `git worktree` of an earlier commit, its native library built in place), one
process per tree and round, so that a kernel change is timed against its parent on the same noisy machine.

    git worktree add /tmp/base HEAD~1 && (cd /tmp/base && python setup.py build_ext --inplace)
    python benchmarks/prefill_ab.py --against /tmp/base --model DIR --precision int8 [--tokens 16 128]
                                    [--decode 1 16] [--rounds 5] [--isa avx2] [--out benchmarks/results/prefill-ab.json]

DIR is an HF GPT-2 checkpoint (config.json + weights; no tokenizer needed). --isa sets GPT2FFN_ISA for both
trees (which native build runs: avx512amx, avx512, avxvnni, avx2). Each process times --repeats prefills per
prompt length after two warm-ups and reports its median; the table shows the medians across rounds. --decode B
also times decode steps of B sequences at once (one new token each, after a 32-token prompt each; the step's
median, as tokens/s).
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
steps = {{}}
for B in {decode!r}:
    cache = KVCache(model.config, B, getattr(model, "kv_dtype", torch.float32), max_len=32 + {repeats} + 3)
    tok = torch.randint(0, model.config.vocab_size, (B, 1), generator=g)
    ts = []
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (B, 32), generator=g), cache=cache, last_only=True)
        for _ in range({repeats} + 2):
            t0 = time.perf_counter(); model(tok, cache=cache); ts.append(time.perf_counter() - t0)
    steps[B] = B / statistics.median(ts[2:])
import gpt2ffn, gpt2ffn._C as C
print(json.dumps({{"ms": out, "decode_tok_s": steps, "isa": C.isa(), "package": gpt2ffn.__file__}}))
"""


def one(src: Path, args) -> dict:
    code = ONE.format(threads=args.threads, model=str(args.model), precision=args.precision,
                      tokens=args.tokens, repeats=args.repeats, decode=args.decode)
    return run_in_tree(src, code, args.isa)


def table(runs: dict, key: str, name: str, points: list, what: str, unit: str, against: Path) -> list:
    """Each point's medians over rounds (runs[tree][round][key][point]) for both trees, their ratio (this tree's
    over the other's) and the median of the per-round ratios, printed as a table and returned as rows."""
    print(f"| {what} | {against} {unit} | this tree {unit} | ratio |\n|---:|---:|---:|---:|")
    suffix, rows = unit.replace("/", "_"), []
    for at in points:
        got = {n: [x[key][str(at)] for x in v] for n, v in runs.items()}
        med = {n: statistics.median(v) for n, v in got.items()}
        rows.append({name: at, f"this_{suffix}": med["this"], f"against_{suffix}": med["against"],
                     "ratio": med["this"] / med["against"],
                     "paired_ratio": statistics.median(t / a for t, a in zip(got["this"], got["against"])),
                     "this_rounds": got["this"], "against_rounds": got["against"]})
        print(f"| {at} | {med['against']:.1f} | {med['this']:.1f} | {med['this'] / med['against']:.3f} |")
    return rows


def main():
    p = ab_parser(__doc__.splitlines()[0], rounds=5, repeats=12, threads=2)
    p.add_argument("--model", type=Path, required=True, help="an HF GPT-2 checkpoint directory")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 128])
    p.add_argument("--decode", type=int, nargs="*", default=[], metavar="B",
                   help="also time decode steps of B sequences at once (tokens/s)")
    args = p.parse_args()
    trees = {"this": ROOT, "against": args.against.resolve()}
    runs = {name: [] for name in trees}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        # the trees' order alternates: whichever runs first in a round can be ~2% slower at some shapes (an A/A run
        # of one commit against itself, GPT-2 124M int8 decode of 32 sequences: 0.98)
        for name, src in list(trees.items())[::1 if r % 2 == 0 else -1]:
            runs[name].append(one(src, args))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {[round(x['ms'][str(T)], 1) for T in args.tokens]}"
            for n, x in ((n, v[-1]) for n, v in runs.items())), file=sys.stderr)
    rows = table(runs, "ms", "tokens", args.tokens, "prompt tokens", "ms", args.against)
    steps = []
    if args.decode:
        print()
        steps = table(runs, "decode_tok_s", "sequences", args.decode, "decode, sequences", "tok/s", args.against)
    if args.out:
        from gpt2ffn.bench import cpu_info
        args.out.write_text(json.dumps({
            "machine": {"cpu": cpu_info(), "threads": args.threads, "isa": runs["this"][0]["isa"]},
            "model": str(args.model), "precision": args.precision, "against": str(args.against),
            "rounds": args.rounds, "order": "alternating: this tree first in odd rounds",
            "repeats_per_process": args.repeats, "wall_s": time.perf_counter() - t0,
            "results": rows, "decode": steps}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
