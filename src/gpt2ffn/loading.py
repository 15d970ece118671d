"""A model and its tokenizer by name: a checkpoint directory, `random:<preset>[:seed]`, or openai-community/gpt2
from the local HF cache (never a download). What the CLI, the server and the benchmarks load through."""

import dataclasses
import warnings
from pathlib import Path

import torch

from .errors import Gpt2ffnError
from .model import DEVICES, check_spec, load_model, parse_random, resolve_device  # noqa: F401 (DEVICES: the CLI's)
from .precision import check_activations, check_precision
from .tokenizer import ByteTokenizer, HFTokenizer, has_tokenizer_files, load_tokenizer, no_tokenizer
from .weights import cached_snapshot


def hf_cache_gpt2():
    """openai-community/gpt2 in the local HF cache (no download), or None."""
    return cached_snapshot("openai-community/gpt2")


def default_dtype(device: str) -> torch.dtype:
    """bfloat16 on CUDA (tensor cores; HF and vLLM serve GPT-2 so), float32 on the CPU (exact; the packed
    kernels take bf16/int8/int4 through precision instead)."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def load(spec=None, dtype=None, precision: str | None = "fp32", device: str = "cpu", tp: int = 1,
         activations: str | None = None, kv_dtype=None, need_tokenizer: bool = True):
    """(GPT2, tokenizer, name) for a checkpoint directory, `random:<preset>[:seed]`, or None: the HF cache.
    A directory without tokenizer files is an error before any weight is read, unless need_tokenizer is False
    (token ids in and out): then the tokenizer is None.

    device: 'cpu' (default), 'cuda[:N]' or 'auto'; dtype: every tensor's (default: default_dtype(device)).
    precision: the linear layers' weights on the CPU, 'fp32' (default), 'bf16', 'int8' or 'int4'
    (gpt2ffn.quantize, the native kernels); it applies to float32 models (with dtype=bfloat16 everything
    runs in bf16 instead). On CUDA the model is plain torch in dtype: precision must be fp32 (or None).
    tp > 1: sharded over the default process group's tp ranks (gpt2ffn.parallel; fp32 weights on torch's ops).
    activations: 'fp32' or 'int8' (integer dot products, int8/int4 weights on the CPU); None (or 'auto'): the
    machine's default for the precision (kernels.packed.default_activations). kv_dtype: the KV caches' dtype
    (GPT2.kv_dtype, torch.float32 / torch.float16 or their names; None or 'auto': its default, fp16 for
    bf16/int8/int4 weights on the CPU, else the weights' dtype)."""
    if spec is not None:
        spec = check_spec(spec)  # before the device, the tokenizer or any weight (a pathlib.Path as its text)
    # the CLI's names too (--kv-cache-dtype auto|float32|float16, --activations auto|fp32|int8): auto is None
    kv_dtype = {"auto": None, "float32": torch.float32, "float16": torch.float16}.get(kv_dtype, kv_dtype) \
        if isinstance(kv_dtype, str) else kv_dtype
    activations = None if activations == "auto" else activations
    device, dtype, precision = load_args(dtype, precision, device, tp, activations)
    spec, name = _where(spec)
    # A missing tokenizer is named before any weight is read, but the tokenizer is read after them: read first,
    # the memory the weights' packing frees stayed resident (GPT-2 124M int8, peers harness: RSS after load
    # 213-218 MB against 198-204 read after)
    if need_tokenizer and Path(spec).is_dir() and not has_tokenizer_files(spec):
        raise no_tokenizer(spec)
    model = load_model(spec, dtype, precision, activations)
    tok = ByteTokenizer() if spec.startswith("random:") else _tokenizer(spec, need_tokenizer)
    model.config = fit_vocab(model.config, tok)
    model.kv_dtype = kv_dtype
    if device != "cpu":  # .to() of a packed (held-once) model would fill its fp32 weights back in
        model = model.to(device)
    if tp > 1:  # imported here: torch.distributed.tensor adds ~0.9 s to every `import gpt2ffn` (CLI, server)
        from .parallel import make_mesh, parallelize
        model = parallelize(model, make_mesh(tp))
    return model, tok, parse_random(spec)[2] if spec.startswith("random:") else name or Path(spec).name


def load_args(dtype=None, precision: str | None = "fp32", device: str = "cpu", tp: int = 1,
              activations: str | None = None) -> tuple:
    """(device, dtype, precision) as load() takes them, or the error load() would give, without reading anything
    (serve checks its flags so before it binds its port)."""
    device = resolve_device(device)
    dtype = dtype or default_dtype(device)
    if device.startswith("cuda"):
        if precision not in (None, "fp32"):
            raise Gpt2ffnError(f"precision={precision!r} packs weights for gpt2ffn's CPU kernels; on CUDA the "
                               "weights are the dtype's (--dtype bfloat16, the default there, or float32)")
        precision = None
    if tp > 1:
        if precision not in ("fp32", None) or dtype != torch.float32:
            raise Gpt2ffnError(f"--tp shards fp32 weights; it does not combine with precision={precision!r}, "
                               f"dtype={dtype}")
        precision = None
    if precision is not None:
        check_precision(precision)
        if dtype != torch.float32:
            if precision != "fp32":
                raise Gpt2ffnError(f"precision={precision!r} quantizes a float32 model's weights; it does not "
                                   f"combine with dtype={dtype}")
            precision = None
    if activations is not None:
        if precision is None:
            raise Gpt2ffnError(f"activations={activations!r} applies to packed int8/int4 weights on the CPU, not to "
                               f"this model (device {device}, dtype {dtype}, tp {tp})")
        check_activations(precision, activations)
    return device, dtype, precision


def fit_vocab(config, tok):
    """config with its bos/eos ids inside the model's vocabulary, warning of what does not fit. HF's GPT2Config
    keeps GPT-2's 50256 for a model of any vocab_size (GPT2Config(vocab_size=1000), saved): no token can be it, so
    EOS never ends a generation and an empty prompt, which starts from BOS, is refused as an id out of range. Such
    an id becomes the tokenizer's <|endoftext|> where it has one in range, else EOS none and BOS 0. A tokenizer
    with fewer tokens than the model is warned of too: the ids past it decode to nothing."""
    V, notes = config.vocab_size, []
    size = tok.tok.get_vocab_size() if isinstance(tok, HFTokenizer) else None
    if size is not None and size < V:
        notes.append(f"the tokenizer has {size} tokens and the model {V}: ids {size}..{V - 1} decode to no text")
    eos_in = [t for t in config.eos_ids if 0 <= t < V]
    bos_in = config.bos_token_id is None or 0 <= config.bos_token_id < V  # None: no BOS, nothing to fit
    if len(eos_in) == len(config.eos_ids) and bos_in:
        if notes:
            warnings.warn("; ".join(notes), stacklevel=3)
        return config
    alt = tok.tok.token_to_id("<|endoftext|>") if isinstance(tok, HFTokenizer) else None
    alt = alt if alt is not None and 0 <= alt < V else None
    eos = eos_in or ([alt] if alt is not None else [])
    fitted = dataclasses.replace(config, eos_token_id=None if not eos else eos[0] if len(eos) == 1 else eos,
                                 bos_token_id=config.bos_token_id if bos_in else 0 if alt is None else alt)
    eos_ok = len(eos_in) == len(config.eos_ids)
    out = [t for t in config.eos_ids if not 0 <= t < V]
    said = ([] if bos_in else [f"bos_token_id {config.bos_token_id}"]) + (
        [] if eos_ok else [f"eos_token_id {out[0] if len(out) == 1 else out}"])
    theirs = " (the tokenizer's <|endoftext|>)" if alt is not None else ""
    eos_theirs = not eos_ok and eos and not eos_in  # EOS from the tokenizer too: one note for both
    now = ([] if bos_in else [f"BOS {fitted.bos_token_id}" + ("" if eos_theirs else theirs)]) + ([] if eos_ok else [
        f"EOS {fitted.eos_token_id}" + (" (the rest of the config's)" if eos_in else theirs) if eos
        else "no EOS (generation ends at its token limit or a stop)"])
    notes.insert(0, f"the checkpoint's {' and '.join(said)} {'is' if len(said) == 1 else 'are'} outside vocab_size "
                    f"{V} (HF's GPT2Config keeps GPT-2's 50256 for any size): using {' and '.join(now)}")
    warnings.warn("; ".join(notes), stacklevel=3)
    return fitted


def _where(spec):
    """(where the model is, its name if not its directory's): a directory, `random:...`, or from the local HF cache
    (openai-community/gpt2 for None, or a model id)."""
    if spec is None:
        found = hf_cache_gpt2()
        if found is None:
            raise Gpt2ffnError("no local openai-community/gpt2 in the HF cache; get it where there is network with "
                               "`hf download openai-community/gpt2` (huggingface_hub's CLI), then pass --model DIR "
                               "(or try --model random:gpt2)")
        return str(found), "openai-community/gpt2"
    if not spec.startswith("random:") and not Path(spec).exists() and (found := cached_snapshot(spec)) is not None:
        return str(found), spec  # a model id in the local HF cache: named by its id, not its snapshot
    return spec, None


def tokenizer_for(spec=None):
    """The tokenizer load(spec) gives with the model, without the model (the server's process when the engine runs
    in its own: serving/core.py). A directory without tokenizer files is an error."""
    if spec is not None:
        spec = check_spec(spec)
    spec, _ = _where(spec)
    if spec.startswith("random:"):
        return ByteTokenizer()
    if Path(spec).is_dir() and not has_tokenizer_files(spec):
        raise no_tokenizer(spec)
    return _tokenizer(spec, True)


def _tokenizer(spec: str, need: bool):
    """The checkpoint's tokenizer; None where it has none and none is needed (files that are there but broken
    are an error either way; a directory that is not there is load_model's error to name)."""
    if not Path(spec).is_dir() or not (need or has_tokenizer_files(spec)):
        return None
    return load_tokenizer(spec)
