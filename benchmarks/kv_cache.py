"""The KV cache's dtype for bf16 / int8 / int4 weights: fp32 against fp16 (GPT2.kv_dtype's default for them),
accuracy and decode speed on one machine.

- accuracy: each token of a sequence fed one cached step at a time (so every key and value is read back from
  the cache, as generation reads them): mean KLD and top-1 agreement against plain fp32 torch modules over the
  whole sequence (no cache), and greedy agreement over 64 tokens after a 128-token prompt against the same
  weights with an fp32 cache, for each precision x cache dtype.
- speed: decode ms per token (64 greedy steps) after a short and a long prompt, the same model with an fp32
  and an fp16 cache in interleaved rounds in one process, medians.

    flock -x /tmp/machine.lock env PYTHONPATH=src python benchmarks/kv_cache.py --model DIR --out FILE.json

DIR: an HF checkpoint (default random:gpt2, the 124M shape with seeded weights); --seq FILE.npy: the token
ids to score (default: seeded random ids).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gpt2ffn.bench import distribution_metrics, machine
from gpt2ffn.model import load_model
from gpt2ffn.serving.kv_cache import KVCache

PRECISIONS = ("bf16", "int8", "int4")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def stepped(model, ids, kv) -> torch.Tensor:
    """Logits (T, vocab) of ids (1, T), one cached step a token, over a cache of dtype kv."""
    cache = KVCache(model.config, 1, kv, max_len=ids.shape[1])
    with torch.inference_mode():
        return torch.cat([model(ids[:, t:t + 1], cache)[0] for t in range(ids.shape[1])])


def greedy(model, prompt, n, kv) -> list:
    cache = KVCache(model.config, 1, kv, max_len=prompt.shape[1] + n)
    out = []
    with torch.inference_mode():
        tok = model(prompt, cache)[:, -1].argmax(-1, keepdim=True)
        for _ in range(n):
            out.append(int(tok))
            tok = model(tok, cache)[:, -1].argmax(-1, keepdim=True)
    return out


def accuracy(spec, ids, prompt_tokens=128, new_tokens=64) -> dict:
    ref_model = load_model(spec, precision=None)
    with torch.inference_mode():
        ref = ref_model(ids)[0]
    out = {}
    for precision in PRECISIONS:
        model = load_model(spec, precision=precision)
        base = greedy(model, ids[:, :prompt_tokens], new_tokens, torch.float32)
        for name, kv in DTYPES.items():
            m = distribution_metrics(ref, stepped(model, ids, kv))
            g = greedy(model, ids[:, :prompt_tokens], new_tokens, kv)
            m["greedy_agree_vs_fp32_cache"] = sum(a == b for a, b in zip(g, base)) / new_tokens
            out[f"{precision} kv {name}"] = m
            print(f"{precision} kv {name}: {m}", file=sys.stderr, flush=True)
    return out


def speed(spec, prompts=(128, 896), new_tokens=64, rounds=7) -> dict:
    out = {}
    for precision in PRECISIONS:
        model = load_model(spec, precision=precision)
        for p in prompts:
            ids = torch.randint(0, model.config.vocab_size, (1, p), generator=torch.Generator().manual_seed(0))
            ms = {name: [] for name in DTYPES}
            with torch.inference_mode():
                for _ in range(rounds):
                    for name, kv in DTYPES.items():
                        cache = KVCache(model.config, 1, kv, max_len=p + new_tokens + 1)
                        tok = model(ids, cache, None, True)[:, -1].argmax(-1, keepdim=True)
                        t0 = time.perf_counter()
                        for _ in range(new_tokens):
                            tok = model(tok, cache, None, True)[:, -1].argmax(-1, keepdim=True)
                        ms[name].append(1e3 * (time.perf_counter() - t0) / new_tokens)
            med = {name: statistics.median(v) for name, v in ms.items()}
            out[f"{precision} prompt {p}"] = {"ms_per_token": med, "fp16_speedup": med["fp32"] / med["fp16"],
                                              "rounds": ms}
            print(f"{precision} prompt {p}: {med} -> fp16 {med['fp32'] / med['fp16']:.3f}x", file=sys.stderr,
                  flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--seq", type=Path, help="token ids (.npy) to score; default: seeded random ids")
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.seq:
        ids = torch.tensor(np.load(args.seq)[:args.positions].tolist())[None]
    else:
        ids = torch.randint(0, 50257, (1, args.positions), generator=torch.Generator().manual_seed(0))
    out = {"machine": machine(), "model": args.model, "positions": ids.shape[1], "accuracy": accuracy(args.model, ids),
           "speed": speed(args.model)}
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
