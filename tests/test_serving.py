"""The continuous-batching engine in process: each request gets what it would get alone, whatever runs beside
it and whenever it joins; chunked prefill; aborts free the cache; limits; batch-invariant logits bitwise."""

import pytest
import torch

import gpt2ffn.serving.engine as engine_mod
from gpt2ffn.errors import Gpt2ffnError
from gpt2ffn.generate import generate, load
from gpt2ffn.serving.engine import Engine, QueueFull, Request
from gpt2ffn.serving.sampling import Sampling


@pytest.fixture(scope="module")
def model():
    return load("random:tiny:3")[0]


def prompts(n, seed=0, lo=3, hi=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 512, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def alone(model, prompt, s, **kw):
    return Engine(model, max_batch=1, **kw).run([Request(prompt, s)])[0].output


def staggered(model, ps, samplings, every=3, **kw):
    """Requests join the running batch one by one, every `every` steps, as clients arrive at a server."""
    eng = Engine(model, max_batch=64, **kw)
    reqs = [Request(p, s) for p, s in zip(ps, samplings)]
    pending, steps = list(reqs), 0
    while pending or eng.has_work():
        if pending and steps % every == 0:
            eng.add(pending.pop(0))
        eng.step()
        steps += 1
    return [r.output for r in reqs]


def test_greedy_in_a_changing_batch_equals_alone(model):
    ps = prompts(12)
    s = Sampling(max_new_tokens=20)
    solo = [alone(model, p, s) for p in ps]
    assert staggered(model, ps, [s] * 12) == solo
    # all at once: their prompts are prefilled packed into shared rows of up to `chunk` tokens
    assert [r.output for r in Engine(model, chunk=64).run([Request(p, s) for p in ps])] == solo


def test_seeded_sampling_is_the_same_whatever_runs_beside(model):
    ps = prompts(8, seed=1)
    samplings = [Sampling(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=100 + i,
                          presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2) for i in range(8)]
    together = staggered(model, ps, samplings, every=2)
    assert together == [alone(model, p, s) for p, s in zip(ps, samplings)]
    # other batch mates (other prompts, greedy ones) do not change the seeded draws either
    mixed = staggered(model, ps[:1] + prompts(5, seed=9), samplings[:1] + [Sampling(max_new_tokens=30)] * 5, every=1)
    assert mixed[0] == together[0]
    assert together[0] != alone(model, ps[0], Sampling(**{**samplings[0].__dict__, "seed": 7}))


def test_chunked_prefill_keeps_running_streams_going(model):
    short, long = prompts(1, seed=2)[0], prompts(1, seed=3, lo=100, hi=101)[0]
    s = Sampling(max_new_tokens=40)
    eng = Engine(model, max_batch=4, chunk=16)
    a = Request(short, s)
    eng.add(a)
    eng.step()
    eng.add(b := Request(long, Sampling(max_new_tokens=8)))
    gaps = []
    while b.computed < len(long):
        before = len(a.output)
        eng.step()
        gaps.append(len(a.output) - before)
    assert len(gaps) == -(-len(long) // 16) and gaps == [1] * len(gaps)  # a token for `a` at every chunk of `b`
    while eng.has_work():
        eng.step()
    assert a.output == alone(model, short, s) and b.output == alone(model, long, Sampling(max_new_tokens=8))
    assert b.output == alone(model, long, Sampling(max_new_tokens=8), chunk=256)


def test_abort_frees_blocks_and_limits(model):
    eng = Engine(model, max_batch=2, max_waiting=2)
    reqs = [Request(p, Sampling(max_new_tokens=50)) for p in prompts(4, seed=4)]
    eng.add(*reqs[:2])
    eng.step()
    eng.add(*reqs[2:])
    with pytest.raises(QueueFull, match=r"2 running and 2 waiting; 1 more would exceed the 4 it holds: max batch 2 "
                                        r"\+ max waiting 2"):
        eng.add(Request([1, 2], Sampling()))
    assert eng.counts()[:2] == (2, 2)
    with pytest.raises(Gpt2ffnError, match="5 sequences at once exceed what this server holds: 2 running"):
        eng.add(*[Request([1, 2], Sampling()) for _ in range(5)])
    burst = Engine(model, max_batch=4, max_waiting=0)  # free slots take a burst: no 503 before the batch is full
    burst.add(*[Request([1, 2], Sampling(max_new_tokens=2)) for _ in range(3)])
    burst.add(Request([3], Sampling(max_new_tokens=2)))
    with pytest.raises(QueueFull):
        burst.add(Request([3], Sampling(max_new_tokens=2)))
    for r in reqs:
        eng.abort(r)
    events = eng.step()
    assert sorted(e.finish_reason for e in events) == ["abort"] * 4
    assert eng.counts() == (0, 0, 0) and not eng.has_work()
    with pytest.raises(Gpt2ffnError,
                       match=r"prompt \(120 tokens\) \+ max_new_tokens \(20\) exceeds the context of 128"):
        eng.add(Request([1] * 120, Sampling(max_new_tokens=20)))


def test_stop_eos_min_tokens_ignore_eos_logit_bias(model):
    p = prompts(1, seed=5)[0]
    s = dict(max_new_tokens=12, temperature=1.0, seed=3)
    free = alone(model, p, Sampling(**s))
    k = next(i for i in range(2, 12) if free[i] not in free[:i])  # a token that first appears at k >= 2
    eos = free[k]
    assert alone(model, p, Sampling(**s, eos_token_id=eos)) == free[:k + 1]
    assert alone(model, p, Sampling(**s, eos_token_id=eos, ignore_eos=True)) == free
    held = alone(model, p, Sampling(**s, eos_token_id=eos, min_tokens=k + 2))
    assert held[:k] == free[:k] and held[k] != eos and len(held) >= k + 2
    assert alone(model, p, Sampling(max_new_tokens=5, logit_bias={7: 100.0})) == [7] * 5


def test_sampling_as_a_python_user_writes_it(model):
    """Int biases (once torch's dtype error), OpenAI's string keys, top_k 0 / -1 as off; what generate() cannot
    do (stop strings without the text, log-probs) is named, not skipped (a stop once ran to max_new_tokens)."""
    p = prompts(1, seed=5)[0]
    s = dict(max_new_tokens=6, temperature=1.0, seed=3)
    assert generate(model, [p], Sampling(**s, logit_bias={7: 100})) == [[7] * 6]
    assert Sampling(logit_bias={"7": 5}).logit_bias == {7: 5.0} and Sampling(logit_bias=None).logit_bias == {}
    assert [generate(model, [p], Sampling(**s, top_k=k)) for k in (0, -1)] == [generate(model, [p], Sampling(**s))] * 2
    with pytest.raises(Gpt2ffnError, match=r"logit_bias: key 512 is not a token id in \[0, 512\)"):
        generate(model, [p], Sampling(max_new_tokens=2, logit_bias={512: 1.0}))
    with pytest.raises(Gpt2ffnError, match=r"Sampling.stop \(\['e t'\]\) needs the text: pass decode="):
        generate(model, [p], Sampling(max_new_tokens=2, stop=["e t"]))
    for bad in (dict(logprobs=2), dict(prompt_logprobs=True)):
        with pytest.raises(Gpt2ffnError, match="generate\\(\\) and stream\\(\\) give token ids only"):
            generate(model, [p], Sampling(max_new_tokens=2, **bad))


@pytest.mark.parametrize("static", [False, True])
def test_batch_invariant_logits_are_bitwise_equal(model, monkeypatch, static):
    """Paged (the CPU's default) or slots (a GPU's: each row's step alone in its slot, StaticDecoder.step_each)."""
    invariant_logits_are_bitwise_equal(model, monkeypatch, static_decode=static)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [None, False])
def test_batch_invariant_logits_are_bitwise_equal_on_cuda(dtype, static, monkeypatch):
    """On a GPU (issue 18's promise there): in batch-invariant mode every logit of a request that shares the
    engine with others, joining one by one, is bitwise the logit of the same request alone (the default there:
    each row through the one-row CUDA graph in its slot; or each row eagerly over the paged cache)."""
    from gpt2ffn.model import load_model
    invariant_logits_are_bitwise_equal(load_model("random:tiny:3", precision=None).to("cuda", dtype), monkeypatch,
                                       static_decode=static)


def invariant_logits_are_bitwise_equal(model, monkeypatch, **kw):
    seen = {}
    real = engine_mod.next_tokens

    def record(logits, rows, generator=None):
        for i, r in enumerate(rows):
            seen.setdefault(r.id, []).append(logits[i].clone())
        return real(logits, rows, generator)

    monkeypatch.setattr(engine_mod, "next_tokens", record)
    ps = prompts(10, seed=6, lo=2, hi=60)
    s = Sampling(max_new_tokens=12)
    eng = Engine(model, max_batch=1, batch_invariant=True, **kw)
    solo = [eng.run([Request(p, s)])[0].id for p in ps]
    mates = staggered(model, ps, [s] * len(ps), every=1, batch_invariant=True, **kw)
    assert len(mates) == len(ps)
    batched_ids = sorted(seen)[-len(ps):]
    for a, b in zip(solo, batched_ids):
        assert len(seen[a]) == len(seen[b]) == 12
        assert all(torch.equal(x, y) for x, y in zip(seen[a], seen[b]))


def test_a_quantized_model_is_served_from_an_fp16_cache():
    """int8 weights: the engine's pool is fp16 (GPT2.kv_dtype), twice the positions in the same bytes, and greedy
    output in a changing batch (packed prefill, fused decode over the fp16 slots) equals each request alone and
    the model stepped by hand over an fp16 KVCache."""
    from gpt2ffn.serving.kv_cache import KVCache
    m = load("random:tiny:3", precision="int8")[0]
    eng = Engine(m, max_batch=4)
    assert m.kv_dtype == torch.float16 and eng.cache.k[0].dtype == torch.float16
    cfg = m.kv_config
    half, full = (engine_mod.default_kv_tokens(cfg, 4096, dtype, fraction=1e-4)
                  for dtype in (torch.float16, torch.float32))
    assert full > cfg.n_positions and 1.9 < half / full < 2.1  # a share of free memory (which moves a little)
    ps = prompts(6, seed=11)
    s = Sampling(max_new_tokens=10)
    solo = [alone(m, p, s) for p in ps]
    assert staggered(m, ps, [s] * 6, every=2) == solo
    cache, ids = KVCache(m.config, 1, torch.float16), torch.tensor([ps[0]])
    with torch.no_grad():
        tok = m(ids, cache)[:, -1].argmax(-1, keepdim=True)
        by_hand = [int(tok)]
        for _ in range(9):
            tok = m(tok, cache)[:, -1].argmax(-1, keepdim=True)
            by_hand.append(int(tok))
    assert solo[0] == by_hand
    # prompts cut into chunks of 8 (the native prefill continuing a sequence in its slot): the same tokens
    assert [alone(m, p, s, chunk=8) for p in ps] == solo
    assert staggered(m, ps, [s] * 6, every=2, chunk=8) == solo


@pytest.mark.parametrize("seed", range(60))
def test_incremental_text_stream(seed):
    """TextStream decodes a few tokens a step. What it sends is, at every step, a prefix of the final text (no
    part of a stop string, no half character shown as U+FFFD), and all but the last `hold` characters known so far
    (those that could start a stop string); the final text is the whole decode cut at the first stop string, hit
    at the first token that completes one. Characters of 1-4 UTF-8 bytes split across tokens, invalid bytes,
    tokens with no text, stop strings."""
    from gpt2ffn.serving.text import TextStream, cut_at_stop
    g = torch.Generator().manual_seed(seed)
    chars = "ab ,.é€😀\n"
    pieces = {i: c.encode() for i, c in enumerate(chars)}
    pieces[len(pieces)] = b"\xff"   # invalid UTF-8
    pieces[len(pieces)] = b""       # a token with no text (a skipped special token)
    stream = []
    for _ in range(int(torch.randint(1, 40, (1,), generator=g))):
        b = pieces[int(torch.randint(len(pieces), (1,), generator=g))]
        cut = int(torch.randint(len(b) + 1, (1,), generator=g))  # split multi-byte characters across tokens
        stream += [b[:cut], b[cut:]]
    ids = {}
    tokens = [ids.setdefault(p, len(ids)) for p in stream]
    table = {i: p for p, i in ids.items()}

    def decode(ts):
        return b"".join(table[t] for t in ts).decode("utf-8", errors="replace")
    whole = decode(tokens).replace("\ufffd", "")  # no U+FFFD in a stop string: it could be half a character
    stops = [[], ["é"], [" a", "😀"], [whole[3:6]] if len(whole) > 6 else ["zz"]][seed % 4]
    hold = max((len(s) for s in stops), default=1) - 1
    hit = next((n for n in range(1, len(tokens) + 1) if cut_at_stop(decode(tokens[:n]), stops)[1]), None)
    final = cut_at_stop(decode(tokens[:hit or len(tokens)]), stops)[0]
    runs = []
    for additive in (False, True):  # this decode is additive where a character ends (bytes, then UTF-8)
        ts, sent, deltas = TextStream(decode, stops, additive), "", []
        for n, t in enumerate(tokens, 1):
            delta, stopped = ts.push(t)
            sent += delta
            deltas.append(delta)
            assert final.startswith(sent) and stopped == (n == hit)
            if stopped:
                assert sent == final
                break
            assert len(sent) >= len(decode(tokens[:n]).rstrip("\ufffd")) - hold
        assert sent + ts.finish() == final
        runs.append(deltas)
    assert runs[0] == runs[1]  # delta for delta


def test_stream_chunks_join_the_tokens_that_came_together():
    """A stream that fell behind sends, per choice, one chunk of every token that came since it last ran: the
    texts joined, the log-probs listed together (the echoed prompt's first), text_offset as the whole answer counts
    it (a token whose text is still held back, as a possible stop string, keeps its place), the finish reason of
    the last."""
    from types import SimpleNamespace

    from gpt2ffn.serving.engine import Token
    from gpt2ffn.serving.protocol import CompletionRequest
    from gpt2ffn.serving.service import Choices, Service
    svc = Service("random:tiny")
    svc.tok, svc.name = SimpleNamespace(decode=lambda ids: "".join("abcdefgh"[i] for i in ids)), "m"
    body = CompletionRequest(model="m", prompt=[0, 1], n=2, logprobs=1, echo=True, stream=True)
    samplings = [Sampling(max_new_tokens=3, logprobs=1, prompt_logprobs=True)] * 2
    choices = Choices(svc, body, [[0, 1]], samplings, echo_text=["ab"])
    r = [Request([0, 1], s) for s in samplings]
    for q in r:
        q.prompt_logprobs = [(None, ((), ())), (-1.0, ([1], [-1.0]))]

    def tok(i, c, t, text, finish=None):
        return c, Token(r[c], t, logprob=-0.5 * i, top=([t], [-0.5 * i]), text=text, finish_reason=finish)
    first = choices.chunks([tok(1, 0, 2, "c"), tok(2, 1, 3, ""), tok(3, 0, 4, "e")])
    assert [c["choices"][0]["index"] for c in first] == [0, 1]
    a, b = (c["choices"][0] for c in first)  # b: the echoed prompt, its token's own text still held back
    assert a["text"] == "abce" and a["finish_reason"] is None  # the echoed prompt's log-probs come first
    assert a["logprobs"]["tokens"] == ["a", "b", "c", "e"]
    assert a["logprobs"]["token_logprobs"] == [None, -1.0, -0.5, -1.5]
    assert a["logprobs"]["text_offset"] == [0, 1, 2, 3]
    assert b["text"] == "ab" and b["logprobs"]["text_offset"] == [0, 1, 2]
    (last,) = choices.chunks([tok(4, 0, 5, "f"), (0, Token(r[0], -1, finish_reason="length"))])
    assert last["choices"][0]["text"] == "f" and last["choices"][0]["finish_reason"] == "length"
    assert last["choices"][0]["logprobs"]["text_offset"] == [4]
    assert choices.texts == ["abcef", "ab"] and choices.gen == [[2, 4, 5], [3]]
    whole = choices.response()["choices"][0]["logprobs"]  # the same offsets as the whole answer's
    assert whole["text_offset"] == [0, 1, 2, 3, 4]


def test_log_probs_asked_by_some_rows_are_each_rows_alone(model):
    """A step computes the log-probs of the rows that ask (top 0, 2, 5) together, beside rows that do not ask:
    each token's log-prob and top ones are those of the same request alone."""
    ps, ks = prompts(6, seed=7), [None, 0, 2, 5, None, 2]

    def events(eng, reqs):
        out = {id(r): [] for r in reqs}
        eng.add(*reqs)
        while eng.has_work():
            for ev in eng.step():
                if ev.id >= 0:
                    out[id(ev.request)].append((ev.id, ev.logprob, ev.top))
        return [out[id(r)] for r in reqs]
    reqs = [Request(p, Sampling(max_new_tokens=6, logprobs=k)) for p, k in zip(ps, ks)]
    together = events(Engine(model, max_batch=8), reqs)
    for p, k, got in zip(ps, ks, together):
        (solo,) = events(Engine(model, max_batch=1), [Request(p, Sampling(max_new_tokens=6, logprobs=k))])
        assert [t for t, _, _ in got] == [t for t, _, _ in solo]
        for (_, lp, top), (_, lp1, top1) in zip(got, solo):
            if k is None:
                assert lp is None and top == ((), ())
                continue
            assert lp == pytest.approx(lp1, abs=1e-5) and len(top[0]) == k and list(top[0]) == list(top1[0])
            assert list(top[1]) == pytest.approx(list(top1[1]), abs=1e-5)


def test_text_offsets_from_anchors_equal_every_prefix_decoded():
    """serving.service.Offsets: with a byte-level tokenizer (GPT-2's kind, and the random presets' bytes) the
    offsets counted from anchors equal len(decode(ids[:i])) for every i, over text whose characters span tokens
    (CJK, emoji, lone continuation bytes), whole or in chunks of any size; a tokenizer not known to be additive
    decodes every prefix."""
    import random
    from types import SimpleNamespace

    from tokenizers import ByteLevelBPETokenizer

    from gpt2ffn.serving.service import Offsets
    from gpt2ffn.tokenizer import ByteTokenizer, HFTokenizer
    text = "naïve café 東京タワー 🙂🚀 ok " * 8
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text, "the cat sat on the mat " * 10], vocab_size=300, min_frequency=1)
    toks = [ByteTokenizer(), HFTokenizer(bpe._tokenizer)]
    assert all(t.additive for t in toks)
    rng = random.Random(0)
    for tok in toks:
        ids = tok.encode(text)
        for trial in range(4):
            seq = ids if trial == 0 else [rng.choice(ids) for _ in range(300)]  # shuffled: half characters too
            want = [len(tok.decode(seq[:i])) for i in range(len(seq))]
            assert Offsets(tok).of(seq) == want
            o, got, i = Offsets(tok), [], 0
            while i < len(seq):  # a stream: the ids arrive a few at a time
                i = min(len(seq), i + rng.randint(1, 9))
                got += o.of(seq[:i], len(got))
            assert got == want, (type(tok).__name__, trial)
    plain = SimpleNamespace(decode=lambda ids: "".join("ab"[i % 2] * (i % 3) for i in ids))  # no `additive`
    assert Offsets(plain).of([1, 2, 3, 4]) == [0, 1, 3, 3]


def test_every_route_that_reads_the_model_is_503_while_it_loads():
    """Before the model has loaded (the HTTP server is up first): 503 in OpenAI's shape with Retry-After, never a
    500 (/v1/models answered a null id) or a misleading 400 (/tokenize)."""
    from fastapi.testclient import TestClient

    from gpt2ffn.serving.http import create_app
    from gpt2ffn.serving.service import Service
    client = TestClient(create_app(Service("random:tiny")), raise_server_exceptions=False)  # no lifespan: no load
    for method, path, body in (("get", "/health", None), ("get", "/v1/models", None),
                               ("post", "/tokenize", {"prompt": "hi"}), ("post", "/detokenize", {"tokens": [1]}),
                               ("post", "/v1/completions", {"model": "m", "prompt": "hi"})):
        r = client.request(method, path, json=body)
        assert r.status_code == 503, (path, r.status_code, r.text)
        assert r.json()["error"]["type"] == "unavailable", path
        assert path == "/health" or r.headers["retry-after"] == "5", path


def test_an_eos_token_that_does_not_stop_keeps_its_text(model):
    """With ignore_eos, EOS is a token like any other and its text is in the answer (a config's EOS list may
    name an ordinary token: id 37, GPT-2's 'F'); an EOS that ends the answer has none."""
    from gpt2ffn.tokenizer import ByteTokenizer
    texts = []
    s = Sampling(max_new_tokens=3, eos_token_id=[37, 0], ignore_eos=True, logit_bias={37: 100.0})
    r = Engine(model, ByteTokenizer().decode).run([Request([1, 2], s, sink=lambda ev: texts.append(ev.text))])[0]
    assert r.output == [37] * 3 and "".join(texts) == "FFF"
    texts.clear()
    s = Sampling(max_new_tokens=3, eos_token_id=[37, 0], logit_bias={37: 100.0})
    r = Engine(model, ByteTokenizer().decode).run([Request([1, 2], s, sink=lambda ev: texts.append(ev.text))])[0]
    assert r.output == [37] and r.finish_reason == "stop" and "".join(texts) == ""


def test_a_cut_loop_ends_every_request_even_one_submitted_after_it():
    """Loop.cut (the server's shutdown deadline, a second Ctrl-C): running requests end with an error event saying
    why, and so does a request that comes after it, whatever the thread was doing (it went through while the
    idle thread warmed the KV cache). Without a cut the same request runs to its length (the control)."""
    import threading

    from gpt2ffn.serving.engine import SHUTTING_DOWN, Loop
    model = load("random:tiny", precision=None)[0]

    def run(loop):
        done, events = threading.Event(), []
        loop.submit(Request([1, 2, 3], Sampling(max_new_tokens=40),
                            sink=lambda ev: (events.append(ev), ev.finish_reason and done.set())))
        assert done.wait(30)
        return events[-1]

    loop = Loop(Engine(model, max_batch=2))
    try:
        assert run(loop).finish_reason == "length"
        loop.cut(f"{SHUTTING_DOWN} (a test)")
        last = run(loop)
        assert last.finish_reason == "error" and last.text == f"{SHUTTING_DOWN} (a test)"
        assert run(loop).finish_reason == "error"  # it stays
    finally:
        loop.stop()


@pytest.mark.parametrize("interval", [1, 3])
def test_stream_interval_sends_the_first_token_then_every_n(interval):
    """--stream-interval N: a choice's first token goes out alone (the time to first token is not delayed), then
    one chunk per N of its tokens, the rest with its finish; the texts join to the same answer. An engine error
    sends the tokens held before it, then the error. N = 1 sends every token."""
    import asyncio
    import dataclasses
    import json
    from types import SimpleNamespace

    from gpt2ffn.serving.engine import Token
    from gpt2ffn.serving.http import sse
    from gpt2ffn.serving.protocol import CompletionRequest
    from gpt2ffn.serving.service import Choices, Service
    svc = Service("random:tiny")
    svc.tok, svc.name = SimpleNamespace(decode=lambda ids: "".join("abcdefgh"[i] for i in ids)), "m"

    class Answer:  # one engine step per call, one token of each choice a step; left: choices not yet finished
        def __init__(self, steps, n, gone=False):
            self.steps, self.done, self.left, self.svc, self.failed = list(steps), False, n, svc, None

            async def is_disconnected():
                return gone
            self.request = SimpleNamespace(is_disconnected=is_disconnected)

        async def next(self):
            items = self.steps.pop(0) if self.steps else []
            self.left -= isinstance(items, list) and sum(ev.finish_reason is not None for _, ev in items)
            return items

    outs = []  # the pieces sse yielded (each one write to the socket) in the last run

    def run(steps, n=1, gone=False):
        body = CompletionRequest(model="m", prompt=[0], n=n, stream=True, stream_options={"include_usage": True})
        samplings = [Sampling(max_new_tokens=8)] * n
        choices = Choices(svc, body, [[0]], samplings)
        events = []

        answer = Answer(steps(choices), n, gone)

        async def go():
            outs.clear()
            async for out in sse(answer, choices, interval):
                outs.append(out)
                batch = [c for e in out.split("\n\n")  # not [DONE], not the usage chunk (no choices)
                         if e.startswith("data: {") and (c := json.loads(e[6:])).get("choices") != []]
                events.extend([batch] if batch else [])
        asyncio.run(go())
        run.answer = answer
        return choices, events

    def tokens(choices, n_tokens=7, n=1, error_at=None):
        r = [Request([0], Sampling(max_new_tokens=8)) for _ in range(n)]
        steps = []
        for i in range(n_tokens):
            if i == error_at:
                steps.append(SimpleNamespace(body=b'{"error": "x"}'))
                break
            last = i == n_tokens - 1
            steps.append([(c, Token(r[c], i % 8, text="abcdefgh"[i % 8], finish_reason="length" if last else None))
                          for c in range(n)])
        return steps
    choices, events = run(tokens)
    texts = ["".join(c["choices"][0]["text"] for c in e) for e in events]
    assert "".join(texts) == "abcdefg" and choices.texts == ["abcdefg"]
    assert texts == (list("abcdefg") if interval == 1 else ["a", "bcd", "efg"])
    assert events[-1][-1]["choices"][0]["finish_reason"] == "length"
    assert '"finish_reason": "length"' in outs[-1] and outs[-1].endswith("data: [DONE]\n\n")  # the end: one piece
    assert '"completion_tokens": 7' in outs[-1]  # the usage counts the tokens that go out with it
    assert all("[DONE]" not in out for out in outs[:-1])
    _, events = run(tokens, gone=True)  # the client left before the end: no end sent, a 499 (not a 200)
    assert not any("[DONE]" in out for out in outs) and run.answer.failed.status_code == 499
    assert not run.answer.done
    _, events = run(lambda ch: tokens(ch, n_tokens=8, n=2), n=2)  # two choices, each counted on its own
    per = [sorted(c["choices"][0]["index"] for c in e) for e in events]
    assert all(p == [0, 1] for p in per) and len(events) == (8 if interval == 1 else 4)  # 1, 3, 3, 1
    def quiet_first(ch):  # the first token's text held back (a possible stop string): the first text goes at once
        steps = tokens(ch)
        steps[0] = [(c, dataclasses.replace(ev, text="")) for c, ev in steps[0]]
        return steps
    _, events = run(quiet_first)
    texts = ["".join(c["choices"][0]["text"] for c in e) for e in events]
    assert texts == (list("bcdefg") if interval == 1 else ["b", "cde", "fg"])
    _, events = run(lambda ch: tokens(ch, error_at=3))
    assert "".join(c["choices"][0]["text"] for e in events for c in e if "choices" in c) == "abc"


def test_top_logprobs_keep_the_chosen_tokens_own_log_prob():
    """Two ids that decode alike (byte tokens' U+FFFD) share a key: the likelier keeps it among the top ones, but
    the chosen token's key holds the chosen token's log-prob, so top_logprobs[i][tokens[i]] == token_logprobs[i]."""
    from types import SimpleNamespace

    from gpt2ffn.serving.service import Service
    svc = Service("random:tiny")
    svc.tok = SimpleNamespace(decode=lambda ids: {97: "\ufffd", 235: "\ufffd", 5: "a"}[ids[0]])
    out = svc.logprobs([235], [-7.5], [((97, 5), (-4.0, -5.0))], [0])
    assert out["tokens"] == ["\ufffd"] and out["top_logprobs"] == [{"\ufffd": -7.5, "a": -5.0}]
    assert out["top_logprobs"][0][out["tokens"][0]] == out["token_logprobs"][0]
    out = svc.logprobs([5], [-5.0], [((97, 235), (-4.0, -4.5))], [0])  # not among the top: added after them
    assert list(out["top_logprobs"][0].items()) == [("\ufffd", -4.0), ("a", -5.0)]
