"""Weight precisions: every precision and kernel route against the numpy reference, packed weights never
stale, weights held once (state_dict in HF's layout from the packed copy, train() and autograd), batch
invariance of the native kernels, and the whole GPT-2 against HF."""

import contextlib
import copy
import types

import numpy as np
import pytest
import torch

from conftest import SMALL, hf_model, randomize_
from gpt2ffn import Config, ConfigError, FeedForward, PackedOnlyError, quantize, reference
from gpt2ffn.kernels import packed as kp
from gpt2ffn.kernels.formats import PRECISIONS, dequantize, quantize_groups
from gpt2ffn.model import GPT2
from gpt2ffn.tolerances import PRECISION_TOLERANCES

# The GPT-2 width, and an odd FFN (hidden not 4d, no width a default group divides).
SHAPES = [Config(n_embd=768), Config(n_embd=200, n_inner=600, n_head=8)]


def ffn_for(cfg, seed=0):
    return randomize_(FeedForward(cfg), seed).eval()


def round_to(w, precision, group):
    """The float32 values a weight (K, N) computes with at `precision`."""
    if precision == "bf16":
        return w.to(torch.bfloat16).float()
    if precision in ("int8", "int4"):
        return dequantize(*quantize_groups(w, precision, group), precision)
    return w


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("K, N", [(1600, 6400), (96, 200), (2048, 50)], ids=lambda v: str(v))
def test_weights_quantize_in_chunks_to_the_whole_tensors_bits(precision, K, N):
    """quantize_groups runs a few groups' rows at a time through one buffer (GPT-2 xl's int8 load 22.7-24.8 ->
    16.2-17.0 s on an AMD EPYC Zen 3): its q and scales equal the whole-tensor operations bit for bit, one row of
    groups per chunk (N = 6400), many (N = 200) and a last chunk shorter than the rest (N = 50), with an all-zero
    group, a -0 one, a subnormal one, and int4's ties of +m and -m (its scale is the first; read without argmax
    where there is no tie: GPT-2 xl's int4 load 29.9-41.8 -> 21.6-22.6 s)."""
    w = torch.randn(K, N, generator=torch.Generator().manual_seed(K + N)) * 0.02
    w[:32, :3] = 0
    w[32:64, 3] = 1e-40
    w[32:64, 4] = -0.0  # a group of -0 (its scale's sign is a bit of the packed layout)
    w[64:96, 5:7] = 0
    w[70, 5], w[80, 5], w[70, 6], w[80, 6] = 0.5, -0.5, -0.5, 0.5  # int4's scale: the first of +m / -m
    wg = w.view(K // 32, 32, N)
    if precision == "int8":
        scale = (wg.abs().amax(dim=1) / 127).half().float()
        q = torch.round(wg / torch.where(scale == 0, 1.0, scale)[:, None]).clamp_(-127, 127)
    else:
        scale = (wg.gather(1, wg.abs().argmax(dim=1, keepdim=True))[:, 0] / -8).half().float()
        q = torch.round(wg / torch.where(scale == 0, 1.0, scale)[:, None] + 8).clamp_(0, 15)
    got_q, got_scale = quantize_groups(w, precision, 32)
    assert got_q.dtype == torch.int8 and got_scale.dtype == torch.float32
    assert torch.equal(got_q, q.view(K, N).to(torch.int8))
    assert torch.equal(got_scale.view(torch.int32), scale.view(torch.int32))  # bits, the sign of 0 too



def plain_layout(w, bias, precision, activations):
    """(w, scale, bias) as Packed made them with whole-tensor operations (pad by cat, permute, contiguous, each in
    fresh memory): what Packed now writes straight into its final memory must be these bytes."""
    K = w.shape[0]

    def blocks(x, fill=0):
        x = torch.cat([x, x.new_full((x.shape[0], -x.shape[1] % 64), fill)], dim=1)
        return x.view(x.shape[0], -1, 64).permute(1, 0, 2).contiguous()

    b = torch.cat([bias, bias.new_zeros(-len(bias) % 64)]) if bias is not None else None
    if precision == "fp32":
        return blocks(w), None, b
    if precision == "bf16":
        return blocks(w.to(torch.bfloat16).view(torch.int16)), None, b
    q, s = quantize_groups(w, precision, 32 if K % 32 == 0 else 8)
    scale = blocks(s.half(), fill=0.0)
    if activations == "int8" and precision == "int8":
        u = blocks((q.to(torch.int16) + 128).to(torch.uint8), fill=128)
        return u.view(-1, K // 4, 4, 64).transpose(2, 3).contiguous(), scale, b
    if activations == "int8":
        u = blocks(q.to(torch.uint8), fill=8).view(-1, K // 8, 2, 4, 64)
        return (u[:, :, 0] | (u[:, :, 1] << 4)).transpose(2, 3).contiguous(), scale, b
    if precision == "int8":
        return blocks(q), scale, b
    qb = blocks(q, fill=8).view(-1, K // 2, 2, 64).to(torch.uint8)
    return (qb[:, :, 0] | (qb[:, :, 1] << 4)).contiguous(), scale, b


def same_bytes(a, b):
    """a and b hold the same bytes (a contiguous), but for a NaN's payload in bf16: torch's own float -> bf16
    conversion writes 0x7FC0 or 0xFFFF for the same NaN, by the source's strides."""
    if a.dtype != b.dtype or a.shape != b.shape or not a.is_contiguous():
        return False
    if a.dtype == torch.int16:
        nan = a.view(torch.bfloat16).isnan()
        if not torch.equal(nan, b.view(torch.bfloat16).isnan()):
            return False
        a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("precision, activations", [("fp32", "fp32"), ("bf16", "fp32"), ("int8", "fp32"),
                                                    ("int4", "fp32"), ("int8", "int8"), ("int4", "int8")])
@pytest.mark.parametrize("arena", [False, True], ids=["alone", "arena"])
def test_packed_layout_written_in_place_is_the_plain_layouts_bytes(precision, activations, arena):
    """Packed writes each layer's final tensors once, straight where they will live (on huge pages, in quantize's
    arena), the pad and a float conversion in the same copy: the bytes are those of the whole-tensor operations
    it used (GPT-2 xl's fp32 load 19.9-40.9 -> 9.7-11.3 s on an AMD EPYC Zen 3). N = 100, 1 and 200 take a padded
    super-block, 128 none; a transposed weight, a NaN and a -0 keep their bits; a control whose pad differs fails."""
    from gpt2ffn.kernels.formats import Packed, packing_arena
    gen = torch.Generator().manual_seed(3)
    for K, N, transposed in [(96, 100, False), (64, 128, True), (256, 1, False), (160, 200, False)]:
        w = torch.randn(N, K, generator=gen).t() if transposed else torch.randn(K, N, generator=gen) * 0.02
        if precision in ("fp32", "bf16"):
            w[0, 0], w[1, 0] = float("nan"), -0.0
        bias = torch.randn(N, generator=gen) if N > 1 else None
        with packing_arena() if arena else contextlib.nullcontext():
            p = Packed(w, bias, precision, group=32 if K % 32 == 0 else 8, activations=activations)
        want = plain_layout(w, bias, precision, activations)
        for got, ref in zip((p.w, p.scale, p.bias), want):
            assert (got is None) == (ref is None) and (ref is None or same_bytes(got, ref)), (K, N, precision)
        if N % 64:  # the control: the same comparison with the padded lanes changed fails
            bad = want[0].clone()
            bad.view(torch.uint8)[-1, -1, -1] ^= 1
            assert not same_bytes(p.w, bad)


def rounded(ffn, q, precision):
    """numpy float64 state dict of the weights `precision` computes with: fp32 `ffn`'s, rounded as `q` packs."""
    out = {}
    for name in ("c_fc", "c_proj"):
        layer = getattr(ffn, name)
        w = round_to(layer.weight.detach(), precision, getattr(q, name).packed.group)
        out[f"{name}.weight"], out[f"{name}.bias"] = w.double().numpy(), layer.bias.detach().double().numpy()
    return out


def rel(a, b):
    return float(np.abs(np.asarray(a, dtype=np.float64) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: f"d{c.n_embd}")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_route_matches_numpy(cfg, precision):
    ffn = ffn_for(cfg)
    exact = reference.FFN.from_state_dict(ffn.state_dict())
    # fp32 activations: numpy's float64 FFN on the rounded weights is the reference (int8 activations:
    # test_int8_activations.py)
    q = quantize(copy.deepcopy(ffn), precision, activations="fp32")
    ref = reference.FFN.from_state_dict(rounded(ffn, q, precision))
    tol = PRECISION_TOLERANCES[precision]
    x = torch.randn(37, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    for route in kp.routes(precision, "cpu"):
        for rows in (1, 5, 37):  # decode (GEMV), a small batch, prefill
            for layer in (q.c_fc, q.c_proj):
                layer.packed.route = {"decode": route, "prefill": route}
            with torch.no_grad():
                y = q(x[:rows]).numpy()
            assert rel(y, ref(x[:rows].double().numpy())) <= tol["kernel"], (route, rows)
            assert rel(y, exact(x[:rows].double().numpy())) <= tol["vs_fp32"], (route, rows)


def test_negative_control_precision_tolerance_can_fail():
    """int4's output is far from fp32 (so the vs_fp32 bar of int8 would catch an int4 mix-up)."""
    ffn = ffn_for(SHAPES[0])
    exact = reference.FFN.from_state_dict(ffn.state_dict())
    x = torch.randn(8, 768, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = quantize(copy.deepcopy(ffn), "int4")(x).numpy()
    assert rel(y, exact(x.double().numpy())) > PRECISION_TOLERANCES["int8"]["vs_fp32"]


@pytest.mark.skipif(kp.WHY_NOT_NATIVE is not None, reason="native kernels not built here")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_native_is_batch_invariant_and_deterministic(precision):
    ffn = quantize(ffn_for(SHAPES[0]), precision)
    for layer in (ffn.c_fc, ffn.c_proj):
        layer.packed.route = {"decode": "native", "prefill": "native"}
    x = torch.randn(40, 768, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        batch = ffn(x)
        assert torch.equal(batch, ffn(x))
        for rows in (1, 2, 3, 7, 8, 9, 13):  # 8 and fewer: row by row (csrc/linear.h FEW_ROWS)
            assert torch.equal(ffn(x[-rows:]), batch[-rows:]), rows


@pytest.mark.skipif(kp.WHY_NOT_NATIVE is not None, reason="native kernels not built here")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_long_k_prefill_in_blocks_is_batch_invariant(precision):
    """K = 2112 > csrc/linear.h KBLOCK: a prefill of many rows sums K in blocks, its running sums passing through
    the output between blocks; each row alone (summed in one pass) must get the same bits. int8 / int4 on fp32
    activations, which the float kernels run."""
    g = torch.Generator().manual_seed(8)
    w, b, x = (torch.randn(2112, 128, generator=g) / 40, torch.randn(128, generator=g),
               torch.randn(40, 2112, generator=g))
    p = kp.Packed(w, b, precision)
    y = kp.linear(x, p, None, p.bias, "native", "tanh")
    for r in (0, 17, 39):
        assert torch.equal(kp.linear(x[r:r + 1], p, None, p.bias, "native", "tanh"), y[r:r + 1]), r
    # the comparison is bitwise, which the order of a sum shows in: torch's order of the same products differs
    # (a build whose blocks are not whole chunks fails the rows above: checked by hand when the blocks landed)
    assert not torch.equal(torch.nn.functional.gelu(torch.addmm(b, x, p.weights()), approximate="tanh"), y)


@pytest.mark.skipif(kp.WHY_NOT_NATIVE is not None, reason="native kernels not built here")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("K", [5, 99, 131])
def test_prefill_of_an_odd_k_matches_each_row_alone(precision, K):
    """K not a multiple of 4: the AVX2 build's prefill tiles (3 and 6 rows) take 4 k a pass (csrc/linear_avx2.cpp),
    so each chunk ends in a remainder; 13 rows (tiles of 6, 6 and 1) must give each row the bits it gets
    alone (one row: decode's tile, one k a pass), and the numpy reference's values."""
    g = torch.Generator().manual_seed(9)
    w, b, x = torch.randn(K, 64, generator=g) / 10, torch.randn(64, generator=g), torch.randn(13, K, generator=g)
    p = kp.Packed(w, b, precision)
    y = kp.linear(x, p, None, p.bias, "native")
    for r in range(13):
        assert torch.equal(kp.linear(x[r:r + 1], p, None, p.bias, "native"), y[r:r + 1]), r
    ref = kp.reference(x, p, None, p.bias)
    assert np.abs(y.numpy() - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    assert np.abs(y.numpy()[:, ::-1] - ref).max() > 1e-2  # the comparison can fail: columns out of order


def test_state_dict_is_unchanged_with_keep_fp32():
    ffn = ffn_for(SHAPES[0])
    before = {k: v.clone() for k, v in ffn.state_dict().items()}
    q = quantize(ffn, "int8", keep_fp32=True)
    after = q.state_dict()
    assert list(after) == list(before) == ["c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"]
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert q.c_fc.weight.untyped_storage().nbytes() == q.c_fc.weight.numel() * 4  # both copies kept


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_load_state_dict_repacks(precision):
    q = quantize(ffn_for(SHAPES[0], seed=0), precision)
    other = ffn_for(SHAPES[0], seed=1)
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        old = q(x)
        q.load_state_dict(other.state_dict())
        new = q(x)
        fresh = quantize(other, precision)(x)
    assert not torch.allclose(old, new)
    torch.testing.assert_close(new, fresh, rtol=1e-6, atol=1e-6)


def test_train_runs_fp32_and_eval_repacks_after_a_step():
    q = quantize(ffn_for(SHAPES[0]), "int8", keep_fp32=True)
    x = torch.randn(4, 768, generator=torch.Generator().manual_seed(5))
    q.train().requires_grad_(True)
    q.dropout.p = 0.0
    y = q(x)
    assert y.grad_fn is not None  # autograd through the fp32 Parameters
    torch.testing.assert_close(y, reference_ffn(q)(x), rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    torch.optim.SGD(q.parameters(), lr=0.1).step()
    q.eval()
    with torch.no_grad():
        after = q(x)
        fresh = quantize(copy.deepcopy(q), "int8", keep_fp32=True)(x)
    torch.testing.assert_close(after, fresh, rtol=1e-6, atol=1e-6)


def reference_ffn(ffn):
    ref = reference.FFN.from_state_dict(ffn.state_dict())
    return lambda x: torch.from_numpy(ref(x.detach().numpy()))


def test_bad_requests_name_the_thing():
    ffn = ffn_for(SHAPES[0])
    with pytest.raises(ConfigError, match=r"precision 'int3' is not supported; known: fp32, bf16, int8, int4"):
        quantize(ffn, "int3")
    with pytest.raises(ConfigError, match=r"int8 group size 100 must divide the layer's 768 inputs"):
        quantize(copy.deepcopy(ffn), "int8", group=100, activations="fp32")
    with pytest.raises(ConfigError, match=r"int8 with int8 activations group size 100 must be a multiple of 4 and "
                                          r"divide the layer's 768 inputs"):
        quantize(copy.deepcopy(ffn), "int8", group=100, activations="int8")
    with pytest.raises(ConfigError, match=r"group applies to int8 and int4, not bf16"):
        quantize(copy.deepcopy(ffn), "bf16", group=32)
    with pytest.raises(ConfigError, match=r"packs fp32 Parameters; Conv1D weight is torch.bfloat16"):
        quantize(copy.deepcopy(ffn).to(torch.bfloat16), "int8")
    with pytest.raises(ConfigError, match=r"Linear has no GPT-2 linear layers \(Conv1D, lm_head\) to quantize$"):
        quantize(torch.nn.Linear(4, 4), "int8")
    from transformers import GPT2Config, GPT2LMHeadModel
    hf = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=100))
    with pytest.raises(ConfigError, match=r"quantize takes gpt2ffn's modules; load the checkpoint with GPT2"):
        quantize(hf, "int8")  # HF's own Conv1D: its layers are there, but not gpt2ffn's


def test_widths_int8_words_cannot_hold_take_fp32_activations_by_default():
    """n_embd 36 (legal: 6 heads of 6): int4's int8 activations need inputs % 8. Not asked for, those layers
    take fp32 activations (inputs 144 and int8's lm_head keep int8 ones) and compute what the numpy
    reference of their own packing says, at int4's tolerance; asked for, it is the error naming the width."""
    cfg = Config(n_embd=36, n_layer=2, n_head=6, vocab_size=333, n_positions=64)
    model = quantize(randomize_(GPT2(cfg), 0).eval(), "int4")
    layers = [m for m in model.modules() if getattr(m, "packed", None) is not None]
    for m in layers:
        want = "fp32" if m.packed.K == 36 and m.packed.precision == "int4" else "int8"
        assert m.packed.activations == want, (m.packed.K, m.packed.precision)
        x = torch.randn(5, m.packed.K, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            got = kp.linear(x, m.packed, None, m.bias, m.packed.route["prefill"])
        assert rel(got.numpy(), kp.reference(x, m.packed, None, m.bias)) <= PRECISION_TOLERANCES["int4"]["kernel"]
    assert {m.packed.activations for m in layers} == {"fp32", "int8"}
    assert model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4).shape == (1, 7)
    with pytest.raises(ConfigError, match=r"int4 with int8 activations needs a number of inputs per layer "
                                          r"divisible by 8 \(a 4-byte word holds 8 weights\); this layer has 36 "
                                          r"\(n_embd or n_inner\): with fp32 activations int4 takes an even one"):
        quantize(randomize_(GPT2(cfg), 0).eval(), "int4", activations="int8")


def test_torch_fallback_when_native_is_missing(monkeypatch):
    monkeypatch.setattr(kp, "_C", None)
    assert kp.routes("int8", "cpu")[0] == "torch"
    ffn = ffn_for(SHAPES[0])
    q = quantize(copy.deepcopy(ffn), "int8", activations="fp32")  # the reference below takes fp32 activations
    assert q.c_fc.packed.route == {"decode": "torch", "prefill": "torch"}
    x = torch.randn(2, 768, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        y = q(x).numpy()
    ref = reference.FFN.from_state_dict(rounded(ffn, q, "int8"))
    assert rel(y, ref(x.double().numpy())) <= 1e-5


def test_probe_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2FFN_CACHE", str(tmp_path))
    quantize(ffn_for(SHAPES[0]), "bf16", keep_fp32=True)  # held once, only the packed routes: nothing to probe
    cached = (tmp_path / "routes.json").read_text()
    assert "bf16" in cached and '"decode"' in cached
    monkeypatch.setattr(kp, "linear", None)  # a second probe would call it; the cache answers instead
    quantize(ffn_for(SHAPES[0]), "bf16", keep_fp32=True)


def test_probe_cache_key_names_the_cpu_and_the_kernel_build(tmp_path, monkeypatch):
    """A rebuilt extension is probed again (its routes and prefetch distances are not the old build's), and the key
    tells CPUs of one model name apart by family and model."""
    lib = tmp_path / "_C.so"
    lib.write_bytes(b"one build")
    monkeypatch.setattr(kp, "_C", types.SimpleNamespace(__file__=str(lib)))
    before = kp.machine_key()
    lib.write_bytes(b"another build")
    assert kp.machine_key() != before
    if any(line.startswith("cpu family") for line in open("/proc/cpuinfo")):
        assert "(family " in before


@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpt2_logits_against_hf(precision):
    hf = hf_model(SMALL, seed=3)
    ours = GPT2(SMALL).eval()
    ours.load_state_dict(hf.state_dict())
    quantize(ours, precision)
    ids = torch.randint(0, SMALL.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids)
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= PRECISION_TOLERANCES[precision]["vs_fp32"] * 2, err
    assert ours.precision == precision
    assert ours.lm_head.packed.precision == ("int8" if precision == "int4" else precision)  # int4 keeps lm_head int8


@pytest.mark.real_weights
def test_precisions_on_real_gpt2(real_gpt2):
    """Each precision's next-token distributions on real GPT-2 against its fp32, over 1024 positions (the
    metrics of `gpt2ffn bench --accuracy --weights DIR`). Bars are loose: real GPT-2 is far less sensitive
    than the random model, whose numbers are in README."""
    from gpt2ffn.bench import bench_accuracy
    r = bench_accuracy(str(real_gpt2), PRECISIONS, log=lambda *a: None)["precisions"]
    assert r["fp32"]["mean_kld"] < 1e-8 and r["fp32"]["top1_agree"] > 0.999
    assert r["bf16"]["mean_kld"] < 1e-3 and r["int8"]["mean_kld"] < 1e-2 and r["int4"]["mean_kld"] < 2e-1
    assert r["int8"]["top1_agree"] > 0.9


# Weights held once (quantize's default where the native kernels run): the packed copy is the only one.

held_once = pytest.mark.skipif(kp.WHY_NOT_NATIVE is not None, reason="native kernels not built here: both copies stay")


def gpt2_pair(seed=3):
    hf = hf_model(SMALL, seed=seed)
    ours = GPT2(SMALL).eval()
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def holds_data(t) -> bool:
    return t.untyped_storage().nbytes() >= t.numel() * t.element_size()


@held_once
@pytest.mark.parametrize("precision", PRECISIONS)
def test_packed_layers_hold_no_fp32_weight(precision):
    _, ours = gpt2_pair()
    kept = quantize(copy.deepcopy(ours), precision, keep_fp32=True)
    quantize(ours, precision)
    layers = [m for m in ours.modules() if hasattr(m, "pack")]
    assert len(layers) == 4 * SMALL.n_layer + 1
    for m in layers:
        assert m.dropped and not holds_data(m.weight), m  # one zero element, expanded to the weight's shape
        assert m.weight.shape == m.weight_value().shape and m.packed.nbytes > 0
    assert ours.transformer.wte.weight is ours.lm_head.weight  # still tied
    assert all(holds_data(m.weight) for m in kept.modules() if hasattr(m, "pack"))  # negative control
    ids = torch.randint(0, SMALL.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():  # the embeddings come from the packed lm_head: exact in fp32 (and bf16's own rounding)
        got, want = ours(ids), kept(ids)
        again = copy.deepcopy(ours)(ids)  # a copy re-packs from the packed weights, not from zeros
    if precision == "fp32":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, got)


@held_once
@pytest.mark.parametrize("precision", PRECISIONS)
def test_state_dict_is_hf_layout_from_packed_weights(precision):
    hf, ours = gpt2_pair()
    quantize(ours, precision)
    want, got = hf.state_dict(), ours.state_dict()
    assert set(got) <= set(want) and {k for k in want if not k.endswith(".attn.bias")} <= set(got)
    for k, v in got.items():
        w = want[k]
        if k.endswith("weight") and (".c_" in k or k.endswith(("wte.weight", "lm_head.weight"))):
            head = k.endswith(("wte.weight", "lm_head.weight"))
            p = "int8" if precision == "int4" and head else precision
            kn = w.t() if k == "lm_head.weight" or k.endswith("wte.weight") else w
            rounded_w = round_to(kn, p, 32)
            assert torch.equal(v, rounded_w.t() if head else rounded_w), k  # exactly the values the kernels use
            tol = PRECISION_TOLERANCES[p]["vs_fp32"] * (4 if p == "int4" else 1)
            assert float((v - w).abs().max() / w.abs().max()) <= tol, k
        else:
            assert torch.equal(v, w), k
    if precision != "fp32":  # negative control: the comparison sees rounding
        assert not torch.equal(got["transformer.h.0.mlp.c_fc.weight"], want["transformer.h.0.mlp.c_fc.weight"])


@held_once
@pytest.mark.parametrize("precision", ["bf16", "int8", "int4"])
def test_train_or_autograd_on_a_packed_only_model_says_how_to_get_fp32(precision):
    _, ours = gpt2_pair()
    quantize(ours, precision)
    with pytest.raises(PackedOnlyError, match=rf"Conv1D holds only its packed {precision} weights, so train\(\) "
                                              r"cannot run: load the model with precision='fp32'"):
        ours.train()
    assert not ours.training and not any(m.training for m in ours.modules())  # refused before any mode changed
    block = ours.transformer.h[1]
    for part in (ours.transformer, ours.transformer.h, block, block.attn, block.mlp,  # its parts refuse as it does
                 ours.transformer.wte):
        with pytest.raises(PackedOnlyError):
            part.train()
        assert not any(m.training for m in ours.modules()), type(part).__name__
    # Autograd in eval() runs on the packed weights: the input's gradient goes through the weights the forward
    # computed with, as a plain fp32 model holding those (dequantized) values gives it.
    plain = GPT2(SMALL).eval()
    plain.load_state_dict(ours.state_dict())
    emb = ours.transformer.wte(torch.tensor([[1, 2, 3]])).detach()
    grads = []
    for model in (ours, plain):
        x = emb.clone().requires_grad_()
        model.transformer.h[0](x).square().sum().backward()
        grads.append(x.grad)
    rel = float((grads[0] - grads[1]).abs().max() / grads[1].abs().max())
    assert rel < (1e-5 if precision == "bf16" else 5e-2), rel  # int8 / int4: activations quantized in the forward
    ffn = quantize(ffn_for(SHAPES[0]), precision)
    ffn.c_fc.weight.requires_grad_(True)  # a gradient for a weight held only packed: said, not made up
    with pytest.raises(PackedOnlyError, match=rf"holds only its packed {precision} weights, so a gradient for its "
                                              r"weight cannot run: .*keep_fp32=True"):
        ffn(torch.randn(2, 768)).sum().backward()


@held_once
def test_fp32_trains_on_one_copy_and_eval_repacks():
    hf, ours = gpt2_pair()
    quantize(ours, "fp32")
    ids = torch.randint(0, SMALL.vocab_size, (2, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        before = ours(ids)
    ours.train()
    layers = [m for m in ours.modules() if hasattr(m, "pack")]
    assert all(m.packed is None and holds_data(m.weight) and m.weight.requires_grad for m in layers)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, hf.state_dict()[k]), k  # unpacked exactly
    ours.eval()
    assert all(m.dropped and not holds_data(m.weight) for m in layers)
    with torch.no_grad():
        assert torch.equal(ours(ids), before)  # the round trip changes nothing
    ours.train()
    ours.transformer.drop.p = 0.0
    for block in ours.transformer.h:
        block.attn.attn_dropout.p = block.attn.resid_dropout.p = block.mlp.dropout.p = 0.0
    ours(ids).logsumexp(-1).sum().backward()
    torch.optim.SGD(ours.parameters(), lr=0.1).step()
    trained = {k: v.clone() for k, v in ours.state_dict().items()}
    ours.eval()
    hf.load_state_dict(trained, strict=False)
    with torch.no_grad():
        after = ours(ids)
        torch.testing.assert_close(after, hf(ids).logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(after, before)  # the step changed the model


@held_once
def test_load_state_dict_into_a_held_once_gpt2_repacks():
    _, ours = gpt2_pair(seed=3)
    other, _ = gpt2_pair(seed=4)
    quantize(ours, "int8")
    ours.load_state_dict(other.state_dict(), strict=False)
    ids = torch.randint(0, SMALL.vocab_size, (1, 7), generator=torch.Generator().manual_seed(9))
    fresh = GPT2(SMALL).eval()
    fresh.load_state_dict(other.state_dict(), strict=False)
    quantize(fresh, "int8")
    with torch.no_grad():
        assert torch.equal(ours(ids), fresh(ids))
    assert ours.lm_head.dropped and not holds_data(ours.lm_head.weight)


@held_once
def test_a_model_held_once_behaves_as_hf_for_an_hf_user():
    """What an HF user does with a loaded model, on the default fp32 one held once: every Parameter asks for
    gradients; a forward without no_grad is the forward; training in eval() (no dropout) matches HF's step for
    step; freezing survives train(); `weight.data = ...` is taken; inference_mode loads and runs; .to(bf16) runs
    in bf16; an empty batch is one error."""
    hf, ours = gpt2_pair()
    quantize(ours, "fp32")
    assert all(p.requires_grad for p in ours.parameters())
    ids = torch.randint(0, SMALL.vocab_size, (2, 9), generator=torch.Generator().manual_seed(9))
    y = ours(ids)
    with torch.no_grad():
        torch.testing.assert_close(y, ours(ids), rtol=1e-5, atol=1e-5)
    hf.eval()
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in (ours, hf)]
    for _ in range(3):
        losses = []
        for m, opt in zip((ours, hf), opts):
            logits = m(ids) if m is ours else m(ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-5, losses
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)  # the trained weights serve
    # a forward between backward and step (a metric under no_grad) leaves the step its values to write; train()
    # between forward and backward leaves the backward the weights its forward used
    loss = ours(ids).logsumexp(-1).mean()
    loss.backward()
    with torch.no_grad():
        ours(ids)
    opts[0].step()
    opts[0].zero_grad()
    loss = ours(ids).logsumexp(-1).mean()
    ours.train()
    loss.backward()
    ours.eval()
    big = [m for m in copy.deepcopy(ours).modules() if getattr(m, "dropped", False)]
    assert big and all(not holds_data(m.weight) for m in big)  # a copy lets its weights go again
    ours.requires_grad_(False)
    ours.transformer.h[-1].requires_grad_(True)
    ours.train()
    assert [n for n, p in ours.named_parameters() if p.requires_grad] == \
        [n for n, p in ours.named_parameters() if n.startswith(f"transformer.h.{SMALL.n_layer - 1}.")]
    ours.eval()
    fc = ours.transformer.h[0].mlp.c_fc
    with torch.no_grad():
        before = ours(ids)
        fc.weight.data = torch.randn(fc.weight.shape)
        assert not torch.equal(ours(ids), before)
    with torch.inference_mode():
        m = quantize(GPT2(SMALL), "int8")
        assert m(ids).shape == (2, 9, SMALL.vocab_size)
        before = m(ids)
        m.load_state_dict(gpt2_pair(seed=5)[1].state_dict())  # inference tensors have no version counter
        assert not torch.equal(m(ids), before)
    with torch.no_grad():
        assert ours.to(torch.bfloat16)(ids).dtype == torch.bfloat16
    with pytest.raises(Exception, match=r"ids has shape \(0, 5\); expected \(batch, tokens\), both >= 1"):
        ours(torch.zeros(0, 5, dtype=torch.long))


@held_once
def test_a_model_held_only_at_a_precision_refuses_another():
    _, ours = gpt2_pair()
    quantize(ours, "int8")
    with pytest.raises(ConfigError, match="GPT2 holds only int8 weights: their fp32 values are gone"):
        quantize(ours, "fp32")
    with pytest.raises(ConfigError, match="holds only int8 weights"):
        quantize(ours, "int4")  # the blocks: int4 keeps only the lm_head at int8
    ours.to("cpu")  # unpacks the int8 values into the Parameters: still int8's rounding
    with pytest.raises(ConfigError, match="holds only int8 weights"):
        quantize(ours, "fp32")
    with pytest.raises(PackedOnlyError, match="train"):
        ours.train()
    quantize(ours, "int8")  # the same precision again is fine
    kept = quantize(gpt2_pair()[1], "int8", keep_fp32=True)
    assert all(p.requires_grad for p in kept.parameters())  # keep_fp32: its Parameters still train
    quantize(kept, "fp32")


@held_once
@pytest.mark.parametrize("precision", PRECISIONS)
def test_torch_save_and_load_of_a_packed_model(precision, tmp_path):
    """torch.save of a whole packed model (int8/int4 packed side by side in one arena, under two dtypes, was
    refused by torch.save) loads back and computes the same logits."""
    _, ours = gpt2_pair()
    quantize(ours, precision)
    ids = torch.randint(0, SMALL.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    torch.save(ours, tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(back(ids), ours(ids))


@held_once
@pytest.mark.parametrize("precision", PRECISIONS)
def test_dtype_changes_and_autocast_on_a_packed_model(precision):
    """autocast's bf16 activations reach layers held only packed: computed in fp32, as without autocast (they
    raised); .half() makes torch layers in fp16 and .float() brings them back (an int8 model raised on both);
    train(), .to(bf16), eval() gives a bf16 model (eval() re-packed bf16 weights as fp32 ones and failed)."""
    _, ours = gpt2_pair()
    quantize(ours, precision)
    ids = torch.randint(0, SMALL.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ours(ids)
        with torch.autocast("cpu", torch.bfloat16):
            torch.testing.assert_close(ours(ids).float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
        assert ours.half()(ids).dtype == torch.float16
        assert ours.float()(ids).dtype == torch.float32
    if precision == "fp32":
        ours.train().to(torch.bfloat16).eval()
        with torch.no_grad():
            assert ours(ids).dtype == torch.bfloat16


def test_a_weight_held_once_reads_as_its_values_and_refuses_writes(tmp_path):
    """Two outside rounds read a held weight and got zeros (model.lm_head.weight.abs().sum() == 0, wte[ids] all
    zeros) and an in-place write raised torch's 'more than one element ... single memory location'. The Parameter
    is a HeldWeight while held: reads (ops, indexing, printing, .data, F.linear) see the values state_dict() gives,
    writes in place raise PackedOnlyError, `w.data = values` gives it values (re-packed on the next call); the same
    object, its storage still one element; pickling, deepcopy and train()/eval() keep all that."""
    import pickle

    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2ffn import GPT2, PackedOnlyError
    from gpt2ffn.linear import HeldWeight
    hf = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=64))
    hf.save_pretrained(tmp_path)
    ids = torch.tensor([[1, 2, 3, 4]])
    for precision in ("fp32", "int8"):
        m = GPT2.from_pretrained(tmp_path, precision=precision)
        sd = m.state_dict()
        head, c_fc = m.lm_head.weight, m.transformer.h[0].mlp.c_fc.weight
        assert type(head) is HeldWeight and isinstance(head, torch.nn.Parameter) and head.stride() == (0, 0)
        assert head.untyped_storage().nbytes() == 4 and head is m.transformer.wte.weight
        wte = sd["transformer.wte.weight"]
        assert torch.equal(head.detach(), wte) and torch.equal(m.transformer.wte.weight[ids], wte[ids])
        assert torch.equal(c_fc.data, sd["transformer.h.0.mlp.c_fc.weight"]) and float(c_fc.abs().sum()) > 0
        x = torch.randn(2, 64)
        assert torch.equal(F.linear(x, head), x @ wte.t())
        assert "Parameter containing" in repr(head) and "0.0000" not in repr(head)[:60]
        with torch.no_grad():
            before = m(ids)
            for write in (lambda w: w.mul_(0.5), lambda w: w.data.zero_(), lambda w: w.__setitem__(0, 1.0)):
                with pytest.raises(PackedOnlyError, match=r"writing into its weight .* cannot run"):
                    write(c_fc)
            assert torch.equal(m(ids), before)
        for copy_ in (pickle.loads(pickle.dumps(m)), __import__("copy").deepcopy(m)):
            assert type(copy_.lm_head.weight) is HeldWeight and copy_.lm_head.weight.stride() == (0, 0)
            with torch.no_grad():
                assert torch.equal(copy_(ids), before)
            assert torch.equal(copy_.lm_head.weight.detach(), wte)
    m = GPT2.from_pretrained(tmp_path).train()  # fp32: its Parameters get their values back
    assert type(m.lm_head.weight) is torch.nn.Parameter
    m.eval()
    assert type(m.lm_head.weight) is HeldWeight
    m = GPT2.from_pretrained(tmp_path)
    c_fc = m.transformer.h[0].mlp.c_fc.weight
    c_fc.data = 2 * sd["transformer.h.0.mlp.c_fc.weight"]  # its own values now: re-packed on the next call
    assert type(c_fc) is torch.nn.Parameter
    with torch.no_grad():
        m(ids)
    assert torch.equal(m.state_dict()["transformer.h.0.mlp.c_fc.weight"], 2 * sd["transformer.h.0.mlp.c_fc.weight"])
    assert type(c_fc) is HeldWeight  # held once again


def test_the_kernels_never_unpack_a_held_weight(tmp_path, monkeypatch):
    """A HeldWeight unpacks on a read; gpt2ffn's own forward, prefill and decode read it only as stored (what its
    packed copy was stamped with): weight_value, the unpacking, is never called there, at any precision."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2ffn import GPT2
    from gpt2ffn.generate import generate
    from gpt2ffn.linear import PackedLayer
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=64)).save_pretrained(
        tmp_path)
    models = [GPT2.from_pretrained(tmp_path, precision=p) for p in ("fp32", "bf16", "int8", "int4")]

    def unpacked(self):
        raise AssertionError(f"{type(self).__name__} unpacked its held weight")
    monkeypatch.setattr(PackedLayer, "weight_value", unpacked)
    for m in models:
        with torch.no_grad():
            m(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]))
        generate(m, [[1, 2, 3], [4, 5]], max_new_tokens=4)
        m(torch.tensor([[1, 2, 3]]))  # autograd on, in eval()


def test_held_weights_review_round(tmp_path):
    """From the review of HeldWeight: torch.compile of a held model failed (AOTAutograd's fake tensors unpacked
    it); nn.init's functions (tensor= as a keyword) and torch._foreach_add_ wrote into a copy, silently; == and
    f-strings read the placeholder; torch.cat([w, w]) read zeros; a held weight pickled alone came back zeros; one
    held weight's .data given to another gave it the placeholder; restore_weight stopped marking int8-rounded values
    (so .half() then .float().train() of an int8 model trained on rounded weights)."""
    import pickle

    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2ffn import GPT2, PackedOnlyError
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=64)).save_pretrained(
        tmp_path)
    m = GPT2.from_pretrained(tmp_path)
    w = m.transformer.h[0].mlp.c_fc.weight
    want = m.state_dict()["transformer.h.0.mlp.c_fc.weight"]
    assert bool((w == want).all()) and not bool((w == 0).all()) and "0.0000, 0.0000" not in f"{w}"
    assert torch.equal(torch.cat([w, w]), torch.cat([want, want])) and torch.equal(w.type(torch.float64),
                                                                                   want.double())
    for write in (lambda t: torch.nn.init.normal_(t), lambda t: torch.nn.init.constant_(t, 1.0),
                  lambda t: torch._foreach_add_([t], 1.0)):
        with pytest.raises(PackedOnlyError):
            write(w)
    assert torch.equal(pickle.loads(pickle.dumps(w)).detach(), want)
    other = GPT2.from_pretrained(tmp_path).transformer.h[0].mlp.c_fc.weight
    other.data = w.data
    assert torch.equal(other.detach(), want)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        eager = m(ids)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(m, backend="aot_eager")(ids), eager, atol=1e-5, rtol=1e-5)
    int8 = GPT2.from_pretrained(tmp_path, precision="int8").half()
    assert int8.transformer.h[0].mlp.c_fc.held_at() == "int8"
    with pytest.raises(PackedOnlyError, match="int8"):
        int8.float().train()


def test_held_weights_second_review_round(tmp_path):
    """From the second review: under a user's own dispatch mode (FlopCounterMode) and in the user's own compiled
    function a held weight read zeros (the bypass took any mode); `w.data = values` left the layer held, so
    state_dict() gave the old values; w.data pickled or deep-copied alone read zeros or raised."""
    import copy
    import pickle

    from torch.utils.flop_counter import FlopCounterMode
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2ffn import GPT2
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=64)).save_pretrained(
        tmp_path)
    m = GPT2.from_pretrained(tmp_path)
    w, sd = m.lm_head.weight, m.state_dict()
    want = sd["transformer.wte.weight"]
    with FlopCounterMode(display=False):
        assert torch.equal(w.abs().sum(), want.abs().sum())
    torch._dynamo.reset()
    assert torch.equal(torch.compile(lambda t: t.abs().sum(), backend="eager")(w.detach()), want.abs().sum())
    data = m.transformer.h[1].mlp.c_proj.weight.data
    key = "transformer.h.1.mlp.c_proj.weight"
    assert torch.equal(pickle.loads(pickle.dumps(data)), sd[key]) and torch.equal(copy.deepcopy(data), sd[key])
    c_fc = m.transformer.h[0].mlp.c_fc
    c_fc.weight.data = 2 * sd["transformer.h.0.mlp.c_fc.weight"]
    assert torch.equal(m.state_dict()["transformer.h.0.mlp.c_fc.weight"], 2 * sd["transformer.h.0.mlp.c_fc.weight"])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_strided_input_computes_as_its_contiguous_copy(precision):
    """The native kernels read each row's K values side by side; a packed FFN, Conv1D or lm_head given a view whose
    rows are not (x.T, a (B, C, T) tensor transposed) raised "x must have unit stride along K" from C++ (an outside
    tester; the unpacked modules computed it). Now each gives its contiguous copy's output, bit for bit, with
    autograd on or off, and the input's gradient through a packed fp32 layer too."""
    model = GPT2(SMALL).eval()
    quantize(model, precision)
    block = model.transformer.h[0]
    d = SMALL.n_embd
    for x in (torch.randn(d, 5).t(), torch.randn(1, d, 5).transpose(1, 2), torch.randn(2, d, 3).transpose(1, 2)):
        for module in (block.mlp, block.mlp.c_fc, block.attn.c_attn, model.lm_head):
            for grad in (False, True):
                with torch.set_grad_enabled(grad):
                    got, want = module(x), module(x.contiguous())
                assert torch.equal(got, want), (precision, type(module).__name__, x.stride(), grad)
    if precision == "fp32":  # through PackedMatmul's backward
        x = torch.randn(1, d, 5).transpose(1, 2).requires_grad_()
        block.mlp(x).sum().backward()
        xc = x.detach().contiguous().requires_grad_()
        block.mlp(xc).sum().backward()
        assert torch.equal(x.grad, xc.grad)
