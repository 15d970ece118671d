"""The GPT-2 feed-forward network as a PyTorch module, state-dict compatible with HF's GPT2MLP."""

import torch
import torch.nn as nn

from . import kernels
from .config import Config
from .errors import InputError, ShapeError
from .gelu import activation
from .kernels import packed
from .linear import Conv1D, TrainChecked, uninitialized
from .precision import quantize


class FeedForward(TrainChecked):
    """c_fc (d -> hidden) -> GELU -> c_proj (hidden -> d) -> dropout, on each token alone.

    Keys and shapes equal HF GPT2MLP's (c_fc.weight is [d, hidden]), so state dicts move both ways.
    Takes a Config, a dict (HF or book-style keys), a preset name or transformers' GPT2Config."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg = Config.coerce(cfg)
        self.c_fc = Conv1D(cfg.n_embd, cfg.hidden, cfg.initializer_range)
        self.act = activation(cfg.gelu_approximate)
        self.c_proj = Conv1D(cfg.hidden, cfg.n_embd, cfg.initializer_range)
        self.dropout = nn.Dropout(cfg.resid_pdrop)

    def forward(self, x):
        """x: (..., n_embd) float tensor -> (..., n_embd), through the fastest path that fits (kernels/).
        Per call a few microseconds of Python in all (on a GPU at 4,096 tokens the GEMMs take ~70 us, and a slow
        host's Python per call is what back-to-back calls wait on): the usual input is recognised by a few cheap
        tests, and check_input names what is wrong with any other."""
        c_fc, c_proj = self._modules["c_fc"], self._modules["c_proj"]
        fc = c_fc._parameters  # the dicts: nn.Module.__getattr__ costs ~0.5 us a name
        w = fc["weight"]
        if not (isinstance(x, torch.Tensor) and x.dtype is w.dtype and x.dim() and x.shape[-1] == self.config.n_embd
                and x.device == w.device):
            self.check_input(x)
        if c_fc.packed is not None and c_fc.runs_packed(x) and c_proj.packed is not None:  # after quantize()
            x2 = x.reshape(-1, x.shape[-1]).float()  # (autocast's bf16 input: computed in fp32)
            if torch.is_grad_enabled() and (c_fc.needs_grad(x) or c_proj.needs_grad(x)):
                y = c_proj.matmul(self.act(c_fc.matmul(x2)))  # autograd on: each layer through PackedMatmul
                return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])
            approximate = self.config.gelu_approximate
            p1, p2 = c_fc.current(), c_proj.current()
            route = packed.regime(x2.shape[0])
            if p1.route[route] == p2.route[route] == "native":
                y = packed.ffn(x2, p1, p2, approximate)
            elif approximate == "relu":
                y = c_proj.packed_forward(c_fc.packed_forward(x2).relu_())
            else:
                y = c_proj.packed_forward(c_fc.packed_forward(x2, gelu=approximate))  # (N, d) -> (N, hidden) -> (N, d)
            return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])
        if c_fc.dropped or c_proj.dropped:
            c_fc.check_fp32("a non-fp32 input (or train())")
            c_proj.check_fp32("a non-fp32 input (or train())")
        proj, flat = c_proj._parameters, x.dim() == 2
        y = kernels.ffn(x if flat else x.reshape(-1, x.shape[-1]), w, fc["bias"],  # (N, d) -> (N, d)
                        proj["weight"], proj["bias"], self.config.gelu_approximate)
        if not flat:
            y = y.view(*x.shape[:-1], y.shape[-1])
        return self.dropout(y) if self.training and self.dropout.p else y

    def intermediates(self, x) -> dict:
        """Each stage for the golden harness: c_fc and GELU through the modules, ffn through forward()."""
        with torch.no_grad():
            c_fc = self.c_fc(x)
            return {"c_fc": c_fc, "gelu": self.act(c_fc), "ffn": self(x)}

    def check_input(self, x):
        """Raise a clear error for input that would give a wrong answer or a deep traceback."""
        if not isinstance(x, torch.Tensor):
            raise InputError(f"FeedForward input must be a torch.Tensor, got {type(x).__name__} "
                             "(gpt2ffn.reference runs numpy arrays)")
        if not x.is_floating_point():
            raise InputError(f"FeedForward input must be a float tensor, got dtype {x.dtype}")
        d = self.config.n_embd
        if x.dim() == 0 or x.shape[-1] != d:
            raise ShapeError(f"FeedForward input has shape {tuple(x.shape)}; expected (..., {d}) "
                             f"(last dim = n_embd = {d})")
        w = self.c_fc.weight
        if x.dtype != w.dtype:
            raise InputError(f"FeedForward input has dtype {x.dtype} but its weights are {w.dtype}; "
                             f"convert one of them (x.to({w.dtype}) or ffn.to({x.dtype}))")
        if x.device != w.device:
            raise InputError(f"FeedForward input is on {x.device} but its weights are on {w.device}")

    @classmethod
    def from_pretrained(cls, path, layer: int = 0, config=None, dtype=torch.float32,
                        precision: str | None = None) -> "FeedForward":
        """Block `layer`'s FFN from an HF GPT-2 checkpoint (a directory or a file); reads only its 4 tensors.

        precision ('fp32', 'bf16', 'int8', 'int4'): pack the weights for fast inference (gpt2ffn.quantize)."""
        from .weights import load_ffn_state
        cfg, state = load_ffn_state(path, layer, config)
        with uninitialized():  # its 4 tensors are read next (load_state_dict is strict)
            ffn = cls(cfg)
        ffn.load_state_dict(state)
        ffn = ffn.to(dtype).eval()
        if precision is not None:
            quantize(ffn, precision)
        return ffn

    def extra_repr(self):
        c = self.config
        return f"n_embd={c.n_embd}, hidden={c.hidden}, activation_function={c.activation_function!r}"
