"""Reading and writing HF GPT-2 checkpoints: safetensors (single or sharded) and pytorch_model.bin.

Two key layouts exist in the wild and both are read: openai-community/gpt2's own file has no prefix
(`h.0.mlp.c_fc.weight`, plus `h.0.attn.bias` mask buffers), while `save_pretrained` of GPT2LMHeadModel
writes `transformer.h.0.mlp.c_fc.weight`. Names here are normalized to the unprefixed form.
Tensors are read lazily: asking for one block's FFN reads those four tensors, not the whole file.
"""

import json
import os
import pickle
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import Config
from .errors import CheckpointError, Gpt2ffnError, ShapeError

PREFIX = "transformer."
FFN_TENSORS = ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")
# The files a checkpoint directory may hold, in the order they are tried.
DIR_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# What HF's Trainer saves beside a model in a checkpoint directory: never the model's weights.
TRAINER_FILES = ("rng_state", "optimizer", "scheduler", "training_args", "trainer_state")
# Buffers that some checkpoints carry and no module needs: the causal mask and its fill value.
IGNORED = re.compile(r"(^|\.)attn\.(bias|masked_bias)$")


# HF's old short names of OpenAI's GPT-2s, now under openai-community/ (the hub redirects; a cache may hold either)
HUB_ALIASES = {f"gpt2{s}": f"openai-community/gpt2{s}" for s in ("", "-medium", "-large", "-xl")}


def hub_cache() -> Path:
    """The local HF hub cache's directory, as huggingface_hub finds it (HF_HUB_CACHE, else HF_HOME/hub)."""
    return Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or Path(
        os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"), "hub"))


def cached_snapshot(repo_id: str) -> Path | None:
    """A model id ('openai-community/gpt2', 'gpt2') -> its snapshot directory in the local HF cache (the one
    refs/main names, else the newest), or None. Never a download."""
    names = [repo_id] + [n for n, full in HUB_ALIASES.items() if full == repo_id]
    names += [HUB_ALIASES[repo_id]] if repo_id in HUB_ALIASES else []
    for name in dict.fromkeys(names):
        repo = hub_cache() / ("models--" + name.replace("/", "--"))
        ref = repo / "refs" / "main"
        if ref.is_file() and (repo / "snapshots" / ref.read_text().strip() / "config.json").is_file():
            return repo / "snapshots" / ref.read_text().strip()
        snaps = sorted((repo / "snapshots").glob("*/config.json"), key=lambda p: p.stat().st_mtime)
        if snaps:
            return snaps[-1].parent
    return None


def resolve_checkpoint(spec) -> Path:
    """A checkpoint directory or file as given, else a model id found in the local HF cache; else an error
    naming both places."""
    path = Path(spec)
    if path.exists():
        return path
    looks_like_id = isinstance(spec, str) and spec.count("/") <= 1 and not spec.startswith((".", "/", "~"))
    found = cached_snapshot(spec) if looks_like_id else None
    if found is not None:
        return found
    if not looks_like_id:
        raise CheckpointError(f"checkpoint {path} does not exist")
    raise CheckpointError(f"checkpoint {path} does not exist, nor is {spec!r} in the local HF cache ({hub_cache()}); "
                          f"gpt2ffn never downloads: get it where there is network (`hf download {spec}`, "
                          f"huggingface_hub's CLI), then pass its directory")


def ffn_shapes(cfg: Config) -> dict:
    """The shape each FFN tensor must have under cfg, in HF's Conv1D layout."""
    d, hidden = cfg.n_embd, cfg.hidden
    return {"c_fc.weight": (d, hidden), "c_fc.bias": (hidden,), "c_proj.weight": (hidden, d), "c_proj.bias": (d,)}


class Checkpoint:
    """A lazy, read-only view of an HF GPT-2 checkpoint (a directory or one file)."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"checkpoint {self.path} does not exist")
        self.files = self._files()
        self._where = {}    # normalized name -> (file, key in that file)
        self._handles = {}  # file -> open safetensors handle or loaded (mmap) state dict
        for file in dict.fromkeys(self.files):
            for key in self._keys(file):
                if not IGNORED.search(key):
                    self._where[key.removeprefix(PREFIX)] = (file, key)
        if not self._where:
            raise CheckpointError(f"checkpoint {self.path} holds no tensors")

    def _files(self) -> list:
        if self.path.is_dir():
            for name in DIR_FILES:
                if (self.path / name).is_file():
                    return self._files_of(self.path / name)
            present = sorted(p.name for p in self.path.iterdir())
            saved = [self.path / n for n in present if n.endswith((".pt", ".pth")) and (self.path / n).is_file()
                     and not n.startswith(TRAINER_FILES)]
            if len(saved) == 1:  # torch.save(model.state_dict(), "model.pt") beside config.json: what the file holds
                return self._files_of(saved[0])
            raise CheckpointError(f"checkpoint directory {self.path} has none of {', '.join(DIR_FILES)} "
                                  f"(it has: {', '.join(present) or 'nothing'})")
        return self._files_of(self.path)

    def _files_of(self, file: Path) -> list:
        if file.stat().st_size == 0:
            raise CheckpointError(f"checkpoint file {file} is empty (0 bytes)")
        if file.name.endswith(".index.json"):
            try:
                weight_map = json.loads(file.read_text())["weight_map"]
                shards = [file.parent / weight_map[k] for k in weight_map]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{file} is not a valid shard index (need a 'weight_map' object): {e}") from None
            missing = sorted({s.name for s in shards if not s.is_file()})
            if missing:
                raise CheckpointError(f"{file} names shard files that do not exist: {', '.join(missing)}")
            for shard in dict.fromkeys(shards):
                if shard.stat().st_size == 0:
                    raise CheckpointError(f"checkpoint shard {shard} is empty (0 bytes)")
            return shards
        return [file]

    def _open(self, file: Path):
        if file not in self._handles:
            self._handles[file] = _open_safetensors(file) if file.suffix == ".safetensors" else _open_torch(file)
        return self._handles[file]

    def _keys(self, file: Path):
        return list(self._open(file).keys())

    @property
    def names(self) -> list:
        """Every tensor name, normalized (no 'transformer.' prefix, no attn.bias buffers)."""
        return sorted(self._where)

    @property
    def layers(self) -> list:
        """The block indices that have at least one tensor here."""
        return sorted({int(m.group(1)) for n in self._where if (m := re.match(r"h\.(\d+)\.", n))})

    def __contains__(self, name):
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        """One tensor by normalized name; only that tensor is read from disk."""
        if name not in self._where:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {name!r}; {self._describe()}")
        file, key = self._where[name]
        handle = self._open(file)
        return handle.get_tensor(key) if hasattr(handle, "get_tensor") else handle[key]

    def _describe(self) -> str:
        layers = self.layers
        span = _span(layers)
        sample = [n for n in self.names if n.startswith(f"h.{layers[0]}.")] if layers else self.names[:8]
        return f"it has {span}; e.g. {', '.join(sample[:12])}"


def load_tensors(own: dict, ckpt: Checkpoint, what: str, config_file, optional=(), size: str = "", alias=None):
    """Copy every tensor of `own` (checkpoint name -> a model's tensor) from `ckpt`: each present, of the
    shape the config gives, and no tensor in the file that `what` (of `size`) does not have, other than
    `optional`. alias (checkpoint name -> Parameter): those Parameters take the file's tensor itself where its
    dtype is theirs (safetensors' memory map: no copy), for weights packed and let go at once; the caller sees
    that none is left holding it."""
    alias = alias or {}
    missing = [k for k in own if k not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt.path} lacks {len(missing)} tensors {what} needs, e.g. "
                              f"{', '.join(missing[:5])}")
    extra = [k for k in ckpt.names if k not in own and k not in optional]
    if extra:
        raise CheckpointError(f"checkpoint {ckpt.path} has tensors {what}{size} does not: {', '.join(extra[:5])}")
    with torch.no_grad():
        for name, target in own.items():
            t = ckpt.get(name)
            if tuple(t.shape) != tuple(target.shape):
                raise ShapeError(f"{name} has shape {tuple(t.shape)}; the config from {config_file} "
                                 f"expects {tuple(target.shape)}{Config.defaults_note(config_file)}")
            p = alias.get(name)
            if p is not None and t.dtype == p.dtype and t.is_contiguous():
                p.data = t
            else:
                target.copy_(t)


def _span(layers: list) -> str:
    if not layers:
        return "no transformer blocks"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}..{layers[-1]}"
    return f"layers {', '.join(map(str, layers))}"


def _open_safetensors(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own SafetensorError for a bad header
        raise CheckpointError(f"{file} is not a valid safetensors file: {e}") from None


def _open_torch(file: Path):
    """pytorch_model.bin with weights_only=True (no pickled code runs), memory-mapped where the format allows."""
    with open(file, "rb") as f:
        head = f.read(2)
    if head[:2] != b"PK" and head[:1] != b"\x80":  # neither torch.save's zip nor a legacy pickle
        what = " (it reads as JSON: a config?)" if head[:1] in (b"{", b"[") else ""
        raise CheckpointError(f"{file} is not a PyTorch checkpoint{what}: give the checkpoint's directory, or its "
                              "model.safetensors / pytorch_model.bin")
    try:
        try:
            sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
            sd = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        if isinstance(e, pickle.UnpicklingError) and "unsupported global" in str(e).lower():  # torch: a paragraph
            raise CheckpointError(f"{file} holds pickled Python objects besides tensors (a whole model saved with "
                                  "torch.save(model)?), which gpt2ffn does not unpickle: save its state_dict() "
                                  "instead, or the model with save_pretrained") from None
        first = re.sub(r"\x1b\[[0-9;]*m", "", str(e).strip()).splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{file} could not be read as a weights-only PyTorch checkpoint: {first}") from None
    if isinstance(sd, dict) and isinstance(sd.get("model"), dict) and "model_args" in sd:
        raise CheckpointError(f"{file} is a nanoGPT training checkpoint (its 'model' state dict, nn.Linear weights "
                              f"[out, in], with 'model_args' and the optimizer's state), not an HF one: build "
                              f"nanoGPT's GPT(GPTConfig(**model_args)), load_state_dict its 'model' (less the "
                              f"'_orig_mod.' prefix), then `gpt2ffn check` that model, or write HF's layout "
                              f"(Conv1D weights [in, out], config.json) for gpt2ffn to load")
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        bad = sorted(k for k, v in sd.items() if not isinstance(v, torch.Tensor))[:4] if isinstance(sd, dict) else []
        raise CheckpointError(f"{file} does not hold a state dict of tensors"
                              + (f" (not tensors: {', '.join(map(str, bad))})" if bad else
                                 f" (it holds a {type(sd).__name__})" if not isinstance(sd, dict) else ""))
    return sd


def _checkpoint_config(ckpt: Checkpoint, config) -> tuple:
    """The Config to check tensors against, and where it came from."""
    if config is not None:
        return Config.coerce(config), "the given config"
    directory = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
    if (directory / "config.json").is_file():
        return Config.from_pretrained(directory), str(directory / "config.json")
    return None, None


def load_ffn_state(path, layer: int = 0, config=None) -> tuple:
    """(Config, state dict) of block `layer`'s FFN, every shape checked against the config.

    The config is `config` if given, else the checkpoint's config.json, else inferred from c_fc.weight."""
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise CheckpointError(f"layer must be an int, got {layer!r}")
    ckpt = Checkpoint(path)
    cfg, source = _checkpoint_config(ckpt, config)
    layers = ckpt.layers
    if layer not in layers or (cfg is not None and layer >= cfg.n_layer):
        raise CheckpointError(f"layer {layer} is out of range: checkpoint {ckpt.path} has {_span(layers)}")
    state = {name: ckpt.get(f"h.{layer}.mlp.{name}") for name in FFN_TENSORS}
    if cfg is None:
        d, hidden = state["c_fc.weight"].shape
        # The FFN alone does not tell n_head or n_layer; these fill the config, the FFN does not use them.
        cfg = Config(n_embd=d, n_inner=None if hidden == 4 * d else hidden, n_head=1, n_layer=layers[-1] + 1)
        source = "c_fc.weight"
    for name, shape in ffn_shapes(cfg).items():
        actual = tuple(state[name].shape)
        if actual != shape:
            raise ShapeError(f"h.{layer}.mlp.{name} has shape {actual}; Config(n_embd={cfg.n_embd}, "
                             f"n_inner={cfg.hidden}) from {source} expects {shape}")
    return cfg, state


def save_ffn(ffn, path, layer: int = 0):
    """Write an FFN as HF-layout safetensors (`h.{layer}.mlp.*`), bit-identical on reload.

    A path ending in .safetensors is written as that file; any other path is a directory that gets
    model.safetensors and a config.json, so HF's from_pretrained reads it."""
    path = Path(path)
    tensors = {f"h.{layer}.mlp.{k}": v.detach().cpu().contiguous().clone() for k, v in ffn.state_dict().items()}
    if path.suffix == ".safetensors":
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"format": "pt"})
        return path
    if path.exists() and not path.is_dir():
        raise Gpt2ffnError(f"{path} is a file: save_ffn writes a directory (model.safetensors and config.json), or "
                           f"one file when the path ends in .safetensors")
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = ffn.config.to_hf_dict()
    hf.update(n_layer=max(ffn.config.n_layer, layer + 1), model_type="gpt2", architectures=["GPT2Model"])
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return path / "model.safetensors"
