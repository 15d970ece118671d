"""GPT-2's linear layers on packed weights: Conv1D (HF/OpenAI's [in, out] layout) and what every packable
layer shares (PackedLayer). gpt2ffn.quantize packs any module that has `pack`; the kernels are in kernels/.

Weights held once: a layer that `quantize` packs for inference (its default, `keep_fp32=False`) lets its
fp32 weight go once the packed copy exists. The Parameter stays (same object, shape, dtype and device, so
optimizers, tying and `named_parameters` see what they saw) over a single zero element, as a HeldWeight whose
reads see the unpacked values and whose writes in place raise PackedOnlyError, and
`state_dict()` answers in HF's layout by unpacking the packed weights (exact for fp32 and bf16, the
dequantized q * s for int8 and int4). An fp32 layer gets its Parameter back in train() and re-packs in eval()
(one copy at any time); a bf16/int8/int4 layer has nothing to train and says so (PackedOnlyError).

In eval() the packed weights serve with autograd on as well (PackedMatmul): the input's gradient goes through
the weights the layer computed with, and an fp32 weight held once gets its gradient x^T dy and its values back
(unpacked, exact) in the backward, so an optimizer can write them; the next packed call re-packs. The
Parameters' requires_grad is the user's throughout."""

import contextlib
import copy
import threading
import weakref
from collections import OrderedDict

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .errors import PackedOnlyError
from .kernels.formats import Packed, changed, release_freed_memory
from .kernels.packed import linear, regime

# ---- modules whose weights are about to be loaded -------------------------------------------------------------

_BUILD = threading.local()


@contextlib.contextmanager
def uninitialized():
    """Modules built inside (in this thread) leave their weights as torch.empty made them, for a model whose
    every weight is loaded next (from_pretrained, random:): GPT-2 124M's normal_ draws took 1.6 of its 4.5 s load
    on an AMD EPYC Zen 3. Biases and LayerNorms start as always (zeros, ones: cheap)."""
    before = getattr(_BUILD, "empty", False)
    _BUILD.empty = True
    try:
        yield
    finally:
        _BUILD.empty = before


def building_uninitialized() -> bool:
    return getattr(_BUILD, "empty", False)


# ---- a weight held once, as its Parameter shows it -------------------------------------------------------------

# id of a held Parameter (or of its .data) -> (weakref to it, weakref to its layer, its class before): by id, as a
# tensor's own hash and == would run through __torch_function__ below
_HELD = {}


def _hold(t, layer, cls, held_cls):
    """t held by layer: of class held_cls until _unhold gives it back cls."""
    key = id(t)
    _HELD[key] = (weakref.ref(t, lambda _, held=_HELD: held.pop(key, None)), weakref.ref(layer), cls)
    t.__class__ = held_cls


def _held_entry(t):
    entry = _HELD.get(id(t))
    return entry if entry is not None and entry[0]() is t else None


# what a held weight answers as it is: its metadata, identity and gradient, and what gpt2ffn itself reads of it
_AS_IS = {"shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "_version", "layout", "ndim",
          "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "names", "_base", "_cdata",
          "size", "dim", "numel", "nelement", "stride", "storage_offset", "is_contiguous", "data_ptr",
          "untyped_storage", "element_size", "is_floating_point", "is_complex", "get_device", "requires_grad_",
          "__hash__", "__len__", "type", "new_zeros", "new_empty", "_is_view", "is_shared",
          "retain_grad", "register_hook", "register_post_accumulate_grad_hook", "__reduce_ex__", "__deepcopy__",
          "__setstate__", "__getstate__", "is_inference", "is_pinned", "is_set_to", "share_memory_"}
_WRITES = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
           "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "set_"}


def _func_name(func) -> str:
    """A torch function's name; a property's own name for its getter or setter (`shape` for Tensor.shape's)."""
    name = getattr(func, "__name__", "")
    return getattr(getattr(func, "__self__", None), "__name__", name) if name in ("__get__", "__set__") else name


def _unhold(t) -> None:
    """t a Parameter (or tensor) of its own class again, its values its own business (a HeldWeight's end)."""
    entry = _held_entry(t)
    _HELD.pop(id(t), None)
    if type(t) in (HeldWeight, HeldData):
        t.__class__ = entry[2] if entry else nn.Parameter if type(t) is HeldWeight else torch.Tensor


def raw(t):
    """A held weight as it is stored (one element expanded), for gpt2ffn's own bookkeeping (storage, version,
    views of it); any other tensor as it is."""
    if type(t) not in (HeldWeight, HeldData):
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach()


def _held_layer(t):
    """The layer whose packed copy holds t's values, where t is a weight it let go (or that weight's .data)."""
    entry = _held_entry(t) if isinstance(t, torch.Tensor) else None
    layer = entry[1]() if entry else None
    return layer if layer is not None and layer.dropped else None


class HeldWeight(nn.Parameter):
    """The class of a Parameter while its layer holds the weight once (drop_weight): one zero element expanded
    to the weight's shape, with the values in the packed copy. Reads (printing, indexing, .sum(), F.linear, ...)
    see the values the kernels compute with, unpacked as state_dict() gives them; writes in place raise
    PackedOnlyError with the way back; shape, dtype, device and the like answer as they are. The same object
    throughout: restore_weight gives it back its class."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _func_name(func)
        # what answers as stored: metadata, and any call while torch.compile's fake tensors trace a model (its
        # packed kernels read the weight as stored, as before it was held)
        if (name in _AS_IS and not (name == "type" and (len(args) > 1 or kwargs))) or _tracing():
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name == "data" and getattr(func, "__name__", "") == "__set__":  # `w.data = values`: its own values now
            layer = _held_layer(args[0])                                    # (the next packed call re-packs them)
            _unhold(args[0])
            if layer is not None:
                layer.dropped, layer.rounded = False, None
            value = args[1]
            if _held_layer(value) is not None:  # another held weight's: its values, not its placeholder
                value = _held_layer(value).weight_value()
            with torch._C.DisableTorchFunctionSubclass():
                return func(args[0], value)
        if name == "data" and getattr(func, "__name__", "") == "__get__":  # .data: the same, one level down
            layer = _held_layer(args[0])
            with torch._C.DisableTorchFunctionSubclass():
                data = func(*args, **kwargs)
            if layer is not None:
                _hold(data, layer, torch.Tensor, HeldData)
            return data
        flat = torch.utils._pytree.tree_leaves((args, kwargs))  # tensors in lists too (torch.cat([w, w]))
        held = [a for a in flat if _held_layer(a) is not None]
        if held and getattr(func, "__self__", None) is not PackedMatmul:
            layer = _held_layer(held[0])
            target = args[0] if args else kwargs.get("tensor", kwargs.get("input", kwargs.get("self")))
            outs = kwargs.get("out")
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            in_place = name in _WRITES or (name.endswith("_") and not name.startswith("__"))
            if (in_place and (_held_layer(target) is not None or isinstance(target, (list, tuple)) and any(
                    _held_layer(t) is not None for t in target))) or any(_held_layer(o) is not None for o in outs):
                raise layer.packed_only(f"writing into its weight ({name})", layer.packed.precision)
            values = {id(a): _held_layer(a).weight_value() for a in held}
            args, kwargs = torch.utils._pytree.tree_map(
                lambda a: values.get(id(a), a) if isinstance(a, torch.Tensor) else a, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __reduce_ex__(self, proto):
        """Pickled as its layer's packed copy (shared with the layer's own pickle by the memo, so a model's file
        holds its weights once); unpickled alone it is a Parameter of the values, in a model its layer's
        __setstate__ holds it again."""
        layer = _held_layer(self)
        if layer is None:
            with torch._C.DisableTorchFunctionSubclass():
                return torch._utils._rebuild_parameter, (self.data, self.requires_grad, OrderedDict())
        transposed = layer.param_layout(torch.empty(2, 3)).shape == (3, 2)
        return _rebuild_held, (layer.packed, transposed, self.requires_grad)


def _rebuild_held(packed, transposed: bool, requires_grad: bool):
    values = packed.weights()
    return nn.Parameter((values.t() if transposed else values).contiguous(), requires_grad)


def _tracing() -> bool:
    """Whether torch.compile's fake tensors (or its functionalization or proxies) are tracing: a user's own
    dispatch mode (FlopCounterMode, ...) reads values as anyone."""
    return any(type(m).__name__ in ("FakeTensorMode", "FunctionalTensorMode", "ProxyTorchDispatchMode")
               for m in _get_current_dispatch_mode_stack())


class HeldData(torch.Tensor):
    """`.data` of a HeldWeight: reads see the values, writes raise, as the weight's own; copied or pickled it is a
    plain tensor of the values."""

    __torch_function__ = HeldWeight.__torch_function__

    def _values(self):
        layer = _held_layer(self)
        with torch._C.DisableTorchFunctionSubclass():
            return layer.weight_value() if layer is not None else self.detach().clone()

    def __reduce_ex__(self, proto):
        return self._values().__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        return self._values()


class PackedLayer:
    """What a linear layer needs to run on packed weights: `weight_kn`, `pack`, and `packed_forward` when
    `runs_packed`. A layer with keeps_int8 (the tied lm_head) is packed at int8 where the model asks for int4.
    With hold_once (set by quantize), eval() keeps only the packed weights (see the module doc)."""

    keeps_int8 = False
    hold_once = False  # the packed weights are the only copy in eval()
    dropped = False    # the fp32 weight was let go: the Parameter is one zero element, expanded to its shape
    rounded = None     # the precision whose rounding the Parameter's values carry, when unpacked from bf16/int8/int4
    _stash = None      # (precision, group, route) while an fp32 layer held once trains on its Parameter

    @property
    def packed(self) -> Packed | None:
        """A Packed once quantize() has run; assigning one counts as a change (kernels.formats.generation())."""
        return self.__dict__.get("_packed")

    @packed.setter
    def packed(self, p: Packed | None):
        self.__dict__["_packed"] = p
        changed()

    def weight_kn(self):
        """The weight as (K in, N out)."""
        raise NotImplementedError

    def param_layout(self, w_kn):
        """A (K, N) weight in the Parameter's own layout, contiguous."""
        raise NotImplementedError

    def pack(self, precision: str, group: int | None = None, activations: str = "fp32"):
        old = self.packed
        if self.dropped and any(self.weight.stride()):  # `weight.data = values` gave it values of its own
            self.dropped, self.rounded = False, None
        source = old.weights() if self.dropped else self.weight_kn()
        self.__dict__.pop("_reload", None)
        self.packed = Packed(source, self.bias, precision, group, activations)
        if old is not None:
            on_cpu = self.weight.device.type == "cpu"
            self.packed.route = {k: r if on_cpu or r == "torch" else "torch" for k, r in old.route.items()}
        if self.hold_once and not self.training and self.weight.grad is None:  # (a gradient not yet stepped
            self.drop_weight()                                                # keeps its values writable)

    def drop_weight(self):
        """Let the fp32 weight go; the packed weights become the only copy (the Parameter a HeldWeight)."""
        w = self.weight
        entry = _held_entry(w)
        cls = entry[2] if entry else type(w)
        _unhold(w)
        w.data = w.new_zeros(()).expand(w.shape)   # same Parameter, shape, dtype and device; 4 bytes of storage
        self.dropped = True
        self.packed.made_from(self.weight_kn(), self.bias)
        _hold(w, self, cls, HeldWeight)

    def restore_weight(self, values=None):
        """Give the Parameter its fp32 values back: `values` in its layout, or the packed weights unpacked."""
        given = values
        if values is None:
            values = self.param_layout(self.packed.weights())
        w = self.weight
        _unhold(w)
        w.data = values
        if given is None and self.packed.precision != "fp32":
            self.rounded = self.packed.precision
        self.dropped = False

    def __setstate__(self, state):
        """copy.deepcopy and pickle clone the one-element placeholder of a weight let go to its full shape: let
        it go again (a weight with storage of its own means values the user gave)."""
        super().__setstate__(state)
        if self.dropped:
            w = self.weight
            _unhold(w)  # a copy made as its original's class (HeldWeight), not yet held
            if any(w.stride()):
                w.data = w.new_zeros(()).expand(w.shape)
            _hold(w, self, type(w), HeldWeight)

    def weight_value(self) -> torch.Tensor:
        """The weight in the Parameter's layout, unpacked from the packed copy if the layer holds only that."""
        return self.param_layout(self.packed.weights()) if self.dropped else self.weight.detach()

    def rows(self, ids) -> torch.Tensor:
        """ids (...) -> (..., K): the rows of W^T for those outputs, from the packed weights (for the tied
        lm_head: wte's embeddings of those tokens, at the precision the lm_head holds)."""
        return self.current().weights(ids.reshape(-1)).view(*ids.shape, self.packed.K)

    def packed_only(self, why: str, precision: str) -> PackedOnlyError:
        way = ("call train() to get the fp32 Parameters back (eval() re-packs them)" if precision == "fp32"
               else "load the model with precision='fp32' to train or take gradients")
        return PackedOnlyError(f"{type(self).__name__} holds only its packed {precision} weights, so {why} cannot "
                               f"run: {way}, or keep both copies with quantize(module, precision, keep_fp32=True)")

    def held_at(self) -> str | None:
        """The bf16/int8/int4 precision this layer's only values carry (packed and let go, or unpacked from
        there): they have no fp32 values to train or to re-quantize from. None for fp32 or both copies kept."""
        p = self.packed
        if self.hold_once and p is not None and p.precision != "fp32":
            return p.precision
        return self.rounded

    def check_fp32(self, why: str):
        """Raise PackedOnlyError if the weight's values are gone (held only packed): `why` is what needed them."""
        if self.dropped:
            raise self.packed_only(why, self.packed.precision)

    def weight_for_grad(self, why: str, packed: Packed):
        """Before a gradient reaches the weight, `packed` the weights the forward used: bf16/int8/int4 held once
        have no fp32 values to train (PackedOnlyError); an fp32 weight let go gets its values back, so an
        optimizer can write them (the next packed call re-packs)."""
        if packed.precision != "fp32":
            raise self.packed_only(why, packed.precision)
        if self.dropped:
            self.restore_weight()

    def train(self, mode: bool = True):
        if self.hold_once and mode != self.training:
            if mode and self.packed is not None:
                if self.held_at():
                    raise self.packed_only("train()", self.held_at())
                p, self.packed = self.packed, None
                self._stash = (p.precision, p.group, p.route)
                self.restore_weight(self.param_layout(p.weights()))
                del p
                release_freed_memory()
            elif not mode and self._stash is not None and self.weight.dtype != torch.float32:
                self._stash, self.hold_once = None, False  # .to(bf16) while training: torch's layer in that dtype
            elif not mode and self._stash is not None:
                precision, group, route = self._stash
                self._stash = None
                self.packed = Packed(self.weight_kn(), self.bias, precision, group)
                self.packed.route = route
                self.drop_weight()
                release_freed_memory()
        return super().train(mode)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        with torch._C.DisableTorchFunctionSubclass():  # (a held weight as stored: its values come below, once)
            super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.dropped:
            destination[prefix + "weight"] = self.weight_value()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.dropped and prefix + "weight" in state_dict:  # room for the new values; eval() re-packs them
            w = self.weight
            self.restore_weight(torch.empty(w.shape, dtype=w.dtype, device=w.device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "weight" in state_dict:
            self.rounded = None
            if self.packed is not None:
                self.__dict__["_reload"] = True  # re-pack on the next call, whatever the version counters say

    def _apply(self, fn, *args, **kwargs):
        if self.dropped:  # .to(), .float(), ...: on the real values; the next packed call re-packs
            self.restore_weight()
        out = super()._apply(fn, *args, **kwargs)
        if self.packed is not None and self.weight.dtype != torch.float32:  # .half(), .to(bf16): torch's path
            self.packed, self.hold_once = None, False                       # in that dtype; quantize re-packs
        return out

    def runs_packed(self, x) -> bool:
        """eval() and an fp32 input (any float input where the packed weights are the only ones, as autocast's
        bf16: computed in fp32, given back in its dtype): the packed weights serve; with a gradient asked, only
        where they are the model's weights (held once: through PackedMatmul), both copies kept compute on the
        Parameters."""
        return (self.packed is not None and not self.training and (x.dtype == torch.float32 or self.dropped and
                x.is_floating_point()) and (self.hold_once or not self.needs_grad(x)))

    def needs_grad(self, x) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad
                                            or (self.bias is not None and self.bias.requires_grad))

    def matmul(self, x2):
        """(M, K) -> (M, N) on the packed weights, through autograd when a gradient may be asked; a bf16 or fp16
        input (autocast's) is computed in fp32 and given back in its dtype."""
        x32 = x2.float()
        y = PackedMatmul.apply(x32, self.weight, self.bias, self) if self.needs_grad(x2) else self.packed_forward(x32)
        return y.to(x2.dtype)

    def current(self) -> Packed:
        """The packed weights, re-packed first if the Parameters changed since they were packed."""
        p = self.packed
        if p.stale(self.weight_kn(), self.bias) or self.__dict__.pop("_reload", False):
            self.pack(p.precision, p.group, p.activations)
            p = self.packed
        return p

    def packed_forward(self, x2, gelu: str | None = None):
        """(M, K) -> (M, N) on the packed weights."""
        p = self.current()
        return linear(x2, p, None if self.dropped else self.weight_kn(), self.bias, p.route[regime(x2.shape[0])],
                      gelu)


def check_trainable(module):
    """Raise PackedOnlyError before train() changes anything when a layer of `module` holds only bf16/int8/int4
    values (nn.Module.train would set the modules before it to training first)."""
    for m in module.modules():
        if isinstance(m, PackedLayer) and m.held_at():
            raise m.packed_only("train()", m.held_at())


class TrainChecked(nn.Module):
    """A module whose train() refuses, before any module's mode changes, when a layer in it holds only bf16/int8/int4
    values (GPT2, its containers, blocks and FFNs: `model.transformer.train()` as well as `model.train()`)."""

    def train(self, mode: bool = True):
        if mode:
            check_trainable(self)
        return super().train(mode)


class PackedMatmul(torch.autograd.Function):
    """x W + b on a layer's packed weights, with gradients: x's through the weights the forward computed with
    (unpacked: fp32 and bf16 exactly, int8/int4 the dequantized q * s), the bias's the sum over rows, an fp32
    weight's x^T dy, its values given back first when only the packed copy held them (so an optimizer step can
    write them; the next packed call re-packs). A bf16/int8/int4 weight has no fp32 values to train:
    PackedOnlyError."""

    @staticmethod
    def forward(ctx, x2, weight, bias, layer):
        y = layer.packed_forward(x2)
        ctx.layer, ctx.packed = layer, layer.packed  # the weights this forward computed with
        ctx.save_for_backward(x2 if ctx.needs_input_grad[1] else None)
        return y

    @staticmethod
    def backward(ctx, dy):
        layer, (x2,) = ctx.layer, ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dy @ ctx.packed.weights().t()                              # (M, N) @ (N, K)
        if ctx.needs_input_grad[1]:
            layer.weight_for_grad("a gradient for its weight", ctx.packed)
            dw = layer.param_layout(x2.t() @ dy)                            # (K, M) @ (M, N), in its layout
        if ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db, None


class Conv1D(PackedLayer, nn.Module):
    """GPT-2's linear layer: weight stored [in, out] (HF/OpenAI layout), y = x @ W + b.

    After gpt2ffn.quantize, eval() forward runs on packed weights at the chosen precision."""

    def __init__(self, n_in: int, n_out: int, std: float = 0.02):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))
        if not building_uninitialized():
            nn.init.normal_(self.weight, std=std)

    def weight_kn(self):
        return self.weight

    def param_layout(self, w_kn):
        return w_kn.contiguous()

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        if self.runs_packed(x):
            y = self.matmul(x2)
        else:
            self.check_fp32("a non-fp32 input (or train())")
            y = torch.addmm(self.bias, x2, self.weight)  # (N, in) -> (N, out)
        return y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self):
        return f"n_in={self.weight.shape[0]}, n_out={self.weight.shape[1]}"


def packed_precisions(module: nn.Module) -> list:
    """The precisions of the packed weights that `module`'s layers compute with, or hold in eval() (an fp32 layer
    training on its Parameter re-packs then); [] where none is packed."""
    return sorted({m.packed.precision if m.packed is not None else m._stash[0] for m in module.modules()
                   if isinstance(m, PackedLayer) and (m.packed is not None or m._stash is not None)})


def unpacked_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module` whose packed layers are plain fp32 layers again: each Parameter holds the values
    its kernels computed with (fp32 exactly, bf16 the bf16 values, int8/int4 the dequantized q * s) and the
    layer runs torch's ops on them, in train() and eval() alike. The module itself is left as it is."""
    copy_ = copy.deepcopy(module)
    for m in copy_.modules():
        if isinstance(m, PackedLayer) and (m.packed is not None or m._stash is not None):
            if m.dropped:
                m.restore_weight()
            m.__dict__.pop("_packed", None)  # not the `packed` setter: no kernel generation bumped for a copy
            m.hold_once, m._stash, m.rounded = False, None, None
            m.__dict__.pop("_reload", None)
    return copy_
