"""Where a GPU engine run spends its time: torch.profiler over gpt2ffn's Engine.run at each batch (the 124M
shape, random weights, 128-token prompts, greedy), after a warm-up run. Prints, per batch, the wall time, the
engine's steps, the host (CPU) time and the device (kernel) time the profiler saw, and the top ops by self
host time and by device time. One device call's part (benchmarks/gpu_round.sh profile).

    PYTHONPATH=src python benchmarks/gpu_profile.py --device cuda --batch 1 256 --out $OUT/profile-cuda.json
"""

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gpt2ffn.bench import random_hf
from gpt2ffn.model import GPT2
from gpt2ffn.serving.engine import Request
from gpt2ffn.serving.sampling import Sampling
from gpt2ffn.serving.tp import make_engine


def top(events, key: str, n: int) -> list:
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"op": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total,
             "self_device_us": e.self_device_time_total} for e in rows]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out")
    a = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    cfg, name, hf = random_hf("random:gpt2")
    model = GPT2(cfg).to(a.device, dtype).eval()
    model.load_state_dict(hf.state_dict())
    g = torch.Generator().manual_seed(0)
    s = Sampling(max_new_tokens=a.new_tokens)
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    result = {"device": torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "dtype": a.dtype, "runs": {}}
    for B in a.batch:
        n = a.prompt_tokens + a.new_tokens
        engine = make_engine(model, max_batch=B, max_waiting=B, max_len=n, kv_tokens=B * n)
        rows = torch.randint(0, cfg.vocab_size, (B, a.prompt_tokens), generator=g).tolist()
        engine.run([Request(list(r), s) for r in rows])  # warm-up: graphs captured on first use, cuBLAS handles
        sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            engine.run([Request(list(r), s) for r in rows])
            sync()
            wall = time.perf_counter() - t0
        ev = prof.key_averages()
        host = sum(e.self_cpu_time_total for e in ev) / 1e6
        dev = sum(e.self_device_time_total for e in ev) / 1e6
        run = {"batch": B, "wall_s": wall, "tokens_per_s": B * a.new_tokens / wall, "host_s": host,
               "device_s": dev, "graph_capture": engine.graph_capture,
               "by_host": top(ev, "self_cpu_time_total", a.top), "by_device": top(ev, "self_device_time_total", a.top)}
        result["runs"][str(B)] = run
        print(f"batch {B}: {wall * 1e3:.1f} ms wall under the profiler ({run['tokens_per_s']:.0f} tok/s), "
              f"host {host * 1e3:.1f} ms, device kernels {dev * 1e3:.1f} ms, capture {engine.graph_capture}")
        for what in ("by_host", "by_device"):
            print(f"  top {what}:")
            for r in run[what]:
                print(f"    {r['op'][:60]:<60}{r['calls']:>7}{r['self_cpu_us']:>12.0f} us cpu"
                      f"{r['self_device_us']:>12.0f} us dev")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
