"""int8 / int4 weights with fp32 activations against the same weights with int8 activations (integer dot
products, kernels/formats.py), and fp32 beside them: accuracy vs fp32 and speed, on one machine.

- accuracy: mean KLD, top-1 agreement over `--positions` positions of a seeded token sequence and greedy
  agreement over 64 tokens after a 128-token prompt, each against plain fp32 torch modules (as
  `gpt2ffn bench --accuracy`), on random:gpt2 (124M shape, seeded weights).
- speed: 128-token prefill ms and decode tokens/s (64 single-token greedy steps, timed by themselves after an
  untimed prefill), every configuration in interleaved rounds in one process, medians. GPT2FFN_ISA=avx2 runs the
  AVX2 (maddubs) build on a CPU that has AVX-512.

    flock -x /tmp/machine.lock env PYTHONPATH=src python benchmarks/int8_activations.py --out FILE.json
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from gpt2ffn import _C
from gpt2ffn.bench import decode_seconds, distribution_metrics, greedy_ids, machine, rounds
from gpt2ffn.model import load_model
from gpt2ffn.precision import quantize
from gpt2ffn.serving.kv_cache import KVCache

CONFIGS = [("fp32", "fp32"), ("int8", "fp32"), ("int8", "int8"), ("int4", "fp32"), ("int4", "int8")]


def accuracy(spec, positions, prompt_tokens=128, new_tokens=64) -> dict:
    ref_model = load_model(spec, precision=None)
    ids = torch.randint(0, ref_model.config.vocab_size, (1, positions), generator=torch.Generator().manual_seed(0))
    prompt = ids[0, :prompt_tokens].tolist()
    with torch.no_grad():
        ref = ref_model(ids)[0]
        ref_greedy = greedy_ids(ref_model, prompt, new_tokens)
    out = {}
    for precision, act in CONFIGS[1:]:
        model = quantize(load_model(spec, precision=None), precision, activations=act)
        with torch.no_grad():
            m = distribution_metrics(ref, model(ids)[0])
            greedy = greedy_ids(model, prompt, new_tokens)
        m["greedy_same"] = sum(a == b for a, b in zip(greedy, ref_greedy)) / new_tokens
        out[f"{precision} weights, {act} activations"] = m
        print(f"{precision:>5} w {act:>4} a: mean KLD {m['mean_kld']:.3e}  top-1 {100 * m['top1_agree']:.2f}%  "
              f"greedy {100 * m['greedy_same']:.1f}%", flush=True)
    return out


def speed(spec, repeats, prompt_tokens=128, new_tokens=64) -> dict:
    ids = torch.randint(0, 50257, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    prefill, steps, models = {}, {}, {}
    for precision, act in CONFIGS:
        name = f"{precision} weights, {act} activations"
        model = quantize(load_model(spec, precision=None), precision, activations=act)
        models[name] = model
        cfg = model.config
        prefill[name] = lambda m=model, cfg=cfg: m(
            ids, KVCache(cfg, 1, m.kv_dtype, max_len=prompt_tokens + new_tokens), last_only=True)
        # the greedy steps alone (generate's time less prefill's came out <= 0 on a fast CPU)
        steps[name] = lambda m=model: decode_seconds(m, ids, new_tokens)
    with torch.no_grad():
        p = rounds(prefill, repeats)
        g = rounds(steps, max(3, repeats // 2), self_timed=True)
    out = {}
    for name, model in models.items():
        out[name] = {"prefill_128_ms": p[name], "decode_tokens_per_s": new_tokens / g[name] * 1e3,
                     "routes": model.lm_head.packed.route}
        print(f"{name:<32} prefill {p[name]:7.1f} ms  decode {out[name]['decode_tokens_per_s']:6.1f} tok/s  "
              f"{out[name]['routes']}", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:gpt2:0")
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--part", choices=["accuracy", "speed", "both"], default="both")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    result = {"machine": {**machine(), "kernels": _C.isa()}, "model": args.model}
    print(f"{result['machine']['cpu']}, {result['machine']['threads']} threads, kernels {_C.isa()}", flush=True)
    if args.part in ("accuracy", "both"):
        result["accuracy"] = accuracy(args.model, args.positions)
    if args.part in ("speed", "both"):
        result["speed"] = speed(args.model, args.repeats)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
