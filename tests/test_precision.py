"""Weight precisions: every precision and kernel route against the numpy reference, packed weights never
stale, state_dict unchanged, batch invariance of the native kernels, and the whole GPT-2 against HF."""

import copy

import numpy as np
import pytest
import torch

from conftest import SMALL, hf_model, randomize_
from gpt2ffn import Config, ConfigError, FeedForward, quantize, reference
from gpt2ffn.kernels import packed as kp
from gpt2ffn.kernels.formats import PRECISIONS, dequantize, quantize_groups
from gpt2ffn.model import GPT2
from gpt2ffn.tolerances import PRECISION_TOLERANCES

# The GPT-2 width, and an odd FFN (hidden not 4d, no width a default group divides).
SHAPES = [Config(n_embd=768), Config(n_embd=200, n_inner=600, n_head=8)]


def ffn_for(cfg, seed=0):
    return randomize_(FeedForward(cfg), seed).eval()


def rounded(ffn, precision):
    """numpy float64 state dict of the weights `precision` computes with."""
    out = {}
    for name, layer in (("c_fc", ffn.c_fc), ("c_proj", ffn.c_proj)):
        w = layer.weight.detach()
        if precision == "bf16":
            w = w.to(torch.bfloat16).float()
        elif precision in ("int8", "int4"):
            w = dequantize(*quantize_groups(w, precision, layer.packed.group), precision)
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
    ref = reference.FFN.from_state_dict(rounded(q, precision))
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
        for rows in (1, 2, 3, 7, 13):
            assert torch.equal(ffn(x[-rows:]), batch[-rows:]), rows


def test_state_dict_is_unchanged_and_hf_layout():
    ffn = ffn_for(SHAPES[0])
    before = {k: v.clone() for k, v in ffn.state_dict().items()}
    q = quantize(ffn, "int8")
    after = q.state_dict()
    assert list(after) == list(before) == ["c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"]
    assert all(torch.equal(after[k], before[k]) for k in before)


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
    q = quantize(ffn_for(SHAPES[0]), "int8")
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
        fresh = quantize(copy.deepcopy(q), "int8")(x)
    torch.testing.assert_close(after, fresh, rtol=1e-6, atol=1e-6)


def reference_ffn(ffn):
    ref = reference.FFN.from_state_dict(ffn.state_dict())
    return lambda x: torch.from_numpy(ref(x.detach().numpy()))


def test_bad_requests_name_the_thing():
    ffn = ffn_for(SHAPES[0])
    with pytest.raises(ConfigError, match=r"precision 'int3' is not supported; known: fp32, bf16, int8, int4"):
        quantize(ffn, "int3")
    with pytest.raises(ConfigError, match=r"int8 group size 100 must divide the layer's 768 inputs"):
        quantize(copy.deepcopy(ffn), "int8", group=100)
    with pytest.raises(ConfigError, match=r"group applies to int8 and int4, not bf16"):
        quantize(copy.deepcopy(ffn), "bf16", group=32)
    with pytest.raises(ConfigError, match=r"packs fp32 Parameters; Conv1D weight is torch.bfloat16"):
        quantize(copy.deepcopy(ffn).to(torch.bfloat16), "int8")
    with pytest.raises(ConfigError, match=r"Linear has no GPT-2 linear layers"):
        quantize(torch.nn.Linear(4, 4), "int8")


def test_torch_fallback_when_native_is_missing(monkeypatch):
    monkeypatch.setattr(kp, "_C", None)
    assert kp.routes("int8", "cpu")[0] == "torch"
    ffn = ffn_for(SHAPES[0])
    q = quantize(copy.deepcopy(ffn), "int8")
    assert q.c_fc.packed.route == {"decode": "torch", "prefill": "torch"}
    x = torch.randn(2, 768, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        y = q(x).numpy()
    ref = reference.FFN.from_state_dict(rounded(q, "int8"))
    assert rel(y, ref(x.double().numpy())) <= 1e-5


def test_probe_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2FFN_CACHE", str(tmp_path))
    quantize(ffn_for(SHAPES[0]), "bf16")
    cached = (tmp_path / "routes.json").read_text()
    assert "bf16" in cached and '"decode"' in cached
    monkeypatch.setattr(kp, "linear", None)  # a second probe would call it; the cache answers instead
    quantize(ffn_for(SHAPES[0]), "bf16")


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
