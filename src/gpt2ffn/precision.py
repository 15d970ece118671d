"""Weight precisions for inference: fp32, bf16, int8 and int4 weights, packed once from the Parameters.

`quantize` packs each linear layer's weights (kernels/formats.py says how each precision rounds) for decode
and prefill to read, and by default lets the fp32 weights go (weights held once, linear.py): `state_dict()`
still answers in HF's layout, unpacked from the packed weights (exact for fp32 and bf16, dequantized for
int8 and int4). `keep_fp32=True` keeps both copies. LayerNorm, attention and embeddings stay fp32 at every
precision, and so do activations unless int8 ones are asked for (int8 / int4 weights: integer dot
products); only the linear layers' weights (c_attn, attn.c_proj, c_fc, mlp.c_proj, and the lm_head tied to
wte) are rounded. int4 keeps the tied lm_head at
int8, as llama.cpp's q4_0 keeps it at q6_K.

Every packed call checks the Parameter's version counter and data pointer, and re-packs after an optimizer
step, `copy_`, `weight.data = ...` or `.to()`; `load_state_dict` re-packs on the next call whatever the
counters say (an inference-mode tensor has none). In train() mode layers run on the fp32 Parameters: an fp32
model held once gets them back in train() (and re-packs in eval()); a bf16/int8/int4 one has none and raises
PackedOnlyError. In eval() a layer held once computes on its packed weights with autograd on too
(linear.PackedMatmul); one that keeps both copies computes on the Parameters when a gradient is asked.

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
    group_for,
    packing_arena,
    release_freed_memory,
)
from .kernels.packed import PACKED_ROUTES, default_activations, probe, routes


def packable(module) -> list:
    """The linear layers of `module` that a precision applies to: every module that can pack its weights
    (Conv1D: c_attn, attn.c_proj, c_fc, mlp.c_proj; a GPT-2 lm_head)."""
    return [m for m in module.modules() if callable(getattr(m, "pack", None)) and hasattr(m, "weight_kn")]


def pack_layer(m, precision: str, group, activations: str, once: bool, auto: bool = False):
    """Pack one layer for quantize(). auto (activations not asked for): a layer whose inputs no int8 word
    layout divides (int4: K % 8, int8: K % 4, as n_embd 7 or 36) takes fp32 activations, not an error."""
    if m.dropped and not once:
        m.restore_weight()
    m.hold_once = once  # then pack() lets the fp32 weight go at once: the peak is one layer over the model
    if precision != "fp32" and once:  # held only packed: nothing to train (keep_fp32 trains its Parameters)
        for p in m.parameters():
            p.requires_grad_(False)
    # int4 keeps the tied lm_head (= wte, the most sensitive matrix) at int8, as llama.cpp's q4_0 keeps it
    # at q6_K: measured on random:gpt2, mean KLD vs fp32 0.301 -> 0.287 (q4_0: 0.294)
    head8 = precision == "int4" and m.keeps_int8
    # int8 gives that lm_head (the logits' own layer) fp32 activations: measured on random:gpt2 over 1024
    # positions, mean KLD vs fp32 2.22e-3 -> 2.12e-3 (q8_0: 2.20e-3) for ~0.1 ms a decode token, and
    # prefill runs it on one row; int4's error is its weights' (0.2863 -> 0.2862), so it stays int8 there
    head_act = "fp32" if precision == "int8" and m.keeps_int8 else activations
    fmt, g = ("int8", None) if head8 else (precision, group)
    if auto and head_act == "int8":
        try:
            group_for(m.weight_kn().shape[0], fmt, g, "int8")
        except ConfigError:
            head_act = "fp32"
    m.pack(fmt, g, head_act)


def holds_once(precision: str, device="cpu", keep_fp32: bool = False) -> bool:
    """Whether quantize(module on `device`, precision, keep_fp32=keep_fp32) lets each layer's fp32 weight go as
    it packs it: the native kernels run there (a route that reads only the packed copy)."""
    return not keep_fp32 and any(r in PACKED_ROUTES for r in routes(precision, device))


def quantize(module, precision: str, group: int | None = None, keep_fp32: bool = False,
             activations: str | None = None):
    """Give every linear layer of `module` (a FeedForward, a GPT2, a Block, ...) packed weights at
    `precision` ('fp32', 'bf16', 'int8', 'int4'), for inference; returns the module, in eval().

    Weights held once (the default, where the native kernels run): each layer's fp32 weight is let go as soon
    as it is packed, and the kernel routes are those that read only the packed copy (PACKED_ROUTES).
    state_dict() answers in HF's layout from the packed weights; an fp32 module trains as before (train()
    unpacks into the Parameters, eval() re-packs: one copy at a time); train() or autograd on a bf16/int8/int4
    one raises PackedOnlyError. keep_fp32=True (or no native kernels: the torch route reads fp32 weights)
    keeps the Parameters beside the packed copy, as before: train() and autograd run on them, and eval()
    reads the packed weights through the route the probe measured fastest on this machine.
    For bf16/int8/int4 held once the Parameters stop asking for gradients (an fp32 one keeps the user's
    requires_grad); no_grad or not, eval() computes at the chosen precision (with both copies kept, a gradient
    asked in eval() runs on the fp32 Parameters). A module held only at bf16/int8/
    int4 is refused another precision: its fp32 values are gone, and re-quantizing its rounded ones would
    pass for what it is not.

    activations ('fp32' or, for int8 / int4, 'int8': integer dot products on activations quantized per
    group, kernels/formats.py): None takes kernels.packed.default_activations(precision), and fp32 ones in a
    layer whose width the int8 layout cannot hold (int4: inputs % 8, int8: % 4); asked for, that is an error."""
    check_precision(precision)
    auto = activations is None
    activations = check_activations(precision, activations or default_activations(precision))
    if group is not None and precision not in GROUP:
        raise ConfigError(f"group applies to int8 and int4, not {precision}")
    layers = packable(module)
    if not layers:
        hf = type(module).__module__.startswith("transformers.")
        raise ConfigError(f"{type(module).__name__} has no GPT-2 linear layers (Conv1D, lm_head) to quantize"
                          + (": quantize takes gpt2ffn's modules; load the checkpoint with GPT2.from_pretrained(dir, "
                             "precision=...), or patch_hf(model) then quantize(model, ...)" if hf else ""))
    for m in layers:
        held, target = m.held_at(), "int8" if precision == "int4" and m.keeps_int8 else precision
        if held and held != target:
            raise ConfigError(f"{type(module).__name__} holds only {held} weights: their fp32 values are gone, so "
                              f"{precision} would be made from {held}-rounded ones; load it again with "
                              f"precision={precision!r} (or quantize with keep_fp32=True to switch later)")
    for m in layers:
        if m.weight.dtype != torch.float32:
            raise ConfigError(f"precision {precision!r} packs fp32 Parameters; {type(m).__name__} weight is "
                              f"{m.weight.dtype} (load with dtype=torch.float32)")
    device = layers[0].weight.device
    once = holds_once(precision, device, keep_fp32)
    module.eval()  # as the docstring says, with both copies kept too
    with packing_arena():  # the packed weights side by side on huge pages (kernels/formats.py: on_huge_pages)
        for m in layers:
            pack_layer(m, precision, group, activations, once, auto)
    choice = probe([(m.packed, None if m.dropped else m.weight_kn(), m.bias) for m in layers], precision, device,
                   only=PACKED_ROUTES if once else None)
    for m in layers:
        m.packed.route = choice
    module.precision = precision
    module.activations = activations
    if once:
        release_freed_memory()
    return module
