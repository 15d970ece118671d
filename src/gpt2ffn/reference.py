"""The GPT-2 feed-forward network in plain numpy: the seed's "ndarray only" FFN, to read top to bottom.

Every fast path in gpt2ffn is checked against this file. It keeps HF's layout: Conv1D weights are
[in, out], so a layer is `x @ W + b` with no transpose.

    c_fc:   (..., d)      @ (d, hidden) + (hidden,) -> (..., hidden)     hidden = 4d in GPT-2
    GELU:   elementwise, tanh form (GPT-2's gelu_new) or exact (erf)
    c_proj: (..., hidden) @ (hidden, d) + (d,)      -> (..., d)
"""

import math

import numpy as np

from .errors import InputError, ShapeError


def _float(x):
    """x as a float array; float16 is computed in float32 so x**3 cannot overflow."""
    x = np.asarray(x)
    if x.dtype.kind != "f":
        raise InputError(f"the activation's input must be a float array, got dtype {x.dtype}")
    return x.astype(np.float32) if x.dtype == np.float16 else x


def gelu_tanh(x):
    """GPT-2's GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    xf = _float(x)
    y = 0.5 * xf * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (xf + 0.044715 * xf**3)))
    return y.astype(np.asarray(x).dtype, copy=False)


_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu_exact(x):
    """The exact GELU: x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))."""
    xf = _float(x)
    y = 0.5 * xf * (1.0 + _erf(xf / math.sqrt(2.0)))
    return y.astype(np.asarray(x).dtype, copy=False)


def relu(x):
    return np.maximum(_float(x), 0).astype(np.asarray(x).dtype, copy=False)


ACTIVATIONS = {"tanh": gelu_tanh, "none": gelu_exact, "relu": relu}


def gelu(x, approximate="tanh"):
    """GELU of a numpy array: approximate="tanh" (GPT-2) or "none" (exact)."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return ACTIVATIONS[approximate](x)


def _activation(approximate: str) -> str:
    if approximate not in ACTIVATIONS:
        raise ValueError(f"approximate must be 'tanh' (GPT-2's GELU), 'none' (exact, erf) or 'relu', got "
                         f"{approximate!r}")
    return approximate


def _array(name: str, a, ndim: int):
    """A weight as a numpy array of `ndim` dimensions (torch tensors and lists taken), else ShapeError."""
    a = np.asarray(a.detach().cpu().numpy() if hasattr(a, "detach") else a)
    if a.ndim != ndim:
        raise ShapeError(f"{name} has shape {tuple(a.shape)}; expected {ndim} dimension{'s' * (ndim > 1)}")
    return a


def ffn_forward(x, c_fc_weight, c_fc_bias, c_proj_weight, c_proj_bias, approximate="tanh"):
    """The FFN on x (..., d): c_fc -> GELU -> c_proj, each token on its own. Returns (..., d).
    Weights in HF's Conv1D layout, [in, out]: c_fc.weight (d, hidden), c_proj.weight (hidden, d)."""
    _activation(approximate)
    x = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
    c_fc_weight, c_proj_weight = _array("c_fc.weight", c_fc_weight, 2), _array("c_proj.weight", c_proj_weight, 2)
    c_fc_bias, c_proj_bias = _array("c_fc.bias", c_fc_bias, 1), _array("c_proj.bias", c_proj_bias, 1)
    d, hidden = c_fc_weight.shape
    if c_fc_bias.shape == (d,) and c_proj_bias.shape == (hidden,) != (d,):  # both weights nn.Linear's [out, in]
        raise ShapeError(f"c_fc.weight has shape {(d, hidden)} and c_fc.bias {(d,)}: the weights look like "
                         f"nn.Linear's [out, in]; this FFN takes HF's Conv1D layout [in, out] (pass weight.T)")
    expected = {"c_fc.bias": (hidden,), "c_proj.weight": (hidden, d), "c_proj.bias": (d,)}
    for name, arr in (("c_fc.bias", c_fc_bias), ("c_proj.weight", c_proj_weight), ("c_proj.bias", c_proj_bias)):
        if arr.shape != expected[name]:
            raise ShapeError(f"{name} has shape {tuple(arr.shape)}; c_fc.weight {(d, hidden)} expects {expected[name]}")
    if x.dtype.kind != "f":
        raise ShapeError(f"input has dtype {x.dtype}; the FFN takes float activations (not token ids)")
    if x.ndim == 0 or x.shape[-1] != d:
        raise ShapeError(f"input has shape {tuple(x.shape)}; the FFN expects last dim n_embd={d}")
    h = x @ c_fc_weight + c_fc_bias          # (..., d) -> (..., hidden)
    h = ACTIVATIONS[approximate](h)          # (..., hidden)
    return h @ c_proj_weight + c_proj_bias   # (..., hidden) -> (..., d)


# HF's activation modules (transformers.activations) by class name -> the form they compute
HF_ACTIVATIONS = {"NewGELUActivation": "tanh", "GELUTanh": "tanh", "PytorchGELUTanh": "tanh",
                  "FastGELUActivation": "tanh", "GELUActivation": "none", "ReLU": "relu"}


def _hf_activation(act) -> str:
    """The form an HF activation module computes (tanh when there is none: GPT-2's)."""
    if act is None:
        return "tanh"
    name = type(act).__name__
    if name not in HF_ACTIVATIONS:
        raise ValueError(f"the module's activation {name} is none the reference computes ("
                         f"{', '.join(sorted(HF_ACTIVATIONS))})")
    return HF_ACTIVATIONS[name]


class FFN:
    """The seed's `struct FFN`: four arrays and a forward. Build it from arrays or from a torch module."""

    def __init__(self, c_fc_weight, c_fc_bias, c_proj_weight, c_proj_bias, approximate="tanh"):
        self.c_fc_weight, self.c_fc_bias = c_fc_weight, c_fc_bias
        self.c_proj_weight, self.c_proj_bias = c_proj_weight, c_proj_bias
        self.approximate = _activation(approximate)

    @classmethod
    def from_state_dict(cls, sd, approximate="tanh"):
        """From a GPT2MLP-style state dict (torch tensors or arrays): c_fc.weight, c_fc.bias, ... (a block's
        `mlp.c_fc.weight`, or a model's `transformer.h.0.mlp.c_fc.weight`, taken when it holds one FFN)."""
        arr = {k: np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v) for k, v in sd.items()}
        names = ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")
        if not all(n in arr for n in names):
            prefixes = {k[:-len(n)] for k in arr for n in names if k.endswith("." + n)}
            prefixes = {p for p in prefixes if all(p + n in arr for n in names)}  # (attn.c_proj is not an FFN's)
            if len(prefixes) != 1:
                found = f"FFNs under {sorted(prefixes)[:4]}: give one FFN's" if prefixes else "none of them"
                raise ShapeError(f"the state dict has no {', '.join(names)} ({found})")
            prefix = prefixes.pop()
            arr = {n: arr[prefix + n] for n in names}
        return cls(arr["c_fc.weight"], arr["c_fc.bias"], arr["c_proj.weight"], arr["c_proj.bias"], approximate)

    @classmethod
    def from_module(cls, module):
        """From a gpt2ffn FeedForward (or any module with GPT2MLP's state dict and a gpt2ffn Config as .config),
        or HF's GPT2MLP (the activation from its `act`), with the activation it computes (a state dict alone does
        not say: from_state_dict takes tanh)."""
        cfg = getattr(module, "config", None)
        approximate = getattr(cfg, "gelu_approximate", None) or _hf_activation(getattr(module, "act", None))
        return cls.from_state_dict(module.state_dict(), approximate)

    def forward(self, x):
        return ffn_forward(x, self.c_fc_weight, self.c_fc_bias, self.c_proj_weight, self.c_proj_bias,
                           self.approximate)

    __call__ = forward
