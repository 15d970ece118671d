"""What `gpt2ffn serve` costs per streamed token, beside the same engine in process: many streaming clients on a
model small enough that the model costs little, so what is measured is the server's own work.

For each server (this tree, or others given by --src for an A/B, interleaved round by round) and each round:
start `gpt2ffn serve --max-batch N`, warm it up with N short requests (so every slot of its KV cache has been
written once: the first write of a slot faults its pages in, on the CPU), send N concurrent streamed completions
(token-id prompts, temperature 0, ignore_eos, usage at the end) from a raw-socket client that only counts bytes
and events (so the client, on the same cores, costs little), and read the server's threads' CPU time from /proc
before and after. Then the same N requests through the engine in process (Engine.step until done, no HTTP; an
engine made as the server makes it, but without the server's Prometheus metrics, whose cost counts as the
server's), for the ratio issue 18 targets (serve at 256 streaming clients >= 0.7 of the in-process rate).

Reported per server: completion tokens/s through HTTP and in process, their ratio, SSE events per token, and
CPU microseconds per token of the event loop's thread (HTTP, JSON, the per-request plumbing) and of the engine's
thread (the steps, sampling, detokenizing, handing tokens over), medians over rounds.

With --tokenizer DIR, also the detokenizer's (TextStream's) microseconds per token at 64, 256 and 1024 tokens.

    python benchmarks/serve_overhead.py [--model random:tiny] [--clients 256] [--max-tokens 64] [--rounds 3] \\
        [--src before=/path/to/old/src] [--serve 'LABEL=SERVE FLAGS' ...] [--tokenizer DIR] [--stream-interval N] \\
        [--out benchmarks/results/serve-overhead.json]
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from load_test import free_port, start, stop  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def child_env(src: str) -> dict:
    """The environment of a child process that imports gpt2ffn from src, keeping what PYTHONPATH already holds (the
    GPU machine's wheels: ../shared/gpu/wheels.sh)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))


def thread_cpu(pid: int) -> dict:
    """CPU seconds (user + system) of pid's threads and its child processes' (serve --engine-process on, --api-servers
    N): "loop" (each API process's main thread, uvicorn's event loop), "engine" (the first thread named
    gpt2ffn-engine), "engine's workers" (threads it started, which inherit its name: torch's OpenMP pool, and the
    engine process's other threads), "other" (the API processes' other threads)."""
    out = {"loop": 0.0, "engine": 0.0, "engine's workers": 0.0, "other": 0.0}
    engine_seen = False
    children = []
    for pids in Path(f"/proc/{pid}/task").glob("*/children"):
        children += [int(c) for c in pids.read_text().split()]
    for proc in [pid, *children]:
        try:  # a child that ended meanwhile (not one of the server's processes) has nothing to count
            tasks = sorted(Path(f"/proc/{proc}/task").iterdir(), key=lambda t: int(t.name))
            cmdline = Path(f"/proc/{proc}/cmdline").read_bytes()
        except OSError:
            continue
        for task in tasks:
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            if task.name == str(proc) and (proc == pid or b"gpt2ffn.serving.http" in cmdline):
                kind = "loop"  # an API process's event loop (serve --api-servers N starts N - 1 more)
            elif name == "gpt2ffn-engine":
                kind, engine_seen = ("engine's workers", True) if engine_seen else ("engine", True)
            else:
                kind = "engine's workers" if b"gpt2ffn.serving.core" in cmdline else "other"
            out[kind] += (int(fields[11]) + int(fields[12])) / TICK
    return out


def resident_mb(pid: int) -> dict:
    """Resident memory (VmRSS, MB) of the server's processes after the run: {"server": its first process, "engine
    process": ..., "API processes": the others together}."""
    out = {}
    children = [int(c) for pids in Path(f"/proc/{pid}/task").glob("*/children") for c in pids.read_text().split()]
    for proc in [pid, *children]:
        try:
            cmdline = Path(f"/proc/{proc}/cmdline").read_bytes()
            kb = next(int(line.split()[1]) for line in Path(f"/proc/{proc}/status").read_text().splitlines()
                      if line.startswith("VmRSS"))
        except (OSError, StopIteration):
            continue
        kind = ("server" if proc == pid else "engine process" if b"gpt2ffn.serving.core" in cmdline else
                "API processes" if b"gpt2ffn.serving.http" in cmdline else None)
        if kind:
            out[kind] = out.get(kind, 0) + kb // 1024
    return out


async def stream(port: int, prompt: list, max_tokens: int, model: str) -> tuple:
    """One streamed completion over a fresh connection: (completion tokens, events with text, bytes)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    data = await reader.read(-1)
    writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head[:200])
    events = rest.count(b'"text": "') - rest.count(b'"text": ""')
    usage = rest[rest.rindex(b'"completion_tokens":') + 20:]
    return int(usage[:usage.index(b",")]), events, len(rest)


def prompts(n: int, vocab: int) -> list:
    return [[(7 * i + j) % vocab for j in range(16)] for i in range(n)]


def through_http(src: str, args, vocab: int, flags=()) -> dict:
    port = free_port()
    env = child_env(src)
    cmd = [sys.executable, "-m", "gpt2ffn.cli", "serve", "--model", args.model, "--port", str(port),
           "--max-batch", str(args.clients), "--max-waiting", str(args.clients), "--threads", str(args.threads),
           "--device", args.device, "--stream-interval", str(args.stream_interval)]
    cmd += list(flags)
    proc, _ = start(cmd, port, env=env)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as r:
            model = json.load(r)["data"][0]["id"]
        asyncio.run(_all(port, prompts(args.clients, vocab), 4, model))  # warm-up: every slot of the cache used once
        before = thread_cpu(proc.pid)
        t0 = time.perf_counter()
        done = asyncio.run(_all(port, prompts(args.clients, vocab), args.max_tokens, model))
        wall = time.perf_counter() - t0
        after = thread_cpu(proc.pid)
        rss = resident_mb(proc.pid)
    finally:
        stop(proc)
    tokens = sum(t for t, _, _ in done)
    us = {k: 1e6 * (after[k] - before[k]) / tokens for k in after}
    return {"tokens": tokens, "tokens_per_s": tokens / wall, "events_per_token": sum(e for _, e, _ in done) / tokens,
            "loop_us_per_token": us["loop"], "engine_us_per_token": us["engine"],
            "workers_us_per_token": us["engine's workers"], "other_threads_us_per_token": us["other"],
            "resident_mb": rss}


async def _all(port, ps, max_tokens, model):
    return await asyncio.gather(*(stream(port, p, max_tokens, model) for p in ps))


def in_process(src: str, args) -> dict:
    """The same requests through Engine.step in a child process of that tree: tokens/s."""
    code = f"""
import json, sys, time, torch
torch.set_num_threads({args.threads})
from gpt2ffn.loading import load
from gpt2ffn.serving.engine import Engine, Request
from gpt2ffn.serving.sampling import Sampling
model, tok, _ = load({args.model!r}, None, "fp32", {args.device!r})
ps = {prompts(args.clients, 10 ** 9)!r}
V = model.config.vocab_size
ps = [[t % V for t in p] for p in ps]
eng = Engine(model, tok.decode, max_batch=len(ps), max_waiting=len(ps))  # as the server makes it
def run(n):
    eng.add(*[Request(p, Sampling(max_new_tokens=n, ignore_eos=True)) for p in ps])
    t0, tokens = time.perf_counter(), 0
    while eng.has_work():
        tokens += sum(ev.id >= 0 for ev in eng.step())
    return tokens, time.perf_counter() - t0
run(4)
tokens, wall = run({args.max_tokens})
print(json.dumps({{"tokens": tokens, "tokens_per_s": tokens / wall}}))
"""
    out = subprocess.run([sys.executable, "-c", code], env=child_env(src), capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def detokenize(src: str, tokenizer: str) -> dict:
    """TextStream's cost per token in that tree, generating README.md's first 64 / 256 / 1024 tokens (best of 3),
    with the tokenizer in `tokenizer` (a directory: tokenizer.json or vocab.json + merges.txt): {tokens: us}."""
    code = f"""
import json, time
from gpt2ffn.tokenizer import load_tokenizer
from gpt2ffn.serving.text import TextStream
tok = load_tokenizer({tokenizer!r})
ids = tok.encode(open({str(HERE.parent / "README.md")!r}).read())[:1024]
out = {{}}
for n in (64, 256, 1024):
    best = 1e9
    for _ in range(3):
        ts = TextStream(tok.decode, ["\\n\\n\\n"])
        t0 = time.perf_counter()
        text = "".join(ts.push(t)[0] for t in ids[:n]) + ts.finish()
        best = min(best, (time.perf_counter() - t0) / n)
        assert text == tok.decode(ids[:n]).split("\\n\\n\\n")[0]
    out[n] = 1e6 * best
print(json.dumps(out))
"""
    out = subprocess.run([sys.executable, "-c", code], env=child_env(src), capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stream-interval", type=int, default=1, help="serve's --stream-interval (tokens a chunk)")
    p.add_argument("--src", action="append", default=[], help="label=path of another tree's src (A/B)")
    p.add_argument("--serve", action="append", default=[], metavar="LABEL=FLAGS", help="this tree's server with "
                   "more serve flags, a server of its own in the A/B (repeatable), e.g. 'one process=--engine-process "
                   "off' 'two API processes=--api-servers 2'")
    p.add_argument("--tokenizer", help="a tokenizer directory: also time TextStream per token (GPT-2's own files)")
    p.add_argument("--out", default="benchmarks/results/serve-overhead.json")
    args = p.parse_args()
    sys.path.insert(0, str(HERE.parent / "src"))
    from gpt2ffn.bench import cpu_info
    from gpt2ffn.config import Config
    vocab = Config.from_name(args.model.split(":")[1]).vocab_size if args.model.startswith("random:") else 50257
    here = str(HERE.parent / "src")
    servers = ({label: (here, flags.split()) for label, flags in (s.split("=", 1) for s in args.serve)}
               or {"this tree": (here, ())})
    servers.update({name: (src, ()) for name, src in (s.split("=", 1) for s in args.src)})
    trees = {name: src for name, (src, _) in servers.items()}
    runs = {name: [] for name in servers}
    for r in range(args.rounds):
        for name, (src, flags) in servers.items():
            point = {**through_http(src, args, vocab, flags), "in_process": in_process(src, args)}
            point["ratio"] = point["tokens_per_s"] / point["in_process"]["tokens_per_s"]
            runs[name].append(point)
            print(f"round {r} {name:12s} http {point['tokens_per_s']:9.0f} tok/s  in process "
                  f"{point['in_process']['tokens_per_s']:9.0f}  ratio {point['ratio']:.2f}  events/token "
                  f"{point['events_per_token']:.2f}  loop {point['loop_us_per_token']:.1f} us/token  engine "
                  f"{point['engine_us_per_token']:.1f}  its workers {point['workers_us_per_token']:.1f}  resident MB "
                  f"{point['resident_mb']}", flush=True)
    med = {name: {k: statistics.median(pt[k] for pt in pts) for k in
                  ("tokens_per_s", "ratio", "events_per_token", "loop_us_per_token", "engine_us_per_token",
                   "workers_us_per_token", "other_threads_us_per_token")}
           | {"in_process_tokens_per_s": statistics.median(pt["in_process"]["tokens_per_s"] for pt in pts)}
           for name, pts in runs.items()}
    detok = {name: detokenize(src, args.tokenizer) for name, src in trees.items()} if args.tokenizer else None
    for name, us in (detok or {}).items():
        print(f"{name:12s} TextStream us/token at 64 / 256 / 1024 tokens: "
              + " / ".join(f"{v:.2f}" for v in us.values()))
    result = {"machine": cpu_info()["cpu"], "detokenize_us_per_token": detok, "model": args.model,
              "device": args.device, "clients": args.clients,
              "max_tokens": args.max_tokens, "threads": args.threads, "rounds": args.rounds,
              "stream_interval": args.stream_interval, "median": med,
              "runs": runs}
    for name, m in med.items():
        print(f"{name:12s} " + "  ".join(f"{k} {v:.2f}" for k, v in m.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
