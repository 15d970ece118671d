"""Resident memory of a loaded gpt2ffn model, per precision: weights held once against both copies.

    PYTHONPATH=src python benchmarks/memory.py --model random:gpt2:0 --repeats 3 --out benchmarks/results/memory.json

Each case runs in its own process (2 threads): import torch and gpt2ffn, load the model with precision=None,
`quantize(model, precision, keep_fp32=...)`, then one forward (a 16-token prompt and 8 single-token steps
through a 64-position KV cache), and read VmRSS / VmHWM from /proc/self/status. The bare interpreter (the same
imports, no model) is its own case; a case's RSS delta is its RSS minus the bare one's (medians over
interleaved repeats). `model_bytes`: what the model holds by design, the packed weights (weights and scales:
what a decode step reads) plus the Parameters that still hold data (biases, LayerNorms, wpe) and the KV
cache; overhead = RSS delta - model_bytes. The tiny preset (random:tiny, ~0.1 MB of weights) measures the
fixed overhead of loading and running any model (the kernel probe, torch's thread pools, first-call buffers).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(2)
from gpt2ffn import quantize
from gpt2ffn.model import load_model
from gpt2ffn.serving.kv_cache import KVCache

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

spec, precision, keep = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
out = {"rss_start": status("VmRSS")}
if precision != "bare":
    t = time.perf_counter()
    model = quantize(load_model(spec, precision=None), precision, keep_fp32=keep)
    out["load_s"] = time.perf_counter() - t
    cache = KVCache(model.config, 1, max_len=64)
    with torch.inference_mode():
        ids = torch.arange(16)[None] % model.config.vocab_size
        nxt = model(ids, cache, last_only=True).argmax(-1)
        for _ in range(8):
            nxt = model(nxt, cache).argmax(-1)[:, -1:]
    layers = [m for m in model.modules() if hasattr(m, "pack")]
    packed = sum(m.packed.nbytes for m in layers)
    held = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()
               if p.untyped_storage().nbytes() >= p.numel() * p.element_size())
    kv = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    out.update(packed_bytes=packed, param_bytes=held, kv_bytes=kv, model_bytes=packed + held + kv,
               dropped=all(m.dropped for m in layers))
out.update(rss=status("VmRSS"), hwm=status("VmHWM"))
print(json.dumps(out))
"""

MB = 1e6


def run_case(python, spec, precision, keep):
    p = subprocess.run([python, "-c", CHILD, spec, precision, "1" if keep else "0"], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{spec} {precision} keep_fp32={keep}: {p.stderr.strip().splitlines()[-1]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2:0", help="a checkpoint directory or random:<preset>[:seed]")
    ap.add_argument("--precision", nargs="*", default=["fp32", "bf16", "int8", "int4"])
    ap.add_argument("--keep-fp32", action="store_true", help="also measure quantize(..., keep_fp32=True): both copies")
    ap.add_argument("--no-tiny", action="store_true", help="skip the fixed-overhead case (random:tiny)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cases = [("bare", "bare", False)]
    if not args.no_tiny:
        cases += [("random:tiny", p, False) for p in args.precision]
    cases += [(args.model, p, False) for p in args.precision]
    if args.keep_fp32:
        cases += [(args.model, p, True) for p in args.precision]
    runs = {c: [] for c in cases}
    t0 = time.time()
    for r in range(args.repeats):  # interleaved: each repeat runs every case once, in turn
        for c in cases:
            runs[c].append(run_case(args.python, *c))
            print(f"repeat {r + 1}/{args.repeats} {c[0]} {c[1]}{' keep_fp32' if c[2] else ''}: "
                  f"RSS {runs[c][-1]['rss'] / MB:.1f} MB", file=sys.stderr, flush=True)
    bare = statistics.median(x["rss"] for x in runs[cases[0]])
    rows = []
    for c in cases[1:]:
        xs = runs[c]
        med = {k: statistics.median(x[k] for x in xs) for k in ("rss", "hwm", "load_s")}
        last = xs[-1]
        delta = med["rss"] - bare
        rows.append({"model": c[0], "precision": c[1], "keep_fp32": c[2], "rss_delta_mb": delta / MB,
                     "peak_delta_mb": (med["hwm"] - bare) / MB, "packed_mb": last["packed_bytes"] / MB,
                     "other_params_mb": last["param_bytes"] / MB, "kv_mb": last["kv_bytes"] / MB,
                     "model_mb": last["model_bytes"] / MB, "overhead_mb": (delta - last["model_bytes"]) / MB,
                     "x_packed": delta / last["packed_bytes"], "load_s": med["load_s"],
                     "fp32_dropped": last["dropped"], "rss_delta_mb_repeats": [(x["rss"] - bare) / MB for x in xs]})
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    report = {"cpu": cpu, "threads": 2, "repeats": args.repeats, "bare_rss_mb": bare / MB,
              "wall_s": time.time() - t0, "results": rows}
    print(f"{cpu}, 2 threads; bare interpreter (torch + gpt2ffn imported) {bare / MB:.1f} MB; medians of "
          f"{args.repeats}\n")
    print("| model | precision | copies | RSS delta MB | packed MB | + other params, KV MB | overhead MB | "
          "x packed | peak delta MB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['precision']} | {'fp32 + packed' if r['keep_fp32'] else 'packed only'} | "
              f"{r['rss_delta_mb']:.1f} | {r['packed_mb']:.1f} | {r['other_params_mb'] + r['kv_mb']:.1f} | "
              f"{r['overhead_mb']:.1f} | {r['x_packed']:.2f} | {r['peak_delta_mb']:.1f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
