"""KV caches: one preallocated per-layer cache for a batch (HF-style `GPT2.forward(ids, cache)`), and the
paged pool the serving engine shares among many sequences (vLLM's PagedAttention).

The model writes into whichever it is given (`update`) and asks nothing else of it; the engine owns the
paged pool's blocks (allocate, release) and binds each forward pass's rows to them.
"""

import torch

from ..config import Config
from ..errors import Gpt2ffnError
from ..kernels.formats import huge_zeros


class KVCache:
    """Keys and values of every layer, preallocated to n_positions: (B, H, n_positions, d/H) each."""

    def __init__(self, cfg: Config, batch: int, dtype=torch.float32, device="cpu", max_len=None):
        if dtype not in (torch.float32, torch.float16):  # as GPT2.kv_dtype says: the kernels read these two
            raise Gpt2ffnError(f"KVCache dtype must be torch.float32 or torch.float16 (model.kv_dtype: the "
                               f"model's own), got {dtype!r}")
        self.max_len = max_len or cfg.n_positions
        if self.max_len > cfg.n_positions:
            raise Gpt2ffnError(f"KV cache of {self.max_len} positions exceeds n_positions={cfg.n_positions}")
        shape = (batch, cfg.n_head, self.max_len, cfg.n_embd // cfg.n_head)
        self.k = [huge_zeros(shape, dtype, device) for _ in range(cfg.n_layer)]
        self.v = [huge_zeros(shape, dtype, device) for _ in range(cfg.n_layer)]
        self.length = 0  # positions filled so far

    def check_room(self, new: int, batch: int, cfg: Config):
        """A forward pass of (batch, new) ids fits: its sequences, the layers and heads of cfg (the model's
        kv_config: a tensor-parallel rank's share of the heads), and room."""
        B, H, _, hd = self.k[0].shape if self.k else (batch, cfg.n_head, 0, cfg.n_embd // cfg.n_head)
        if batch != B:
            raise Gpt2ffnError(f"ids hold {batch} sequence{'s' * (batch != 1)} but the KV cache holds {B}: make it "
                               f"with KVCache(model.config, {batch}, ...) (one cache row per sequence)")
        if (len(self.k), H, hd) != (cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head):
            raise Gpt2ffnError(f"the KV cache was made for {len(self.k)} layers of {H} heads x {hd}, not this model's "
                               f"{cfg.n_layer} x {cfg.n_head} x {cfg.n_embd // cfg.n_head}: make it with "
                               "KVCache(model.kv_config, batch, ...) (model.config but on a tensor-parallel rank)")
        if self.length + new > self.max_len:
            raise Gpt2ffnError(f"{self.length} cached + {new} new tokens exceed the context of {self.max_len} "
                               f"positions (n_positions); GPT-2 cannot attend further back")

    def update(self, layer: int, k, v):
        """Write this step's k, v (B, H, T, d/H) after the cached ones; return all of them so far."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length:end] = k.to(self.k[layer].dtype)  # rounded to nearest even into fp16
        self.v[layer][:, :, self.length:end] = v.to(self.v[layer].dtype)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class PagedKVCache:
    """Keys and values of many sequences in fixed-size blocks, as vLLM's PagedAttention keeps them.

    Per layer one pool (num_blocks, H, block_size, d/H). A sequence owns a list of blocks (its block table),
    reserved for its whole length when it is admitted, so a running sequence never waits for memory. A
    forward pass first bind()s the rows' tables and positions; update() then writes each new key at its
    position and returns each row's own blocks gathered, (B, H, blocks * block_size, d/H): a row sees only
    its own keys, and forward_paged's mask hides the positions it has not written yet."""

    def __init__(self, cfg: Config, num_blocks: int, block_size: int = 16, dtype=torch.float32, device="cpu"):
        self.block_size, self.num_blocks = block_size, num_blocks
        shape = (num_blocks, cfg.n_head, block_size, cfg.n_embd // cfg.n_head)
        # zeros, not empty: a masked key is multiplied by probability 0, and 0 * NaN from stale memory is NaN
        self.k = [huge_zeros(shape, dtype, device) for _ in range(cfg.n_layer)]
        self.v = [huge_zeros(shape, dtype, device) for _ in range(cfg.n_layer)]
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables = self.positions = None

    def pieces(self, nbytes: int = 2 << 20):
        """Every pool in pieces of whole blocks, about nbytes each (at least one block), in the order allocate()
        hands blocks out: the first blocks of each layer's k and v, then the next ones."""
        per = max(1, nbytes // self.k[0][0].nbytes)
        for b in range(0, self.num_blocks, per):
            for pool in self.k + self.v:
                yield pool[b:b + per]

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, tokens: int):
        """Blocks for a sequence of `tokens` positions, or None when the pool has too few free."""
        n = self.blocks_for(tokens)
        if n > len(self.free):
            return None
        return [self.free.pop() for _ in range(n)]

    def release(self, blocks: list):
        self.free.extend(reversed(blocks))

    def bind(self, tables, positions, slots=None, span=None, keys=None):
        """tables (B, nb) block ids per row (padded with any of its own), positions (B, T) of the new tokens;
        slots: (blocks, offsets), each (B*T,), where they are written, if not at their positions in their
        row's blocks (a packed row holds tokens of several sequences); span: keys beyond it are not read; keys:
        (blocks, offsets) of every key a one-row pass reads, in place of tables."""
        if slots is None:
            slots = (tables.gather(1, positions // self.block_size).flatten(), (positions % self.block_size).flatten())
        self.tables, self.slots, self.span, self.keys = tables, slots, span, keys

    def update(self, layer: int, k, v):
        """Write k, v (B, H, T, d/H) at their slots; return every row's blocks (B, H, nb * block_size, d/H)."""
        B, H, T, D = k.shape
        blk, off = self.slots
        self.k[layer][blk, :, off] = k.transpose(1, 2).reshape(B * T, H, D).to(self.k[layer].dtype)
        self.v[layer][blk, :, off] = v.transpose(1, 2).reshape(B * T, H, D).to(self.v[layer].dtype)
        if self.keys is not None:  # one row, its keys listed: (blocks, offsets) each (K,) -> (1, H, K, D)
            return [pool[layer][self.keys[0], :, self.keys[1]].transpose(0, 1)[None] for pool in (self.k, self.v)]
        nb = self.tables.shape[1]
        return [pool[layer][self.tables].transpose(1, 2).reshape(B, H, nb * self.block_size, D)[:, :, :self.span]
                for pool in (self.k, self.v)]                                           # from (B, nb, H, bs, D)
