"""Golden checkpoints: reference tensors taken from HF GPT-2's own modules, and a judge for any engine.

`extract` runs HF transformers' GPT2LMHeadModel with forward hooks and writes every stage of the chosen
blocks, with a manifest: as .npy files, raw little-endian float32 .bin files (for engines in C, Go, ... that
read them with fread), or one .safetensors file. Nothing here re-derives a stage: each tensor is what HF's
module returned (q/k/v are HF's c_attn output split by head). `verify` runs gpt2ffn's own stages on the golden
inputs, or judges another engine's tensors (the same three formats), and names the first checkpoint that
diverges.
"""

import hashlib
import itertools
import json
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import Config
from .diagnose import STAGES as FFN_STAGES
from .diagnose import FFNCase, blind_to
from .errors import CheckpointError, ConfigError, Gpt2ffnError
from .model import parse_random, random_hf_model
from .tolerances import GOLDEN_ATOL, GOLDEN_SCALED

FORMAT = "gpt2ffn-golden/1"
# How the tensors are stored: a .npy file each, a raw little-endian float32 .bin file each (C order; the shape
# is in manifest.json), or all in one .safetensors file under their names.
FILE_FORMATS = ("npy", "bin", "safetensors")
BUNDLE = "golden.safetensors"

# Seed 001's numbering, where it has one; 00, 08 and 09 extend it to the ends of the model.
CHECKPOINTS = {
    "00": "embeddings (wte + wpe)",
    "01": "LayerNorm (ln_1)",
    "02": "QKV projection (c_attn; q by head)",
    "03": "KV cache (k, v by head)",
    "04": "attention scores (softmax probabilities)",
    "05": "attention output (c_proj, + residual, ln_2)",
    "06": "FFN (c_fc, GELU, c_proj)",
    "07": "transformer block output",
    "08": "final LayerNorm (ln_f)",
    "09": "logits",
}
SHORT = {"00": "embed", "01": "ln_1", "02": "qkv", "03": "kv", "04": "scores", "05": "attn", "06": "ffn",
         "07": "block", "08": "ln_f", "09": "logits"}
# Per block, in forward order: (stage, checkpoint, what it is and its shape).
BLOCK_STAGES = [
    ("ln_1", "01", "ln_1(x), (1, T, d)"),
    ("c_attn", "02", "c_attn(ln_1), (1, T, 3d)"),
    ("q", "02", "queries by head, (1, H, T, d/H)"),
    ("k", "03", "keys by head: the KV cache, (1, H, T, d/H)"),
    ("v", "03", "values by head: the KV cache, (1, H, T, d/H)"),
    ("attn_probs", "04", "softmax(q k^T / sqrt(d/H) + causal mask), (1, H, T, T)"),
    ("attn_out", "05", "attn.c_proj output, (1, T, d)"),
    ("attn_resid", "05", "x + attention output, (1, T, d)"),
    ("ln_2", "05", "ln_2(x + attn), the FFN's input, (1, T, d)"),
    ("c_fc", "06", "c_fc(ln_2), (1, T, hidden)"),
    ("gelu", "06", "GELU(c_fc), (1, T, hidden)"),
    ("ffn", "06", "c_proj(GELU), the FFN's output, (1, T, d)"),
    ("block", "07", "x + attn + FFN, (1, T, d)"),
]
MODEL_STAGES = [
    ("embeddings", "00", "wte(ids) + wpe(positions), (1, T, d)"),
    ("ln_f", "08", "ln_f(last block), (1, T, d)"),
    ("logits", "09", "ln_f @ wte^T, (1, T, vocab)"),
]
# Block weights, HF layout ([in, out] for Conv1D), under seed 001's file names.
BLOCK_WEIGHTS = {
    "ln_1.weight": "ln_1_weight", "ln_1.bias": "ln_1_bias",
    "attn.c_attn.weight": "c_attn_weight", "attn.c_attn.bias": "c_attn_bias",
    "attn.c_proj.weight": "attn_c_proj_weight", "attn.c_proj.bias": "attn_c_proj_bias",
    "ln_2.weight": "ln_2_weight", "ln_2.bias": "ln_2_bias",
    "mlp.c_fc.weight": "c_fc_weight", "mlp.c_fc.bias": "c_fc_bias",
    "mlp.c_proj.weight": "ffn_c_proj_weight", "mlp.c_proj.bias": "ffn_c_proj_bias",
}
# The model's weights outside the blocks: with the block weights, all an engine needs to run end to end.
MODEL_WEIGHTS = {
    "wte.weight": ("wte", "token embeddings [vocab, d]; also the LM head (tied): logits = ln_f(x) @ wte^T"),
    "wpe.weight": ("wpe", "position embeddings [n_positions, d]; row p for the token at position p, from 0"),
    "ln_f.weight": ("ln_f_weight", "final LayerNorm's gain [d]"),
    "ln_f.bias": ("ln_f_bias", "final LayerNorm's bias [d]"),
}
# Seed 001's own file names for block 0, written as copies so its tests run unchanged.
SEED_ALIASES = {"checkpoint_05_output": "h0_ln_2", "checkpoint_06_ffn": "h0_ffn"}
IDS_FILE = "token_ids.txt"  # the token ids, space-separated: an engine in C or Rust needs no JSON to read them


def conventions(cfg: Config) -> dict:
    """What an engine must do to reproduce each tensor, said once in the manifest, for this config."""
    d, H = cfg.n_embd, cfg.n_head
    dh = d // H
    scale = ("1" if not cfg.scale_attn_weights else f"1/sqrt(d/H) = 1/sqrt({dh})") + \
        (" / (L + 1) in block L (scale_attn_by_inverse_layer_idx)" if cfg.scale_attn_by_inverse_layer_idx else "")
    gelu = {"tanh": "GELU, tanh form (HF's gelu_new): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))",
            "none": "GELU, exact form: 0.5 x (1 + erf(x / sqrt(2)))", "relu": "ReLU: max(x, 0)"}[cfg.gelu_approximate]
    return {
        "files": "float32 tensors in C (row-major) order; a .bin file is raw little-endian IEEE 754 float32 with "
                 f"no header, its shape in tensors[name].shape; the token ids are also in {IDS_FILE}",
        "batch": "one sequence: activations carry a leading batch dim of 1; the model runs in eval mode, so no "
                 "dropout (the *_pdrop fields are for training)",
        "linear": "HF's Conv1D layout: a weight is [in, out] and y = x @ W + b (nn.Linear stores [out, in])",
        "embeddings": "x = wte[ids] + wpe[p] for positions p = 0 .. T-1",
        "layer_norm": f"(x - mean) / sqrt(var + {cfg.layer_norm_epsilon:g}) * weight + bias over the last axis; var is "
                      "the biased variance (divides by d, not d - 1)",
        "attention": f"c_attn's {3 * d} output columns are [q | k | v], {d} each; head h of each is its columns "
                     f"h*{dh} .. h*{dh}+{dh - 1} (q by head: (1, H, T, d/H)); scores = q k^T * {scale}; scores of keys "
                     "after the query are -inf, so their probabilities are exactly 0; softmax over the keys; "
                     "the heads' outputs are concatenated in head order back to (1, T, d), then attn.c_proj",
        "ffn": f"c_fc (d -> {cfg.hidden}; n_inner, or 4 d when it is null), then {gelu}, then c_proj "
               f"({cfg.hidden} -> d)",
        "block": "pre-norm: x = x + attn(ln_1(x)); x = x + ffn(ln_2(x))",
        "logits": "ln_f after the last block; logits = ln_f(x) @ wte^T at every position (the LM head is wte)",
    }


def config_sha256(config: dict) -> str:
    """The sha256 of a manifest's config, as canonical JSON (sorted keys): an edit to it shows, as one to a tensor
    file does."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _hf():
    try:
        import transformers
    except ImportError:
        raise Gpt2ffnError("this command runs HF transformers as the reference: pip install 'gpt2ffn[hf]'") from None
    return transformers


# ---- the reference model ------------------------------------------------------------------------------

def load_reference(source: str):
    """(HF GPT2LMHeadModel in eval mode with eager attention, Config, manifest's model entry).

    source is a local HF checkpoint directory, or `random:<preset>[:seed]` for seeded random weights."""
    transformers = _hf()
    if source.startswith("random:"):
        cfg, seed, name = parse_random(source)
        return random_hf_model(cfg, seed, "eager"), cfg, {"source": name, "files": {}}
    path = Path(source)
    if not path.is_dir():
        raise Gpt2ffnError(f"model {source!r} is neither a checkpoint directory nor random:<preset>[:seed]")
    cfg = Config.from_pretrained(path)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # HF's "Loading weights" bar: not on the CLI's one line
    try:
        model = transformers.GPT2LMHeadModel.from_pretrained(path, attn_implementation="eager",
                                                             dtype=torch.float32).eval()
    except Exception as e:
        raise CheckpointError(f"HF transformers could not load {path}: {str(e).splitlines()[0]}") from None
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    if not torch.equal(model.lm_head.weight, model.transformer.wte.weight):  # the golden sets' logits are ln_f @ wte^T
        raise ConfigError(f"{path / 'config.json'} sets tie_word_embeddings=false and its lm_head.weight differs "
                          "from wte: GPT-2 ties the LM head to wte, as the golden sets' logits (ln_f @ wte^T) and "
                          "gpt2ffn's GPT-2 do, so it is not a GPT-2 to judge against or take golden tensors from")
    files = {p.name: sha256(p) for p in sorted(path.iterdir())
             if p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json")}
    return model, cfg, {"source": str(path.resolve()), "files": files}


def token_ids(cfg: Config, model_source: str, ids=None, prompt=None) -> list:
    if (ids is None) == (prompt is None):
        raise Gpt2ffnError("give exactly one of --ids and --prompt")
    if prompt is not None:
        if model_source.startswith("random:"):
            raise Gpt2ffnError("--prompt needs a tokenizer, and a random: model has none; use --ids")
        from .tokenizer import load_tokenizer
        ids = load_tokenizer(model_source).encode(prompt)
    if not ids:
        raise Gpt2ffnError(f"no tokens: the prompt {prompt!r} encodes to nothing" if prompt is not None else
                           "no tokens: --ids is empty; give at least one id (e.g. --ids 15496,11)")
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise Gpt2ffnError(f"token ids {bad[:5]} are outside the vocabulary [0, {cfg.vocab_size})")
    if len(ids) > cfg.n_positions:
        raise Gpt2ffnError(f"{len(ids)} tokens exceed the context length n_positions={cfg.n_positions}")
    return list(ids)


def capture(model, cfg: Config, ids: list, layers: list) -> dict:
    """Run HF's model once with forward hooks; every tensor as HF's own modules returned it (float32 numpy)."""
    out, hooks = {}, []
    tr = model.transformer

    def keep(name, pick=lambda o: o):
        def hook(module, args, output):
            out[name] = pick(output).detach().float().numpy().copy()
        return hook

    hooks.append(tr.drop.register_forward_hook(keep("embeddings")))
    for L in layers:
        b = tr.h[L]
        hooks += [
            b.ln_1.register_forward_hook(keep(f"h{L}_ln_1")),
            b.attn.c_attn.register_forward_hook(keep(f"h{L}_c_attn")),
            b.attn.register_forward_hook(keep(f"h{L}_attn_probs", lambda o: o[1])),
            b.attn.c_proj.register_forward_hook(keep(f"h{L}_attn_out")),
            b.ln_2.register_forward_pre_hook(lambda m, args, L=L: out.__setitem__(
                f"h{L}_attn_resid", args[0].detach().float().numpy().copy())),
            b.ln_2.register_forward_hook(keep(f"h{L}_ln_2")),
            b.mlp.c_fc.register_forward_hook(keep(f"h{L}_c_fc")),
            b.mlp.act.register_forward_hook(keep(f"h{L}_gelu")),
            b.mlp.register_forward_hook(keep(f"h{L}_ffn")),
            b.register_forward_hook(keep(f"h{L}_block", lambda o: o[0] if isinstance(o, tuple) else o)),
        ]
    hooks.append(tr.ln_f.register_forward_hook(keep("ln_f")))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits
    finally:
        for h in hooks:
            h.remove()
    out["logits"] = logits.float().numpy()
    T, H, d = len(ids), cfg.n_head, cfg.n_embd
    for L in layers:  # HF splits c_attn's output this way inside GPT2Attention.forward
        for name, part in zip("qkv", np.split(out[f"h{L}_c_attn"], 3, axis=-1)):
            out[f"h{L}_{name}"] = np.ascontiguousarray(part.reshape(1, T, H, d // H).transpose(0, 2, 1, 3))
    return out


def parse_layers(spec: str, n_layer: int) -> list:
    if spec == "all":
        return list(range(n_layer))
    try:
        layers = sorted({int(s) for s in spec.split(",")})
    except ValueError:
        raise Gpt2ffnError(f"--layers must be 'all' or comma-separated ints like 0,3; got {spec!r}") from None
    bad = [L for L in layers if not 0 <= L < n_layer]
    if bad:
        raise Gpt2ffnError(f"--layers {bad} out of range: the model has layers 0..{n_layer - 1}")
    return layers


def set_files(out_dir: Path) -> set:
    """The files a golden set there names (its manifest.json's, a gpt2ffn golden set's only): what a new set
    written there removes of them once it is written (a set of other layers or another model left files an
    engine reading by name would take: h1_*.npy beside a 1-block set)."""
    try:
        m = json.loads((out_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("tensors"), dict):
        return set()
    names = [e.get("file") for e in m["tensors"].values() if isinstance(e, dict)] + [m.get("token_ids_file")]
    return {n for n in names if isinstance(n, str) and "/" not in n and n not in ("", ".", "..")}


def extract(model_source: str, out_dir, ids=None, prompt=None, layers="0", progress=True,
            file_format="npy") -> dict:
    """Write golden tensors, block weights and manifest.json to out_dir, as file_format (FILE_FORMATS).
    Returns the manifest."""
    import tqdm
    if file_format not in FILE_FORMATS:
        raise Gpt2ffnError(f"format {file_format!r}: expected one of {', '.join(FILE_FORMATS)}")
    model, cfg, model_info = load_reference(model_source)
    ids = token_ids(cfg, model_source, ids, prompt)
    layers = parse_layers(layers, cfg.n_layer) if isinstance(layers, str) else layers
    tensors = capture(model, cfg, ids, layers)
    entries = {}
    for stage, ck, what in MODEL_STAGES:
        entries[stage] = dict(kind="activation", checkpoint=ck, stage=stage, layer=None, what=what)
    for L in layers:
        for stage, ck, what in BLOCK_STAGES:
            entries[f"h{L}_{stage}"] = dict(kind="activation", checkpoint=ck, stage=stage, layer=L, what=what)
        sd = model.transformer.h[L].state_dict()
        for key, name in BLOCK_WEIGHTS.items():
            tensors[f"h{L}_{name}"] = sd[key].float().numpy()
            entries[f"h{L}_{name}"] = dict(kind="weight", checkpoint=None, stage=key, layer=L,
                                           what=f"h.{L}.{key}, HF layout")
    sd = model.transformer.state_dict()
    for key, (name, what) in MODEL_WEIGHTS.items():
        tensors[name] = sd[key].float().numpy()
        entries[name] = dict(kind="weight", checkpoint=None, stage=key, layer=None, what=what)
    if 0 in layers:
        for alias, name in SEED_ALIASES.items():
            tensors[alias] = tensors[name]
            entries[alias] = dict(entries[name], kind="alias", alias_of=name)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    old_files = set_files(out_dir)
    arrays = {name: np.ascontiguousarray(tensors[name], dtype="<f4") for name in entries}
    if file_format == "safetensors":
        from safetensors.numpy import save_file
        file = out_dir / BUNDLE
        save_file(arrays, file, metadata={"format": FORMAT})
        digest = sha256(file)
        for name, entry in entries.items():
            entry.update(file=file.name, key=name, shape=list(arrays[name].shape), dtype="float32", sha256=digest)
    else:
        for name in tqdm.tqdm(list(entries), desc=f"writing {out_dir}", unit="tensor", disable=not progress):
            file = out_dir / f"{name}.{file_format}"
            if file_format == "npy":
                np.save(file, arrays[name])
            else:
                arrays[name].tofile(file)
            entries[name].update(file=file.name, shape=list(arrays[name].shape), dtype="float32",
                                 sha256=sha256(file))
    (out_dir / IDS_FILE).write_text(" ".join(map(str, ids)) + "\n")
    import transformers
    manifest = {
        "format": FORMAT,
        "file_format": file_format,
        "model": model_info,
        "config": cfg.to_hf_dict(),
        "config_sha256": config_sha256(cfg.to_hf_dict()),
        "conventions": conventions(cfg),
        "token_ids": ids,
        "token_ids_file": IDS_FILE,
        "prompt": prompt,
        "layers": layers,
        "checkpoints": CHECKPOINTS,
        "tolerance": {"atol": GOLDEN_ATOL, "scaled": GOLDEN_SCALED,
                      "note": "seed 001: max |diff| <= 1e-4, fp32; for the stages in scaled (the residual stream, "
                              "logits): max(1e-4, scaled * max|expected|)"},
        "tensors": entries,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "numpy": np.__version__,
                     "gpt2ffn": __import__("gpt2ffn").__version__},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for name in old_files - set_files(out_dir):  # the old set's files the new one did not write again
        (out_dir / name).unlink(missing_ok=True)
    return manifest


# ---- the golden set, read back ------------------------------------------------------------------------

class Golden:
    """A golden directory: its manifest, and its tensors checked against their sha256 on first read."""

    def __init__(self, directory):
        self.dir = Path(directory)
        file = self.dir / "manifest.json"
        if not file.is_file():
            raise Gpt2ffnError(f"{self.dir} is not a golden directory: no manifest.json "
                               "(make one with gpt2ffn extract)")
        try:
            m = json.loads(file.read_text())
            if m.get("format") != FORMAT:
                raise ValueError(f"format is {m.get('format')!r}, expected {FORMAT!r}")
            self.config = Config.from_dict(m["config"], ignore_unknown=True)
            if "config_sha256" in m and m["config_sha256"] != config_sha256(m["config"]):  # (sets before it: none)
                raise Gpt2ffnError(f"{file}'s config differs from the one its tensors were extracted with (its "
                                   "config_sha256): the manifest was edited; extract the set again")
            self.tensors, self.layers, self.token_ids = m["tensors"], m["layers"], m["token_ids"]
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise Gpt2ffnError(f"{file} is corrupt: {e}") from None
        ids_file = self.dir / m.get("token_ids_file", IDS_FILE)
        if ids_file.is_file():  # what an engine in C reads; the manifest's ids are what the tensors were made from
            written = ids_file.read_text().split()
            if written != [str(i) for i in self.token_ids]:
                raise Gpt2ffnError(f"{ids_file} ({' '.join(written[:8])}{' ...' if len(written) > 8 else ''}) "
                                   f"differs from manifest.json's token_ids ({' '.join(map(str, self.token_ids[:8]))}"
                                   f"{' ...' if len(self.token_ids) > 8 else ''}): the set was edited; extract it "
                                   f"again")
        lost = [L for L in self.layers if not isinstance(L, int) or f"h{L}_ffn" not in self.tensors]
        if lost:  # a layer listed and not extracted (an edited manifest): named here, not a KeyError later
            raise Gpt2ffnError(f"{file} is corrupt: it lists layer {lost[0]!r} but holds no tensors of it "
                               f"(layers {self.layers}); extract the set again")
        self.manifest = m
        self._cache, self._cases, self._checked, self._planted = {}, {}, set(), {}

    def __contains__(self, name):
        return name in self.tensors

    def load(self, name) -> np.ndarray:
        if name not in self._cache:
            entry = self.tensors[name]
            path = self.dir / entry["file"]
            if self.dir.resolve() not in path.resolve().parents:  # an edited manifest may point anywhere
                raise Gpt2ffnError(f"golden tensor {name}'s file {entry['file']!r} lies outside {self.dir}: the "
                                   f"manifest was edited; extract the set again")
            if path.name not in self._checked:
                if not path.is_file():
                    raise Gpt2ffnError(f"golden tensor {path} is missing (listed in manifest.json)")
                if sha256(path) != entry["sha256"]:
                    raise Gpt2ffnError(f"golden tensor {path} does not match the sha256 in manifest.json: "
                                       "the file was changed after extraction")
                self._checked.add(path.name)
            value = read_tensor(path, entry.get("key", name), tuple(entry["shape"]))
            if value.dtype.kind == "f" and not np.isfinite(value).all():  # HF's stages never are: a broken set
                raise Gpt2ffnError(f"golden tensor {name} ({path.name}) holds NaN or Inf values: the set is broken "
                                   f"(its sha256 too was rewritten); extract it again")
            self._cache[name] = value
        return self._cache[name]

    def activations(self) -> list:
        """Activation tensors in forward order (model input, blocks, model output); aliases last."""
        order = {n: i for i, n in enumerate(["embeddings"] + [f"h{L}_{s}" for L in self.layers
                                                               for s, _, _ in BLOCK_STAGES] + ["ln_f", "logits"])}
        acts = [n for n, e in self.tensors.items() if e["kind"] == "activation"]
        aliases = [n for n, e in self.tensors.items() if e["kind"] == "alias"]
        return sorted(acts, key=lambda n: order.get(n, len(order))) + aliases

    def weights(self) -> list:
        """Weight tensors: the model's (wte, wpe, ln_f) first, then block by block."""
        ws = [n for n, e in self.tensors.items() if e["kind"] == "weight"]
        return sorted(ws, key=lambda n: -1 if self.tensors[n]["layer"] is None else self.tensors[n]["layer"])

    def block_input(self, layer: int):
        """HF's input to block `layer` (embeddings, or the block before's output), float64; None if not in the set."""
        name = "embeddings" if layer == 0 else f"h{layer - 1}_block"
        return torch.from_numpy(self.load(name)).double() if name in self else None

    def block_weights(self, layer: int) -> dict:
        """Block `layer`'s weights under HF's state-dict keys (HF layout), float64 torch tensors."""
        return {k: torch.from_numpy(self.load(f"h{layer}_{v}")).double() for k, v in BLOCK_WEIGHTS.items()}

    def planted(self, layer: int) -> dict:
        """Every stage of block `layer` with each known block mistake planted (gpt2ffn.diagnose.MISTAKES), on HF's
        input to it: {mistake: {stage: tensor}}; {} when the set lacks that input."""
        from .diagnose import MISTAKES, block_forward
        if layer not in self._planted:
            x = self.block_input(layer)
            w = self.block_weights(layer)
            self._planted[layer] = {} if x is None else {
                k: block_forward(x, w, self.config, k, layer) for k in [None, *MISTAKES]}  # None: none planted
        return {k: v for k, v in self._planted[layer].items() if k is not None}

    def unplanted(self, layer: int) -> dict:
        """Every stage of block `layer` as the set's own weights and config compute it (float64), or {}."""
        self.planted(layer)
        return self._planted[layer].get(None, {})

    def ffn_weights(self, layer: int) -> dict:
        """Block `layer`'s FFN as a GPT2MLP state dict of torch tensors."""
        return {k.removeprefix("mlp."): torch.from_numpy(self.load(f"h{layer}_{BLOCK_WEIGHTS[k]}"))
                for k in ("mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")}

    def weak_note(self, atol: float = GOLDEN_ATOL) -> str | None:
        """What this set cannot tell: the known FFN mistakes within atol of right at every block it holds (a set
        taken from a checkpoint at HF's init, whose c_fc outputs stay small), as a note; None where it tells all."""
        blind = [blind_to(self.ffn_case(L), atol) for L in self.layers]
        both = [n for n in blind[0] if all(n in b for b in blind)]
        if not both:
            return None
        reach = max(float(np.abs(self.ffn_case(L).expected["c_fc"]).max()) for L in self.layers)
        return (f"note: this golden set cannot tell {len(both)} known mistake{'s' * (len(both) != 1)} from a right "
                f"FFN ({'; '.join(both[:3])}{'; ...' if len(both) > 3 else ''}): on its inputs c_fc's outputs reach "
                f"only |x| = {reach:.2g}, and they stay within {atol:g} of right; a pass here does not rule them out: "
                f"extract from random:<preset> or a trained checkpoint (verify --negative lists them)")

    def ffn_case(self, layer: int) -> FFNCase:
        """Block `layer`'s FFN with its golden input, residual stream and stage outputs, for diagnosis."""
        if layer not in self.layers:
            raise Gpt2ffnError(f"layer {layer} is not in golden set {self.dir} (it has layers {self.layers})")
        if layer not in self._cases:
            self._cases[layer] = FFNCase(
                source=self.manifest["model"]["source"], layer=layer, approximate=self.config.gelu_approximate,
                weights={k: v.numpy() for k, v in self.ffn_weights(layer).items()},
                x=self.load(f"h{layer}_ln_2"), resid=self.load(f"h{layer}_attn_resid"),
                expected={s: self.load(f"h{layer}_{s}") for s in FFN_STAGES})
        return self._cases[layer]


def read_tensor(path: Path, key: str, shape: tuple) -> np.ndarray:
    """One tensor from a .npy file, a raw float32 .bin file of `shape`, or a .safetensors file's `key`."""
    if path.suffix == ".npy":
        return np.load(path, allow_pickle=False)
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(path, framework="numpy") as f:
            return f.get_tensor(key)
    data = np.fromfile(path, dtype="<f4")
    if data.size != int(np.prod(shape)):
        raise Gpt2ffnError(f"{path} holds {path.stat().st_size} bytes, expected {4 * int(np.prod(shape))} "
                           f"(float32, shape {shape})")
    return data.reshape(shape)


# ---- judging ------------------------------------------------------------------------------------------

@dataclass
class Row:
    name: str
    checkpoint: str
    layer: object
    shape: tuple
    max_abs: float
    max_rel: float   # max |a - e| / max |e|: the error against the tensor's scale
    atol: float
    status: str      # PASS, FAIL, MISSING
    note: str = ""

    def as_dict(self):
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def compare(name, entry, actual, expected, atol) -> Row:
    """One row: shape/dtype/finiteness first, then the diffs."""
    ck, layer, shape = entry["checkpoint"], entry["layer"], tuple(expected.shape)

    def fail(note):
        return Row(name, ck, layer, shape, float("nan"), float("nan"), atol, "FAIL", note)

    if actual.dtype.kind == "f" and actual.dtype.itemsize == 4:
        actual = actual.astype(expected.dtype)  # float32 of either byte order (a .npy file says which)
    if actual.dtype != expected.dtype:
        return fail(f"dtype {actual.dtype}, expected {expected.dtype}: write float32" +
                    (" (arr.astype(np.float32))" if actual.dtype.kind == "f" else ""))
    if actual.shape != expected.shape:
        squeeze = lambda s: tuple(s)[next((i for i, n in enumerate(s) if n != 1), len(s)):]  # noqa: E731
        if squeeze(actual.shape) != squeeze(expected.shape):
            last = len(shape) == 3 and squeeze(actual.shape) == shape[-1:] and shape[1] > 1  # one token's vector
            return fail(f"shape {tuple(actual.shape)}, expected {shape}" + (
                f": one token's values? write every one of the {shape[1]} tokens' (only logits may be the last "
                f"position's alone)" if last else ""))
        actual = actual.reshape(expected.shape)  # only leading 1s differ, e.g. [T, d] for [1, T, d]
    if not np.isfinite(actual).all():
        bad = ~np.isfinite(actual)
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        kinds = " and ".join(k for k, m in (("NaN", np.isnan(actual)), ("Inf", np.isinf(actual))) if m.any())
        return fail(f"{int(bad.sum())} {kinds} value{'s' * (int(bad.sum()) > 1)}, the first at {list(first)}")
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    max_rel = max_abs / scale if scale else max_abs
    return Row(name, ck, layer, shape, max_abs, max_rel, atol, "PASS" if max_abs <= atol else "FAIL")


def tolerance_for(name, entry, tolerances: dict, default: float, expected=None) -> float:
    """Per-checkpoint overrides by tensor name (h0_ffn), stage (ffn) or checkpoint number (06); else the
    default, scaled with the tensor for the stages in GOLDEN_SCALED (the residual stream, logits)."""
    for key in (name, entry.get("alias_of", name), entry["stage"], entry["checkpoint"]):
        if key in tolerances:
            return tolerances[key]
    rtol = GOLDEN_SCALED.get(entry["stage"])
    if rtol is not None and expected is not None and expected.size:
        return max(default, rtol * float(np.abs(expected).max()))
    return default


# ---- what a failing tensor got wrong -----------------------------------------------------------------------

def _core(shape) -> tuple:
    """shape without its leading 1s: [T, d] and [1, T, d] hold the same tensor."""
    shape = tuple(shape)
    return shape[next((i for i, n in enumerate(shape) if n != 1), len(shape)):]


def _axis_labels(entry: dict, ndim: int) -> list:
    """Names of a tensor's axes (its leading 1s dropped) from the manifest's description: T, H, d/H, ..."""
    if entry["kind"] == "weight":
        named = {"wte.weight": ["vocab", "d"], "wpe.weight": ["n_positions", "d"]}.get(entry["stage"], ["in", "out"])
        return named if ndim == 2 else [f"axis {i}" for i in range(ndim)]
    labels = [t.strip() for t in entry["what"].rsplit("(", 1)[-1].rstrip(")").split(",")]
    labels = labels[next((i for i, t in enumerate(labels) if t != "1"), len(labels)):]
    if len(labels) != ndim:
        return [f"axis {i}" for i in range(ndim)]
    # axes of one name told apart: the probabilities' (H, T, T) are (H, queries, keys); else by their order
    kinds = iter(["queries", "keys"]) if entry["checkpoint"] == "04" else None
    for t in {x for x in labels if labels.count(x) > 1}:
        n = iter(range(1, ndim + 1))
        labels = [x if x != t else f"{t} {next(kinds)}" if kinds else f"{t} #{next(n)}" for x in labels]
    return labels


def layout_hint(entry: dict, actual, expected, atol: float) -> str | None:
    """When the values are right but laid out otherwise: the same axes in another order (q as (T, H, d/H), the
    attention probabilities as (keys, queries), a weight as [out, in]), or the right C order under another shape."""
    if actual.size != expected.size or not np.isfinite(actual).all():
        return None
    want = np.asarray(expected, np.float64).reshape(_core(expected.shape))
    flat = np.asarray(actual, np.float64).reshape(-1)
    labels = _axis_labels(entry, want.ndim)
    if want.ndim > 4:
        return None
    for perm in itertools.permutations(range(want.ndim)):
        stored = tuple(want.shape[i] for i in perm)
        if np.abs(flat.reshape(stored).transpose(np.argsort(perm)) - want).max() > atol:
            continue
        if perm == tuple(range(want.ndim)):
            if _core(actual.shape) == want.shape:
                return None  # the same layout: nothing to say
            return f"the values are right in C order; only the shape differs: write shape {tuple(expected.shape)}"
        return (f"the values are right, stored as ({', '.join(labels[i] for i in perm)}) = {stored}: write them as "
                f"({', '.join(labels)}) = {tuple(want.shape)}, C order")
    return None


def convention_hint(golden: "Golden", entry: dict, actual, expected, atol: float) -> str | None:
    """Right values under another engine's convention: logits written as log-probabilities, probabilities or
    shifted by each row's max (what a sampler wants); q scaled by 1/sqrt(d/H) before it was written (fused
    attention kernels fold the scale into q); q, k or v with the heads in reverse order."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    if a.size != e.size:
        return None
    a = a.reshape(e.shape)
    stage = entry["stage"]
    # a convention is named only where it is told apart from the right values and from zeros at this bar
    near = lambda want: (float(np.abs(a - want).max()) <= max(atol, 1e-6 * float(np.abs(want).max()))  # noqa: E731
                         and float(np.abs(want - e).max()) > atol and float(np.abs(want).max()) > atol)
    if stage == "logits":
        shifted = e - e.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        for want, what in ((log_probs, "log-probabilities (log_softmax of the logits)"),
                           (np.exp(log_probs), "probabilities (softmax of the logits)"),
                           (shifted, "the logits less each row's max")):
            if near(want):
                return f"these are {what}: write the logits themselves, ln_f(x) @ wte^T, before any softmax"
    if stage in ("q", "k", "v") and e.ndim == 4:  # (1, H, T, d/H)
        if stage == "q" and near(e / np.sqrt(e.shape[-1])):
            return ("q is scaled by 1/sqrt(d/H) = 1/sqrt({}) (the attention scale folded into q, as fused kernels do): "
                    "write q as c_attn gives it; the scale applies to q @ k^T".format(e.shape[-1]))
        if e.shape[1] > 1 and near(e[:, ::-1]):
            return f"the heads are in reverse order: head h is c_attn's {stage} columns h*d/H .. (h+1)*d/H - 1"
    return None


def same_as(golden: "Golden", name: str, actual, atol: float) -> str | None:
    """A failing tensor whose values are another golden tensor's (an in-place op before it was written, a stage
    skipped, a file written from the wrong buffer): which one, and the likely cause where the pair says it."""
    a = np.asarray(actual, np.float64)
    V, stage, L = golden.config.vocab_size, golden.tensors[name]["stage"], golden.tensors[name]["layer"]
    if name == "logits" and a.size == V and "logits" in golden:  # one row of logits: which position's it is
        full = golden.load("logits").reshape(-1, V)
        for r in range(len(full) - 1):
            if (np.abs(a.reshape(V) - full[r]).max()
                    <= max(atol, GOLDEN_SCALED["logits"] * float(np.abs(full[r]).max()))):
                return (f"these are position {r}'s logits; a file of one row ({V} values) is judged as the last "
                        f"position's, {len(full) - 1}: write the logits of the last token (or all {len(full)} rows)")
    for other in golden.activations():
        e = golden.tensors[other]
        if other == name or e["kind"] == "alias" or e["shape"] is None or int(np.prod(e["shape"])) != a.size:
            continue
        want = golden.load(other)
        if np.abs(a.reshape(want.shape) - want).max() > atol:
            continue
        if stage == "c_fc" and other == f"h{L}_gelu":
            why = "GELU applied in place before c_fc's output was written: write it before the GELU"
        elif stage in ("ln_1", "ln_2", "ln_f") and e["stage"] in ("embeddings", "block", "attn_resid"):
            why = f"{stage} not applied: its input was written as its output (or the model skipped it)"
        else:
            why = "the wrong buffer written under this name, or an in-place op before it was written"
        return f"these are {other}'s values: {why}"
    return None


def number_hint(actual, expected, atol: float) -> str | None:
    """A failure the numbers' encoding explains: bytes in big-endian order, or every value a float16 or bfloat16
    (computed or stored in half precision)."""
    a = np.asarray(actual)
    if a.dtype != np.float32 or a.size == 0:
        return None
    swapped = a.byteswap()
    if np.isfinite(swapped).all() and swapped.size == expected.size \
            and np.abs(swapped.reshape(expected.shape).astype(np.float64) - expected).max() <= atol:
        return "big-endian: the values match with each float's 4 bytes reversed; write little-endian float32"
    finite = a[np.isfinite(a)]
    exp = np.asarray(expected, np.float32)
    if finite.size < 16 or not finite.any():
        return None
    for name, on_grid in (("bfloat16", lambda t: (t.view(np.uint32) & 0xFFFF) == 0),
                          ("float16", lambda t: t.astype(np.float16).astype(np.float32) == t)):
        if on_grid(finite).all() and not on_grid(exp).all():
            return (f"every value is a {name} (each survives a round trip through {name} unchanged): computed or "
                    f"stored in half precision; compute in float32 and write float32")
    return None


def worst_element(actual, expected) -> str | None:
    """Where a failing tensor is furthest off: index, got, expected."""
    if _core(actual.shape) != _core(expected.shape) or not np.isfinite(actual).all():
        return None
    g = np.asarray(actual, np.float64).reshape(expected.shape)
    diff = np.abs(g - expected)
    i = np.unravel_index(int(np.argmax(diff)), diff.shape)
    return f"worst element {list(map(int, i))}: got {g[i]:.6g}, expected {float(expected[i]):.6g}"


# A tensor matches a known mistake's within max(atol, DIAGNOSE_RTOL * max|mistake's|), as the residual stream is
# judged (tolerances.GOLDEN_SCALED): an engine's own rounding grows with the values (logits without ln_f reach
# ~120 on random:gpt2, where a correct fp32 engine's were 1.3e-4 off HF's), and naming needs the tensor nearer
# the mistake than GPT-2's as well.
DIAGNOSE_RTOL = 1e-5


# The one mistake that gives an engine non-finite values by itself: a query with no key left to attend to
# divides 0 by 0. A tensor with NaN/Inf is matched to it on its finite values.
NON_FINITE_MISTAKES = ("mask_excludes_self",)


def stage_mistake(golden: Golden, entry: dict, got, atol: float, near=False, closer=np.inf) -> tuple | None:
    """The known mistake (gpt2ffn.diagnose's MISTAKES, MODEL_MISTAKES) a tensor outside the FFN equals, computed
    from the set's weights and HF's input to that stage: (distance, name, what to change), closest first; None if
    none is within atol (scaled with the variant: DIAGNOSE_RTOL) and nearer than `closer` (half
    the distance to the golden tensor: a tensor as near GPT-2's as a mistake's is not that mistake). near:
    instead the closest LayerNorm variant (eps, unbiased) whatever its distance. A tensor with NaN/Inf values
    is compared on its finite ones, with NON_FINITE_MISTAKES only."""
    from .diagnose import MISTAKES, MODEL_MISTAKES, layer_norm_mistakes
    stage, L, cfg = entry["stage"], entry["layer"], golden.config
    with np.errstate(invalid="ignore"):  # NaN/Inf values: compared on the finite ones below
        got = np.asarray(got, np.float64)
    finite = np.isfinite(got)
    found = []

    name = stage if L is None else f"h{L}_{stage}"
    right = golden.load(name).astype(np.float64) if name in golden and not near else None

    def offer(key, want):  # the variant's bar scales with it (atol: the unscaled part)
        want = want.numpy() if isinstance(want, torch.Tensor) else np.asarray(want, np.float64)
        if _core(got.shape) == _core(want.shape) and np.isfinite(want).all() and want.size \
                and (finite.all() or key in NON_FINITE_MISTAKES):
            bar = max(atol, DIAGNOSE_RTOL * float(np.abs(want).max()))
            if right is not None and right.size == want.size and float(np.abs(right.reshape(want.shape) - want).max()) \
                    <= bar:  # the mistake does not change this stage beyond float32's rounding of it (DIAGNOSE_RTOL):
                return        # not told apart here (eps 1e-5, GPT-2's own; c_proj's layout at q)
            diff = np.abs(got.reshape(want.shape) - want)[finite.reshape(want.shape)]
            found.append((float(diff.max()), key, bar))

    def norm_alone(x, w, b):  # one LayerNorm wrong, on HF's own input to it
        for k, want in layer_norm_mistakes(x, w, b, cfg.layer_norm_epsilon):
            offer(k, want)

    last = f"h{cfg.n_layer - 1}_block"
    if L is not None:
        w = golden.block_weights(L)
        if stage == "ln_1" and (x := golden.block_input(L)) is not None:
            norm_alone(x, w["ln_1.weight"], w["ln_1.bias"])
        elif stage == "ln_2" and f"h{L}_attn_resid" in golden:
            norm_alone(golden.load(f"h{L}_attn_resid"), w["ln_2.weight"], w["ln_2.bias"])
        if not near:
            key = {"q": "q_heads", "k": "k_heads", "v": "v_heads"}.get(stage, stage)
            base = golden.unplanted(L).get(key)
            for k, out in golden.planted(L).items():
                if key not in out or k == "heads_reshaped" and stage in ("q", "k", "v"):  # at q, k, v these are
                    continue  # the right values stored as (T, H, d/H): layout_hint names that
                if base is not None and float((out[key] - base).abs().max()) <= DIAGNOSE_RTOL * float(
                        base.abs().max()):  # this mistake leaves the stage as it is (c_proj's layout at ln_1): were
                    continue  # it named, a set whose own config disagrees with its tensors would blame it
                offer(k, out[key])
    elif stage == "embeddings" and "wte" in golden:
        wte, wpe, ids = golden.load("wte"), golden.load("wpe"), golden.token_ids
        offer("positions_not_added", wte[ids][None])
        ids_ = np.asarray(ids)
        for shift in (1, -1):
            if 0 <= (ids_ + shift).min() and (ids_ + shift).max() < len(wte):
                offer("ids_off_by_one", (wte[ids_ + shift] + wpe[:len(ids_)].astype(np.float64))[None])
        if len(ids) < len(wpe):
            offer("positions_from_1", (wte[ids] + wpe[1:len(ids) + 1].astype(np.float64))[None])
    elif stage == "ln_f" and last in golden and "ln_f_weight" in golden:
        w, b = (torch.from_numpy(golden.load(n)).double() for n in ("ln_f_weight", "ln_f_bias"))
        norm_alone(golden.load(last), w, b)
        if not near:
            offer("no_ln_f", golden.load(last))
    elif stage == "logits" and last in golden and "wte" in golden and not near and got.shape[-1] == cfg.vocab_size:
        logits = golden.load(last).astype(np.float64) @ golden.load("wte").T.astype(np.float64)
        offer("logits_without_ln_f", logits[:, -(got.size // cfg.vocab_size):])
        if "ln_f" in golden:
            wrong = (golden.load("ln_f").astype(np.float64)
                     @ golden.load("wte").reshape(cfg.n_embd, -1).astype(np.float64))
            offer("lm_head_as_d_by_vocab", wrong[:, -(got.size // cfg.vocab_size):])
    table = {**MISTAKES, **MODEL_MISTAKES}
    hits = sorted(f[:2] for f in found if near or f[0] <= f[2] and f[0] < closer)
    if not hits:
        return None
    best = hits[0][0]
    eps = list(dict.fromkeys(k.removeprefix("ln_eps_") for dist, k in hits
                             if k.startswith("ln_eps_") and dist <= 2 * best + 1e-6))
    if not near and hits[0][1].startswith("ln_eps_") and len(eps) > 1:  # the output cannot tell them apart
        return hits[0][0], f"LayerNorm eps other than GPT-2's (each of {', '.join(eps)} fits)", table[hits[0][1]][1]
    return (hits[0][0], *table[hits[0][1]])


def near_miss(golden: Golden, entry: dict, actual, expected) -> str | None:
    """A LayerNorm output that passes, but is far closer to a known-wrong LayerNorm (another eps, the unbiased
    variance) than to GPT-2's: the cause of a failure downstream, where the residual stream grows the error."""
    if entry["stage"] not in ("ln_1", "ln_2", "ln_f") or _core(actual.shape) != _core(expected.shape):
        return None
    off = float(np.abs(np.asarray(actual, np.float64).reshape(expected.shape) - expected).max())
    hit = stage_mistake(golden, entry, actual, 0.0, near=True)
    if hit is None or not hit[0] < off / 10 or hit[0] > 1e-5:
        return None
    dist, name, fix = hit
    return (f"within tolerance, but it is {name} (within {dist:.1e} of it, {off:.1e} of GPT-2's): {fix}; the "
            "difference grows downstream")


def rebuild_model(golden: Golden):
    """gpt2ffn's GPT2 for the golden set's model: random presets are rebuilt from their seed, a directory is
    read if its weight files still match the manifest's sha256; no tokenizer is needed (the manifest holds the
    token ids). (model, None) or (None, why not)."""
    from .model import load_model
    info = golden.manifest["model"]
    source = info["source"]
    if not source.startswith("random:"):
        path = Path(source)
        if not path.is_dir():
            return None, f"model directory {source} is not here"
        changed = [f for f, h in info["files"].items() if not (path / f).is_file() or sha256(path / f) != h]
        if changed:
            return None, f"model files changed since extraction: {', '.join(changed)}"
    return load_model(source), None


def run_ours(golden: Golden) -> tuple:
    """gpt2ffn's own implementation of every checkpoint, each stage fed its golden input, then the whole
    model end to end on the golden token ids. Returns (tensors by golden name, reasons for what was skipped)."""
    from .model import Block
    cfg, g = golden.config, lambda n: torch.from_numpy(golden.load(n))
    ours, skipped = {}, {}
    with torch.no_grad():
        for L in golden.layers:
            block = Block(cfg).eval()
            block.load_state_dict({k: g(f"h{L}_{v}") for k, v in BLOCK_WEIGHTS.items()})
            x = g("embeddings") if L == 0 else g(f"h{L - 1}_block") if f"h{L - 1}_block" in golden else None
            ln_1, attn_resid = g(f"h{L}_ln_1"), g(f"h{L}_attn_resid")
            q, k, v = block.attn.qkv(ln_1)
            stages = {
                "c_attn": block.attn.c_attn(ln_1), "q": q, "k": k, "v": v,
                "attn_probs": block.attn.probs(g(f"h{L}_q"), g(f"h{L}_k"), scale=cfg.attn_scale(L)),
                "attn_out": block.attn(ln_1, L),
                "ln_2": block.ln_2(attn_resid),
                **block.mlp.intermediates(g(f"h{L}_ln_2")),
            }
            if x is not None:
                stages.update(ln_1=block.ln_1(x), attn_resid=x + g(f"h{L}_attn_out"), block=block(x, L))
            else:
                for s in ("ln_1", "attn_resid", "block"):
                    skipped[f"h{L}_{s}"] = f"its input h{L - 1}_block is not in the golden set"
            ours.update({f"h{L}_{k}": v for k, v in stages.items()})
        model, why = rebuild_model(golden)
        if model is None:
            for n in ("embeddings", "ln_f", "logits"):
                skipped[n] = why
        else:  # end to end: our whole model on the token ids, every block output along the way
            seen = {}
            hooks = [model.transformer.drop.register_forward_hook(lambda m, a, o: seen.__setitem__("embeddings", o)),
                     model.transformer.ln_f.register_forward_hook(lambda m, a, o: seen.__setitem__("ln_f", o))]
            hooks += [model.transformer.h[L].register_forward_hook(
                lambda m, a, o, L=L: seen.__setitem__(f"h{L}_block (chain)", o)) for L in golden.layers]
            seen["logits"] = model(torch.tensor([golden.token_ids]))
            for h in hooks:
                h.remove()
            ours.update(seen)
    return {k: v.numpy() for k, v in ours.items()}, skipped


def _ffn_text(row: Row, golden: Golden, entry: dict, actual, own: dict, failed: set) -> str | None:
    """What a failing FFN stage (c_fc, GELU, FFN output) is: the known mistake it equals on the golden input, else
    given the engine's own input to it where that one already failed (its own ln_2 for the whole FFN, its own
    c_fc or GELU output for the stage alone): right for that input (it only inherits an earlier error), or a
    mistake of its own there. None when nothing explains it."""
    from .diagnose import named
    stage, L = entry["stage"], entry["layer"]
    case = golden.ffn_case(L)
    d = case.diagnose(stage, actual, row.atol)
    if d.key:
        return d.text
    prev = {"c_fc": f"h{L}_ln_2", "gelu": f"h{L}_c_fc", "ffn": f"h{L}_gelu"}[stage]
    for name in dict.fromkeys((f"h{L}_ln_2", prev)):
        inp = own.get(name)
        if name not in failed or inp is None or inp.dtype != np.float32 or not np.isfinite(inp).all() \
                or _core(inp.shape) != _core(golden.tensors[name]["shape"]):
            continue
        inp = inp.reshape(golden.tensors[name]["shape"])
        right_for_own = (f"right for its own input: what GPT-2 computes from the candidate's {name}, which is "
                         "already off; fix the first failing checkpoint before it")
        if name == f"h{L}_ln_2":
            given = case.given(inp)
            want = given.expected[stage]
            if _core(actual.shape) == _core(want.shape) and \
                    np.abs(actual.reshape(want.shape) - want).max() <= row.atol:
                return right_for_own
            if (d2 := given.diagnose(stage, actual, row.atol)).key:
                return f"{d2.text} (given the candidate's own {name})"
        else:
            ok, hits = case.local(stage, inp, actual, row.atol)
            if ok:
                return right_for_own
            if hits:
                return f"{named(hits[0][1], stage, hits[0][0]).text} (given the candidate's own {name})"
    return None if row.note else d.text  # a shape note says it already when no mistake explains it


def diagnosed(row: Row, golden: Golden, entry: dict, actual, expected=None, own=None, failed=()) -> Row:
    """A failing row with what went wrong in its note: for an FFN stage the known FFN mistake (_ffn_text), for
    another activation a known block or model mistake (stage_mistake); else what the numbers' encoding or layout
    explains (big-endian, half precision, axes in another order); else the worst element. own: the engine's
    tensors so far by name, failed: the names among them that failed (own inputs are tried only where off)."""
    if row.status != "FAIL":
        return row
    stage, L = entry["stage"], entry["layer"]
    expected = golden.load(entry.get("alias_of", row.name.removesuffix(" (chain)"))) if expected is None else expected
    a = np.asarray(actual)
    clean = a.dtype == np.float32 and np.isfinite(a).all()
    text = None
    unscaled = GOLDEN_ATOL if entry["stage"] in GOLDEN_SCALED else row.atol
    if clean and entry["kind"] != "weight":
        if stage in FFN_STAGES and L in golden.layers:
            text = _ffn_text(row, golden, entry, a, own or {}, set(failed))
        elif (hit := stage_mistake(golden, entry, a, unscaled, closer=0.5 * row.max_abs)) is not None:
            text = f"{hit[1]} (within {hit[0]:.1e} of it): {hit[2]}"
    elif a.dtype == np.float32 and entry["kind"] != "weight" and stage not in FFN_STAGES and a.size == expected.size \
            and 2 * np.isfinite(a).sum() >= a.size:  # mostly finite: a mistake that leaves some values NaN
        finite = np.isfinite(a).reshape(-1)
        off = float(np.abs(a.reshape(-1)[finite] - expected.reshape(-1)[finite]).max())
        if (hit := stage_mistake(golden, entry, a, unscaled, closer=0.5 * off)) is not None:
            text = f"{hit[1]} (within {hit[0]:.1e} of it where finite; a query with no key divides 0 by 0): {hit[2]}"
    if text is None or "matches no known mistake" in text:
        hint = layout_hint(entry, a, expected, row.atol) if clean else None
        hint = hint or (convention_hint(golden, entry, a, expected, row.atol) if clean else None)
        hint = hint or number_hint(a, expected, row.atol)
        if hint is None and clean and entry["kind"] != "weight":
            hint = same_as(golden, row.name.removesuffix(" (chain)"), a, row.atol)
        if hint:
            text = hint
        elif text is None and not row.note and clean:
            text = worst_element(a, expected)
    row.note = "; ".join(t for t in (row.note, text) if t)
    return row


def verify_ours(golden: Golden, tolerances=None, atol=GOLDEN_ATOL, repeat=1) -> list:
    """gpt2ffn's own stages and whole model against the golden set; failing FFN stages are diagnosed."""
    tolerances = tolerances or {}
    first, skipped = run_ours(golden)
    rows = []
    for n in golden.activations():
        entry = golden.tensors[n]
        tol = tolerance_for(n, entry, tolerances, atol, golden.load(n))
        for name in (n, f"{n} (chain)"):
            if name in first:
                rows.append(diagnosed(compare(name, entry, first[name], golden.load(n), tol), golden, entry,
                                      first[name], golden.load(n)))
        if n in skipped:
            rows.append(Row(n, entry["checkpoint"], entry["layer"], tuple(entry["shape"]), float("nan"),
                            float("nan"), tol, "SKIP", skipped[n]))
    for i in range(1, repeat):
        again, _ = run_ours(golden)
        changed = [n for n in first if not np.array_equal(first[n], again[n])]
        if changed:
            rows.append(Row(f"repeat {i + 1}", "--", None, (), float("nan"), float("nan"), 0.0, "FAIL",
                            f"not bit-identical to run 1: {', '.join(changed)}"))
    if repeat > 1 and all(r.status == "PASS" for r in rows if r.name.startswith("repeat")):
        rows.append(Row(f"{repeat} runs", "--", None, (), 0.0, 0.0, 0.0, "PASS", "bit-identical"))
    return rows


class Candidate:
    """Another engine's tensors under the golden names: a directory of NAME.npy or NAME.bin files (raw
    little-endian float32, C order, the golden shape), one .safetensors file keyed by NAME, or one .npz file
    (numpy's savez) keyed by NAME."""

    def __init__(self, path):
        self.path = Path(path)
        self.keys, self.npz = None, None
        if self.path.is_file() and self.path.suffix == ".npz":
            try:
                self.npz = np.load(self.path, allow_pickle=False)
                self.keys = set(self.npz.files)
            except Exception as e:
                raise Gpt2ffnError(f"candidate {self.path} is not a readable .npz file (np.savez): {e}") from None
        elif self.path.is_file() and self.path.suffix == ".safetensors":
            from safetensors import safe_open
            try:
                with safe_open(self.path, framework="numpy") as f:
                    self.keys = set(f.keys())
            except Exception as e:
                raise Gpt2ffnError(f"candidate {self.path} is not a readable .safetensors file: {e}") from None
        elif not self.path.is_dir():
            raise Gpt2ffnError(f"candidate {self.path} does not exist" if not self.path.exists() else
                               f"candidate {self.path} is neither a directory of .npy/.bin files nor a "
                               ".safetensors or .npz file")

    def names(self) -> set:
        """What the candidate holds, by name, for telling a user what matched nothing."""
        if self.keys is not None:
            return self.keys
        return {p.stem for p in self.path.iterdir() if p.suffix in (".npy", ".bin")}

    def read(self, name, expected) -> tuple:
        """(array, None) | (None, why it cannot be judged) | (None, None) when absent."""
        if self.npz is not None:
            if name not in self.keys:
                return None, None
            try:
                return self.npz[name], None
            except ValueError:  # an object array: numpy says to allow pickles
                return None, f"{name} in {self.path.name} holds Python objects (dtype object): save a float32 array"
        if self.keys is not None:
            if name not in self.keys:
                return None, None
            from safetensors import safe_open
            with safe_open(self.path, framework="numpy") as f:
                dtype = f.get_slice(name).get_dtype()
                if dtype == "BF16":  # numpy has no bfloat16
                    return None, ("dtype bfloat16, expected float32: write float32 (tensor.float() before "
                                  "safetensors' save_file)")
                try:
                    return f.get_tensor(name), None
                except Exception as e:
                    return None, f"unreadable tensor {name!r} ({dtype}) in {self.path.name}: {e}"
        npy, raw = self.path / f"{name}.npy", self.path / f"{name}.bin"
        if npy.is_file() and raw.is_file():
            return None, f"both {npy.name} and {raw.name}: keep one"
        if npy.is_file():
            try:
                with open(npy, "rb") as f:
                    magic = f.read(6)
                if magic != b"\x93NUMPY":  # np.load would take it for a pickle and advise allow_pickle=True
                    return None, f"{npy.name} is not an .npy file (no NumPy header): write it with np.save"
                return np.load(npy, allow_pickle=False), None
            except ValueError as e:
                if "allow_pickle" in str(e):  # an object array: numpy says to allow pickles
                    return None, f"{npy.name} holds Python objects (dtype object), not numbers: save a float32 array"
                return None, f"unreadable .npy {npy.name}: {e}"
            except Exception as e:
                return None, f"unreadable .npy {npy.name}: {e}"
        if not raw.is_file():
            return None, None
        size, n = raw.stat().st_size, expected.size
        if size == 0:
            return None, f"{raw.name} is empty: expected {4 * n} bytes (float32, shape {tuple(expected.shape)})"
        if size == 4 * n:
            return np.fromfile(raw, dtype="<f4").reshape(expected.shape), None
        if name == "logits" and size == 4 * expected.shape[-1]:  # the last position's logits only
            return np.fromfile(raw, dtype="<f4"), None
        guesses = [{8 * n: "8 bytes a value: float64? write float32",
                    2 * n: "2 bytes a value: float16 or bfloat16? write float32"}.get(size)]
        per_token = 4 * n // expected.shape[1] if expected.ndim == 3 and expected.shape[0] == 1 else 0
        if per_token and size % per_token == 0 and size // per_token != expected.shape[1]:  # another prompt's
            guesses.insert(0, f"as float32, {size // per_token} tokens where this golden set has {expected.shape[1]}: "
                              f"run the engine on the golden set's ids")
        if size == 8 * n and len(guesses) == 2:  # float64 first where only it reads as values of the expected scale
            scale = float(np.abs(expected).max())

            def plausible(v):
                return bool(np.isfinite(v).all()) and scale / 100 <= float(np.abs(v).max()) <= 100 * scale + 1
            if plausible(np.fromfile(raw, dtype="<f8")) and not plausible(np.fromfile(raw, dtype="<f4")):
                guesses.reverse()
        hint = "; or ".join(g for g in guesses if g)
        return None, (f"{raw.name} holds {size} bytes, expected {4 * n} (float32, {n} values, shape "
                      f"{tuple(expected.shape)})" + (f" ({hint})" if hint else ""))


def verify_candidate(golden: Golden, candidate, tolerances=None, atol=GOLDEN_ATOL) -> list:
    """Judge another engine's tensors (Candidate: .npy or .bin files, or a .safetensors file) under the golden
    names against the golden set, weights first (those the engine wrote: as it loaded them), then activations in
    forward order; seed 001's aliases are judged when present, never missing. Failing rows are diagnosed."""
    cand = candidate if isinstance(candidate, Candidate) else Candidate(candidate)
    tolerances = tolerances or {}
    rows, loaded, failed = [], {}, set()  # loaded: the candidate's arrays so far (forward order), for own inputs
    for name in golden.weights() + golden.activations():
        entry, expected = golden.tensors[name], golden.load(name)
        tol = tolerance_for(name, entry, tolerances, atol, expected)
        actual, why = cand.read(name, expected)
        if actual is None:
            if why or entry["kind"] == "activation":
                absent = f"no {name} in {cand.path.name}" if cand.keys is not None else f"no {name}.npy or .bin"
                rows.append(Row(name, entry["checkpoint"], entry["layer"], tuple(expected.shape),
                                float("nan"), float("nan"), tol, "FAIL" if why else "MISSING", why or absent))
            continue
        last = ""
        if name == "logits" and actual.size == expected.shape[-1] and expected.shape[1] > 1:
            expected, last = expected[:, -1:], "the last position's logits only"
        row = diagnosed(compare(name, entry, actual, expected, tol), golden, entry, actual, expected, loaded, failed)
        if row.status == "PASS" and (near := near_miss(golden, entry, actual, expected)):
            row.note = near
        row.note = "; ".join(t for t in (last, row.note) if t)
        failed |= {name} if row.status == "FAIL" else set()
        loaded[name] = actual
        rows.append(row)
    first = next((r for r in rows if r.status == "FAIL"), None)
    near = next((r for r in rows if r.status == "PASS" and r.note.startswith("within tolerance, but")), None)
    if first is not None and near is not None and rows.index(near) < rows.index(first) and "(within " not in first.note:
        first.note = "; ".join(t for t in (first.note, f"{near.name} passed {near.note}") if t)
    return rows


def unmatched(golden: Golden, cand: Candidate) -> tuple:
    """(the candidate's tensor names that match no golden name, a hint at why): they are not judged."""
    import re
    have = cand.names()
    names = sorted(have - set(golden.tensors))
    hint = ""
    shifted = {re.sub(r"^h(\d+)_", lambda m: f"h{int(m[1]) - 1}_", n) for n in names if re.match(r"h\d+_", n)}
    if shifted & set(golden.tensors) and not any(n.startswith("h0_") for n in have):
        hint = "layers count from 0 (h0_ is the first block); these look 1-based"
    elif names:
        layers = golden.layers
        first = f"h{layers[0]}_" if layers else ""
        only = (f"; this set holds block{'s' * (len(layers) > 1)} {', '.join(map(str, layers))} only"
                if layers and len(layers) < golden.config.n_layer else "")
        hint = (f"the golden names are {first}ln_2, {first}ffn, logits, ...: see manifest.json" if first else
                "the golden names are embeddings, ln_f, logits, ...: see manifest.json") + only
    return names, hint


def verify_negative(golden: Golden, atol=GOLDEN_ATOL) -> list:
    """Every known-wrong FFN (gpt2ffn.diagnose) on each layer's golden ln_2: a row PASSes when the judge FAILs
    the variant and the diagnosis names it."""
    rows = []
    for L in golden.layers:
        case, entry = golden.ffn_case(L), golden.tensors[f"h{L}_ffn"]
        for v in case.known:
            got = v.stages["ffn"].astype(np.float32)
            r = compare(f"h{L}_ffn", entry, got, case.expected["ffn"], atol)
            named = case.diagnose("ffn", got, atol).key == v.key
            ok = r.status == "FAIL" and named
            note = ("judge fails it" if r.status == "FAIL" else "NOT caught: the judge passed a wrong FFN") + \
                   f" ({r.max_abs / atol:.3g}x the tolerance); " + ("named" if named else "NOT named")
            if r.status != "FAIL":  # the mistake really is within tolerance on these inputs: say so
                reach = float(np.abs(case.expected["c_fc"]).max())
                note += (f" (within tolerance on this set's inputs: c_fc's outputs reach only |x| = {reach:.2g}; "
                         "a set of GPT-2's scale, from a trained checkpoint or random:<preset>, tells it apart)")
            rows.append(Row(v.name, r.checkpoint, L, r.shape, r.max_abs, r.max_rel, atol, "PASS" if ok else "FAIL",
                            note))
    return rows


def format_rows(rows, title) -> str:
    w = max([34] + [len(r.name) + 2 for r in rows])
    head = (f"{'checkpoint':<11}{'layer':>5}  {'tensor':<{w}}{'shape':<20}{'max abs':>11}{'max rel':>11}{'tol':>9}"
            "  result")
    lines = [title, head, "-" * len(head)]
    for r in rows:
        ck = f"{r.checkpoint} {SHORT.get(r.checkpoint, '')}" if r.checkpoint else "--"
        # nan: not compared (a file of the wrong size, NaN/Inf values): the note says why
        diff = "".join(f"{v:>11.3e}" if v == v else f"{'--':>11}" for v in (r.max_abs, r.max_rel))
        lines.append(f"{ck:<11}{'' if r.layer is None else r.layer:>5}  {r.name:<{w}}{str(tuple(r.shape)):<20}"
                     f"{diff}{r.atol:>9.0e}  {r.status}{'  ' + r.note if r.note else ''}")
    return "\n".join(lines)


def gelu_effect(model_source: str, ids=None, prompt=None) -> dict:
    """How far exact GELU lands from HF's GPT-2 (tanh): per block at the FFN output, and at the logits."""
    from transformers.activations import ACT2FN
    cfg = (Config.from_pretrained(model_source) if Path(model_source).is_dir() else
           parse_random(model_source)[0] if model_source.startswith("random:") else None)
    if cfg is not None and cfg.gelu_approximate != "tanh":  # said before HF loads anything
        raise ConfigError(f"{model_source} has activation_function={cfg.activation_function!r}: gelu-effect "
                          "measures exact GELU against the tanh GELU of a model that uses it (gelu_new, GPT-2's)")
    model, cfg, info = load_reference(model_source)
    ids = token_ids(cfg, model_source, ids, prompt)
    layers = list(range(cfg.n_layer))
    ref = capture(model, cfg, ids, layers)
    ffn_rows = []
    exact = ACT2FN["gelu"]
    with torch.no_grad():
        for L in layers:
            mlp = model.transformer.h[L].mlp
            tanh_act, mlp.act = mlp.act, exact
            y = mlp(torch.from_numpy(ref[f"h{L}_ln_2"])).numpy()
            mlp.act = tanh_act
            ffn_rows.append({"layer": L, "ffn_max_abs": float(np.abs(y - ref[f"h{L}_ffn"]).max())})
        acts = [b.mlp.act for b in model.transformer.h]
        for b in model.transformer.h:
            b.mlp.act = exact
        logits = model(torch.tensor([ids])).logits.numpy()
        for b, a in zip(model.transformer.h, acts):
            b.mlp.act = a
    return {
        "model": info["source"], "tokens": len(ids), "ffn": ffn_rows,
        "logits_max_abs": float(np.abs(logits - ref["logits"]).max()),
        "argmax_agree": float((logits.argmax(-1) == ref["logits"].argmax(-1)).mean()),
    }
