"""Text generation: greedy or sampled (temperature, top-k, top-p, penalties), seeded, batched.

Many prompts run through the serving engine's continuous batching (serving/engine.py): each row has its
own positions and its own blocks of the paged KV cache, so each gets the tokens it would get alone.
"""

import torch

from .errors import Gpt2ffnError
from .model import GPT2
from .serving.engine import Engine, Request
from .serving.sampling import Sampling, pick  # noqa: F401  (the public names of generation)


@torch.no_grad()
def stream(model: GPT2, prompts: list, s: Sampling, decode=None, batch_invariant: bool = False):
    """Yield, after each engine step that made tokens, the new token id per prompt (None: none this step).

    The prompts run through the serving engine (continuous batching), the one batching path of gpt2ffn;
    each gets the tokens it would get alone. With decode, stop strings end a sequence."""
    if not prompts:
        raise Gpt2ffnError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts) + s.max_new_tokens
    max_len = min(longest, model.config.n_positions) if longest > 0 else 1
    engine = Engine(model, decode, max_batch=len(prompts), max_waiting=len(prompts), max_len=max_len,
                    kv_tokens=len(prompts) * (max_len + 16), batch_invariant=batch_invariant)
    requests = [Request(list(p), s) for p in prompts]
    row = {r.id: i for i, r in enumerate(requests)}
    engine.add(*requests)
    while engine.has_work():
        out = [None] * len(prompts)
        for ev in engine.step():
            if ev.id >= 0:
                out[row[ev.request.id]] = ev.id
        if any(t is not None for t in out):
            yield out


def generate(model: GPT2, prompts: list, s: Sampling, decode=None, batch_invariant: bool = False) -> list:
    """The new token ids of each prompt, up to EOS, the token completing a stop string, or max_new_tokens."""
    out = [[] for _ in prompts]
    for step in stream(model, prompts, s, decode, batch_invariant):
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
