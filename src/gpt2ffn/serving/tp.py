"""The engine over a tensor-parallel model (gpt2ffn.parallel): every rank runs the same engine and the same
forward passes, each on its own shards and its own heads of the KV cache; rank 0 alone schedules.

Rank 0 takes the requests, admits, chunks and samples exactly as the one-process Engine does; before each
forward pass it broadcasts what that pass reads (ids, positions, block tables or slots, the mask), and the
other ranks, in `follow()`, run the same pass on their shards. The passes' all-reduces line up because every
rank calls them in the same order; only rank 0 uses the logits. Block numbers mean the same on every rank:
the cache geometry is rank 0's (broadcast when the engine is made) and only rank 0 allocates.
"""

import signal
import threading

import torch
import torch.distributed as dist

from .engine import Engine
from .static import attention_kernels

STOP = "stop"


def make_engine(model, decode=None, **kwargs) -> Engine:
    """The engine for `model`: a TPEngine when it is sharded over more than one rank (parallel.parallelize
    gives it a mesh), else the one-process Engine. Every rank calls it with the same arguments."""
    mesh = getattr(model, "mesh", None)
    if mesh is not None and mesh.size() > 1:
        return TPEngine(model, decode, **kwargs)
    return Engine(model, decode, **kwargs)


class TPEngine(Engine):
    """An Engine on every rank of a tensor-parallel model; rank 0 steps it, the others `follow()`."""

    def __init__(self, model, decode=None, **kwargs):
        self.group = model.mesh.get_group()
        self.rank = dist.get_rank(self.group)
        self.root = dist.get_global_rank(self.group, 0)
        kwargs["kv_tokens"] = self.broadcast(kwargs.get("kv_tokens") or self.default_tokens(model, kwargs))
        kwargs["static_decode"] = False  # each pass goes through forward(), which the other ranks follow
        super().__init__(model, decode, **kwargs)
        self.follower = self.rank != 0

    @staticmethod
    def default_tokens(model, kwargs) -> int:
        from .engine import default_kv_tokens  # free memory differs between ranks: rank 0's count is used
        weight = model.transformer.wpe.weight
        return default_kv_tokens(model.kv_config, kwargs.get("max_batch", 64), model.kv_dtype, device=weight.device,
                                 fraction=kwargs.get("kv_fraction"), max_len=kwargs.get("max_len"))

    def broadcast(self, obj):
        """rank 0's obj on every rank (a pickled object: small, once per forward pass)."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.root, group=self.group)
        return box[0]

    def forward(self, ids, positions, tables, *args):
        self.broadcast((ids, positions, tables, args))
        return super().forward(ids, positions, tables, *args)

    def step(self) -> list:
        if self.follower:
            raise RuntimeError("only rank 0 steps a TPEngine; the other ranks call follow()")
        return super().step()

    def follow(self):
        """Ranks > 0: run each forward pass rank 0 broadcasts, until it closes the engine. Meanwhile Ctrl-C and
        SIGTERM are rank 0's to act on (torchrun sends them to every rank): a follower that died of them left rank
        0's passes and its STOP without a peer ("Connection closed by peer"); rank 0 drains, closes the engine,
        and this returns. The handlers are given back after."""
        ignore = threading.current_thread() is threading.main_thread()
        saved = [(sig, signal.signal(sig, signal.SIG_IGN)) for sig in (signal.SIGINT, signal.SIGTERM)] if ignore else []
        try:
            with torch.no_grad(), attention_kernels(self.device):
                while True:
                    call = self.broadcast(None)
                    if call == STOP:
                        return
                    ids, positions, tables, args = call
                    super().forward(ids, positions, tables, *args)
        finally:
            for sig, handler in saved:
                if handler is not None:  # None: a handler installed from C, which Python cannot put back
                    signal.signal(sig, handler)

    def close(self):
        """Rank 0: release the followers (their follow() returns)."""
        if not self.follower:
            self.broadcast(STOP)
