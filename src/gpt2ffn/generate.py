"""Text generation: greedy or sampled (temperature, top-k, top-p, penalties), seeded, batched.

Many prompts run through the serving engine's continuous batching (serving/engine.py): each row has its
own positions and its own blocks of the paged KV cache, so each gets the tokens it would get alone.
"""

import operator
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from .errors import Gpt2ffnError
from .loading import load  # noqa: F401  (the public names of generation)
from .model import GPT2
from .serving.engine import Engine, Request
from .serving.sampling import Sampling, pick  # noqa: F401  (as above)
from .serving.text import TextStream, cut_at_stop  # noqa: F401  (as above)
from .serving.tp import make_engine


def token_lists(prompts) -> list:
    """The prompts as lists of int token ids: a list (or tuple) of id sequences (lists, tuples, ranges, 1-D integer
    tensors or arrays; ids as ints, numpy ints or 0-d integer tensors), or a 2-D integer tensor or array (HF's
    input_ids). A flat list of ids (one prompt not wrapped in a list), text or a float id is refused by name."""
    def integer(a) -> bool:
        if isinstance(a, torch.Tensor):
            return not (a.is_floating_point() or a.is_complex() or a.dtype == torch.bool)
        return np.issubdtype(a.dtype, np.integer)

    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        if prompts.ndim != 2 or not integer(prompts):
            raise Gpt2ffnError(f"prompts as a tensor must be 2-D integer ids (batch, tokens), as HF's input_ids; "
                               f"got {prompts.dtype} of shape {tuple(prompts.shape)}")
        return prompts.tolist()
    if not isinstance(prompts, (list, tuple)):
        raise Gpt2ffnError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}"
                           + (" (text: encode it with the tokenizer first)" if isinstance(prompts, str) else ""))
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (torch.Tensor, np.ndarray)):
            if p.ndim != 1 or not integer(p):
                raise Gpt2ffnError(f"prompts[{i}] must be 1-D integer ids; got {p.dtype} of shape {tuple(p.shape)}")
            p = p.tolist()
        if isinstance(p, (str, bytes)) or not isinstance(p, (list, tuple, range)):
            hint = ": one prompt is [ids], a list of one list" if isinstance(p, (int, np.integer)) else ""
            raise Gpt2ffnError(f"prompts must be a list of token-id lists; prompts[{i}] is {repr(p)[:40]} "
                               f"({type(p).__name__}){hint}")
        ids = []
        for t in p:
            try:
                if isinstance(t, (bool, np.bool_)) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool):
                    raise TypeError
                ids.append(operator.index(t))
            except TypeError:
                raise Gpt2ffnError(f"token ids must be ints; prompts[{i}] holds {repr(t)[:40]} "
                                   f"({type(t).__name__})") from None
        out.append(ids)
    return out


def loaded(model) -> None:
    """A loaded GPT-2, or an error naming what was given instead (a checkpoint's path: load it first)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        what = f"{type(model).__name__} {str(model)[:60]!r}" if isinstance(model, (str, Path)) else type(model).__name__
        raise Gpt2ffnError(f"generate takes a loaded GPT-2, not a {what}: model, tok, name = "
                           f"gpt2ffn.generate.load(path) (or GPT2.from_pretrained(path)), then generate(model, ...)")


def engine_for(model: GPT2, prompts: list, s: Sampling, decode=None, batch_invariant: bool = False) -> Engine:
    """The engine that runs these prompts: slots sized to them; a TPEngine on every rank of a tensor-parallel
    model (ranks > 0 call its follow() while rank 0 streams)."""
    loaded(model)
    if not prompts:
        raise Gpt2ffnError("generate was given no prompts: give a list of token-id lists, [[ids]] for one prompt")
    if s.stop and decode is None:  # without the text no stop string can match: say so, not run to max_new_tokens
        raise Gpt2ffnError(f"Sampling.stop ({s.stop!r}) needs the text: pass decode= (the tokenizer's decode, e.g. "
                           "tok.decode from model, tok, name = gpt2ffn.generate.load(path)), or stop on ids with "
                           "stop_token_ids")
    if s.logprobs is not None or s.prompt_logprobs:
        raise Gpt2ffnError("generate() and stream() give token ids only, not log-probs: Sampling.logprobs and "
                           "prompt_logprobs are the serving engine's and the server's (logprobs, echo); a prompt's "
                           "log-probs are model(ids).logits.log_softmax(-1)")
    longest = max(len(p) for p in prompts) + s.max_new_tokens
    max_len = min(longest, model.config.n_positions) if longest > 0 else 1
    return make_engine(model, decode, max_batch=len(prompts), max_waiting=len(prompts), max_len=max_len,
                       kv_tokens=len(prompts) * (max_len + 16), batch_invariant=batch_invariant,
                       offline=True,  # every prompt added up front: on CUDA prefilled in as few steps as fit
                       graph_seconds=0)  # one call: CUDA graphs of the shapes it meets, captured on first use


def stream(model: GPT2, prompts: list, s: Sampling, decode=None, batch_invariant: bool = False):
    """Yield the new token id per prompt (None: none this time), one token per prompt at most each time: after
    each engine step that made tokens, or several times for a step that made several per prompt (a burst of
    greedy GPU steps, serving/static.StaticDecoder.steps).

    The prompts run through the serving engine (continuous batching), the one batching path of gpt2ffn;
    each gets the tokens it would get alone. A seeded Sampling gives prompt i the seed s.seed + i (as the
    server's n choices take theirs), so a repeated prompt draws different samples, each the one it draws alone
    with that seed. With decode, stop strings end a sequence. prompts: a list of token-id lists (token_lists)."""
    return _stream(model, token_lists(prompts), s, decode, batch_invariant)


@torch.no_grad()
def _stream(model: GPT2, prompts: list, s: Sampling, decode, batch_invariant: bool):
    """stream() of prompts already lists of ints."""
    engine = engine_for(model, prompts, s, decode, batch_invariant)
    requests = [Request(list(p), s if s.seed is None or not i else replace(s, seed=s.seed + i))
                for i, p in enumerate(prompts)]
    row = {r.id: i for i, r in enumerate(requests)}
    try:  # a request refused (too long, empty) still releases a TPEngine's other ranks: close() below
        engine.add(*requests)
        while engine.has_work():
            out = [None] * len(prompts)
            for ev in engine.step():
                if ev.id >= 0:
                    i = row[ev.request.id]
                    if out[i] is not None:  # the step's next token for this prompt: the ones so far first
                        yield out
                        out = [None] * len(prompts)
                    out[i] = ev.id
            if any(t is not None for t in out):
                yield out
    finally:  # also when the caller stops early: a TPEngine releases the other ranks
        engine.close()


def generate(model: GPT2, prompts: list, s: Sampling | None = None, decode=None, batch_invariant: bool = False,
             **sampling) -> list:
    """The new token ids of each prompt, up to EOS, the token completing a stop string, or max_new_tokens.
    s: a Sampling; or its fields as keywords, as HF's generate takes them (generate(model, [[1, 2]],
    max_new_tokens=8, temperature=0.7)), with EOS the model config's unless eos_token_id is given; keywords with
    an s replace its fields."""
    loaded(model)
    if s is None or sampling:
        fields = set(Sampling.__dataclass_fields__)
        unknown = sorted(set(sampling) - fields)
        if unknown:
            raise Gpt2ffnError(f"generate() takes Sampling's fields as keywords ({', '.join(sorted(fields))}); "
                               f"not {', '.join(unknown)}")
        if s is None:
            s = Sampling(**{"eos_token_id": model.config.eos_token_id, **sampling})
        else:
            s = replace(s, **sampling)
    prompts = token_lists(prompts)
    out = [[] for _ in prompts]
    for step in _stream(model, prompts, s, decode, batch_invariant):
        for b, t in enumerate(step):
            if t is not None:
                out[b].append(t)
    return out
