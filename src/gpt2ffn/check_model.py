"""Check a learner's whole GPT-2, checkpoint by checkpoint: the first divergence named, and diagnosed.

    gpt2ffn check nanogpt.py:GPT                    # built with the file's GPTConfig, GPT-2 124M's values
    gpt2ffn check gpt.py:GPTModel --model random:tiny:3
    print(gpt2ffn.check(GPT).format())              # the same from Python

The learner's parameters are matched to GPT-2's (by name where they follow HF, nanoGPT or the book, else by
shape and order within each block), loaded with the reference weights, and the model runs once in eval() on a
fixed prompt with forward hooks on its modules. Each stage is compared with what HF's own GPT2LMHeadModel
returned (gpt2ffn.golden.capture) at the golden tolerance, in forward order: embeddings, then per block ln_1,
q/k/v, attention probabilities (where a dropout module sees them), attention output, first residual, ln_2,
the FFN's stages, block output; ln_f; logits; greedy next tokens. The first stage that diverges is named by
block and checkpoint, and compared with each known mistake computed from HF's weights and its input there.
"""

import dataclasses
import re
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
import torch.nn as nn

from .config import PRESETS, Config
from .diagnose import (
    MISTAKES,
    MODEL_MISTAKES,
    NON_FINITE,
    Diagnosis,
    FFNCase,
    block_forward,
    dropout_rate,
    layer_norm_mistakes,
    named,
)
from .golden import CHECKPOINTS, DIAGNOSE_RTOL, NON_FINITE_MISTAKES, Golden, capture, compare, load_reference
from .learner import CheckError
from .tolerances import GOLDEN_ATOL, GOLDEN_SCALED

DEFAULT_MODEL = "random:gpt2:0"
# Seed 001's prompt "Hello, my dog is cute" in GPT-2's BPE (taken mod the vocabulary for small presets).
TOKEN_IDS = [15496, 11, 616, 3290, 318, 13779]
NEW_TOKENS = 4
# Per block, forward order: (stage, seed 001's checkpoint, label).
BLOCK_STAGES = [
    ("ln_1", "01", "ln_1"),
    ("q", "02", "q (c_attn)"),
    ("k", "03", "k (KV cache)"),
    ("v", "03", "v (KV cache)"),
    ("attn_probs", "04", "attention probabilities"),
    ("attn_out", "05", "attention output (c_proj)"),
    ("attn_resid", "05", "x + attention (1st residual)"),
    ("ln_2", "05", "ln_2"),
    ("c_fc", "06", "FFN c_fc"),
    ("gelu", "06", "FFN activation"),
    ("ffn", "06", "FFN output"),
    ("block", "07", "block output (2nd residual)"),
]
MODEL_STAGES = [("embeddings", "00", "embeddings (wte + wpe)"), ("ln_f", "08", "ln_f"), ("logits", "09", "logits"),
                ("tokens", "10", f"greedy next {NEW_TOKENS} tokens")]
LABELS = {s: label for s, _, label in BLOCK_STAGES + MODEL_STAGES}
CHECKPOINT = {s: ck for s, ck, _ in BLOCK_STAGES + MODEL_STAGES}


def is_model(module: nn.Module) -> bool:
    """A whole model holds a token embedding; an FFN or a GELU does not."""
    return any(isinstance(m, nn.Embedding) for m in module.modules())


def model_source(golden=None, model=None) -> str:
    """The reference weights: --model, else --golden's model (random:... or the directory it was taken from)."""
    if model is not None:
        return str(model)
    if golden is None or str(golden).startswith("random:"):
        return str(golden or DEFAULT_MODEL)
    return Golden(golden).manifest["model"]["source"]


# ---- the learner's modules in GPT-2's roles -------------------------------------------------------------

NORM_HINTS = {"ln_1": r"(ln_?1|norm_?1|attn_norm|input_layernorm)$", "ln_2": r"(ln_?2|norm_?2|ffn_norm|mlp_norm|"
              r"post_attention_layernorm)$"}
LINEAR_HINTS = {"q": r"(^|\.)(w_?q|q|q_proj|query|w_query)$", "k": r"(^|\.)(w_?k|k|k_proj|key|w_key)$",
                "v": r"(^|\.)(w_?v|v|v_proj|value|w_value)$", "attn.c_proj": r"(c_proj|out_proj|o_proj|w_?o|proj|out)$",
                "mlp.c_fc": r"(c_fc|fc1?|up(_proj)?|w1|layers\.0)$",
                "mlp.c_proj": r"(c_proj|fc2|down(_proj)?|w2|proj|layers\.2)$"}
WEIGHT_NAMES, BIAS_NAMES = ("weight", "scale", "gamma", "g", "w"), ("bias", "shift", "beta", "b")


@dataclass
class Part:
    """A learner module in one GPT-2 role: its name, the module, and its weight layout ([in, out] or [out, in])."""

    name: str
    module: nn.Module
    layout: str | None = None


@dataclass
class Structure:
    wte: Part
    wpe: Part | None        # None: it has no learned position embeddings (RoPE, sinusoids: named at checkpoint 00)
    blocks: list            # per block: {role: Part}, roles ln_1, ln_2, attn.c_attn or q/k/v, attn.c_proj,
    ln_f: Part              # mlp.c_fc, mlp.c_proj, and the containers attn, mlp, block
    lm_head: Part | None    # None: logits come from wte (tied)
    style: str
    notes: list = field(default_factory=list)
    head_bias: tuple | None = None  # (name, Parameter): the bias of an lm_head tied to wte (GPT-2's has none)


def _leaves(module: nn.Module, skip=()) -> list:
    """(name, module) of every submodule holding parameters directly, in registration order (the module's own
    parameters have no GPT-2 role: loading names them as left over)."""
    return [(n, m) for n, m in module.named_modules() if n and any(p is not None for p in m._parameters.values())
            and not any(n == s or n.startswith(s + ".") for s in skip)]


def _is_norm(m, d) -> bool:
    ps = [p for p in m._parameters.values() if p is not None]
    return bool(ps) and all(p.dim() == 1 and p.shape[0] == d for p in ps)


def _weight2d(m):
    w = m._parameters.get("weight")
    return w if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def _common(names: list) -> str:
    """The deepest module name that contains all names ('' for the root)."""
    parts = [n.split(".")[:-1] for n in names]
    out = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        out.append(level[0])
    return ".".join(out)


def _blocks(model: nn.Module) -> tuple:
    """(name, container) of the learner's transformer blocks: the list of same-type modules with most weights."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m)
             and len({type(c) for c in m}) == 1 and sum(p.dim() == 2 for p in m[0].parameters()) >= 3]
    if not found:
        raise CheckError(f"{type(model).__name__} has no list of transformer blocks (an nn.ModuleList or "
                         "nn.Sequential of blocks, each with attention and an FFN)")
    return max(found, key=lambda f: sum(p.numel() for p in f[1].parameters()))


def _pick(roles: list, named: list, hints: dict) -> dict:
    """Assign modules to roles by name hints when each role gets exactly one, else in registration order."""
    by_hint = {}
    for role in roles:
        hits = [x for x in named if re.search(hints[role], x[0], re.IGNORECASE)]
        by_hint[role] = hits[0] if len(hits) == 1 else None
    if all(by_hint.values()) and len({id(x[1]) for x in by_hint.values()}) == len(roles):
        return by_hint
    return dict(zip(roles, named))


def _layout(m, n_in, n_out, siblings) -> str:
    """[out, in] for nn.Linear, [in, out] for a Conv1D; other modules by which side is n_in, a square one as
    its non-square siblings of the same class are."""
    w = _weight2d(m)
    if isinstance(m, nn.Linear):
        return "[out, in]"
    if "conv1d" in type(m).__name__.lower():
        return "[in, out]"
    if n_in != n_out:
        return "[in, out]" if tuple(w.shape) == (n_in, n_out) else "[out, in]"
    for s in siblings:
        ws = _weight2d(s)
        if type(s) is type(m) and ws.shape[0] != ws.shape[1]:
            return "[in, out]" if ws.shape[0] < ws.shape[1] or ws.shape[0] == m.weight.shape[0] else "[out, in]"
    return "[out, in]"


def find_structure(model: nn.Module, cfg: Config) -> Structure:
    """Every GPT-2 role in the learner's model, or a CheckError saying what does not fit."""
    d, V, P = cfg.n_embd, cfg.vocab_size, cfg.n_positions
    bname, container = _blocks(model)
    if len(container) != cfg.n_layer:
        width = next((p.shape[-1] for p in model.parameters() if p.dim() == 2), None)
        size = next((f"random:{k}" for k, c in PRESETS.items() if (c.n_layer, c.n_embd) == (len(container), width)),
                    "random:<preset>")
        raise CheckError(f"{type(model).__name__} has {len(container)} blocks ({bname}); the reference has "
                         f"n_layer={cfg.n_layer}: check it against a reference of its size (--model {size}), or "
                         f"build it with the reference's config (--config), where its constructor takes one")
    top = _leaves(model, skip=[bname])
    embs = [(n, m) for n, m in top if isinstance(m, nn.Embedding)]
    wte = next((x for x in embs if x[1].num_embeddings == V), None)
    # wpe: GPT-2's, or a shorter context (the book's chapter 5 trains at 256): its first positions are GPT-2's
    lo = min(len(TOKEN_IDS) + NEW_TOKENS, P)
    short = [x for x in embs if x is not wte and lo <= x[1].num_embeddings <= P]
    wpe = max(short, key=lambda x: x[1].num_embeddings, default=None)
    if wpe is None and wte is not None:  # a Parameter of its own (minGPT's pos_emb), else none: RoPE, sinusoids
        wpe = own_positions(model, bname, d, lo, P)
        if wpe is not None:  # the module holding it directly holds nothing else of GPT-2's roles
            mine = [id(wpe[1].weight)]
            top = [(n, m) for n, m in top if [id(p) for p in m._parameters.values() if p is not None] != mine]
        elif len(embs) == 1:
            wpe = ("", None)  # judged: its embeddings (block 0's input) fail, and are named as having no wpe
    if wte is None or wpe is None:
        got = ", ".join(f"{n} {tuple(m.weight.shape)}" for n, m in embs) or "none"
        padded = [(n, m.num_embeddings) for n, m in embs if V < m.num_embeddings != P]
        hint = (f" ({padded[0][0]} pads the vocabulary to {padded[0][1]}, as nanoGPT's GPTConfig() default does): "
                f"build it with vocab_size={V}, as nanoGPT's from_pretrained does, or check the class itself, "
                "which check builds with GPT-2's values" if padded and wte is None else "")
        raise CheckError(f"{type(model).__name__}'s embeddings are {got}; GPT-2 here has wte ({V}, {d}) and "
                         f"wpe ({P}, {d}){hint}")
    norms = [(n, m) for n, m in top if _is_norm(m, d)]
    heads = [(n, m) for n, m in top if not isinstance(m, nn.Embedding) and _weight2d(m) is not None]
    other = [n for n, m in top if not isinstance(m, nn.Embedding) and (n, m) not in norms + heads]
    if len(norms) != 1 or len(heads) > 1 or other:
        raise CheckError(f"outside its blocks {type(model).__name__} has norms {[n for n, _ in norms]}, output "
                         f"layers {[n for n, _ in heads]} and {other or 'nothing else'}; GPT-2 has one final "
                         f"LayerNorm (ln_f) and at most one lm_head")
    lm_head = None
    if heads and heads[0][1].weight is not wte[1].weight:
        h = heads[0][1]
        if sorted(h.weight.shape) != sorted((V, d)):
            raise CheckError(f"{heads[0][0]} has weight {tuple(h.weight.shape)}; GPT-2's lm_head maps {d} -> {V}")
        lm_head = Part(heads[0][0], h, "[out, in]" if tuple(h.weight.shape) == (V, d) else "[in, out]")
    blocks = [_block_roles(f"{bname}.{i}", b, cfg) for i, b in enumerate(container)]
    names = " ".join(p.name for p in blocks[0].values()) + " " + wte[0]
    style = ("nanoGPT/HF" if re.search(r"c_attn|c_fc", names) and "ln_1" in names else
             "the book's" if re.search(r"W_query|norm1|tok_emb", names) else None)
    tied = heads[0] if heads and lm_head is None else None  # Karpathy's lecture: nn.Linear(n_embd, vocab_size)
    bias = getattr(tied[1], "bias", None) if tied else None
    return Structure(Part(*wte), Part(*wpe) if wpe[1] is not None else None, blocks, Part(*norms[0]), lm_head, style,
                     head_bias=(f"{tied[0]}.bias", bias) if isinstance(bias, torch.Tensor) else None)


class OwnLinear(nn.Module):
    """A layer's weight and bias that a module reads directly, as a layer: nn.MultiheadAttention's in_proj_weight
    [3d, d] and in_proj_bias (GPT-2's c_attn, [out, in]), or a module's own Parameters (`c_attn_w [d, 3d]`,
    `c_attn_b`: x @ W + b). The same Parameters, so loading it loads the learner's; never called: no stage of its
    own (the module holding it gives the attention output)."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = weight, bias


class OwnPositions(nn.Module):
    """Position embeddings held as a Parameter of the model's own, (1, P, n_embd) or (P, n_embd) (minGPT's first
    `self.pos_emb = nn.Parameter(torch.zeros(1, block_size, n_embd))`), as wpe: the same Parameter."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight
        self.num_embeddings = weight.shape[-2]


def own_positions(model: nn.Module, skip: str, d: int, lo: int, hi: int):
    """(name, OwnPositions) of the one Parameter outside the blocks (skip), not named weight or bias (a layer's),
    shaped as position embeddings: (1, P, d) or (P, d), P in lo..hi; else None."""
    found = [(n, p) for n, p in model.named_parameters() if not (n == skip or n.startswith(skip + "."))
             and n.rpartition(".")[2] not in ("weight", "bias") and p.shape[-1] == d and lo <= p.shape[-2] <= hi
             and (p.dim() == 2 or p.dim() == 3 and p.shape[0] == 1)]
    return (found[0][0], OwnPositions(found[0][1])) if len(found) == 1 else None


class PerHead(nn.Module):
    """One of q, k, v computed per head by a layer of its own (Karpathy's "Let's build GPT": a ModuleList of Head
    modules, each with key, query, value nn.Linear(n_embd, head_size)), taken as one layer: loading gives head h
    columns h * d_head .. of GPT-2's, and a hook on it sees the heads' outputs side by side, (B, T, n_embd), as
    the lecture's torch.cat([h(x) for h in self.heads], dim=-1) puts them. The heads stay the learner's modules."""

    def __init__(self, heads: list):
        super().__init__()
        self.heads = tuple(heads)  # a tuple: not registered, so not counted as this module's submodules
        w = self.heads[0].weight
        self.layout = "[out, in]" if isinstance(self.heads[0], nn.Linear) or w.shape[0] < w.shape[1] else "[in, out]"

    def load(self, w, b, name: str) -> tuple:
        """Copy GPT-2's [in, out] weight w (n_embd, n_embd) and bias b into the heads: (ids of the Parameters
        copied, whether any head lacks a bias)."""
        hd, done, unbiased = w.shape[1] // len(self.heads), [], False
        for h, m in enumerate(self.heads):
            wh = w[:, h * hd:(h + 1) * hd]
            weight, bias = m.weight, getattr(m, "bias", None)  # a layer of its own may hold a weight alone
            _copy(weight, wh.T if self.layout == "[out, in]" else wh, f"{name} head {h} weight")
            done.append(id(weight))
            if bias is None:
                unbiased = True
            elif b is not None:
                _copy(bias, b[h * hd:(h + 1) * hd], f"{name} head {h} bias")
                done.append(id(bias))
        return done, unbiased

    def register_forward_hook(self, hook):
        """hook(self, args, (B, T, n_embd)) once every head has run, their outputs side by side."""
        outs = {}

        def each(i):
            def seen(m, args, out):
                outs[i] = out
                if len(outs) == len(self.heads):
                    hook(self, args, torch.cat([outs.pop(k) for k in range(len(self.heads))], dim=-1))
            return seen
        return _Handles([m.register_forward_hook(each(i)) for i, m in enumerate(self.heads)])


class _Handles:
    """Several hook handles removed as one."""

    def __init__(self, handles: list):
        self.handles = handles

    def remove(self):
        for h in self.handles:
            h.remove()


def per_head(lin: list, d: int, n_head: int) -> dict | None:
    """q, k, v as PerHead layers where a block's attention is n_head layers each of them, [d_head, d] (named
    query / key / value, or q / k / v: the Head modules' own names), in head order: {role: (name, PerHead)}."""
    hd = d // n_head
    heads = [(n, m) for n, m in lin if sorted(_weight2d(m).shape) == sorted((d, hd))]
    if hd == d or len(heads) != 3 * n_head:
        return None
    roles = {}
    for role in "qkv":
        mine = [(n, m) for n, m in heads if re.search(LINEAR_HINTS[role], n, re.IGNORECASE)]
        if len(mine) != n_head:
            return None
        stem, _, last = mine[0][0].rpartition(".")
        roles[role] = (f"{_common([n for n, _ in mine])}.*.{last}", PerHead([m for _, m in mine]))
    return roles


def stem(name: str, tail: str) -> str:
    """A Parameter's name without its weight / bias mark: c_attn_w, c_fc_weight -> c_attn, c_fc; W1, Wq, W_q -> 1,
    q, q; weight -> '' (tail: 'weight|w' or 'bias|b')."""
    cut = re.sub(rf"(^|[._])({tail})$", "", name, flags=re.I)
    return cut if cut != name else re.sub(rf"^({tail})[._]?", "", name, flags=re.I)


NORM_LIKE = re.compile(r"gamma|beta|scale|shift|gain|norm|^ln|_ln", re.I)


def own_linears(own: list, d: int) -> list:
    """A module's own Parameters as layers: (stem, weight, bias or None) per matrix. A bias is the vector with the
    matrix's stem (c_attn_w / c_attn_b, W1 / b1, Wq / bq), else the one vector whose length is one of the
    matrix's sides, else (two matrices, two vectors: an FFN's W1, b1, W2, b2 in any order) the first matrix's
    the hidden width and the second's n_embd."""
    mats = [(k, p) for k, p in own if p.dim() == 2]
    vecs = [(k, p) for k, p in own if p.dim() == 1 and not NORM_LIKE.search(k)]  # a gain or shift is no bias
    bias = {k: next((p for j, p in vecs if stem(j, "bias|b") == stem(k, "weight|w")), None) for k, _ in mats}
    for k, w in mats:
        free = [p for _, p in vecs if p.shape[0] in w.shape and all(p is not b for b in bias.values())]
        if bias[k] is None and len(free) == 1:
            bias[k] = free[0]
    if len(mats) == 2 == len(vecs) and any(b is None for b in bias.values()):
        for i, (k, _) in enumerate(mats):
            fits = [p for _, p in vecs if (p.shape[0] == d) == (i == 1)]
            bias[k] = fits[0] if len(fits) == 1 else None
    return [(s if (s := stem(k, "weight|w")) and not s.isdigit() else k, w, bias[k]) for k, w in mats]  # W1: W1


def _own_layers(name: str, m: nn.Module, d: int) -> list:
    """(name, layer) of what a leaf module holds: itself, or per matrix of its own Parameters an OwnLinear."""
    if isinstance(m, nn.MultiheadAttention) and m.in_proj_weight is not None:
        return [(f"{name}.in_proj", OwnLinear(m.in_proj_weight, m.in_proj_bias))]
    own = [(k, p) for k, p in m._parameters.items() if p is not None]
    if not any(p.dim() == 2 for _, p in own) or [k for k, p in own if p.dim() == 2] == ["weight"]:
        return [(name, m)]
    return [(f"{name}.{k}", OwnLinear(w, b)) for k, w, b in own_linears(own, d)]


def _block_roles(prefix: str, block: nn.Module, cfg: Config) -> dict:
    d, hidden = cfg.n_embd, cfg.hidden
    leaves = [x for n, m in _leaves(block) for x in _own_layers(n, m, d)]
    norms = [(n, m) for n, m in leaves if _is_norm(m, d)]
    lin = [(n, m) for n, m in leaves if _weight2d(m) is not None]
    strange = [n for n, m in leaves if (n, m) not in norms + lin]
    shape = lambda m: sorted(_weight2d(m).shape)  # noqa: E731
    fused = [x for x in lin if shape(x[1]) == sorted((d, 3 * d))]
    square = [x for x in lin if shape(x[1]) == [d, d]]
    ffn = [x for x in lin if shape(x[1]) == sorted((d, hidden))]
    heads = per_head(lin, d, cfg.n_head) if not fused else None  # Karpathy's lecture: each head's q, k, v
    split = [id(m) for _, p in (heads or {}).values() for m in p.heads]
    rest = [n for n, m in lin if (n, m) not in fused + square + ffn and id(m) not in split] + strange
    where = f"{prefix} ({type(block).__name__})"
    widths = {w for n, m in lin if n in rest for w in shape(m) if w != d}
    if len(norms) == 2 and not strange and len(rest) == 2 and len(widths) == 1 and not ffn:
        width = widths.pop()  # an FFN of another width than the reference's n_inner (4 x n_embd by habit)
        raise CheckError(f"{where}'s FFN ({', '.join(rest)}) is {width} wide ({width / d:.4g}x n_embd); the "
                         f"reference's is n_inner = {hidden} ({hidden / d:.4g}x): no weights of it fit; build c_fc "
                         f"as nn.Linear(n_embd, n_inner) from the checkpoint's config")
    if len(norms) != 2 or rest:
        raise CheckError(f"{where} has LayerNorms {[n for n, _ in norms]} and other layers {rest}; a GPT-2 block has "
                         f"two LayerNorms of width {d} and linear layers of shapes [{d}, {3 * d}] or 3 x [{d}, {d}], "
                         f"[{d}, {d}], [{d}, {hidden}], [{hidden}, {d}]")
    roles = _pick(["ln_1", "ln_2"], norms, NORM_HINTS)
    if len(ffn) != 2:
        raise CheckError(f"{where} has {len(ffn)} layers of shape {d} x {hidden} ({[n for n, _ in ffn]}); GPT-2's FFN "
                         "has two, c_fc then c_proj")
    mods = [m for _, m in lin]
    linear_fc = [x for x in ffn if isinstance(x[1], nn.Linear)]
    if len(linear_fc) == 2:  # nn.Linear stores [out, in]: c_fc's weight is [hidden, d]
        ffn = sorted(ffn, key=lambda x: x[1].weight.shape[1] != d)
        roles.update({"mlp.c_fc": ffn[0], "mlp.c_proj": ffn[1]})
    else:
        roles.update(_pick(["mlp.c_fc", "mlp.c_proj"], ffn, LINEAR_HINTS))
    if len(fused) == 1 and len(square) == 1:
        roles.update({"attn.c_attn": fused[0], "attn.c_proj": square[0]})
        attn = [fused[0][0], square[0][0]]
    elif heads and len(square) == 1:
        roles.update({**heads, "attn.c_proj": square[0]})
        attn = [n for n, m in lin if id(m) in split] + [square[0][0]]
    elif not fused and len(square) == 4:
        roles.update(_pick(["q", "k", "v", "attn.c_proj"], square, LINEAR_HINTS))
        attn = [n for n, _ in square]
    else:
        raise CheckError(f"{where} has {len(fused)} layers of shape {d} x {3 * d} and {len(square)} of {d} x {d} "
                         f"({', '.join(n for n, _ in fused + square)}): cannot tell which is which; GPT-2's attention "
                         f"has c_attn [{d}, {3 * d}] and c_proj [{d}, {d}], or q, k, v and an output projection, "
                         f"4 x [{d}, {d}]")
    out = {}
    for role, (n, m) in roles.items():
        n_in, n_out = {"attn.c_attn": (d, 3 * d), "mlp.c_fc": (d, hidden), "mlp.c_proj": (hidden, d)}.get(role, (d, d))
        lay = m.layout if isinstance(m, PerHead) else _layout(m, n_in, n_out, mods) if _weight2d(m) is not None \
            else None
        out[role] = Part(f"{prefix}.{n}", m, lay)
    named_mods = dict(block.named_modules())
    others = {id(m) for role, (_, m) in roles.items() if not role.startswith("mlp.")} | set(split)
    for role, names in (("attn", attn), ("mlp", [roles["mlp.c_fc"][0], roles["mlp.c_proj"][0]])):
        n = _common(names)
        while role == "mlp" and n:  # the FFN is the outermost module holding it alone: the book's ff, not ff.layers
            up = n.rpartition(".")[0]
            if not up or any(id(m) in others for m in named_mods[up].modules()):
                break
            n = up
        out[role] = Part(f"{prefix}.{n}" if n else prefix, named_mods[n])
    out["block"] = Part(prefix, block)
    return out


# ---- loading the reference weights ----------------------------------------------------------------------

def _copy(param, value, what) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise CheckError(f"{what} has shape {tuple(param.shape)}; GPT-2's tensor for it is {tuple(value.shape)}")
    with torch.no_grad():
        param.copy_(value)


def _params(part: Part, one_d: bool):
    """(weight, bias) Parameters of a layer: by name (weight/scale/gamma, bias/shift/beta), else in order."""
    ps = [(k, p) for k, p in part.module._parameters.items() if p is not None]
    w = next((p for k, p in ps if k in WEIGHT_NAMES), None)
    b = next((p for k, p in ps if k in BIAS_NAMES), None)
    if w is None:
        w = ps[0][1]
    if b is None and not one_d:
        b = next((p for k, p in ps if p is not w and p.dim() == 1), None)
    elif b is None:
        b = next((p for k, p in ps if p is not w), None)
    return w, b


def _own(param, value, raw) -> str | None:
    """What the learner's own tensor held before check copied GPT-2's `value` in (raw: HF's tensor, [in, out]):
    'same' (to bf16's rounding), how it differs, or None where GPT-2's tensor is one constant (a LayerNorm at its
    init: every model holds that) or the shapes differ (_copy names it)."""
    p, v = param.detach().float(), value.detach().float()
    if p.shape != v.shape or not p.numel() or bool((v == v.flatten()[0]).all()):
        return None
    bar = 1e-2 * float(v.abs().max())

    def near(a):
        return a.shape == p.shape and bool(((p - a).abs() <= bar).all())
    if near(v):
        return "same"
    if raw is not value and raw.numel() == p.numel() and near(raw.detach().float().reshape(p.shape)):
        return "GPT-2's [in, out] data reshaped or viewed, not transposed"
    if p.dim() == 2 and near(v.T):
        return "transposed"
    return "other values"


def load_weights(s: Structure, model: nn.Module, hf, cfg: Config) -> tuple:
    """Copy HF's weights into the learner's model: (tensors copied, notes on what GPT-2 has and it lacks,
    names of the learner's parameters left without a GPT-2 tensor, the tensors its own loading got wrong:
    [(name, how)] where some others held GPT-2's values already, else [])."""
    d = cfg.n_embd
    tr, done, notes, unbiased, own = hf.transformer, set(), [], [], []

    def put(part, key, w, b=None):
        if isinstance(part.module, PerHead):  # each head its columns of GPT-2's
            ids, lacks = part.module.load(w, b, part.name)
            done.update(ids)
            if lacks and b is not None:
                unbiased.append(f"{part.name} has no bias (GPT-2's {key} has one)")
            return
        weight, bias = _params(part, w.dim() == 1)
        value = w.T if part.layout == "[out, in]" else w
        own.append((f"{part.name}.weight ({key})", _own(weight, value, w)))
        _copy(weight, value, f"{part.name} ({key}) weight")
        done.add(id(weight))
        if b is not None:
            if bias is None:
                unbiased.append(f"{part.name} has no bias (GPT-2's {key} has one)")
            else:
                own.append((f"{part.name}.bias ({key})", _own(bias, b, b)))
                _copy(bias, b, f"{part.name} ({key}) bias")
                done.add(id(bias))

    put(s.wte, "wte", tr.wte.weight)
    if s.wpe is None:
        notes.append("no position embeddings (an nn.Embedding, or a Parameter of (n_positions, n_embd)): GPT-2's "
                     "wpe has nowhere to go")
    else:
        n_pos = s.wpe.module.num_embeddings
        wpe = tr.wpe.weight[:n_pos]
        put(s.wpe, "wpe", wpe.reshape(s.wpe.module.weight.shape) if isinstance(s.wpe.module, OwnPositions) else wpe)
        if n_pos < cfg.n_positions:
            notes.append(f"{s.wpe.name} holds {n_pos} positions: given GPT-2's first {n_pos} (of {cfg.n_positions})")
    for i, roles in enumerate(s.blocks):
        h = tr.h[i]
        for key in ("ln_1", "ln_2", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            m = h.get_submodule(key)
            put(roles[key], f"h.{i}.{key}", m.weight, m.bias)
        if "attn.c_attn" in roles:
            put(roles["attn.c_attn"], f"h.{i}.attn.c_attn", h.attn.c_attn.weight, h.attn.c_attn.bias)
        else:
            for j, role in enumerate("qkv"):
                put(roles[role], f"h.{i}.attn.c_attn[{role}]", h.attn.c_attn.weight[:, j * d:(j + 1) * d],
                    h.attn.c_attn.bias[j * d:(j + 1) * d])
    put(s.ln_f, "ln_f", tr.ln_f.weight, tr.ln_f.bias)
    notes += unbiased if len(unbiased) <= 3 else [f"{len(unbiased)} layers have no bias where GPT-2's have one: "
                                                  f"{'; '.join(unbiased[:3])}; ..."]
    if s.head_bias is not None:
        _copy(s.head_bias[1], torch.zeros(cfg.vocab_size), s.head_bias[0])
        done.add(id(s.head_bias[1]))
        notes.append(f"{s.head_bias[0]}: GPT-2's head has no bias: given zeros (GPT-2's is nn.Linear(n_embd, "
                     "vocab_size, bias=False))")
    if s.lm_head is not None:  # [in, out]: the book's loader does out_head.weight = wte; HF's state_dict holds
        biased = _params(s.lm_head, False)[1] is not None  # Karpathy's lecture: nn.Linear(n_embd, vocab_size)
        put(s.lm_head, "lm_head", tr.wte.weight.T,  # lm_head.weight = wte, which nanoGPT's and minGPT's copy
            torch.zeros(cfg.vocab_size) if biased else None)
        notes.append(f"{s.lm_head.name} is not tied to {s.wte.name}: given wte's values, as GPT-2 ties them "
                     "(HF's state_dict holds them as lm_head.weight)")
        if biased:
            notes.append(f"{s.lm_head.name} has a bias, which GPT-2's head has not: given zeros (GPT-2's is "
                         "nn.Linear(n_embd, vocab_size, bias=False))")
    # its own loading ran (most tensors that are not one constant held GPT-2's values): what it got wrong is
    # worth saying; a few near-constant ones (LayerNorm gains a short run from their init) are no sign of it
    told = [how for _, how in own if how is not None]
    loaded = 2 * told.count("same") > len(told)
    wrong = [(n, how) for n, how in own if loaded and how not in (None, "same")]
    return len(done), notes, [n for n, p in model.named_parameters() if id(p) not in done], wrong


# ---- running it: every stage, by forward hooks ----------------------------------------------------------

def _tensor(o):
    """A module's output tensor: the tensor, a tuple's first tensor (after a None loss: `return None, logits`),
    an output object's or a dict's logits."""
    if isinstance(o, torch.Tensor):
        return o
    if isinstance(o, (tuple, list)) and o and (isinstance(o[0], torch.Tensor) or o[0] is None):
        return next((t for t in o if isinstance(t, torch.Tensor)), None)
    logits = o.get("logits") if isinstance(o, dict) else getattr(o, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def _head(model: nn.Module, s: Structure, cfg: Config) -> str | None:
    """The name of a module of the model's that is an LM head (a weight of wte's shape, other than wte)."""
    shapes = {(cfg.vocab_size, cfg.n_embd), (cfg.n_embd, cfg.vocab_size)}
    return next((n for n, m in model.named_modules() if not isinstance(m, nn.Embedding) and m is not s.wte.module
                 and (s.wpe is None or m is not s.wpe.module) and isinstance(getattr(m, "weight", None), torch.Tensor)
                 and tuple(m.weight.shape) in shapes), None)


def _logits(o, s: Structure, cfg: Config, head: str | None = None, rows: int = 1):
    """(logits, note) from a model's output for `rows` sequences. A trunk with no LM head (HF's GPT2Model, a
    last_hidden_state of (1, T, n_embd)) gets GPT-2's tied head, hidden @ wte.T, and a note saying so; a model
    that has a head (`head`, its name) and returns the hidden state is refused: its forward never applies it.
    2-D logits are the last position's, (rows, vocab), or every position's flattened, (rows * T, vocab)."""
    t = _tensor(o)
    if t is None:
        t = getattr(o, "last_hidden_state", None)
        t = t if isinstance(t, torch.Tensor) else None
    if t is not None and t.dim() == 2 and t.shape[-1] == cfg.vocab_size:  # (B, V), or flattened (B * T, V)
        t = t[:, None] if t.shape[0] == rows else t.reshape(rows, -1, t.shape[-1]) if t.shape[0] % rows == 0 else t
    if t is None or t.dim() != 3 or t.shape[-1] != cfg.n_embd or cfg.n_embd == cfg.vocab_size:
        return t, None
    if head is not None:
        raise CheckError(f"the model returned {tuple(t.shape)}, the hidden state, not logits (1, T, "
                         f"{cfg.vocab_size}): it holds an LM head, {head}, that its forward never applies")
    return t @ s.wte.module.weight.T, (f"no LM head: its output {tuple(t.shape)} taken as the last hidden state, "
                                       "logits by GPT-2's tied head (hidden @ wte.T)")


def run_stages(model: nn.Module, s: Structure, ids: list, cfg: Config, name: str) -> dict:
    """One eval() forward of the learner's model; every stage its modules saw, as float32 numpy (first call)."""
    seen, hooks, T, d, H = {}, [], len(ids), cfg.n_embd, cfg.n_head

    def keep(key, t):
        if isinstance(t, torch.Tensor) and key not in seen:
            seen[key] = t.detach().float().numpy().copy()

    def out(key, pick=lambda t: t):
        return lambda m, a, o: keep(key, pick(_tensor(o)))

    def first_input(key):
        return lambda m, a, kw: keep(key, a[0] if a else next(iter(kw.values()), None))

    def add(r, role, fn, pre=False):
        m = r[role].module
        hooks.append(m.register_forward_pre_hook(fn, with_kwargs=True) if pre else m.register_forward_hook(fn))

    hooks.append(s.blocks[0]["block"].module.register_forward_pre_hook(first_input("embeddings"), with_kwargs=True))
    ran = set()  # block 0's roles whose module ran: a stage not seen of one that did not is "never called"
    for role, part in s.blocks[0].items():
        if not isinstance(part.module, (PerHead, OwnLinear)):
            hooks.append(part.module.register_forward_pre_hook(lambda m, a, role=role: ran.add(role)))
    for i, r in enumerate(s.blocks):
        def hook(role, fn, pre=False, r=r):
            add(r, role, fn, pre)
        hook("ln_1", out(f"h{i}_ln_1"))
        if "attn.c_attn" in r:
            for j, role in enumerate("qkv"):
                hook("attn.c_attn", out(f"h{i}_{role}", lambda t, j=j: t[..., j * d:(j + 1) * d]))
        else:
            for role in "qkv":
                hook(role, out(f"h{i}_{role}"))
        for m in r["attn"].module.modules():  # attention probabilities: what a dropout after the softmax sees
            if isinstance(m, nn.Dropout):
                hooks.append(m.register_forward_pre_hook(lambda mod, a, i=i: keep(f"h{i}_attn_probs", a[0]) if (
                    a[0].dim() == 4 and tuple(a[0].shape[-3:]) == (H, T, T)) else None))
        hook("attn.c_proj", out(f"h{i}_attn_out"))
        if isinstance(r["attn.c_proj"].module, OwnLinear) or isinstance(r["attn"].module, nn.MultiheadAttention):
            hook("attn", out(f"h{i}_attn_out"))  # its projection is read, not called (MHA's out_proj, x @ W + b)
        hook("ln_2", first_input(f"h{i}_attn_resid"), pre=True)
        hook("ln_2", out(f"h{i}_ln_2"))
        hook("mlp.c_fc", out(f"h{i}_c_fc"))
        hook("mlp.c_proj", first_input(f"h{i}_gelu"), pre=True)
        # the FFN's output: its module's, unless that is the block or a container that is never called (minGPT's
        # ModuleDict, run by a lambda): then c_proj's
        called = runs_alone(r)
        hook("mlp" if called else "mlp.c_proj", out(f"h{i}_ffn"))
        hook("block", out(f"h{i}_block"))
    hooks.append(s.ln_f.module.register_forward_hook(out("ln_f")))
    try:
        with torch.no_grad():
            logits, headless = _logits(model(torch.tensor([ids])), s, cfg, _head(model, s, cfg))
    except CheckError:
        raise
    except Exception as e:
        raise CheckError(f"{name} failed on token ids of shape (1, {T}): {type(e).__name__}: {e}".splitlines()[0]) \
            from None
    finally:
        for h in hooks:
            h.remove()
    if logits is None or logits.dim() != 3 or logits.shape[-1] != cfg.vocab_size:
        got = tuple(logits.shape) if logits is not None else "no tensor"
        raise CheckError(f"{name} returned {got}; a GPT-2 returns logits (1, T, {cfg.vocab_size}) (or a tuple or "
                         "output object holding them first, or a dict's 'logits')")
    seen["logits"] = logits.detach().float().numpy()
    seen["headless"] = headless
    seen["uncalled"] = {role: part.name for role, part in s.blocks[0].items() if role not in ran
                        and not isinstance(part.module, (PerHead, OwnLinear))}
    return seen


def greedy(step, ids: list, n: int) -> list:
    """n greedy next tokens, each from a full forward of the prompt so far (no KV cache: nothing to trust)."""
    prompt, ids = len(ids), list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(step(torch.tensor([ids]))[0, -1].argmax()))
    return ids[prompt:]  # (not ids[-n:]: at n = 0 that is the whole prompt)


# ---- the known mistakes at the first divergence ---------------------------------------------------------

@dataclass
class Reference:
    """HF GPT-2 on the prompt: its model, config, every stage (float32 numpy), and its greedy tokens."""

    source: str
    model: nn.Module
    cfg: Config
    ids: list
    stages: dict
    tokens: list    # its greedy next tokens: NEW_TOKENS, fewer where the context is shorter than prompt + them
    forced: np.ndarray  # its logits (1, T, vocab) over the prompt and those tokens, one forward (teacher-forced)
    batch: list     # two sequences of that length: the prompt and those tokens, and other ids
    batched: np.ndarray  # its logits (2, T, vocab) over them, one forward


@lru_cache(maxsize=2)
def reference(source: str) -> Reference:
    model, cfg, info = load_reference(source)
    # a context under 10 positions (prompt + NEW_TOKENS) takes a shorter prompt, then fewer new tokens
    ids = [i % cfg.vocab_size for i in TOKEN_IDS][:max(1, cfg.n_positions - NEW_TOKENS)]
    t = capture(model, cfg, ids, list(range(cfg.n_layer)))
    d = cfg.n_embd
    for L in range(cfg.n_layer):  # q, k, v as the c_attn output's thirds, (1, T, d): any learner's layout
        for j, role in enumerate("qkv"):
            t[f"h{L}_{role}"] = np.ascontiguousarray(t[f"h{L}_c_attn"][..., j * d:(j + 1) * d])
    tokens = greedy(lambda x: model(x).logits, ids, min(NEW_TOKENS, cfg.n_positions - len(ids)))
    batch = [ids + tokens, [(7 * i + 3) % cfg.vocab_size for i in ids + tokens]]
    with torch.no_grad():
        forced = model(torch.tensor([ids + tokens])).logits.float().numpy()
        batched = model(torch.tensor(batch)).logits.float().numpy()
    return Reference(info["source"], model, cfg, ids, t, tokens, forced, batch, batched)


def blind_spots(ref: Reference) -> list:
    """What the reference's weights cannot show: every linear-layer bias 0, every LayerNorm the identity (a
    checkpoint saved from HF's init), so a bias or a LayerNorm's gain and shift left out computes the same."""
    tr, out = ref.model.transformer, []
    linears = [m for b in tr.h for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)]
    norms = [n for b in tr.h for n in (b.ln_1, b.ln_2)] + [tr.ln_f]
    if all(m.bias is None or not bool(m.bias.any()) for m in linears):
        out.append("a linear layer's bias left out (every bias of this checkpoint is 0)")
    if all(bool((n.weight == 1).all()) and not bool(n.bias.any()) for n in norms):
        out.append("a LayerNorm's gain and shift left out (every LayerNorm of this checkpoint has weight 1, bias 0)")
    return out


def ffn_case(ref: Reference, layer: int) -> FFNCase:
    """Block `layer`'s FFN as the reference computed it: HF's weights, its ln_2 output as the input, its stages."""
    t, mlp = ref.stages, ref.model.transformer.h[layer].mlp
    return FFNCase(ref.source, layer, ref.cfg.gelu_approximate,
                   {k: v.detach().float().numpy() for k, v in mlp.state_dict().items()}, t[f"h{layer}_ln_2"],
                   t[f"h{layer}_attn_resid"], {s: t[f"h{layer}_{s}"] for s in ("c_fc", "gelu", "ffn")})


def runs_alone(block: dict) -> bool:
    """Whether a block's FFN is a module of its own that can run alone (not the block itself, not a ModuleDict
    that the block runs in a lambda, as minGPT's)."""
    m = block["mlp"].module
    return m is not block["block"].module and type(m).forward is not nn.Module.forward \
        and not isinstance(m, (nn.ModuleDict, nn.ModuleList))


def _float64(t):
    return torch.as_tensor(np.asarray(t), dtype=torch.float64)


def diagnose(ref: Reference, stage: str, layer, got, atol: float, runs_differ=False, seen=None):
    """The known mistake that the first divergent stage equals (closest first; mistakes equal there told apart
    by the learner's later stages, `seen`, where they differ), else dropout, else the worst element: a
    gpt2ffn.diagnose.Diagnosis. A stage with NaN/Inf is matched on its finite values, to NON_FINITE_MISTAKES."""
    from .diagnose import Diagnosis
    from .diagnose import diagnose as plain
    cfg, t = ref.cfg, ref.stages
    key = stage if layer is None else f"h{layer}_{stage}"
    expected = t[key] if stage != "logits" else t["logits"][:, -got.shape[1]:]
    found = []   # (distance, key, name, fix)
    finite = np.isfinite(got)

    def offer(k, want):
        want = want.detach().numpy() if isinstance(want, torch.Tensor) else want
        if want.shape != got.shape:
            return
        sure = np.isfinite(want)  # a mistake whose values are NaN or Inf (NON_FINITE) where the learner's are
        if sure.all() and (finite.all() or k in NON_FINITE_MISTAKES and 2 * finite.sum() >= finite.size) or (
                k in NON_FINITE and finite.any() and np.array_equal(sure, finite)
                and np.array_equal(got[~finite], want[~sure].astype(got.dtype), equal_nan=True)):
            dist = float(np.abs(got[finite] - want[finite]).max())
            if stage in GOLDEN_SCALED:  # logits O(100), the residual stream to ~3000: float32 rounding alone
                dist *= atol / max(atol, DIAGNOSE_RTOL * float(np.abs(want).max()))  # reaches 1e-5 of max
            found.append((dist, k, *{**MISTAKES, **MODEL_MISTAKES}[k]))

    def norm_alone(x, w, b):  # one LayerNorm wrong on HF's own input to it (the block's others may be right)
        for k, want in layer_norm_mistakes(x, w, b, cfg.layer_norm_epsilon):
            offer(k, want)

    if layer is not None:
        hf = ref.model.transformer.h[layer]
        w = {k: v.detach().double() for k, v in hf.state_dict().items() if k not in ("attn.bias", "attn.masked_bias")}
        x = _float64(t["embeddings"] if layer == 0 else t[f"h{layer - 1}_block"])
        for k in MISTAKES:
            offer(k, block_forward(x, w, cfg, k, layer)[stage])
        usual = {"scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True}
        flags = [f for f, v in usual.items() if getattr(cfg, f) != v]  # the reference's HF options, where the
        for f in flags:                                                  # learner wrote GPT-2 as usual
            offer(f"ref_{f}", block_forward(x, w, dataclasses.replace(cfg, **{f: usual[f]}), None, layer)[stage])
        if len(flags) == 2:
            offer("ref_scale_attn_both", block_forward(x, w, dataclasses.replace(cfg, **usual), None, layer)[stage])
        if stage == "ln_2":
            norm_alone(t[f"h{layer}_attn_resid"], w["ln_2.weight"], w["ln_2.bias"])
        if stage in ("c_fc", "gelu", "ffn"):
            case = ffn_case(ref, layer)
            hits = case.matching(stage, got, atol)
            later = (seen or {}).get(f"h{layer}_ffn")
            if len(hits) > 1 and later is not None:  # GELU left out and GELU after c_proj agree until the FFN output
                after = {v.key for _, v in case.matching("ffn", later, atol)}
                hits.sort(key=lambda h: (h[1].key not in after, h[0]))
            if hits:
                return named(hits[0][1], stage, hits[0][0])
    elif stage == "embeddings":
        tr = ref.model.transformer
        offer("positions_not_added", tr.wte.weight[ref.ids].detach().double()[None])
        T = len(ref.ids)
        if T < cfg.n_positions:
            offer("positions_from_1", (tr.wte.weight[ref.ids] + tr.wpe.weight[1:T + 1]).detach().double()[None])
    elif stage == "ln_f":
        ln, last = ref.model.transformer.ln_f, t[f"h{cfg.n_layer - 1}_block"]
        norm_alone(last, ln.weight.detach().double(), ln.bias.detach().double())
        offer("no_ln_f", last)
    elif stage == "logits":
        wte = ref.model.transformer.wte.weight.detach().double()
        offer("logits_without_ln_f", (_float64(t[f"h{cfg.n_layer - 1}_block"]) @ wte.T)[:, -got.shape[1]:])
    hits = sorted(f for f in found if f[0] <= atol)
    if hits:
        dist, k, name, fix = hits[0]
        return Diagnosis(stage, k, f"{name} (within {dist:.1e} of it): {fix}", dist)
    p = dropout_rate(got, expected, atol)
    if p is not None or runs_differ:
        rate = f"{p:.0%} of the elements are 0 and the rest scaled by {1 / (1 - p):.4f} = 1/(1 - p); " if p else ""
        return Diagnosis(stage, "dropout", f"dropout left on in eval(): two runs differ; {rate}call model.eval(), "
                                           "and use nn.Dropout or F.dropout(x, p, training=self.training)")
    return plain(stage, got, expected, [], atol)


# ---- the check ----------------------------------------------------------------------------------------

@dataclass
class Row:
    """One stage, judged over the blocks it was reached in."""

    checkpoint: str
    stage: str
    blocks: str
    shape: tuple
    max_abs: float
    atol: float | None
    status: str       # PASS, FAIL, or "--" (not hooked, or not reached)
    note: str = ""

    def as_dict(self):
        return {**self.__dict__, "shape": list(self.shape)}


@dataclass
class ModelReport:
    """A whole model's check: rows per stage in forward order, the first divergence and its diagnosis."""

    subject: str
    info: list
    rows: list
    verdict: str
    diagnosis: object = None
    first: dict | None = None    # {"layer", "stage", "checkpoint"} of the first divergence
    kind: str = "model"
    passed: bool = field(init=False)

    def __post_init__(self):
        self.passed = all(r.status != "FAIL" for r in self.rows)

    def format(self) -> str:
        w = max(len(r.stage) for r in self.rows) + 5
        head = f"{'checkpoint':<{w}}{'blocks':<8}{'shape':<18}{'max abs':>11}{'tol':>9}  result"
        lines = [f"MODEL check of {self.subject}", *[f"  {i}" for i in self.info], head, "-" * len(head)]
        for r in self.rows:
            num = f"{r.max_abs:>11.3e}" if r.max_abs == r.max_abs else f"{'':>11}"
            tol = f"{r.atol:>9.0e}" if r.atol is not None else f"{'':>9}"
            lines.append(f"{r.checkpoint + ' ' + r.stage:<{w}}{r.blocks:<8}{str(tuple(r.shape)):<18}{num}{tol}  "
                         f"{r.status}" + (f"  {r.note}" if r.note else ""))
        seen = {}
        for r in self.rows:
            if r.checkpoint == "--":  # not one of seed 001's (its own weights)
                continue
            seen[r.checkpoint] = "FAIL" if "FAIL" in (seen.get(r.checkpoint), r.status) else (
                "PASS" if "PASS" in (seen.get(r.checkpoint), r.status) else "--")
        lines.append("seed 001's checkpoints: " + "  ".join(f"{ck} {st}" for ck, st in seen.items()))
        return "\n".join(lines + [self.verdict])

    def as_dict(self) -> dict:
        return {"kind": self.kind, "subject": self.subject, "passed": self.passed, "info": self.info,
                "rows": [r.as_dict() for r in self.rows], "verdict": self.verdict, "first_divergence": self.first,
                "diagnosis": self.diagnosis.as_dict() if self.diagnosis else None}


def _span(layers: list) -> str:
    if not layers:
        return ""
    return str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"


def square(m: nn.Module) -> bool:
    """A linear layer whose weight's layout its shape cannot tell: a square 2-D weight of a module neither nn.Linear
    ([out, in]) nor a Conv1D ([in, out]); a pointwise nn.Conv1d's weight is 3-D, its layout known."""
    w = _weight2d(m) if not isinstance(m, PerHead) else None
    return w is not None and w.shape[0] == w.shape[1] and not isinstance(m, nn.Linear) \
        and "conv1d" not in type(m).__name__.lower()


def check_model(model: nn.Module, name: str, built: list, source: str = DEFAULT_MODEL,
                atol: float = GOLDEN_ATOL, fresh: bool = False) -> ModelReport:
    """Load the reference's weights into the learner's GPT-2, run it on the prompt, judge each stage in
    forward order, stop at the first divergence and diagnose it. Unless fresh (built by check from a class),
    the tensors its own loader got wrong are named (load_weights). Square layers of its own Parameters, whose
    layout check takes from their siblings (a [d, 3d] c_attn used as x @ W), are judged in the other layout too
    where the first fails as a layer not transposed: a w_o used through F.linear beside it is as right."""
    s = find_structure(model, reference(source).cfg)
    guessed = any(square(p.module) for b in s.blocks for p in b.values())
    came = [p.detach().clone() for p in model.parameters()] if guessed and not fresh else None
    report = _check_model(model, name, built, source, atol, fresh)
    key = report.diagnosis.key if report.diagnosis is not None else None
    if report.passed or not guessed or not (key or "").endswith(("not_transposed", "viewed")):
        return report
    if came is not None:  # its own weights as they came, for the retry's own-weights check (not the first run's)
        with torch.no_grad():
            for p, c in zip(model.parameters(), came):
                p.copy_(c)
    other = _check_model(model, name, built, source, atol, fresh, flip_square=True)
    if not other.passed:
        return report
    other.info.append("note: its square layers of its own Parameters cannot be told [in, out] from [out, in] by "
                      "their shape, nor by their siblings here: judged in the layout in which they compute GPT-2")
    return other


def _check_model(model: nn.Module, name: str, built: list, source: str, atol: float, fresh: bool,
                 flip_square: bool = False) -> ModelReport:
    """check_model, its square own-Parameter layers in the layout their siblings say, or (flip_square) the
    other one."""
    ref = reference(source)
    cfg = ref.cfg
    s = find_structure(model, cfg)
    if flip_square:
        for b in s.blocks:
            for p in b.values():
                if square(p.module):
                    p.layout = "[in, out]" if p.layout == "[out, in]" else "[out, in]"
    n, notes, wrong = _load_all(s, model, ref, cfg)
    tied = "lm_head tied to wte" if s.lm_head is None else f"lm_head = {s.lm_head.name}"
    how = f"by name ({s.style} naming)" if s.style else "by shape and order within each block (names not HF's, " \
                                                         "nanoGPT's or the book's)"
    layouts = sorted({p.layout for b in s.blocks for p in b.values() if p.layout})
    info = built + [f"weights: {ref.source} ({cfg.n_layer} blocks, n_embd {cfg.n_embd}), {n} tensors mapped {how}; "
                    f"linear layers {' and '.join(layouts)}; {tied}" + "".join(f"; {x}" for x in notes),
                    f"fed token ids {ref.ids} in eval(); each stage compared with HF GPT-2's own modules, tolerance "
                    f"{atol:.0e} (the residual stream: {GOLDEN_SCALED['block']:.0e} x its max |value|, logits: "
                    f"{GOLDEN_SCALED['logits']:.0e} x max |logits|, when larger)"]
    wrong = [] if fresh else wrong
    if wrong:  # its own loader ran (other tensors held GPT-2's values) and got these wrong: judged, they'd not show
        shown = "; ".join(f"{n}: {how}" for n, how in wrong[:4]) + ("; ..." if len(wrong) > 4 else "")
        info.append(f"note: {name}'s own weights were GPT-2's before check copied them in, but for {len(wrong)} "
                    f"tensor{'s' * (len(wrong) != 1)} ({shown}); what follows judges the computation with GPT-2's "
                    f"weights, so fix the loading there too")
    was_training = model.training
    model.eval()
    try:
        got = run_stages(model, s, ref.ids, cfg, name)
        if got["headless"]:
            info.append(got["headless"])
        order = ([("embeddings", None)] + [(st, L) for L in range(cfg.n_layer) for st, _, _ in BLOCK_STAGES]
                 + [("ln_f", None), ("logits", None)])
        judged, unhooked, first = {}, set(), None   # stage -> [(layer, max_abs, status, note, shape)]
        for stage, L in order:
            key = stage if L is None else f"h{L}_{stage}"
            if key not in got:
                unhooked.add(stage)
                continue
            expected = ref.stages[key]
            mine = got[key]
            if stage == "logits" and mine.ndim == 3 and mine.shape[1] < expected.shape[1]:
                expected = expected[:, -mine.shape[1]:]  # nanoGPT: the last position only
            tol = max(atol, GOLDEN_SCALED.get(stage, 0.0) * float(np.abs(expected).max()))  # verify's rule
            r = compare(key, {"checkpoint": CHECKPOINT[stage], "layer": L}, mine, expected, tol)
            judged.setdefault(stage, []).append((L, r.max_abs, r.status, r.note, r.shape, tol))
            if r.status == "FAIL":  # a second run tells dropout left on from a deterministic mistake
                again = run_stages(model, s, ref.ids, cfg, name)
                first = (stage, L, mine, not np.array_equal(mine, again.get(key), equal_nan=True))
                break
        tokens = None if first else greedy(lambda x: _logits(model(x), s, cfg)[0], ref.ids, len(ref.tokens))
        forced = None if first else teacher_forced(model, s, ref, atol)
        batch = None if first else teacher_forced(model, s, ref, atol, batch=True)
    finally:
        model.train(was_training)
    rows = []
    for stage, ck, label in [MODEL_STAGES[0]] + BLOCK_STAGES + MODEL_STAGES[1:3]:
        entries = judged.get(stage, [])
        if not entries:
            role = {"attn_resid": "ln_2", "attn_out": "attn.c_proj", "c_fc": "mlp.c_fc", "gelu": "mlp.c_proj",
                    "ffn": "mlp"}.get(stage, stage)
            never = got.get("uncalled", {}).get(role) if stage in unhooked else None
            why = ("not reached" if stage not in unhooked else f"not hooked: {never} is never called in the forward "
                   "(its weights read directly, or not used)"
                   if never else "not hooked: no dropout module sees them (fused or functional attention)"
                   if stage == "attn_probs" else "not hooked: no module of yours returns it")
            rows.append(Row(ck, label, "", (), float("nan"), None, "--", why))
            continue
        layers = [e[0] for e in entries if e[0] is not None]
        worst = max(entries, key=lambda e: (e[2] == "FAIL", e[1] if e[1] == e[1] else np.inf))
        note = worst[3] + (f" (block {worst[0]})" if worst[2] == "FAIL" and worst[0] is not None else "")
        rows.append(Row(ck, label, _span(layers), worst[4], worst[1], worst[5], worst[2], note.strip()))
    ck, label = MODEL_STAGES[3][1:]
    label = f"greedy next {len(ref.tokens)} token" + "s" * (len(ref.tokens) != 1)
    forced_label = f"logits on prompt + {len(ref.tokens)} (forced)"  # HF's greedy tokens, teacher-forced
    batch_label = "logits, a batch of 2 (forced)"
    if tokens is None:
        for what in (label, forced_label, batch_label):
            rows.append(Row(ck, what, "", (), float("nan"), None, "--", "not reached"))
    else:
        ok = tokens == ref.tokens
        rows.append(Row(ck, label, "", (len(tokens),), float("nan"), None, "PASS" if ok else "FAIL",
                        f"got {tokens}" + ("" if ok else f", expected {ref.tokens}")))
        rows.append(forced_row := Row(ck, forced_label, "", *forced))
        rows.append(batch_row := Row(ck, batch_label, "", *batch))
        tokens_row = rows[-3]
    own_row = None
    if wrong:  # its computation may be GPT-2's, but not its weights as it loads them
        rows.append(own_row := Row("--", "its own weights, as its loader left them", "", (len(wrong),), float("nan"),
                                   None, "FAIL", f"{len(wrong)} tensor{'s' * (len(wrong) != 1)} not GPT-2's: the "
                                                 f"note above"))
    if first is None:
        late = [  # (row, stage, checkpoint, what, verdict) of a failure after every stage passed, in this order
            (forced_row, "logits_forced", ck, forced_label,
             f"FAIL (logits past the prompt, checkpoint 10): {forced_row.note}, though every stage on the "
             f"{len(ref.ids)}-token prompt is within tolerance and the greedy tokens agree: a causal mask or position "
             f"that goes wrong only past the prompt's length?"),
            (batch_row, "logits_batch", ck, batch_label,
             f"FAIL (a batch of 2 sequences, checkpoint 10): {batch_row.note}, though one sequence alone is right at "
             f"every stage: something mixes the batch's sequences (heads merged with a permute or reshape across the "
             f"batch axis, attention or a LayerNorm over it)?"),
            (own_row, "own_weights", None, "its own weights",
             f"FAIL (its own weights): {name} computes GPT-2 with GPT-2's weights (every stage within {atol:.0e} of "
             f"HF's), but its own loading left {len(wrong)} weight tensor{'s' * (len(wrong) != 1)} wrong (the note "
             f"above): as loaded, it is not GPT-2")]
        failed = next((x for x in late if x[0] is not None and x[0].status == "FAIL"), None)
        if tokens_row.status == "FAIL":
            verdict = f"FAIL (greedy tokens): {tokens_row.note}, though every stage is within tolerance"
        elif failed:
            _, stage, at, what, verdict = failed
            return ModelReport(name, info, rows, verdict, None, {"layer": None, "stage": stage, "checkpoint": at,
                                                                 "what": what})
        else:
            verdict = (f"PASS: {name} computes GPT-2 ({cfg.n_layer} blocks, every stage within {atol:.0e} of HF's, "
                       f"same greedy tokens and logits past the prompt" + (" and in a batch)" if batch_row.status ==
                                                                           "PASS" else "; one sequence at a time)"))
            blind = blind_spots(ref)
            if blind:
                info.append(f"note: these weights cannot show {'; nor '.join(blind)}: judge against random:<preset> "
                            f"too (--preset), whose biases and LayerNorms are not")
                verdict += f"; but these weights cannot show {len(blind)} kind{'s' * (len(blind) > 1)} of mistake " \
                           f"(the note above)"
        return ModelReport(name, info, rows, verdict)
    stage, L, mine, differ = first
    diagnosis = diagnose(ref, stage, L, mine, max(atol, judged[stage][-1][5]), differ, got)
    if stage == "embeddings" and s.wpe is None:  # RoPE or sinusoids: what it lacks, whatever it adds instead
        lacks, fix = MODEL_MISTAKES["no_wpe"]
        diagnosis = Diagnosis("embeddings", "no_wpe", f"{lacks}: {fix}")
    where = f"block {L}, {LABELS[stage]}" if L is not None else LABELS[stage]
    verdict = f"FAIL (first divergence: {where}, checkpoint {CHECKPOINT[stage]}): {diagnosis.text}"
    return ModelReport(name, info, rows, verdict, diagnosis, {"layer": L, "stage": stage,
                                                              "checkpoint": CHECKPOINT[stage],
                                                              "what": CHECKPOINTS.get(CHECKPOINT[stage],
                                                                                      LABELS[stage])})


def teacher_forced(model: nn.Module, s: Structure, ref: Reference, atol: float, batch: bool = False) -> tuple:
    """(shape, max_abs, tol, status, note) of the model's logits over the prompt and HF's greedy tokens, one
    forward, against HF's (every position it returns: nanoGPT's the last). The stages see only the prompt, and a
    token's argmax can hold through a wrong logit: a mask that lets rows past the prompt's length see later ones
    changed nanoGPT's logits on the 2-block reference by 0.24 at position 9 of 10, the greedy tokens unchanged.
    batch: the same sequence beside another one, as a batch of 2 (ref.batch): the stages see one sequence, and a
    head merge that permutes the batch axis, attention or a LayerNorm over it, are right for one alone."""
    rows, want = (ref.batch, ref.batched) if batch else ([ref.ids + ref.tokens], ref.forced)
    what = "a batch of 2 sequences" if batch else "the prompt and HF's greedy tokens"
    one = "a model of one sequence at a time: judged on one only"
    try:
        with torch.no_grad():
            got = _logits(model(torch.tensor(rows)), s, ref.cfg, rows=len(rows))[0]
    except CheckError:
        raise
    except Exception as e:
        if batch:  # one sequence at a time (an assert on B, a cache of one row): not GPT-2's fault, nor a mistake
            return (), float("nan"), None, "--", f"{one} (it failed on a batch of 2: {type(e).__name__}: " \
                                                 f"{e}".splitlines()[0] + ")"
        raise CheckError(f"the model failed on {what}, token ids of shape {tuple(want.shape[:2])}: "
                         f"{type(e).__name__}: {e}".splitlines()[0]) from None
    if batch and isinstance(got, torch.Tensor) and got.dim() == 3 and got.shape[0] == 1:
        return tuple(got.shape), float("nan"), None, "--", f"{one} (it returned 1 sequence's logits for 2)"
    if got is None or got.dim() != 3 or got.shape[0] != want.shape[0] or got.shape[-1] != want.shape[-1] \
            or not 0 < got.shape[1] <= want.shape[1]:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else ()
        return shape, float("nan"), None, "FAIL", f"logits of shape {shape}, expected {want.shape}"
    got = got.detach().float().numpy()
    want = want[:, -got.shape[1]:]
    tol = max(atol, GOLDEN_SCALED["logits"] * float(np.abs(want).max()))
    first = ref.forced.shape[1] - got.shape[1]  # the position of got's first row
    where = ("sequence {b}: " if batch else "") + "position {pos}"
    prompt = f"positions 0-{len(ref.ids) - 1} are the prompt"
    if not np.isfinite(got).all():
        b, pos = np.argwhere(~np.isfinite(got).all(-1))[0]
        return got.shape, float("nan"), tol, "FAIL", f"NaN/Inf at {where.format(b=b, pos=pos + first)} ({prompt})"
    err = np.abs(got - want)
    worst = float(err.max())
    if worst <= tol:
        return got.shape, worst, tol, "PASS", ""
    b, pos = np.unravel_index(int(err.max(-1).argmax()), err.shape[:2])
    return got.shape, worst, tol, "FAIL", (f"{where.format(b=b, pos=pos + first)} differs by {worst:.3g} (tolerance "
                                           f"{tol:.1e}" + ("" if batch else f"; {prompt}") + ")")


def _load_all(s: Structure, model: nn.Module, ref: Reference, cfg: Config) -> tuple:
    """Load every weight; refuse a model with parameters GPT-2 has no tensor for."""
    before = {id(p) for p in model.parameters()}
    n, notes, left, wrong = load_weights(s, model, ref.model, cfg)
    if left:
        raise CheckError(f"{len(left)} of {len(before)} parameters have no GPT-2 tensor: {', '.join(left[:6])}")
    return n, notes, wrong


# ---- a whole GPT-2 written as a function of its weights (picoGPT) -----------------------------------------

def is_model_function(names: list) -> bool:
    """picoGPT's gpt2(inputs, wte, wpe, blocks, ln_f, n_head): the parameters after the token ids."""
    return {"wte", "wpe", "blocks", "ln_f"} <= set(names)


def pico_params(model: nn.Module) -> dict:
    """An HF GPT2LMHeadModel's weights as picoGPT's loader nests them: linear layers {"w": [in, out], "b"},
    layer norms {"g", "b"}, per block attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj, ln_1, ln_2 (numpy)."""
    t = model.transformer

    def a(p):
        return p.detach().float().numpy()

    def lin(m):
        return {"w": a(m.weight), "b": a(m.bias)}

    def norm(m):
        return {"g": a(m.weight), "b": a(m.bias)}
    blocks = [{"attn": {"c_attn": lin(h.attn.c_attn), "c_proj": lin(h.attn.c_proj)},
               "mlp": {"c_fc": lin(h.mlp.c_fc), "c_proj": lin(h.mlp.c_proj)}, "ln_1": norm(h.ln_1),
               "ln_2": norm(h.ln_2)} for h in t.h]
    return {"wte": a(t.wte.weight), "wpe": a(t.wpe.weight), "blocks": blocks, "ln_f": norm(t.ln_f)}


def block_function_mistake(fn, source: str, layer: int, atol: float = GOLDEN_ATOL) -> str | None:
    """picoGPT's transformer_block(x, mlp, attn, ln_1, ln_2, n_head) run alone on HF's input to block `layer`
    with that block's weights: None when it fails to run or matches HF's block output; else what it gets
    wrong, a known mistake of the block (block_forward) when one matches, or how far off it is."""
    ref = reference(source)
    cfg, t = ref.cfg, ref.stages
    x = t["embeddings"] if layer == 0 else t[f"h{layer - 1}_block"]
    try:
        got = np.asarray(fn(x[0].copy(), **pico_params(ref.model)["blocks"][layer], n_head=cfg.n_head),
                         dtype=np.float32)[None]
    except Exception:
        return None
    want = t[f"h{layer}_block"]
    if got.shape != want.shape or np.abs(got - want).max() <= atol:
        return None
    hf = ref.model.transformer.h[layer]
    w = {k: v.detach().double() for k, v in hf.state_dict().items() if k not in ("attn.bias", "attn.masked_bias")}
    hits = sorted((float(np.abs(got - block_forward(_float64(x), w, cfg, k, layer)["block"].numpy()).max()), k)
                  for k in MISTAKES)
    if hits and hits[0][0] <= atol:
        name, fix = MISTAKES[hits[0][1]]
        return f"{name} (within {hits[0][0]:.1e} of it): {fix}"
    return f"it is {float(np.abs(got - want).max()):.3g} off HF's block output, matching no known mistake"


def check_model_function(fn, name: str, names: list, source: str = DEFAULT_MODEL,
                         atol: float = GOLDEN_ATOL) -> ModelReport:
    """A whole GPT-2 as picoGPT writes it, gpt2(inputs, wte, wpe, blocks, ln_f, n_head) -> logits (T, vocab):
    given the reference's weights, its logits are judged; where they diverge it runs again on the first k blocks
    only (what picoGPT's own loop allows), against ln_f of HF's residual stream after k blocks times wte^T, so
    the first block that diverges is named. Its inner stages are not seen."""
    ref = reference(source)
    cfg, L = ref.cfg, ref.cfg.n_layer
    params = pico_params(ref.model)
    unknown = [n for n in names if n not in params and n != "n_head"]
    if unknown:
        raise CheckError(f"{name}({', '.join(['inputs', *names])}): check gives picoGPT's wte, wpe, blocks, ln_f "
                         f"and n_head; it has no {', '.join(unknown)}")
    extra = {"n_head": cfg.n_head} if "n_head" in names else {}

    def run(k):
        try:
            out = fn(list(ref.ids), **{**params, "blocks": params["blocks"][:k]}, **extra)
            return np.asarray(out.detach() if isinstance(out, torch.Tensor) else out, dtype=np.float32)
        except Exception as e:
            raise CheckError(f"{name} failed on token ids {ref.ids} with {k} of {L} blocks: "
                             f"{type(e).__name__}: {e}".splitlines()[0]) from None

    tr = ref.model.transformer
    with torch.no_grad():
        def expected(k):  # the logits of the first k blocks: ln_f(residual after them) @ wte^T, by HF's modules
            if k == L:
                return ref.stages["logits"]
            h = ref.stages["embeddings"] if k == 0 else ref.stages[f"h{k - 1}_block"]
            return (tr.ln_f(torch.from_numpy(h)) @ tr.wte.weight.T).float().numpy()

        def judge(k, got):
            want = expected(k)
            tol = max(atol, GOLDEN_SCALED["logits"] * float(np.abs(want).max()))
            r = compare(f"logits after {k} blocks", {"checkpoint": "09", "layer": None}, got, want, tol)
            label = f"logits after {k} of {L} blocks" + (" (whole model)" if k == L else "")
            return Row("09", label, str(k), r.shape, r.max_abs, tol, r.status, r.note)
        whole = run(L)
        rows = [judge(L, whole)]
        first = None
        if rows[0].status == "FAIL":
            for k in range(L):
                rows.insert(k, judge(k, run(k)))
                if rows[k].status == "FAIL":
                    first = k
                    break
    info = [f"a function: {name}({', '.join(['inputs', *names])}), given picoGPT's nested weights (linear "
            f"{{'w': [in, out], 'b'}}, layer norm {{'g', 'b'}}) of {ref.source} ({L} blocks, n_embd {cfg.n_embd})",
            f"fed token ids {ref.ids}; its logits compared with HF GPT-2's, tolerance {atol:.0e} "
            f"({GOLDEN_SCALED['logits']:.0e} x max |logits| when larger); where they differ, run on its first k blocks"]
    if rows[-1].status == "PASS":
        if not np.array_equal(whole, run(L), equal_nan=True):
            return ModelReport(name, info, rows, f"FAIL: {name} passes once but two runs differ: something random "
                                                  "is on at inference")
        return ModelReport(name, info, rows, f"PASS: {name} computes GPT-2 ({L} blocks, logits within tolerance of "
                                             "HF's)")
    if first is None:
        where = "the whole model diverges though each shorter run agrees: ln_f or the logits after the last block"
        block = None
    elif first == 0:
        where, block = ("before any block: the embeddings (wte[ids] + wpe[positions]), ln_f or the logits "
                        "(x @ wte.T)"), None
    else:
        before = "the embeddings agree" if first == 1 else f"the {first - 1} blocks before it agree"
        where, block = f"block {first - 1} ({before})", first - 1
    return ModelReport(name, info, rows, f"FAIL (first divergence: {where})", None,
                       {"layer": block, "stage": "block" if block is not None else "model", "checkpoint": "09",
                        "what": where})
