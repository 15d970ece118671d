"""Shared helpers: seeded random HF GPT-2 parts (our reference), and checkpoints the tests make themselves."""

import atexit
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

from gpt2ffn import Config

# The kernel probe's cache (gpt2ffn.kernels.packed) in a directory of this test run, not the user's, removed when the
# run ends (each run once left one behind in /tmp).
if "GPT2FFN_CACHE" not in os.environ:
    os.environ["GPT2FFN_CACHE"] = tempfile.mkdtemp(prefix="gpt2ffn-cache-")
    atexit.register(shutil.rmtree, os.environ["GPT2FFN_CACHE"], ignore_errors=True)

# A suite started as a background job (`nohup bash .ci/run &`) begins with SIGINT ignored, and the servers the
# Ctrl-C tests start would inherit that: they then exited 0 (or aborted) where a Ctrl-C ends them with 130.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The widths of gpt2, -medium, -large, -xl, and an odd one whose hidden is not 4d.
WIDTHS = [Config(n_embd=768), Config(n_embd=1024, n_head=16), Config(n_embd=1280, n_head=20),
          Config(n_embd=1600, n_head=25), Config(n_embd=200, n_inner=600, n_head=8)]
ACTIVATIONS = ["gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu", "relu"]


def hf_config(cfg: Config, **overrides) -> GPT2Config:
    d = cfg.to_hf_dict()
    d.update(overrides)
    return GPT2Config(**d)


def randomize_(module: torch.nn.Module, seed: int, bias_std: float = 0.1) -> torch.nn.Module:
    """Seeded normal weights (std 0.02, as GPT-2's init) and non-zero biases, so a missing bias shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            std = bias_std if name.endswith("bias") and p.dim() == 1 else 0.02
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return module


def native_isas() -> list:
    """The instruction-set builds of gpt2ffn._C this CPU runs (avx512amx, avx512, avxvnni, avx2), for tests that run
    each."""
    from gpt2ffn.kernels.packed import _C
    out = []
    for name in ("avx512amx", "avx512", "avxvnni", "avx2") if _C is not None else ():
        try:
            _C.set_isa(_C.set_isa(name))
        except RuntimeError:
            continue
        out.append(name)
    return out


def hf_mlp(cfg: Config, seed: int = 0) -> GPT2MLP:
    """HF's own GPT2MLP for cfg, seeded random weights, eval mode."""
    return randomize_(GPT2MLP(cfg.hidden, hf_config(cfg)), seed).eval()


def hf_model(cfg: Config, seed: int = 0) -> GPT2LMHeadModel:
    """HF's own GPT2LMHeadModel for cfg, seeded random weights, eval mode."""
    model = GPT2LMHeadModel(hf_config(cfg))
    return randomize_(model, seed).eval()


SMALL = Config(n_embd=64, n_layer=3, n_head=4, n_positions=32, vocab_size=96, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="session")
def small_model():
    return hf_model(SMALL, seed=7)


@pytest.fixture(scope="session")
def hf_dir(small_model, tmp_path_factory) -> Path:
    """A checkpoint as save_pretrained writes it: model.safetensors with 'transformer.' keys."""
    d = tmp_path_factory.mktemp("hf_save_pretrained")
    small_model.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def quiet_dir(tmp_path_factory) -> Path:
    """A checkpoint saved from HF's random init (weights N(0, 0.02), biases 0), as a learner makes one: c_fc's
    outputs stay within |x| ~ 0.6 on the judge's prompt, where the exact GELU is within 1e-4 of the tanh one."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("quiet")
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128)).save_pretrained(path)
    return path


@pytest.fixture
def real_gpt2() -> Path:
    path = os.environ.get("GPT2FFN_REAL_GPT2")
    if not path:
        pytest.skip("set GPT2FFN_REAL_GPT2 to a local openai-community/gpt2 directory to run real-weight tests")
    return Path(path)


def pytest_collection_modifyitems(config, items):
    """Tests marked cuda run where a CUDA device is present (a lent GPU) and are skipped elsewhere (CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_ids(tmp_path_factory):
    """A small checkpoint saved with HF's GPT2Config defaults (bos/eos 50256, outside its vocab of 300) and a
    byte-level BPE trained here, of 280 tokens with <|endoftext|> (id 0); `plain/` the same tokenizer without it."""
    from tokenizers import ByteLevelBPETokenizer
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("default_ids")
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=300, n_positions=64)).save_pretrained(d)
    for sub, special in ((d, ["<|endoftext|>"]), (d / "plain", [])):
        sub.mkdir(exist_ok=True)
        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, vocab_size=280,
                                min_frequency=1, special_tokens=special)
        tok.save(str(sub / "tokenizer.json"))
    return d
