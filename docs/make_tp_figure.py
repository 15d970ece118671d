"""Draw docs/tp.png: what each of 2 tensor-parallel ranks holds in a GPT-2 block, and where the all-reduces sit
(gpt2ffn.parallel). Run: python docs/make_tp_figure.py"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

RANK = ["#4C72B0", "#DD8452"]   # rank 0, rank 1
SHARED = "#8C8C8C"              # replicated on every rank
REDUCE = "#C44E52"


def box(ax, x, y, w, h, text, color, alpha=0.9, size=8.5, bold=False):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="black",
                                lw=0.6, alpha=alpha))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, color="white",
            weight="bold" if bold else "normal")


def arrow(ax, x, y0, y1):
    ax.annotate("", xy=(x, y1), xytext=(x, y0), arrowprops=dict(arrowstyle="->", lw=0.8, color="black"))


OUT = Path(__file__).with_name("tp.png")


def main(out=OUT):
    fig, ax = plt.subplots(figsize=(9.5, 10))
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.3, 13.2)
    ax.axis("off")
    cols = [(0.6, 4.2), (5.2, 4.2)]  # (x, width) of rank 0 and rank 1
    ax.text(cols[0][0] + 2.1, 12.9, "rank 0", ha="center", fontsize=12, color=RANK[0], weight="bold")
    ax.text(cols[1][0] + 2.1, 12.9, "rank 1", ha="center", fontsize=12, color=RANK[1], weight="bold")

    # (y, height, text: one box across both ranks, or [rank 0's, rank 1's], color of a box across both)
    rows = [
        (12.0, 0.6, ["wte rows 0..V/2 (vocab-parallel)", "wte rows V/2..V"], None),
        (11.3, 0.45, "all-reduce: each token's embedding row from the rank that holds it   (+ wpe, replicated)",
         REDUCE),
        (10.6, 0.45, "x (B, T, d): the same on every rank   ->   ln_1 (replicated)", SHARED),
        (9.6, 0.75, ["c_attn [d, 3, d] Shard(2): q, k, v of heads 0..H/2\nKV cache: heads 0..H/2 only",
                     "c_attn Shard(2): q, k, v of heads H/2..H\nKV cache: heads H/2..H only"], None),
        (8.8, 0.6, ["attention of its H/2 heads (no communication)", "attention of its H/2 heads"], None),
        (8.0, 0.6, ["attn.c_proj rows 0..d/2 (Shard(0)) -> partial sum", "attn.c_proj rows d/2..d -> partial sum"],
         None),
        (7.3, 0.45, "ALL-REDUCE #1 (Partial -> Replicate): d floats per token   + c_proj bias, residual, ln_2",
         REDUCE),
        (6.2, 0.75, ["c_fc [d, 4d] Shard(1): hidden units 0..2d\n(weight columns and bias)",
                     "c_fc Shard(1): hidden units 2d..4d"], None),
        (5.4, 0.6, ["GELU on its own 2d units (no communication)", "GELU on its own 2d units"], None),
        (4.4, 0.75, ["mlp.c_proj [4d, d] Shard(0): rows 0..2d\n-> partial sum of the output",
                     "mlp.c_proj rows 2d..4d\n-> partial sum"], None),
        (3.7, 0.45, "ALL-REDUCE #2: the FFN's one all-reduce, d floats per token   + c_proj bias, residual", REDUCE),
        (2.2, 0.6, ["lm_head = wte rows 0..V/2 (tied)", "lm_head = wte rows V/2..V"], None),
        (1.5, 0.45, "all-gather: logits (B, T, V) on every rank; rank 0 samples and schedules", REDUCE),
        (0.4, 0.6, "serving/tp.py: rank 0 broadcasts each forward pass (ids, positions, block tables); "
         "every rank runs it", SHARED),
    ]
    for y, h, text, color in rows:
        if isinstance(text, list):
            for r, (x, w) in enumerate(cols):
                box(ax, x, y, w, h, text[r], RANK[r])
        else:
            box(ax, cols[0][0], y, cols[1][0] + cols[1][1] - cols[0][0], h, text, color, bold=color == REDUCE)
    ax.text(5.0, 3.25, "x n_layer blocks: 2 all-reduces of d floats per token per block", ha="center", fontsize=9,
            style="italic", bbox=dict(fc="white", ec="none"), zorder=5)
    for (y0, _, _, _), (y1, h1, _, _) in zip(rows, rows[1:]):
        for x in (2.7, 7.3):
            arrow(ax, x, y0, y1 + h1)
    ax.set_title("GPT-2 tensor-parallel over 2 ranks (gpt2ffn.parallel, DTensor placements)", fontsize=12)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
