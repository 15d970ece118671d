import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Model

from conftest import SMALL, hf_mlp
from gpt2ffn import (
    Checkpoint,
    CheckpointError,
    Config,
    FeedForward,
    Gpt2ffnError,
    ShapeError,
    save_ffn,
    tolerance,
    weights,
)


def hf_block_out(model, layer, x):
    with torch.no_grad():
        return model.transformer.h[layer].mlp(x)


def openai_layout(model, directory):
    """Rewrite a model the way openai-community/gpt2's own file is: no prefix, attn.bias buffers, no lm_head."""
    sd = {k.removeprefix("transformer."): v.contiguous() for k, v in model.state_dict().items()
          if k != "lm_head.weight"}
    n = model.config.n_positions
    for layer in range(model.config.n_layer):
        sd[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        sd[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    directory.mkdir(exist_ok=True)
    save_file(sd, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    return directory


def test_checkpoint_layouts_normalize(small_model, hf_dir, tmp_path):
    ours = Checkpoint(openai_layout(small_model, tmp_path / "openai"))
    theirs = Checkpoint(hf_dir)
    assert "h.0.mlp.c_fc.weight" in ours and "h.0.mlp.c_fc.weight" in theirs
    assert not any(n.endswith((".attn.bias", ".attn.masked_bias")) for n in ours.names)
    assert ours.layers == theirs.layers == [0, 1, 2]


@pytest.mark.parametrize("layout", ["save_pretrained", "openai", "sharded", "bin", "bin_legacy", "file"])
@pytest.mark.parametrize("layer", [0, 2])
def test_from_pretrained_gives_hf_output(small_model, hf_dir, tmp_path, layout, layer):
    if layout == "save_pretrained":
        path = hf_dir
    elif layout == "openai":
        path = openai_layout(small_model, tmp_path / "openai")
    elif layout == "sharded":
        small_model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
        path = tmp_path / "sharded"
        assert (path / "model.safetensors.index.json").is_file()
    elif layout in ("bin", "bin_legacy"):
        path = tmp_path / layout
        path.mkdir()
        torch.save(small_model.state_dict(), path / "pytorch_model.bin",
                   _use_new_zipfile_serialization=(layout == "bin"))
        small_model.config.save_pretrained(path)
    else:
        path = hf_dir / "model.safetensors"
    ffn = FeedForward.from_pretrained(path, layer=layer)
    assert ffn.config.n_embd == SMALL.n_embd and not ffn.training
    hf = small_model.transformer.h[layer].mlp
    assert all(torch.equal(v, hf.state_dict()[k]) for k, v in ffn.state_dict().items())
    x = 3 * torch.randn(2, 4, SMALL.n_embd)
    tol = tolerance(torch.float32)
    torch.testing.assert_close(ffn(x).detach(), hf_block_out(small_model, layer, x), atol=tol.atol, rtol=tol.rtol)


def test_only_the_needed_tensors_are_read(hf_dir, monkeypatch):
    read = []
    real_open = weights._open_safetensors

    class Spy:
        def __init__(self, handle):
            self.handle = handle

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.handle.get_tensor(key)

    monkeypatch.setattr(weights, "_open_safetensors", lambda f: Spy(real_open(f)))
    FeedForward.from_pretrained(hf_dir, layer=1)
    assert sorted(read) == sorted(f"transformer.h.1.mlp.{n}" for n in weights.FFN_TENSORS)


def test_dtype_argument(hf_dir):
    ffn = FeedForward.from_pretrained(hf_dir, layer=0, dtype=torch.bfloat16)
    assert ffn.c_fc.weight.dtype == torch.bfloat16


def test_save_ffn_round_trip_bit_identical(tmp_path):
    cfg = Config(n_embd=200, n_inner=600, n_head=8, activation_function="gelu")
    ffn = FeedForward(cfg)
    ffn.load_state_dict(hf_mlp(cfg, seed=4).state_dict())
    save_ffn(ffn, tmp_path / "one.safetensors", layer=3)
    back = FeedForward.from_pretrained(tmp_path / "one.safetensors", layer=3, config=cfg)
    for k, v in ffn.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)
    assert set(load_file(tmp_path / "one.safetensors")) == {f"h.3.mlp.{n}" for n in weights.FFN_TENSORS}
    # A directory gets a config.json too, so the config (exact GELU, n_inner=600) comes back by itself.
    save_ffn(ffn, tmp_path / "dir", layer=1)
    again = FeedForward.from_pretrained(tmp_path / "dir", layer=1)
    assert again.config.activation_function == "gelu" and again.config.hidden == 600
    assert all(torch.equal(again.state_dict()[k], v) for k, v in ffn.state_dict().items())
    # An existing file that is not .safetensors is no directory to write into: said by name (was FileExistsError).
    with pytest.raises(Gpt2ffnError, match="dir/config.json is a file: save_ffn writes a directory"):
        save_ffn(ffn, tmp_path / "dir" / "config.json")


def test_hf_reads_what_save_ffn_writes(tmp_path):
    cfg = Config(n_embd=64, n_head=4, n_layer=2)
    ffn = FeedForward(cfg)
    ffn.load_state_dict(hf_mlp(cfg, seed=6).state_dict())
    save_ffn(ffn, tmp_path, layer=1)
    model = GPT2Model.from_pretrained(tmp_path)
    for k, v in ffn.state_dict().items():
        assert torch.equal(model.h[1].mlp.state_dict()[k], v)


# Bad checkpoints: each a clear error that names the thing.

def test_missing_empty_corrupt(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        FeedForward.from_pretrained(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="has none of model.safetensors.*it has: nothing"):
        FeedForward.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is empty"):
        FeedForward.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!garbage!")
    with pytest.raises(CheckpointError, match="is not a valid safetensors file"):
        FeedForward.from_pretrained(tmp_path)
    (tmp_path / "x.bin").write_bytes(b"not a pickle at all")
    with pytest.raises(CheckpointError, match="x.bin is not a PyTorch checkpoint: give the checkpoint's directory"):
        FeedForward.from_pretrained(tmp_path / "x.bin")
    (tmp_path / "x.bin").write_bytes(b"PK\x03\x04 a broken zip")
    with pytest.raises(CheckpointError, match="could not be read as a weights-only PyTorch checkpoint"):
        FeedForward.from_pretrained(tmp_path / "x.bin")
    (tmp_path / "config.json").write_text('{"n_embd": 64}')  # a file of the directory given for the directory
    with pytest.raises(CheckpointError, match=r"config.json is not a PyTorch checkpoint \(it reads as JSON"):
        FeedForward.from_pretrained(tmp_path / "config.json")


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_pickled_code_does_not_run(tmp_path):
    """A file holding pickled objects (code, or a whole model saved with torch.save(model)) is refused in one line
    of ours (torch's own says "two options" on a later line, with terminal bold codes)."""
    torch.save({"h.0.mlp.c_fc.weight": Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"holds pickled Python objects besides tensors \(a whole model saved "
                                              r"with torch.save\(model\)\?\), which gpt2ffn does not unpickle: save "
                                              r"its state_dict\(\) instead") as e:
        FeedForward.from_pretrained(tmp_path)
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value)


def test_missing_tensor_names_it_and_what_exists(small_model, tmp_path):
    sd = {k: v.clone() for k, v in small_model.state_dict().items() if k != "transformer.h.1.mlp.c_fc.bias"}
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"no tensor 'h.1.mlp.c_fc.bias'; it has layers 0..2; e.g. h.0."):
        FeedForward.from_pretrained(tmp_path, layer=1)


def test_layer_out_of_range(hf_dir):
    with pytest.raises(CheckpointError, match="layer 3 is out of range: .* has layers 0..2"):
        FeedForward.from_pretrained(hf_dir, layer=3)
    with pytest.raises(CheckpointError, match="layer -1 is out of range"):
        FeedForward.from_pretrained(hf_dir, layer=-1)
    with pytest.raises(CheckpointError, match="layer must be an int"):
        FeedForward.from_pretrained(hf_dir, layer="0")


def test_two_x_expansion_checkpoint_raises(tmp_path):
    half = Config(n_embd=768, n_inner=1536)
    save_ffn(FeedForward(half), tmp_path / "ffn.safetensors")
    with pytest.raises(ShapeError, match=r"h.0.mlp.c_fc.weight has shape \(768, 1536\); "
                                         r"Config\(n_embd=768, n_inner=3072\) from the given config "
                                         r"expects \(768, 3072\)"):
        FeedForward.from_pretrained(tmp_path / "ffn.safetensors", config="gpt2")
    # And when the directory's config.json says 4x, the same weights raise against it.
    save_ffn(FeedForward(half), tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["n_inner"] = None
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ShapeError, match="config.json expects"):
        FeedForward.from_pretrained(tmp_path / "d")


@pytest.mark.parametrize("drop, error, message", [
    (("n_head", "n_layer"), "ConfigError",
     "must divide by n_head=12: attention splits n_embd into n_head heads (CONFIG has no n_layer, n_head: GPT-2's 12, "
     "12 taken, as transformers does)"),
    (("n_embd",), "ShapeError", "CONFIG has no n_embd: GPT-2's 768 taken, as transformers does)"),
])
def test_a_config_without_its_sizes_says_which_defaults_it_took(hf_dir, tmp_path, drop, error, message):
    """A config.json lacking sizes takes GPT-2 small's, as HF's GPT2Config does; the error those cause (n_embd % n_head,
    a tensor's shape) says so, where it named only the side effect (an outside tester). A whole config says nothing."""
    import shutil

    from gpt2ffn import GPT2
    d = tmp_path / "ck"
    shutil.copytree(hf_dir, d)
    assert Config.defaults_note(d / "config.json") == ""
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in drop}))
    with pytest.raises(Gpt2ffnError) as e:
        GPT2.from_pretrained(d)
    assert type(e.value).__name__ == error and message.replace("CONFIG", str(d / "config.json")) in str(e.value)


def test_bad_shard_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"h.0.mlp.c_fc.weight": "a.safetensors"}}))
    with pytest.raises(CheckpointError, match="names shard files that do not exist: a.safetensors"):
        FeedForward.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(CheckpointError, match="not a valid shard index"):
        FeedForward.from_pretrained(tmp_path)


@pytest.mark.real_weights
def test_real_gpt2_every_layer(real_gpt2):
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained(real_gpt2).eval()
    x = torch.randn(1, 8, 768)
    for layer in range(12):
        ffn = FeedForward.from_pretrained(real_gpt2, layer=layer)
        with torch.no_grad():
            assert (ffn(x) - hf_block_out(model, layer, x)).abs().max().item() <= 1e-5
