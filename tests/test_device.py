"""--device on generate, serve and bench: auto resolves to what torch sees, a missing GPU is one line and exit 2,
bf16 is CUDA's default dtype, the KV cache takes a fraction of the free memory. The tests marked cuda run where a
GPU is present (a lent machine) and are skipped in CI."""

import pytest
import torch
from transformers import GPT2LMHeadModel

from gpt2ffn import Config
from gpt2ffn.cli import main
from gpt2ffn.errors import Gpt2ffnError
from gpt2ffn.generate import Sampling, generate
from gpt2ffn.loading import default_dtype, load, resolve_device
from gpt2ffn.model import load_model
from gpt2ffn.serving import engine as engine_mod
from gpt2ffn.serving.engine import Engine, default_kv_tokens

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal where torch sees no GPU")


def test_auto_is_what_torch_sees_and_names_are_checked():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("cpu") == "cpu"
    for bad in ("tpu", "cuda:x", "gpu"):
        with pytest.raises(Gpt2ffnError, match="auto, cpu, cuda or cuda:N"):
            resolve_device(bad)
    assert default_dtype("cuda:0") == torch.bfloat16 and default_dtype("cpu") == torch.float32


@no_cuda
def test_cuda_without_a_gpu_is_one_line_and_exit_2(capsys):
    for argv in (["generate", "hi", "--model", "random:tiny", "--device", "cuda"],
                 ["serve", "--model", "random:tiny", "--device", "cuda:0"],
                 ["bench", "--model", "--device", "cuda"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "sees no CUDA device" in err[0], err


def test_cpu_default_dtype_and_auto_on_this_machine(capsys):
    model, _, _ = load("random:tiny", device="auto")
    assert model.transformer.wte.weight.device.type == resolve_device("auto").split(":")[0]
    model, _, _ = load("random:tiny")
    assert model.transformer.wte.weight.dtype == torch.float32
    assert main(["generate", "hi", "--model", "random:tiny", "--device", "cpu", "--max-new-tokens", "2"]) == 0


def test_cuda_refuses_cpu_formats():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU to get past the device check")
    with pytest.raises(Gpt2ffnError, match="packs weights for gpt2ffn's CPU kernels"):
        load("random:tiny", precision="int8", device="cuda")


def test_kv_cache_fraction(monkeypatch):
    cfg = Config.from_name("gpt2")                        # 2 * 12 * 768 * 4 = 73,728 bytes a position in fp32
    monkeypatch.setattr(engine_mod, "free_memory", lambda device: 1 << 30)
    per = 2 * cfg.n_layer * cfg.n_embd * 4
    assert default_kv_tokens(cfg, 64, torch.float32) == (1 << 30) // 4 // per                # a quarter
    assert default_kv_tokens(cfg, 64, torch.float32, fraction=0.5) == (1 << 30) // 2 // per
    assert default_kv_tokens(cfg, 2, torch.float32, fraction=0.5) == 2 * cfg.n_positions     # no more than needed
    assert default_kv_tokens(cfg, 64, torch.float32, fraction=1e-6) == cfg.n_positions       # one context at least
    monkeypatch.setattr(engine_mod, "free_memory", lambda device: 64 << 30)
    assert default_kv_tokens(cfg, 64, torch.float32) == (2 << 30) // per                     # the 2 GiB cap
    assert default_kv_tokens(cfg, 64, torch.float32, fraction=0.25) == 64 * cfg.n_positions  # explicit: no cap
    for bad in (0, -0.1, 1.5):
        with pytest.raises(Gpt2ffnError, match=r"fraction of free memory must be in \(0, 1\]"):
            default_kv_tokens(cfg, 64, torch.float32, fraction=bad)


def test_serve_refuses_a_bad_fraction_before_loading(capsys):
    assert main(["serve", "--model", "random:tiny", "--kv-cache-fraction", "0"]) == 2
    assert "--kv-cache-fraction must be in (0, 1], got 0.0" in capsys.readouterr().err


def test_engine_sizes_its_cache_by_the_fraction(monkeypatch):
    monkeypatch.setattr(engine_mod, "free_memory", lambda device: 1 << 20)
    model, _, _ = load("random:tiny", precision=None)
    big = Engine(model, max_batch=64, kv_fraction=1.0)
    small = Engine(model, max_batch=64, kv_fraction=0.1)
    assert big.cache.num_blocks > small.cache.num_blocks


@pytest.mark.cuda
def test_cuda_model_and_engine_match_hf_on_the_card(hf_dir):
    """On a GPU: fp32 logits within the CUDA tolerance of HF's on the same card, greedy tokens equal (bf16 too)."""
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]], device="cuda")
    hf = GPT2LMHeadModel.from_pretrained(hf_dir).to("cuda").eval()
    hf.generation_config.eos_token_id = None
    model = load_model(str(hf_dir), precision=None).to("cuda")  # weights only: the checkpoint has no tokenizer
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() < 1e-4
        want = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 6:].tolist()
    assert generate(model, [ids[0].tolist()], Sampling(max_new_tokens=8))[0] == want
    bf16 = load_model(str(hf_dir), precision=None).to("cuda", torch.bfloat16)
    out = generate(bf16, [ids[0].tolist()] * 3, Sampling(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=1))
    assert len(out) == 3 and all(len(o) == 8 for o in out)


def test_bench_model_times_any_random_size_and_refuses_a_checkpoint():
    from gpt2ffn.bench import bench_model
    # decode timed by itself (steps after an untimed prefill): a rate however small the model; as generate's time
    # less prefill's it came out NaN (<= 0) on a fast CPU (AMD EPYC Zen 5)
    r = bench_model(("fp32",), prompt_tokens=8, new_tokens=4, repeats=2, weights="random:tiny", log=lambda *a: None)
    assert r["model"] == "random:tiny:0" and r["engines"]["gpt2ffn fp32"]["greedy_same_as_hf"] == 1.0
    for e in r["engines"].values():
        assert e["decode_ms"] > 0 and e["decode_tokens_per_s"] == pytest.approx(4 / e["decode_ms"] * 1e3)
    with pytest.raises(Gpt2ffnError, match=r"random weights \(random:<preset>\[:seed\]\), not 'some/dir'"):
        bench_model(("fp32",), weights="some/dir")
