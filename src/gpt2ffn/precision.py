"""Weight precisions for inference: fp32, bf16, int8 and int4 weights, packed once from the Parameters.

A layer's Parameters stay fp32 in HF's layout (state_dict() is unchanged); `quantize` derives a packed copy
(kernels/formats.py says how each precision rounds) that decode and prefill read instead. LayerNorm,
attention and embeddings stay fp32 at every precision, and so do activations unless int8 ones are asked
for (int8 / int4 weights); only the linear layers' weights (c_attn, attn.c_proj, c_fc, mlp.c_proj, and the
lm_head tied to wte) are rounded. int4 keeps the tied lm_head at
int8, as llama.cpp's q4_0 keeps it at q6_K.

The packed copy is never silently stale: every packed call checks the Parameter's version counter and data
pointer, and re-packs after `load_state_dict`, `copy_`, an optimizer step or `.to()`. In train() mode, or
when autograd needs gradients, layers run on the fp32 Parameters.

`quantize` walks a module tree by what a layer can do (it has `pack`: linear.PackedLayer), so it knows no
class above it.
"""

import torch

from .errors import ConfigError
from .kernels.formats import (  # noqa: F401  (PRECISIONS, ACTIVATIONS: public here)
    ACTIVATIONS,
    DEFAULT_ACTIVATIONS,
    GROUP,
    PRECISIONS,
    check_activations,
    check_precision,
)
from .kernels.packed import default_activations, probe


def packable(module) -> list:
    """The linear layers of `module` that a precision applies to: every module that can pack its weights
    (Conv1D: c_attn, attn.c_proj, c_fc, mlp.c_proj; a GPT-2 lm_head)."""
    return [m for m in module.modules() if callable(getattr(m, "pack", None)) and hasattr(m, "weight_kn")]


def quantize(module, precision: str, group: int | None = None, activations: str | None = None):
    """Give every linear layer of `module` (a FeedForward, a GPT2, a Block, ...) packed weights at
    `precision` ('fp32', 'bf16', 'int8', 'int4'), for inference; returns the module.

    The fp32 Parameters stay (state_dict() is HF's layout, and train() runs on them); eval() forward then
    reads the packed weights through the kernel route the probe measured fastest on this machine. For
    bf16/int8/int4 the Parameters stop asking for gradients, so no_grad or not, eval() computes at the
    chosen precision; call requires_grad_() to train.

    activations ('fp32' or, for int8 / int4, 'int8': integer dot products on activations quantized per
    group, kernels/formats.py): None takes kernels.packed.default_activations(precision)."""
    check_precision(precision)
    activations = check_activations(precision, activations or default_activations(precision))
    if group is not None and precision not in GROUP:
        raise ConfigError(f"group applies to int8 and int4, not {precision}")
    layers = packable(module)
    if not layers:
        raise ConfigError(f"{type(module).__name__} has no GPT-2 linear layers (Conv1D, lm_head) to quantize")
    for m in layers:
        if m.weight.dtype != torch.float32:
            raise ConfigError(f"precision {precision!r} packs fp32 Parameters; {type(m).__name__} weight is "
                              f"{m.weight.dtype} (load with dtype=torch.float32)")
    for m in layers:
        # int4 keeps the tied lm_head (= wte, the most sensitive matrix) at int8, as llama.cpp's q4_0 keeps it
        # at q6_K: measured on random:gpt2, mean KLD vs fp32 0.301 -> 0.287 (q4_0: 0.294)
        head8 = precision == "int4" and m.keeps_int8
        m.pack("int8" if head8 else precision, None if head8 else group, activations)
        if precision != "fp32":
            for p in m.parameters():
                p.requires_grad_(False)
    choice = probe([(m.packed, m.weight_kn(), m.bias) for m in layers], precision, layers[0].weight.device)
    for m in layers:
        m.packed.route = choice
    module.precision = precision
    module.activations = activations
    return module
