"""gpt2ffn: the GPT-2 feed-forward network, proven against HuggingFace.

    from gpt2ffn import Config, FeedForward, GPT2, check, gelu
    ffn = FeedForward(Config.from_name("gpt2"))           # c_fc -> GELU (tanh) -> c_proj
    ffn = FeedForward.from_pretrained("gpt2-dir", layer=0)  # real HF weights, block 0
    model = GPT2.from_pretrained("gpt2-dir")              # the whole GPT-2; model.generate(ids, max_new_tokens=20)
    print(check(MyFeedForward).format())                 # a learner's FFN or GELU, judged and diagnosed

`gpt2ffn.generate` and `gpt2ffn.check` are the functions (generate(model, [[ids]], max_new_tokens=20), or
with a Sampling); their modules import as `from gpt2ffn.generate import load` and `from gpt2ffn.check import
Report`.
"""

import os
import sys

# gpt2ffn runs numpy (OpenBLAS) and torch (OpenMP) in one process. After each call OpenBLAS's workers
# busy-wait for ~2^28 cycles and take the cores torch needs next: measured here, a torch.mm right after a
# numpy matmul took 10.5 ms instead of 1.3. 2^4 cycles makes them sleep at once. It only takes effect if set
# before numpy loads; a value the user set wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
# libgomp's threads (torch's OpenMP team, which runs gpt2ffn's kernels) spin at each barrier, and between parallel
# regions, up to GOMP_SPINCOUNT times before they sleep: 300,000 unless set, a few ms. On a CPU shared with
# another busy process, a thread then spins through its time slice while its partner waits for one: measured on
# 2 cores beside one busy loop, GPT-2 medium int8 prefill 396 ms and decode 11 tok/s, against 184 ms and 29 tok/s
# at 6,000 (alone: the same within the noise; README, "A CPU shared with other work"). libgomp reads it when torch
# loads: it takes effect only if gpt2ffn is imported first (the CLI, its processes); a value or wait policy the user
# set wins.
if "OMP_WAIT_POLICY" not in os.environ and "torch" not in sys.modules:
    os.environ.setdefault("GOMP_SPINCOUNT", "6000")

from . import reference  # noqa: E402
from .check import check  # noqa: E402  (the function; the module stays importable by its full name)
from .config import Config  # noqa: E402
from .errors import CheckpointError, ConfigError, Gpt2ffnError, InputError, PackedOnlyError, ShapeError  # noqa: E402
from .ffn import FeedForward  # noqa: E402
from .gelu import GELU, gelu  # noqa: E402
from .generate import Sampling, generate  # noqa: E402  (generate: the function, as check)
from .hf import patch_hf  # noqa: E402
from .model import GPT2  # noqa: E402
from .precision import PRECISIONS, quantize  # noqa: E402
from .tolerances import GOLDEN_ATOL, TOLERANCES, tolerance  # noqa: E402
from .weights import Checkpoint, save_ffn  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Config", "FeedForward", "GELU", "gelu", "reference", "save_ffn", "Checkpoint", "patch_hf", "quantize",
    "PRECISIONS", "GPT2", "generate", "Sampling", "check",
    "Gpt2ffnError", "ConfigError", "ShapeError", "InputError", "CheckpointError", "PackedOnlyError",
    "TOLERANCES", "GOLDEN_ATOL", "tolerance",
]
