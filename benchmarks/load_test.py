"""Load test: `gpt2ffn serve` and llama.cpp's `llama-server` on the same weights, same load, same run.

For each server and each client count, N concurrent clients send streamed completions (the same prompts,
temperature 0, `ignore_eos` so every request makes exactly max_tokens tokens, `cache_prompt: false` so
llama-server redoes each prompt as gpt2ffn does) until M requests are done. Reported per point: completion
tokens/s, requests/s, time to first token and latency p50/p99, errors and status codes, and how many answers
differ from the same prompt's answer with nothing else running (measured first, one request at a time). The
servers run one after the other (never together) and are started here on loopback, or given by --url.

    python benchmarks/load_test.py --hf-dir DIR --llama-server /path/llama-server --gguf DIR/gpt2-f32.gguf \\
        --clients 1,8,32,64 --requests-per-client 4 --max-tokens 32
    python benchmarks/load_test.py --hf-dir random:gpt2 --clients 1,8 --requests-per-client 1   # gpt2ffn only
"""

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

VARIANTS = 16  # distinct prompts: each answer under load is checked against the same prompt's answer alone
# ~22 GPT-2 tokens
PROMPT = "Request {i}: the quick brown fox jumps over the lazy dog, and then it runs into the forest where"


# A connection per request: llama-server closes idle keep-alive connections, and a client reusing one gets
# "Server disconnected"; both servers get the same treatment.
FRESH = httpx.Limits(max_keepalive_connections=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list, port: int, health="/health", timeout=300, env=None):
    """Start a server process (in `env`, else this one's environment) and wait until it answers 200 on its health
    endpoint. Its output goes to a file: a pipe nobody reads fills up and stalls a server that logs every request
    (llama-server)."""
    import tempfile
    log = tempfile.NamedTemporaryFile("w+", prefix=Path(cmd[0]).name + "-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url + health, timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited before it was ready: {Path(log.name).read_text()[-2000:]}")
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"{cmd[0]} did not become ready in {timeout} s")


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def gpt2ffn_cmd(args, port):
    cmd = [sys.executable, "-m", "gpt2ffn.cli", "serve", "--model", args.hf_dir, "--port", str(port),
           "--threads", str(args.threads), "--device", args.device]
    if args.device == "cpu":
        cmd += ["--precision", args.precision]
    else:  # CUDA: the dtype (serve's default there bfloat16)
        cmd += ["--dtype", {"fp32": "float32", "bf16": "bfloat16"}[args.precision]]
    if args.max_batch:
        cmd += ["--max-batch", str(args.max_batch)]
    if args.engine_process:
        cmd += ["--engine-process", args.engine_process]
    return cmd + (["--batch-invariant"] if args.batch_invariant else [])


def llama_cmd(args, port):
    return [args.llama_server, "-m", args.gguf, "--port", str(port), "-np", str(args.parallel), "-c",
            str(args.ctx), "-t", str(args.threads), "--no-webui"]


async def one(http, url, model, i, max_tokens):
    """One streamed completion: (status, ttft_s, latency_s, completion tokens, text or error text)."""
    body = {"model": model, "prompt": PROMPT.format(i=i % VARIANTS), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "cache_prompt": False}
    t0 = time.perf_counter()
    ttft, tokens, chunks, text = None, None, 0, ""
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, None, None, 0, (await r.aread()).decode()[:200]
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                tokens = d["usage"]["completion_tokens"]
            elif d.get("timings", {}).get("predicted_n"):  # llama-server without usage in the stream
                tokens = d["timings"]["predicted_n"]
            delta = "".join(c.get("text") or "" for c in d.get("choices") or [])
            if delta:
                chunks += 1
                text += delta
                ttft = ttft or time.perf_counter() - t0
    return 200, ttft, time.perf_counter() - t0, tokens if tokens is not None else chunks, text


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


async def alone(url, max_tokens, timeout):
    """Each prompt variant's answer with nothing else running (temperature 0): the reference under load."""
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    async with httpx.AsyncClient(timeout=timeout, limits=FRESH) as http:
        return [(await one(http, url, model, i, max_tokens))[4] for i in range(VARIANTS)]


async def drive(url, clients, requests, max_tokens, timeout, reference, start_at=None):
    """`clients` concurrent clients send `requests` streamed completions in all (from start_at, a time.time(),
    if given) -> (per done request (ttft, latency, tokens), status codes, error texts, answers that differ from
    alone, start, end)."""
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    todo = list(range(requests))
    done, codes, errors, differ = [], {}, [], 0

    async def client(http):
        nonlocal differ
        while todo:
            i = todo.pop()
            try:
                status, ttft, lat, tokens, err = await one(http, url, model, i, max_tokens)
            except httpx.HTTPError as e:
                status, err = 0, f"{type(e).__name__}: {e}"
            codes[status] = codes.get(status, 0) + 1
            if status == 200:
                done.append((ttft, lat, tokens))
                differ += err != reference[i % VARIANTS]
            else:
                errors.append(f"{status}: {err}")

    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=clients + 4,
                                                                     max_keepalive_connections=0)) as http:
        await one(http, url, model, -1, 4)  # warm-up
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.time()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return done, codes, errors, differ, t0, time.time()


def _drive_in_process(args):
    return asyncio.run(drive(*args))


def load(url, clients, requests, max_tokens, timeout, reference, processes=1):
    """The load of `clients` streaming clients, from `processes` client processes (one Python process parses
    ~20-30k server-sent events a second: a GPU serving 256 streams needs more than one)."""
    processes = max(1, min(processes, clients))
    if processes == 1:
        parts = [asyncio.run(drive(url, clients, requests, max_tokens, timeout, reference))]
    else:
        import multiprocessing
        start_at = time.time() + 2 + 0.2 * processes  # every process connected and warmed up first
        share = [(clients // processes + (p < clients % processes),
                  requests // processes + (p < requests % processes)) for p in range(processes)]
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            parts = pool.map(_drive_in_process, [(url, c, r, max_tokens, timeout, reference, start_at)
                                                 for c, r in share])
    done = [d for part in parts for d in part[0]]
    codes = {}
    for part in parts:
        for k, v in part[1].items():
            codes[k] = codes.get(k, 0) + v
    errors = [e for part in parts for e in part[2]]
    differ = sum(part[3] for part in parts)
    wall = max(part[5] for part in parts) - min(part[4] for part in parts)
    spread = max(part[4] for part in parts) - min(part[4] for part in parts)  # a late process makes wall longer
    ttfts, lats = [d[0] for d in done if d[0] is not None], [d[1] for d in done]
    tokens = sum(d[2] for d in done)
    return {"clients": clients, "requests": requests, "max_tokens": max_tokens, "client_processes": processes,
            "start_spread_s": round(spread, 3),
            "wall_s": round(wall, 3), "completion_tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
            "requests_per_s": round(len(done) / wall, 3),
            "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
            "latency_p50_s": statistics.median(lats) if lats else None, "latency_p99_s": pct(lats, 0.99),
            "differ_from_alone": differ, "errors": len(errors), "status_codes": {str(k): v for k, v in codes.items()},
            "first_errors": errors[:3]}


def plot(result, path):
    from gpt2ffn.plot import _pyplot
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in result["servers"].items():
        xs = [p["clients"] for p in points]
        a.plot(xs, [p["tokens_per_s"] for p in points], "o-", label=name)
        b.plot(xs, [p["latency_p50_s"] for p in points], "o-", label=name)
    a.set(xscale="log", xlabel="concurrent clients", ylabel="completion tokens/s", title="Throughput")
    b.set(xscale="log", xlabel="concurrent clients", ylabel="p50 latency (s)", title="Latency")
    clients = sorted({p["clients"] for points in result["servers"].values() for p in points})
    for ax in (a, b):
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.minorticks_off()
        ax.grid(True)
        ax.legend()
    fig.suptitle(f"{result['max_tokens']} new tokens per request, {result['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-dir", default="random:gpt2", help="gpt2ffn's model: HF directory (same weights as --gguf)")
    p.add_argument("--precision", choices=["fp32", "bf16", "int8", "int4"], help="gpt2ffn serve --precision "
                   "(default fp32); on CUDA the dtype, fp32 or bf16 (default bf16)")
    p.add_argument("--batch-invariant", action="store_true", help="gpt2ffn serve --batch-invariant")
    p.add_argument("--device", default="cpu", help="gpt2ffn serve --device (cuda: its default bf16, CUDA graphs)")
    p.add_argument("--max-batch", type=int, help="gpt2ffn serve --max-batch (default its own, 64)")
    p.add_argument("--engine-process", nargs="+", choices=("auto", "on", "off"), help="gpt2ffn serve "
                   "--engine-process, a server per value, one after the other (default: serve's own)")
    p.add_argument("--llama-server", help="path to llama.cpp's llama-server; omit to test gpt2ffn only")
    p.add_argument("--gguf", help="the GGUF llama-server loads")
    p.add_argument("--parallel", type=int, default=32, help="llama-server -np")
    p.add_argument("--ctx", type=int, default=32768, help="llama-server -c")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t and gpt2ffn serve --threads")
    p.add_argument("--url", help="an already running server instead (one series, named 'server')")
    p.add_argument("--clients", default="1,8,32,64", help="comma-separated client counts")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=600, help="per request, seconds")
    p.add_argument("--processes", type=int, default=1, help="client processes the clients are split over")
    p.add_argument("--out", default="benchmarks/results/load.json")
    args = p.parse_args()
    if args.device == "auto":  # what serve's auto picks: CUDA where torch sees a GPU
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.precision is None:
        args.precision = "fp32" if args.device == "cpu" else "bf16"
    elif args.device != "cpu" and args.precision not in ("fp32", "bf16"):
        p.error(f"on --device {args.device} --precision is the dtype: fp32 or bf16, got {args.precision}")
    if args.llama_server and not args.gguf:
        p.error("--llama-server needs --gguf (the same weights as --hf-dir)")
    clients = [int(c) for c in args.clients.split(",")]
    servers = {}
    if args.url:
        servers["server"] = (None, args.url)
    else:
        for mode in args.engine_process or [None]:
            label = f"gpt2ffn serve ({args.precision}{f', engine process {mode}' if mode else ''})"
            servers[label] = (lambda a, port, mode=mode: gpt2ffn_cmd(argparse.Namespace(**{**vars(a), "engine_process":
                                                                                           mode}), port), None)
        if args.llama_server:
            servers[f"llama-server ({Path(args.gguf).stem})"] = (llama_cmd, None)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
              "max_tokens": args.max_tokens, "prompt": PROMPT, "servers": {}}
    for name, (cmd, url) in servers.items():
        proc = None
        if cmd is not None:
            port = free_port()
            proc, url = start(cmd(args, port), port)
        try:
            reference = asyncio.run(alone(url, args.max_tokens, args.timeout))
            for n in clients:
                r = load(url, n, n * args.requests_per_client, args.max_tokens, args.timeout, reference,
                         args.processes)
                result["servers"].setdefault(name, []).append(r)
                print(f"{name:32s} {n:3d} clients: {r['tokens_per_s']:8.1f} tok/s {r['requests_per_s']:6.2f} req/s  "
                      f"TTFT p50 {r['ttft_p50_s'] or 0:6.2f} s  latency p50 {r['latency_p50_s'] or 0:6.2f} "
                      f"p99 {r['latency_p99_s'] or 0:6.2f} s  errors {r['errors']}  differ from alone "
                      f"{r['differ_from_alone']}", flush=True)
        finally:
            if proc is not None:
                stop(proc)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    plot(result, Path(args.out).with_suffix(".png"))
    return 1 if any(r["errors"] for pts in result["servers"].values() for r in pts) else 0


if __name__ == "__main__":
    sys.exit(main())
