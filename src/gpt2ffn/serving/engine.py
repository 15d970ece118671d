"""The continuous-batching engine (Orca, OSDI 2022): one step() admits waiting requests, prefills them in
chunks, then advances every running sequence by one token in one batched forward pass.

The engine knows nothing of HTTP. The server and `gpt2ffn.generate` both call add() and step(); a
`Loop` thread drives step() for the server. Each request has its own Sampling, and a seeded one its own
stream of draws (a function of its seed and its token count, sampling.uniforms), so what runs beside it does
not change its tokens (temperature 0: the same argmax; seeded: the same draws).
"""

import atexit
import itertools
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import Gpt2ffnError
from ..kernels.formats import make_resident
from ..model import GPT2
from .kv_cache import PagedKVCache
from .sampling import Sampling, logprobs_of, next_tokens
from .static import FreshSlots, StaticDecoder, attention_kernels
from .text import TextStream

# Prefill tokens per step. GPT-2 small, 512-token prompt: chunks of 128 and 256 prefill equally fast (2.2 s),
# 32 and 64 are 50% and 25% slower; 128 stalls the running streams half as long as 256 (README, "Serving").
# A GPU prefills thousands of tokens in the time a step's launches take: there a step takes up to 8192 (vLLM's
# max_num_batched_tokens), so 256 prompts of 128 tokens are admitted in 4 steps, not 256. On an H200 (bf16,
# 124M, benchmarks/gpu_engine_ab.py) 8192 against 2048: batch 256 94,133 against 71,238 tokens/s, batch 32
# 33,508 against 27,428, batch 1 the same. GPT2FFN_CUDA_CHUNK sets it, for A/B.
CHUNK = 128
CUDA_CHUNK = int(os.environ.get("GPT2FFN_CUDA_CHUNK", 8192))
# An offline batch (every prompt known up front: gpt2ffn.generate, bench --model) has no streams that a long
# prefill step would keep waiting: on CUDA it prefills up to this many tokens a step, 256 prompts of 128 in one.
# A second run on that H200: 32768 against 8192, batch 256 105,722 against 85,993 tokens/s.
OFFLINE_CUDA_CHUNK = 32768
# Those budgets are for prompts in their slots (static decode: padded batches, no mask). Chunks packed into one
# row under a mask (no slots: tensor-parallel, GPT2FFN_FRESH_PREFILL=0) build a (T, T) mask, 64 MiB at 8192 and
# 1 GiB at 32768: they keep 2048 a step on CUDA.
PACKED_CUDA_CHUNK = 2048
# Where sequences have slots (static decode), prompts from their start are prefilled as padded batches
# (Engine.prefill_fresh), which add at most PAD_WASTE of padding tokens; GPT2FFN_FRESH_PREFILL=0 packs them as
# the other chunks are instead, for A/B.
PAD_WASTE = 0.25
FRESH_PREFILL = os.environ.get("GPT2FFN_FRESH_PREFILL", "1") != "0"


KV_FRACTION = {"cpu": 0.25, "cuda": 0.8}


def free_memory(device) -> int:
    """Bytes free now where the cache will live: the device's (torch.cuda.mem_get_info, after the weights are
    loaded) or the host's available pages."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4 << 30


def prefill_budget(device, fresh: bool, offline: bool) -> int:
    """Prompt tokens a prefill step takes by default: CHUNK on the CPU; on CUDA, prompts in their slots as padded
    batches (fresh): CUDA_CHUNK, or OFFLINE_CUDA_CHUNK for an offline batch; chunks packed under a mask:
    PACKED_CUDA_CHUNK."""
    if torch.device(device).type != "cuda":
        return CHUNK
    if not fresh:
        return PACKED_CUDA_CHUNK
    return OFFLINE_CUDA_CHUNK if offline else CUDA_CHUNK


def default_kv_tokens(cfg, max_batch: int, dtype, slots: bool = False, device="cpu",
                      fraction: float | None = None, max_len: int | None = None) -> int:
    """Positions of KV cache: room for max_batch sequences of max_len positions (default: the full context),
    or what `fraction` of the free memory holds if that is less (as vLLM's gpu_memory_utilization, but of what
    is free after the weights). Default fraction: a quarter of the host's free memory on the CPU, at most 2 GiB
    (requests reserve only prompt + max_tokens, so short ones share what a full context would take; slots,
    max_len positions per sequence, lift the 2 GiB cap); 0.8 of the GPU's free memory on CUDA. Never less than
    one sequence of max_len."""
    kind = torch.device(device).type
    if fraction is not None and not 0 < fraction <= 1:
        raise Gpt2ffnError(f"the KV cache fraction of free memory must be in (0, 1], got {fraction!r}")
    per_token = 2 * cfg.n_layer * cfg.n_embd * torch.finfo(dtype).bits // 8
    cap = free_memory(device) * (fraction or KV_FRACTION.get(kind, 0.25))
    if fraction is None and kind == "cpu" and not slots:
        cap = min(cap, 2 << 30)
    max_len = max_len or cfg.n_positions
    return max(min(max_batch * max_len, int(cap // per_token)), max_len)


class QueueFull(Gpt2ffnError):
    """More requests are waiting than max_waiting allows."""


class TooMany(Gpt2ffnError):
    """More sequences at once than the server holds (max batch + max waiting): no retry could fit them."""


@dataclass
class Token:
    """One generated token of one request, as step() reports it."""

    request: "Request"
    id: int
    logprob: float | None = None
    top: tuple = ((), ())         # (ids, log-probs) of the most likely tokens, when asked for
    text: str = ""                # new text safe to show (never part of a stop string)
    finish_reason: str | None = None  # "stop", "length" or "abort" on the request's last event
    gap: float | None = None      # seconds since the request's previous token


@dataclass
class Request:
    prompt: list                   # token ids
    params: Sampling
    sink: object = None            # called with each Token (the server's bridge to its event loop)
    id: int = field(default_factory=itertools.count().__next__)
    output: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)  # [(log-prob, (top ids, top log-probs))] per prompt token
    computed: int = 0              # prompt tokens in the cache
    blocks: list = field(default_factory=list)
    text: object = None            # TextStream when the engine has a decode function
    finish_reason: str | None = None
    cancelled: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None


class Engine:
    """Continuous batching over a paged KV cache. max_batch: sequences decoded together; max_waiting:
    requests queued beyond them (more: QueueFull); kv_tokens: size of the cache pool in positions
    (default: default_kv_tokens, with kv_fraction of the free memory);
    max_len: the longest prompt + max_new_tokens it takes (default n_positions); batch_invariant: each
    row's logits bitwise independent of its batch mates (see decode_step); static_decode: decode steps of
    fixed shapes over slots (serving/static.py; default: on CUDA; batch-invariant: one row a step), replayed as CUDA
    graphs there unless cuda_graphs is False (captured at start-up for up to graph_seconds, the rest on
    first use); chunk: prompt tokens a prefill step takes (default: prefill_budget; offline: every request is
    added up front and nobody streams, as generate() and bench)."""

    def __init__(self, model: GPT2, decode=None, max_batch: int = 64, max_waiting: int = 256,
                 kv_tokens: int | None = None, chunk: int | None = None, block_size: int = 16,
                 max_len: int | None = None,
                 batch_invariant: bool = False, metrics=None, kv_fraction: float | None = None,
                 static_decode: bool | None = None, cuda_graphs: bool = True, graph_seconds: float = 60.0,
                 offline: bool = False):
        cfg = model.config
        self.model, self.decode, self.metrics = model, decode, metrics
        weight = model.transformer.wte.weight
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.batch_invariant = batch_invariant
        with torch.no_grad():
            # The native decode block (kernels/, gpt2ffn._C) reads each sequence's cache as one contiguous slot:
            # then a block is a whole context. It is batch-invariant by construction (each row's LayerNorm,
            # GEMV sums, attention over its own slot in one fixed order), so it serves that mode too.
            self.fused = model.fused_decode()
        self.max_len = min(max_len or cfg.n_positions, cfg.n_positions)
        if static_decode is None:
            static_decode = weight.device.type == "cuda" and not self.fused
        slots = self.fused or static_decode
        if slots:  # one slot of max_len positions per sequence
            block_size = self.max_len
        kv_tokens = kv_tokens or default_kv_tokens(model.kv_config, max_batch, model.kv_dtype, slots=slots,
                                                   device=weight.device, fraction=kv_fraction, max_len=self.max_len)
        self.cache = PagedKVCache(model.kv_config, -(-kv_tokens // block_size), block_size, model.kv_dtype,
                                  weight.device)
        self.device = weight.device
        # batch-invariant: each row's step alone, in its slot (StaticDecoder.step_each: on a GPU one graph a row)
        self.static = (StaticDecoder(model, self.cache, max_batch, cuda_graphs, each_row=batch_invariant)
                       if static_decode else None)
        self.fresh_prefill = FRESH_PREFILL and self.static is not None and not batch_invariant
        self.chunk = chunk or prefill_budget(weight.device, self.fresh_prefill, offline)
        self.graph_capture = None  # (CUDA graphs captured at start-up, of how many shapes, seconds)
        if self.static is not None and self.static.use_graphs and graph_seconds > 0:
            self.graph_capture = self.static.capture(graph_seconds)
        self.generator = torch.Generator()  # the draws of requests without a seed (on the host, sampling.uniforms)
        self.generator.seed()
        self.waiting, self.running = deque(), []
        self.lock = threading.Lock()

    # -- requests in ------------------------------------------------------------------------------------
    def check(self, prompt: list, s: Sampling):
        cfg = self.model.config
        if not prompt:
            raise Gpt2ffnError("every prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= cfg.vocab_size:
            raise Gpt2ffnError(f"token ids must be in [0, {cfg.vocab_size}); got min {min(prompt)}, max {max(prompt)}")
        bad = [t for t in s.logit_bias if t >= cfg.vocab_size]
        if bad:
            raise Gpt2ffnError(f"logit_bias: key {bad[0]} is not a token id in [0, {cfg.vocab_size})")
        if len(prompt) + s.max_new_tokens > self.max_len:
            raise Gpt2ffnError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({s.max_new_tokens}) exceeds the "
                               f"context of {self.max_len} positions")
        if self.cache.blocks_for(len(prompt) + s.max_new_tokens) > self.cache.num_blocks:
            raise Gpt2ffnError(f"prompt + max_new_tokens ({len(prompt) + s.max_new_tokens}) exceed the KV cache "
                               f"of {self.cache.num_blocks * self.cache.block_size} positions")

    def add(self, *requests: Request):
        """Queue requests (all or none). Raises QueueFull beyond max_waiting, Gpt2ffnError on bad input."""
        for r in requests:
            self.check(r.prompt, r.params)
            if self.decode is not None:
                r.text = TextStream(self.decode, r.params.stop)
        if len(requests) > self.max_batch + self.max_waiting:  # no retry could fit them
            raise TooMany(f"{len(requests)} sequences at once exceed what this server holds: {self.max_batch} "
                               f"running (max batch) + {self.max_waiting} waiting (max waiting)")
        with self.lock:
            # a request the next step admits to a free slot of the batch is not waiting for room
            if len(self.running) + len(self.waiting) + len(requests) > self.max_batch + self.max_waiting:
                raise QueueFull(f"{len(self.running)} running and {len(self.waiting)} waiting; {len(requests)} more "
                                f"would exceed the {self.max_batch + self.max_waiting} it holds: max batch "
                                f"{self.max_batch} + max waiting {self.max_waiting}")
            self.waiting.extend(requests)

    def abort(self, request: Request):
        """Stop a request at the next step (any thread)."""
        request.cancelled = True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def counts(self) -> tuple:
        """(running, waiting, KV blocks in use)."""
        return len(self.running), len(self.waiting), self.cache.num_blocks - len(self.cache.free)

    # -- one iteration ----------------------------------------------------------------------------------
    @torch.no_grad()  # not inference_mode: kernels/ keeps buffers that later plain calls write into
    def step(self) -> list:
        """Admit, prefill up to one chunk of tokens, decode every running sequence once (or a burst of greedy steps,
        decode_step); return the Tokens."""
        events = []
        for r in [r for r in self.running if r.cancelled]:
            events.append(self.finish(r, "abort"))
        with self.lock:
            for r in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(r)
                events.append(Token(r, -1, finish_reason="abort"))
            while self.waiting and len(self.running) < self.max_batch:
                r = self.waiting[0]
                r.blocks = self.cache.allocate(len(r.prompt) + r.params.max_new_tokens)
                if r.blocks is None:
                    break  # the pool is full: it waits for a running sequence to finish
                self.running.append(self.waiting.popleft())
        decoding = [r for r in self.running if r.computed == len(r.prompt)]
        with attention_kernels(self.device):
            events += self.prefill([r for r in self.running if r.computed < len(r.prompt)])
            if decoding:
                events += self.decode_step(decoding)
        if self.metrics is not None:
            self.metrics.step(self, len(decoding), events)
        return events

    def table(self, rows: list, lengths: list):
        """(B, nb) the blocks holding each row's first `length` positions, padded with its first block."""
        used = [r.blocks[:self.cache.blocks_for(n)] for r, n in zip(rows, lengths)]
        nb = max(len(u) for u in used)
        return torch.tensor([u + u[:1] * (nb - len(u)) for u in used], device=self.device)

    def prefill(self, rows: list) -> list:
        """Whole chunks (a prompt is cut at multiples of `chunk`, whatever else runs) up to `chunk` tokens in
        all, but at least one chunk, so a long prompt delays the running streams by one chunk at most. The
        chunks run together in one forward (the native step: each in its own slot, one call; else packed into
        one row), except echo's (all positions' logits) and in batch-invariant mode (each chunk alone, so its
        sums cannot depend on the others)."""
        plan, budget = [], self.chunk
        for r in rows:
            n = min(self.chunk, len(r.prompt) - r.computed)
            if n > budget and budget < self.chunk:
                break
            budget -= n
            plan.append((r, r.computed, n))
        alone = [p for p in plan if self.batch_invariant or p[0].params.prompt_logprobs]
        packed = [p for p in plan if p not in alone]
        events = [ev for p in alone for ev in self.prefill_alone(*p)]
        if self.fresh_prefill:  # one slot per sequence: prompts from their start as padded batches
            for group in pad_groups([p for p in packed if p[1] == 0]):
                events += self.prefill_fresh(group)
            packed = [p for p in packed if p[1] != 0]
        if not packed:
            return events
        # the native step: every chunk in its sequence's slot, in one call (GPT2.prefill_slots)
        return events + (self.prefill_slots(packed) if self.fused else self.prefill_packed(packed))

    def prefill_slots(self, chunks: list) -> list:
        """Chunks of several prompts in one native call, each in its sequence's slot: every weight read once for
        all of them; each row's sums as its chunk's alone (tests/test_decode_plan.py)."""
        ids = torch.tensor([t for r, s, n in chunks for t in r.prompt[s:s + n]])
        logits = self.model.prefill_slots(ids, [s for _, s, _ in chunks], [r.blocks[0] for r, _, _ in chunks],
                                          [n for _, _, n in chunks], self.cache.k, self.cache.v)
        return self.prefilled(chunks, logits)

    def prefill_packed(self, chunks: list) -> list:
        """Chunks of several prompts as one row of sum(n) tokens; each token attends its own sequence only."""
        ids, positions, slot_block, slot_off, key_block, key_off, key_pos, key_seq, q_seq = packed_inputs(
            chunks, self.cache.block_size, self.device)
        mask = ((key_seq[None] == q_seq[:, None]) & (key_pos[None] <= positions[:, None]))[None, None]  # (1, 1, T, K)
        last = list(itertools.accumulate(n for _, _, n in chunks))
        logits = self.forward(ids[None], positions[None], None, [e - 1 for e in last], mask, (slot_block, slot_off),
                              (key_block, key_off))
        return self.prefilled(chunks, logits)

    def prefill_fresh(self, chunks: list) -> list:
        """Chunks that start their prompts, each sequence in its slot (static decode's layout), as one (C, T) batch
        right-padded to the longest: causal attention over each row's own keys with no mask and no key gather
        (serving/static.FreshSlots), the inputs sent in one copy, each row's logits at its last token."""
        C, T = len(chunks), max(n for _, _, n in chunks)
        host = np.zeros(C * T + 2 * C, np.int64)
        ids = host[:C * T].reshape(C, T)
        for i, (r, _, n) in enumerate(chunks):
            ids[i, :n] = r.prompt[:n]
        host[C * T:C * T + C] = [r.blocks[0] for r, _, _ in chunks]
        host[C * T + C:] = [n - 1 for _, _, n in chunks]
        out = torch.from_numpy(host).to(self.device)
        ids, slots, last = out[:C * T].view(C, T), out[C * T:C * T + C], out[C * T + C:]
        positions = torch.arange(T, device=self.device).expand(C, T)
        logits = self.model.forward_paged(ids, positions, FreshSlots(self.cache, slots), None, last)
        return self.prefilled(chunks, logits)

    def prefilled(self, chunks: list, logits) -> list:
        """Chunks done, row i of logits chunk i's last position's: a prompt now whole emits its first token (those
        of every such prompt drawn together, as a decode step's)."""
        done = []
        for i, (r, _, n) in enumerate(chunks):
            r.computed += n
            if r.computed == len(r.prompt):
                done.append(i)
        first = [i for i in done if chunks[i][0].params.max_new_tokens > 0]
        emitted = {}
        if first:
            rows = logits if first == list(range(len(logits))) else logits[first]
            emitted = dict(zip(first, self.emit_all([chunks[i][0] for i in first], rows)))
        return [emitted[i] if i in emitted else self.finish(chunks[i][0], "length") for i in done]

    def prefill_alone(self, r: Request, start: int, n: int) -> list:
        ids = torch.tensor([r.prompt[start:start + n]], device=self.device)
        pos = torch.arange(start, start + n, device=self.device)[None]
        if self.fused and not r.params.prompt_logprobs:  # one native call, as a decode step
            logits = self.model.prefill_slot(ids[0], start, self.cache.k, self.cache.v, r.blocks[0])
        else:
            logits = self.forward(ids, pos, self.table([r], [start + n]),
                                  "all" if r.params.prompt_logprobs else "last")
        r.computed += n
        if r.params.prompt_logprobs:
            logits = logits[0]                                               # (n, V)
            if start == 0:
                r.prompt_logprobs.append((None, ((), ())))
            following = r.prompt[start + 1:start + n + 1]                    # the token each position predicts
            lp, top = logprobs_of(logits[:len(following)], following, r.params.logprobs or 0)
            r.prompt_logprobs += list(zip(lp, top))
            logits = logits[-1:]
        if r.computed < len(r.prompt):
            return []
        return [self.finish(r, "length") if r.params.max_new_tokens == 0 else self.emit(r, logits, 0)]

    def decode_step(self, rows: list) -> list:
        """Each row's last token in, its next token out: one (B, 1) forward (or B of them, batch-invariant, each in
        its slot with static decode), or with static decode a burst of up to static.max_burst greedy steps, each
        row's tokens of them out (burst)."""
        if self.static is not None:  # rows in slots 0..D-1, a fixed-shape step (a CUDA graph's replay on a GPU)
            if len(rows) != len(self.static.rows):  # the rows it holds are among these: some are new
                for r in rows:
                    if not self.static.holds(r):
                        self.static.add(r, self.running)
            rows = list(self.static.rows)
            k = self.burst(rows)
            if k:
                return self.emit_steps(rows, self.static.steps(k))
            logits = self.static.step()
        else:
            logits = self.step_logits(rows)
        return self.emit_all(rows, logits)

    def burst(self, rows: list) -> int:
        """Greedy steps the static rows take with no host work between them (StaticDecoder.steps): none unless
        every row picks plain greedy without log-probs; one while requests wait (a row that ends midway, at EOS or
        a stop, would keep its slot from them for the rest of the burst) or prompts are in prefill (they join at
        the next step); else up to static.max_burst (static.MAX_BURST), within every row's max_new_tokens."""
        most = 0 if self.static.each_row else self.static.max_burst
        kinds = {id(r.params): r.params for r in rows}.values()
        if not most or not all(s.plain_greedy and s.logprobs is None for s in kinds):
            return 0
        if self.waiting or len(self.running) > len(rows):
            return 1
        return max(1, min(most, min(r.params.max_new_tokens - len(r.output) for r in rows)))

    def emit_steps(self, rows: list, steps: list) -> list:
        """steps: k lists of every row's next token (StaticDecoder.steps): each emitted in turn, a row's tokens after
        it finishes dropped, and an aborted row's (abort() came during the burst: it ends at the next step). The
        burst's tokens share one time: a client gets them together (the metrics see gaps of 0 between them). A
        row that finishes midway frees its slot to the last row, whose keys the burst has already written further
        than its tokens so far: static.ahead says how far, so the move copies them."""
        now, events = time.perf_counter(), []
        try:
            for j, ids in enumerate(steps):
                self.static.ahead = len(steps) - j
                events += [self.emit(r, None, i, t, None, now) for i, (r, t) in enumerate(zip(rows, ids))
                           if r.finish_reason is None and not r.cancelled]
        finally:
            self.static.ahead = 0
        return events

    def emit_all(self, rows: list, logits) -> list:
        """Row i of logits (B, vocab) gives rows[i] its next token: one draw for the batch, the log-probs of the
        rows that ask in one pass, then each emitted."""
        picked = next_tokens(logits, rows, self.generator)
        asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        lps = {}
        if asked:  # the rows that report log-probs, in one log_softmax and one topk (of the most any asks)
            top = max(rows[i].params.logprobs for i in asked)
            chosen, tops = logprobs_of(logits[asked], [picked[i] for i in asked], top)
            for i, lp, (ids, vals) in zip(asked, chosen, tops):
                k = rows[i].params.logprobs
                lps[i] = (lp, (ids[:k], vals[:k]))
        now = time.perf_counter()
        return [self.emit(r, logits, i, picked[i], lps.get(i), now) for i, r in enumerate(rows)]

    def step_logits(self, rows: list):
        """(B, vocab): the next-token logits of rows in their own slots or blocks (the native step, B forwards
        of one row in batch-invariant mode, or one paged forward)."""
        ids = torch.tensor([[r.output[-1]] for r in rows], device=self.device)
        pos = torch.tensor([[len(r.prompt) + len(r.output) - 1] for r in rows], device=self.device)
        lengths = [len(r.prompt) + len(r.output) for r in rows]
        if self.fused:
            logits = self.model.decode_slots(ids[:, 0], pos[:, 0], self.cache.k, self.cache.v,
                                             torch.tensor([r.blocks[0] for r in rows], device=self.device))
        elif self.batch_invariant:  # each row through the same M=1 path: its logits cannot depend on the others
            logits = torch.cat([self.forward(ids[i:i + 1], pos[i:i + 1], self.table([r], lengths[i:i + 1]))
                                for i, r in enumerate(rows)])
        else:
            logits = self.forward(ids, pos, self.table(rows, lengths))    # (B, V)
        return logits

    def forward(self, ids, positions, tables, *args):
        """One forward pass of the model over the engine's paged cache (GPT2.forward_paged's arguments, less the
        cache): the one place a step runs the model (serving/tp.py broadcasts it to the other ranks)."""
        return self.model.forward_paged(ids, positions, self.cache, tables, *args)

    def close(self):
        """Called by the Loop thread when it ends (serving/tp.py releases the other ranks)."""

    def emit(self, r: Request, logits, row: int, token: int | None = None, lp=None, now=None) -> Token:
        """Row `row` of logits gave r its next token (picked here if None; its log-prob and top ones in lp when
        the step computed them; now: the step's time, else read here): append it, detokenize, finish r when it
        is done. Per row of every step: kept to few attribute reads (256 rows a step on a GPU)."""
        if token is None:
            token = next_tokens(logits[row:row + 1], [r], self.generator)[0]
        now = now or time.perf_counter()
        last, r.last_token = r.last_token, now
        if last is None:
            r.first_token = now
        out, s = r.output, r.params
        out.append(token)
        ev = Token(r, token, gap=None if last is None else now - last)
        if lp is not None:
            ev.logprob, ev.top = lp
        elif s.logprobs is not None:
            (ev.logprob,), (ev.top,) = logprobs_of(logits[row:row + 1], [token], s.logprobs)
        early = len(out) <= s.min_tokens
        eos = token in s.eos_ids and not s.ignore_eos  # an EOS that ends it has no text; with ignore_eos it is a
        stopped = (eos or token in s.stop_token_ids) and not early  # token like any other (config's EOS may be one)
        if r.text is not None and not eos:
            ev.text, hit = r.text.push(token)
            stopped = stopped or (hit and not early)
        if stopped or len(out) >= s.max_new_tokens:
            if r.text is not None:
                ev.text += r.text.finish()
            ev.finish_reason = self.finish(r, "stop" if stopped else "length").finish_reason
        return ev

    def finish(self, r: Request, reason: str) -> Token:
        r.finish_reason = reason
        self.running.remove(r)
        if self.static is not None:
            self.static.remove(r)
        self.cache.release(r.blocks)
        r.blocks = []
        return Token(r, -1, finish_reason=reason)

    def run(self, requests: list) -> list:
        """In-process use: add the requests, step until all finish, return them."""
        self.add(*requests)
        while any(r.finish_reason is None for r in requests):
            to_sinks(self.step())
        return requests


def pad_groups(chunks: list, waste: float = PAD_WASTE) -> list:
    """Chunks [(request, start, n)], longest first, cut into groups that padding to their longest grows by at most
    `waste` of their tokens (a group of one pads nothing)."""
    groups = []
    for c in sorted(chunks, key=lambda c: -c[2]):
        g = groups[-1] if groups else None
        if g and (len(g) + 1) * g[0][2] <= (1 + waste) * (sum(n for _, _, n in g) + c[2]):
            g.append(c)
        else:
            groups.append([c])
    return groups


def packed_inputs(chunks: list, block_size: int, device) -> list:
    """A packed prefill's inputs for chunks [(request, start, n)], built with array operations (no loop over tokens)
    and sent to `device` in one copy: ids, positions (T,) of the chunks' tokens; the block and offset where each is
    written (T,); for every key a chunk's tokens read (its sequence's positions 0 .. start + n - 1, K in all) its
    block, offset, position and chunk (K,); and each token's chunk (T,)."""
    n = np.array([c[2] for c in chunks], dtype=np.int64)
    start = np.array([c[1] for c in chunks], dtype=np.int64)
    span = start + n                                                    # keys each chunk reads
    T, K = int(n.sum()), int(span.sum())
    ids = np.fromiter(itertools.chain.from_iterable(r.prompt[s:s + m] for r, s, m in chunks), np.int64, T)
    q_seq = np.repeat(np.arange(len(chunks)), n)
    positions = np.arange(T) - np.repeat(np.cumsum(n) - n, n) + np.repeat(start, n)
    key_seq = np.repeat(np.arange(len(chunks)), span)
    key_pos = np.arange(K) - np.repeat(np.cumsum(span) - span, span)
    used = -(-span // block_size)                                      # each sequence's blocks in use
    table = np.fromiter(itertools.chain.from_iterable(r.blocks[:u] for (r, _, _), u in zip(chunks, used.tolist())),
                        np.int64, int(used.sum()))
    first = np.cumsum(used) - used                                     # where each sequence's blocks start
    slot_block = table[np.repeat(first, n) + positions // block_size]
    key_block = table[np.repeat(first, span) + key_pos // block_size]
    host = np.concatenate([ids, positions, slot_block, positions % block_size, q_seq,
                           key_block, key_pos % block_size, key_pos, key_seq])
    out = torch.from_numpy(host).to(device)
    tok, key = out[:5 * T].view(5, T), out[5 * T:].view(4, K)
    return [*tok[:4], *key, tok[4]]


def name_os_thread(name: str):
    """Give the calling thread `name` where the OS shows it (Linux: top -H, /proc/<pid>/task/*/comm; 15 bytes)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


SHUTTING_DOWN = "the server is shutting down"  # how a cut request's error event starts (http.py answers 503)


def to_sinks(events: list):
    """Each Token to its request's sink (the server's bridge to its event loop)."""
    for ev in events:
        if ev.request.sink is not None:
            ev.request.sink(ev)


def _halt_at_exit(ref):
    loop = ref()
    if loop is not None:
        loop.halt(SHUTTING_DOWN)


class Loop:
    """The thread that owns the engine for the server: it steps while there is work, sleeps otherwise, and
    passes each Token to its request's sink. Idle on the CPU, it first makes the KV cache resident a piece at
    a time (make_resident, ~2 MiB, a few ms: a request that comes meanwhile waits at most that), in the order
    sequences get its blocks: a fresh 1024-position slot at fp32 otherwise costs tens of ms of page faults in
    the prefill of the request that gets it. Until idle time has covered the cache, blocks not yet reached are
    faulted in on first use, as before; `cold` is None once it is all resident."""

    def __init__(self, engine: Engine, deliver=None):
        self.engine, self.wake, self.stopping = engine, threading.Condition(), False
        self.deliver = deliver or to_sinks  # a step's Tokens, all at once (serving/core.py ships them elsewhere)
        self.cutting = None  # a message: end every request with it at the next turn (shutdown's deadline)
        self.cold = engine.cache.pieces() if engine.device.type == "cpu" else None
        self.thread = threading.Thread(target=self.work, name="gpt2ffn-engine", daemon=True)
        self.thread.start()
        # Before the interpreter finalizes: a daemon thread still inside native code (an OpenMP region) when
        # Python tears down is killed by a forced unwind through C++ frames, which aborts the process
        # ("terminate called without an active exception", SIGABRT after a second Ctrl-C).
        atexit.register(_halt_at_exit, weakref.ref(self))  # weak: a Loop that is gone needs nothing

    def submit(self, *requests: Request):
        self.engine.add(*requests)
        with self.wake:
            self.wake.notify()

    def stop(self):
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join(30)

    def cut(self, message: str):
        """End every running and waiting request with an error event carrying message, from the engine's own
        thread at its next turn (between steps): the clients get it and their streams close properly. It stays:
        a request submitted after it is ended the same way."""
        with self.wake:
            self.cutting = message
            self.wake.notify()

    def halt(self, message: str):
        """cut, then stop and wait for the thread: what remains when the process exits."""
        if self.thread.is_alive():
            self.cut(message)
            self.stop()

    def work(self):
        name_os_thread("gpt2ffn-engine")
        while True:
            with self.wake:
                while not self.engine.has_work() and not self.stopping and self.cold is None:
                    self.wake.wait()
                cutting = self.cutting  # sticky: a request that comes after the cut is cut too
                if self.stopping and not self.engine.has_work():
                    self.engine.close()
                    return
            if cutting is not None and self.engine.has_work():
                self.deliver(self.fail_all(cutting))
                continue
            if not self.engine.has_work():  # idle, part of the cache not yet resident: one piece, then look again
                piece = next(self.cold, None)
                if piece is None or not make_resident(piece):
                    self.cold = None
                continue
            try:
                events = self.engine.step()
            except Exception as e:  # a bug must reach the clients as a 500, not kill the engine
                events = self.fail_all(f"{type(e).__name__}: {e}")
            self.deliver(events)

    def fail_all(self, message: str) -> list:
        e = self.engine
        with e.lock:
            victims = e.running + list(e.waiting)
            e.waiting.clear()
        if e.static is not None:  # no slot moves: every row goes (and after a device error they would fail too)
            e.static.rows.clear()
        for r in list(e.running):
            e.finish(r, "error")
        out = []
        for r in victims:
            r.finish_reason = "error"
            out.append(Token(r, -1, text=message, finish_reason="error"))
        return out
