"""gpt2ffn: the GPT-2 feed-forward network, proven against HuggingFace.

    from gpt2ffn import Config, FeedForward, gelu
    ffn = FeedForward(Config.from_name("gpt2"))           # c_fc -> GELU (tanh) -> c_proj
    ffn = FeedForward.from_pretrained("gpt2-dir", layer=0)  # real HF weights, block 0
"""

from . import reference
from .config import Config
from .errors import CheckpointError, ConfigError, Gpt2ffnError, InputError, ShapeError
from .ffn import FeedForward
from .gelu import GELU, gelu
from .hf import patch_hf
from .tolerances import GOLDEN_ATOL, TOLERANCES, tolerance
from .weights import Checkpoint, save_ffn

__version__ = "0.1.0"

__all__ = [
    "Config", "FeedForward", "GELU", "gelu", "reference", "save_ffn", "Checkpoint", "patch_hf",
    "Gpt2ffnError", "ConfigError", "ShapeError", "InputError", "CheckpointError",
    "TOLERANCES", "GOLDEN_ATOL", "tolerance",
]
