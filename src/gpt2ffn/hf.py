"""patch_hf: put gpt2ffn's FeedForward (and its fast paths) inside a HuggingFace GPT-2 model."""

import torch.nn as nn

from .config import ACTIVATIONS, Config
from .errors import Gpt2ffnError
from .ffn import FeedForward


def patch_hf(model: nn.Module) -> int:
    """Swap every GPT2MLP of a transformers GPT-2 model for a FeedForward sharing its Parameters.

    Outputs stay within the fp32 tolerance; returns how many blocks were patched. A model that is not
    GPT-2, or whose MLP gpt2ffn does not compute, is refused with the reason, and left unchanged."""
    try:
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
    except ImportError:
        raise Gpt2ffnError("patch_hf needs transformers: pip install 'gpt2ffn[hf]'") from None
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "gpt2":
        raise Gpt2ffnError(f"patch_hf takes a transformers GPT-2 model (model_type 'gpt2'), got "
                           f"{type(model).__name__} with model_type {getattr(config, 'model_type', None)!r}")
    if config.activation_function not in ACTIVATIONS:
        raise Gpt2ffnError(f"patch_hf: activation_function {config.activation_function!r} is not one gpt2ffn "
                           f"computes ({', '.join(ACTIVATIONS)}); the model is left unchanged")
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, GPT2MLP)]
    if not targets:
        raise Gpt2ffnError(f"patch_hf found no GPT2MLP in {type(model).__name__} (already patched?)")
    for parent, name, mlp in targets:
        d, hidden = mlp.c_fc.weight.shape
        cfg = Config(n_embd=d, n_inner=hidden, activation_function=config.activation_function,
                     resid_pdrop=config.resid_pdrop)
        ffn = FeedForward(cfg).to(device=mlp.c_fc.weight.device, dtype=mlp.c_fc.weight.dtype)
        for sub in ("c_fc", "c_proj"):
            getattr(ffn, sub).weight = getattr(mlp, sub).weight  # shared, not copied
            getattr(ffn, sub).bias = getattr(mlp, sub).bias
        ffn.train(mlp.training)
        setattr(parent, name, ffn)
    return len(targets)
