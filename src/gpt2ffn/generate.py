"""Text generation with the KV cache: greedy or sampled (temperature, top-k, top-p), seeded, batched.

A batch of prompts of different lengths is left-padded; the attention mask hides the padding and positions
count real tokens only, so each sequence gets the same tokens as when run alone.
"""

from dataclasses import dataclass, field

import torch

from .errors import Gpt2ffnError
from .model import GPT2, KVCache


@dataclass
class Sampling:
    """How to pick the next token. temperature 0 means greedy."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos_token_id: int | None = None
    stop: list = field(default_factory=list)  # stop strings (need a decode function)

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise Gpt2ffnError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not 0 <= self.temperature <= 100:
            raise Gpt2ffnError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if self.top_k is not None and self.top_k < 1:
            raise Gpt2ffnError(f"top_k must be >= 1, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise Gpt2ffnError(f"top_p must be in (0, 1], got {self.top_p!r}")


def pick(logits, s: Sampling, generator):
    """(B, V) logits -> (B,) next ids."""
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / s.temperature
    if s.top_k is not None:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p is not None and s.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= s.top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def stream(model: GPT2, prompts: list, s: Sampling, decode=None):
    """Yield, after each step, the list of new token ids per prompt (None where a sequence has finished)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise Gpt2ffnError("every prompt needs at least one token")
    cfg = model.config
    longest = max(len(p) for p in prompts)
    if longest + s.max_new_tokens > cfg.n_positions:
        raise Gpt2ffnError(f"prompt ({longest} tokens) + max_new_tokens ({s.max_new_tokens}) exceeds the context "
                           f"of {cfg.n_positions} positions")
    device = model.transformer.wte.weight.device
    pad = s.eos_token_id if s.eos_token_id is not None else 0
    B = len(prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    padded = bool((mask == 0).any())
    cache = KVCache(cfg, B, dtype=model.transformer.wte.weight.dtype, device=device,
                    max_len=longest + s.max_new_tokens)
    generator = torch.Generator(device=device)
    if s.seed is not None:
        generator.manual_seed(s.seed)
    else:
        generator.seed()
    done = [False] * B
    texts = [[] for _ in range(B)]
    logits = model(ids, cache, mask if padded else None, last_only=True)[:, -1]
    for _ in range(s.max_new_tokens):
        nxt = pick(logits, s, generator)
        out = []
        for b in range(B):
            if done[b]:
                out.append(None)
                continue
            t = int(nxt[b])
            texts[b].append(t)
            out.append(t)
            if t == s.eos_token_id:
                done[b] = True
            elif s.stop and decode is not None and any(stop in decode(texts[b]) for stop in s.stop):
                done[b] = True
        yield out
        if all(done):
            return
        nxt = torch.where(torch.tensor(done, device=device), torch.full_like(nxt, pad), nxt)
        if padded:
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=device)], dim=1)
        logits = model(nxt[:, None], cache, mask if padded else None, last_only=True)[:, -1]


def generate(model: GPT2, prompts: list, s: Sampling, decode=None) -> list:
    """The new token ids of each prompt, up to EOS, the token completing a stop string, or max_new_tokens."""
    out = [[] for _ in prompts]
    for step in stream(model, prompts, s, decode):
        for b, t in enumerate(step):
            if t is not None:
                out[b].append(t)
    return out


def cut_at_stop(text: str, stop: list) -> tuple:
    """(text before the first stop string, whether one was found), as OpenAI's API returns it."""
    hits = [i for i in (text.find(st) for st in stop) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


class TextStream:
    """Turns generated tokens into text deltas that never show part of a stop string or half a character."""

    def __init__(self, decode, stop):
        self.decode, self.stop, self.tokens, self.sent = decode, stop, [], ""
        self.hold = max((len(s) for s in stop), default=1) - 1

    def push(self, token) -> tuple:
        """(new text safe to send, whether a stop string was hit)."""
        self.tokens.append(token)
        text, stopped = cut_at_stop(self.decode(self.tokens), self.stop)
        safe = text if stopped else text[:len(text) - self.hold] if self.hold else text
        safe = safe.rstrip("\ufffd") if not stopped else safe
        delta, self.sent = safe[len(self.sent):], max(self.sent, safe, key=len)
        return delta, stopped

    def finish(self) -> str:
        text, _ = cut_at_stop(self.decode(self.tokens), self.stop)
        delta, self.sent = text[len(self.sent):], text
        return delta


def hf_cache_gpt2():
    """openai-community/gpt2 in the local HF cache (no download), or None."""
    import os
    from pathlib import Path
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface")), "hub")
    for repo in ("models--openai-community--gpt2", "models--gpt2"):
        snaps = sorted(Path(hub, repo, "snapshots").glob("*/config.json"))
        if snaps:
            return snaps[-1].parent
    return None


def load(spec=None, dtype=torch.float32, precision: str | None = "fp32"):
    """(GPT2, tokenizer, name) for a checkpoint directory, `random:<preset>[:seed]`, or None: the HF cache.

    precision: the linear layers' weights, 'fp32' (default), 'bf16', 'int8' or 'int4' (gpt2ffn.quantize);
    it applies to float32 models (with dtype=bfloat16 everything runs in bf16 instead)."""
    from .precision import check_precision
    if precision is not None:
        check_precision(precision)
        if dtype != torch.float32:
            if precision != "fp32":
                raise Gpt2ffnError(f"precision={precision!r} quantizes a float32 model's weights; it does not "
                                   f"combine with dtype={dtype}")
            precision = None
    from .model import load_model, parse_random
    from .tokenizer import ByteTokenizer, load_tokenizer
    if spec is None:
        found = hf_cache_gpt2()
        if found is None:
            raise Gpt2ffnError("no local openai-community/gpt2 in the HF cache; get it where there is network with "
                               "`huggingface-cli download openai-community/gpt2`, then pass --model DIR "
                               "(or try --model random:gpt2)")
        spec = str(found)
    model = load_model(spec, dtype, precision)
    if spec.startswith("random:"):
        return model, ByteTokenizer(), parse_random(spec)[2]
    from pathlib import Path
    return model, load_tokenizer(spec), Path(spec).name
