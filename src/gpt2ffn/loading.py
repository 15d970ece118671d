"""A model and its tokenizer by name: a checkpoint directory, `random:<preset>[:seed]`, or openai-community/gpt2
from the local HF cache (never a download). What the CLI, the server and the benchmarks load through."""

import os
from pathlib import Path

import torch

from .errors import Gpt2ffnError
from .model import load_model, parse_random
from .parallel import make_mesh, parallelize
from .precision import check_precision
from .tokenizer import ByteTokenizer, load_tokenizer


def hf_cache_gpt2():
    """openai-community/gpt2 in the local HF cache (no download), or None."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface")), "hub")
    for repo in ("models--openai-community--gpt2", "models--gpt2"):
        snaps = sorted(Path(hub, repo, "snapshots").glob("*/config.json"))
        if snaps:
            return snaps[-1].parent
    return None


def load(spec=None, dtype=torch.float32, precision: str | None = "fp32", tp: int = 1):
    """(GPT2, tokenizer, name) for a checkpoint directory, `random:<preset>[:seed]`, or None: the HF cache.

    precision: the linear layers' weights, 'fp32' (default), 'bf16', 'int8' or 'int4' (gpt2ffn.quantize);
    it applies to float32 models (with dtype=bfloat16 everything runs in bf16 instead).
    tp > 1: sharded over the default process group's tp ranks (gpt2ffn.parallel; fp32 weights on torch's ops)."""
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
    if spec is None:
        found = hf_cache_gpt2()
        if found is None:
            raise Gpt2ffnError("no local openai-community/gpt2 in the HF cache; get it where there is network with "
                               "`huggingface-cli download openai-community/gpt2`, then pass --model DIR "
                               "(or try --model random:gpt2)")
        spec = str(found)
    model = load_model(spec, dtype, precision)
    if tp > 1:
        model = parallelize(model, make_mesh(tp))
    if spec.startswith("random:"):
        return model, ByteTokenizer(), parse_random(spec)[2]
    return model, load_tokenizer(spec), Path(spec).name
