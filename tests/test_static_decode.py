"""Decode steps of fixed shapes over slots (serving/static.py): the sequences that decode kept in slots 0..D-1,
each step one (batch bucket, span bucket) shape, so that a GPU replays it as a CUDA graph. On the CPU the same
steps run eagerly: the tokens and logits must be the paged path's, whatever joins, finishes or is aborted."""

import pytest
import torch

import gpt2ffn.serving.engine as engine_mod
from gpt2ffn.errors import Gpt2ffnError
from gpt2ffn.generate import load
from gpt2ffn.model import load_model
from gpt2ffn.serving.engine import Engine, Request
from gpt2ffn.serving.sampling import Sampling
from gpt2ffn.serving.static import batch_buckets, span_buckets


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


def staggered(model, ps, samplings, every=2, abort=(), **kw):
    eng = Engine(model, max_batch=5, max_waiting=64, chunk=8, max_len=80, **kw)
    reqs = [Request(p, s) for p, s in zip(ps, samplings)]
    pending, steps = list(reqs), 0
    while pending or eng.has_work():
        if pending and steps % every == 0:
            eng.add(pending.pop(0))
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
    greedy = [Sampling(max_new_tokens=int(n)) for n in torch.randint(1, 30, (12,), generator=torch.Generator().manual_seed(1))]
    seeded = [Sampling(max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.9, seed=i, presence_penalty=0.3)
              for i in range(12)]
    for samplings in (greedy, seeded):
        want = staggered(model, ps, samplings, static_decode=False)
        assert staggered(model, ps, samplings, static_decode=True) == want
        assert staggered(model, ps, samplings, abort=(2, 5), static_decode=True)[6:] == want[6:]


def test_every_step_logits_are_the_whole_sequence_forward(model, monkeypatch):
    """Each decoding row's logits equal a plain forward of its whole sequence (fp32 tolerance), through slot
    moves (rows finishing, joining), padded batch buckets and span buckets."""
    worst, picked = [0.0], engine_mod.next_tokens

    def spy(logits, rows, gen):
        with torch.no_grad():
            for i, r in enumerate(rows):
                ref = model(torch.tensor([r.prompt + r.output]))[0, -1]
                worst[0] = max(worst[0], (ref - logits[i]).abs().max().item())
        return picked(logits, rows, gen)

    monkeypatch.setattr(engine_mod, "next_tokens", spy)
    ps = prompts(10, seed=3, hi=60)
    staggered(model, ps, [Sampling(max_new_tokens=18)] * 10, every=1, static_decode=True)
    assert 0 < worst[0] < 2e-5


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
    with pytest.raises(Gpt2ffnError, match="cannot be batch-invariant"):
        Engine(model, static_decode=True, batch_invariant=True)


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
    s = [Sampling(max_new_tokens=n - 9)] * 20 + [Sampling(max_new_tokens=n - 9, temperature=1.0, seed=i) for i in range(20)]
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
@pytest.mark.parametrize("dtype,cache_dtype,D", [(torch.float32, torch.float32, 64), (torch.bfloat16, torch.bfloat16, 64),
                                                  (torch.float32, torch.float16, 48)])
def test_decode_attention_kernel_writes_and_attends(dtype, cache_dtype, D):
    """On a GPU: kernels/decode_attention.py writes each row's new key and value at its position of its slot and
    nothing else, and its output is softmax(q k^T) v over keys 0..position of the slot, computed in float64
    (rows from position 0, across a 64-key block edge, to the cache's last position)."""
    import math

    from gpt2ffn.kernels.decode_attention import available, decode_attention
    if not available("cuda"):
        pytest.skip("no Triton on this CUDA install")
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, L = 6, 3, 200
    kc = torch.randn(B + 2, H, L, D, device="cuda", generator=g).to(cache_dtype)
    vc = torch.randn(B + 2, H, L, D, device="cuda", generator=g).to(cache_dtype)
    qkv = torch.randn(B, 1, 3 * H * D, device="cuda", generator=g).to(dtype)
    q, k, v = [t.view(B, 1, H, D).transpose(1, 2) for t in qkv.split(H * D, 2)]
    pos = torch.tensor([0, 1, 63, 64, 130, L - 1], device="cuda")
    k0, v0 = kc.clone(), vc.clone()
    out = decode_attention(q, k, v, kc, vc, pos)
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
    lone = decode_attention(q, k, v, kc, vc, pos, past=torch.zeros_like(pos))
    want = v[:, :, 0].to(cache_dtype).to(dtype).reshape(B, 1, H * D)
    torch.testing.assert_close(lone, want, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.cuda
def test_decode_attention_kernel_gives_the_sdpa_steps_tokens(hf_dir, monkeypatch):
    """On a GPU, fp32 with TF32 off: the engine's decode steps through the Triton kernel give the tokens of the
    same steps through SDPA under a mask (greedy and seeded)."""
    from gpt2ffn.kernels.decode_attention import available
    from gpt2ffn.serving import static
    if not available("cuda"):
        pytest.skip("no Triton on this CUDA install")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = load_model(str(hf_dir), dtype=torch.float32, precision=None).to("cuda").eval()
    V, n = model.config.vocab_size, model.config.n_positions
    g = torch.Generator().manual_seed(7)
    ps = [torch.randint(0, V, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(24)]
    s = [Sampling(max_new_tokens=n - 9)] * 12 + [Sampling(max_new_tokens=n - 9, temperature=1.0, seed=i) for i in range(12)]
    fused = Engine(model, max_batch=24, max_len=n)
    assert fused.static.attends
    got = [r.output for r in fused.run([Request(p, x) for p, x in zip(ps, s)])]
    monkeypatch.setattr(static, "DECODE_ATTENTION", "sdpa")
    sdpa = Engine(model, max_batch=24, max_len=n)
    assert not sdpa.static.attends
    assert got == [r.output for r in sdpa.run([Request(p, x) for p, x in zip(ps, s)])]


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
