"""Per-request sampling parameters (vLLM's SamplingParams) and the sampler that applies them row by row."""

from dataclasses import dataclass, field

import torch

from ..errors import Gpt2ffnError


@dataclass
class Sampling:
    """How one request picks its tokens. temperature 0 means greedy. Penalties as vLLM applies them:
    presence/frequency over the generated tokens, repetition over prompt and generated tokens."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos_token_id: int | None = None
    stop: list = field(default_factory=list)    # stop strings (need a decode function)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0                         # EOS and stop strings are held off until this many tokens
    ignore_eos: bool = False                    # EOS is a token like any other
    logprobs: int | None = None                 # report the chosen token's log-prob and this many top ones
    prompt_logprobs: bool = False               # also the log-prob of every prompt token (OpenAI's echo)

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise Gpt2ffnError(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        if not 0 <= self.temperature <= 100:
            raise Gpt2ffnError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if self.top_k is not None and self.top_k < 1:
            raise Gpt2ffnError(f"top_k must be >= 1, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise Gpt2ffnError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.repetition_penalty <= 0:
            raise Gpt2ffnError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.min_tokens < 0:
            raise Gpt2ffnError(f"min_tokens must be >= 0, got {self.min_tokens!r}")

    @property
    def plain_greedy(self) -> bool:
        """argmax of the raw logits: rows like this are picked together, in one call."""
        return (self.temperature == 0 and not self.logit_bias and self.presence_penalty == 0 and
                self.frequency_penalty == 0 and self.repetition_penalty == 1 and self.min_tokens == 0)


def pick(logits, s: Sampling, generator):
    """(B, V) logits -> (B,) next ids, after temperature, top-k and top-p."""
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


def adjust(logits, s: Sampling, prompt: list, output: list):
    """One row's (V,) logits after logit_bias, penalties and min_tokens."""
    logits = logits.float().clone()
    if s.repetition_penalty != 1 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)))
        v = logits[seen]
        logits[seen] = torch.where(v > 0, v / s.repetition_penalty, v * s.repetition_penalty)
    if output and (s.presence_penalty or s.frequency_penalty):
        ids, counts = torch.tensor(output).unique(return_counts=True)
        logits[ids] -= s.frequency_penalty * counts.float() + s.presence_penalty
    for t, bias in s.logit_bias.items():
        logits[int(t)] += bias
    if len(output) < s.min_tokens and s.eos_token_id is not None:
        logits[s.eos_token_id] = float("-inf")
    return logits


def next_tokens(logits, requests) -> list:
    """(B, V) logits, one row per request -> its next token id; each row under its own Sampling and generator."""
    out = [None] * len(requests)
    plain = [i for i, r in enumerate(requests) if r.params.plain_greedy]
    if plain:
        for i, t in zip(plain, logits[plain].argmax(-1).tolist()):
            out[i] = t
    for i, r in enumerate(requests):
        if out[i] is None:
            row = adjust(logits[i], r.params, r.prompt, r.output)
            out[i] = int(pick(row[None], r.params, r.generator)[0])
    return out


def logprobs_of(logits, tokens, top: int):
    """(N, V) logits, (N,) chosen ids -> (chosen log-probs, [(top ids, top log-probs)] per row) of the raw
    distribution (before temperature and penalties), as OpenAI and vLLM report them."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.as_tensor(tokens)[:, None])[:, 0].tolist()
    if not top:
        return chosen, [([], []) for _ in chosen]
    vals, ids = lp.topk(top, dim=-1)
    return chosen, list(zip(ids.tolist(), vals.tolist()))
