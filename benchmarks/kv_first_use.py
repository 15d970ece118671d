"""What a KV cache slot's first use costs the request that gets it, and what the server's idle time takes off.

A fresh engine's cache is mapped but not resident: the first write to each 2 MiB page faults it in (the kernel
zeroes it; in a VM the host may have to back it too). For each precision, rounds alternate between a fresh
engine whose cache is cold and one made resident first, as the server's engine thread does while idle
(serving/engine.py: Loop; kernels/formats.py: make_resident), and time the same batch of prompts prefilled into
fresh slots (one engine step, one token each). Each round is a process of its own (a freed cache's pages are
cheap to fault in again while the process that freed them runs); medians over the rounds.

    flock -x /tmp/machine.lock env PYTHONPATH=src python benchmarks/kv_first_use.py --out FILE.json
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from gpt2ffn.bench import machine
from gpt2ffn.kernels.formats import make_resident
from gpt2ffn.model import load_model
from gpt2ffn.serving.engine import Engine, Request
from gpt2ffn.serving.sampling import Sampling


def prefill(model, batch: int, prompt: int, resident: bool) -> dict:
    """ms to prefill `batch` prompts into fresh slots of a fresh engine, and to make its cache resident first."""
    engine = Engine(model, max_batch=batch, kv_tokens=batch * model.config.n_positions)
    out = {}
    if resident:
        t0 = time.perf_counter()
        for piece in engine.cache.pieces():
            if not make_resident(piece):
                raise SystemExit("this system has no MADV_POPULATE_WRITE (Linux 5.14+)")
        out["making_resident"] = (time.perf_counter() - t0) * 1e3
    g = torch.Generator().manual_seed(0)
    requests = [Request(torch.randint(0, model.config.vocab_size, (prompt,), generator=g).tolist(),
                        Sampling(max_new_tokens=1)) for _ in range(batch)]
    t0 = time.perf_counter()
    engine.run(requests)
    out["resident" if resident else "cold"] = (time.perf_counter() - t0) * 1e3
    return out


def one(args):
    """One round in this process: the model loaded, its kernels warmed on a small engine, then the engine timed."""
    torch.set_num_threads(args.threads)
    model = load_model(args.model, precision=args.one[0])
    Engine(model, max_batch=1, kv_tokens=64).run([Request(list(range(args.prompt)), Sampling(max_new_tokens=2))])
    out = prefill(model, args.batch, args.prompt, args.one[1] == "resident")
    print(json.dumps({"kv_dtype": str(model.kv_dtype).removeprefix("torch."), **out}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:gpt2")
    p.add_argument("--precisions", default="fp32,int8")
    p.add_argument("--batch", type=int, default=32, help="prompts prefilled together, each into a fresh slot")
    p.add_argument("--prompt", type=int, default=22, help="tokens per prompt (load_test.py's prompts: ~22)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one", nargs=2, metavar=("PRECISION", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args()
    if args.one:
        return one(args)
    results = {}
    for precision in args.precisions.split(","):
        times, kv = {"cold": [], "resident": [], "making_resident": []}, None
        for _ in range(args.rounds):
            for mode in ("cold", "resident"):
                r = subprocess.run([sys.executable, __file__, "--one", precision, mode, *sys.argv[1:]],
                                   capture_output=True, text=True, check=True)
                got = json.loads(r.stdout.strip().splitlines()[-1])
                kv = got.pop("kv_dtype")
                for k, v in got.items():
                    times[k].append(v)
        med = {k: statistics.median(v) for k, v in times.items()}
        results[precision] = {"kv_dtype": kv, "median_ms": med,
                              "first_use_ms_per_slot": (med["cold"] - med["resident"]) / args.batch,
                              "rounds_ms": times}
        print(f"{precision} (KV {kv}): {args.batch} prompts of {args.prompt} tokens into fresh slots: cold "
              f"{med['cold']:.1f} ms, resident {med['resident']:.1f} ms "
              f"({results[precision]['first_use_ms_per_slot']:.2f} ms a slot); making the cache resident "
              f"{med['making_resident']:.1f} ms", flush=True)
    out = {"machine": machine(), "model": args.model, "batch": args.batch, "prompt": args.prompt,
           "threads": args.threads, "rounds": args.rounds, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
