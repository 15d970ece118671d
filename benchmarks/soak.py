"""Soak test: `gpt2ffn serve` under a mixed load for N minutes; nothing may 5xx and memory must stay flat.

It starts the server itself (an API key, loopback), then C clients loop until the time is up, each picking per
request one of: a plain completion (some with n/best_of), a streamed one read to [DONE], a streamed one the
client drops after two events, malformed JSON, an oversized body (2 MiB), a wrong or missing API key, a prompt
+ max_tokens past the context. Each kind has the status it must get (200, 400, 401, 413; a dropped stream: no
status). Reported: requests by kind and status, the 5xx count (must be 0), requests that got another status
than their kind's, p50/p99 latency of the completions per minute, the server's resident memory (VmRSS) per
minute (must grow under 5% from minute 2 to the end), and what the server's own metrics say once the load
stops (nothing running, waiting or holding KV blocks). Writes benchmarks/results/<name>.json and <name>.png.

    python benchmarks/soak.py                                     # random:tiny, 10 minutes, 8 clients
    python benchmarks/soak.py --model random:gpt2 --minutes 3 --name soak-124m
Exit status 1 if a 5xx came back, a request got an unexpected status, or memory grew by 5% or more.
"""

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

KEY = "sk-soak-" + os.urandom(8).hex()
WEIGHTS = {"plain": 28, "stream": 24, "disconnect": 14, "malformed": 8, "oversized": 4, "bad_key": 12,
           "past_context": 10}
EXPECTED = {"plain": 200, "stream": 200, "disconnect": "dropped", "malformed": 400, "oversized": 413,
            "bad_key": 401, "past_context": 400}
WORDS = "the quick brown fox jumps over the lazy dog and then it runs into the forest where".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} cores"


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start_server(args, port):
    cmd = [sys.executable, "-m", "gpt2ffn.cli", "serve", "--model", args.model, "--port", str(port),
           "--api-key", KEY, "--threads", str(args.threads)]
    log = tempfile.NamedTemporaryFile("w+", prefix="soak-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {Path(log.name).read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, cmd, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not become ready")


async def one(client: httpx.AsyncClient, url: str, model: str, context: int, kind: str, rng: random.Random):
    """Send one request of this kind; its status (or 'dropped', or the exception's name)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))  # <= 72 bytes: fits random:tiny
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(4, 32),
            "temperature": rng.choice([0.0, 0.8, 1.0]), "seed": rng.randint(0, 1000)}
    if kind == "plain":
        if rng.random() < 0.2:
            body.update(n=2, best_of=3, temperature=1.0)
        r = await client.post(url + "/v1/completions", json=body, headers=auth)
        return r.status_code
    if kind in ("stream", "disconnect"):
        async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                                 headers=auth) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code
            events, done = 0, False
            async for line in r.aiter_lines():
                events += line.startswith("data: ")
                done = done or line == "data: [DONE]"
                if kind == "disconnect" and events >= 2:
                    return "dropped"  # leaving the block closes the connection mid-stream
            return 200 if done else "truncated"
    if kind == "malformed":
        r = await client.post(url + "/v1/completions", content=json.dumps(body)[:-rng.randint(1, 20)],
                              headers={**auth, "Content-Type": "application/json"})
        return r.status_code
    if kind == "oversized":
        r = await client.post(url + "/v1/completions", content=b"x" * (2 << 20),
                              headers={**auth, "Content-Type": "application/json"})
        return r.status_code
    if kind == "bad_key":
        headers = rng.choice([{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Bearer {KEY}x"}])
        r = await client.post(url + "/v1/completions", json=body, headers=headers)
        return r.status_code
    if kind == "past_context":
        n = rng.randint(1, context // 2)
        r = await client.post(url + "/v1/completions", headers=auth,
                              json={**body, "prompt": [rng.randint(1, 60) for _ in range(n)],
                                    "max_tokens": context - n + rng.randint(1, 16)})
        return r.status_code
    raise ValueError(kind)


async def load(args, url: str, pid: int):
    async with httpx.AsyncClient(timeout=120) as c:
        r = await c.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        card = r.json()["data"][0]
    model, context = card["id"], card["max_model_len"]
    records, rss = [], []  # (seconds since start at the end, kind, outcome, latency); (seconds, MiB)
    t0 = time.perf_counter()
    end = t0 + args.minutes * 60

    async def client_loop(i: int):
        rng = random.Random(args.seed * 1000 + i)
        kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
        async with httpx.AsyncClient(timeout=120) as client:
            while time.perf_counter() < end:
                kind = rng.choices(kinds, weights)[0]
                start = time.perf_counter()
                try:
                    outcome = await one(client, url, model, context, kind, rng)
                except httpx.HTTPError as e:
                    outcome = type(e).__name__
                now = time.perf_counter()
                records.append((now - t0, kind, outcome, now - start))

    async def sampler():
        while time.perf_counter() < end:
            rss.append((time.perf_counter() - t0, rss_mib(pid)))
            await asyncio.sleep(args.sample_every)
        rss.append((time.perf_counter() - t0, rss_mib(pid)))

    await asyncio.gather(sampler(), *(client_loop(i) for i in range(args.clients)))
    return model, context, records, rss


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def server_metrics(url: str) -> dict:
    """The server's own counters and gauges once the load has stopped (after a short settle)."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    keep = ("gpt2ffn_requests_total", "gpt2ffn_cancelled_total", "gpt2ffn_num_requests_running",
            "gpt2ffn_num_requests_waiting", "gpt2ffn_kv_cache_blocks_in_use")
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in text.splitlines()
                                                    if line.startswith(keep))}


def plot(result: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    t, mib = zip(*result["rss_samples"])
    a.plot([x / 60 for x in t], mib, color="tab:blue")
    a.set_ylabel("server RSS (MiB)")
    a.set_ylim(0, max(mib) * 1.15)
    a.set_title(f"gpt2ffn serve soak: {result['model']}, {result['clients']} clients, "
                f"{result['total_requests']} requests, {result['five_xx']} 5xx, "
                f"RSS {result['rss_growth_pct']:+.1f}% from minute 2", fontsize=9)
    minutes = [m["minute"] for m in result["per_minute"]]
    b.plot(minutes, [m["p50_s"] for m in result["per_minute"]], "o-", label="p50")
    b.plot(minutes, [m["p99_s"] for m in result["per_minute"]], "s-", label="p99")
    b.set_ylabel("completion latency (s)")
    b.set_xlabel("minute")
    b.legend()
    fig.text(0.01, 0.01, result["cpu"], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:tiny", help="what `gpt2ffn serve --model` takes (default random:tiny)")
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    p.add_argument("--sample-every", type=float, default=5, help="seconds between RSS samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="soak", help="file names: <out>/<name>.json and .png")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a soak stopped by `timeout` still stops its server
    port = free_port()
    proc, url, cmd, log = start_server(args, port)
    try:
        model, context, records, rss = asyncio.run(load(args, url, proc.pid))
        time.sleep(2)
        after = server_metrics(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "killed"
    minutes = int(-(-args.minutes // 1))
    per_minute = []
    for m in range(minutes):
        rows = [r for r in records if m * 60 <= r[0] < (m + 1) * 60]
        lat = [r[3] for r in rows if r[1] in ("plain", "stream") and r[2] == 200]
        in_minute = [mib for t, mib in rss if t < (m + 1) * 60]
        per_minute.append({"minute": m + 1, "requests": len(rows), "completions": len(lat),
                           "p50_s": quantile(lat, 0.5), "p99_s": quantile(lat, 0.99),
                           "rss_mib": round(in_minute[-1], 1),
                           "outcomes": dict(Counter(str(r[2]) for r in rows))})
    by_kind = {k: dict(Counter(str(r[2]) for r in records if r[1] == k)) for k in WEIGHTS}
    five_xx = sum(1 for r in records if isinstance(r[2], int) and r[2] >= 500)
    unexpected = sum(1 for r in records if r[2] != EXPECTED[r[1]])
    base = per_minute[1]["rss_mib"] if len(per_minute) > 1 else per_minute[0]["rss_mib"]
    growth = 100 * (rss[-1][1] - base) / base
    result = {
        "cpu": cpu_name(), "model": args.model, "served_as": model, "context": context, "minutes": args.minutes,
        "clients": args.clients, "server_threads": args.threads, "server_cmd": " ".join(cmd).replace(KEY, "KEY"),
        "weights": WEIGHTS, "expected": EXPECTED, "total_requests": len(records), "by_kind": by_kind,
        "five_xx": five_xx, "unexpected": unexpected,
        "p50_s": quantile([r[3] for r in records if r[1] in ("plain", "stream") and r[2] == 200], 0.5),
        "p99_s": quantile([r[3] for r in records if r[1] in ("plain", "stream") and r[2] == 200], 0.99),
        "latency_by_kind_s": {k: {"p50": quantile([r[3] for r in records if r[1] == k], 0.5),
                                  "p99": quantile([r[3] for r in records if r[1] == k], 0.99)} for k in WEIGHTS},
        "rss_minute_2_mib": base, "rss_end_mib": round(rss[-1][1], 1), "rss_growth_pct": round(growth, 2),
        "per_minute": per_minute, "rss_samples": [(round(t, 1), round(m, 1)) for t, m in rss],
        "server_metrics_after": after, "server_exit": code,
    }
    result["pass"] = five_xx == 0 and unexpected == 0 and growth < 5 and code == 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / f"{args.name}.png")
    print(json.dumps({k: result[k] for k in ("cpu", "model", "total_requests", "by_kind", "five_xx", "unexpected",
                                             "p50_s", "p99_s", "latency_by_kind_s", "rss_minute_2_mib", "rss_end_mib",
                                             "rss_growth_pct", "server_metrics_after", "server_exit", "pass")},
                     indent=1))
    for m in per_minute:
        print(f"minute {m['minute']:>2}: {m['requests']:>5} requests, p50 {m['p50_s']:.3f} s, p99 {m['p99_s']:.3f} s, "
              f"RSS {m['rss_mib']:.1f} MiB")
    print(f"server log: {log}")
    sys.exit(0 if result["pass"] else 1)


if __name__ == "__main__":
    main()
