"""Decode steps of fixed shapes over a slot cache, so that a GPU replays each as one CUDA graph (as vLLM does).

The engine's cache holds one slot of max_len positions per sequence (PagedKVCache with block_size = max_len).
The sequences that decode are kept in slots 0..D-1, in order: a sequence whose prompt is done moves into slot
D, and when one finishes the last one moves into its slot (its filled positions are copied, a few MB on a
GPU). A step then reads every decoding row's keys as one view of the cache, cache[:B, :, :span], with no
gather and no block table, and its shapes depend only on (B, span): B the batch rounded up to a bucket (1,
2, 4, 8, 16, 32, then steps of 32), span the longest row rounded up to a power of two (at least 64, at most
max_len). Rows past D are padding: token 0 at position max_len - 1 of their slot, a position every sequence
writes before it reads it, so they disturb no one, and their logits are dropped.

On CUDA with Triton the attention of a step is one kernel per layer instead (kernels/decode_attention.py: it
writes the new key and value and reads each row's own keys, padding rows none), so a step's shapes depend on B
alone: span is max_len throughout, and no mask is built.

On CUDA each (B, span) is captured once into a CUDA graph, at start-up within a time bound (reported) or on
its first use, and a step is one host-to-device copy of the ids and positions, one replay, and the sampler's
one copy back. Each step also takes every row's argmax and, on the device, makes it the row's next input at the
next position (padding rows stay put): so greedy rows can run several steps with no host work between them
(`steps`, vLLM's multi-step decode), the host's per-step work (inputs, launch, sampling, emitting) paid once
per burst instead of once per token. On the CPU the same steps run eagerly (tested against the engine's paged
path); the CPU's native decode (GPT2.decode_slots) needs none of this.
"""

import contextlib
import os
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..kernels import decode_attention
from ..model import GPT2
from .sampling import greedy

# On CUDA the engine's attention (masked: paged prefill, these steps) runs on the memory-efficient, flash or
# math kernels, not cuDNN's: cuDNN planned anew for every new shape (1.1 ms a call, 57% of the host time of
# a batch-256 run, issue 18), and prefill's packed rows have a new shape every step.
GPU_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
# A decode step's attention: "triton" (kernels/decode_attention.py: the KV write and each row's own keys in one
# kernel) where it runs (CUDA with Triton), else "sdpa" (the write, then SDPA under a mask over the span).
# GPT2FFN_DECODE_ATTENTION=sdpa forces SDPA, for A/B.
DECODE_ATTENTION = os.environ.get("GPT2FFN_DECODE_ATTENTION", "triton")


# Greedy steps a decode burst runs at most (StaticDecoder.steps; vLLM's num_scheduler_steps); GPT2FFN_DECODE_BURST
# sets it (1: the host between every two steps; 0: no bursts, every step's logits through the sampler), for A/B.
MAX_BURST = max(0, int(os.environ.get("GPT2FFN_DECODE_BURST", 8)))


def attention_kernels(device):
    """The context the engine's steps run in: on CUDA, SDPA without cuDNN (GPU_ATTENTION)."""
    return sdpa_kernel(GPU_ATTENTION) if torch.device(device).type == "cuda" else contextlib.nullcontext()


def batch_buckets(max_batch: int) -> list:
    """1, 2, 4, 8, 16, 32, then steps of 32, up to and including max_batch."""
    out = [b for b in (1, 2, 4, 8, 16) if b < max_batch] + list(range(32, max_batch, 32))
    return out + [max_batch]


def span_buckets(max_len: int) -> list:
    """Powers of two from 64 below max_len, then max_len."""
    out, s = [], 64
    while s < max_len:
        out.append(s)
        s *= 2
    return out + [max_len]


def first_at_least(buckets: list, n: int) -> int:
    return next(b for b in buckets if b >= n)


class _SlotView:
    """The cache GPT2.forward_paged is given: write each row's new key and value at its position of its slot
    (rows: each row's slot, b in a batched step), return the rows' slots' first `span` positions (views of slots
    0..B-1, or gathered where `gather`: one row in any slot). Where `attends`, the attention layers hand it the
    whole step instead (attend: write and attend in one kernel)."""

    def __init__(self, cache, rows, positions, span: int, attends: bool = False, past=None, gather=False):
        self.cache, self.rows, self.positions, self.span = cache, rows, positions, span
        self.attends, self.past = attends, past  # past: the keys before each row's new one that attend reads
        self.gather = gather

    def bind(self, *args):
        pass

    def attend(self, layer: int, q, k, v, scale):
        """q, k, v (B, H, 1, D) of rows 0..B-1 -> attention output (B, 1, H * D), the new k, v written."""
        return decode_attention.decode_attention(q, k, v, self.cache.k[layer], self.cache.v[layer], self.positions,
                                                 scale, self.past, self.rows)

    def update(self, layer: int, k, v):
        B = k.shape[0]
        for pool, new in ((self.cache.k[layer], k), (self.cache.v[layer], v)):
            pool[self.rows, :, self.positions] = new[:, :, 0].to(pool.dtype)      # (B, H, D) at (slot, position)
        if self.gather:
            return [pool[layer][self.rows, :, :self.span] for pool in (self.cache.k, self.cache.v)]
        return self.cache.k[layer][:B, :, :self.span], self.cache.v[layer][:B, :, :self.span]


class FreshSlots:
    """The cache GPT2.forward_paged is given for prompts from their first token, row i in slot slots[i], as one
    (C, T) batch right-padded to the longest (the engine's prefill where sequences have slots): each layer's
    keys and values go into positions 0..T-1 of the rows' slots in one write each and come back as the cache
    holds them (rounded to its dtype, as later steps read them), for causal attention over the row's own new
    keys (flash SDPA on CUDA: no mask, no gather). The padding's keys land past the prompts, where a sequence
    writes each position before it reads it."""

    attends = False

    def __init__(self, cache, slots):
        self.cache, self.slots = cache, slots

    def bind(self, *args):
        pass

    def update(self, layer: int, k, v):
        T = k.shape[2]
        k, v = k.to(self.cache.k[layer].dtype), v.to(self.cache.v[layer].dtype)
        self.cache.k[layer][self.slots, :, :T] = k                          # (C, H, T, D) into C slots
        self.cache.v[layer][self.slots, :, :T] = v
        return k, v


class StaticDecoder:
    """One-token steps of the rows in slots 0..D-1 (see the module's docstring). rows: the decoding requests,
    row i in slot i (request.blocks == [i]). graphs (CUDA only): replay each shape as a CUDA graph, captured
    by capture() at start-up or else on its first use. each_row (batch-invariant mode): the only shape is one
    row, and a step runs it for each row in turn, in that row's slot (step_each): a row's sums never see
    another's, and a GPU replays one small graph per row instead of launching every op of every row."""

    def __init__(self, model: GPT2, cache, max_batch: int, graphs: bool = False, each_row: bool = False):
        self.model, self.cache = model, cache
        self.max_len = cache.block_size
        self.each_row = each_row
        self.buckets = [1] if each_row else batch_buckets(min(max_batch, cache.num_blocks))
        device = cache.k[0].device
        self.use_graphs = graphs and device.type == "cuda"
        self.attends = DECODE_ATTENTION == "triton" and decode_attention.available(device)
        self.spans = [self.max_len] if self.attends else span_buckets(self.max_len)  # the kernel reads no span
        top = self.buckets[-1]
        # ids, positions, keys to read (the position for a row, 0 for padding), 1 for a row (0 for padding), the
        # row's slot (row b's is b, but for each_row's one row): the step's inputs, in place (a graph reads these
        # addresses); pinned host staging
        self.io = torch.zeros(5, top, dtype=torch.long, device=device)
        self.host = torch.zeros(5, top, dtype=torch.long, pin_memory=self.use_graphs)
        self.host_np = self.host.numpy()  # the same memory: numpy writes cost a fraction of torch's indexing
        self.host_np[4] = range(top)
        self.io.copy_(self.host)
        self.each = None  # each_row: every row's inputs on the device, (5, rows), one column a replay
        self.no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        self.logits = None  # (top, vocab): every graph's output, one buffer (not one per shape)
        self.next_ids = torch.zeros(top, dtype=torch.long, device=device)  # each step's argmax per row
        self.max_burst = MAX_BURST  # (0: no bursts, every step through the sampler)
        self.ahead = 0  # steps of a burst computed but not yet emitted (Engine.emit_steps)
        self.ring = torch.zeros(MAX_BURST, top, dtype=torch.long, device=device)  # a burst's argmaxes
        self.rows = []
        self.graphs = {}    # (B, span) -> CUDAGraph, or None where its capture failed (then eager)
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.capture_s, self.capture_error = 0.0, None

    # -- the slots ----------------------------------------------------------------------------------------
    def _copy(self, src: int, dst: int, n: int):
        """Positions 0..n-1 of slot src into slot dst, every layer."""
        for pool in (*self.cache.k, *self.cache.v):
            pool[dst, :, :n] = pool[src, :, :n]

    def _swap(self, a: int, na: int, b: int, nb: int):
        for pool in (*self.cache.k, *self.cache.v):
            keep = pool[a, :, :na].clone()
            pool[a, :, :nb] = pool[b, :, :nb]
            pool[b, :, :na] = keep

    def filled(self, r) -> int:
        """Positions of r's slot that may hold its keys: its prompt so far and its tokens (the last one's
        position is written by the step that reads it, maybe already this step), and while a burst's tokens are
        being emitted, the positions its steps not yet emitted have written (`ahead`)."""
        return min(r.computed + len(r.output) + self.ahead, self.max_len)

    def add(self, r, running: list):
        """r's prompt is done: move it into slot D (swapping with a sequence still in prefill there)."""
        d, s = len(self.rows), r.blocks[0]
        if s != d:
            other = next((q for q in running if q is not r and q.blocks and q.blocks[0] == d), None)
            if other is None:  # slot d is free: take it, free r's
                self._copy(s, d, self.filled(r))
                free = self.cache.free
                free[free.index(d)] = s
            else:
                self._swap(s, self.filled(r), d, self.filled(other))
                other.blocks = [s]
            r.blocks = [d]
        self.rows.append(r)

    def holds(self, r) -> bool:
        return bool(r.blocks) and r.blocks[0] < len(self.rows) and self.rows[r.blocks[0]] is r

    def remove(self, r):
        """r stops decoding: the last row moves into its slot; r is left holding the slot that frees."""
        if not self.holds(r):
            return
        i, last = r.blocks[0], self.rows[-1]
        if last is not r:
            self._copy(last.blocks[0], i, self.filled(last))
            self.rows[i] = last
            r.blocks, last.blocks = last.blocks, [i]
        self.rows.pop()

    # -- the step -----------------------------------------------------------------------------------------
    def advance(self, logits, B: int):
        """After a step: each row's argmax (the sampler's greedy pick) into next_ids, and for rows 0..D-1 (io[3])
        as the next step's input at the next position. A step whose inputs the host writes overwrites them."""
        ids = greedy(logits)
        valid = self.io[3, :B]
        self.next_ids[:B] = ids
        self.io[0, :B] = ids * valid
        self.io[1:3, :B] += valid

    def forward(self, B: int, span: int):
        """The model over inputs io[:, :B], row b in slot io[4, b] (b, but for step_each's one row) -> logits (B,
        vocab): fixed shapes for (B, span)."""
        ids, positions = self.io[0, :B, None], self.io[1, :B, None]                      # (B, 1)
        if self.attends:  # the layers hand their attention to the view: no mask is read
            mask = self.no_mask
        else:
            mask = (torch.arange(span, device=ids.device) <= positions)[:, None, None]  # (B, 1, 1, span)
        view = _SlotView(self.cache, self.io[4, :B], positions[:, 0], span, self.attends, self.io[2, :B],
                         gather=self.each_row)
        return self.model.forward_paged(ids, positions, view, None, "last", mask)

    def _rows_into(self, host) -> list:
        """Every row's last token, position (and keys read), 1 into columns 0..D-1 of host (numpy, (5, >= D));
        -> the positions."""
        d = len(self.rows)
        positions = [len(r.prompt) + len(r.output) - 1 for r in self.rows]
        host[0, :d] = [r.output[-1] for r in self.rows]
        host[1, :d] = host[2, :d] = positions
        host[3, :d] = 1
        return positions

    def _inputs(self, k: int = 1) -> tuple:
        """Every row's last token and position into io, for k steps: -> (rows D, batch bucket B, span)."""
        d, host = len(self.rows), self.host_np
        positions = self._rows_into(host)
        host[0, d:], host[1, d:], host[2, d:], host[3, d:] = 0, self.max_len - 1, 0, 0
        self.io.copy_(self.host, non_blocking=True)  # the whole buffer: a strided part would bypass the pinned copy
        return d, first_at_least(self.buckets, d), first_at_least(self.spans, max(positions) + k)

    def _run(self, B: int, span: int):
        """One step of shape (B, span) from io: logits into self.logits[:B] (eager: returned), argmax advanced."""
        if self.use_graphs and (B, span) not in self.graphs:
            self._capture(B, span)  # first use: the inputs are real; warm-up writes the same keys (no advance)
        graph = self.graphs.get((B, span))
        if graph is None:
            logits = self.forward(B, span)
            self.advance(logits, B)
            return logits
        graph.replay()
        return self.logits[:B]

    def step(self) -> torch.Tensor:
        """The next-token logits of every decoding row, (D, vocab), row i that of self.rows[i]; next_ids[:D] their
        argmaxes."""
        if self.each_row:
            return self.step_each()
        d, B, span = self._inputs()
        return self._run(B, span)[:d]

    def step_each(self) -> torch.Tensor:
        """Batch-invariant: every row's inputs sent in one copy, then for each row the one-row step in its own slot
        (on a GPU one graph replay: its inputs copied in on the device, its logits out) -> (D, vocab)."""
        d = len(self.rows)
        if not d:
            return self.io.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32)
        if self.each is None or self.each.shape[1] < d:  # grown to the most rows seen, pinned staging with it
            self.each = self.io.new_zeros(5, 2 * d)
            self.each_host = torch.zeros(5, 2 * d, dtype=torch.long, pin_memory=self.use_graphs)
        rows = self.each_host.numpy()
        positions = self._rows_into(rows)
        rows[4, :d] = range(d)
        self.each.copy_(self.each_host, non_blocking=True)  # (the sampler's copy back ends the step before the next)
        out = None
        for i in range(d):  # the row's own span bucket: how many keys a row's attention sums is its own
            self.io[:, :1].copy_(self.each[:, i:i + 1])
            logits = self._run(1, first_at_least(self.spans, positions[i] + 1))
            if out is None:
                out = logits.new_empty(d, logits.shape[-1])
            out[i] = logits[0]
        return out

    def steps(self, k: int) -> list:
        """k greedy steps of every row with no host work between them (each step's argmax the next one's input,
        on the device), one copy back: -> the k steps' tokens, k lists of D. Every row must have room for k more
        positions in its slot; a row that ends midway (EOS, a stop) computed its further steps for nothing."""
        d, B, span = self._inputs(k)
        if k > self.ring.shape[0]:
            self.ring = self.ring.new_zeros(k, self.ring.shape[1])
        for i in range(k):
            self._run(B, span)
            self.ring[i, :B].copy_(self.next_ids[:B])
        return self.ring[:k, :d].tolist()

    @torch.no_grad()
    def capture(self, seconds: float = 60.0) -> tuple:
        """CUDA graphs of every (B, span), the smallest batches first (the most launch-bound), sharing one
        memory pool, until `seconds` have passed (the rest are captured on first use); -> (graphs captured, of
        how many shapes, seconds taken). The inputs are the padding rows' (every slot's last position, rewritten
        before any sequence reads it)."""
        start = time.perf_counter()
        self.host[0], self.host[1], self.host[2], self.host[3] = 0, self.max_len - 1, 0, 0
        self.host[4] = torch.arange(self.host.shape[1])
        self.io.copy_(self.host)
        shapes = [(B, s) for B in self.buckets for s in self.spans]
        for B, span in shapes:
            if time.perf_counter() - start > seconds:
                break
            self._capture(B, span)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        return sum(g is not None for g in self.graphs.values()), len(shapes), self.capture_s

    def _capture(self, B: int, span: int):
        """One shape's graph, its logits into self.logits[:B]; a shape that fails to capture runs eagerly."""
        try:
            with attention_kernels("cuda"):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm up: cuBLAS workspaces, attention kernels' choices
                    for _ in range(2):
                        out = self.forward(B, span)
                torch.cuda.current_stream().wait_stream(side)
                if self.logits is None:
                    self.logits = torch.empty(self.buckets[-1], out.shape[-1], dtype=out.dtype, device=out.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.logits[:B].copy_(self.forward(B, span))
                    self.advance(self.logits[:B], B)
            self.graphs[B, span] = graph
        except RuntimeError as e:  # e.g. out of memory: this shape stays eager
            self.graphs[B, span] = None
            self.capture_error = f"{type(e).__name__}: {e}"
