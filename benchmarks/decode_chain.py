"""The decode GEMVs alone: the 48 block layers of GPT-2 124M (c_attn, attn.c_proj, c_fc, mlp.c_proj x 12), one
row each (--rows N: a decode step of N sequences), one after another through the native kernels
(`kernels.packed.linear`), per weight precision and activations, in interleaved rounds, medians. What
`csrc/qvec_avx2.h` quotes for QNB1 (one row) and for qtile8's group-major order (2-8 rows); no lm_head, no
attention; each call is its own parallel region, so a step of the fused decode plan takes less.

    PYTHONPATH=src python benchmarks/decode_chain.py [--rounds 15] [--rows 1]

Against an earlier commit: `git worktree add /tmp/base REV`, build it in place (`python setup.py build_ext
--inplace` there), then run this file under PYTHONPATH=/tmp/base/src and PYTHONPATH=src in turn.
"""

import argparse

import torch

from gpt2ffn.bench import machine, rounds
from gpt2ffn.kernels.packed import linear
from gpt2ffn.model import load_model
from gpt2ffn.precision import quantize

CONFIGS = [("int8", "fp32"), ("int8", "int8"), ("int4", "fp32"), ("int4", "int8")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:gpt2:0")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--rows", type=int, default=1, help="rows a call (sequences in the decode step)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(machine()["cpu"], machine()["isa"])
    chains = {}
    for precision, act in CONFIGS:
        model = quantize(load_model(args.model, precision=None), precision, activations=act)
        mods = [m for b in model.transformer.h for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)]
        xs = {m.packed.K: torch.randn(args.rows, m.packed.K) for m in mods}

        def chain(mods=mods, xs=xs):
            for m in mods:
                linear(xs[m.packed.K], m.packed, m.weight, m.bias, "native")
        chains[f"{precision} weights, {act} activations"] = chain
    with torch.no_grad():
        ms = rounds(chains, args.rounds)
    for name, t in ms.items():
        print(f"{name:<32} {t:6.3f} ms")


if __name__ == "__main__":
    main()
