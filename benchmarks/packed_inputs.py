"""Host time to build a packed prefill's inputs (Engine.prefill_packed, the GPU engine's prefill): the token-by-token
lists it built before against packed_inputs' array operations, checked equal first over 300 random layouts (block
sizes 1-192, chunks starting mid-prompt). The workload: 16 prompts of 128 tokens, one 2,048-token step, as a batch
of 256 prompts is admitted on a GPU (16 such steps).

    PYTHONPATH=src python benchmarks/packed_inputs.py
"""

import random
import time

import torch

from gpt2ffn.serving.engine import packed_inputs


class R:
    pass


def old(chunks, bs, dev="cpu"):
    pos = [p for _, s, n in chunks for p in range(s, s + n)]
    ids = torch.tensor([[t for r, s, n in chunks for t in r.prompt[s : s + n]]], device=dev)
    positions = torch.tensor([pos], device=dev)
    slots = (
        torch.tensor([r.blocks[p // bs] for r, s, n in chunks for p in range(s, s + n)], device=dev),
        positions[0] % bs,
    )
    key_pos = [p for _, s, n in chunks for p in range(s + n)]
    keys = (
        torch.tensor([r.blocks[p // bs] for r, s, n in chunks for p in range(s + n)], device=dev),
        torch.tensor(key_pos, device=dev) % bs,
    )
    key_seq = torch.tensor([i for i, (_, s, n) in enumerate(chunks) for _ in range(s + n)], device=dev)
    q_seq = torch.tensor([i for i, (_, _, n) in enumerate(chunks) for _ in range(n)], device=dev)
    mask = ((key_seq[None] == q_seq[:, None]) & (torch.tensor(key_pos, device=dev)[None] <= positions[0][:, None]))[
        None, None
    ]
    return ids[0], positions[0], slots, keys, mask


rng = random.Random(0)
for trial in range(300):
    bs = rng.choice([1, 4, 16, 64, 192])
    chunks = []
    pool = list(range(1000))
    rng.shuffle(pool)
    for _ in range(rng.randint(1, 6)):
        r = R()
        L = rng.randint(1, 150)
        r.prompt = [rng.randrange(500) for _ in range(L)]
        s = rng.randint(0, L - 1)
        n = rng.randint(1, L - s)
        nb = -(-(L + rng.randint(0, 20)) // bs)
        r.blocks = [pool.pop() for _ in range(nb)]
        chunks.append((r, s, n))
    ids, positions, sb, so, kb, ko, kp, ks, qs = packed_inputs(chunks, bs, "cpu")
    mask = ((ks[None] == qs[:, None]) & (kp[None] <= positions[:, None]))[None, None]
    i2, p2, (sb2, so2), (kb2, ko2), m2 = old(chunks, bs)
    assert torch.equal(ids, i2) and torch.equal(positions, p2) and torch.equal(sb, sb2) and torch.equal(so, so2)
    assert torch.equal(kb, kb2) and torch.equal(ko, ko2) and torch.equal(mask, m2), trial
print("equal in 300 trials")
chunks = []
for i in range(16):
    r = R()
    r.prompt = list(range(128))
    r.blocks = [i]
    chunks.append((r, 0, 128))


def new_full():
    ids, positions, sb, so, kb, ko, kp, ks, qs = packed_inputs(chunks, 192, "cpu")
    return ((ks[None] == qs[:, None]) & (kp[None] <= positions[:, None]))[None, None]


for f, name in ((lambda: old(chunks, 192), "lists"), (new_full, "arrays")):
    for _ in range(3):
        f()
    t = time.perf_counter()
    for _ in range(30):
        f()
    print(name, round((time.perf_counter() - t) / 30 * 1e3, 3), "ms (with the mask on the CPU)")
t = time.perf_counter()
for _ in range(100):
    packed_inputs(chunks, 192, "cpu")
print("arrays, inputs only", round((time.perf_counter() - t) / 100 * 1e3, 3), "ms")
