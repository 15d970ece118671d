"""A learner's code, loaded and built: FILE.py:NAME imported from its path, a class built with the config
its own file defines (nanoGPT's @dataclass GPTConfig, any class whose fields name the width), else the
seeds' book-style dict (GPT_CONFIG_124M), else an object answering both naming styles.

    obj, label = load_object("my_gpt.py:GPT")
    module, how = build(obj, Config.from_name("gpt2"))   # how: "GPT(GPTConfig(n_embd=768, ...))"
"""

import dataclasses
import importlib.util
import inspect
import json
import sys
from pathlib import Path

import torch.nn as nn

from .config import GPT_CONFIG_124M, Config
from .errors import Gpt2ffnError


class CheckError(Gpt2ffnError):
    """What stops a check from running, in one line."""


# The field names learners give GPT-2's hyperparameters (HF, nanoGPT, the book, common variants) -> the value.
WIDTH_NAMES = ("n_embd", "emb_dim", "d_model", "hidden_size")
# A constructor's one argument by these names is the width itself, not a config.
WIDTH_ARGS = WIDTH_NAMES + ("embed_dim", "dim", "ndim", "d", "normalized_shape", "n_state", "width")
FIELD_NAMES = {
    "n_embd": WIDTH_NAMES + ("embed_dim", "dim"),
    "n_head": ("n_head", "n_heads", "num_heads", "num_attention_heads"),
    "n_layer": ("n_layer", "n_layers", "num_layers", "num_hidden_layers"),
    "n_positions": ("block_size", "context_length", "n_positions", "n_ctx", "max_position_embeddings",
                    "max_seq_len", "context_size"),
    "vocab_size": ("vocab_size", "vocab", "n_vocab", "num_tokens", "vocab_len"),
    "hidden": ("n_inner", "d_ff", "intermediate_size", "ffn_dim"),
    "resid_pdrop": ("dropout", "drop_rate", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout_rate"),
    "bias": ("bias", "qkv_bias", "use_bias"),
    "layer_norm_epsilon": ("layer_norm_epsilon", "layer_norm_eps", "ln_eps", "norm_eps", "eps"),
    "activation_function": ("activation_function",),
}


# Every name a GPT-2 config field goes by, in any style (a --config key outside these is the learner's own, or a typo)
GPT2_NAMES = ({n for names in FIELD_NAMES.values() for n in names} | {f.name for f in dataclasses.fields(Config)}
              | set(GPT_CONFIG_124M))

# Argument names the keyword path of build() leaves alone: they mean different widths in different code.
AMBIGUOUS_ARGS = ("hidden_size", "dim", "eps")


def gpt2_values(cfg: Config) -> dict:
    """Every field name a learner's config may have -> its value for GPT-2 of cfg's shape (biases on)."""
    value = {k: getattr(cfg, k) for k in ("n_embd", "n_head", "n_layer", "n_positions", "vocab_size", "hidden",
                                          "resid_pdrop", "layer_norm_epsilon", "activation_function")}
    value["bias"] = True  # GPT-2 has every bias, c_attn's too
    return {name: value[key] for key, names in FIELD_NAMES.items() for name in names}


# ---- loading the file -----------------------------------------------------------------------------------

def _where(e, path) -> str:
    """' (line N)' of the deepest traceback frame in the learner's file."""
    line, tb = None, e.__traceback__
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename) == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (line {line})" if line else ""


def super_missing(e):
    """The module class whose __init__ assigned a layer before calling super().__init__(), or None."""
    if not (isinstance(e, AttributeError) and "before Module.__init__() call" in str(e)):
        return None
    name, tb = None, e.__traceback__
    while tb is not None:
        me = tb.tb_frame.f_locals.get("self")
        if tb.tb_frame.f_code.co_name == "__init__" and isinstance(me, nn.Module):
            name = type(me).__name__
        tb = tb.tb_next
    return name


def super_message(name, e) -> str:
    return (f"{name}.__init__ never calls super().__init__(): add super().__init__() as its first line "
            f"(nn.Module sets itself up there; without it torch says: {e})")


class NoIPython:
    """What `get_ipython()` returns in a notebook exported to .py (nbconvert writes `get_ipython().run_line_magic(
    'matplotlib', 'inline')` for %matplotlib, `.system(...)` for !pip): every magic and shell command does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def load_object(target: str):
    """(object, label) for FILE.py:NAME; the file is imported as a module from its path (its __main__ block
    does not run)."""
    file, sep, name = target.rpartition(":")
    if not sep or not file or not name:
        raise CheckError(f"expected FILE.py:NAME (a class or an instance in the file), got {target!r}")
    path = Path(file).resolve()
    if path.is_dir():
        raise CheckError(f"{file} is a directory: give the Python file in it, FILE.py:NAME")
    if not path.is_file():
        raise CheckError(f"no file {file}")
    # As `python FILE.py` would: its folder first on sys.path, so it imports its neighbours (the book's
    # `from previous_chapters import ...`); in a package (minGPT's mingpt/model.py), the folder holding the package,
    # and the file imported under its dotted name, so `from mingpt.utils import ...` and relative imports work.
    root, dotted = path.parent, [path.stem]
    while (root / "__init__.py").is_file():
        dotted.insert(0, root.name)
        root = root.parent
    for folder in dict.fromkeys([str(path.parent), str(root)]):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    name_in_sys = ".".join(dotted) if len(dotted) > 1 else f"gpt2ffn_check_{path.stem}"
    spec = importlib.util.spec_from_file_location(name_in_sys, path)
    module = importlib.util.module_from_spec(spec)
    module.get_ipython = NoIPython  # a notebook's export (nbconvert): its %magics and !commands do nothing here
    sys.modules[spec.name] = module  # @dataclass and pickling look a class's module up by name
    try:
        if len(dotted) > 1:
            importlib.import_module(".".join(dotted[:-1]))  # its package's __init__ first, as an import runs it
        spec.loader.exec_module(module)
    except SystemExit as e:  # a script's sys.exit(main()) at top level: it would end check with its own code
        del sys.modules[spec.name]
        raise CheckError(f"importing {file} called sys.exit({e.code!r}){_where(e, path)}: a script's run belongs "
                         "under `if __name__ == \"__main__\":`, which check does not run") from None
    except Exception as e:
        del sys.modules[spec.name]
        who = super_missing(e)
        why = super_message(who, e) if who else f"{type(e).__name__}: {e}"
        raise CheckError(f"importing {file} failed{_where(e, path)}: {why}".splitlines()[0]) from None
    if not hasattr(module, name):
        found = [n for n, v in vars(module).items() if not n.startswith("_") and (
            isinstance(v, nn.Module) or inspect.isclass(v) and issubclass(v, nn.Module) and v.__module__ == spec.name)]
        raise CheckError(f"{file} has no {name!r}; its modules: {', '.join(found) or 'none'}")
    return getattr(module, name), f"{Path(file).name}:{name}"


# ---- what a class is built with -------------------------------------------------------------------------

def override(config, base: Config | None = None) -> tuple:
    """--config as (Config for the values, the raw dict or None): JSON text, a .json file, a preset name or a Config.
    A dict changes only the fields it names, of base (the reference's config): {"drop_rate": 0.0} keeps the rest."""
    if isinstance(config, Config):
        return config, None
    if isinstance(config, dict):
        return dataclasses.replace(base or Config(), **Config.fields_of(config, ignore_unknown=True)), config
    text = str(config)
    if Path(text).is_dir():
        raise CheckError(f"--config {text} is a directory: give JSON text, a .json file or a preset name")
    if text.lstrip().startswith(("{", "[")) or text.endswith(".json"):
        try:
            d = json.loads(Path(text).read_text() if text.endswith(".json") else text)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckError(f"--config {text!r} is not a JSON object or file: {e}") from None
        if not isinstance(d, dict):
            raise CheckError(f"--config {text!r} holds a {type(d).__name__}, expected a JSON object")
        try:
            return override(d, base)
        except Gpt2ffnError:  # values only the learner's class knows: they go to it as they are
            return base or Config(), d
    return Config.from_name(text), None


def _fields(cls) -> list:
    """The names a config class takes: dataclass fields, its own __init__'s parameters, or its class attributes."""
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls) if f.init]
    if "__init__" in vars(cls):
        return [p for p in list(inspect.signature(cls.__init__).parameters)[1:]]
    return [k for k, v in vars(cls).items() if not k.startswith("_") and not callable(v)]


def _annotated_class(cls):
    """The class cls's constructor's first parameter is annotated with (def __init__(self, args: ModelArgs)), or
    None."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:2]
    ann = params[0].annotation if params else inspect.Parameter.empty
    if isinstance(ann, str):
        ann = getattr(sys.modules.get(cls.__module__), ann, None)
    return ann if inspect.isclass(ann) and ann is not inspect.Parameter.empty else None


def config_class(cls):
    """The config class cls's constructor takes: its parameter's annotation, else the one class in cls's file
    (not a module) whose fields name the width (n_embd, emb_dim, d_model, hidden_size). None if there is none."""
    mod = sys.modules.get(cls.__module__)
    ann = _annotated_class(cls)
    candidates = [ann] if ann is not None else []
    if mod is not None:
        candidates += [v for v in vars(mod).values() if inspect.isclass(v) and v.__module__ == mod.__name__
                       and not issubclass(v, nn.Module)]
    return next((c for c in candidates if set(_fields(c)) & set(WIDTH_NAMES)), None)


def _required(cfg_cls) -> list:
    """The parameters of cfg_cls's constructor that have no default (a dataclass's fields without one)."""
    try:
        params = list(inspect.signature(cfg_cls).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def make_config(cfg_cls, cfg: Config, raw: dict | None = None) -> tuple:
    """(an instance of the learner's config class with GPT-2's values for the fields it has, its repr)."""
    values = {**gpt2_values(cfg), **(raw or {})}
    names = [n for n in _fields(cfg_cls) if n in values]
    kw = {n: values[n] for n in names}
    try:
        if dataclasses.is_dataclass(cfg_cls) or "__init__" in vars(cfg_cls):
            obj = cfg_cls(**kw)
        else:
            obj = cfg_cls()
            for n, v in kw.items():
                setattr(obj, n, v)
    except Exception as e:
        unset = [n for n in _required(cfg_cls) if n not in kw]
        example = json.dumps({n: "VALUE" for n in unset}).replace('"VALUE"', "VALUE")
        hint = (f": {', '.join(unset)} {'is' if len(unset) == 1 else 'are'} not a GPT-2 field check knows; give "
                f"{'it' if len(unset) == 1 else 'them'} with --config '{example}' (check(obj, config={{...}}) in "
                "Python)" if unset and isinstance(e, TypeError) else "")
        raise CheckError(f"{cfg_cls.__name__}({', '.join(f'{n}=...' for n in names)}) raised "
                         f"{type(e).__name__}: {e}".splitlines()[0] + hint) from None
    return obj, f"{cfg_cls.__name__}({', '.join(f'{n}={v!r}' for n, v in kw.items())})"


class ReadKeys(dict):
    """A config dict that remembers which keys its reader asked for (a read of the whole dict counts as all), so a
    --config key no one read (a typo: "drop_rte") can be named."""

    def _mark(self, *keys):
        self.__dict__.setdefault("read", set()).update(keys or super().keys())

    def __getitem__(self, key):
        self._mark(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._mark(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._mark(key)
        return super().__contains__(key)

    def _whole(name):  # a read of every key
        def read_all(self):
            self._mark()
            return getattr(dict, name)(self)
        return read_all

    __iter__, keys, items, values = _whole("__iter__"), _whole("keys"), _whole("items"), _whole("values")
    copy = _whole("copy")

    def unread(self, raw) -> list:
        """raw's keys (--config's) that name no GPT-2 field in any style and that no one read."""
        return [k for k in raw or () if k not in GPT2_NAMES and k not in self.__dict__.get("read", ())]


def _unread_note(keys: list, who: str) -> str:
    return (f"; --config's {', '.join(repr(k) for k in keys)} {'is' if len(keys) == 1 else 'are'} no GPT-2 field "
            f"and {who}" if keys else "")


class BothStyles(ReadKeys):
    """A config answering both naming styles: cfg["emb_dim"] (the book's dict) and cfg.n_embd (nanoGPT, HF)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no field {name!r}; it has {', '.join(self)}") from None


def _call(cls, args: list, how: str, cfg_label: str, cfg=None, kwargs=None):
    try:
        return cls(*args, **(kwargs or {}))
    except Exception as e:
        who = super_missing(e)
        if who:
            raise CheckError(super_message(who, e)) from None
        hint = (f": it reads a key {cfg_label} does not have ({', '.join(cfg)}); give it with --config "
                f"'{{\"{e.args[0]}\": VALUE}}' (check(obj, config={{...}}) in Python)"
                if isinstance(e, KeyError) and cfg and e.args else "")
        raise CheckError(f"{how} raised {type(e).__name__}: {e}{hint}".splitlines()[0]) from None


def _default_config(cls, default, values: Config, raw: dict | None) -> tuple:
    """cls(C) for a class that names its own default config (minGPT's GPT.get_default_config(), a CfgNode): C's
    fields set to GPT-2's values of the reference's shape, and model_type (minGPT's preset name, which must be
    None when the sizes are given) to None."""
    try:
        C = default()
    except Exception as e:
        raise CheckError((f"{cls.__name__}.get_default_config() raised "
                          f"{type(e).__name__}: {e}").splitlines()[0]) from None
    given = {**gpt2_values(values), **(raw or {})}
    fields = list(vars(C)) if hasattr(C, "__dict__") else []
    kw = {n: given[n] for n in fields if n in given}
    if "model_type" in fields:
        kw["model_type"] = raw.get("model_type") if raw and "model_type" in raw else None
    for n, v in kw.items():
        setattr(C, n, v)
    label = f"{cls.__name__}.get_default_config() with {', '.join(f'{n}={v!r}' for n, v in kw.items())}"
    return _call(cls, [C], f"{cls.__name__}({label})", "C"), f"{cls.__name__}({label})"


def build(cls, ref: Config, config=None, qkv_bias: bool = False) -> tuple:
    """(instance of cls, how it was built). cls() when its constructor takes nothing; else cls(one config):
    the file's own config class filled with GPT-2's values (ref's shape, or --config's), else the book's dict
    (GPT_CONFIG_124M for gpt2; qkv_bias as asked: a whole GPT-2 has c_attn biases), else, when the class reads
    the dict's keys as attributes, an object with both naming styles."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        sig = None
    params = [] if sig is None else [p for p in sig.parameters.values()
                                     if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    named = [] if sig is None else [p for p in sig.parameters.values()
                                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    values, raw = (ref, None) if config is None else override(config, ref)
    # names that say one GPT-2 field and nothing else (hidden_size is HF's width but many a learner's FFN width)
    fields = {k: v for k, v in gpt2_values(values).items() if k not in AMBIGUOUS_ARGS}
    required = [p for p in named if p.default is p.empty]
    if required and not (len(params) == 1 and params[0].name in WIDTH_ARGS) and all(p.name in fields for p in required):
        # MLP(embed_dim, intermediate_size), GPT(*, vocab_size, n_embd, ...): each required argument a GPT-2 field's
        # name gets its value; one with a default keeps it, unless --config asks for the reference's values
        given = {k: v for k, v in (raw or {}).items() if v is not None}  # --config's own values, as it gave them
        kw = {p.name: given.get(p.name, fields[p.name]) for p in named
              if p.name in fields and (p in required or config is not None)}
        how = f"{cls.__name__}({', '.join(f'{n}={v!r}' for n, v in kw.items())})"
        return _call(cls, [], how, "", kwargs=kw), how
    if len(params) > 1 or (params and params[0].kind is inspect.Parameter.KEYWORD_ONLY):
        raise CheckError(f"{cls.__name__}{sig} wants {', '.join(p.name for p in params)}; check builds a class with "
                         f"one config dict (GPT_CONFIG_124M) or its file's config class: make an instance in "
                         f"your file (ffn = {cls.__name__}(...)) and check that (FILE.py:ffn)")
    if not params:
        return _call(cls, [], f"{cls.__name__}()", ""), f"{cls.__name__}()"
    if params[0].name in WIDTH_ARGS:  # FeedForward(n_embd) (Karpathy's lecture), the book's LayerNorm(emb_dim)
        how = f"{cls.__name__}({params[0].name}={values.n_embd})"
        return _call(cls, [values.n_embd], how, ""), how
    default = getattr(cls, "get_default_config", None)
    if callable(default) and not inspect.signature(default).parameters:  # minGPT: GPT.get_default_config()
        return _default_config(cls, default, values, raw)
    cfg_cls = config_class(cls)
    if cfg_cls is not None:
        obj, label = make_config(cfg_cls, values, raw)
        foreign = [k for k in raw or () if k not in GPT2_NAMES and k not in _fields(cfg_cls)]
        return _call(cls, [obj], f"{cls.__name__}({label})", label), f"{cls.__name__}({label})" + _unread_note(
            foreign, f"{cfg_cls.__name__} has no such field: left out")
    if config is not None:  # the fields --config names, over the reference's book dict
        book, label = {**values.to_book_dict(), **(raw or {})}, "cfg"
    elif (ref.n_embd, ref.hidden) == (768, 3072):
        book, label = dict(GPT_CONFIG_124M), "GPT_CONFIG_124M"
    else:
        book, label = ref.to_book_dict(), "cfg"
    if qkv_bias and book.get("qkv_bias") is False:
        book = {**book, "qkv_bias": True}
        label += " with qkv_bias=True (GPT-2's c_attn has biases)"
    how = f"{cls.__name__}({label})" + (f", cfg = {json.dumps(book)}" if label == "cfg" else "")
    book = ReadKeys(book)
    try:
        return cls(book), how + _unread_note(book.unread(raw), f"{cls.__name__} did not read it")
    except AttributeError as e:
        if "'ReadKeys' object has no attribute" not in str(e):
            _call(cls, [book], f"{cls.__name__}({label})", label, book)  # re-raise it as a CheckError
    except KeyError as e:  # the dict read with another style's keys (cfg["n_embd"]): both styles answer below
        key = e.args[0] if e.args else None
        if key in book or key not in fields:
            _call(cls, [book], f"{cls.__name__}({label})", label, book)
    except Exception:
        _call(cls, [book], f"{cls.__name__}({label})", label, book)
    both = BothStyles({**gpt2_values(values), **book})
    ann = _annotated_class(cls)
    why = (f"check builds a config class only when it names the width {', '.join(WIDTH_NAMES[:-1])} or "
           f"{WIDTH_NAMES[-1]} ({ann.__name__} names none)" if ann else "its file has no config class")
    built = _call(cls, [both], f"{cls.__name__}(config)", "config")
    return built, (f"{cls.__name__}(config), an object with both naming styles (config.n_embd = config['emb_dim'] = "
                   f"{both.get('emb_dim')}), as {why}"
                   + _unread_note(both.unread(raw), f"{cls.__name__} did not read it"))
