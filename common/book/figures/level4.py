"""Level 4's figures: loops and caches."""

from __future__ import annotations

import matplotlib.pyplot as plt

from common.book.figures import BACKWARD, FORWARD, HIGHLIGHT, MEMORY, MUTED, THREAD


def loop_order(batch: int = 8, hidden: int = 256, n_in: int = 784):
    """linear_forward's two loop orders: which rows are in use together, and how many bytes of W1 stream into the L1
    cache in one step (W1 is larger than L1, the cache nearest the core; x is small and stays there)."""
    w1_kib = hidden * n_in * 4 / 1024
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.9))
    for ax, w_outer in zip(axes, (True, False)):
        ax.set_xlim(0, 10)
        ax.set_ylim(0, 7)
        ax.axis("off")
        # W1's first rows (each 784 floats = 49 cache lines of 64 bytes) and the batch's rows of x.
        for row in range(6):
            in_use = row == 0 if w_outer else True
            ax.add_patch(plt.Rectangle((0.3, 6.0 - row * 0.45), 4.6, 0.32,
                                       color=HIGHLIGHT if in_use and w_outer else (FORWARD if in_use else MUTED)))
            ax.text(0.2, 6.16 - row * 0.45, f"W1[{row}]", ha="right", va="center", fontsize=7)
        ax.text(2.6, 3.15, f"⋮  {hidden} rows, {w1_kib:.0f} KiB", ha="center", fontsize=8)
        for row in range(batch):
            in_use = True if w_outer else row == 0
            ax.add_patch(plt.Rectangle((5.6, 6.0 - row * 0.35), 4.1, 0.25,
                                       color=(FORWARD if w_outer else HIGHLIGHT) if in_use else MUTED))
        ax.text(7.65, 3.0, f"x: {batch} rows", ha="center", fontsize=8)
        ax.set_title("outer loop over W1's rows (level 4)" if w_outer else "outer loop over the batch's rows",
                     fontsize=10)
        passes = 1 if w_outer else batch
        for k in range(passes):  # one block per pass of W1 through the cache in one step
            ax.add_patch(plt.Rectangle((0.3 + k * 1.15, 0.55), 1.05, 0.7, color=BACKWARD if passes > 1 else THREAD))
        ax.text(0.3, 1.55, f"W1 into the L1 cache per step: {passes} x {w1_kib:.0f} KiB", fontsize=8.5)
        ax.text(0.3, 2.3, ("one row of W1 (orange) serves every row of x (blue)" if w_outer else
                           "one row of x (orange) meets every row of W1 (blue)"), fontsize=8, color=MEMORY)
    fig.tight_layout()
    return fig
