"""Time the CPU's native top-p (kernels.packed.top_p_) over GPT-2's vocabulary at 1, 16 and 256 rows, optionally
against another checkout's build, the two run alternately in fresh processes.

    python benchmarks/top_p.py [--against /tmp/wt] [--rounds 3] [--out benchmarks/results/top-p.json]

--against DIR: a worktree of another commit with its extension built in place (`python setup.py build_ext
--inplace`); its src/ is put first on the path of its runs. Rows are N(0, s) logits less their max (s = 3:
peaked, s = 0.5: flat), top_p 0.9; each figure is the median of 11 calls, then the median over rounds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS = (1, 16, 256)
SCALES = {"peaked (N(0, 3))": 3.0, "flat (N(0, 0.5))": 0.5}


def measure() -> dict:
    import torch

    from gpt2ffn.kernels.packed import top_p_
    g = torch.Generator().manual_seed(0)
    out = {}
    for R in ROWS:
        for name, s in SCALES.items():
            x = torch.randn(R, 50257, generator=g) * s
            x -= x.amax(-1, keepdim=True)
            z = x.clone()
            ts = []
            for _ in range(11):
                z.copy_(x)
                t0 = time.perf_counter()
                assert top_p_(z, [0.9] * R), "no native top-p in this build"
                ts.append(1e3 * (time.perf_counter() - t0))
            out[f"{R} rows, {name}"] = statistics.median(ts)
    return out


def run(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    code = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import top_p; " \
           "print(json.dumps(top_p.measure()))"
    return json.loads(subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, check=True,
                                     capture_output=True, text=True).stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", help="another checkout, its extension built in place")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/top-p.json")
    args = p.parse_args()
    from gpt2ffn.bench import cpu_info
    trees = {"this": Path(__file__).resolve().parent.parent}
    if args.against:
        trees["against"] = Path(args.against).resolve()
    runs = {k: [] for k in trees}
    for _ in range(args.rounds):
        for k, tree in trees.items():
            runs[k].append(run(tree))
    ms = {k: {c: statistics.median(r[c] for r in v) for c in v[0]} for k, v in runs.items()}
    commits = {k: subprocess.run(["git", "describe", "--always", "--dirty"], cwd=t, capture_output=True,
                                 text=True).stdout.strip() for k, t in trees.items()}
    import torch
    result = {"machine": f"{cpu_info()['cpu']}, {torch.get_num_threads()} threads, torch {torch.__version__}",
              "vocab": 50257, "top_p": 0.9, "rounds": args.rounds, "commits": commits, "ms_median": ms}
    for c in ms["this"]:
        line = f"{c:<32} {ms['this'][c]:8.3f} ms"
        if "against" in ms:
            line += f"   against {ms['against'][c]:8.3f} ms ({ms['against'][c] / ms['this'][c]:.1f}x)"
        print(line)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
