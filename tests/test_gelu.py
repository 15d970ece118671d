import numpy as np
import pytest
import torch
import torch.nn as nn
from transformers.activations import ACT2FN

from gpt2ffn import GELU, InputError, gelu, reference, tolerance

POINTS = [-2.0, -1.0, 0.0, 1.0, 2.0]
TANH = [-0.0454, -0.1588, 0.0000, 0.8412, 1.9546]   # seed 000's expected output
EXACT = [-0.0455, -0.1587, 0.0000, 0.8413, 1.9545]


@pytest.mark.parametrize("approximate, expected", [("tanh", TANH), ("none", EXACT)])
def test_spot_values(approximate, expected):
    x = torch.tensor(POINTS)
    assert torch.allclose(gelu(x, approximate), torch.tensor(expected), atol=5e-5)
    assert np.allclose(gelu(np.array(POINTS, dtype=np.float32), approximate), expected, atol=5e-5)
    assert torch.equal(GELU(approximate)(x), gelu(x, approximate))


def test_default_is_tanh_because_gpt2_uses_it():
    x = torch.linspace(-4, 4, 101)
    assert torch.equal(gelu(x), gelu(x, "tanh"))
    assert torch.equal(GELU()(x), gelu(x, "tanh"))


def test_max_gap_between_forms_is_4_73e_4_at_2_70():
    x = torch.linspace(-6, 6, 1_200_001, dtype=torch.float64)
    gap = (gelu(x, "none") - gelu(x, "tanh")).abs()
    assert round(gap.max().item(), 6) == pytest.approx(4.73e-4, abs=1e-6)
    assert abs(x[gap.argmax()].item()) == pytest.approx(2.70, abs=0.01)
    # The numpy reference agrees on the same fact.
    xn = x.numpy()
    gap_np = np.abs(reference.gelu_exact(xn) - reference.gelu_tanh(xn))
    assert gap_np.max() == pytest.approx(gap.max().item(), rel=1e-9)


@pytest.mark.parametrize("hf_name, approximate", [("gelu_new", "tanh"), ("gelu_fast", "tanh"),
                                                  ("gelu_pytorch_tanh", "tanh"), ("gelu", "none")])
def test_equal_to_hf_activations(hf_name, approximate):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 4
    assert (gelu(x, approximate) - ACT2FN[hf_name](x)).abs().max().item() <= 1e-6


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_equal_to_nn_gelu_and_numpy(approximate):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1)) * 4
    assert (gelu(x, approximate) - nn.GELU(approximate=approximate)(x)).abs().max().item() <= 1e-6
    assert np.abs(reference.gelu(x.numpy(), approximate) - gelu(x, approximate).numpy()).max() <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_extremes_are_finite_and_right(dtype, approximate):
    x = torch.tensor([-400.0, -300.0, -30.0, 30.0, 300.0, 400.0], dtype=dtype)
    y = gelu(x, approximate)
    assert y.dtype == dtype and torch.isfinite(y).all()
    expected = torch.where(x > 0, x, torch.zeros_like(x))  # GELU(x) -> x for large x, -> 0 for very negative x
    assert torch.equal(y, expected)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_extremes_numpy(approximate):
    for dtype in (np.float16, np.float32, np.float64):
        x = np.array([-400, -300, 300, 400], dtype=dtype)
        y = reference.gelu(x, approximate)
        assert y.dtype == dtype and np.isfinite(y).all()
        assert np.array_equal(y, np.where(x > 0, x, 0).astype(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes_track_fp32(dtype):
    x = torch.linspace(-5, 5, 2001)
    tol = tolerance(dtype)
    torch.testing.assert_close(gelu(x.to(dtype)).float(), gelu(x), atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_autograd_and_gradcheck(approximate):
    x = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: gelu(t, approximate), (x,))
    y = gelu(x.detach().float().requires_grad_(), approximate)
    y.sum().backward()


def test_any_shape():
    for shape in [(), (5,), (2, 3, 4), (1, 2, 3, 4, 5)]:
        x = torch.randn(shape)
        assert gelu(x).shape == x.shape


def test_bad_input():
    with pytest.raises(InputError, match="float tensor, got dtype torch.int64"):
        gelu(torch.arange(3))
    with pytest.raises(InputError, match="float tensor, got dtype torch.bool"):
        gelu(torch.tensor([True]))
    with pytest.raises(InputError, match="float array, got dtype int64"):
        gelu(np.arange(3))
    with pytest.raises(ValueError, match="approximate must be 'tanh' .* got 'erf'"):
        gelu(torch.zeros(1), "erf")
    with pytest.raises(ValueError, match="approximate must be"):
        GELU("exact")
    with pytest.raises(InputError, match="torch tensor or a numpy array, got str"):
        gelu("1.0")
