"""Plots (matplotlib is an optional extra: pip install 'gpt2ffn[plot]')."""

import numpy as np

from .errors import Gpt2ffnError
from .reference import gelu_exact, gelu_tanh, relu


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise Gpt2ffnError("plotting needs matplotlib: pip install 'gpt2ffn[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_gelu(path):
    """GELU (tanh), GELU (exact) and ReLU side by side on [-3, 3], and exact - tanh in its own panel."""
    plt = _pyplot()
    x = np.linspace(-3, 3, 601)
    tanh, exact = gelu_tanh(x), gelu_exact(x)
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, y, title in zip(axes, (tanh, exact, relu(x)),
                            ("GELU, tanh form (GPT-2: gelu_new)", "GELU, exact (erf)", "ReLU")):
        ax.plot(x, y)
        ax.set_title(title)
        ax.set_xlabel("x")
        ax.grid(True)
    diff = exact - tanh
    i = int(np.argmax(np.abs(diff)))
    axes[3].plot(x, diff, color="tab:red")
    axes[3].set_title(f"exact - tanh\nmax |diff| = {abs(diff[i]):.2e} at |x| = {abs(x[i]):.2f}")
    axes[3].set_xlabel("x")
    axes[3].grid(True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
