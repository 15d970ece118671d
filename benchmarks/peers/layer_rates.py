"""Prefill's linear layers, ours against ONNX Runtime's, layer by layer: products per second of each GPT-2 layer
kind at T prompt tokens. ONNX Runtime's come from its own profiler over the int8 model run.py times (optimum's
export, `quantize_dynamic`: DynamicQuantizeMatMul nodes, activations quantized per tensor inside each node),
ours from the same layer of gpt2ffn's model through `kernels.packed.linear` (int8 weights and activations,
activations quantized per group inside the call), each at 2 threads and at 1, in interleaved rounds, medians.

    PYTHONPATH=src /work/peers-build/venv/bin/python benchmarks/peers/layer_rates.py \\
        --models /work/peers-build/models-gpt2-medium [--tokens 128] [--rounds 5] [--out FILE]

The ONNX model computes the lm_head for every prompt row (run.py's prefill asks for the last row's logits; ours
computes that row only): its row is listed, and the whole-run time beside the layers' sum. Not run by CI.
"""

import argparse
import collections
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from gpt2ffn.bench import machine
from gpt2ffn.generate import load
from gpt2ffn.kernels.packed import linear

KINDS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def ort_round(models: Path, T: int, threads: int, runs: int) -> dict:
    """ONNX Runtime's kernel ms per node of each (K, N) over `runs` profiled runs (after 2 unprofiled), and
    the median whole run."""
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "ort")
    s = ort.InferenceSession(str(models / "onnx-int8/model.onnx"), so, providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(0, 50257, (1, T))
    feed = {"input_ids": ids, "attention_mask": np.ones((1, T), np.int64)}
    for i in s.get_inputs():
        if i.name == "position_ids":
            feed[i.name] = np.arange(T, dtype=np.int64)[None]
        elif i.name.startswith("past_key_values."):
            feed[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
    for _ in range(2 + runs):
        s.run(None, feed)
    path = s.end_profiling()
    events = json.loads(Path(path).read_text())
    Path(path).unlink()
    starts = [e["ts"] for e in events if e.get("name") == "model_run"]
    whole = [e["dur"] / 1e3 for e in events if e.get("name") == "model_run"][2:]
    nodes = collections.defaultdict(list)  # (op, K, N) -> kernel ms per node
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time") or e["ts"] < starts[2]:
            continue
        a = e["args"]
        if a["op_name"] not in ("DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulInteger"):
            continue
        K = [v for d in a["input_type_shape"][:1] for v in d.values()][0][-1]
        N = [v for d in a["output_type_shape"] for v in d.values()][0][-1]
        nodes[(a["op_name"], K, N)].append(e["dur"] / 1e3)
    return {"whole_ms": statistics.median(whole),
            "nodes": {f"{op} {K}x{N}": statistics.median(v) for (op, K, N), v in nodes.items()}}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, required=True, help="run.py's models directory (hf/, onnx-int8/)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    T = args.tokens
    model, _, _ = load(str(args.models / "hf"), precision="int8", need_tokenizer=False)
    blk = model.transformer.h[0]
    mods = {"attn.c_attn": blk.attn.c_attn, "attn.c_proj": blk.attn.c_proj, "mlp.c_fc": blk.mlp.c_fc,
            "mlp.c_proj": blk.mlp.c_proj}
    xs = {k: torch.randn(T, m.packed.K, generator=torch.Generator().manual_seed(0)) for k, m in mods.items()}
    ours = collections.defaultdict(list)
    theirs = collections.defaultdict(list)
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for threads in (2, 1):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                for k, m in mods.items():
                    linear(xs[k], m.packed, m.weight, m.bias, "native")
                    ts = []
                    for _ in range(5):
                        t = time.perf_counter()
                        linear(xs[k], m.packed, m.weight, m.bias, "native")
                        ts.append((time.perf_counter() - t) * 1e3)
                    ours[(threads, k)].append(statistics.median(ts))
            theirs[threads].append(ort_round(args.models, T, threads, 3))
        print(f"round {r + 1}/{args.rounds} ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = []
    for threads in (2, 1):
        whole = statistics.median(x["whole_ms"] for x in theirs[threads])
        names = sorted({n for x in theirs[threads] for n in x["nodes"]})
        node_ms = {n: statistics.median(x["nodes"][n] for x in theirs[threads] if n in x["nodes"]) for n in names}
        for k, m in mods.items():
            K, N = m.packed.K, m.packed.N
            ms = statistics.median(ours[(threads, k)])
            match = [n for n in names if n.endswith(f" {K}x{N}")]
            o = node_ms[match[0]] if match else None
            rows.append({"threads": threads, "layer": k, "K": K, "N": N, "gpt2ffn_ms": ms,
                         "gpt2ffn_gps": T * K * N / ms / 1e6, "ort_node": match[0] if match else None,
                         "ort_ms": o, "ort_gps": T * K * N / o / 1e6 if o else None})
        head = [n for n in names if n.endswith(f"x{model.config.vocab_size}")]
        if head:
            K = int(head[0].split()[-1].split("x")[0])
            o = node_ms[head[0]]
            rows.append({"threads": threads, "layer": "lm_head (every row)", "K": K, "N": model.config.vocab_size,
                         "gpt2ffn_ms": None, "gpt2ffn_gps": None, "ort_node": head[0], "ort_ms": o,
                         "ort_gps": T * K * model.config.vocab_size / o / 1e6})
        rows.append({"threads": threads, "layer": "ONNX Runtime whole run", "ort_ms": whole})
    print(f"{machine()['cpu']} {machine()['isa']}, {T} tokens, {args.rounds} rounds")
    print("| threads | layer | K x N | gpt2ffn ms | gpt2ffn G/s | ONNX Runtime ms | ONNX Runtime G/s |")
    print("|---:|---|---|---:|---:|---:|---:|")
    f = lambda v, s: "" if v is None else format(v, s)  # noqa: E731
    for x in rows:
        kn = f"{x['K']} x {x['N']}" if "K" in x else ""
        print(f"| {x['threads']} | {x['layer']} | {kn} | {f(x.get('gpt2ffn_ms'), '.2f')} | "
              f"{f(x.get('gpt2ffn_gps'), '.1f')} | {f(x.get('ort_ms'), '.2f')} | {f(x.get('ort_gps'), '.1f')} |")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine(), "tokens": T, "rounds": args.rounds, "rows": rows,
                                        "ours_rounds": {f"{t} {k}": v for (t, k), v in ours.items()},
                                        "ort_rounds": {str(t): v for t, v in theirs.items()},
                                        "ort_version": ort.__version__}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
