"""The batch sampler's time per step when requests use repetition / frequency / presence penalties, by batch size
and context length, for this tree and others (--src label=path, an A/B), interleaved, medians.

Every row is greedy with repetition_penalty 1.1 and frequency_penalty 0.2 over a context of L ids (half prompt,
half generated) from GPT-2's vocabulary; a step is serving/sampling.next_tokens on (B, 50257) logits, the
requests' outputs growing by one id a step as in the engine.

    python benchmarks/penalties.py [--src before=/path/to/old/src] [--out benchmarks/results/penalties.json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = [(64, 128), (64, 900), (256, 900)]

CHILD = """
import json, sys, time, torch
torch.set_num_threads({threads})
from gpt2ffn.serving.engine import Request
from gpt2ffn.serving.sampling import Sampling, next_tokens
V, B, L = 50257, {B}, {L}
g = torch.Generator().manual_seed(0)
reqs = [Request(torch.randint(0, V, (L // 2,), generator=g).tolist(),
                Sampling(max_new_tokens=L, repetition_penalty=1.1, frequency_penalty=0.2)) for _ in range(B)]
for r in reqs:
    r.output = torch.randint(0, V, (L // 2,), generator=g).tolist()
x = torch.randn(B, V, generator=g)
ms = []
for _ in range({steps}):
    t0 = time.perf_counter()
    ids = next_tokens(x, reqs)
    ms.append(1e3 * (time.perf_counter() - t0))
    for r, t in zip(reqs, ids):
        r.output.append(t)
print(json.dumps(ms[1:]))
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", action="append", default=[], help="label=path of another tree's src (A/B)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/penalties.json")
    args = p.parse_args()
    sys.path.insert(0, str(HERE.parent / "src"))
    from gpt2ffn.bench import cpu_info
    trees = {"this tree": str(HERE.parent / "src"), **dict(s.split("=", 1) for s in args.src)}
    ms = {name: {f"B={B} L={L}": [] for B, L in SHAPES} for name in trees}
    for _ in range(args.rounds):
        for B, L in SHAPES:
            for name, src in trees.items():
                code = CHILD.format(threads=args.threads, B=B, L=L, steps=args.steps + 1)
                out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=src),
                                     capture_output=True, text=True, check=True)
                ms[name][f"B={B} L={L}"] += json.loads(out.stdout.strip().splitlines()[-1])
    med = {name: {k: statistics.median(v) for k, v in shapes.items()} for name, shapes in ms.items()}
    for name, shapes in med.items():
        print(f"{name:12s} " + "  ".join(f"{k}: {v:7.1f} ms" for k, v in shapes.items()))
    result = {"machine": f"{cpu_info()['cpu']}, {args.threads} threads", "ms_per_step_median": med}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
