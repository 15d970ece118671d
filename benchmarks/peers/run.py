"""gpt2ffn against the real peers in one run: speed in interleaved rounds, the bandwidth floor, accuracy vs fp32.

    /work/peers-build/venv/bin/python benchmarks/peers/run.py --models /work/peers-build/models --rounds 9 \\
        --out benchmarks/results/peers.json

Speed: round r runs every (engine, precision) once, each in its own process (engine.py, 2 threads), in a
shuffled order, plus a DRAM read-bandwidth probe; the table shows medians across rounds of each process's
median. x floor = measured decode step time / (bytes one decode step must read / measured bandwidth).
Accuracy, as llama.cpp's perplexity --kl-divergence reports it: every engine's logits over the 1024 tokens
of DIR/seq.npy vs HF transformers fp32: mean KL(p_fp32 || p_x) in float64, top-1 agreement, max |logit diff|;
and its 64 greedy ids after the 128-token prompt vs HF fp32's (equal positions, first divergence).
"""

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MAIN_PYTHON = "/work/main/.venv/bin/python"  # gpt2ffn's own venv: engines gpt2ffn and hf
CASES = [("hf", "fp32"), ("gpt2ffn", "fp32"), ("gpt2ffn", "bf16"), ("gpt2ffn", "int8"), ("gpt2ffn", "int4"),
         ("ct2", "float32"), ("ct2", "int8"), ("ct2", "bfloat16"), ("ort", "fp32"), ("ort", "int8"),
         ("ort", "q8_0"), ("ort", "q4_0"),
         ("llama", "f32"), ("llama", "bf16"), ("llama", "q8_0"), ("llama", "q4_0")]
REFERENCE = ("hf", "fp32")
ISA_ENV = ("GPT2FFN_ISA", "CT2_FORCE_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")



def weight_counts(models: Path):
    """The weights one decode step reads, from DIR/hf/config.json (d = n_embd, L = n_layer): matrices, per layer
    c_attn (d, 3d), attn.c_proj (d, d), c_fc (d, 4d), mlp.c_proj (4d, d); lm_head = wte (vocab, d), tied;
    small = biases and LayerNorms (fp32 everywhere). The position embedding (one row per step) and the KV
    cache are not counted. GPT-2 124M: 84.9M, 38.6M, 0.1M."""
    cfg = json.loads((models / "hf/config.json").read_text())
    d, L, V = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
    return L * d * (3 * d + d + 4 * d + 4 * d), V * d, L * (3 * d + d + 4 * d + d + 4 * d) + 2 * d
# Bytes per weight of the matrices and lm_head. gpt2ffn int8 / int4: groups of 32 with an fp16 scale; int4
# keeps the tied lm_head int8 (LM_HEAD_BYTES). CTranslate2 int8: one fp32 scale per output row of 768 or 3072
# inputs (~768 taken); ONNX Runtime quantize_dynamic: QInt8, one scale per tensor; its MatMulNBits q8_0 /
# q4_0: one fp32 scale per block of 32. llama.cpp: exact, from the GGUF file.
BYTES_PER_WEIGHT = {("gpt2ffn", "fp32"): 4, ("gpt2ffn", "bf16"): 2, ("gpt2ffn", "int8"): 1 + 2 / 32,
                    ("gpt2ffn", "int4"): 0.5 + 2 / 32, ("hf", "fp32"): 4, ("ct2", "float32"): 4,
                    ("ct2", "bfloat16"): 2, ("ct2", "int8"): 1 + 4 / 768, ("ort", "fp32"): 4, ("ort", "int8"): 1,
                    ("ort", "q8_0"): 1 + 4 / 32, ("ort", "q4_0"): 0.5 + 4 / 32}

LM_HEAD_BYTES = {("gpt2ffn", "int4"): 1 + 2 / 32}

# run by --main-python (torch is there; a peer venv may have none)
BANDWIDTH = """
import time, torch
torch.set_num_threads(2)
x = torch.ones(2**28)  # 1 GiB float32
x.sum()
times = []
for _ in range(7):
    t = time.perf_counter(); x.sum(); times.append(time.perf_counter() - t)
times.sort()
print(x.numel() * 4 / times[3] / 1e9)
"""


def decode_bytes(engine, precision, models):
    if engine == "llama":
        from gguf import GGUFReader
        tensors = GGUFReader(models / f"gguf/gpt2-{precision}.gguf").tensors
        return sum(int(t.n_bytes) for t in tensors if t.name != "position_embd.weight")
    per = BYTES_PER_WEIGHT[(engine, precision)]
    matrix, lm_head, small = weight_counts(models)
    return matrix * per + lm_head * LM_HEAD_BYTES.get((engine, precision), per) + small * 4


def run_engine(engine, precision, args, *extra):
    python = args.main_python if engine in ("gpt2ffn", "hf") else sys.executable
    cmd = [python, str(HERE / "engine.py"), engine, precision, "--models", str(args.models),
           "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        return {"error": lines[-1] if lines else f"exit code {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def speed(args, cases, log):
    """Interleaved rounds: {case: [engine.py JSON per round]}, the bandwidth per round (GB/s), {case: last error}."""
    results = {c: [] for c in cases}
    bandwidth = []
    failed = {}
    for r in range(args.rounds):
        order = list(cases) + ["bandwidth"]
        random.Random(r).shuffle(order)
        for c in order:
            if c == "bandwidth":
                out = subprocess.run([args.main_python, "-c", BANDWIDTH], capture_output=True, text=True, check=True)
                bandwidth.append(float(out.stdout))
                log(f"round {r + 1}/{args.rounds}  bandwidth {bandwidth[-1]:.1f} GB/s")
                continue
            out = run_engine(*c, args, "--repeats", str(args.repeats))
            if "error" in out:  # kept, but tried again next round: gpt2ffn's tree may be mid-edit
                failed[c] = out["error"]
                log(f"round {r + 1}/{args.rounds}  {c[0]} {c[1]}: FAILED: {out['error']}")
                continue
            results[c].append(out)
            log(f"round {r + 1}/{args.rounds}  {c[0]} {c[1]}: prefill {out['prefill_ms']:.1f} ms, "
                f"decode {out['decode_tok_s']:.1f} tok/s")
    return results, bandwidth, failed


def accuracy(args, cases, log):
    """{case: metrics} vs the HF fp32 reference, each engine run once more with --logits-out."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def logits_of(c):
            r = run_engine(*c, args, "--repeats", "0", "--logits-out", str(tmp / "logits.npy"),
                           "--greedy-out", str(tmp / "greedy.json"))
            if "error" in r:
                return r, None, None
            logits = np.load(tmp / "logits.npy").astype(np.float64)  # (T, vocab)
            (tmp / "logits.npy").unlink()
            return r, logits, json.loads((tmp / "greedy.json").read_text())

        _, ref, ref_greedy = logits_of(REFERENCE)
        if ref is None:
            raise RuntimeError("the HF fp32 reference failed; no accuracy")
        ref_logp = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
        ref_p, ref_top = np.exp(ref_logp), ref.argmax(-1)
        for c in cases:
            r, logits, greedy = logits_of(c)
            if logits is None:
                out[c] = {"error": r["error"]}
                log(f"accuracy {c[0]} {c[1]}: FAILED: {r['error']}")
                continue
            logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
            kld = (ref_p * (ref_logp - logp)).sum(-1)  # (T,)
            equal = [a == b for a, b in zip(greedy, ref_greedy)]
            out[c] = {"positions": len(kld), "mean_kld": float(kld.mean()), "max_kld": float(kld.max()),
                      "top1_pct": float((logits.argmax(-1) == ref_top).mean() * 100),
                      "max_abs_dlogit": float(np.abs(logits - ref).max()),
                      "greedy_equal": sum(equal), "greedy_len": len(equal),
                      "greedy_first_divergence": equal.index(False) if False in equal else None,
                      "greedy_distinct": len(set(greedy))}
            log(f"accuracy {c[0]} {c[1]}: mean KLD {out[c]['mean_kld']:.3g}, top-1 {out[c]['top1_pct']:.2f} %")
            del logits, logp
    return out


def cpu_name(main_python=MAIN_PYTHON):
    """gpt2ffn.bench.cpu_info() through gpt2ffn's python: the model name with family/model and Zen generation
    ("AMD EPYC" alone names Zen 3, 4 and 5 alike) and the vector extensions; else the bare model name."""
    try:
        out = subprocess.run([main_python, "-c", "import json; from gpt2ffn.bench import cpu_info; "
                              "print(json.dumps(cpu_info()))"], capture_output=True, text=True, timeout=120)
        info = json.loads(out.stdout)
        return f"{info['cpu']}; {' '.join(info['isa'])}"
    except (OSError, ValueError, KeyError, subprocess.TimeoutExpired):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
        return platform.processor()


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=Path, default=Path("/work/peers-build/models"))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs inside each engine process")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--only", nargs="*", help="cases as ENGINE:PRECISION (default: all)")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--main-python", default=MAIN_PYTHON, help="python with gpt2ffn and transformers")
    ap.add_argument("--out", type=Path, default=HERE.parent / "results/peers.json")
    args = ap.parse_args()
    cases = [tuple(s.split(":")) for s in args.only] if args.only else CASES

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t0 = time.time()
    results, bandwidth, failed = speed(args, cases, log)
    acc = {} if args.no_accuracy else accuracy(args, cases, log)
    gbs = statistics.median(bandwidth)
    rows = []
    for c in cases:
        runs = results[c]
        row = {"engine": c[0], "precision": c[1], "rounds": len(runs)}
        if c in failed:
            row["error"] = failed[c]
        if runs:
            step_ms = 1e3 / statistics.median(r["decode_tok_s"] for r in runs)
            nbytes = decode_bytes(*c, args.models)
            floor_ms = nbytes / gbs / 1e6
            row.update(prefill_ms=statistics.median(r["prefill_ms"] for r in runs),
                       decode_tok_s=1e3 / step_ms, decode_bytes=nbytes,
                       rss_delta_mb=statistics.median(r["rss_delta_mb"] for r in runs),
                       rss_mb=statistics.median(r["rss_mb"] for r in runs), floor_ms=floor_ms,
                       floor_tok_s=1e3 / floor_ms, x_floor=step_ms / floor_ms, versions=runs[0]["versions"],
                       greedy_stable=all(r["greedy_stable"] for r in runs),
                       prefill_ms_rounds=[r["prefill_ms"] for r in runs],
                       decode_tok_s_rounds=[r["decode_tok_s"] for r in runs])
        row.update(acc.get(c, {}))
        rows.append(row)
    # the switches that hold an engine to a lower instruction set, where set (GPT2FFN_ISA=avx2, CTranslate2's own)
    held = {k: os.environ[k] for k in ISA_ENV if k in os.environ}
    report = {"machine": {"cpu": cpu_name(args.main_python), "threads": 2, "python": platform.python_version(),
                          "isa_env": held},
              "model": json.loads((args.models / "prepare.json").read_text())["model"]
              + " (gpt2ffn's random_weights_, saved with save_pretrained)",
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rounds": args.rounds,
              "repeats_per_process": args.repeats, "bandwidth_gb_s": gbs, "bandwidth_gb_s_rounds": bandwidth,
              "reference": "hf fp32", "wall_s": time.time() - t0, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"{report['machine']['cpu']}, 2 threads, {args.rounds} rounds, {args.prompt_tokens}-token prompt, "
          f"{args.new_tokens} greedy tokens; read bandwidth {gbs:.1f} GB/s\n")
    print("| engine | precision | prefill ms | decode tok/s | x floor | RSS delta MB | decode MB | mean KLD | "
          "top-1 % | max abs dlogit | greedy agree |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        greedy = (f"{r['greedy_equal']}/{r['greedy_len']}" + (f" (from {r['greedy_first_divergence']})"
                  if r["greedy_first_divergence"] is not None else "")) if "greedy_equal" in r else "-"
        print(f"| {r['engine']} | {r['precision']} | {fmt(r.get('prefill_ms'), '.1f')} | "
              f"{fmt(r.get('decode_tok_s'), '.1f')} | {fmt(r.get('x_floor'), '.2f')} | "
              f"{fmt(r.get('rss_delta_mb'), '.0f')} | "
              f"{fmt(r.get('decode_bytes') and r['decode_bytes'] / 1e6, '.0f')} | "
              f"{fmt(r.get('mean_kld'), '.2e')} | {fmt(r.get('top1_pct'), '.2f')} | "
              f"{fmt(r.get('max_abs_dlogit'), '.3g')} | {greedy} |")
    for r in rows:
        if "error" in r:
            print(f"\n{r['engine']} {r['precision']} failed ({r['rounds']} of {args.rounds} rounds ran): {r['error']}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
