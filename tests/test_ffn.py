import dataclasses

import numpy as np
import pytest
import torch

from conftest import ACTIVATIONS, WIDTHS, hf_mlp
from gpt2ffn import Config, FeedForward, InputError, ShapeError, reference, tolerance
from gpt2ffn.cli import GPT_CONFIG_124M
from gpt2ffn.errors import ConfigError

HF_KEYS = {"c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"}


def ours_from(mlp, cfg) -> FeedForward:
    ffn = FeedForward(cfg).eval()
    ffn.load_state_dict(mlp.state_dict())
    return ffn


def tokens(cfg, shape=(2, 5), seed=0, dtype=torch.float32, scale=1.0):
    return scale * torch.randn(*shape, cfg.n_embd, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("cfg", WIDTHS, ids=lambda c: f"d{c.n_embd}h{c.hidden}")
def test_matches_hf_gpt2mlp_fp32(cfg, activation):
    cfg = dataclasses.replace(cfg, activation_function=activation)
    mlp = hf_mlp(cfg, seed=cfg.n_embd)
    ffn = ours_from(mlp, cfg)
    x = tokens(cfg, scale=3.0)  # pre-activations spread over the range where the GELU forms differ
    with torch.no_grad():
        expected, actual = mlp(x), ffn(x)
    tol = tolerance(torch.float32)
    assert (actual - expected).abs().max().item() <= tol.atol
    torch.testing.assert_close(actual, expected, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_hf_in_half_precision(dtype):
    cfg = Config.from_name("gpt2")
    mlp = hf_mlp(cfg).to(dtype)
    ffn = ours_from(mlp, cfg).to(dtype)
    x = tokens(cfg, dtype=dtype)
    tol = tolerance(dtype)
    with torch.no_grad():
        torch.testing.assert_close(ffn(x), mlp(x), atol=tol.atol, rtol=tol.rtol)


def test_state_dict_moves_both_ways():
    cfg = Config.from_name("gpt2")
    mlp = hf_mlp(cfg, seed=1)
    ffn = FeedForward(cfg)
    assert set(ffn.state_dict()) == set(mlp.state_dict()) == HF_KEYS
    assert {k: v.shape for k, v in ffn.state_dict().items()} == {k: v.shape for k, v in mlp.state_dict().items()}
    assert ffn.c_fc.weight.shape == (768, 3072)  # HF Conv1D layout: [in, out]
    ffn.load_state_dict(mlp.state_dict())
    back = hf_mlp(cfg, seed=2)
    back.load_state_dict(ffn.state_dict())
    for k, v in mlp.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


def test_gradients_match_hf_autograd():
    cfg = Config(n_embd=200, n_inner=600, n_head=8)
    mlp = hf_mlp(cfg, seed=3)
    ffn = ours_from(mlp, cfg)
    x = tokens(cfg, scale=2.0)
    g = torch.randn(2, 5, 200, generator=torch.Generator().manual_seed(9))
    grads = []
    for module in (mlp, ffn):
        xi = x.clone().requires_grad_()
        (module(xi) * g).sum().backward()
        grads.append({"input": xi.grad, **{k: p.grad for k, p in module.named_parameters()}})
    tol = tolerance(torch.float32)
    assert set(grads[0]) == {"input"} | HF_KEYS
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=tol.atol, rtol=tol.rtol, msg=k)


def test_gradcheck_float64():
    cfg = Config(n_embd=8, n_inner=24, n_head=2, resid_pdrop=0.0)
    ffn = FeedForward(cfg).double()
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ffn, (x,))


def test_any_leading_dims_and_non_contiguous():
    cfg = Config(n_embd=64, n_head=4)
    mlp = hf_mlp(cfg)
    ffn = ours_from(mlp, cfg)
    x = torch.randn(3, 4, 5, 64)
    with torch.no_grad():
        for xi in (x, x[0, 0, 0], x.transpose(0, 1), x[..., ::1][:, ::2]):
            y = ffn(xi)
            assert y.shape == xi.shape
            torch.testing.assert_close(y, mlp(xi.contiguous()))


def test_position_wise():
    cfg = Config(n_embd=64, n_head=4)
    ffn = FeedForward(cfg).eval()
    x = torch.randn(1, 6, 64)
    with torch.no_grad():
        whole = ffn(x)
        alone = torch.cat([ffn(x[:, t:t + 1]) for t in range(6)], dim=1)
    torch.testing.assert_close(whole, alone)


def test_dropout_only_in_training():
    ffn = FeedForward(Config(n_embd=64, n_head=4, resid_pdrop=0.5))
    x = torch.randn(4, 64)
    ffn.train()
    torch.manual_seed(0)
    y = ffn(x)
    assert (y == 0).float().mean().item() == pytest.approx(0.5, abs=0.15)
    ffn.eval()
    assert torch.equal(ffn(x), ffn(x))
    assert (ffn(x) == 0).sum() == 0


def test_book_dict_and_seed_example():
    torch.manual_seed(123)
    ff = FeedForward(GPT_CONFIG_124M)
    x = torch.randn(2, 3, 768)
    assert ff(x).shape == (2, 3, 768)


def test_matches_numpy_reference():
    for cfg in (Config(n_embd=768), Config(n_embd=200, n_inner=600, n_head=8, activation_function="gelu"),
                Config(n_embd=64, activation_function="relu")):
        ffn = ours_from(hf_mlp(cfg, seed=5), cfg)
        ref = reference.FFN.from_module(ffn)  # the activation its config names
        x = tokens(cfg, shape=(3, 7), scale=2.0)
        with torch.no_grad():
            y = ffn(x).numpy()
        assert np.abs(ref(x.numpy()) - y).max() <= 1e-5


def test_deterministic_bit_exact():
    cfg = Config.from_name("gpt2")
    ffn = ours_from(hf_mlp(cfg), cfg)
    x = tokens(cfg, shape=(4, 33))
    with torch.no_grad():
        runs = [ffn(x) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


# Negative controls: each must fail the 1e-4 comparison that the right FFN passes.

def _negative_setup():
    cfg = Config.from_name("gpt2")
    mlp = hf_mlp(cfg, seed=11)
    x = tokens(cfg, shape=(2, 8), scale=4.0)  # c_fc outputs reach |x| ~ 2.7, where exact and tanh differ most
    with torch.no_grad():
        expected = mlp(x).numpy()
    return cfg, mlp, x.numpy(), expected


def test_negative_controls_fail_1e4():
    cfg, mlp, x, expected = _negative_setup()
    sd = {k: v.detach().numpy() for k, v in mlp.state_dict().items()}
    w1, b1, w2, b2 = sd["c_fc.weight"], sd["c_fc.bias"], sd["c_proj.weight"], sd["c_proj.bias"]
    right = reference.ffn_forward(x, w1, b1, w2, b2)
    assert np.abs(right - expected).max() <= 1e-4
    wrong = {
        "exact GELU": reference.ffn_forward(x, w1, b1, w2, b2, approximate="none"),
        "untransposed c_fc": reference.ffn_forward(x, w1.reshape(3072, 768).T, b1, w2, b2),
        "missing biases": reference.ffn_forward(x, w1, 0 * b1, w2, 0 * b2),
    }
    for name, y in wrong.items():
        assert np.abs(y - expected).max() > 1e-4, name


def test_two_x_expansion_raises():
    ffn = FeedForward(Config.from_name("gpt2"))
    sd = {k: v[..., :1536] if k.startswith("c_fc") else v[:1536] if k == "c_proj.weight" else v
          for k, v in ffn.state_dict().items()}
    with pytest.raises(RuntimeError, match="size mismatch for c_fc.weight"):
        ffn.load_state_dict(sd)


@pytest.mark.parametrize("x, error, message", [
    (torch.randn(2, 3, 512), ShapeError, r"shape \(2, 3, 512\); expected \(\.\.\., 768\)"),
    (torch.tensor(1.0), ShapeError, r"shape \(\); expected \(\.\.\., 768\)"),
    (torch.ones(2, 768, dtype=torch.int64), InputError, "float tensor, got dtype torch.int64"),
    (torch.ones(2, 768, dtype=torch.bool), InputError, "float tensor, got dtype torch.bool"),
    (torch.ones(2, 768, dtype=torch.float64), InputError, "dtype torch.float64 but its weights are torch.float32"),
    (np.ones((2, 768), dtype=np.float32), InputError, "must be a torch.Tensor, got ndarray"),
])
def test_bad_input_is_a_clear_error(x, error, message):
    with pytest.raises(error, match=message):
        FeedForward(Config.from_name("gpt2"))(x)


def test_the_cuda_epilogue_is_used_only_where_its_gelu_is_tanh():
    """torch._addmm_activation's GELU is the device's: exact on the CPU, so the check refuses it there (on a
    GPU, cuBLASLt's epilogue is the tanh form); the FFN then runs its plain ops."""
    from gpt2ffn.kernels import cuda
    assert not cuda.epilogue_gelu_is_tanh("cpu") and not cuda.epilogue_gelu_is_tanh("cpu", torch.bfloat16)
    tanh, exact = cuda.epilogue_gelu_errors("cpu")
    assert exact < 1e-6 and abs(tanh - 4.73e-4) < 1e-6  # the two forms' largest gap, at |x| = 2.70
    assert cuda.choices()["epilogue_gelu_errors"]["cpu"] == {"max_vs_tanh": tanh, "max_vs_exact": exact}
    x, w1, b1, w2, b2 = torch.randn(4, 8), torch.randn(8, 32), torch.randn(32), torch.randn(32, 8), torch.randn(8)
    assert cuda.choose(x, w1, b1, w2, b2, None, 4) == "plain"
    from gpt2ffn.kernels import gemm_gelu
    assert not gemm_gelu.available(torch.randn(2048, 8, dtype=torch.bfloat16))  # CUDA only


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_cuda_ffn_matches_hf_whichever_path_is_chosen(tokens, dtype, monkeypatch):
    """On a GPU (TF32 off): the FFN (fused epilogue or plain, as chosen there for the dtype) within the dtype's
    tolerance of HF's GPT2MLP in that dtype, and the choice recorded."""
    from gpt2ffn import kernels
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cfg = Config.from_name("gpt2")
    ffn = FeedForward(cfg).cuda().eval().to(dtype)
    mlp = hf_mlp(cfg).cuda().eval().to(dtype)
    mlp.load_state_dict(ffn.state_dict())
    x = torch.randn(tokens, cfg.n_embd, device="cuda", dtype=dtype)
    with torch.no_grad():
        tol = tolerance(dtype)
        torch.testing.assert_close(ffn(x), mlp(x), atol=tol.atol, rtol=tol.rtol)
    assert any(str(dtype) in k for k in kernels.cuda.choices()["ffn"])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_gemm_gelu_matches_the_plain_ops(dtype, monkeypatch):
    """On a GPU: kernels/gemm_gelu.py's c_fc + bias + tanh GELU within the dtype's tolerance of the same in fp32
    (GPT-2's shape and an odd one), and (bf16) the FFN forced through it within the tolerance of HF's GPT2MLP."""
    import torch.nn.functional as F

    from gpt2ffn.kernels import cuda, gemm_gelu
    if not gemm_gelu.available(torch.empty(gemm_gelu.MIN_TOKENS, 8, device="cuda", dtype=dtype)):
        pytest.skip("Triton does not build kernels on this install")
    tol = tolerance(dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    for M, K, N in ((1500, 768, 3072), (1031, 200, 333)):
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        w = (0.05 * torch.randn(K, N, device="cuda", generator=g)).to(dtype)
        b = torch.randn(N, device="cuda", generator=g).to(dtype)
        want = F.gelu(x.float() @ w.float() + b.float(), approximate="tanh")
        torch.testing.assert_close(gemm_gelu.gemm_bias_gelu(x, w, b).float(), want, atol=tol.atol, rtol=tol.rtol)
    if dtype != torch.bfloat16:  # the FFN against HF: in bf16, the dtype served on GPUs
        return
    monkeypatch.setattr(cuda, "FORCED", "triton")
    cfg = Config.from_name("gpt2")
    ffn = FeedForward(cfg).cuda().eval().to(dtype)
    mlp = hf_mlp(cfg).cuda().eval().to(dtype)
    mlp.load_state_dict(ffn.state_dict())
    x = torch.randn(2048, cfg.n_embd, device="cuda", dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(ffn(x), mlp(x), atol=tol.atol, rtol=tol.rtol)


def test_transformers_gpt2config_builds_it():
    """FeedForward(hf_model.config): HF's GPT2Config, its width and activation taken, the rest ignored."""
    from transformers import GPT2Config
    f = FeedForward(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_inner=200, activation_function="gelu"))
    assert f.config.n_embd == 64 and f.config.hidden == 200 and f.config.gelu_approximate == "none"
    assert tuple(f.c_fc.weight.shape) == (64, 200)
    with pytest.raises(ConfigError, match="transformers' GPT2Config, got LlamaConfig"):
        from transformers import LlamaConfig
        FeedForward(LlamaConfig())


def test_the_reference_reads_hfs_activation_and_names_bad_input():
    """From an outside round: FFN.from_module(HF's GPT2MLP) took tanh whatever its activation (2.4e-3 off for
    'gelu'); approximate='exact' was a bare KeyError; a block's 'mlp.'-prefixed state dict, a 1-D weight, torch
    weights, nn.Linear's [out, in] weights and token ids as input each failed unnamed."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    from gpt2ffn.errors import ShapeError
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32) * 3
    for act, form in (("gelu", "none"), ("gelu_new", "tanh"), ("gelu_pytorch_tanh", "tanh"), ("relu", "relu")):
        mlp = GPT2MLP(32, GPT2Config(n_embd=8, n_inner=32, activation_function=act)).eval()
        with torch.no_grad():
            mlp.c_fc.bias.normal_(), mlp.c_proj.bias.normal_()
            want = mlp(torch.from_numpy(x)).numpy()
        ref = reference.FFN.from_module(mlp)
        assert ref.approximate == form and np.abs(ref(x) - want).max() <= 1e-5, act
    sd = {f"mlp.{k}": v for k, v in mlp.state_dict().items()}
    assert np.abs(reference.FFN.from_state_dict(sd, "relu")(x) - want).max() <= 1e-5
    w = {k: v.numpy() for k, v in mlp.state_dict().items()}
    args = (w["c_fc.weight"], w["c_fc.bias"], w["c_proj.weight"], w["c_proj.bias"])
    assert np.abs(reference.ffn_forward(x, *map(torch.from_numpy, args), "relu") - want).max() <= 1e-5
    with pytest.raises(ValueError, match="approximate must be 'tanh' .*, 'none' .* or 'relu', got 'exact'"):
        reference.ffn_forward(x, *args, approximate="exact")
    with pytest.raises(ShapeError, match=r"the weights look like nn.Linear's \[out, in\]"):
        reference.ffn_forward(x[:, :1].repeat(32, 1), args[0].T, args[1], args[2].T, args[3])
    with pytest.raises(ShapeError, match=r"c_fc.weight has shape \(32,\); expected 2 dimensions"):
        reference.ffn_forward(x, args[0][0], *args[1:])
    with pytest.raises(ShapeError, match="input has dtype int64; the FFN takes float activations"):
        reference.ffn_forward(np.ones((2, 8), np.int64), *args)


def test_the_reference_takes_a_blocks_state_dict():
    """A block's state dict (attn.c_proj beside mlp.c_proj) was refused as holding two FFNs."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    block = GPT2Block(GPT2Config(n_embd=8, n_head=2, n_inner=32)).eval()
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    with torch.no_grad():
        want = block.mlp(torch.from_numpy(x)).numpy()
    assert np.abs(reference.FFN.from_state_dict(block.state_dict())(x) - want).max() <= 1e-5
