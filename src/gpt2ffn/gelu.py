"""GELU in both forms, for torch tensors and numpy arrays.

GPT-2 uses the tanh form (HF activation_function="gelu_new"), so it is the default here.
The two forms differ by at most 4.73e-4, at |x| = 2.70: enough to fail a 1e-4 conformance check.
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import reference
from .errors import InputError

APPROXIMATIONS = ("tanh", "none")


def _check_approximate(approximate):
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be 'tanh' (GPT-2) or 'none' (exact), got {approximate!r}")


def gelu(x, approximate: str = "tanh"):
    """GELU of a torch tensor (any float dtype and shape, autograd works) or a numpy array."""
    _check_approximate(approximate)
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            raise InputError(f"GELU input must be a float tensor, got dtype {x.dtype}")
        # F.gelu computes in float32 for half types, so x^3 cannot overflow at +-400 in fp16.
        return F.gelu(x, approximate=approximate)
    if isinstance(x, (np.ndarray, np.generic, float, list)):
        return reference.gelu(x, approximate)
    raise InputError(f"GELU input must be a torch tensor or a numpy array, got {type(x).__name__}")


class GELU(nn.Module):
    """GELU as a module; approximate="tanh" (GPT-2's gelu_new, the default) or "none" (exact)."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        _check_approximate(approximate)
        self.approximate = approximate

    def forward(self, x):
        return gelu(x, self.approximate)

    def extra_repr(self):
        return f"approximate={self.approximate!r}"


def activation(kind: str) -> nn.Module:
    """The module for a Config.gelu_approximate: 'tanh', 'none' or 'relu'."""
    return nn.ReLU() if kind == "relu" else GELU(kind)
