"""One config type for GPT-2, with HF's field names, presets by name, and the seeds' book-style dict."""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

# activation_function (HF name) -> the GELU form it computes. GPT-2 itself uses gelu_new, the tanh form.
ACTIVATIONS = {
    "gelu_new": "tanh",           # GPT-2's own: 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))
    "gelu_pytorch_tanh": "tanh",  # the same formula through F.gelu(approximate="tanh")
    "gelu_fast": "tanh",          # the same formula, factored differently
    "gelu": "none",               # exact: x * Phi(x) via erf
    "relu": "relu",
}

# The seeds' book-style keys (Raschka's GPT_CONFIG_124M) -> HF keys. drop_rate sets all three dropouts.
BOOK_KEYS = {
    "emb_dim": ("n_embd",),
    "n_heads": ("n_head",),
    "n_layers": ("n_layer",),
    "context_length": ("n_positions",),
    "drop_rate": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
}

# Seed 000's book-style config for GPT-2 124M, as the course writes it.
GPT_CONFIG_124M = {
    "vocab_size": 50257,
    "context_length": 1024,
    "emb_dim": 768,
    "n_heads": 12,
    "n_layers": 12,
    "drop_rate": 0.1,
    "qkv_bias": False,
}

# HF GPT2Config's attribute_map aliases.
HF_ALIASES = {
    "hidden_size": "n_embd",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
    "max_position_embeddings": "n_positions",
}
# The sizes a GPT-2 config.json gives (HF's GPT2Config takes GPT-2 small's for any it lacks, and so does Config)
SIZES = ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size")


@dataclass(frozen=True)
class Config:
    """GPT-2 hyperparameters with HF GPT2Config's names and defaults (gpt2, 124M)."""

    n_embd: int = 768                   # model width d
    n_inner: int | None = None          # FFN hidden width; None means 4 * n_embd
    activation_function: str = "gelu_new"  # GPT-2 uses the tanh GELU
    resid_pdrop: float = 0.1            # dropout after attn.c_proj and mlp.c_proj (training only)
    embd_pdrop: float = 0.1             # dropout after token + position embeddings
    attn_pdrop: float = 0.1             # dropout on attention probabilities
    n_layer: int = 12                   # transformer blocks
    n_head: int = 12                    # attention heads; n_embd must divide by it (checked where attention is built)
    n_positions: int = 1024             # context length
    vocab_size: int = 50257             # GPT-2 BPE vocabulary
    layer_norm_epsilon: float = 1e-5    # eps of ln_1, ln_2, ln_f
    initializer_range: float = 0.02     # std of the normal init of every weight
    qkv_bias: bool = True               # c_attn has a bias in GPT-2; the book's from-scratch config turns it off
    bos_token_id: int = 50256
    eos_token_id: int | list | None = 50256  # HF takes a list too (generation stops at any of them), or None
    scale_attn_weights: bool = True     # HF's: scores scaled by 1/sqrt(d/H) (False: not scaled)
    scale_attn_by_inverse_layer_idx: bool = False  # HF's (Stanford CRFM's GPT-2s): block i's scores / (i + 1) too
    tie_word_embeddings: bool = True    # the lm_head is wte (GPT-2's); gpt2ffn's GPT2 has no untied head

    def __post_init__(self):
        for name in ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"Config.{name} must be a positive int, got {value!r}")
        if self.n_inner is not None and (not isinstance(self.n_inner, int) or self.n_inner <= 0):
            raise ConfigError(f"Config.n_inner must be a positive int or None, got {self.n_inner!r}")
        if self.activation_function not in ACTIVATIONS:
            raise ConfigError(f"Config.activation_function {self.activation_function!r} is not supported; "
                              f"known: {', '.join(ACTIVATIONS)}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.eos_ids):
            raise ConfigError(f"Config.eos_token_id must be a token id, a list of them or None, got "
                              f"{self.eos_token_id!r}")
        for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"Config.{name} must be in [0, 1), got {value!r}")

    @property
    def eos_ids(self) -> list:
        """eos_token_id as a list: HF's config may give several (generation ends at any of them), or none."""
        eos = self.eos_token_id
        return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]

    def attn_scale(self, layer: int) -> float | None:
        """The factor on block `layer`'s q k^T, as HF's GPT2Attention.scaling computes it; None for GPT-2's own,
        1/sqrt(d/H) (the kernels' default)."""
        if self.scale_attn_weights and not self.scale_attn_by_inverse_layer_idx:
            return None
        scale = (self.n_embd // self.n_head) ** -0.5 if self.scale_attn_weights else 1.0
        return scale / float(layer + 1) if self.scale_attn_by_inverse_layer_idx else scale

    @property
    def hidden(self) -> int:
        """The FFN's hidden width: n_inner, or 4 * n_embd when n_inner is None."""
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    # HF GPT2Config's other names for the same fields (its attribute_map), and its pad_token_id (GPT-2 has none)
    hidden_size = property(lambda self: self.n_embd)
    max_position_embeddings = property(lambda self: self.n_positions)
    num_attention_heads = property(lambda self: self.n_head)
    num_hidden_layers = property(lambda self: self.n_layer)
    pad_token_id = None

    def to_dict(self) -> dict:
        """HF's name for the config as a dict: GPT2Config's fields (to_hf_dict)."""
        return self.to_hf_dict()

    @property
    def gelu_approximate(self) -> str:
        """'tanh', 'none' (exact) or 'relu': what activation_function computes."""
        return ACTIVATIONS[self.activation_function]

    @classmethod
    def from_name(cls, name: str, **overrides) -> "Config":
        """A preset: gpt2, gpt2-medium, gpt2-large, gpt2-xl (openai-community/ prefix allowed), or tiny."""
        key = name.removeprefix("openai-community/")
        if key not in PRESETS:
            raise ConfigError(f"unknown config name {name!r}; known: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[key], **overrides)

    @classmethod
    def from_dict(cls, d: dict, ignore_unknown: bool = False) -> "Config":
        """From HF keys (n_embd, hidden_size, ...) or the seeds' book keys (emb_dim, drop_rate, ...).

        Unknown keys raise unless ignore_unknown, so a typo like 'n_embed' is not silently dropped."""
        return cls(**cls.fields_of(d, ignore_unknown))

    @classmethod
    def fields_of(cls, d: dict, ignore_unknown: bool = False) -> dict:
        """The Config fields d sets, by their Config names ({"emb_dim": 1024} -> {"n_embd": 1024}), for
        dataclasses.replace(config, **...). Unknown keys raise unless ignore_unknown."""
        fields = {f.name for f in dataclasses.fields(cls)}
        out, unknown = {}, []
        for key, value in d.items():
            targets = BOOK_KEYS.get(key) or ((HF_ALIASES.get(key, key),) if HF_ALIASES.get(key, key) in fields else ())
            if not targets:
                unknown.append(key)
            for target in targets:
                if target in out and out[target] != value:
                    raise ConfigError(f"config sets {target} twice: {out[target]!r} and {value!r} (from {key!r})")
                out[target] = value
        if unknown and not ignore_unknown:
            raise ConfigError(f"unknown config keys {sorted(unknown)}; known: {sorted(fields | set(BOOK_KEYS))}")
        return out

    @classmethod
    def from_pretrained(cls, path) -> "Config":
        """From an HF config.json, or a checkpoint directory holding one."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise ConfigError(f"{path} does not exist (a checkpoint directory holding config.json, or the file)")
        if not file.is_file():
            raise ConfigError(f"no config.json at {file}")
        try:
            d = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{file} holds a {type(d).__name__}, expected a JSON object")
        if d.get("model_type", "gpt2") != "gpt2":
            raise ConfigError(f"{file} has model_type={d['model_type']!r}; gpt2ffn reads GPT-2 (model_type='gpt2')")
        return cls.from_dict({**d, **generation_ids(file.parent / "generation_config.json")}, ignore_unknown=True)

    @classmethod
    def defaults_note(cls, file) -> str:
        """'' or, for a config.json without some of GPT-2's sizes, ' (FILE has no n_head, n_layer: GPT-2's 12, 12
        taken, as transformers does)': what an error its sizes cause (a shape, n_embd % n_head) goes on to say."""
        try:
            d = json.loads(Path(file).read_text())
        except (OSError, ValueError):
            return ""
        if not isinstance(d, dict):
            return ""
        aliases = {k: {k} | {a for a, t in HF_ALIASES.items() if t == k} for k in SIZES}
        absent = [k for k in SIZES if not aliases[k] & set(d)]
        if not absent:
            return ""
        default = cls()
        return (f" ({file} has no {', '.join(absent)}: GPT-2's {', '.join(str(getattr(default, k)) for k in absent)} "
                f"taken, as transformers does)")

    @classmethod
    def coerce(cls, cfg) -> "Config":
        """A Config as is; a dict through from_dict; a preset name through from_name; transformers' GPT2Config."""
        if isinstance(cfg, Config):
            return cfg
        if isinstance(cfg, dict):
            return cls.from_dict(cfg)
        if isinstance(cfg, str):
            return cls.from_name(cfg)
        if callable(getattr(cfg, "to_dict", None)) and getattr(cfg, "model_type", None) == "gpt2":
            return cls.from_dict(cfg.to_dict(), ignore_unknown=True)  # transformers' GPT2Config
        raise ConfigError(f"expected a Config, a dict, a preset name or transformers' GPT2Config, got "
                          f"{type(cfg).__name__}")

    def check_heads(self):
        """Raise unless n_embd splits into n_head heads: attention needs it, an FFN alone does not."""
        if self.n_embd % self.n_head:
            raise ConfigError(f"Config.n_embd={self.n_embd} must divide by n_head={self.n_head}: attention splits "
                              f"n_embd into n_head heads")

    def to_book_dict(self) -> dict:
        """The seeds' book-style dict for this config (GPT_CONFIG_124M's keys), as a learner's class reads it."""
        return {"vocab_size": self.vocab_size, "context_length": self.n_positions, "emb_dim": self.n_embd,
                "n_heads": self.n_head, "n_layers": self.n_layer, "drop_rate": self.resid_pdrop,
                "qkv_bias": self.qkv_bias}

    def to_hf_dict(self) -> dict:
        """Keyword arguments for transformers.GPT2Config (n_inner stays None when it is 4d)."""
        d = dataclasses.asdict(self)
        del d["qkv_bias"]  # HF GPT-2 always has a c_attn bias
        return d


def generation_ids(file: Path) -> dict:
    """bos_token_id and eos_token_id from a checkpoint's generation_config.json where it sets them: HF's generate
    takes them from there, not from config.json. An unreadable file is left to HF's loader to complain about."""
    try:
        d = json.loads(file.read_text()) if file.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return {}
    return {k: d[k] for k in ("bos_token_id", "eos_token_id") if isinstance(d, dict) and d.get(k) is not None}


PRESETS = {
    "gpt2": Config(),
    "gpt2-medium": Config(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": Config(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": Config(n_embd=1600, n_layer=48, n_head=25),
    # A test-sized model (< 1M parameters with its small vocabulary) for offline golden sets and fast tests.
    "tiny": Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=512, bos_token_id=0, eos_token_id=0),
}
