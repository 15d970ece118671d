"""The GPU engine's prefill and decode choices side by side, in one process and interleaved rounds: the 124M
shape (random weights), 128-token prompts, 64 greedy tokens each, end to end as `gpt2ffn bench --model` times
it, at batch 1, 32 and 256, one engine (and one set of CUDA graphs) per batch, each variant set on it in turn:

    packed      prompts packed into one row under a mask (Engine.prefill_packed), every step through the sampler
    fresh       prompts from their start as padded batches, causal with no mask (Engine.prefill_fresh)
    burst N     fresh, and greedy rows run up to N steps with no host work between them (StaticDecoder.steps)
    chunk N     burst 8, and a prefill step takes N prompt tokens (8192, 16384, 32768), not 2048

Prints tokens/s per variant and batch (median of the rounds) and how many of each variant's tokens equal the
first variant's (bf16 sums in other shapes may flip a near tie). One device call's part
(benchmarks/gpu_round.sh ab).

    PYTHONPATH=src python benchmarks/gpu_engine_ab.py --device cuda --out $OUT/engine-ab-cuda.json
"""

import argparse
import json
import statistics
import time

import torch

from gpt2ffn.bench import CUDA_DTYPES, random_hf
from gpt2ffn.model import GPT2
from gpt2ffn.serving.engine import Request
from gpt2ffn.serving.sampling import Sampling
from gpt2ffn.serving.tp import make_engine

VARIANTS = {  # name -> (fresh prefill, max burst, prefill tokens a step)
    "packed": (False, 0, 2048),
    "fresh": (True, 0, 2048),
    "burst 1": (True, 1, 2048),
    "burst 8": (True, 8, 2048),
    "burst 16": (True, 16, 2048),
    "chunk 8192": (True, 8, 8192),
    "chunk 16384": (True, 8, 16384),
    "chunk 32768": (True, 8, 32768),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=sorted(CUDA_DTYPES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out")
    a = p.parse_args()
    cfg, name, hf = random_hf("random:gpt2")
    model = GPT2(cfg).to(a.device, CUDA_DTYPES[a.dtype]).eval()
    model.load_state_dict(hf.state_dict())
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    s = Sampling(max_new_tokens=a.new_tokens)
    prompts = torch.randint(0, cfg.vocab_size, (max(a.batch), a.prompt_tokens),
                            generator=torch.Generator().manual_seed(0)).tolist()
    out = {"device": torch.cuda.get_device_name(a.device) if cuda else "cpu", "torch": torch.__version__,
           "dtype": a.dtype, "model": name, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
           "variants": {v: VARIANTS[v] for v in a.variants}, "runs": {}}
    for B in a.batch:
        n = a.prompt_tokens + a.new_tokens
        engine = make_engine(model, max_batch=B, max_waiting=B, max_len=n, kv_tokens=B * n, static_decode=True)
        rows = prompts[:B]

        def run(variant, engine=engine, rows=rows):
            engine.fresh_prefill, engine.static.max_burst, engine.chunk = VARIANTS[variant]
            sync()
            t0 = time.perf_counter()
            done = engine.run([Request(list(r), s) for r in rows])
            sync()
            return time.perf_counter() - t0, [r.output for r in done]

        tokens, times = {}, {v: [] for v in a.variants}
        for v in a.variants:  # warm-up: every graph and kernel choice made before the timed rounds
            tokens[v] = run(v)[1]
        for _ in range(a.rounds):
            for v in a.variants:
                times[v].append(run(v)[0])
        base = tokens[a.variants[0]]
        r = out["runs"][B] = {"graph_capture": engine.graph_capture}
        for v in a.variants:
            t = statistics.median(times[v])
            same = sum(x == y for o, w in zip(tokens[v], base) for x, y in zip(o, w)) / (B * a.new_tokens)
            r[v] = {"ms": 1e3 * t, "tokens_per_s": B * a.new_tokens / t, "same_tokens_as_first": same}
            print(f"batch {B:>4} {v:<12} {1e3 * t:>9.1f} ms {B * a.new_tokens / t:>11.1f} tok/s   "
                  f"tokens as {a.variants[0]}: {same:.3f}", flush=True)
        del engine
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        print("wrote", a.out)


if __name__ == "__main__":
    main()
