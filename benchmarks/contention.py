"""A machine shared with another busy process: prefill and decode alone and beside one, per OpenMP wait setting.

    python benchmarks/contention.py --model DIR --precision int8 [--rounds 2] [--out FILE]
        [--setting "libgomp default=" --setting "spin 6000=GOMP_SPINCOUNT=6000"
         --setting passive=OMP_WAIT_POLICY=passive]

gpt2ffn's kernels run in libgomp's thread team (torch's), whose threads spin at a barrier and between parallel
regions before they sleep (GOMP_SPINCOUNT iterations: 300,000 unless set). On 2 cores beside one busy process, a
thread that spins waits for a partner the scheduler has set aside, for up to its whole time slice. libgomp reads
these variables when torch is imported, so each setting runs in a process of its own (LABEL=VAR=VALUE,...: the
label has no '='; `LABEL=` sets none), the settings interleaved round by round. Each process imports torch before
gpt2ffn, so gpt2ffn's own GOMP_SPINCOUNT (6000, set on import when torch is not loaded yet) is not in the way.
Each process times a prefill of --tokens tokens (median of 5) and --new-tokens single-token greedy steps after it
(the steps alone, median of 3), first alone, then beside a Python busy loop.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ONE = """
import json, statistics, subprocess, sys, time
import torch
torch.set_num_threads({threads})
from gpt2ffn.bench import decode_seconds
from gpt2ffn.generate import load
from gpt2ffn.serving.kv_cache import KVCache
model, _, _ = load({model!r}, precision={precision!r}, need_tokenizer=False)
ids = torch.randint(0, model.config.vocab_size, (1, {tokens}), generator=torch.Generator().manual_seed(0))
def prefill():
    with torch.inference_mode():
        model(ids, cache=KVCache(model.config, 1, model.kv_dtype, max_len={tokens} + 1), last_only=True)
def decode():  # seconds of the steps alone (generate's time less prefill's came out <= 0 on a fast CPU)
    with torch.inference_mode():
        return decode_seconds(model, ids, {new})
def ms(f, n, timed=False):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); t = f(); ts.append((t if timed else time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)
prefill(); decode()
out = {{}}
for where in ("alone", "beside a busy process"):
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if where != "alone" else None
    time.sleep(0.3)
    try:
        p, g = ms(prefill, 5), ms(decode, 3, timed=True)
    finally:
        if hog is not None:
            hog.kill()
    out[where] = {{"prefill_ms": p, "decode_tokens_per_s": {new} / g * 1e3}}
print(json.dumps(out))
"""


def setting(text: str) -> tuple:
    label, _, env = text.partition("=")
    return label, dict(kv.split("=", 1) for kv in env.split(",") if kv)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an HF GPT-2 checkpoint directory or random:<preset>")
    p.add_argument("--precision", default="int8", choices=["fp32", "bf16", "int8", "int4"])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--setting", action="append", type=setting,
                   help="LABEL=VAR=VALUE[,VAR=VALUE]: one process's OpenMP variables (LABEL=: none)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    settings = args.setting or [setting(s) for s in ("libgomp default=", "spin 6000=GOMP_SPINCOUNT=6000",
                                                     "passive=OMP_WAIT_POLICY=passive")]
    code = ONE.format(threads=args.threads, model=args.model, precision=args.precision, tokens=args.tokens,
                      new=args.new_tokens)
    runs = {label: [] for label, _ in settings}
    for r in range(args.rounds):
        for label, pairs in settings:
            env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
            out = subprocess.run([sys.executable, "-c", code], env={**env, **pairs}, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{label}: {out.stderr.strip().splitlines()[-1]}")
            runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {label}: {runs[label][-1]}", flush=True)
    from gpt2ffn.bench import machine
    result = {"machine": machine(), "model": args.model, "precision": args.precision, "tokens": args.tokens,
              "new_tokens": args.new_tokens, "threads": args.threads, "rounds": args.rounds,
              "settings": {label: pairs for label, pairs in settings}, "runs": runs, "medians": {}}
    print(f"{args.model} {args.precision}, {args.threads} threads, {args.tokens}-token prefill ms / decode tok/s "
          f"(medians of {args.rounds} rounds)")
    for label, points in runs.items():
        med = {where: {k: statistics.median(p[where][k] for p in points) for k in points[0][where]}
               for where in points[0]}
        result["medians"][label] = med
        alone, busy = med["alone"], med["beside a busy process"]
        print(f"  {label:<24} alone {alone['prefill_ms']:7.1f} / {alone['decode_tokens_per_s']:6.1f}   beside a busy "
              f"process {busy['prefill_ms']:7.1f} / {busy['decode_tokens_per_s']:6.1f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
