"""Host time of the sampler and of a whole engine decode step at batch 256, the batch sampler
(serving/sampling.next_tokens) against the per-row loop it replaced (adjust + pick for each row), and the
step with the static decode (serving/static.py: rows in slots 0..B-1, no block table, no gather; CUDA's
default, where it is replayed as a CUDA graph) against the paged one, interleaved.

    python benchmarks/sampling_host.py [--batch 256] [--vocab 50257] [--rounds 7] [--device cpu|cuda]
                                       [--out benchmarks/results/sampling-host.json]

The model is tiny (d=64, 1 layer, GPT-2's vocabulary), so a step is what the host does around the weights:
sampling, scheduling, bookkeeping. The requests mix what a server sees: a quarter greedy, a quarter
temperature + top-k, a quarter top-p + penalties, a quarter seeded with logit_bias.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gpt2ffn.serving.engine as engine_mod
from gpt2ffn import GPT2, Config
from gpt2ffn.bench import cpu_info
from gpt2ffn.model import random_weights_
from gpt2ffn.serving.engine import Engine, Request
from gpt2ffn.serving.sampling import Sampling, adjust, next_tokens, pick

GENERATORS = {}  # request id -> its own torch.Generator, as the engine kept them before the batch sampler


def per_row(logits, requests, generator=None):
    """The sampler before the batch one: plain-greedy rows in one argmax, every other row alone."""
    out = [None] * len(requests)
    plain = [i for i, r in enumerate(requests) if r.params.plain_greedy]
    if plain:
        for i, t in zip(plain, logits[plain].argmax(-1).tolist()):
            out[i] = t
    for i, r in enumerate(requests):
        if out[i] is None:
            if r.id not in GENERATORS:
                g = GENERATORS[r.id] = torch.Generator(device=logits.device)
                if r.params.seed is not None:
                    g.manual_seed(r.params.seed)
                else:
                    g.seed()
            out[i] = int(pick(adjust(logits[i], r.params, r.prompt, r.output)[None], r.params, GENERATORS[r.id])[0])
    return out


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def aten_calls(fn, *args) -> int:
    """How many aten ops one call of fn runs: on a GPU, about how many kernels it launches."""
    with _Count() as c:
        fn(*args)
    return c.n


def samplings(n: int, vocab: int) -> list:
    kinds = [dict(), dict(temperature=0.8, top_k=50), dict(temperature=1.0, top_p=0.9, presence_penalty=0.5,
                                                           frequency_penalty=0.3, repetition_penalty=1.1),
             dict(temperature=0.7, logit_bias={11: 2.0, vocab - 1: -100.0})]
    return [Sampling(max_new_tokens=100, ignore_eos=True, seed=i if i % 4 == 3 else None, **kinds[i % 4])
            for i in range(n)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device", default="cpu", help="where the logits and the tiny model are: cpu or cuda")
    p.add_argument("--out", default="benchmarks/results/sampling-host.json")
    args = p.parse_args()
    B, V = args.batch, args.vocab
    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(0, V, (22,), generator=g).tolist(), s) for s in samplings(B, V)]
    for r in reqs:
        r.output = torch.randint(0, V, (16,), generator=g).tolist()
    logits = torch.randn(B, V, generator=g).to(args.device)
    samplers = {"per-row loop (before)": per_row, "batch sampler": next_tokens}
    ops = {name: aten_calls(fn, logits, reqs) for name, fn in samplers.items()}
    ms = {name: [] for name in samplers}
    for _ in range(args.rounds):
        for name, fn in samplers.items():
            t0 = time.perf_counter()
            fn(logits, reqs)
            ms[name].append(1e3 * (time.perf_counter() - t0))

    cfg = Config(n_embd=64, n_layer=1, n_head=4, n_positions=128, vocab_size=V)
    model = random_weights_(GPT2(cfg), 0).eval().to(args.device)
    engines = {name: (fn, False) for name, fn in samplers.items()}
    engines["batch sampler, static decode"] = (next_tokens, True)
    steps = {name: [] for name in engines}
    for _ in range(max(2, args.rounds // 2)):
        for name, (fn, static) in engines.items():
            engine_mod.next_tokens = fn
            eng = Engine(model, max_batch=B, max_waiting=B, max_len=128, kv_tokens=B * 128, static_decode=static)
            eng.add(*[Request(list(r.prompt), r.params) for r in reqs])
            while eng.waiting or any(r.computed < len(r.prompt) for r in eng.running):
                eng.step()  # admit and prefill everything first (prompts 22 + 100 new: none finishes here)
            for _ in range(8):
                t0 = time.perf_counter()
                eng.step()
                steps[name].append(1e3 * (time.perf_counter() - t0))
    engine_mod.next_tokens = next_tokens
    # greedy rows: the step is the model and the engine's bookkeeping, paged (a block table per row, every
    # row's keys gathered) against static (slots 0..B-1 read in place), contexts of ~100 positions
    greedy = {"paged": [], "static decode": []}
    prompts = [torch.randint(0, V, (100,), generator=g).tolist() for _ in range(B)]
    for _ in range(max(2, args.rounds // 2)):
        for name in greedy:
            eng = Engine(model, max_batch=B, max_waiting=B, max_len=128, kv_tokens=B * 128,
                         static_decode=name != "paged", chunk=4096)
            eng.add(*[Request(list(p), Sampling(max_new_tokens=20, ignore_eos=True)) for p in prompts])
            while eng.waiting or any(r.computed < len(r.prompt) for r in eng.running):
                eng.step()
            for _ in range(8):
                t0 = time.perf_counter()
                eng.step()
                greedy[name].append(1e3 * (time.perf_counter() - t0))
    gpu = f", {torch.cuda.get_device_name()}" if torch.device(args.device).type == "cuda" else ""
    result = {"machine": f"{cpu_info()['cpu']}, {torch.get_num_threads()} threads{gpu}, torch {torch.__version__}",
              "device": args.device,
              "batch": B, "vocab": V,
              "sampler_ms_median": {k: statistics.median(v) for k, v in ms.items()},
              "sampler_aten_ops": ops,
              "engine_step_ms_median": {k: statistics.median(v) for k, v in steps.items()},
              "greedy_step_ms_median": {k: statistics.median(v) for k, v in greedy.items()}}
    for k, v in ops.items():
        print(f"{'sampler_aten_ops':22s} {k:30s} {v:8d}")
    for what in ("sampler_ms_median", "engine_step_ms_median", "greedy_step_ms_median"):
        for k, v in result[what].items():
            print(f"{what:22s} {k:30s} {v:8.2f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
