"""One stream's time per token through the server's engine, in a thread of this process (Loop) and in a process of its
own (serving/core.py's EngineProcess), without HTTP: whether the engine process steps as fast as the thread.

Per place and round: a Service loads the model (as `serve` does: its loader thread, or the engine process), then
R requests of one prompt run one after another, each for N greedy tokens; a request's time per token is the
median gap between its Tokens' arrivals here. Places alternate round by round, one process each.

    python benchmarks/engine_process_step.py [--model random:gpt2] [--tokens 100] [--requests 4] [--rounds 2] \\
        [--threads 2] [--out benchmarks/results/engine-process-step.json]
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def gaps_ms(stamps: list) -> float:
    return 1000 * statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:]))  # from the 2nd token on


def in_thread(args) -> list:
    from gpt2ffn.serving.engine import Request
    from gpt2ffn.serving.sampling import Sampling
    from gpt2ffn.serving.service import Service
    svc = Service(args.model, threads=args.threads)
    loader = threading.Thread(target=svc.load)  # as serve() loads: on a thread that ends
    loader.start()
    loader.join()
    out = []
    for _ in range(args.requests):
        done, stamps = threading.Event(), []

        def sink(ev, stamps=stamps, done=done):
            stamps.append(time.perf_counter())
            if ev.finish_reason:
                done.set()
        svc.loop.submit(Request([1, 2, 3], Sampling(max_new_tokens=args.tokens, ignore_eos=True), sink))
        done.wait()
        out.append(gaps_ms(stamps))
    svc.loop.stop()
    return out


async def in_process(args) -> list:
    from gpt2ffn.serving.engine import Request
    from gpt2ffn.serving.sampling import Sampling
    from gpt2ffn.serving.service import Service
    svc = Service(args.model, threads=args.threads, engine_process=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, svc.load_remote, loop)
    while not svc.ready.is_set():
        await asyncio.sleep(0.01)
    out = []
    for _ in range(args.requests):
        done, stamps = loop.create_future(), []

        def sink(ev, stamps=stamps, done=done):
            stamps.append(time.perf_counter())
            if ev.finish_reason and not done.done():
                done.set_result(None)
        await svc.loop.submit(Request([1, 2, 3], Sampling(max_new_tokens=args.tokens, ignore_eos=True), sink))
        await done
        out.append(gaps_ms(stamps))
    svc.loop.stop()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:gpt2")
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--place", choices=("thread", "process"), help=argparse.SUPPRESS)  # a child's one run
    p.add_argument("--out", default="benchmarks/results/engine-process-step.json")
    args = p.parse_args()
    sys.path.insert(0, str(HERE.parent / "src"))
    if args.place:
        ms = in_thread(args) if args.place == "thread" else asyncio.run(in_process(args))
        print(json.dumps(ms))
        return
    from gpt2ffn.bench import cpu_info
    runs = {"thread": [], "process": []}
    for r in range(args.rounds):
        for place in runs:
            cmd = [sys.executable, __file__, "--place", place, "--model", args.model, "--tokens", str(args.tokens),
                   "--requests", str(args.requests), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            ms = json.loads(out.stdout.strip().splitlines()[-1])
            runs[place].append(ms)
            print(f"round {r} engine in a {place:7s}: ms a token per request " + " ".join(f"{x:.2f}" for x in ms),
                  flush=True)
    med = {place: statistics.median(x for ms in pts for x in ms) for place, pts in runs.items()}
    print(f"median ms a token: thread {med['thread']:.2f}, process {med['process']:.2f} "
          f"(process / thread {med['process'] / med['thread']:.3f})")
    result = {"machine": cpu_info()["cpu"], "model": args.model, "tokens": args.tokens, "threads": args.threads,
              "median_ms_per_token": med, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
