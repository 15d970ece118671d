"""GELU (tanh form) and ReLU applied inside the native kernels as they store x @ W + b (csrc/act_impl.h): against
float64 GELU in every build this CPU runs, the same bits in every build, the ends of the float range, and a
negative control (the exact GELU in its place fails the same comparison)."""

import pytest
import torch
import torch.nn.functional as F

from conftest import native_isas
from gpt2ffn.kernels import packed as kp
from gpt2ffn.kernels.formats import Packed

_C = kp._C
pytestmark = pytest.mark.skipif(kp.WHY_NOT_NATIVE is not None, reason=str(kp.WHY_NOT_NATIVE))
FORMATS = [("fp32", "fp32"), ("bf16", "fp32"), ("int8", "fp32"), ("int4", "fp32"), ("int8", "int8"),
           ("int4", "int8")]
TOL = 2e-6  # |fused - GELU_float64(y)| <= TOL * max(1, |y|): the kernel's exp and division, a few ulp


def run(x, p, act, isa=None):
    old = _C.set_isa(isa) if isa else None
    try:
        return _C.linear(x, p.w, p.scale, p.bias, p.format, p.N, p.group, act)
    finally:
        if old:
            _C.set_isa(old)


def gelu64(y):
    """GELU's tanh form in float64 as x * sigmoid(2u): the same function as 0.5 x (1 + tanh(u)), without the
    cancellation that makes F.gelu(approximate="tanh") 0 below x ~ -6.3 even in float64."""
    y = y.double()
    return y * torch.sigmoid(2 * 0.7978845608028654 * (y + 0.044715 * y**3))


def err(got, y):
    return ((got.double() - gelu64(y)).abs() / y.double().abs().clamp(min=1)).max().item()


@pytest.mark.parametrize("isa", native_isas())
@pytest.mark.parametrize("precision,activations", FORMATS)
def test_fused_gelu_is_gelu_of_the_same_sums(isa, precision, activations):
    g = torch.Generator().manual_seed(3)
    K, N, M = 256, 200, 9  # N not a multiple of 64: the padded lanes are computed and cut off
    p = Packed(torch.randn(K, N, generator=g) * 0.2, torch.randn(N, generator=g), precision, None, activations)
    x = 2 * torch.randn(M, K, generator=g)
    y = run(x, p, "", isa)
    assert err(run(x, p, "tanh", isa), y) <= TOL
    assert torch.equal(run(x, p, "relu", isa), y.relu())
    exact = F.gelu(y, approximate="none")
    assert err(exact, y) > 10 * TOL  # negative control: the erf form (4.7e-4 away at |y| = 2.7)
    assert torch.allclose(run(x, p, "none", isa), exact, rtol=1e-6, atol=4e-6)  # aten after the kernels


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("M", [5, 17, 23])
def test_every_build_gives_the_same_bits(precision, M):
    """fp32 activations: the row counts take every tile (AVX2: 6 x 1 and 3 x 1 lane blocks, then 2 and 1 rows;
    AVX-512: 6 x 4 (int4: 6 x 2), 4 x 2, 3 x 2; fp32 and bf16 below FEW_ROWS: 2 x 4), none of which changes an
    order of sums."""
    g = torch.Generator().manual_seed(4)
    p = Packed(torch.randn(192, 320, generator=g) * 0.1, torch.randn(320, generator=g), precision, None, "fp32")
    x = 3 * torch.randn(M, 192, generator=g)
    outs = [run(x, p, "tanh", isa) for isa in native_isas()]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert torch.equal(run(x[:1], p, "tanh"), outs[0][:1])  # a row's bits whatever its tile


def test_the_ends_of_the_float_range():
    K = 64
    p = Packed(torch.eye(K), torch.zeros(K), "fp32", None, "fp32")  # y = x: the activation alone
    x = torch.linspace(-30, 30, 64 * 100)
    ends = torch.tensor([-3.4e38, -1e30, -1e4, -100.0, -10.0, 0.0, -0.0, 1e-30, -1e-30, 10.0, 1e4, 3.4e38])
    x = torch.cat([x, ends, torch.zeros(K - len(ends))]).view(-1, K)
    for isa in native_isas():
        y = run(x, p, "tanh", isa).reshape(-1)
        want = gelu64(x.reshape(-1))
        assert torch.isfinite(y).all()
        # relative error: ~1e-6 where |y| matters, up to ~5e-6 on the tiny values of the far negative tail
        # (e^z near z = 88 carries z's own fp32 rounding, 88 * 6e-8)
        assert ((y.double() - want).abs() <= 1e-5 * want.abs() + 1e-36).all()  # -0 where GELU < 1e-36
        nan = run(torch.full((1, K), float("nan")), p, "tanh", isa)
        assert torch.isnan(nan).all()


def test_an_unknown_activation_is_refused():
    p = Packed(torch.randn(64, 64), torch.zeros(64), "fp32", None, "fp32")
    with pytest.raises(RuntimeError, match="unknown activation 'gelu'; known: '', 'tanh', 'relu', 'none'"):
        _C.linear(torch.randn(1, 64), p.w, p.scale, p.bias, p.format, p.N, p.group, "gelu")
