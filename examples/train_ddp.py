"""Data-parallel training of gpt2ffn's GPT-2 with PyTorch's DistributedDataParallel, on a text this script makes.

    torchrun --nproc-per-node 2 examples/train_ddp.py --compare     # 2 ranks: gloo on CPU (nccl on GPUs)
    python examples/train_ddp.py                                     # one process, the same global batches

Every step draws one global batch of --batch sequences (the same on every rank, from the step's seed); rank
r of N trains on rows r*B/N..(r+1)*B/N. DDP averages the gradients across ranks during backward, so with equal
shares each rank's update equals one process's on the whole batch. Rank 0 prints the global batch's loss (the
ranks' mean losses averaged). --compare: rank 0 then trains a fresh model in one process on the same batches
and prints how far the two loss curves are apart (fp32: ~1e-6, the sums' different order).
The FFN of every block trains through gpt2ffn's RecomputeGELU backward (kernels/).
"""

import argparse
import json
import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gpt2ffn import GPT2, Config

# Dropout off: with it, two runs cannot agree (each rank draws its own masks).
CFG = Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=256, embd_pdrop=0.0, attn_pdrop=0.0,
             resid_pdrop=0.0)
WORDS = ("the model reads every weight once and the cache keeps each key so a token attends what came before "
         "it while the feed forward network widens each position four times applies gelu and narrows it").split()


def make_text(seed: int = 0, words: int = 4000) -> torch.Tensor:
    """A text of random sentences over a small vocabulary of words, as byte ids (GPT-2's 256 single bytes)."""
    rng = random.Random(seed)
    sentences = []
    while sum(len(s) for s in sentences) < words:
        sentences.append([rng.choice(WORDS) for _ in range(rng.randint(4, 12))])
    text = ". ".join(" ".join(s) for s in sentences) + "."
    return torch.tensor(list(text.encode()), dtype=torch.long)


def batch(data: torch.Tensor, step: int, rows: int, T: int):
    """The step's global batch: (rows, T) inputs and their next tokens, the same in every process."""
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(len(data) - T - 1, (rows,), generator=g)
    idx = starts[:, None] + torch.arange(T)
    return data[idx], data[idx + 1]


def train(model, data, steps, rows, T, lr, rank=0, world=1, ddp=False) -> list:
    """Losses of `steps` AdamW steps on share `rank` of `world` of every global batch; ddp: the ranks' losses
    averaged (the global batch's)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    share = rows // world
    losses = []
    for step in range(steps):
        x, y = batch(data, step, rows, T)
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        logits = model(x)                                                           # (share, T, vocab)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()                                                             # DDP: gradients averaged
        opt.step()
        total = loss.detach().clone()
        if ddp:
            dist.all_reduce(total)
            total /= world
        losses.append(float(total))
    return losses


def fresh_model() -> GPT2:
    torch.manual_seed(0)
    return GPT2(CFG).train()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (>= 1)")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences, >= 1); divisible by the world size")
    p.add_argument("--seq", type=int, default=32, help=f"tokens per sequence (1 to the model's {CFG.n_positions})")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--compare", action="store_true", help="rank 0 also trains one process on the same batches")
    p.add_argument("--out", help="write the loss curves as JSON")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    for flag, value, most in (("--steps", args.steps, None), ("--batch", args.batch, None),
                              ("--seq", args.seq, CFG.n_positions)):
        if not 1 <= value <= (most or value):
            raise SystemExit(f"error: {flag} must be in [1, {most or 'inf'}], got {value}")
    if args.batch % world:
        raise SystemExit(f"error: --batch {args.batch} does not split evenly over {world} ranks")
    rank = 0
    torch.set_num_threads(1 if world > 1 else torch.get_num_threads())
    data = make_text()
    if world > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank = dist.get_rank()
        model = DDP(fresh_model())  # DDP broadcasts rank 0's parameters; they are equal anyway (same seed)
    else:
        model = fresh_model()
    losses = train(model, data, args.steps, args.batch, args.seq, args.lr, rank, world, ddp=world > 1)
    result = {"world": world, "losses": losses}
    if rank == 0:
        for i in range(0, args.steps, max(1, args.steps // 10)):
            print(f"step {i:3d}  loss {losses[i]:.6f}")
        if args.compare and world > 1:
            result["single"] = train(fresh_model(), data, args.steps, args.batch, args.seq, args.lr)
            # what rank 0 would learn alone on its share: the curve a broken all-reduce would give
            result["half_batch"] = train(fresh_model(), data, args.steps, args.batch, args.seq, args.lr, 0, world)
            result["max_abs_diff"] = max(abs(a - b) for a, b in zip(losses, result["single"]))
            print(f"{world} ranks (DDP) vs one process on the same global batches: loss curves differ by at most "
                  f"{result['max_abs_diff']:.2e} over {args.steps} steps")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
