"""The errors gpt2ffn raises on bad input. The CLI prints any of them as one line and exits 2."""

import sys


class Gpt2ffnError(Exception):
    """Base class: a message that names the thing, what was expected and what was found."""


class ConfigError(Gpt2ffnError, ValueError):
    """A config value or name that gpt2ffn does not accept."""


class ShapeError(Gpt2ffnError, ValueError):
    """A tensor whose shape does not fit the config."""


class InputError(Gpt2ffnError, TypeError):
    """An input of the wrong kind: integer or bool dtype, numpy where torch is needed, wrong device."""


class CheckpointError(Gpt2ffnError, ValueError):
    """A checkpoint that is missing, empty, corrupt, or lacks a tensor."""


class PackedOnlyError(Gpt2ffnError, RuntimeError):
    """Training or autograd asked of a layer that holds only its packed (bf16/int8/int4, or fp32 in eval())
    weights: the message names the way back to fp32."""


def warning_line(message, *rest, **kwargs):
    """A warnings.showwarning that prints `warning: <message>` on one line, as the CLI prints its errors (Python's
    default names the file and line of the warn() call and quotes that line)."""
    print(f"warning: {message}", file=sys.stderr)
