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


def plot_verify(rows, path, title):
    """A verify run: max abs diff per checkpoint and layer (log axis), each row's tolerance as a line, failing
    bars red and marked FAIL (a failure with no number, such as a wrong shape, is drawn up to the axis top)."""
    plt = _pyplot()
    rows = [r for r in rows if r.status in ("PASS", "FAIL") and r.checkpoint != "--"]
    if not rows:
        raise Gpt2ffnError("nothing to plot: no row was judged")
    floor = 1e-9
    finite = [r.max_abs for r in rows if np.isfinite(r.max_abs)] + [r.atol for r in rows]
    top = max(finite) * 30
    heights = [min(max(r.max_abs, floor), top) if np.isfinite(r.max_abs) else top for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.24 * len(rows) + 2), 4.8))
    colors = ["tab:red" if r.status == "FAIL" else "tab:green" for r in rows]
    ax.bar(x, heights, color=colors, width=0.75, bottom=floor * 0.5)
    ax.step(np.r_[x - 0.5, x[-1] + 0.5], np.r_[[r.atol for r in rows], rows[-1].atol], where="post",
            color="black", linestyle="--", linewidth=1, label="tolerance")
    for i, r in enumerate(rows):
        if r.status == "FAIL":
            ax.text(i, heights[i] * 1.3, "FAIL", rotation=90, ha="center", va="bottom", fontsize=7, color="tab:red")
        elif r.max_abs == 0:
            ax.text(i, floor * 1.3, "0", ha="center", va="bottom", fontsize=6)
    labels = [f"{r.checkpoint} {r.name}" for r in rows]
    ax.set_xticks(x, labels, rotation=90, fontsize=7)
    ax.set_xlim(-0.7, len(rows) - 0.3)
    ax.set_yscale("log")
    ax.set_ylim(floor * 0.5, top * 20)
    ax.set_ylabel("max |actual - golden|")
    failed = sum(r.status == "FAIL" for r in rows)
    ax.set_title(f"{title}\n{len(rows) - failed} passed, {failed} failed", fontsize=10)
    from matplotlib.patches import Patch
    handles = ax.get_legend_handles_labels()[0] + [Patch(color="tab:green", label="PASS"),
                                                   Patch(color="tab:red", label="FAIL")]
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
