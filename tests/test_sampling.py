"""The batch sampler (serving/sampling.next_tokens) against the one-row reference (adjust, pick): the same
adjusted logits bitwise, the same top-k/top-p support, an exact sample of the distribution, and a seeded row's
draws independent of its batch mates."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gpt2ffn.kernels import packed
from gpt2ffn.serving.sampling import (
    Sampling,
    adjust,
    adjust_batch,
    candidates,
    draw,
    next_tokens,
    pick,
    seeded_uniforms,
    uniforms,
)

V = 300


def request(s: Sampling, prompt=(), output=()):
    return SimpleNamespace(params=s, prompt=list(prompt), output=list(output))


def mixed(n=24, seed=0):
    """Requests with every kind of adjustment, alone and combined, and their logits."""
    g = torch.Generator().manual_seed(seed)
    kinds = [dict(), dict(repetition_penalty=1.3), dict(presence_penalty=0.7), dict(frequency_penalty=0.4),
             dict(logit_bias={5: 3.0, 17: -100.0}), dict(min_tokens=9, eos_token_id=3),
             dict(min_tokens=6, stop_token_ids=[8, 11]), dict(min_tokens=5, eos_token_id=3, stop_token_ids=[3, 9]),
             dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.1, logit_bias={3: 2.5},
                  min_tokens=4, eos_token_id=3)]
    reqs = []
    for i in range(n):
        toks = torch.randint(0, V, (2, 12), generator=g).tolist()
        reqs.append(request(Sampling(temperature=0.0, **kinds[i % len(kinds)]), toks[0][:i % 7], toks[1][:i % 11]))
    return reqs, 3 * torch.randn(n, V, generator=g)


def test_adjust_batch_equals_the_reference_bitwise():
    reqs, logits = mixed()
    x = logits.clone()
    adjust_batch(x, reqs)
    for i, r in enumerate(reqs):
        assert torch.equal(x[i], adjust(logits[i], r.params, r.prompt, r.output)), i
    assert not torch.equal(x, logits)  # the adjustments did something
    # greedy rows take the argmax of their adjusted logits
    assert next_tokens(logits, reqs) == x.argmax(-1).tolist()


def test_adjust_batch_follows_growing_outputs_bitwise():
    """The ids seen are kept on each request and extended by its new tokens (sampling.history): step after step,
    with repeats and contexts of hundreds of ids, and after an output is replaced, still `adjust` bitwise."""
    g = torch.Generator().manual_seed(1)
    kinds = [dict(repetition_penalty=1.2), dict(frequency_penalty=0.3, presence_penalty=0.2),
             dict(repetition_penalty=0.9, frequency_penalty=-0.4)]
    reqs = [request(Sampling(max_new_tokens=200, **kinds[i % 3]), torch.randint(0, 40, (50 * i + 1,),
                                                                                 generator=g).tolist())
            for i in range(6)]
    for step in range(60):
        logits = 3 * torch.randn(len(reqs), V, generator=g)
        x = logits.clone()
        adjust_batch(x, reqs)
        for i, r in enumerate(reqs):
            assert torch.equal(x[i], adjust(logits[i], r.params, r.prompt, r.output)), (step, i)
        for r in reqs:
            r.output.append(int(torch.randint(0, 60, (1,), generator=g)))
        if step == 30:
            reqs[1].output = reqs[1].output[:3]  # not what the engine does, but history() must not go stale


def reference_support(logits, s: Sampling):
    """What pick keeps of one row: its masked, temperature-scaled logits (top-k first, then top-p)."""
    x = logits.float()[None] / s.temperature
    if s.top_k is not None:
        kth = torch.topk(x, min(s.top_k, x.shape[-1]), dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p is not None and s.top_p < 1:
        srt, order = x.sort(dim=-1, descending=True)
        prob = srt.double().softmax(-1)
        drop = prob.cumsum(-1) - prob >= s.top_p
        drop[:, 0] = False  # the likeliest token, however small top_p is
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return x[0]


@pytest.mark.parametrize("params", [
    [dict(temperature=1.0, top_k=5), dict(temperature=0.9, top_k=40, top_p=0.8), dict(temperature=1.0, top_k=1),
     dict(temperature=1.2, top_k=300, top_p=0.3)],
    [dict(temperature=1.3, top_p=0.5), dict(temperature=1.0, top_p=0.05), dict(temperature=0.7, top_p=0.99)],
])
def test_candidates_equal_the_reference(params):
    """Each row keeps exactly the tokens, and the values, that pick keeps, alone or grouped with others."""
    logits = 2 * torch.randn(len(params), V, generator=torch.Generator().manual_seed(1))
    ss = [Sampling(**p) for p in params]
    scaled = logits / torch.tensor([s.temperature for s in ss])[:, None]
    grouped = candidates(scaled, ss)
    for i, s in enumerate(ss):
        want = reference_support(logits[i], s)
        for vals, idx in (candidates(scaled[i:i + 1], [s]), (grouped[0][i:i + 1], grouped[1][i:i + 1])):
            kept = ~torch.isinf(vals[0])
            assert sorted(idx[0][kept].tolist()) == torch.nonzero(~torch.isinf(want))[:, 0].tolist(), s
            assert torch.allclose(vals[0][kept], want[idx[0][kept]], rtol=1e-6, atol=0), s


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(2))
    reqs = [request(Sampling(temperature=1.0, top_k=1, seed=i)) for i in range(3)]
    reqs += [request(Sampling(temperature=1.5, top_p=1e-6)) for _ in range(3)]
    for _ in range(5):
        assert next_tokens(logits, reqs) == logits.argmax(-1).tolist()


def test_a_seeded_row_draws_the_same_whatever_runs_beside():
    g = torch.Generator().manual_seed(3)
    me = Sampling(temperature=1.0, top_p=0.95, seed=42)
    mine = torch.randn(V, generator=g)
    alone = [next_tokens(mine[None], [request(me)])[0] for _ in range(1)]
    for mates in (0, 1, 7, 30):
        others = [request(Sampling(temperature=float(t % 3), top_k=(t % 5) or None,
                                   seed=t if t % 2 else None)) for t in range(mates)]
        for at in {0, mates // 2, mates}:
            reqs = others[:at] + [request(me)] + others[at:]
            logits = torch.cat([torch.randn(at, V, generator=g), mine[None], torch.randn(mates - at, V, generator=g)])
            assert next_tokens(logits, reqs)[at] == alone[0], (mates, at)


def test_draws_are_an_exact_sample_of_the_distribution():
    """20000 rows of the same 5-way distribution: each frequency within 4.5 sigma of its probability."""
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    n = 20000
    for seeded in (False, True):
        reqs = [request(Sampling(temperature=0.8, seed=i if seeded else None)) for i in range(n)]
        ids = torch.tensor(next_tokens(logits.repeat(n, 1), reqs, torch.Generator().manual_seed(5)))
        p = (logits / 0.8).softmax(-1)
        freq = torch.bincount(ids, minlength=5).float() / n
        assert ((freq - p).abs() <= 4.5 * (p * (1 - p) / n).sqrt()).all(), (seeded, freq, p)


@pytest.mark.cuda
def test_sampling_on_cuda_equals_cpu_where_it_must():
    """Greedy and adjusted-greedy rows pick the same ids on the GPU; a seeded row reproduces there."""
    reqs, logits = mixed()
    assert next_tokens(logits.cuda(), reqs) == next_tokens(logits, reqs)
    me = [request(Sampling(temperature=1.0, top_k=20, seed=9), output=[1, 2])]
    first = next_tokens(logits[:1].cuda(), me)
    assert next_tokens(logits[:1].cuda(), me) == first
    assert next_tokens(torch.cat([torch.randn(5, V), logits[:1]]).cuda(), mixed(5)[0] + me)[-1] == first[0]


@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_p=5e-324), dict(temperature=5e-324),
                                dict(temperature=1e-40, top_k=3), dict(temperature=2.0, top_p=1e-46, seed=7)])
def test_extreme_but_legal_parameters_take_the_likeliest_token(kw):
    """Found by schemathesis (top_p=5e-324 is 0 in fp32): no nan, no inf, no error; the argmax wins."""
    logits = 3 * torch.randn(5, V, generator=torch.Generator().manual_seed(1))
    reqs = [request(Sampling(**kw)) for _ in range(5)]
    assert next_tokens(logits, reqs) == logits.argmax(-1).tolist()
    assert pick(logits, reqs[0].params, torch.Generator().manual_seed(0)).tolist() == logits.argmax(-1).tolist()


def test_a_seeds_draws_are_a_function_of_seed_and_count():
    """Draw k of seed s is the same number whatever else is drawn, in (0, 1], different for neighbouring seeds
    and counts, and uniform (Kolmogorov-Smirnov over 100k draws of consecutive seeds and counts)."""
    seeds, draws = [0, 1, 2, 2**64 - 1, 12345], [0, 0, 7, 3, 100]
    u = seeded_uniforms(seeds, draws)
    for i in range(len(seeds)):
        assert seeded_uniforms([seeds[i]], [draws[i]])[0] == u[i]
    assert len(set(u.tolist())) == len(u) and ((u > 0) & (u <= 1)).all()
    n = 100_000
    big = np.sort(np.concatenate([seeded_uniforms(np.arange(n // 2), np.zeros(n // 2, np.uint64)),
                                  seeded_uniforms(np.full(n // 2, 7), np.arange(n // 2))]))
    ks = np.abs(big - np.arange(1, n + 1) / n).max()
    assert ks < 1.63 / n ** 0.5, ks        # the 1% critical value
    # a request's draw follows its token count, not the call: the same count draws the same number again
    r = request(Sampling(temperature=1.0, seed=5), output=[1, 2, 3])
    assert uniforms([r])[0] == uniforms([request(Sampling(seed=1)), r])[1] == seeded_uniforms([5], [3])[0]
    assert uniforms([request(Sampling(temperature=1.0, seed=-1))])[0] == seeded_uniforms([2**64 - 1], [0])[0]


def test_a_draw_never_picks_a_dropped_token_even_at_the_ends_of_u():
    """u = 1 takes the last token of non-zero weight, the smallest u the first; tokens at -inf (dropped by
    top-k/top-p, or outside the vocabulary's likely part) are never drawn, wherever they sit."""
    inf = float("-inf")
    z = torch.tensor([[inf, 0.0, inf, -1.0, inf, inf], [0.0, inf, inf, inf, inf, inf],
                      [-3.0, inf, 0.0, inf, -2.0, inf]])
    last = torch.tensor([3, 0, 4])
    first = torch.tensor([1, 0, 0])
    assert torch.equal(draw(z, torch.ones(3, dtype=torch.float64)), last)
    assert torch.equal(draw(z, torch.full((3,), 2.0 ** -53, dtype=torch.float64)), first)
    u = torch.from_numpy(seeded_uniforms(np.arange(3000) % 7, np.arange(3000) // 7))
    picked = draw(z.repeat(1000, 1), u).reshape(1000, 3)
    for row in range(3):
        assert set(picked[:, row].tolist()) <= set(torch.nonzero(~torch.isinf(z[row]))[:, 0].tolist())


@pytest.mark.skipif(packed._C is None, reason="gpt2ffn._C is not built")
@pytest.mark.parametrize("V", [1, 2, 17, 300, 50257])
def test_native_top_p_keeps_the_nucleus(V):
    """kernels.packed.top_p_ (the weights summed into bins of the logit, no sort) keeps each row's nucleus: a
    prefix of its tokens in descending order (ties in any order), the last kept one with less than top_p before
    it and the first dropped one with at least top_p before it, in float64 up to 1e-6 (fp32's rounding of the
    weights; the sort-based path `candidates` cut 36 tokens early in a row here at top_p 0.999 over GPT-2's
    vocabulary when its cumsum was fp32; now it sums in float64 too). Peaked and flat rows, ties, -inf entries,
    top_p from 5e-324 to 1; the same bits from every instruction-set build (the AVX-512 and AVX2 vector passes)."""
    from conftest import native_isas
    g = torch.Generator().manual_seed(V)
    rows = [4 * torch.randn(V, generator=g), 0.3 * torch.randn(V, generator=g), 12 * torch.randn(V, generator=g),
            torch.randint(0, 4, (V,), generator=g).float(),  # a few values, many ties
            torch.where(torch.rand(V, generator=g) < 0.5, float("-inf"), torch.randn(V, generator=g))]
    rows[-1][0] = 0.0
    tops = [5e-324, 1e-6, 0.1, 0.5, 0.9, 0.95, 0.999, 1.0]
    x = torch.stack([r for r in rows for _ in tops])
    ps = tops * len(rows)
    z = x - x.amax(-1, keepdim=True)
    by_isa = {}
    for isa in native_isas():
        old = packed._C.set_isa(isa)
        try:
            by_isa[isa] = z.clone()
            assert packed.top_p_(by_isa[isa], ps)
        finally:
            packed._C.set_isa(old)
    kept = by_isa["avx2"]
    assert all(torch.equal(k, kept) for k in by_isa.values()), list(by_isa)
    for i, p in enumerate(ps):
        srt = z[i].sort(descending=True).values
        n = int((~torch.isinf(kept[i])).sum())
        assert torch.equal(kept[i][~torch.isinf(kept[i])].sort(descending=True).values, srt[:n]), (i, p)
        prob = srt.double().softmax(-1)
        before = prob.cumsum(-1) - prob
        if p < 1e-300:
            assert n == 1, (i, p)
            continue
        assert before[n - 1] < p + 1e-6, (i, p, n)
        assert n == V or before[n] >= p - 1e-6 or prob[n] == 0, (i, p, n)
    assert torch.equal(kept[~torch.isinf(kept)], z[~torch.isinf(kept)])  # the kept values are untouched
    assert not packed.top_p_(z.double(), ps)  # other dtypes: not here
    if V > 1:
        assert not packed.top_p_(z[:, ::2], ps)  # nor other layouts


def test_top_p_draws_are_an_exact_sample_of_the_nucleus():
    """20000 draws of a 6-way distribution with top_p 0.8: only the nucleus, each at its renormalized share."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -2.0])
    n = 20000
    reqs = [request(Sampling(temperature=1.0, top_p=0.8, seed=i)) for i in range(n)]
    ids = torch.tensor(next_tokens(logits.repeat(n, 1), reqs))
    p = logits.softmax(-1)
    keep = (p.cumsum(-1) - p) < 0.8
    q = torch.where(keep, p, 0) / p[keep].sum()
    freq = torch.bincount(ids, minlength=6).float() / n
    assert (freq[~keep] == 0).all()
    assert ((freq - q).abs() <= 4.5 * (q * (1 - q) / n).sqrt()).all(), (freq, q)


def test_the_callers_logits_are_left_as_they_were():
    """The engine reads the same logits again for log-probs: penalties, bias, temperature and top-p work on
    copies, whether the batch needs adjusting or not, fp32 or bf16, whole or a row's view."""
    reqs, logits = mixed(12)
    reqs += [request(Sampling(temperature=0.8, top_p=0.9, seed=1)), request(Sampling(temperature=1.0, top_k=4))]
    logits = torch.cat([logits, torch.randn(2, V)])
    for batch in (reqs, reqs[-2:]):
        for x in (logits[-len(batch):].clone(), logits[-len(batch):].bfloat16()):
            before = x.clone()
            next_tokens(x, batch)
            assert torch.equal(x, before)
    full = logits.clone()
    next_tokens(logits[1:2], [reqs[1]])  # a row's view, as Engine.emit passes it
    assert torch.equal(logits, full)


def test_an_extreme_repetition_penalty_is_no_nan():
    """repetition_penalty 1e-300 (0 in float32) sends every seen token with a positive logit to inf, and a row with
    inf in it sampled NaN (always the last id); held at 1e20 they tie, and a sample is one of them."""
    logits = torch.tensor([[2.0, 1.0, -1.0, 3.0, 0.5]])
    picked = set()
    for seed in range(16):
        s = Sampling(max_new_tokens=1, temperature=1.0, seed=seed, repetition_penalty=1e-300)
        x = logits.clone()
        adjust_batch(x, [request(s, prompt=[0, 1])])
        assert torch.isfinite(x).all() and torch.equal(x[0], adjust(logits[0], s, [0, 1], []))
        picked.add(next_tokens(logits, [request(s, prompt=[0, 1])])[0])
    assert picked == {0, 1}
