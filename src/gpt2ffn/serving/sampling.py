"""Per-request sampling parameters (vLLM's SamplingParams), the sampler of a whole batch (next_tokens), and
the plain one-row reference it is checked against (adjust, pick)."""

from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import Gpt2ffnError
from ..kernels.packed import top_p_


@dataclass
class Sampling:
    """How one request picks its tokens. temperature 0 means greedy. Penalties as vLLM applies them:
    presence/frequency over the generated tokens, repetition over prompt and generated tokens."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos_token_id: int | list | None = None     # one id or several (HF's list): any of them ends the sequence
    stop: list = field(default_factory=list)    # stop strings (need a decode function)
    stop_token_ids: list = field(default_factory=list)  # ids that stop as a stop string does (kept in the output)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0                         # EOS and stops are held off until this many tokens
    ignore_eos: bool = False                    # EOS is a token like any other
    logprobs: int | None = None                 # report the chosen token's log-prob and this many top ones
    prompt_logprobs: bool = False               # also the log-prob of every prompt token (OpenAI's echo)

    def __post_init__(self):
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.eos_ids):
            raise Gpt2ffnError(f"eos_token_id must be a token id or a list of them, got {self.eos_token_id!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise Gpt2ffnError(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        if not 0 <= self.temperature <= 100:
            raise Gpt2ffnError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if self.top_k in (0, -1):  # off, as HF's top_k=0, vLLM's -1 and the CLI's --top-k 0 say
            self.top_k = None
        if self.top_k is not None and self.top_k < 1:
            raise Gpt2ffnError(f"top_k must be >= 1 (0 or -1: off), got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise Gpt2ffnError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.repetition_penalty <= 0:
            raise Gpt2ffnError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.min_tokens < 0:
            raise Gpt2ffnError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        self.logit_bias = {_token_id(k): _bias(k, v) for k, v in dict(self.logit_bias or {}).items()}  # None: none

    @property
    def eos_ids(self) -> tuple:
        """The ids that end a sequence: eos_token_id's one, or its list's."""
        eos = self.eos_token_id
        return () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)

    @property
    def held(self) -> list:
        """The ids min_tokens holds off: EOS and stop_token_ids."""
        return list(self.eos_ids) + [t for t in self.stop_token_ids if t not in self.eos_ids]

    @property
    def plain_greedy(self) -> bool:
        """argmax of the raw logits: rows like this are picked together, in one call."""
        return (self.temperature == 0 and not self.logit_bias and self.presence_penalty == 0 and
                self.frequency_penalty == 0 and self.repetition_penalty == 1 and self.min_tokens == 0)


def _token_id(key) -> int:
    """A logit_bias key: a token id, as an int or as OpenAI's JSON writes it ("50256")."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool) and key >= 0:
        return int(key)
    raise Gpt2ffnError(f"logit_bias: key {key!r} is not a token id (an int >= 0)")


def _bias(key, value) -> float:
    """A logit_bias value: a finite real number (an int too), as a float (an infinite one made sampling draw
    another token without a word; -100 bans a token, +100 forces it, as OpenAI's)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not np.isfinite(value):
        raise Gpt2ffnError(f"logit_bias: value {value!r} for token {key!r} is not a finite number (-100 bans a "
                           f"token, +100 forces it)")
    return float(value)


# A logit a repetition penalty moves stays within +-1e20: a legal extreme (1e-300, 0 in float32) would make it
# inf, and a row with inf in it samples NaN; at 1e20 the penalized tokens tie and the sampler picks among them.
PENALIZED = 1e20


def pick(logits, s: Sampling, generator):
    """(B, V) logits -> (B,) next ids, after temperature, top-k and top-p: the plain reference of one Sampling
    for every row (torch.multinomial); the engine samples a batch of Samplings with next_tokens."""
    if s.temperature == 0:
        return greedy(logits)
    logits = scale_(logits.float().clone(), torch.tensor([[s.temperature]], device=logits.device))
    if s.top_k is not None:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p is not None and s.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        prob = sorted_logits.double().softmax(-1)          # in float64: fp32's cumsum cuts early near top_p 1
        drop = prob.cumsum(-1) - prob >= s.top_p           # keep the smallest prefix reaching top_p
        drop[:, 0] = False                                 # and the likeliest token, however small top_p is
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def adjust(logits, s: Sampling, prompt: list, output: list):
    """One row's (V,) logits after logit_bias, penalties and min_tokens: the reference of adjust_batch."""
    logits = logits.float().clone()
    if s.repetition_penalty != 1 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)))
        v = logits[seen]
        pen = torch.tensor(s.repetition_penalty)
        logits[seen] = torch.where(v > 0, v / pen, v * pen).clamp_(-PENALIZED, PENALIZED)
    if output and (s.presence_penalty or s.frequency_penalty):
        ids, counts = torch.tensor(output).unique(return_counts=True)
        logits[ids] -= s.frequency_penalty * counts.float() + s.presence_penalty
    for t, bias in s.logit_bias.items():
        logits[int(t)] += bias
    if len(output) < s.min_tokens:
        for t in s.held:
            logits[t] = float("-inf")
    return logits


def next_tokens(logits, requests, generator=None) -> list:
    """(B, V) logits, one row per request -> its next token id, each row under its own Sampling, the whole batch
    at once on the logits' device: penalties, logit_bias and min_tokens as `adjust` does them (bitwise equal),
    temperature, top-k and top-p as `pick` keeps them, one draw per row, one device-to-host copy of the ids.

    A draw is one uniform number per row, made on the host (`uniforms`: a seeded request's comes from its seed
    and how many tokens it has drawn, so its tokens do not depend on what runs beside it; the others' from
    `generator`, a CPU torch.Generator, torch's default if None), sent to the device in one copy and turned
    into a token by inverting the row's cumulative distribution."""
    params = [r.params for r in requests]
    kinds = {id(s): s for s in params}.values()  # requests often share one Sampling: each looked at once
    if all(s.plain_greedy for s in kinds):
        return greedy(logits).tolist()
    x = logits.float()
    if x.data_ptr() == logits.data_ptr() and any(_adjusts(s) for s in kinds):
        x = x.clone()                                      # adjust_batch writes in place; the caller keeps logits
    adjust_batch(x, requests)
    rows = [i for i, s in enumerate(params) if s.temperature > 0]
    if not rows:
        return greedy(x).tolist()
    ids = torch.empty(len(params), dtype=torch.long, device=x.device)
    if len(rows) < len(params):  # the greedy rows: argmax of their own logits only
        kept = [i for i, s in enumerate(params) if s.temperature == 0]
        ids[kept] = greedy(x[kept])
    drawing = [requests[i] for i in rows]
    u = torch.from_numpy(uniforms(drawing, generator)).to(x.device, non_blocking=True)
    ids[rows] = sample(x, rows, drawing, u)
    return ids.tolist()


def greedy(x):
    """Each row's first largest index: argmax, as x.max(-1) finds it, 2.6-2.9x faster than argmax on the CPU
    (256 rows of GPT-2's vocabulary 8.3 -> 2.9 ms, Intel Xeon, 2 threads; the same index, ties and NaN too)."""
    return x.max(-1).indices


def _adjusts(s: Sampling) -> bool:
    """Whether adjust_batch changes this row's logits."""
    return bool(s.repetition_penalty != 1 or s.presence_penalty or s.frequency_penalty or s.logit_bias
                or (s.min_tokens and s.held))


def scale_(x, temps):
    """(R, V) logits / (R, 1) temperatures in place, max first subtracted: a temperature as small as 5e-324 (0 in
    fp32, clamped to fp32's smallest normal) leaves the argmax at 0 and the rest at -inf, never inf or nan."""
    return x.sub_(x.amax(-1, keepdim=True)).div_(temps.clamp_min(torch.finfo(torch.float32).tiny))


def sample(x, rows: list, requests: list, u):
    """Rows `rows` of the (B, V) logits x, drawn for `requests` (one each) with u (float64, in (0, 1], one each)
    -> their ids, in three groups that cost differently, each gathered from x once and scaled by its
    temperatures in place: rows that keep the whole vocabulary draw from it; rows with top_k draw from their top
    k (top_p then applied within them); rows with only top_p sort the vocabulary first (on the CPU,
    kernels.packed.top_p_ drops the same tokens with no sort)."""
    out = torch.empty(len(rows), dtype=torch.long, device=x.device)
    whole = [j for j, r in enumerate(requests) if r.params.top_k is None and not _top_p(r.params)]
    top_k = [j for j, r in enumerate(requests) if r.params.top_k is not None]
    only_p = [j for j, r in enumerate(requests) if r.params.top_k is None and _top_p(r.params)]
    temps = torch.tensor([r.params.temperature for r in requests], device=x.device)[:, None]

    def scaled(group):
        return scale_(x[[rows[j] for j in group]], temps[group])

    if whole:
        out[whole] = draw(scaled(whole), u[whole])
    if only_p:
        z = scaled(only_p)
        if top_p_(z, [requests[j].params.top_p for j in only_p]):  # on the CPU, in place, with no sort
            out[only_p] = draw(z, u[only_p])
        else:
            vals, idx = candidates(z, [requests[j].params for j in only_p])
            out[only_p] = idx.gather(1, draw(vals, u[only_p])[:, None])[:, 0]
    if top_k:
        vals, idx = candidates(scaled(top_k), [requests[j].params for j in top_k])
        out[top_k] = idx.gather(1, draw(vals, u[top_k])[:, None])[:, 0]
    return out


def _top_p(s: Sampling) -> bool:
    return s.top_p is not None and s.top_p < 1


def candidates(x, params: list):
    """(C, V) logits -> (vals, idx) each (C, K): every row's K best in descending order (K = the largest top_k,
    or V when rows have only top_p), with what its own top_k and top_p drop at -inf, as `pick` keeps them."""
    V = x.shape[1]
    ks = [s.top_k for s in params]
    K = V if any(k is None for k in ks) else min(max(ks), V)
    vals, idx = x.sort(dim=-1, descending=True) if K == V else x.topk(K, dim=-1)
    if any(k is not None for k in ks):
        kth = vals.gather(1, torch.tensor([min(k or K, K) for k in ks], device=x.device)[:, None] - 1)
        vals = vals.masked_fill(vals < kth, float("-inf"))
    if any(_top_p(s) for s in params):
        top_p = torch.tensor([s.top_p if _top_p(s) else 2.0 for s in params], dtype=torch.float64,
                             device=x.device)[:, None]
        prob = vals.double().softmax(-1)           # in float64: fp32's cumsum cut 36 tokens early at top_p 0.999
        drop = prob.cumsum(-1) - prob >= top_p     # the smallest prefix reaching top_p
        drop[:, 0] = False                         # and the likeliest token, however small top_p is
        vals = vals.masked_fill(drop, float("-inf"))
    return vals, idx


GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x):
    """SplitMix64's finalizer over a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def seeded_uniforms(seeds, draws):
    """Draw number `draws[i]` (0, 1, ...) of the stream a seed names, for each row: SplitMix64 started from the
    mixed seed, its (draws + 1)-th output, as a float64 in (0, 1]. A pure function of (seed, draw): no state to
    keep, the same on every device and in any batch."""
    with np.errstate(over="ignore"):
        state = _mix64(np.array(seeds, dtype=np.uint64))
        h = _mix64(state + (np.asarray(draws, dtype=np.uint64) + np.uint64(1)) * GOLDEN)
    return ((h >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53


def uniforms(requests: list, generator=None):
    """One float64 in (0, 1] per request: seeded ones from (seed, tokens drawn so far) (`seeded_uniforms`), the
    others from one call on `generator` (a CPU torch.Generator)."""
    u = np.empty(len(requests))
    seeded = [j for j, r in enumerate(requests) if r.params.seed is not None]
    if seeded:
        u[seeded] = seeded_uniforms([requests[j].params.seed % 2 ** 64 for j in seeded],
                                    [len(requests[j].output) for j in seeded])
    if len(seeded) < len(requests):
        free = [j for j, r in enumerate(requests) if r.params.seed is None]
        u[free] = 1.0 - torch.rand(len(free), dtype=torch.float64, generator=generator).numpy()
    return u


def draw(z, u):
    """One sample per row of z (R, K) (logits less their row's max, -inf where dropped), given u (R,) in (0, 1]:
    the first k whose cumulative weight sum(exp(z[:k+1])) reaches u x the row's total (inverse transform
    sampling; the sums in float64, so a weight as small as 1e-16 of the total keeps its share). A token of
    weight 0 is never drawn: its sum equals the one before it, which is reached first."""
    c = z.double().exp_().cumsum_(-1)
    return torch.searchsorted(c, (u * c[:, -1])[:, None])[:, 0].clamp_max_(z.shape[1] - 1)


def history(r):
    """r's prompt + output ids as an int64 numpy array, kept on the request and extended by its new tokens only
    (the engine appends to r.output), so a step costs the new tokens, not the whole context, in Python."""
    n, p = len(r.prompt) + len(r.output), len(r.prompt)
    buf, filled = getattr(r, "_history", None), getattr(r, "_history_n", 0)
    if buf is None or filled > n or len(buf) < n:
        buf = np.empty(max(n, p + r.params.max_new_tokens, 1), np.int64)
        buf[:p], filled = r.prompt, p
        r._history = buf
    buf[filled:n] = r.output[filled - p:]
    r._history_n = n
    return buf[:n]


def _padded(ids: list, device, pad=None):
    """Rows of ids of different lengths -> (R, L) int64, each row padded with `pad`, or else with its own first id
    (an index that the ops below read and write alike: a duplicate changes nothing)."""
    out = np.empty((len(ids), max(len(i) for i in ids)), np.int64)
    for j, i in enumerate(ids):
        out[j, :len(i)], out[j, len(i):] = i, i[0] if pad is None else pad
    return torch.from_numpy(out).to(device)


def adjust_batch(x, requests):
    """`adjust` for every row of x (B, V) in place, bitwise: one tensor op per kind of adjustment for the batch,
    over the ids each row has seen (a few hundred), never over the (B, V) logits as a whole."""
    dev = x.device
    rep = [i for i, r in enumerate(requests) if r.params.repetition_penalty != 1 and (r.prompt or r.output)]
    if rep:  # every id of prompt and output (a repeated one reads and writes the same): v / p if v > 0 else v * p
        ids = _padded([history(requests[i]) for i in rep], dev)
        rows = torch.tensor(rep, device=dev)[:, None].expand_as(ids)
        pen = torch.tensor([requests[i].params.repetition_penalty for i in rep], device=dev)[:, None]
        v = x[rows, ids]
        x[rows, ids] = torch.where(v > 0, v / pen, v * pen).clamp_(-PENALIZED, PENALIZED)
    pf = [i for i, r in enumerate(requests) if r.output and (r.params.presence_penalty or r.params.frequency_penalty)]
    if pf:  # every generated id: minus frequency x its count + presence
        gen = [history(requests[i])[len(requests[i].prompt):] for i in pf]
        out = _padded(gen, dev)
        srt = _padded(gen, dev, pad=-1).sort(dim=1).values  # the padding counts as no id
        counts = (torch.searchsorted(srt, out, right=True) - torch.searchsorted(srt, out)).float()
        rows = torch.tensor(pf, device=dev)[:, None].expand_as(out)
        freq = torch.tensor([requests[i].params.frequency_penalty for i in pf], device=dev)[:, None]
        pres = torch.tensor([requests[i].params.presence_penalty for i in pf], device=dev)[:, None]
        x[rows, out] = x[rows, out] - (freq * counts + pres)
    bias = [(i, int(t), b) for i, r in enumerate(requests) for t, b in r.params.logit_bias.items()]
    if bias:
        x.index_put_((torch.tensor([i for i, _, _ in bias], device=dev),
                      torch.tensor([t for _, t, _ in bias], device=dev)),
                     torch.tensor([b for _, _, b in bias], device=dev), accumulate=True)
    held = [(i, t) for i, r in enumerate(requests) if len(r.output) < r.params.min_tokens for t in r.params.held]
    if held:
        x[torch.tensor([i for i, _ in held], device=dev),
          torch.tensor([t for _, t in held], device=dev)] = float("-inf")


def logprobs_of(logits, tokens, top: int):
    """(N, V) logits, (N,) chosen ids -> (chosen log-probs, [(top ids, top log-probs)] per row) of the raw
    distribution (before temperature and penalties), as OpenAI and vLLM report them."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.as_tensor(tokens)[:, None])[:, 0].tolist()
    if not top:
        return chosen, [([], []) for _ in chosen]
    vals, ids = lp.topk(top, dim=-1)
    return chosen, list(zip(ids.tolist(), vals.tolist()))
