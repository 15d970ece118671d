"""The whole GPT-2 around the FFN: attention, blocks, embeddings, tied lm_head.

Module names and state-dict keys equal HF GPT2LMHeadModel's (`transformer.h.0.attn.c_attn.weight`, ...),
so a state dict moves between the two unchanged. The FFN of each block is gpt2ffn's FeedForward. The KV
caches a forward pass writes into (serving/kv_cache.py) are passed in: the model holds no cache of its own.
"""

import contextlib
import dataclasses
import json
import math
import os
import re
import weakref
import zlib
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import Config
from .errors import ConfigError, Gpt2ffnError, InputError, ShapeError
from .ffn import FeedForward
from .kernels import add_layer_norm
from .kernels.packed import DecodePlan, causal_attention, runs_causal_attention
from .linear import Conv1D, PackedLayer, TrainChecked, building_uninitialized, check_trainable, raw, uninitialized
from .precision import check_precision, holds_once, quantize
from .weights import IGNORED, Checkpoint, cached_snapshot, hub_cache, load_tensors, resolve_checkpoint

# HF forward arguments that change nothing here when left at these values (what HF's own callers pass)
HF_NEUTRAL = {"use_cache": (None, True, False), "output_attentions": (None, False),
              "output_hidden_states": (None, False), "token_type_ids": (None,), "head_mask": (None,),
              "past_key_values": (None,), "inputs_embeds": (None,)}


@dataclasses.dataclass
class LMOutput:
    """What GPT2 answers HF's call with (input_ids=, labels=, return_dict=, ...), as HF's
    CausalLMOutputWithCrossAttentions: .logits (B, T, vocab), .loss (None without labels), out[0] the first of
    (loss, logits) that is set, out["logits"], to_tuple()."""
    logits: torch.Tensor
    loss: torch.Tensor | None = None

    def to_tuple(self) -> tuple:
        return tuple(v for v in (self.loss, self.logits) if v is not None)

    def keys(self) -> list:  # as HF's ModelOutput, an ordered dict of the fields that are set
        return [k for k in ("loss", "logits") if getattr(self, k) is not None]

    def __contains__(self, key) -> bool:
        return key in self.keys()

    def __iter__(self):
        return iter(self.keys())

    @property
    def past_key_values(self):
        raise AttributeError("gpt2ffn's GPT2 returns no past_key_values: keep a cache of your own "
                             "(model(ids, cache=KVCache(model.config, B, model.kv_dtype)), README) or call generate()")

    def __getitem__(self, key):
        if isinstance(key, str):  # as HF's ModelOutput: only the fields that are set
            if key not in ("logits", "loss") or getattr(self, key) is None:
                raise KeyError(key)
            return getattr(self, key)
        return self.to_tuple()[key]


def causal_mask(T: int, past: int, key_valid=None, device="cpu"):
    """Boolean (B or 1, 1, T, past + T): query i (at position past + i) sees key j <= past + i that is valid.

    As HF's mask: a padding query sees the valid keys before it (right padding), not itself; one with none
    (left padding) sees itself alone, so no row is empty (which would give NaN)."""
    q = torch.arange(past, past + T, device=device)[:, None]
    k = torch.arange(past + T, device=device)[None, :]
    mask = (k <= q)[None, None]                                  # (1, 1, T, S) causal
    if key_valid is not None:
        mask = mask & key_valid[:, None, None, :].bool()
        mask = mask | ~mask.any(-1, keepdim=True) & (k == q)[None, None]
    return mask


class CausalSelfAttention(TrainChecked):
    """c_attn -> q, k, v by head -> causal scaled_dot_product_attention -> c_proj."""

    def __init__(self, cfg: Config):
        super().__init__()
        cfg.check_heads()
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd
        self.scale = cfg.attn_scale  # layer -> the factor on q k^T (None: 1/sqrt(d/H))
        self.c_attn = Conv1D(cfg.n_embd, 3 * cfg.n_embd, cfg.initializer_range)
        self.c_proj = Conv1D(cfg.n_embd, cfg.n_embd, cfg.initializer_range)
        self.attn_dropout = nn.Dropout(cfg.attn_pdrop)
        self.resid_dropout = nn.Dropout(cfg.resid_pdrop)

    def qkv(self, x):
        """(B, T, C) -> q, k, v each (B, H, T, C/H), as HF splits c_attn's output."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        return [t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v)]

    @staticmethod
    def probs(q, k, mask=None, scale=None):
        """softmax(q k^T / sqrt(d/H)) (or q k^T * scale) under the causal (or given) mask: (B, H, T, S). For checks
        and teaching; forward() uses gpt2ffn._C.causal_attention (fp32 inference on the CPU) or
        scaled_dot_product_attention."""
        T, S = q.shape[2], k.shape[2]
        att = q @ k.transpose(-2, -1)
        att = att / math.sqrt(k.shape[-1]) if scale is None else att * scale
        if mask is None:
            mask = causal_mask(T, S - T, device=q.device)
        att = att.masked_fill(~mask, torch.finfo(att.dtype).min)
        return F.softmax(att, dim=-1)

    def forward(self, x, layer=0, cache=None, mask=None):
        T = x.shape[1]
        q, k, v = self.qkv(x)
        B = q.shape[0]
        scale = self.scale(layer)
        if T == 1 and getattr(cache, "attends", False) and not self.training:  # the cache's own decode kernel
            return self.project(cache.attend(layer, q, k, v, scale))          # (serving/static.py)
        if cache is not None:
            k, v = cache.update(layer, k, v)                       # (B, H, past + T, C/H)
        dropout = self.attn_dropout.p if self.training else 0.0
        if mask is None and runs_causal_attention(q, k, v, dropout):  # query i sees keys 0..past + i
            return self.project(causal_attention(q, k, v, scale))   # (an fp16 cache widened as it is read)
        if k.dtype != q.dtype:  # an fp16 cache (GPT2.kv_dtype): its values, widened exactly
            k, v = k.to(q.dtype), v.to(q.dtype)
        if mask is None and k.shape[2] == T:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale)
        elif mask is None and T == 1:  # one new token sees every cached key: no mask to build
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scale)
        else:
            if mask is None:
                mask = causal_mask(T, k.shape[2] - T, device=x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
        return self.project(y.transpose(1, 2).reshape(B, T, -1))   # (B, H, T, C/H) -> (B, T, C)

    def project(self, y):
        """The heads' outputs (B, T, C) -> c_proj -> dropout (parallel.py: this rank's heads, one all-reduce)."""
        return self.resid_dropout(self.c_proj(y))


class LMHead(PackedLayer, nn.Linear):
    """The logits layer, nn.Linear (weight [vocab, d], tied to wte); packed by gpt2ffn.quantize like Conv1D,
    at int8 where the model is int4 (it is wte, the most sensitive matrix)."""

    keeps_int8 = True

    def reset_parameters(self):
        if not building_uninitialized():
            super().reset_parameters()

    def weight_kn(self):
        return raw(self.weight).t()  # (a weight held once as stored: what its packed copy was stamped with)

    def param_layout(self, w_kn):
        return w_kn.t().contiguous()

    def forward(self, x):
        if self.runs_packed(x):
            y = self.matmul(x.reshape(-1, x.shape[-1]))             # (N, d) -> (N, vocab)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        self.check_fp32("a non-fp32 input (or train())")
        padded = self.padded_weight(x)
        if padded is not None:
            return F.linear(x, padded)[..., :self.weight.shape[0]]
        return super().forward(x)

    def padded_weight(self, x):
        """On CUDA, for inference: the weight with zero rows up to a multiple of 64, or None. GPT-2's 50,257 logits
        per row make an odd leading dimension, on which cuBLAS runs an unaligned kernel (cutlass 'align1': 200 us
        a call at batch 256 on an H200; padded, under 62 us). The copy is made once per weight and refreshed in
        place when the weight changes (load_state_dict, an optimizer step): CUDA graphs captured earlier keep
        reading the same memory, which the next eager call refreshes. Not for sharded (DTensor) weights."""
        w = self.weight
        V = w.shape[0]
        if not x.is_cuda or V % 64 == 0 or self.bias is not None or (torch.is_grad_enabled() and w.requires_grad):
            if not w.is_cuda:
                _PADDED.pop(self, None)  # moved off the GPU: let the copy go
            return None
        if _is_dtensor(w) or _is_dtensor(x):
            return None
        version = None if w.is_inference() else w._version  # inference tensors keep no version counter
        cached = _PADDED.get(self)
        if cached is not None and cached[0]() is w and cached[1] == (w.data_ptr(), version):
            return cached[2]
        rows = -(-V // 64) * 64
        if cached is not None and (cached[2].shape, cached[2].dtype, cached[2].device) == ((rows, w.shape[1]), w.dtype,
                                                                                          w.device):
            pad = cached[2]
        else:
            pad = torch.zeros(rows, w.shape[1], dtype=w.dtype, device=w.device)
        pad[:V] = w.detach()
        _PADDED[self] = (weakref.ref(w), (w.data_ptr(), version), pad)
        return pad


_PADDED = weakref.WeakKeyDictionary()  # LMHead -> (weakref to its weight, (pointer, version), padded copy)


def _is_dtensor(t) -> bool:
    """A torch.distributed DTensor (parallel.py's sharded weights), without importing torch.distributed here."""
    return type(t).__name__ == "DTensor"


class TiedEmbedding(nn.Embedding):
    """wte: an nn.Embedding whose weight is the lm_head's (tied). When the lm_head holds its weights only
    packed (weights held once), the embeddings are read from there, at the lm_head's precision, and
    state_dict / load_state_dict / .to() go through it."""

    def __init__(self, num, dim, head: LMHead):
        super().__init__(num, dim, _weight=torch.empty(num, dim) if building_uninitialized() else None)
        self.__dict__["head"] = head  # not a submodule: the lm_head is the model's

    def forward(self, ids):
        h = self.head
        if h.dropped or (h.hold_once and h.packed is not None and not h.training):  # re-packed first if stale
            if torch.is_grad_enabled() and h.weight.requires_grad:
                return PackedRows.apply(ids, h.weight, h)
            return h.rows(ids)                                     # (...) -> (..., d)
        return super().forward(ids)

    def train(self, mode: bool = True):
        if mode:
            check_trainable(self.head)  # its weight is the lm_head's: a bf16/int8/int4 one cannot train
        return super().train(mode)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        with torch._C.DisableTorchFunctionSubclass():  # (a held weight as stored: its values come below, once)
            super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.head.dropped:
            destination[prefix + "weight"] = self.head.weight_value()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.head.dropped and prefix + "weight" in state_dict:
            w = self.weight
            self.head.restore_weight(torch.empty(w.shape, dtype=w.dtype, device=w.device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        if self.head.dropped:
            self.head.restore_weight()
        return super()._apply(fn, *args, **kwargs)


class PackedRows(torch.autograd.Function):
    """wte's rows read from the packed lm_head, with wte's gradient (its rows' sums of dy), the fp32 values
    given back first as PackedMatmul gives them."""

    @staticmethod
    def forward(ctx, ids, weight, head):
        rows = head.rows(ids)
        ctx.head, ctx.packed = head, head.packed
        ctx.save_for_backward(ids)
        return rows

    @staticmethod
    def backward(ctx, dy):
        head, (ids,) = ctx.head, ctx.saved_tensors
        head.weight_for_grad("a gradient for wte", ctx.packed)
        dw = torch.zeros(head.weight.shape, dtype=dy.dtype, device=dy.device)
        return None, dw.index_add_(0, ids.reshape(-1), dy.reshape(-1, dy.shape[-1])), None


class Block(TrainChecked):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x)); mlp is gpt2ffn's FeedForward."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = FeedForward(cfg)

    def forward(self, x, layer=0, cache=None, mask=None):
        x = x + self.attn(self.ln_1(x), layer, cache, mask)
        return x + self.mlp(self.ln_2(x))


class Transformer(TrainChecked, nn.ModuleDict):
    """GPT2.transformer (wte, wpe, drop, h, ln_f), HF's names; train() refuses as GPT2's does."""


class Blocks(TrainChecked, nn.ModuleList):
    """GPT2.transformer.h; train() refuses as GPT2's does."""


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str | None = "cpu") -> str:
    """'auto' (CUDA when torch sees a GPU, else CPU), 'cpu', 'cuda' or 'cuda:N' -> the device to use."""
    name = name or "cpu"
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    kind, _, index = name.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if not torch.cuda.is_available():
        why = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
        raise ConfigError(f"device {name!r}: torch {torch.__version__} sees no CUDA device ({why}); "
                           "use --device cpu or auto")
    if index and int(index) >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r}: there are {torch.cuda.device_count()} CUDA devices")
    return name


class GPT2(TrainChecked):
    """GPT-2 with HF GPT2LMHeadModel's names; lm_head shares wte's weight. A bf16/int8/int4 model's train() refuses
    before any module is set to training (TrainChecked), on any of its parts as well."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg = Config.coerce(cfg)
        head = LMHead(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer = Transformer(dict(
            wte=TiedEmbedding(cfg.vocab_size, cfg.n_embd, head),
            wpe=nn.Embedding(cfg.n_positions, cfg.n_embd,
                             _weight=torch.empty(cfg.n_positions, cfg.n_embd) if building_uninitialized() else None),
            drop=nn.Dropout(cfg.embd_pdrop),
            h=Blocks([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon),
        ))
        self.lm_head = head
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        # The heads of the KV cache a forward pass writes (serving/kv_cache.py): parallel.py narrows it to a
        # rank's heads.
        self.kv_config = cfg
        for name, p in self.named_parameters():
            if (name.endswith("wte.weight") or name.endswith("wpe.weight")) and not building_uninitialized():
                nn.init.normal_(p, std=cfg.initializer_range)

    def embed(self, ids, past=0, attention_mask=None, position_ids=None):
        """wte(ids) + wpe(positions): (B, T) -> (B, T, d). With left padding, positions count real tokens; a
        padding token after real ones (right padding) has its index, as in HF's forward; position_ids (B or 1,
        T), HF's, say them outright."""
        T = ids.shape[1]
        if position_ids is not None:
            pos = position_ids
        elif attention_mask is None:
            pos = torch.arange(past, past + T, device=ids.device)[None]
        else:
            seen = attention_mask.long().cumsum(-1)  # real tokens so far
            index = torch.arange(seen.shape[1], device=ids.device).expand_as(seen)
            pad = torch.where(seen > 0, index, 0)   # padding after a real token: its index; before any: 0
            pos = torch.where(attention_mask.bool(), seen - 1, pad)[:, -T:]
        return self.transformer.drop(self.transformer.wte(ids) + self.transformer.wpe(pos))

    def forward(self, ids=None, cache=None, attention_mask=None, last_only=False, *, input_ids=None, labels=None,
                position_ids=None, return_dict=None, **hf):
        """ids (B, T) -> logits (B, T, vocab). attention_mask (B, past + T): 1 for real tokens, 0 for padding.
        last_only: logits of the last position only, (B, 1, vocab): all generation needs, and it skips
        T - 1 rows of the largest GEMM (vocab x d).

        HF's call works too: input_ids=, labels= (HF's loss: each position predicts the next label, -100
        ignored, the mean), position_ids=, return_dict=; given input_ids, labels, return_dict or any other of
        HF's arguments (use_cache=, ...), the answer is HF's output object (LMOutput: .logits, .loss; with
        return_dict=False HF's tuple), else the logits tensor itself."""
        hf_output = input_ids is not None or labels is not None or return_dict is not None or bool(hf)
        ids = self.hf_ids(ids, input_ids, hf)
        self.check_ids(ids, cache)
        if position_ids is not None:
            position_ids = self.check_positions(position_ids, ids)
        if labels is not None:
            if last_only:
                raise InputError("labels need every position's logits; last_only=True keeps only the last")
            self.check_labels(labels, ids)
        logits = self.logits(ids, cache, attention_mask, last_only, position_ids)
        if not hf_output:
            return logits
        loss = None
        if labels is not None:  # as HF's GPT2LMHeadModel: logits in fp32, position t predicts label t + 1
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten().long(),
                                   ignore_index=-100)
        out = LMOutput(logits=logits, loss=loss)
        return out.to_tuple() if return_dict is False else out

    def hf_ids(self, ids, input_ids, hf: dict):
        """The token ids of forward's call, given as ids or as HF's input_ids; HF's other arguments are taken
        where they change nothing (use_cache, output_attentions=False, ...) and refused in one line where
        they would."""
        for name, value in hf.items():
            neutral = HF_NEUTRAL.get(name)
            if neutral is None:
                raise InputError(f"GPT2.forward got an unexpected argument {name!r}; it takes ids (or HF's "
                                 "input_ids), cache, attention_mask, last_only, labels, position_ids, return_dict")
            if not any(value is v for v in neutral):
                raise InputError(f"GPT2.forward does not take {name}={_short(value)}: gpt2ffn's GPT-2 computes "
                                 f"logits (and the loss) only; leave {name} at {neutral[0]}")
        if ids is not None and input_ids is not None:
            raise InputError("give the token ids once: as ids (the first argument) or as input_ids, not both")
        if ids is None and input_ids is None:
            raise InputError("GPT2.forward needs token ids (B, T): model(ids) or model(input_ids=ids)")
        return ids if ids is not None else input_ids

    def check_positions(self, position_ids, ids):
        """HF's position_ids: (B, T), (1, T) or (T,) ints in [0, n_positions) -> (B or 1, T)."""
        if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.int64, torch.int32):
            raise InputError(f"position_ids must be an int64 tensor (B, T), got "
                             f"{getattr(position_ids, 'dtype', type(position_ids).__name__)}")
        p = position_ids[None] if position_ids.dim() == 1 else position_ids
        T = ids.shape[1]
        if p.dim() != 2 or p.shape[1] != T or p.shape[0] not in (1, ids.shape[0]):
            raise ShapeError(f"position_ids has shape {tuple(position_ids.shape)}; expected "
                             f"{(ids.shape[0], T)} or {(1, T)}, as input_ids {tuple(ids.shape)}")
        n = self.config.n_positions
        if int(p.min()) < 0 or int(p.max()) >= n:
            raise InputError(f"position_ids must be in [0, {n}) (n_positions); got min {int(p.min())}, "
                             f"max {int(p.max())}")
        return p

    def check_labels(self, labels, ids):
        """HF's labels: the shape of input_ids, ids in [0, vocab) or -100 (ignored)."""
        if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
            raise InputError(f"labels must be an int64 tensor of token ids (B, T), got "
                             f"{getattr(labels, 'dtype', type(labels).__name__)}")
        if labels.shape != ids.shape:
            raise ShapeError(f"labels has shape {tuple(labels.shape)}; expected {tuple(ids.shape)}, the shape of "
                             "input_ids (HF shifts them inside: pass labels=input_ids)")
        V = self.config.vocab_size
        bad = (labels != -100) & ((labels < 0) | (labels >= V))
        if bool(bad.any()):
            raise InputError(f"labels must be token ids in [0, {V}) or -100 (ignored); got "
                             f"{int(labels[bad][0])}")

    def logits(self, ids, cache=None, attention_mask=None, last_only=False, position_ids=None):
        """forward's logits (B, T or 1, vocab), its arguments checked."""
        if cache is not None and attention_mask is None and position_ids is None and self.fused_decode():
            if ids.shape[1] == 1:
                return self.decode_step(ids, cache)
            if last_only:  # a prompt's prefill, one native call a row
                logits = torch.cat([self.prefill_slot(row, cache.length, cache.k, cache.v, b)
                                    for b, row in enumerate(ids)])
                cache.length += ids.shape[1]
                return logits[:, None]                                              # (B, 1, vocab)
        past = cache.length if cache is not None else 0
        T = ids.shape[1]
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != (ids.shape[0], past + T):
                raise ShapeError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected "
                                 f"{(ids.shape[0], past + T)} (batch, cached + new tokens)")
            mask = causal_mask(T, past, attention_mask, ids.device)
        x = self.embed(ids, past, attention_mask, position_ids)
        for i, block in enumerate(self.transformer.h):
            x = block(x, i, cache, mask)
        if cache is not None:
            cache.length += T
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.transformer.ln_f(x))

    def forward_paged(self, ids, positions, cache, tables, logits_for="last", mask=None, slots=None,
                      keys=None):
        """Rows of different sequences at once: ids and positions (B, T), tables (B, nb) each row's blocks in
        the paged cache (serving/kv_cache.PagedKVCache). A query at position p attends keys 0..p of its own
        row, nothing else (or what mask (B, 1, T, keys) allows, with slots and keys as PagedKVCache.bind takes
        them: a packed row). tables None and no mask: each row is a sequence's first T tokens (right-padded),
        and the cache's update hands back the new keys themselves, attended causally (serving/static.FreshSlots).
        logits_for: "last" -> (B, vocab) of each row's last token; "all" -> (B, T, vocab); a list of token
        indices of row 0 -> (len, vocab); a tensor (B,) of each row's own index -> (B, vocab)."""
        span = None
        if mask is None and tables is not None:  # keys up to the furthest new position, not a whole big block
            span = min(tables.shape[1] * cache.block_size, int(positions.max()) + 1)
            mask = (torch.arange(span, device=ids.device)[None, None, :]
                    <= positions[:, :, None])[:, None]  # (B, 1, T, S)
        cache.bind(tables, positions, slots, span, keys)
        x = self.transformer.drop(self.transformer.wte(ids) + self.transformer.wpe(positions))
        if (ids.shape[1] == 1 and isinstance(logits_for, str) and logits_for == "last" and not self.training
                and not torch.is_grad_enabled() and getattr(self, "mesh", None) is None
                and not torch.is_autocast_enabled() and add_layer_norm.available(ids.device)):
            # a decode step on a GPU (not tensor-parallel, not under autocast: its sums change dtype)
            return self.lm_head(self.decode_blocks(x, cache, mask)[:, -1])
        for i, block in enumerate(self.transformer.h):
            x = block(x, i, cache, mask)
        if isinstance(logits_for, torch.Tensor):
            x = x[torch.arange(x.shape[0], device=x.device), logits_for]
        elif logits_for == "last":
            x = x[:, -1]
        elif logits_for != "all":
            x = x[0, logits_for]
        return self.lm_head(self.transformer.ln_f(x))

    def decode_blocks(self, x, cache, mask):
        """The blocks of a one-token step, each residual add and the layer norm after it as one kernel
        (kernels/add_layer_norm.py): h = ln_1(x); per block x, h = x + attn(h), ln_2(...); x, h = x + mlp(h), the
        next ln_1 (the last block: ln_f) -> ln_f of the last residual, (B, 1, d). Two kernels a block fewer."""
        blocks, ln_f = self.transformer.h, self.transformer.ln_f
        h = blocks[0].ln_1(x)
        for i, block in enumerate(blocks):
            after = blocks[i + 1].ln_1 if i + 1 < len(blocks) else ln_f
            ln2 = block.ln_2
            x, h = add_layer_norm.add_layer_norm(x, block.attn(h, i, cache, mask), ln2.weight, ln2.bias, ln2.eps)
            x, h = add_layer_norm.add_layer_norm(x, block.mlp(h), after.weight, after.bias, after.eps)
        return h

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of the KV caches generation makes for this model (the serving engine's pool; make yours as
        KVCache(model.config, B, dtype=model.kv_dtype)): float16 when the linear layers are packed at bf16, int8
        or int4 on the CPU (halves the cache bytes every decode step reads, as llama.cpp's default f16 cache;
        README, "KV cache"), else the weights' dtype (fp32: the values HF's cache holds). Assign float32 or
        float16 to choose, None to go back to this default."""
        chosen = self.__dict__.get("_kv_dtype")
        if chosen is not None:
            return chosen
        w = self.transformer.wte.weight
        packed = [m.packed for m in self.modules() if isinstance(m, PackedLayer) and m.packed is not None]
        if w.device.type == "cpu" and w.dtype == torch.float32 and packed and all(p.precision != "fp32"
                                                                                   for p in packed):
            return torch.float16
        return w.dtype

    @kv_dtype.setter
    def kv_dtype(self, dtype):
        if dtype is not None and dtype not in (torch.float32, torch.float16):
            raise ConfigError(f"kv_dtype must be torch.float32 or torch.float16 (load() takes 'float32', 'float16'; "
                              f"None or 'auto': the default), got {dtype!r}")
        self.__dict__["_kv_dtype"] = dtype

    def __getstate__(self):
        """copy.deepcopy and pickle without the native decode plan (rebuilt on the next step)."""
        state = self.__dict__.copy()
        state.pop("_plan", None)
        return state

    # What HF scripts read off a model: `.to(model.device)`, `model.dtype`, num_parameters(), the embeddings.
    @property
    def device(self) -> torch.device:
        return self.transformer.wte.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype (float32 for a bf16/int8/int4 model too: its packed weights are not Parameters)."""
        return self.transformer.wte.weight.dtype

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """As HF's: the tied wte / lm_head counted once; exclude_embeddings leaves wte and wpe out."""
        skip = {id(self.transformer.wte.weight), id(self.transformer.wpe.weight)} if exclude_embeddings else set()
        return sum(p.numel() for p in self.parameters()
                   if id(p) not in skip and (p.requires_grad or not only_trainable))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def fused_decode(self) -> bool:
        """Whether a one-token step can run as one native call (gpt2ffn._C.StepPlan): eval(), every linear layer
        and the lm_head packed with the native decode route, no gradient asked, fp32 on CPU."""
        if self.training:
            return False
        plan = self.__dict__.get("_plan")
        if plan is None or not plan.valid():
            plan = self.__dict__["_plan"] = DecodePlan.build(self)
        if plan is None:
            return False
        return not torch.is_grad_enabled() or not plan.native.requires_grad()

    def decode_step(self, ids, cache):
        """One new token per row (B, 1) -> logits (B, 1, vocab), one native call."""
        B = ids.shape[0]
        logits = self.decode_slots(ids[:, 0], torch.full((B,), cache.length, dtype=torch.long), cache.k, cache.v,
                                   torch.arange(B))
        cache.length += 1
        return logits[:, None]                                                          # (B, 1, vocab)

    def decode_slots(self, ids, positions, k, v, slots):
        """ids (B,) at positions (B,), row b's keys and values in slot slots[b] of every layer's k[i], v[i]
        (slots, H, S, d/H) -> logits (B, vocab), the whole step one native call. A row attends its own positions
        0..p only, so rows of different lengths share the step (the serving engine's decode)."""
        if not self.fused_decode():
            raise Gpt2ffnError("decode_slots needs every linear layer packed with the native decode route "
                               "(gpt2ffn.quantize on a CPU where gpt2ffn._C is built), eval() and no gradient")
        return self.__dict__["_plan"].run(ids, positions, slots, k, v)

    def prefill_slot(self, ids, past: int, k, v, slot: int):
        """ids (T,), one sequence's tokens at positions past .. past + T - 1, their keys and values into slot `slot`
        of every layer's k[i], v[i] (slots, H, S, d/H), each attending to the slot's positions up to its own ->
        the last position's logits (1, vocab): a prompt's whole prefill in one native call (as decode_slots)."""
        if not self.fused_decode():
            raise Gpt2ffnError("prefill_slot needs every linear layer packed with the native decode route "
                               "(gpt2ffn.quantize on a CPU where gpt2ffn._C is built), eval() and no gradient")
        return self.__dict__["_plan"].prefill(ids, past, slot, k, v)

    def prefill_slots(self, ids, pasts: list, slots: list, lengths: list, k, v):
        """prefill_slot for chunks of several sequences in one native call: ids (T,) holds chunk c's lengths[c]
        tokens (at positions pasts[c] .. of slot slots[c], one chunk a slot), one chunk after another -> each
        chunk's last position's logits (chunks, vocab). Every weight is read once for all the chunks' rows (a
        server admitting short prompts prefills them together), and each row's logits, keys and values are
        bitwise those of its chunk alone."""
        if not self.fused_decode():
            raise Gpt2ffnError("prefill_slots needs every linear layer packed with the native decode route "
                               "(gpt2ffn.quantize on a CPU where gpt2ffn._C is built), eval() and no gradient")
        return self.__dict__["_plan"].prefill_many(ids, list(pasts), list(slots), list(lengths), k, v)

    def check_ids(self, ids, cache=None):
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise InputError(f"ids must be an int64 tensor of token ids (B, T), got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)}")
        if ids.dim() != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
            raise ShapeError(f"ids has shape {tuple(ids.shape)}; expected (batch, tokens), both >= 1")
        V = self.config.vocab_size
        # (not under torch.compile: reading the values would end a fullgraph trace; HF's embedding raises there)
        if not torch.compiler.is_compiling() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise InputError(f"token ids must be in [0, {V}); got min {int(ids.min())}, max {int(ids.max())}")
        if cache is not None:
            cache.check_room(ids.shape[1], ids.shape[0], self.kv_config)  # a tensor-parallel rank's heads
        elif ids.shape[1] > self.config.n_positions:
            raise Gpt2ffnError(f"{ids.shape[1]} tokens exceed the context of n_positions={self.config.n_positions}")

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens=None, do_sample=None, temperature=None, top_k=None, top_p=None,
                 eos_token_id=None, attention_mask=None, pad_token_id=None, num_return_sequences=None,
                 repetition_penalty=None, *, max_length=None, min_new_tokens=None, min_length=None,
                 generation_config=None, streamer=None, **hf):
        """HF-style generate: (B, T) LongTensor -> (B * num_return_sequences, T + new) LongTensor of prompt + new ids.

        Defaults as HF's GenerationConfig: greedy unless do_sample (then temperature, top_k=50, top_p; seeded
        from torch's global RNG, so torch.manual_seed reproduces a run), and None for any of them means its
        default, as in HF; top_k=0 means no top-k (HF's). max_new_tokens (default 20) or HF's max_length
        (prompt + new; max_new_tokens wins where both are given); min_new_tokens / min_length hold EOS off.
        eos_token_id None means the config's (config.json's, or generation_config.json's where it sets one);
        a list stops at any of its ids. A batch is left-padded with attention_mask (1 real, 0 padding); without
        one, HF's rule infers it: a pad_token_id that is no EOS marks the padding where it appears. A row that
        ends early is padded with pad_token_id (None: the first EOS id, GPT-2's pad). num_return_sequences
        samples per prompt, each prompt's rows together (as HF; greedy has one answer, so more is an error);
        repetition_penalty as HF's (1.0: none). generation_config (HF's GenerationConfig): its fields, under the
        arguments given; streamer (HF's TextStreamer, ...): put(prompt), put(each new token), end(), one row
        only, as HF. Beam search, n-gram bans and scores are refused in one line. A thin layer over
        gpt2ffn.generate."""
        # The one upward import of the model layer (import-linter's contract ignores it by name): HF's API puts
        # generate on the model, and generation is the serving engine's job.
        from .generate import Sampling, generate, stream
        given = {k: v for k, v in dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                                       top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                                       pad_token_id=pad_token_id, num_return_sequences=num_return_sequences,
                                       repetition_penalty=repetition_penalty, max_length=max_length,
                                       min_new_tokens=min_new_tokens, min_length=min_length, **hf).items()
                 if v is not None}
        if generation_config is not None:  # its fields set away from HF's defaults, under the arguments given
            given = {**generation_config.to_diff_dict(), **given}
        args = generate_args(given)
        self.check_ids(input_ids)
        T = input_ids.shape[1]
        num_return_sequences = args.get("num_return_sequences", 1)
        do_sample = bool(args.get("do_sample", False))
        if not isinstance(num_return_sequences, int) or num_return_sequences < 1:
            raise Gpt2ffnError(f"num_return_sequences must be an int >= 1, got {num_return_sequences!r}")
        if num_return_sequences > 1 and not do_sample:
            raise Gpt2ffnError(f"num_return_sequences={num_return_sequences} needs do_sample=True: greedy decoding "
                               "has one answer per prompt (as HF's generate says)")
        eos = args.get("eos_token_id", self.config.eos_token_id)
        eos_ids = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
        pad = args.get("pad_token_id", eos_ids[0] if eos_ids else None)  # HF pads with the first EOS id
        rows = input_ids.tolist()
        if attention_mask is None and "pad_token_id" in args and pad not in eos_ids \
                and any(pad in r for r in rows):  # HF's rule: such a pad id marks padding
            attention_mask = (input_ids != pad).long()
            inferred = f" (inferred from pad_token_id={pad}, which appears in input_ids: HF's rule)"
        else:
            inferred = ""
        real = rows if attention_mask is None else unpad(rows, attention_mask, input_ids.shape, inferred)
        new = args.get("max_new_tokens")
        if new is None:
            new = args["max_length"] - T if "max_length" in args else 20
            if new < 1:
                raise Gpt2ffnError(f"max_length={args['max_length']} leaves no room after the prompt's {T} tokens "
                                   "(max_length counts them, as HF's); give max_new_tokens")
        least = args.get("min_new_tokens", args.get("min_length", T) - T)
        top_k = args.get("top_k", 50)
        s = Sampling(max_new_tokens=new, temperature=args.get("temperature", 1.0) if do_sample else 0.0,
                     top_k=(top_k or None) if do_sample else None,  # 0: no top-k
                     top_p=args.get("top_p", 1.0) if do_sample else None,
                     seed=int(torch.randint(2**62, (1,))) if do_sample else None, eos_token_id=eos,
                     repetition_penalty=args.get("repetition_penalty", 1.0), min_tokens=max(0, least))
        prompts = [p for p in real for _ in range(num_return_sequences)]
        if streamer is None:
            out = generate(self, prompts, s)
        else:
            if len(prompts) != 1:
                raise Gpt2ffnError(f"a streamer takes one sequence, as HF's; this call makes {len(prompts)} "
                                   "(batch x num_return_sequences)")
            streamer.put(input_ids.cpu())
            out = [[]]
            for (token,) in stream(self, prompts, s):
                out[0].append(token)
                streamer.put(torch.tensor([token]))
            streamer.end()
        width = max(len(n) for n in out)
        rows = [r for r in rows for _ in range(num_return_sequences)]
        out = [row + n + [pad] * (width - len(n)) for row, n in zip(rows, out)]
        return torch.tensor(out, dtype=torch.long, device=input_ids.device)

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, precision: str | None = "fp32",
                        activations: str | None = None, *, torch_dtype=None, device_map=None) -> "GPT2":
        """GPT-2 of any size from an HF checkpoint directory (either key layout, safetensors or .bin).

        dtype: a torch dtype, its name ('bfloat16') or 'auto' (config.json's dtype, else float32), as HF's
        (torch_dtype=, HF's older name, too).
        precision ('fp32', 'bf16', 'int8', 'int4'): the linear layers' weights for inference, packed by
        gpt2ffn.quantize (activations stay fp32); fp32 is exact and takes this machine's fastest kernels;
        None leaves plain torch modules (and with dtype other than float32, precision must be None).
        activations: as quantize's ('fp32', 'int8' for int8/int4 weights; None: the machine's default).
        device_map: as HF's, for one device: 'cpu', 'auto' (CUDA when torch sees a GPU), 'cuda[:N]', N, or a
        dict whose values all name one device. On CUDA the model is plain torch modules (precision fp32 or None)."""
        if torch_dtype is not None:
            dtype = torch_dtype
        device = "cpu"
        if device_map is not None:
            devices = {str(v) for v in device_map.values()} if isinstance(device_map, dict) else {str(device_map)}
            if not devices:
                raise ConfigError("device_map={} names no device; give one ('cpu', 'auto', 'cuda' or 'cuda:N'), "
                                  "or a dict such as {'': 'cpu'}")
            if len(devices) != 1:
                raise ConfigError(f"device_map={device_map!r} splits the model over devices; gpt2ffn places it on one "
                                  "('cpu', 'auto', 'cuda' or 'cuda:N')")
            device = devices.pop()
            device = resolve_device(f"cuda:{device}" if device.isdigit() else device)
            if device != "cpu":
                if precision not in (None, "fp32"):
                    raise ConfigError(f"precision={precision!r} packs weights for gpt2ffn's CPU kernels; on "
                                      f"{device} give precision=None (or 'fp32')")
                precision = None
        path = resolve_checkpoint(path)  # a directory, a file, or a model id in the local HF cache
        dtype = torch_dtype_of(dtype, path)
        if precision not in (None, "fp32") and dtype != torch.float32:
            raise ConfigError(f"precision={precision!r} quantizes a float32 model's weights; it does not combine "
                              f"with dtype={dtype} (give precision=None, or dtype=torch.float32)")
        ckpt = Checkpoint(path)
        directory = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
        with uninitialized():  # every weight is read next (load_tensors refuses a checkpoint that lacks one)
            try:
                model = cls(Config.from_pretrained(directory))
            except ConfigError as e:  # n_embd % n_head, say, from sizes config.json left to GPT-2's
                raise ConfigError(f"{e}{Config.defaults_note(directory / 'config.json')}") from None
        # HF's keys without "transformer."; lm_head.weight is wte's (tied), whether the file has it or not
        own = {k.removeprefix("transformer."): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        # The blocks' linear weights, packed and let go next (held once), are packed from the file's own tensors
        # (safetensors' memory map) rather than copied into the model first
        held = precision is not None and dtype == torch.float32 and device == "cpu" and holds_once(
            check_precision(precision))
        mapped = [(name.removeprefix("transformer."), m) for name, m in model.named_modules()
                  if held and isinstance(m, Conv1D)]
        load_tensors(own, ckpt, "GPT-2", directory / "config.json", optional=("lm_head.weight",),
                     size=f" ({model.config.n_layer} layers)", alias={f"{n}.weight": m.weight for n, m in mapped})
        if not model.config.tie_word_embeddings:
            untied_head(ckpt, directory, own["wte.weight"])
        model = model.to(dtype).eval()
        if precision is not None and dtype == torch.float32:
            quantize(model, precision, activations=activations)
        for _, m in mapped:  # each was let go; one that was not would get memory of its own (and re-pack)
            if not m.dropped:
                m.weight.data = m.weight.data.clone()
        return model.to(device) if device != "cpu" else model

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's, reading HF's layouts as from_pretrained does: keys without `transformer.` (openai-community/gpt2's
        own file), the attn.bias / attn.masked_bias buffers some files carry left out, and lm_head.weight, which
        save_pretrained leaves out, taken as wte's (tied)."""
        # told from the keys given (own keys would take state_dict(), which dequantizes a packed model's weights)
        bare = not any(k.startswith("transformer.") for k in state_dict) and any(
            k.startswith(("wte.", "wpe.", "h.", "ln_f.")) for k in state_dict)
        sd = {(f"transformer.{k}" if bare and not k.startswith("lm_head.") else k): v
              for k, v in state_dict.items() if not IGNORED.search(k)}
        if "lm_head.weight" not in sd and "transformer.wte.weight" in sd and self.config.tie_word_embeddings:
            sd["lm_head.weight"] = sd["transformer.wte.weight"]
        result = super().load_state_dict(sd, strict=strict, assign=assign)
        if assign and self.config.tie_word_embeddings:  # assign puts new Parameters in: tie them again
            self.lm_head.weight = self.transformer.wte.weight
        return result

    def save_pretrained(self, path) -> Path:
        """An HF checkpoint directory: config.json and model.safetensors with save_pretrained's keys
        (`transformer.h.0...`, the tied lm_head left out; with tie_word_embeddings=false in the config, its
        lm_head.weight, wte's values, written), which HF's GPT2LMHeadModel.from_pretrained and
        GPT2.from_pretrained both read. The weights are the values the model computes with (int8/int4/bf16
        ones rounded, stored as fp32; a .to(bf16) model's in bf16); tokenizer files are not the model's to
        write (tokenizer.save_pretrained(path) adds them, as in HF). A tensor-parallel model (gpt2ffn.parallel)
        gathers its shards: every rank calls it, rank 0 writes, and all return once the files are there."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise Gpt2ffnError(f"{path} is a file; save_pretrained writes a directory (config.json, model.safetensors)")
        from safetensors.torch import save_file
        tensors = {}
        for k, v in self.state_dict().items():
            if k == "lm_head.weight" and self.config.tie_word_embeddings:  # untied: HF reads it from the file
                continue
            if hasattr(v, "full_tensor"):  # tensor-parallel (gpt2ffn.parallel): a collective, on every rank
                v = v.full_tensor()
                if k.endswith("attn.c_attn.weight") or k.endswith("attn.c_attn.bias"):  # sharded as [d, 3, d]
                    v = v.reshape(*v.shape[:-2], -1)
            tensors[k] = v.detach().cpu().contiguous().clone()
        parallel = getattr(self, "mesh", None) is not None
        if not parallel or torch.distributed.get_rank() == 0:  # one rank writes; the others wait for it below
            path.mkdir(parents=True, exist_ok=True)
            # an earlier sharded save's files go, as HF's save_pretrained removes them: left beside the new file
            # they are another copy of older weights
            for old in [*path.glob("model-*-of-*.safetensors"), path / "model.safetensors.index.json"]:
                if old.is_file() and re.fullmatch(r"model(-\d{5}-of-\d{5}\.safetensors|\.safetensors\.index\.json)",
                                                  old.name):
                    old.unlink()
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
            config = self.config.to_hf_dict()
            config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"],  # dtype: the tensors', as HF writes
                          dtype=str(tensors["transformer.wte.weight"].dtype).removeprefix("torch."))
            (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if parallel:
            torch.distributed.barrier()
        return path


def _short(value) -> str:
    """A value for a one-line message: a tensor by its shape, anything else by a short repr."""
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def torch_dtype_of(dtype, path) -> torch.dtype:
    """from_pretrained's dtype as HF takes it: a torch dtype, its name, or 'auto' (the checkpoint's config.json
    dtype / torch_dtype, else float32)."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    if dtype == "auto":
        file = Path(path) / "config.json" if Path(path).is_dir() else Path(path).parent / "config.json"
        try:
            d = json.loads(file.read_text())
        except (OSError, ValueError):
            d = {}
        name = (d.get("dtype") or d.get("torch_dtype") or "float32") if isinstance(d, dict) else "float32"
    value = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        short = name if isinstance(name, str) else None
        hint = f" ({short} weights: precision={short!r})" if short in ("bf16", "int8", "int4") else ""
        raise ConfigError(f"dtype={_short(dtype)} is not a float dtype{hint}: give torch.float32, torch.bfloat16, "
                          "torch.float16, their names ('bfloat16') or 'auto'")
    return value


def untied_head(ckpt: Checkpoint, directory, wte):
    """A config with tie_word_embeddings=false: its lm_head.weight must be wte's values after all, as gpt2ffn's
    GPT2 (like GPT-2) has no lm_head of its own."""
    why = ("the checkpoint has no lm_head.weight" if "lm_head.weight" not in ckpt else None
           if torch.equal(ckpt.get("lm_head.weight").to(wte.dtype), wte) else "its lm_head.weight differs from wte")
    if why:
        raise ConfigError(f"{directory / 'config.json'} sets tie_word_embeddings=false and {why}: "
                          "gpt2ffn's GPT-2 ties the lm_head to wte, as GPT-2 does, so it cannot run this model")


# GPT2.generate's HF arguments: what each may be (a value outside: refused in one line), None: any value taken.
# Those with a set of values change nothing at these values (greedy/sampling with one beam, no scores).
GENERATE_ARGS = {"max_new_tokens": None, "do_sample": None, "temperature": None, "top_k": None, "top_p": None,
                 "eos_token_id": None, "pad_token_id": None, "num_return_sequences": None,
                 "repetition_penalty": None, "max_length": None, "min_new_tokens": None, "min_length": None,
                 "use_cache": None, "bos_token_id": None, "num_beams": (1,), "num_beam_groups": (1,),
                 "no_repeat_ngram_size": (0,), "return_dict_in_generate": (False,), "output_scores": (False,),
                 "output_logits": (False,), "output_attentions": (False,), "output_hidden_states": (False,),
                 "early_stopping": None, "length_penalty": None, "transformers_version": None,
                 "_from_model_config": None}
GENERATE_WHY = {"num_beams": "beam search is not implemented: gpt2ffn decodes greedily or samples",
                "num_beam_groups": "beam search is not implemented",
                "no_repeat_ngram_size": "n-gram bans are not implemented (repetition_penalty is)"}


def generate_args(given: dict) -> dict:
    """GPT2.generate's arguments (and a GenerationConfig's fields) checked: an unknown one, or one at a value
    that would change what HF computes in a way gpt2ffn does not, is refused in one line naming it."""
    for name, value in given.items():
        if name not in GENERATE_ARGS:
            raise InputError(f"GPT2.generate got an unexpected argument {name!r}; it takes input_ids, "
                             f"attention_mask, generation_config, streamer and {', '.join(list(GENERATE_ARGS)[:-2])}")
        allowed = GENERATE_ARGS[name]
        if allowed is not None and not any(value == v for v in allowed):
            why = GENERATE_WHY.get(name, "gpt2ffn's generate returns the token ids only")
            raise InputError(f"GPT2.generate does not take {name}={_short(value)}: {why}")
    return given


def unpad(rows: list, attention_mask, shape, inferred: str = "") -> list:
    """Left-padded rows (B, T) and their attention_mask (1 real, 0 padding) -> each row's real tokens."""
    if tuple(attention_mask.shape) != tuple(shape):
        raise ShapeError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected "
                         f"{tuple(shape)}, the shape of input_ids")
    prompts = []
    for b, (row, m) in enumerate(zip(rows, attention_mask.tolist())):
        n = int(sum(m))
        if n == 0 or m != [0] * (len(m) - n) + [1] * n:
            raise InputError(f"attention_mask row {b} is {m}{inferred}; generate takes left padding: zeros, then "
                             "at least one 1, then only 1s (tokenizer.padding_side = 'left')")
        prompts.append(row[len(m) - n:])
    return prompts


def random_weights_(model: nn.Module, seed: int) -> nn.Module:
    """Seeded weights for the random: presets, the same for HF's GPT2LMHeadModel and ours (each parameter
    drawn from its own generator seeded by (seed, name)). Scaled to exercise every stage: std 1.5/sqrt(fan_in)
    so GELU inputs reach |x| ~ 2.7 where its two forms differ most, and non-zero biases and LayerNorm
    parameters, so a missing one shows. Embeddings have GPT-2's own scale (std 0.1): with std 1 the tied
    lm_head made logits O(100), next-token distributions one-hot and the greedy path one repeated token."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            # drawn in place, then scaled (and shifted) in place: the same float operations as scale * randn, with
            # no temporaries (GPT-2 124M: 0.5 s of a 3 s load)
            x = p.data if p.is_contiguous() and p.dtype == torch.float32 else torch.empty(p.shape)
            torch.randn(p.shape, generator=g, out=x)
            if name.endswith(("wte.weight", "wpe.weight")):  # std 0.1, as GPT-2's own embeddings (and tied lm_head)
                x.mul_(0.1)
            elif ".ln_" in name or "ln_f" in name:
                x.mul_(0.1).add_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                x.mul_(0.1)
            else:  # Conv1D weight [in, out]
                x.mul_(1.5 / p.shape[0] ** 0.5)
            if x is not p.data:
                p.copy_(x)
    return model


def random_hf_model(cfg: Config, seed: int, attn_implementation: str | None = None) -> nn.Module:
    """HF's own GPT2LMHeadModel with random_weights_(seed), in eval mode: the reference the random: presets are
    judged and timed against. Built without HF's init draws where transformers offers that (every weight is drawn
    next; GPT-2 124M's took 1.6 of 2.8 s), its lm_head tied to wte as HF's init ties it."""
    import transformers
    hf_cfg = transformers.GPT2Config(**cfg.to_hf_dict())
    if attn_implementation is not None:
        hf_cfg._attn_implementation = attn_implementation
    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        model = transformers.GPT2LMHeadModel(hf_cfg)
    model.tie_weights()  # (left untied inside no_init_weights; already tied without it)
    if cfg.tie_word_embeddings and model.lm_head.weight is not model.transformer.wte.weight:
        raise RuntimeError("HF's GPT2LMHeadModel came out with its lm_head untied from wte")
    return random_weights_(model, seed).eval()


def check_spec(spec) -> str:
    """A model as the CLI, load() and serve name it: a checkpoint directory (a pathlib.Path too), a model id in
    the local HF cache, or random:<preset>[:seed] (an unknown preset named); else one line saying which these are.
    Returns it as a string."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise Gpt2ffnError(f"a model is named by a string (a directory, a model id or random:<preset>[:seed]), "
                           f"not {type(spec).__name__} {spec!r}")
    if not spec.strip():
        raise Gpt2ffnError("--model is empty: give a checkpoint directory, a model id in the local HF cache, or "
                           "random:<preset>[:seed]")
    if spec.startswith("random:"):
        parse_random(spec)
    elif not Path(spec).is_dir() and (Path(spec).exists() or cached_snapshot(spec) is None):
        raise Gpt2ffnError(f"model {spec!r} is neither a checkpoint directory, a model id in the local HF cache "
                           f"({hub_cache()}), nor random:<preset>[:seed]")
    return spec


def load_model(spec: str, dtype=torch.float32, precision: str | None = "fp32", activations: str | None = None) -> GPT2:
    """GPT2 in eval mode from a checkpoint directory, a model id in the local HF cache or
    `random:<preset>[:seed]`; weights only, no tokenizer. precision: as GPT2.from_pretrained's."""
    spec = check_spec(spec)
    if spec.startswith("random:"):
        cfg, seed, _ = parse_random(spec)
        with uninitialized():  # random_weights_ draws every parameter
            model = GPT2(cfg)
        model = random_weights_(model, seed).to(dtype).eval()
        if precision is not None and dtype == torch.float32:
            return quantize(model, precision, activations=activations)
        return model
    return GPT2.from_pretrained(spec, dtype=dtype, precision=precision, activations=activations)


def parse_random(spec: str) -> tuple:
    """'random:<preset>[:seed]' -> (Config, seed, canonical name)."""
    parts = spec.split(":")
    if parts[0] != "random" or len(parts) not in (2, 3) or (len(parts) == 3 and not parts[2].isdigit()):
        raise Gpt2ffnError(f"bad model {spec!r}: expected random:<preset>[:seed], e.g. random:gpt2:0")
    seed = int(parts[2]) if len(parts) == 3 else 0
    return Config.from_name(parts[1]), seed, f"random:{parts[1]}:{seed}"
