"""Decode steps of fixed shapes over slots (serving/static.py): the sequences that decode kept in slots 0..D-1,
each step one (batch bucket, span bucket) shape, so that a GPU replays it as a CUDA graph. On the CPU the same
steps run eagerly: the tokens and logits must be the paged path's, whatever joins, finishes or is aborted."""

import importlib
import importlib.util

import pytest
import torch

import gpt2ffn.serving.engine as engine_mod
import gpt2ffn.serving.static as static_mod
from gpt2ffn.generate import load
from gpt2ffn.model import load_model
from gpt2ffn.serving.engine import Engine, Request
from gpt2ffn.serving.sampling import Sampling
from gpt2ffn.serving.static import StaticDecoder, batch_buckets, span_buckets


@pytest.fixture(scope="module", params=["plain", "packed"])
def model(request):
    """Plain torch modules (the GPU's case) and the CPU's packed layers (the native decode, here bypassed)."""
    if request.param == "plain":
        return load_model("random:tiny:3", precision=None).eval()
    return load("random:tiny:3")[0]


def prompts(n, seed=0, lo=1, hi=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 512, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def check_slots(eng):
    """Decoding rows in slots 0..D-1 in order; every running request owns its own slot; the rest are free."""
    st = eng.static
    assert [r.blocks for r in st.rows] == [[i] for i in range(len(st.rows))]
    owned = [r.blocks[0] for r in eng.running]
    assert len(set(owned)) == len(owned)
    assert sorted(owned + eng.cache.free) == list(range(eng.cache.num_blocks))
    assert all(s >= len(st.rows) for s in eng.cache.free)


def staggered(model, ps, samplings, every=2, abort=(), chunk=8, burst=1, **kw):
    eng = Engine(model, max_batch=5, max_waiting=64, chunk=chunk, max_len=80, **kw)
    reqs = [Request(p, s) for p, s in zip(ps, samplings)]
    pending, steps = list(reqs), 0
    while pending or eng.has_work():
        if pending and steps % every == 0:
            eng.add(*pending[:burst])
            pending = pending[burst:]
        for i in abort:
            if steps == 6 + 3 * i:
                eng.abort(reqs[i])
        eng.step()
        if eng.static is not None:
            check_slots(eng)
        steps += 1
    return [r.output for r in reqs]


def test_buckets():
    assert batch_buckets(1) == [1] and batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]
    assert batch_buckets(256)[-3:] == [192, 224, 256]
    assert span_buckets(64) == [64] and span_buckets(50) == [50] and span_buckets(1024) == [64, 128, 256, 512, 1024]
    assert span_buckets(192) == [64, 128, 192]


def test_greedy_and_seeded_tokens_equal_the_paged_path(model):
    ps = prompts(12)
    greedy = [Sampling(max_new_tokens=int(n))
              for n in torch.randint(1, 30, (12,), generator=torch.Generator().manual_seed(1))]
    seeded = [Sampling(max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.9, seed=i, presence_penalty=0.3)
              for i in range(12)]
    for samplings in (greedy, seeded):
        want = staggered(model, ps, samplings, static_decode=False)
        assert staggered(model, ps, samplings, static_decode=True) == want
        assert staggered(model, ps, samplings, abort=(2, 5), static_decode=True)[6:] == want[6:]


@pytest.mark.parametrize("chunk,every,burst", [(8, 1, 1), (64, 4, 4)])
def test_every_step_logits_are_the_whole_sequence_forward(model, monkeypatch, chunk, every, burst):
    """Each decoding row's logits equal a plain forward of its whole sequence (fp32 tolerance), through slot
    moves (rows finishing, joining), padded batch buckets and span buckets; the first token's too, prefilled in
    chunks (8: most continue a prompt, packed) or whole (64, four prompts a time: prompts of different lengths
    from their start as padded batches, Engine.prefill_fresh, several at once and cut into groups)."""
    worst, picked = [0.0], engine_mod.next_tokens

    def spy(logits, rows, gen):
        with torch.no_grad():
            for i, r in enumerate(rows):
                ref = model(torch.tensor([r.prompt + r.output]))[0, -1]
                worst[0] = max(worst[0], (ref - logits[i]).abs().max().item())
        return picked(logits, rows, gen)

    monkeypatch.setattr(engine_mod, "next_tokens", spy)
    monkeypatch.setattr(static_mod, "MAX_BURST", 0)  # every step's logits through the sampler
    ps = prompts(10, seed=3, hi=60)
    staggered(model, ps, [Sampling(max_new_tokens=18)] * 10, every=every, chunk=chunk, burst=burst,
              static_decode=True)
    assert 0 < worst[0] < 2e-5


def test_greedy_bursts_give_the_single_steps_tokens(model, monkeypatch):
    """Greedy rows run up to MAX_BURST steps with no host work between them (StaticDecoder.steps): the same tokens
    as one step at a time and as the paged path, with rows ending midway at EOS, at a stop string's token, at
    max_new_tokens, or aborted, and prompts joining between bursts."""
    ps = prompts(12, seed=5)
    first = staggered(model, ps, [Sampling(max_new_tokens=30)] * 12, static_decode=False)
    common = max(range(512), key=lambda t: sum(o[3:].count(t) for o in first))  # a token many rows reach
    lengths = torch.randint(1, 30, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    samplings = [Sampling(max_new_tokens=n, eos_token_id=common if i % 3 else None,
                          stop_token_ids=[common] if i % 3 == 0 and i % 2 else []) for i, n in enumerate(lengths)]
    want = staggered(model, ps, samplings, static_decode=False)
    assert any(len(w) < n for w, n in zip(want, lengths))  # some end early
    bursts = []
    real = StaticDecoder.steps
    monkeypatch.setattr(StaticDecoder, "steps", lambda self, k: bursts.append(k) or real(self, k))
    assert staggered(model, ps, samplings, static_decode=True) == want
    assert staggered(model, ps, samplings, every=6, abort=(2, 5), static_decode=True)[6:] == want[6:]
    assert max(bursts) == static_mod.MAX_BURST and 1 in bursts
    monkeypatch.setattr(static_mod, "MAX_BURST", 0)
    assert staggered(model, ps, samplings, static_decode=True) == want


def test_bursts_cross_span_buckets_and_their_logits_are_the_whole_sequences(model, monkeypatch):
    """Without the GPU's kernel a step reads keys up to a span bucket (64, 128, max_len): a burst takes the bucket
    its last step needs. Prompts of 50-63 tokens and 30 new cross 64 inside bursts; the tokens equal the paged
    path's, and every burst step's logits (captured as they come) a plain forward of the whole sequence."""
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(1, 512, (int(n),), generator=g).tolist() for n in torch.randint(50, 64, (6,), generator=g)]
    s = Sampling(max_new_tokens=30)
    run = lambda **kw: [r.output for r in Engine(model, max_batch=6, max_len=200, **kw).run(  # noqa: E731
        [Request(p, s) for p in ps])]
    want = run(static_decode=False)
    seen, real_steps, real_run = [], StaticDecoder.steps, StaticDecoder._run

    def steps(self, k):
        seen.append([(r, len(r.output)) for r in self.rows] + [[]])
        return real_steps(self, k)

    def run_once(self, B, span):
        logits = real_run(self, B, span)
        if seen:
            seen[-1][-1].append((span, logits[:len(self.rows)].clone()))
        return logits

    monkeypatch.setattr(StaticDecoder, "steps", steps)
    monkeypatch.setattr(StaticDecoder, "_run", run_once)
    assert run(static_decode=True) == want
    spans, worst = set(), 0.0
    with torch.no_grad():
        for *rows, outs in seen:
            for j, (span, logits) in enumerate(outs):
                spans.add(span)
                for i, (r, n) in enumerate(rows):
                    ref = model(torch.tensor([r.prompt + r.output[:n + j]]))[0, -1]
                    worst = max(worst, (ref - logits[i]).abs().max().item())
    assert {64, 128} <= spans and 0 < worst < 2e-5


def test_a_full_batch_with_requests_waiting_steps_one_token_at_a_time(model):
    """A request waiting for a slot gets it at the step a row ends, as on the paged path (a burst would keep the
    slot of a row that ended at EOS midway until the burst's end): the same steps, token for token, until the
    waiting request's first token (then nothing waits, and bursts may go on)."""
    ps = [[5, 6, 7], [9, 10], [12, 13, 14]]
    free = Engine(model, max_batch=3, max_len=80).run([Request(p, Sampling(max_new_tokens=20)) for p in ps])
    ss = [Sampling(max_new_tokens=20, stop_token_ids=[free[0].output[3]])] + [Sampling(max_new_tokens=20)] * 2

    def timeline(**kw):
        eng, reqs, steps = Engine(model, max_batch=2, max_len=80, **kw), [Request(p, s) for p, s in zip(ps, ss)], []
        eng.add(*reqs)
        while not reqs[2].output:
            steps.append([(ev.request.id - reqs[0].id, ev.id) for ev in eng.step()])
        return steps

    assert timeline(static_decode=True) == timeline(static_decode=False)


def test_an_abort_during_a_burst_sends_no_more_tokens(model, monkeypatch):
    """abort() from another thread while a burst runs: the row's tokens of that burst are not sent."""
    eng = Engine(model, max_batch=2, max_len=80, static_decode=True)
    reqs = [Request([5, 6, 7], Sampling(max_new_tokens=30)), Request([9, 10], Sampling(max_new_tokens=30))]
    eng.add(*reqs)
    eng.step()
    real = eng.static.steps
    eng.static.steps = lambda k: (eng.abort(reqs[0]), real(k))[1]
    events = eng.step()
    assert len(reqs[0].output) == 1 and len(reqs[1].output) == 1 + static_mod.MAX_BURST
    assert all(ev.request is reqs[1] for ev in events)
    events = eng.step()
    assert reqs[0].finish_reason == "abort" and len(reqs[0].output) == 1


def test_the_padded_prefill_attends_the_keys_as_the_cache_holds_them(monkeypatch):
    """An fp16 KV cache under an fp32 model: the padded-batch prefill attends its keys rounded to fp16, as the
    cache gives them to every later step and to the packed prefill (first tokens' logits as close as two attention
    kernels get)."""
    model = load_model("random:tiny:3", precision=None).eval()
    model.kv_dtype = torch.float16
    ps = prompts(6, seed=8, hi=30)
    got = {}

    def spy(name):
        def pick(logits, rows, gen):
            for r, row in zip(rows, logits):
                got.setdefault(name, {})[tuple(r.prompt)] = row.clone()
            return next_tokens(logits, rows, gen)
        return pick

    next_tokens = engine_mod.next_tokens
    for name, fresh in (("fresh", True), ("packed", False)):
        monkeypatch.setattr(engine_mod, "next_tokens", spy(name))
        eng = Engine(model, max_batch=6, max_len=80, static_decode=True)
        eng.fresh_prefill = fresh
        calls = []
        real = eng.prefill_fresh
        eng.prefill_fresh = lambda chunks, calls=calls, real=real: calls.append(len(chunks)) or real(chunks)
        eng.run([Request(p, Sampling(max_new_tokens=1)) for p in ps])
        assert bool(calls) == fresh
    assert len(got["fresh"]) == len(ps)
    # other attention kernels (the CPU's causal one, SDPA under a mask): 5.7e-5 apart; unrounded keys: 1.5e-3
    assert max((got["fresh"][p] - got["packed"][p]).abs().max().item() for p in got["packed"]) < 3e-4


def test_a_row_ending_midway_through_a_burst_leaves_the_others_keys(model):
    """Row 0 stops at step 7 of a burst of 8: its slot goes to the last row, whose keys the burst wrote one step
    further than its tokens emitted so far; the move copies them too (the last row's tokens equal the paged
    path's), for every step a row can stop at."""
    ps = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    free = [r.output for r in Engine(model, max_batch=3, max_len=80).run([Request(p, Sampling(max_new_tokens=30))
                                                                          for p in ps])]
    ran = 0
    for at in range(2, 9):
        stop = free[0][at]
        if stop in free[0][:at]:
            continue
        ran += 1
        ss = [Sampling(max_new_tokens=30, stop_token_ids=[stop])] + [Sampling(max_new_tokens=30)] * 2
        want = [r.output for r in Engine(model, max_batch=3, max_len=80).run([Request(p, s) for p, s in zip(ps, ss)])]
        got = Engine(model, max_batch=3, max_len=80, static_decode=True).run([Request(p, s) for p, s in zip(ps, ss)])
        assert len(want[0]) == at + 1 and [r.output for r in got] == want
    assert ran


def test_generate_and_stream_give_every_token_of_a_burst(model, monkeypatch):
    """gpt2ffn.generate / stream over an engine that bursts (a GPU's default, forced here): every token, in order,
    one per prompt a time (a burst's step made several per prompt: stream kept only the last, on a GPU)."""
    gen = importlib.import_module("gpt2ffn.generate")  # the module (the package's `generate` is the function)
    ps = prompts(5, seed=9)
    s = Sampling(max_new_tokens=20)
    want = gen.generate(model, ps, s)  # the CPU's default engine: no bursts
    real, bursts = gen.engine_for, []
    monkeypatch.setattr(gen, "engine_for", lambda *a: make_bursting(real(*a), bursts))
    assert gen.generate(model, ps, s) == want and max(bursts) == static_mod.MAX_BURST
    steps = list(gen.stream(model, ps, s))
    assert len(steps) == 20 and [[t[i] for t in steps] for i in range(5)] == want


def kernel_runs_or_skip(available):
    """Skip where Triton is not installed; where it is, the kernel's probe must pass (a kernel that fails to build
    or answers wrong on the GPU is a failure here, not a quiet fallback)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("no Triton on this CUDA install")
    assert available("cuda"), "Triton is installed but the kernel's probe failed on this GPU"


def make_bursting(engine, bursts):
    """engine with static decode (slots, bursts) as on a GPU, counting its bursts."""
    e = Engine(engine.model, max_batch=engine.max_batch, max_waiting=engine.max_waiting, max_len=engine.max_len,
               static_decode=True)
    real = e.static.steps
    e.static.steps = lambda k: bursts.append(k) or real(k)
    return e


def test_prefill_budget():
    """On CUDA prompts in their slots take 8192 tokens a step (offline batches 32768); chunks packed under a mask
    (its (T, T) bools grow as the square) 2048; the CPU 128. An engine's own choice wins."""
    budget = engine_mod.prefill_budget
    assert budget("cpu", True, True) == budget("cpu", False, False) == engine_mod.CHUNK == 128
    assert budget("cuda", True, False) == engine_mod.CUDA_CHUNK == 8192
    assert budget("cuda:0", True, True) == engine_mod.OFFLINE_CUDA_CHUNK == 32768
    assert budget("cuda", False, True) == engine_mod.PACKED_CUDA_CHUNK == 2048
    model = load_model("random:tiny:3", precision=None).eval()
    assert Engine(model, static_decode=True, offline=True).chunk == 128
    assert Engine(model, static_decode=True, chunk=40).chunk == 40


def test_pad_groups():
    chunks = [(None, 0, n) for n in (10, 60, 50, 9, 58, 1, 12)]
    groups = engine_mod.pad_groups(chunks)
    assert [[n for _, _, n in g] for g in groups] == [[60, 58, 50], [12, 10, 9], [1]]
    for g in groups:
        assert len(g) * g[0][2] <= 1.25 * sum(n for _, _, n in g) or len(g) == 1


def test_defaults_and_logprobs(model):
    # on the CPU the default is the paged path (the packed model's native decode when it has one)
    assert Engine(model, max_batch=2).static is None
    eng = Engine(model, max_batch=3, static_decode=True)
    assert eng.static is not None and eng.cache.block_size == eng.max_len and eng.graph_capture is None
    s = Sampling(max_new_tokens=5, logprobs=2, prompt_logprobs=1)
    got = eng.run([Request([5, 6, 7, 8], s), Request([9, 10], s)])
    want = Engine(model, max_batch=3, static_decode=False).run([Request([5, 6, 7, 8], s), Request([9, 10], s)])
    assert [r.output for r in got] == [r.output for r in want]
    assert [len(r.prompt_logprobs) for r in got] == [4, 2]
    assert eng.counts() == (0, 0, 0) and eng.static.rows == []
    inv = Engine(model, static_decode=True, batch_invariant=True)  # one row a step, each in its own slot
    assert inv.static.each_row and inv.static.buckets == [1] and not inv.fresh_prefill


def test_cuda_graph_seconds_is_checked(capsys):
    from gpt2ffn.cli import main
    assert main(["serve", "--model", "random:tiny", "--cuda-graph-seconds", "-1"]) == 2
    assert "--cuda-graph-seconds must be >= 0, got -1.0" in capsys.readouterr().err


def test_bench_batch_sizes_are_for_cuda(capsys):
    from gpt2ffn.cli import main
    assert main(["bench", "--model", "--batch", "32", "--weights", "random:tiny"]) == 2
    assert "--batch is for --model --device cuda" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_replay_the_eager_steps(hf_dir, dtype, monkeypatch):
    """On a GPU: the shapes captured at start-up and on first use, the replayed steps give the eager steps'
    tokens, greedy and seeded; in fp32 with TF32 off the greedy tokens are HF's on the same card."""
    from transformers import GPT2LMHeadModel
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = load_model(str(hf_dir), dtype=dtype, precision=None).to("cuda").eval()
    V, n = model.config.vocab_size, model.config.n_positions                 # the small checkpoint: 96, 32
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, V, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(40)]
    s = [Sampling(max_new_tokens=n - 9)] * 20 + [Sampling(max_new_tokens=n - 9, temperature=1.0, seed=i)
                                                 for i in range(20)]
    graphs = Engine(model, max_batch=40, max_len=n)
    assert graphs.static is not None and graphs.graph_capture[0] == graphs.graph_capture[1] > 0
    lazy = Engine(model, max_batch=40, max_len=n, graph_seconds=0)
    eager = Engine(model, max_batch=40, max_len=n, cuda_graphs=False)
    assert lazy.graph_capture is None and not eager.static.use_graphs
    got = [r.output for r in graphs.run([Request(p, x) for p, x in zip(ps, s)])]
    assert got == [r.output for r in lazy.run([Request(p, x) for p, x in zip(ps, s)])]
    assert lazy.static.graphs and all(g is not None for g in lazy.static.graphs.values())
    assert got == [r.output for r in eager.run([Request(p, x) for p, x in zip(ps, s)])]
    if dtype == torch.float32:
        hf = GPT2LMHeadModel.from_pretrained(hf_dir).to("cuda").eval()
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            for p, out in zip(ps[:4], got):
                want = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=n - 9, do_sample=False,
                                   pad_token_id=0)[0, len(p):].tolist()
                assert out == want


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,cache_dtype,D", [(torch.float32, torch.float32, 64),
                                                  (torch.bfloat16, torch.bfloat16, 64),
                                                  (torch.float32, torch.float16, 48)])
@pytest.mark.parametrize("block", ["default", "wide"])
def test_decode_attention_kernel_writes_and_attends(dtype, cache_dtype, D, block):
    """On a GPU: kernels/decode_attention.py writes each row's new key and value at its position of its slot and
    nothing else, and its output is softmax(q k^T) v over keys 0..position of the slot, computed in float64
    (rows from position 0, across a 64-key block edge, to the cache's last position), in both configurations
    (the default's blocks of keys, the wide one's for few programs)."""
    import math

    from gpt2ffn.kernels.decode_attention import available, decode_attention
    kernel_runs_or_skip(available)
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, L = 6, 3, 200
    kc = torch.randn(B + 2, H, L, D, device="cuda", generator=g).to(cache_dtype)
    vc = torch.randn(B + 2, H, L, D, device="cuda", generator=g).to(cache_dtype)
    qkv = torch.randn(B, 1, 3 * H * D, device="cuda", generator=g).to(dtype)
    q, k, v = [t.view(B, 1, H, D).transpose(1, 2) for t in qkv.split(H * D, 2)]
    pos = torch.tensor([0, 1, 63, 64, 130, L - 1], device="cuda")
    k0, v0 = kc.clone(), vc.clone()
    out = decode_attention(q, k, v, kc, vc, pos, block=block)
    assert out.shape == (B, 1, H * D) and out.dtype == dtype
    for b in range(B):
        p = int(pos[b])
        for pool, old, new in ((kc, k0, k), (vc, v0, v)):
            want = old[b].clone()
            want[:, p] = new[b, :, 0].to(cache_dtype)
            assert torch.equal(pool[b], want)
        K, V = kc[b, :, :p + 1].double(), vc[b, :, :p + 1].double()
        s = (q[b, :, 0].double()[:, None] * K).sum(-1) / math.sqrt(D)
        want = (s.softmax(-1)[:, :, None] * V).sum(1).reshape(-1)
        err = ((out[b, 0].double() - want).norm() / want.norm()).item()
        assert err < (1e-6 if dtype == torch.float32 else 8e-3), (b, err)
    assert torch.equal(kc[B:], k0[B:]) and torch.equal(vc[B:], v0[B:])
    # a padding row (past 0) reads no key of its slot: its output is its own new value
    lone = decode_attention(q, k, v, kc, vc, pos, past=torch.zeros_like(pos), block=block)
    want = v[:, :, 0].to(cache_dtype).to(dtype).reshape(B, 1, H * D)
    torch.testing.assert_close(lone, want, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)
    # rows in other slots (batch-invariant mode's one row in its own slot): the same output, written there
    slots = torch.tensor([7, 0, 5, 2, 6, 1], device="cuda")
    moved_k, moved_v = k0.clone(), v0.clone()
    moved_k[slots], moved_v[slots] = k0[:B], v0[:B]
    km, vm = moved_k.clone(), moved_v.clone()
    again = decode_attention(q, k, v, km, vm, pos, slots=slots, block=block)
    assert torch.equal(again, out)
    assert torch.equal(km[slots], kc[:B]) and torch.equal(vm[slots], vc[:B])
    rest = torch.tensor([s for s in range(B + 2) if s not in slots.tolist()], device="cuda")
    assert torch.equal(km[rest], moved_k[rest]) and torch.equal(vm[rest], moved_v[rest])


@pytest.mark.cuda
def test_decode_attention_kernel_gives_the_sdpa_steps_tokens(hf_dir, monkeypatch):
    """On a GPU, fp32 with TF32 off: the engine's decode steps through the Triton kernel give the tokens of the
    same steps through SDPA under a mask (greedy and seeded)."""
    from gpt2ffn.kernels.decode_attention import available
    from gpt2ffn.serving import static
    kernel_runs_or_skip(available)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = load_model(str(hf_dir), dtype=torch.float32, precision=None).to("cuda").eval()
    V, n = model.config.vocab_size, model.config.n_positions
    g = torch.Generator().manual_seed(7)
    ps = [torch.randint(0, V, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(24)]
    s = [Sampling(max_new_tokens=n - 9)] * 12 + [Sampling(max_new_tokens=n - 9, temperature=1.0, seed=i)
                                                 for i in range(12)]
    fused = Engine(model, max_batch=24, max_len=n)
    assert fused.static.attends
    got = [r.output for r in fused.run([Request(p, x) for p, x in zip(ps, s)])]
    monkeypatch.setattr(static, "DECODE_ATTENTION", "sdpa")
    sdpa = Engine(model, max_batch=24, max_len=n)
    assert not sdpa.static.attends
    assert got == [r.output for r in sdpa.run([Request(p, x) for p, x in zip(ps, s)])]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_bursts_give_the_single_steps_tokens(hf_dir, dtype, monkeypatch):
    """On a GPU: greedy rows in bursts of replayed graphs (each step's argmax fed to the next on the device) give
    the tokens of one replay at a time through the sampler, bitwise (the same graphs: the rows end together, so
    the batch buckets are the same, and with the Triton kernel every span is max_len), and (fp32) the
    padded-batch prefill's first tokens are the packed prefill's."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = load_model(str(hf_dir), dtype=dtype, precision=None).to("cuda").eval()
    V, n = model.config.vocab_size, model.config.n_positions
    g = torch.Generator().manual_seed(11)
    ps = [torch.randint(0, V, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(20)]
    s = Sampling(max_new_tokens=n - 9)
    bursts = []
    real = StaticDecoder.steps
    monkeypatch.setattr(StaticDecoder, "steps", lambda self, k: bursts.append(k) or real(self, k))
    engine = Engine(model, max_batch=20, max_len=n)
    if not engine.static.attends:
        pytest.skip("no Triton decode kernel here: a burst's span bucket is not a single step's")
    got = [r.output for r in engine.run([Request(p, s) for p in ps])]
    assert max(bursts) == min(static_mod.MAX_BURST, n - 9 - 1)
    monkeypatch.setattr(static_mod, "MAX_BURST", 0)
    assert got == [r.output for r in Engine(model, max_batch=20, max_len=n).run([Request(p, s) for p in ps])]
    if dtype == torch.bfloat16:  # other kernels and shapes: a near tie may round the other way
        return
    packed = Engine(model, max_batch=20, max_len=n)
    packed.fresh_prefill = False
    firsts = [r.output[0] for r in packed.run([Request(p, Sampling(max_new_tokens=1)) for p in ps])]
    assert firsts == [o[0] for o in got]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_add_and_normalize_in_one_kernel_on_cuda(hf_dir, dtype, monkeypatch):
    """On a GPU a decode step adds each sublayer's output to the residual stream and normalizes the sum in one
    kernel (kernels/add_layer_norm.py, GPT2.decode_blocks): every step's logits as the two ops' (fp32 without
    TF32: 1e-5; bf16: its rounding), the same greedy tokens in fp32."""
    import gpt2ffn.kernels.add_layer_norm as aln
    kernel_runs_or_skip(aln.available)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(static_mod, "MAX_BURST", 0)  # every step's logits through the sampler
    model = load_model(str(hf_dir), dtype=dtype, precision=None).to("cuda").eval()
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(0, 96, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(6)]
    seen, real = {}, engine_mod.next_tokens

    def run(name):
        def record(logits, rows, gen):
            seen.setdefault(name, []).append(logits.float().clone())
            return real(logits, rows, gen)
        monkeypatch.setattr(engine_mod, "next_tokens", record)
        return [r.output for r in Engine(model, max_batch=6, max_len=32).run([Request(p, Sampling(max_new_tokens=12))
                                                                            for p in ps])]
    calls, kernel = [], aln.add_layer_norm
    monkeypatch.setattr(aln, "add_layer_norm", lambda *a: calls.append(1) or kernel(*a))
    fused = run("fused")
    assert calls  # the decode steps went through the kernel
    monkeypatch.setattr(aln, "available", lambda device: False)
    plain = run("plain")
    if dtype == torch.float32:
        assert fused == plain
    # the sampler calls up to the first token that differs (bf16 near ties) had the same inputs in both runs
    same = min(next((i for i, (a, b) in enumerate(zip(f, p)) if a != b), len(f)) for f, p in zip(fused, plain))
    worst = max((a - b).abs().max().item() for a, b in zip(seen["fused"][:same + 1], seen["plain"][:same + 1]))
    assert same >= 1 and worst < (1e-5 if dtype == torch.float32 else 0.1), (same, worst)


@pytest.mark.cuda
def test_lm_head_pads_its_weight_on_cuda(hf_dir):
    """On a GPU, for inference: the lm_head computes through a copy of its weight padded to 64 rows (an odd
    vocabulary gives cuBLAS an unaligned kernel), the same logits as the unpadded weight, and a changed weight is
    copied again into the same memory."""
    import torch.nn.functional as F
    model = load_model(str(hf_dir), dtype=torch.float32, precision=None).to("cuda").eval()
    head, x = model.lm_head, torch.randn(5, model.config.n_embd, device="cuda")
    V = head.weight.shape[0]
    with torch.no_grad():
        padded = head.padded_weight(x)
        assert padded.shape[0] % 64 == 0 and torch.equal(padded[:V], head.weight) and not padded[V:].any()
        y = head(x)
        assert y.shape == (5, V)
        torch.testing.assert_close(y, F.linear(x, head.weight), rtol=1e-5, atol=1e-5)
        head.weight.mul_(2)
        torch.testing.assert_close(head(x), 2 * y, rtol=1e-5, atol=1e-5)
        assert head.padded_weight(x) is padded  # refreshed in place: graphs captured before read the new values
    assert head.padded_weight(x.cpu()) is None
