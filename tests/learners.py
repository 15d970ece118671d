"""Learners' GPT-2s, written as the public code they copy, for `gpt2ffn check`: nanoGPT's model.py (a @dataclass
GPTConfig, `GPT(config)`), the "GPT from scratch" book's GPTModel (a cfg dict), and HF's GPT2LMHeadModel.
Each is a source text; a test writes it to a file and checks FILE.py:NAME. Mutants plant one mistake each
(`plant`): a text replacement that must occur exactly once in the source."""

# nanoGPT's model.py (Karpathy), trimmed to inference; the attention keeps its explicit (non-flash) path,
# where the probabilities pass through attn_dropout and can be hooked.
NANOGPT = '''
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2 vocab_size of 50257, padded up to nearest multiple of 64 for efficiency
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # True: bias in Linears and LayerNorms, like GPT-2. False: a bit better and faster


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # inference-time mini-optimization: only the last position
            loss = None
        return logits, loss
'''

# The "GPT from scratch" book's chapter 4 model (Raschka, LLMs from scratch), as written there.
BOOK = '''
import torch
import torch.nn as nn

GPT_CONFIG_124M = {
    "vocab_size": 50257,     # Vocabulary size
    "context_length": 1024,  # Context length
    "emb_dim": 768,          # Embedding dimension
    "n_heads": 12,           # Number of attention heads
    "n_layers": 12,          # Number of layers
    "drop_rate": 0.1,        # Dropout rate
    "qkv_bias": False        # Query-Key-Value bias
}


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1]**0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = (attn_weights @ values).transpose(1, 2)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        context_vec = self.out_proj(context_vec)
        return context_vec


class LayerNorm(nn.Module):
    def __init__(self, emb_dim):
        super().__init__()
        self.eps = 1e-5
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        norm_x = (x - mean) / torch.sqrt(var + self.eps)
        return self.scale * norm_x + self.shift


class GELU(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(
            torch.sqrt(torch.tensor(2.0 / torch.pi)) *
            (x + 0.044715 * torch.pow(x, 3))
        ))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg["emb_dim"], 4 * cfg["emb_dim"]),
            GELU(),
            nn.Linear(4 * cfg["emb_dim"], cfg["emb_dim"]),
        )

    def forward(self, x):
        return self.layers(x)


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.att = MultiHeadAttention(
            d_in=cfg["emb_dim"],
            d_out=cfg["emb_dim"],
            context_length=cfg["context_length"],
            num_heads=cfg["n_heads"],
            dropout=cfg["drop_rate"],
            qkv_bias=cfg["qkv_bias"])
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg["emb_dim"])
        self.norm2 = LayerNorm(cfg["emb_dim"])
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])

    def forward(self, x):
        shortcut = x
        x = self.norm1(x)
        x = self.att(x)
        x = self.drop_shortcut(x)
        x = x + shortcut

        shortcut = x
        x = self.norm2(x)
        x = self.ff(x)
        x = self.drop_shortcut(x)
        x = x + shortcut
        return x


class GPTModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])
        self.trf_blocks = nn.Sequential(*[TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = LayerNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

    def forward(self, in_idx):
        batch_size, seq_len = in_idx.shape
        tok_embeds = self.tok_emb(in_idx)
        pos_embeds = self.pos_emb(torch.arange(seq_len, device=in_idx.device))
        x = tok_embeds + pos_embeds
        x = self.drop_emb(x)
        x = self.trf_blocks(x)
        x = self.final_norm(x)
        logits = self.out_head(x)
        return logits
'''

# HF's own model, as a learner who checks the library first would write it (an instance of the tiny preset).
HF = '''
from transformers import GPT2Config, GPT2LMHeadModel

model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=512,
                                   bos_token_id=0, eos_token_id=0))
'''

# One planted mistake each: key -> (source, the text replaced, its replacement). Each key is a diagnosis key.
MUTANTS = {
    "no_scale": (NANOGPT, " * (1.0 / math.sqrt(k.size(-1)))", ""),
    "no_mask": (NANOGPT, "        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))\n", ""),
    "inverted_mask": (NANOGPT, "self.bias[:, :, :T, :T] == 0", "self.bias[:, :, :T, :T].transpose(-1, -2) == 0"),
    "softmax_axis": (NANOGPT, "att = F.softmax(att, dim=-1)", "att = F.softmax(att, dim=-2)"),
    "ln_unbiased": (BOOK, "unbiased=False", "unbiased=True"),
    "ln_eps_1e-06": (BOOK, "self.eps = 1e-5", "self.eps = 1e-6"),
    "post_norm": (NANOGPT, "        x = x + self.attn(self.ln_1(x))\n        x = x + self.mlp(self.ln_2(x))",
                  "        x = self.ln_1(x + self.attn(x))\n        x = self.ln_2(x + self.mlp(x))"),
    "no_resid_attn": (NANOGPT, "x = x + self.attn(self.ln_1(x))", "x = self.attn(self.ln_1(x))"),
    "no_resid_mlp": (BOOK, "        x = self.drop_shortcut(x)\n        x = x + shortcut\n        return x",
                     "        x = self.drop_shortcut(x)\n        return x"),
    "positions_not_added": (BOOK, "x = tok_embeds + pos_embeds", "x = tok_embeds"),
    # The learner's loader copied GPT-2's Conv1D [in, out] weight into nn.Linear without .T: the same as
    # computing x @ W where W is the Linear's [out, in] weight.
    "attn_c_proj_not_transposed": (NANOGPT, "y = self.resid_dropout(self.c_proj(y))",
                                   "y = self.resid_dropout(y @ self.c_proj.weight + self.c_proj.bias)"),
    "dropout": (NANOGPT, "att = self.attn_dropout(att)", "att = F.dropout(att, 0.1)  # training=True by default"),
    "qkv_bias_missing": (BOOK, 'qkv_bias=cfg["qkv_bias"])', "qkv_bias=False)"),
    "gelu_exact": (BOOK, "return self.layers(x)", "return self.layers[2](F.gelu(self.layers[0](x)))"),
    "mask_off_by_one": (NANOGPT, "self.bias[:, :, :T, :T] == 0", "torch.ones(T, T).tril(diagonal=1) == 0"),
    "heads_interleaved": (NANOGPT, "".join(f"        {t} = {t}.view(B, T, self.n_head, C // self.n_head)"
                                           f".transpose(1, 2){'  # (B, nh, T, hs)' if t == 'k' else ''}\n"
                                           for t in "kqv"),
                          "".join(f"        {t} = {t}.view(B, T, C // self.n_head, self.n_head).permute(0, 3, 1, 2)\n"
                                  for t in "kqv")),
    "positions_from_1": (BOOK, "torch.arange(seq_len, device=in_idx.device)",
                         "torch.arange(1, seq_len + 1, device=in_idx.device)"),
    "logits_without_ln_f": (NANOGPT, "        x = self.transformer.ln_f(x)\n", ""),
    "q_k_swapped": (NANOGPT, "q, k, v = self.c_attn(x).split(self.n_embd, dim=2)",
                    "k, q, v = self.c_attn(x).split(self.n_embd, dim=2)"),
    "ln_std_eps_biased": (BOOK, "norm_x = (x - mean) / torch.sqrt(var + self.eps)",
                          "norm_x = (x - mean) / (torch.sqrt(var) + self.eps)"),
    # from an outside round of learners' code (each failed unnamed before)
    "mask_zero_fill": (NANOGPT, "self.bias[:, :, :T, :T] == 0, float('-inf'))", "self.bias[:, :, :T, :T] == 0, 0.0)"),
    "ln_no_sqrt": (BOOK, "norm_x = (x - mean) / torch.sqrt(var + self.eps)", "norm_x = (x - mean) / (var + self.eps)"),
    "resid_normed": (NANOGPT, "x = x + self.attn(self.ln_1(x))", "x = self.ln_1(x) + self.attn(self.ln_1(x))"),
    "qkv_per_head": (NANOGPT, "q, k, v = self.c_attn(x).split(self.n_embd, dim=2)",
                     "q, k, v = (t.reshape(B, T, C) for t in self.c_attn(x).view(B, T, self.n_head, -1)"
                     ".split(C // self.n_head, dim=-1))"),
    "mask_excludes_self": (NANOGPT, "self.bias[:, :, :T, :T] == 0", "torch.ones(T, T).tril(diagonal=-1) == 0"),  # NaN
    "gelu_after_c_proj": (BOOK, "            GELU(),\n            nn.Linear(4 * cfg[\"emb_dim\"], cfg[\"emb_dim\"]),\n",
                          "            nn.Linear(4 * cfg[\"emb_dim\"], cfg[\"emb_dim\"]),\n            GELU(),\n"),
    # from a second outside round (each failed unnamed before)
    "ln_2_for_attn": (NANOGPT, "x = x + self.attn(self.ln_1(x))", "x = x + self.attn(self.ln_2(x))"),
    "scale_d_head": (NANOGPT, " * (1.0 / math.sqrt(k.size(-1)))", " * (1.0 / k.size(-1))"),
    "softmax_heads": (NANOGPT, "att = F.softmax(att, dim=-1)", "att = F.softmax(att, dim=1)"),  # NaN
    "mask_after_softmax_inf": (NANOGPT, "        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))\n"
                               "        att = F.softmax(att, dim=-1)\n",
                               "        att = F.softmax(att, dim=-1)\n"
                               "        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))\n"),
    "heads_reshaped": (NANOGPT, "".join(f"        {t} = {t}.view(B, T, self.n_head, C // self.n_head)"
                                        f".transpose(1, 2){'  # (B, nh, T, hs)' if t == 'k' else ''}\n" for t in "kqv"),
                       "".join(f"        {t} = {t}.reshape(B, self.n_head, T, C // self.n_head)\n" for t in "kqv")),
}


def plant(key: str) -> str:
    source, old, new = MUTANTS[key]
    assert source.count(old) == 1, (key, source.count(old))
    return source.replace(old, new).replace("import torch.nn as nn\n",
                                            "import torch.nn as nn\nimport torch.nn.functional as F\n", 1)



# minGPT (github.com/karpathy/minGPT, MIT license) as its repository lays it out: mingpt/model.py imports
# `from mingpt.utils import CfgNode`; GPT is built from GPT.get_default_config(), its lm_head is not tied to wte
# (from_pretrained copies HF's lm_head.weight into it), and a Block's MLP is an nn.ModuleDict run by a lambda.
# model.py verbatim up to configure_optimizers, then its forward; utils.py's CfgNode, trimmed.
MINGPT_MODEL = '''"""
Full definition of a GPT Language Model, all of it in this single file.

References:
1) the official GPT-2 TensorFlow implementation released by OpenAI:
https://github.com/openai/gpt-2/blob/master/src/model.py
2) huggingface/transformers PyTorch implementation:
https://github.com/huggingface/transformers/blob/main/src/transformers/models/gpt2/modeling_gpt2.py
"""

import math

import torch
import torch.nn as nn
from torch.nn import functional as F

from mingpt.utils import CfgNode as CN

# -----------------------------------------------------------------------------

class NewGELU(nn.Module):
    """
    Implementation of the GELU activation function currently in Google BERT repo (identical to OpenAI GPT).
    Reference: Gaussian Error Linear Units (GELU) paper: https://arxiv.org/abs/1606.08415
    """
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

class CausalSelfAttention(nn.Module):
    """
    A vanilla multi-head masked self-attention layer with a projection at the end.
    It is possible to use torch.nn.MultiheadAttention here but I am including an
    explicit implementation here to show that there is nothing too scary here.
    """

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        # regularization
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        # causal mask to ensure that attention is only applied to the left in the input sequence
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                                     .view(1, 1, config.block_size, config.block_size))
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x):
        B, T, C = x.size() # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k ,v  = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:,:,:T,:T] == 0, float('-inf'))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C) # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y

class Block(nn.Module):
    """ an unassuming Transformer block """

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.ModuleDict(dict(
            c_fc    = nn.Linear(config.n_embd, 4 * config.n_embd),
            c_proj  = nn.Linear(4 * config.n_embd, config.n_embd),
            act     = NewGELU(),
            dropout = nn.Dropout(config.resid_pdrop),
        ))
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x)))) # MLP forward

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlpf(self.ln_2(x))
        return x

class GPT(nn.Module):
    """ GPT Language Model """

    @staticmethod
    def get_default_config():
        C = CN()
        # either model_type or (n_layer, n_head, n_embd) must be given in the config
        C.model_type = 'gpt'
        C.n_layer = None
        C.n_head = None
        C.n_embd =  None
        # these options must be filled in externally
        C.vocab_size = None
        C.block_size = None
        # dropout hyperparameters
        C.embd_pdrop = 0.1
        C.resid_pdrop = 0.1
        C.attn_pdrop = 0.1
        return C

    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.block_size = config.block_size

        type_given = config.model_type is not None
        params_given = all([config.n_layer is not None, config.n_head is not None, config.n_embd is not None])
        assert type_given ^ params_given # exactly one of these (XOR)
        if type_given:
            # translate from model_type to detailed configuration
            config.merge_from_dict({
                # names follow the huggingface naming conventions
                # GPT-1
                'openai-gpt':   dict(n_layer=12, n_head=12, n_embd=768),  # 117M params
                # GPT-2 configs
                'gpt2':         dict(n_layer=12, n_head=12, n_embd=768),  # 124M params
                'gpt2-medium':  dict(n_layer=24, n_head=16, n_embd=1024), # 350M params
                'gpt2-large':   dict(n_layer=36, n_head=20, n_embd=1280), # 774M params
                'gpt2-xl':      dict(n_layer=48, n_head=25, n_embd=1600), # 1558M params
                # Gophers
                'gopher-44m':   dict(n_layer=8, n_head=16, n_embd=512),
                # (there are a number more...)
                # I made these tiny models up
                'gpt-mini':     dict(n_layer=6, n_head=6, n_embd=192),
                'gpt-micro':    dict(n_layer=4, n_head=4, n_embd=128),
                'gpt-nano':     dict(n_layer=3, n_head=3, n_embd=48),
            }[config.model_type])

        self.transformer = nn.ModuleDict(dict(
            wte = nn.Embedding(config.vocab_size, config.n_embd),
            wpe = nn.Embedding(config.block_size, config.n_embd),
            drop = nn.Dropout(config.embd_pdrop),
            h = nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f = nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

        # init all weights, and apply a special scaled init to the residual projections, per GPT-2 paper
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02/math.sqrt(2 * config.n_layer))

        # report number of parameters (note we don't count the decoder parameters in lm_head)
        n_params = sum(p.numel() for p in self.transformer.parameters())
        print("number of parameters: %.2fM" % (n_params/1e6,))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            torch.nn.init.zeros_(module.bias)
            torch.nn.init.ones_(module.weight)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device).unsqueeze(0) # shape (1, t)

        # forward the GPT model itself
        tok_emb = self.transformer.wte(idx) # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos) # position embeddings of shape (1, t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)

        # if we are given some desired targets also calculate the loss
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

        return logits, loss
'''

MINGPT_UTILS = '''class CfgNode:
    """ a lightweight configuration class inspired by yacs """

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)

    def merge_from_dict(self, d):
        self.__dict__.update(d)
'''

MINGPT = {"mingpt/__init__.py": "", "mingpt/utils.py": MINGPT_UTILS, "mingpt/model.py": MINGPT_MODEL}


# A GPT-2 whose attention is torch's nn.MultiheadAttention (batch_first, a boolean mask of the future), as tutorials
# write it: its in_proj_weight [3d, d] is GPT-2's c_attn in [out, in], out_proj its c_proj.
MHA = (
    'import torch\n'
    'import torch.nn as nn\n'
    'import torch.nn.functional as F\n'
    '\n'
    'GPT_CONFIG = {"vocab_size": 50257, "context_length": 1024, "emb_dim": 768, "n_heads": 12, "n_layers": 12}\n'
    '\n'
    'class Block(nn.Module):\n'
    '    def __init__(self, cfg):\n'
    '        super().__init__()\n'
    '        d = cfg["emb_dim"]\n'
    '        self.ln1 = nn.LayerNorm(d)\n'
    '        self.mha = nn.MultiheadAttention(d, cfg["n_heads"], batch_first=True)\n'
    '        self.ln2 = nn.LayerNorm(d)\n'
    '        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))\n'
    '        self.register_buffer("mask", torch.triu(torch.ones(cfg["context_length"], cfg["context_length"], '
    'dtype=torch.bool), diagonal=1), persistent=False)\n'
    '    def forward(self, x):\n'
    '        T = x.size(1)\n'
    '        h = self.ln1(x)\n'
    '        a, _ = self.mha(h, h, h, attn_mask=self.mask[:T, :T], need_weights=False)\n'
    '        x = x + a\n'
    '        x = x + self.mlp(self.ln2(x))\n'
    '        return x\n'
    '\n'
    'class GPTModel(nn.Module):\n'
    '    def __init__(self, cfg):\n'
    '        super().__init__()\n'
    '        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])\n'
    '        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])\n'
    '        self.blocks = nn.Sequential(*[Block(cfg) for _ in range(cfg["n_layers"])])\n'
    '        self.final_norm = nn.LayerNorm(cfg["emb_dim"])\n'
    '        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)\n'
    '    def forward(self, idx):\n'
    '        T = idx.shape[1]\n'
    '        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))\n'
    '        x = self.blocks(x)\n'
    '        return self.out_head(self.final_norm(x))\n'
)

MUTANTS.update({  # nn.MultiheadAttention's masks as tutorials get them wrong (a second outside round)
    "mask_keeps_future": (MHA, 'self.register_buffer("mask", torch.triu(', 'self.register_buffer("mask", ~torch.triu('),
    "mask_float_01": (MHA, 'torch.triu(torch.ones(cfg["context_length"], cfg["context_length"], dtype=torch.bool), '
                           'diagonal=1)', 'torch.tril(torch.ones(cfg["context_length"], cfg["context_length"]))'),
})


# A GPT-2 whose attention holds its weights as its own Parameters in Conv1D's layout (c_attn_w [C, 3C], c_attn_b,
# x @ W + b), beside nn.Linear FFNs and a hand-written LayerNorm (gamma, beta), as a learner reading GPT-2's file
# writes it.
OWN_PARAMS = '''import math
from dataclasses import dataclass
import torch
import torch.nn as nn
import torch.nn.functional as F

@dataclass
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768

class MyLayerNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(d))
        self.beta = nn.Parameter(torch.zeros(d))
    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
        return self.gamma * (x - mean) / torch.sqrt(var + self.eps) + self.beta

class SelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        C = cfg.n_embd
        self.c_attn_w = nn.Parameter(torch.zeros(C, 3 * C)); self.c_attn_b = nn.Parameter(torch.zeros(3 * C))
        self.c_proj_w = nn.Parameter(torch.zeros(C, C)); self.c_proj_b = nn.Parameter(torch.zeros(C))
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (x @ self.c_attn_w + self.c_attn_b).split(C, dim=-1)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return y @ self.c_proj_w + self.c_proj_b

class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = MyLayerNorm(cfg.n_embd)
        self.attn = SelfAttention(cfg)
        self.norm2 = MyLayerNorm(cfg.n_embd)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
        )
    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        x = x + self.ffn(self.norm2(x))
        return x

class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.norm = MyLayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tie by hand
    def forward(self, idx, targets=None):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss
'''


# Karpathy's "Let's build GPT" lecture (github.com/karpathy/ng-video-lecture, MIT license), its gpt.py's model in
# its own words, at GPT-2's choices (biases on q, k, v; the tanh GELU where the lecture has ReLU; a head without a
# bias): one Head module per head, each with key, query and value layers of head_size, in a ModuleList.
KARPATHY = '''
import torch
import torch.nn as nn
from torch.nn import functional as F

block_size, n_embd, n_head, n_layer, dropout, vocab_size = 128, 64, 4, 2, 0.0, 512


class Head(nn.Module):
    """ one head of self-attention """

    def __init__(self, head_size):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=True)
        self.query = nn.Linear(n_embd, head_size, bias=True)
        self.value = nn.Linear(n_embd, head_size, bias=True)
        self.register_buffer('tril', torch.tril(torch.ones(block_size, block_size)))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        B,T,C = x.shape
        k = self.key(x)   # (B,T,hs)
        q = self.query(x) # (B,T,hs)
        wei = q @ k.transpose(-2,-1) * k.shape[-1]**-0.5 # (B, T, hs) @ (B, hs, T) -> (B, T, T)
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float('-inf')) # (B, T, T)
        wei = F.softmax(wei, dim=-1) # (B, T, T)
        wei = self.dropout(wei)
        v = self.value(x) # (B,T,hs)
        out = wei @ v # (B, T, T) @ (B, T, hs) -> (B, T, hs)
        return out


class MultiHeadAttention(nn.Module):
    """ multiple heads of self-attention in parallel """

    def __init__(self, num_heads, head_size):
        super().__init__()
        self.heads = nn.ModuleList([Head(head_size) for _ in range(num_heads)])
        self.proj = nn.Linear(head_size * num_heads, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        out = torch.cat([h(x) for h in self.heads], dim=-1)
        out = self.dropout(self.proj(out))
        return out


class FeedFoward(nn.Module):
    """ a simple linear layer followed by a non-linearity """

    def __init__(self, n_embd):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(approximate='tanh'),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    """ Transformer block: communication followed by computation """

    def __init__(self, n_embd, n_head):
        super().__init__()
        head_size = n_embd // n_head
        self.sa = MultiHeadAttention(n_head, head_size)
        self.ffwd = FeedFoward(n_embd)
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)

    def forward(self, x):
        x = x + self.sa(self.ln1(x))
        x = x + self.ffwd(self.ln2(x))
        return x


class GPTLanguageModel(nn.Module):

    def __init__(self):
        super().__init__()
        self.token_embedding_table = nn.Embedding(vocab_size, n_embd)
        self.position_embedding_table = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head=n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd) # final layer norm
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        tok_emb = self.token_embedding_table(idx) # (B,T,C)
        pos_emb = self.position_embedding_table(torch.arange(T, device=idx.device)) # (T,C)
        x = tok_emb + pos_emb # (B,T,C)
        x = self.blocks(x) # (B,T,C)
        x = self.ln_f(x) # (B,T,C)
        logits = self.lm_head(x) # (B,T,vocab_size)
        if targets is None:
            loss = None
        else:
            B, T, C = logits.shape
            loss = F.cross_entropy(logits.view(B*T, C), targets.view(B*T))
        return logits, loss
'''
