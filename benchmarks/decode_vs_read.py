"""How close a decode step comes to the machine's DRAM read rate, measured moments apart on a noisy host: samples
of (one pass of benchmarks/read_rate.cpp, a plain read of as many bytes as the packed weights with as many
threads; --tokens single-token greedy steps of one sequence, timed by themselves; the read again), each sample's
ratio of the step's packed-weight GB/s to its two reads' mean. A ratio near 1 means the step streams its weights
as fast as a plain read does: at equal bytes no engine can be much faster there. The host's bandwidth moves (36-86
GB/s seen on one Zen 5 VM, flipping within seconds): a sample whose two reads differ by more than 10% straddled
such a change and is left out of the median (kept in the file, marked).

    python benchmarks/decode_vs_read.py --model DIR --precision bf16 [--pairs 12] [--tokens 4] [--out FILE.json]
    PYTHONPATH=src /work/peers-build/venv/bin/python benchmarks/decode_vs_read.py --engine gpt2ffn llama \
        --model PREPARED --precision bf16     # and llama.cpp (llama-cpp-python) on PREPARED/gguf/gpt2-bf16.gguf,
                                              # the engines' samples alternating in one process
    python benchmarks/decode_vs_read.py --model DIR --precision bf16 --prefetch 0 4096
                                              # gpt2ffn at each decode prefetch distance (_C.set_prefetch), alternating

gpt2ffn's bytes are its packed weights; llama.cpp's the GGUF file's size (its tensors and a few MB of vocabulary).

read_rate.cpp is built with g++ (-march=native) into /tmp on first use. Not run by CI.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from gpt2ffn import _C
from gpt2ffn.bench import greedy_steps, machine
from gpt2ffn.generate import load
from gpt2ffn.serving.kv_cache import KVCache

ROOT = Path(__file__).resolve().parents[1]
READ = Path("/tmp/read_rate")
SOURCE = ROOT / "benchmarks" / "read_rate.cpp"
SETTLE = 0.05  # seconds before each read


def reader() -> Path:
    if not READ.exists() or READ.stat().st_mtime < SOURCE.stat().st_mtime:
        subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-o", str(READ),
                        str(SOURCE)], check=True)
    return READ


def gpt2ffn_engine(args, positions: int, model=None, prefetch=None):
    """(step(token) -> logits, the prompt's logits, bytes a step reads) for gpt2ffn; prefetch: its decode prefetch
    distance for this engine's samples (set before each step; None: as the probe chose)."""
    model = model or load(args.model, precision=args.precision, need_tokenizer=False)[0]
    packed = [m.packed for m in model.modules() if hasattr(m, "packed")]
    nbytes = sum(p.nbytes for p in packed)
    ids = torch.randint(0, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model.config, 1, model.kv_dtype, max_len=positions)

    def step(token):
        if prefetch is not None:
            for f in {p.format for p in packed}:
                _C.set_prefetch(f, prefetch)
        with torch.inference_mode():
            return model(torch.tensor([[token]]), cache, last_only=True)[0, -1]
    with torch.inference_mode():
        return step, model(ids, cache, last_only=True)[0, -1], nbytes


def llama_engine(args, positions: int):
    """The same for llama.cpp through the peers' harness (benchmarks/peers/engine.py: Llama)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    import engine
    engine.THREADS = args.threads  # the harness's (2), as gpt2ffn's and the reads'
    llm = engine.Llama(args.precision, args.model, positions)
    prompt = torch.randint(0, llm.n_vocab, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    return llm.step, llm.prefill(prompt), Path(llm.path).stat().st_size


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", nargs="+", default=["gpt2ffn"], choices=["gpt2ffn", "llama"],
                    help="two: their samples alternate, each bracketed by its own reads (one process: the peers' venv)")
    ap.add_argument("--prefetch", nargs="+", type=int, default=None, metavar="BYTES",
                    help="gpt2ffn as one engine per decode prefetch distance (one model), the first the baseline")
    ap.add_argument("--model", required=True, type=Path,
                    help="a prepare.py directory (hf/, gguf/) or, for gpt2ffn alone, an HF GPT-2 checkpoint")
    ap.add_argument("--llama-precision", default=None, help="llama.cpp's, when it differs (bf16 -> bf16)")
    ap.add_argument("--precision", default="bf16", help="gpt2ffn: fp32 bf16 int8 int4; llama: f32 bf16 q8_0 q4_0")
    ap.add_argument("--pairs", type=int, default=12, help="samples (read, decode steps, read)")
    ap.add_argument("--tokens", type=int, default=4, help="decode steps a sample")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    read = reader()
    positions = 128 + (args.pairs + 1) * args.tokens + 1
    engines = {}
    if args.prefetch:
        if args.engine != ["gpt2ffn"]:
            ap.error("--prefetch compares gpt2ffn with itself: give no --engine")
        hf = args.model / "hf" if (args.model / "hf").is_dir() else args.model
        model = load(hf, precision=args.precision, need_tokenizer=False)[0]
        args.engine = [f"pf {d}" for d in args.prefetch]
        for name, d in zip(args.engine, args.prefetch):
            engines[name] = gpt2ffn_engine(argparse.Namespace(**{**vars(args), "model": hf}), positions, model, d)
    for name in args.engine if not args.prefetch else []:
        if name == "llama":
            engines[name] = llama_engine(argparse.Namespace(**{**vars(args), "precision": args.llama_precision
                                                                 or args.precision}), positions)
        else:
            hf = args.model / "hf" if (args.model / "hf").is_dir() else args.model
            engines[name] = gpt2ffn_engine(argparse.Namespace(**{**vars(args), "model": hf}), positions)

    # one reader for the whole run, its buffer allocated once (a process a pass made the kernel map and free ~3 GB
    # around every sample, on the cores the decode runs on)
    most = max(nbytes for _, _, nbytes in engines.values())
    # (its OpenMP threads sleep at once after a pass: spinning, they took the cores of the decode right after it)
    reading = subprocess.Popen([str(read), str(most / 1e9), "-", str(args.threads)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_WAIT_POLICY": "passive"})

    def read_gb_s(nbytes) -> float:
        # first a pause: an engine's threads spin on for a few ms after a step (libgomp, ggml's pool) and took
        # the cores from a read right after it (0.9 GB of int4: 80 GB/s before a sample, 52 after, every sample)
        time.sleep(SETTLE)
        reading.stdin.write(f"{nbytes / 1e9}\n")
        reading.stdin.flush()
        return float(reading.stdout.readline().split()[0])

    samples = {name: [] for name in engines}
    for step, logits, _ in engines.values():
        greedy_steps(step, logits, args.tokens)  # warm-up
    for i in range(args.pairs):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]  # ABBA: none always goes first
        for name in order:
            step, logits, nbytes = engines[name]
            before = read_gb_s(nbytes)
            seconds = greedy_steps(step, logits, args.tokens) / args.tokens
            after = read_gb_s(nbytes)
            decode_gb_s, read_mean = nbytes / seconds / 1e9, (before + after) / 2
            kept = abs(before - after) <= 0.1 * max(before, after)
            samples[name].append({"decode_tok_s": 1 / seconds, "decode_gb_s": decode_gb_s, "read_before_gb_s": before,
                                  "read_after_gb_s": after, "ratio": decode_gb_s / read_mean, "kept": kept})
            print(f"sample {i + 1}/{args.pairs} {name:>7}: read {before:5.1f}, decode {1 / seconds:6.1f} tok/s = "
                  f"{decode_gb_s:5.1f} GB/s of weights, read {after:5.1f} GB/s: ratio "
                  f"{decode_gb_s / read_mean:.2f}{'' if kept else ' (left out: the reads differ)'}", flush=True)
    reading.stdin.close()
    reading.wait()
    out = {"machine": machine(), "model": str(args.model), "precision": args.precision,
           **({"llama_precision": args.llama_precision or args.precision} if "llama" in engines else {}),
           "threads": args.threads,
           "tokens_per_sample": args.tokens, "engines": {}}
    for name, (_, _, nbytes) in engines.items():
        kept = [p["ratio"] for p in samples[name] if p["kept"]]
        ratio = statistics.median(kept) if kept else float("nan")
        out["engines"][name] = {"step_gb": nbytes / 1e9, "median_ratio_kept": ratio, "samples": samples[name]}
        precision = args.llama_precision or args.precision if name == "llama" else args.precision
        print(f"{name} {args.model} {precision}: {nbytes / 1e9:.2f} GB a step; median ratio {ratio:.2f} "
              f"over the {len(kept)} of {args.pairs} samples kept ({machine()['cpu']}, {args.threads} threads)")
    names = list(engines)
    # sample i of one engine against sample i of another, a few seconds apart: gpt2ffn / llama, or each
    # prefetch distance / the first
    pairs = [(names[0], names[1])] if len(names) == 2 and not args.prefetch else [(b, names[0]) for b in names[1:]]
    for a, b in pairs:
        paired = [x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(samples[a], samples[b])]
        medians = (statistics.median(x["decode_tok_s"] for x in samples[a])
                   / statistics.median(y["decode_tok_s"] for y in samples[b]))
        entry = {"tok_s_ratios": paired, "median": statistics.median(paired), "of_medians": medians}
        if args.prefetch:
            out.setdefault("paired", {})[f"{a} / {b}"] = entry
        else:
            out["paired"] = entry
        print(f"{a} / {b} tok/s: median of the {len(paired)} sample pairs' ratios {statistics.median(paired):.2f}, "
              f"ratio of the medians {medians:.2f}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
