"""How close a decode step comes to the machine's DRAM read rate, measured moments apart on a noisy host: samples
of (one pass of benchmarks/read_rate.cpp, a plain read of as many bytes as the packed weights with as many
threads; --tokens single-token greedy steps of one sequence, timed by themselves; the read again), each sample's
ratio of the step's packed-weight GB/s to its two reads' mean. A ratio near 1 means the step streams its weights
as fast as a plain read does: at equal bytes no engine can be much faster there. The host's bandwidth moves (36-86
GB/s seen on one Zen 5 VM, flipping within seconds): a sample whose two reads differ by more than 10% straddled
such a change and is left out of the median (kept in the file, marked).

    python benchmarks/decode_vs_read.py --model DIR --precision bf16 [--pairs 12] [--tokens 4] [--out FILE.json]

read_rate.cpp is built with g++ (-march=native) into /tmp on first use. Not run by CI.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from gpt2ffn.bench import greedy_steps, machine
from gpt2ffn.generate import load
from gpt2ffn.serving.kv_cache import KVCache

ROOT = Path(__file__).resolve().parents[1]
READ = Path("/tmp/read_rate")
SOURCE = ROOT / "benchmarks" / "read_rate.cpp"


def reader() -> Path:
    if not READ.exists() or READ.stat().st_mtime < SOURCE.stat().st_mtime:
        subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-o", str(READ),
                        str(SOURCE)], check=True)
    return READ


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an HF GPT-2 checkpoint directory (no tokenizer needed)")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "int8", "int4"])
    ap.add_argument("--pairs", type=int, default=12, help="samples (read, decode steps, read)")
    ap.add_argument("--tokens", type=int, default=4, help="decode steps a sample")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    read = reader()
    model, _, _ = load(args.model, precision=args.precision, need_tokenizer=False)
    nbytes = sum(m.packed.nbytes for m in model.modules() if hasattr(m, "packed"))
    ids = torch.randint(0, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model.config, 1, model.kv_dtype, max_len=128 + args.pairs * args.tokens + 1)

    def step(token):
        return model(torch.tensor([[token]]), cache, last_only=True)[0, -1]

    def read_gb_s() -> float:
        out = subprocess.run([str(read), str(nbytes / 1e9), "1", str(args.threads)], capture_output=True, text=True,
                             check=True)
        return float(out.stdout.split()[0])

    pairs = []
    with torch.inference_mode():
        logits = model(ids, cache, last_only=True)[0, -1]
        greedy_steps(step, logits, 1)  # warm-up
        for i in range(args.pairs):
            before = read_gb_s()
            seconds = greedy_steps(step, logits, args.tokens) / args.tokens
            after = read_gb_s()
            decode_gb_s, read_mean = nbytes / seconds / 1e9, (before + after) / 2
            kept = abs(before - after) <= 0.1 * max(before, after)
            pairs.append({"decode_tok_s": 1 / seconds, "decode_gb_s": decode_gb_s, "read_before_gb_s": before,
                          "read_after_gb_s": after, "ratio": decode_gb_s / read_mean, "kept": kept})
            print(f"sample {i + 1}/{args.pairs}: read {before:5.1f}, decode {1 / seconds:6.1f} tok/s = "
                  f"{decode_gb_s:5.1f} GB/s of packed weights, read {after:5.1f} GB/s: ratio "
                  f"{decode_gb_s / read_mean:.2f}{'' if kept else ' (left out: the reads differ)'}", flush=True)
    kept = [p["ratio"] for p in pairs if p["kept"]]
    ratio = statistics.median(kept) if kept else float("nan")
    print(f"{args.model} {args.precision}: {nbytes / 1e9:.2f} GB packed; median ratio {ratio:.2f} over the "
          f"{len(kept)} of {args.pairs} samples kept ({machine()['cpu']}, {args.threads} threads)")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine(), "model": args.model, "precision": args.precision,
                                        "packed_gb": nbytes / 1e9, "threads": args.threads,
                                        "tokens_per_sample": args.tokens, "median_ratio_kept": ratio, "samples": pairs},
                                       indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
