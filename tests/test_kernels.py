"""Every fast path against the numpy reference: each path, token bucket, odd sizes, non-contiguous input."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import hf_mlp, randomize_
from gpt2ffn import Config, FeedForward, Gpt2ffnError, kernels, patch_hf, reference, tolerance
from gpt2ffn.kernels import cpu

SIZES = [Config(n_embd=768), Config(n_embd=200, n_inner=600, n_head=8), Config(n_embd=96, n_inner=200, n_head=1)]
TOKENS = [1, 3, 8, 17, 64, 300]


def weights(cfg, seed=0):
    ffn = FeedForward(cfg)
    ffn.load_state_dict(hf_mlp(cfg, seed).state_dict())
    return ffn.eval()


@pytest.mark.parametrize("path", list(cpu.PATHS))
@pytest.mark.parametrize("approximate", ["tanh", "none", "relu"])
@pytest.mark.parametrize("cfg", SIZES, ids=lambda c: f"d{c.n_embd}h{c.hidden}")
def test_every_path_matches_reference(path, approximate, cfg):
    ffn = weights(cfg)
    p = [t.detach() for t in (ffn.c_fc.weight, ffn.c_fc.bias, ffn.c_proj.weight, ffn.c_proj.bias)]
    ref = reference.FFN.from_state_dict(ffn.state_dict(), approximate)
    tol = tolerance(torch.float32)
    for T in TOKENS:
        x = 3 * torch.randn(T, cfg.n_embd, generator=torch.Generator().manual_seed(T))
        y = cpu.run_path(path, x, *p, approximate)
        np.testing.assert_allclose(y.numpy(), ref(x.numpy()), atol=tol.atol, rtol=tol.rtol, err_msg=f"{path} T={T}")


def test_dispatcher_runs_one_fixed_path():
    """Inference above DECODE_TOKENS runs cpu.DEFAULT bit for bit at every size, never a path a timing picked (the
    GELU forms round differently, so a race made two processes disagree)."""
    cfg = Config(n_embd=200, n_inner=600, n_head=8)
    ffn = weights(cfg)
    p = [t.detach() for t in (ffn.c_fc.weight, ffn.c_fc.bias, ffn.c_proj.weight, ffn.c_proj.bias)]
    assert kernels.choose() == cpu.DEFAULT and kernels.choices() == {"cpu fp32": cpu.DEFAULT}
    with torch.no_grad():
        for T in (20, 30, 200):
            x = torch.randn(T, 200, generator=torch.Generator().manual_seed(T))
            y = ffn(x)
            assert torch.equal(y, cpu.run_path(cpu.DEFAULT, x, *p, "tanh")), T
            other = "torch+aten" if cpu.DEFAULT != "torch+aten" else "torch+sigmoid"
            assert not torch.equal(y, cpu.run_path(other, x, *p, "tanh")), T  # the forms do differ
    assert kernels.bucket(1) == 1 and kernels.bucket(17) == 32 and kernels.bucket(2048) == 2048


def test_non_contiguous_and_leading_dims_through_module():
    cfg = Config(n_embd=200, n_inner=600, n_head=8)
    ffn = weights(cfg)
    ref = reference.FFN.from_state_dict(ffn.state_dict())
    x = torch.randn(40, 3, 200)
    with torch.no_grad():
        for xi in (x.transpose(0, 1), x[::2], x[:, 1], x[..., None, :].expand(40, 3, 2, 200)):
            assert not xi.is_contiguous()
            np.testing.assert_allclose(ffn(xi).numpy(), ref(xi.contiguous().numpy()), atol=1e-5, rtol=1e-5)


def test_output_is_not_a_reused_buffer():
    ffn = weights(Config(n_embd=96, n_inner=200, n_head=1))
    with torch.no_grad():
        a = ffn(torch.ones(64, 96))
        keep = a.clone()
        ffn(torch.zeros(64, 96))
    assert torch.equal(a, keep)


def test_two_threads_on_one_module():
    cfg = Config(n_embd=200, n_inner=600, n_head=8)
    ffn = weights(cfg)
    ref = reference.FFN.from_state_dict(ffn.state_dict())
    inputs = [torch.randn(128, 200, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    errors = []

    def work(x):
        expected = ref(x.numpy())
        for _ in range(50):
            with torch.no_grad():
                y = ffn(x).numpy()
            errors.append(float(np.abs(y - expected).max()))

    threads = [threading.Thread(target=work, args=(x,)) for x in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 100 and max(errors) <= 1e-5


@pytest.mark.parametrize("approximate_name", ["gelu_new", "gelu", "relu"])
def test_recompute_gelu_gradients_equal_plain_autograd(approximate_name):
    cfg = Config(n_embd=96, n_inner=200, n_head=1, activation_function=approximate_name, resid_pdrop=0.0)
    ffn = weights(cfg).train()
    x = torch.randn(2, 9, 96, requires_grad=True)
    g = torch.randn(2, 9, 96)
    ffn(x).backward(g)
    ours = [x.grad] + [p.grad for p in ffn.parameters()]
    x2 = x.detach().clone().requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in ffn.parameters()]
    y = kernels.plain(x2.reshape(-1, 96), *params, cfg.gelu_approximate).view(2, 9, 96)
    y.backward(g)
    for a, b in zip(ours, [x2.grad] + [p.grad for p in params]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_recompute_gelu_gradcheck_float64():
    ffn = FeedForward(Config(n_embd=8, n_inner=24, n_head=2, resid_pdrop=0.0)).double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    args = (x, ffn.c_fc.weight, ffn.c_fc.bias, ffn.c_proj.weight, ffn.c_proj.bias)
    assert torch.autograd.gradcheck(lambda *a: kernels.RecomputeGELU.apply(*a, "tanh"), args)


def test_recompute_gelu_saves_less():
    from gpt2ffn.bench import saved_bytes
    cfg = Config(n_embd=96, n_inner=384, n_head=1, resid_pdrop=0.0)
    ffn = weights(cfg).train()
    mlp = hf_mlp(cfg).train()
    x = torch.randn(64, 96, requires_grad=True)
    ours, _ = saved_bytes(lambda: ffn(x), ffn)
    theirs, _ = saved_bytes(lambda: mlp(x), mlp)
    assert ours == 64 * (96 + 384) * 4  # x and the pre-activation only
    assert ours <= 0.6 * theirs


def test_torch_compile_of_a_model_holding_it():
    torch._dynamo.reset()
    cfg = Config(n_embd=32, n_inner=64, n_head=1, resid_pdrop=0.0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(32), weights(cfg)).eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), expected, atol=1e-6, rtol=1e-6)


def test_patch_hf_keeps_logits_and_generate():
    hf_cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=128)
    model = randomize_(GPT2LMHeadModel(hf_cfg), seed=3).eval()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    shared = model.transformer.h[0].mlp.c_fc.weight
    assert patch_hf(model) == 2
    assert type(model.transformer.h[0].mlp) is FeedForward
    assert model.transformer.h[0].mlp.c_fc.weight is shared  # Parameters shared, not copied
    with torch.no_grad():
        assert (model(ids).logits - logits).abs().max().item() <= 1e-5
        assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0), tokens)
    with pytest.raises(Gpt2ffnError, match=r"found no GPT2MLP in GPT2LMHeadModel \(already patched\?\)"):
        patch_hf(model)


def test_patch_hf_refuses_what_it_does_not_understand():
    with pytest.raises(Gpt2ffnError, match="takes a transformers GPT-2 model .* got Linear"):
        patch_hf(torch.nn.Linear(2, 2))
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50, activation_function="quick_gelu"))
    with pytest.raises(Gpt2ffnError, match="'quick_gelu' is not one gpt2ffn computes"):
        patch_hf(model)
    assert type(model.transformer.h[0].mlp).__name__ == "GPT2MLP"


def test_bench_quick_smoke(tmp_path, capsys, monkeypatch):
    """No --out: the results go to ./gpt2ffn-bench, never into a repository's committed benchmarks/results."""
    from gpt2ffn.cli import main
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--dims", "96", "--tokens", "1,32", "--repeats", "10", "--backward"]) == 0
    assert not (tmp_path / "benchmarks").exists()
    tmp_path = tmp_path / "gpt2ffn-bench"
    import json
    result = json.loads((tmp_path / "bench-cpu.json").read_text())
    impls = {r["impl"] for r in result["forward"]}
    assert {"gpt2ffn", "HF GPT2MLP", "book FeedForward", "Linear+GELU(tanh)+Linear",
            "torch.compile(Linear+GELU+Linear)", "numpy reference", "floor (torch mm)"} <= impls
    assert all(r["correct"] is not False for r in result["forward"])
    assert (tmp_path / "bench-cpu.png").read_bytes()[:4] == b"\x89PNG"
    assert "| 96, 32 |" in capsys.readouterr().out
    assert result["noise"]["entries"] >= len(impls) and result["noise"]["where"].startswith(("d=96 ", "backward d=96 "))


def test_bench_says_when_the_machine_moved_its_timings(capsys):
    """rounds() keeps each entry's spread (interquartile range / median); noise() names the worst, in one line
    when it is 10% or more, and says nothing for steady timings."""
    from gpt2ffn import bench
    bench.SPREAD.clear()
    steady, shaky = iter([0.010] * 12), iter([0.010, 0.020] * 6)  # 2 warm-up calls each, then 10 timed
    ms = bench.rounds({"steady": lambda: next(steady), "shaky": lambda: next(shaky)}, 10, self_timed=True, what="x")
    assert ms["steady"] == 10.0 and ms["shaky"] == 15.0
    said = bench.noise()
    assert said["where"] == "x shaky" and said["max_iqr_over_median"] > 0.5 and said["entries"] == 2
    said_line = capsys.readouterr().out
    assert "moved between repeats by up to 67% of their median (interquartile range, x shaky)" in said_line
    bench.SPREAD.clear()
    steady = iter([0.010] * 12)
    bench.rounds({"steady": lambda: next(steady)}, 10, self_timed=True)
    assert bench.noise() == {"max_iqr_over_median": 0.0, "where": "steady", "entries": 1}
    assert capsys.readouterr().out == ""
    bench.SPREAD.clear()


def test_import_sets_a_short_openmp_spin_unless_told():
    """gpt2ffn sets GOMP_SPINCOUNT=6000 on import (libgomp's 300,000 spins through a busy neighbour's time slice:
    README, "A CPU shared with other work"): where unset, with no OMP_WAIT_POLICY given and torch not loaded yet;
    a user's value wins."""
    def spin(first="", **env):  # started at once, read below: the four imports overlap
        base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
        code = f"import os; {first}import gpt2ffn; print(os.environ.get('GOMP_SPINCOUNT'))"
        return subprocess.Popen([sys.executable, "-c", code], env={**base, **env}, stdout=subprocess.PIPE, text=True)
    runs = [spin(), spin(GOMP_SPINCOUNT="100"), spin(OMP_WAIT_POLICY="active"),
            spin("import torch; ")]  # the last: libgomp has read its variables, setting one now would mislead
    outs = [p.communicate(timeout=120)[0].strip() for p in runs]
    assert [p.returncode for p in runs] == [0] * 4
    assert outs == ["6000", "100", "None", "None"], outs


def test_import_leaves_torch_distributed_tensor_unloaded():
    """`import gpt2ffn` (every CLI command, every server and engine process) does not import
    torch.distributed.tensor, ~0.9 s of start-up: gpt2ffn.parallel is imported where --tp > 1 needs it."""
    code = "import sys, gpt2ffn.cli, gpt2ffn.serving.http; print('torch.distributed.tensor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_torch_compile_fullgraph_of_a_plain_gpt2(hf_dir, small_model):
    """torch.compile(GPT2, fullgraph=True) of a model of plain torch modules (precision=None) stopped at check_ids'
    int(ids.min()) (a data-dependent value) and then at the native causal attention: under compile the range check
    is left to the embedding, and attention is SDPA; the logits equal HF's."""
    from gpt2ffn import GPT2
    torch._dynamo.reset()
    model = GPT2.from_pretrained(hf_dir, precision=None).eval()
    ids = torch.randint(0, small_model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(ids), small_model.eval()(ids).logits, atol=1e-5, rtol=1e-5)
