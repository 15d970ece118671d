"""Decode tokens/s of one source tree's gpt2ffn, for A/B runs of two trees alternated in one shell loop.

    git worktree add /tmp/wt_base <commit> && cp src/gpt2ffn/_C*.so /tmp/wt_base/src/gpt2ffn/
    for r in 1 2 3; do for t in /tmp/wt_base/src src; do .venv/bin/python benchmarks/tree_decode_ab.py $t; done; done

random:gpt2 (124M shape), fp32 and int8: one 16-token prompt, 48 greedy tokens (median of 5), and a batch of 4
prompts, 32 tokens each (median of 3); prints tokens/s as (one sequence, batch of 4).
"""

import sys
import time

sys.path.insert(0, sys.argv[1])

import torch  # noqa: E402

from gpt2ffn.generate import generate, load  # noqa: E402


def rate(model, prompts, new_tokens: int, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        generate(model, prompts, max_new_tokens=new_tokens)
        times.append(time.perf_counter() - t0)
    return len(prompts) * new_tokens / sorted(times)[runs // 2]


def main():
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    one = [torch.randint(0, 50000, (16,), generator=g).tolist()]
    four = [torch.randint(0, 50000, (16,), generator=g).tolist() for _ in range(4)]
    out = {}
    for precision in ("fp32", "int8"):
        model, _, _ = load("random:gpt2", precision=precision)
        generate(model, one, max_new_tokens=8)  # warm-up
        out[precision] = (round(rate(model, one, 48, 5), 1), round(rate(model, four, 32, 3), 1))
    print(sys.argv[1], out)


if __name__ == "__main__":
    main()
