"""Whether a Triton kernel runs on a device: CUDA, Triton importable, and one small call of it compiled and right
there, asked once per kernel and device (a GPU or install where Triton cannot build kernels gets False, and the
callers keep their torch ops)."""

import functools

import torch


def runs_on(device, check, have_triton: bool) -> bool:
    """check(torch.device): the kernel's small call, True where its answer is right (an exception: False)."""
    device = torch.device(device)
    if not have_triton or device.type != "cuda":
        return False
    return _runs(check, device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _runs(check, index: int) -> bool:
    try:
        return bool(check(torch.device("cuda", index)))
    except Exception:  # noqa: BLE001 -- any failure to build or launch means: not here
        return False
