"""The `gpt2ffn` command: one subcommand per task, each mapped to a function. Errors print one line, exit 2."""

import argparse
import sys

from .errors import Gpt2ffnError

# Seed 000's book-style config for GPT-2 124M, as the course writes it.
GPT_CONFIG_124M = {
    "vocab_size": 50257,
    "context_length": 1024,
    "emb_dim": 768,
    "n_heads": 12,
    "n_layers": 12,
    "drop_rate": 0.1,
    "qkv_bias": False,
}


class UsageError(Gpt2ffnError):
    """A command-line mistake."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def cmd_demo(args):
    """Seed 000's example, then the numpy reference on the same weights."""
    import torch

    from . import reference
    from .ffn import FeedForward
    from .gelu import GELU

    torch.manual_seed(123)
    ff = FeedForward(GPT_CONFIG_124M).eval()
    x = torch.randn(2, 3, GPT_CONFIG_124M["emb_dim"])
    with torch.no_grad():
        output = ff(x)
    print(f"Config: n_embd={ff.config.n_embd}, hidden={ff.config.hidden}, "
          f"activation_function={ff.config.activation_function!r} (tanh GELU, as GPT-2)")
    print(f"Input shape:  {x.shape}")
    print(f"Output shape: {output.shape}")
    assert output.shape == x.shape
    print("✓ Shape preservation test passed!")
    vals = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])
    print("GELU test values:", vals)
    print("GELU outputs:    ", GELU()(vals))
    ref = reference.FFN.from_state_dict(ff.state_dict()).forward(x.numpy())
    diff = float(abs(ref - output.numpy()).max())
    print(f"numpy reference (gpt2ffn.reference) vs torch module: max |diff| = {diff:.2e}")
    return 0


def cmd_gelu(args):
    """Both GELU forms at the given points, or a plot of them."""
    import numpy as np

    from .reference import gelu_exact, gelu_tanh

    if args.plot:
        from .plot import plot_gelu
        plot_gelu(args.plot)
        print(f"wrote {args.plot}")
        if not args.x:
            return 0
    if not args.x:
        raise UsageError("gpt2ffn gelu: give one or more numbers, or --plot FILE")
    x = np.array(args.x, dtype=np.float64)
    tanh, exact = gelu_tanh(x), gelu_exact(x)
    print(f"{'x':>10} {'tanh (GPT-2)':>14} {'exact (erf)':>14} {'exact - tanh':>14}")
    for row in zip(x, tanh, exact, exact - tanh):
        print(f"{row[0]:>10.4f} {row[1]:>14.7f} {row[2]:>14.7f} {row[3]:>14.3e}")
    return 0


def build_parser() -> Parser:
    parser = Parser(prog="gpt2ffn", description="The GPT-2 feed-forward network, proven against HuggingFace.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("demo", help="run seed 000's FFN example and check it against the numpy reference")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("gelu", help="print GELU (tanh and exact) at points, or plot both with ReLU")
    p.add_argument("x", nargs="*", type=float, help="points to evaluate, e.g. -2 0.5 3")
    p.add_argument("--plot", metavar="FILE", help="write a PNG: tanh GELU, exact GELU, ReLU, and exact - tanh")
    p.set_defaults(func=cmd_gelu)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except Gpt2ffnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
