"""The one table of tolerances, per dtype: tests, the golden harness and the benchmark's check all read it.

A comparison passes when |actual - expected| <= atol + rtol * |expected| elementwise (torch.allclose's rule).
fp32/fp64 compare two computations of the same math (ours vs HF's modules); half types compare ours
against HF run in the same half dtype, where the two may round differently in the GEMM's accumulation order.
"""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


TOLERANCES = {
    "float64": Tolerance(atol=1e-10, rtol=1e-10),
    "float32": Tolerance(atol=1e-5, rtol=1e-5),
    "bfloat16": Tolerance(atol=2e-2, rtol=1.6e-2),
    "float16": Tolerance(atol=2e-3, rtol=1e-3),
}

# Weight precisions (gpt2ffn.precision), as max |actual - expected| / max |expected| of a layer's output:
# - "kernel": a packed layer against numpy float64 on the same rounded weights: the kernels' own error,
#   the fp32 bar whatever the precision (products and sums are fp32 at every precision);
# - "vs_fp32": the FeedForward against numpy float64 on the fp32 weights: what rounding the weights costs
#   (measured at d=768 with GPT-2-scale random weights: bf16 2.5e-3, int8 8.8e-3, int4 1.2e-1).
PRECISION_TOLERANCES = {
    "fp32": {"kernel": 1e-5, "vs_fp32": 1e-5},
    "bf16": {"kernel": 1e-5, "vs_fp32": 1e-2},
    "int8": {"kernel": 1e-5, "vs_fp32": 2.5e-2},
    "int4": {"kernel": 1e-5, "vs_fp32": 2.5e-1},
}

# Seed 001's conformance bar: absolute difference to HF's golden tensors, fp32.
GOLDEN_ATOL = 1e-4
# Stages whose bar scales with the tensor: max(GOLDEN_ATOL, rtol * max|expected|). GPT-2's logits are
# O(100), where fp32 keeps ~7 digits: two correct fp32 computations differ by ~1e-4 there (measured 1.1e-4
# at max|logits| = 130, i.e. 8e-7 relative), so an absolute 1e-4 would fail correct engines. The residual
# stream (attn_resid, the block output) grows with depth and carries an engine's own rounding from block
# to block: a correct C engine summing in fp32 in order (llm.c's way) was 1.0e-4 to 1.25e-4 off in blocks 18-23
# of random:gpt2-medium (values to ~50: 2.5e-6 relative), and real GPT-2's outlier features reach ~3000, where
# one fp32 ulp is 2.4e-4. 1e-5 relative is ~80 ulps of the tensor's largest value.
GOLDEN_SCALED = {"attn_resid": 1e-5, "block": 1e-5, "logits": 1e-6}  # by stage


def tolerance(dtype) -> Tolerance:
    """The row for a torch dtype, a numpy dtype, or a name like 'float32'."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {name!r}; the table has {', '.join(TOLERANCES)}")
    return TOLERANCES[name]
