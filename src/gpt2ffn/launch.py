"""Joining the processes torchrun starts, for `gpt2ffn generate --tp N` and `gpt2ffn serve --tp N`.

torchrun (PyTorch's launcher) starts N copies of the command with RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address in their environment; `init` joins them into one process group (gloo on CPU, nccl where
CUDA is present, each rank on its own GPU). Run as README says:

    torchrun --nproc-per-node 2 -m gpt2ffn.cli generate --tp 2 --model random:gpt2 "Hello"
    torchrun --nproc-per-node 2 --no-python gpt2ffn serve --tp 2 --model random:gpt2
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import Gpt2ffnError
from .parallel import backend

# How long a collective may wait: the other ranks of `serve --tp` sit in one (the next forward pass's broadcast)
# for as long as no request comes; with the default (30 min for gloo) an idle server lost them.
IDLE = timedelta(days=365)


def init(tp: int, command: str = "generate") -> int:
    """Join torchrun's process group of `tp` ranks; return this rank. A clear error, not a hang, when the
    command (the gpt2ffn subcommand, for the message) was not started by torchrun or with another number of
    processes."""
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        raise Gpt2ffnError(f"--tp {tp} runs one process per rank: start it with torchrun, e.g. torchrun "
                           f"--nproc-per-node {tp} -m gpt2ffn.cli {command} --tp {tp} ... (WORLD_SIZE is not set)")
    if int(world) != tp:
        raise Gpt2ffnError(f"--tp {tp} but torchrun started {world} processes: use --nproc-per-node {tp}")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():  # no timeout that matters: a server's followers wait between requests
        dist.init_process_group(backend(), timeout=IDLE)
    return dist.get_rank()


def finish():
    """Leave the process group (each rank, at the end of the command)."""
    if dist.is_initialized():
        dist.destroy_process_group()
