"""A bounded load test of `gpt2ffn serve` on loopback: N concurrent clients, M requests in all, then it stops.

It starts its own server (127.0.0.1, a free port) unless --url is given, and reports requests/s, tokens/s,
p50/p99 latency, errors and status codes, as a table and as JSON.

    python benchmarks/load_test.py --model random:gpt2 --clients 32 --requests 320 --max-tokens 16
"""

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_server(model, max_queue):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "gpt2ffn.cli", "serve", "--model", model, "--port", str(port),
                             "--max-queue", str(max_queue)], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the server exited before it was ready")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready in 120 s")


async def run(url, clients, requests, max_tokens, timeout):
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    todo = list(range(requests))
    latencies, codes, tokens, errors = [], {}, 0, []

    async def client(http):
        nonlocal tokens
        while todo:
            i = todo.pop()
            body = {"model": model, "prompt": f"Request {i}: the quick brown fox", "max_tokens": max_tokens,
                    "temperature": 0.8, "seed": i}
            t0 = time.perf_counter()
            try:
                r = await http.post(url + "/v1/completions", json=body)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)
                    tokens += r.json()["usage"]["completion_tokens"]
                else:
                    errors.append(f"{r.status_code}: {r.text[:200]}")
            except httpx.HTTPError as e:
                errors.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {
        "model": model, "clients": clients, "requests": requests, "max_tokens": max_tokens, "wall_s": wall,
        "requests_per_s": len(lat) / wall, "tokens_per_s": tokens / wall, "completion_tokens": tokens,
        "p50_s": statistics.median(lat) if lat else None,
        "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
        "status_codes": codes, "errors": len(errors), "first_errors": errors[:5],
        "server_errors_5xx": sum(n for c, n in codes.items() if c >= 500),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="an already running server; default: start one")
    p.add_argument("--model", default="random:gpt2")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=320)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=300, help="per request, seconds")
    p.add_argument("--out", default="benchmarks/results/load.json")
    args = p.parse_args()
    proc = None
    url = args.url
    if url is None:  # a queue as deep as the clients: the test measures serving, not refusals
        proc, url = start_server(args.model, max_queue=args.clients)
    try:
        r = asyncio.run(run(url, args.clients, args.requests, args.max_tokens, args.timeout))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    r["machine_cores"] = os.cpu_count()
    print(f"{r['requests']} requests from {r['clients']} clients, {r['max_tokens']} tokens max, model {r['model']}")
    print(f"  {r['requests_per_s']:.2f} requests/s, {r['tokens_per_s']:.1f} tokens/s, "
          f"p50 {r['p50_s']:.2f} s, p99 {r['p99_s']:.2f} s, wall {r['wall_s']:.1f} s")
    print(f"  status codes {r['status_codes']}, errors {r['errors']}, 5xx {r['server_errors_5xx']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
    return 1 if r["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
