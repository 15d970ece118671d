"""Tensor parallelism on this CPU: per-rank weight bytes, step time at world size 1 and 2, bytes moved by
collectives per token (gpt2ffn.parallel over gloo). Not run by CI.

    flock -x /tmp/machine.lock env PYTHONPATH=src .venv/bin/python benchmarks/tp.py   # ~3 min on 2 cores

GPT-2 small with random weights (random:gpt2), fp32 on torch's ops (a sharded layer runs its shard through
torch; the packed native kernels of one process are listed as the floor of what one process does). Each
configuration is a fresh set of spawned processes; rounds interleave the configurations; medians over rounds
of each configuration's median step. First every sharded model is checked: logits within 1e-5 of one
process's (fp32 table). Collective bytes are counted by a dispatch mode over one step (the inputs of every
all-reduce / all-gather this rank issues).
"""

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PROMPT = 128       # prefill tokens; decode steps attend this many cached positions
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single")


class CountComm(TorchDispatchMode):
    """Bytes of the tensors this rank hands to functional collectives (what DTensor's redistribute issues)."""

    def __init__(self):
        super().__init__()
        self.bytes, self.calls = 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name.rstrip("_") in COLLECTIVES:
            t = args[0]
            self.bytes += t.numel() * t.element_size()
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(rank, world, threads, variant, store, queue, repeats):
    import torch.distributed as dist

    from gpt2ffn import parallel
    from gpt2ffn.model import load_model
    from gpt2ffn.serving.kv_cache import KVCache
    torch.set_num_threads(threads)
    precision = "fp32" if variant == "native" else None
    model = load_model("random:gpt2", precision=precision)
    ids = torch.randint(model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids, last_only=True)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        parallel.parallelize(model, vocab_parallel=variant == "vocab-parallel")
    out = {"world": world, "threads": threads, "variant": variant}
    with torch.no_grad():
        got = model(ids, last_only=True)
        out["max_abs_logits"] = float((got - expected).abs().max())
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), out
        cache = KVCache(model.kv_config, 1, max_len=PROMPT + 2 * repeats + 8)

        def decode():
            cache.length = PROMPT
            model(ids[:, :1], cache)

        model(ids, cache)                                                  # fill the cache once
        out["decode_ms"] = 1e3 * timed(decode, repeats)
        out["prefill_ms"] = 1e3 * timed(lambda: model(ids, last_only=True), max(3, repeats // 4))
        if world > 1:
            for name, fn, tokens in (("decode", decode, 1), ("prefill", lambda: model(ids, last_only=True), PROMPT)):
                with CountComm() as c:
                    fn()
                out[f"comm_bytes_per_token_{name}"] = c.bytes / tokens
                out[f"collectives_{name}"] = c.calls
    ffn = [m for b in model.transformer.h for m in (b.mlp.c_fc, b.mlp.c_proj)]
    attn = [m for b in model.transformer.h for m in (b.attn.c_attn, b.attn.c_proj)]
    out["bytes"] = {"all": parallel.local_bytes(model), "ffn": sum(map(parallel.local_bytes, ffn)),
                    "attn": sum(map(parallel.local_bytes, attn)),
                    "wte_lm_head": parallel.local_bytes(model.transformer.wte)}
    if rank == 0:
        queue.put(out)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run(world, threads, variant, repeats):
    ctx = mp.get_context("spawn")
    queue, store = ctx.Queue(), tempfile.mktemp(prefix="gpt2ffn-tp-bench-")
    procs = [ctx.Process(target=worker, args=(r, world, threads, variant, store, queue, repeats))
             for r in range(world)]
    for p in procs:
        p.start()
    out = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    if os.path.exists(store):
        os.unlink(store)
    return out


CONFIGS = [  # (world, threads per rank, variant)
    (1, 2, "native"),          # one process, gpt2ffn's packed native kernels: what one process does best
    (1, 2, "torch"),           # one process, torch's ops (what a sharded layer runs), both cores
    (1, 1, "torch"),           # one process, one core: the work one rank would do alone
    (2, 1, "vocab-parallel"),  # two ranks, one core each, wte / lm_head split by vocabulary
    (2, 1, "replicated"),      # two ranks, wte / lm_head whole on each
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20, help="decode steps timed per run (prefill: a quarter)")
    p.add_argument("--out", default="benchmarks/results/tp.json")
    args = p.parse_args()
    runs = {c: [] for c in CONFIGS}
    for r in range(args.rounds):
        for c in CONFIGS:
            runs[c].append(run(*c, args.repeats))
            print(r, c, {k: runs[c][-1][k] for k in ("decode_ms", "prefill_ms")}, flush=True)
    rows = []
    for outs in runs.values():
        row = dict(outs[0])
        row["decode_ms"] = statistics.median(o["decode_ms"] for o in outs)
        row["prefill_ms"] = statistics.median(o["prefill_ms"] for o in outs)
        row["decode_ms_runs"] = [o["decode_ms"] for o in outs]
        row["prefill_ms_runs"] = [o["prefill_ms"] for o in outs]
        rows.append(row)
    base = next(r for r in rows if r["variant"] == "torch" and r["threads"] == 2)
    for r in rows:
        r["decode_x_torch_1x2"] = r["decode_ms"] / base["decode_ms"]
        r["prefill_x_torch_1x2"] = r["prefill_ms"] / base["prefill_ms"]
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    result = {"cpu": f"{cpu}, {os.cpu_count()} cores", "torch": torch.__version__, "model": "random:gpt2 (124M)",
              "prompt": PROMPT, "rounds": args.rounds, "repeats": args.repeats, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"| world x threads | lm_head | weights per rank MB | FFN / attn MB | decode ms | prefill {PROMPT} ms | "
          "collective bytes / token (decode, prefill) |")
    for r in rows:
        b = r["bytes"]
        comm = (f"{r['comm_bytes_per_token_decode']:.0f}, {r['comm_bytes_per_token_prefill']:.0f}"
                if "comm_bytes_per_token_decode" in r else "0")
        print(f"| {r['world']} x {r['threads']} {r['variant']} | {b['all'] / 1e6:.1f} | {b['ffn'] / 1e6:.1f} / "
              f"{b['attn'] / 1e6:.1f} | {r['decode_ms']:.1f} | {r['prefill_ms']:.1f} | {comm} |")
    print(f"wrote {args.out} ({result['cpu']})")


if __name__ == "__main__":
    main()
