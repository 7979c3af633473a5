"""Level 5's figures: threads, blocks, warps, and how a warp reads memory."""

from __future__ import annotations

import matplotlib.pyplot as plt

from common.book.figures import (
    BACKWARD,
    FORWARD,
    HIGHLIGHT,
    MEMORY,
    MUTED,
    THREAD,
    grid,
)


def thread_layout(batch: int = 8, hidden: int = 256, tile: int = 16):
    """h = x W1^T as a grid of blocks: one thread per output element, a block of tile x tile threads, and the warps
    of 32 threads (two rows of a 16 x 16 block)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.5, 3.6), gridspec_kw={"width_ratios": [1.5, 1]})
    blocks_x, blocks_y = -(-hidden // tile), -(-batch // tile)
    left.set_xlim(-0.5, blocks_x + 0.5)
    left.set_ylim(-2.2, blocks_y + 1.6)
    left.axis("off")
    for bx in range(blocks_x):
        left.add_patch(plt.Rectangle((bx, 0), 1, 1, facecolor=HIGHLIGHT if bx == 0 else FORWARD, alpha=0.25 + 0.5 *
                                     (bx == 0), edgecolor="white"))
    left.add_patch(plt.Rectangle((0, 0.5), blocks_x, 0.5, fill=False, edgecolor=THREAD, lw=1.5, ls="--"))
    left.text(blocks_x / 2, 1.25, f"the grid: {blocks_x} blocks along the {hidden} hidden units", ha="center",
              fontsize=9)
    left.text(blocks_x / 2, -0.45, f"output h ({batch} x {hidden}): the green frame; each block covers {tile} x {tile}"
              f"\noutputs, so half of each block's threads ({tile - batch} of its {tile} rows) have no output",
              ha="center", va="top", fontsize=8, color=MEMORY)
    # One block, zoomed: tile x tile threads, the first two warps coloured.
    right.set_xlim(-1, tile + 1)
    right.set_ylim(-3.2, tile + 1.5)
    right.set_aspect("equal")
    right.axis("off")
    colors = [[(HIGHLIGHT if r < 2 else THREAD if r < 4 else MUTED) if r < batch else "white" for c in range(tile)]
              for r in range(tile)]
    grid(right, 0, tile, tile, tile, cell=1.0, colors=colors, edge="#dddddd")
    right.text(tile / 2, tile + 0.5, f"one block: {tile} x {tile} threads (orange block at left)", ha="center",
               fontsize=9)
    right.text(tile + 0.3, tile - 1, "warp 0", fontsize=8, color=HIGHLIGHT, va="center")
    right.text(tile + 0.3, tile - 3, "warp 1", fontsize=8, color=THREAD, va="center")
    right.text(tile / 2, -0.6, "thread (x, y) computes h[y][x];\na warp = 32 threads = two rows of the block;\n"
               f"rows {batch}..{tile - 1} (white) return at once", ha="center", va="top", fontsize=8, color=MEMORY)
    fig.tight_layout()
    return fig


def coalescing(n_in: int = 784):
    """The addresses one warp loads in one step of its sums: 32 neighbouring floats (4 sectors of 32 bytes) against
    16 floats from 16 rows of W1, n_in floats apart (16 sectors, one each)."""
    fig, axes = plt.subplots(2, 1, figsize=(9, 3.2))
    for ax, strided in zip(axes, (False, True)):
        ax.set_xlim(-1, 67)
        ax.set_ylim(-1.3, 2.2)
        ax.axis("off")
        # Memory as a row of 32-byte sectors (8 floats each); the warp's 32 threads above it.
        for s in range(16):
            ax.add_patch(plt.Rectangle((s * 4, 0), 4, 0.6, facecolor="white", edgecolor=MEMORY, lw=0.8))
        touched = range(16) if strided else range(4)
        for s in touched:
            ax.add_patch(plt.Rectangle((s * 4, 0), 4, 0.6, facecolor=BACKWARD if strided else FORWARD, alpha=0.35))
        for t in range(32 if not strided else 16):
            x = (t * 0.5 + 0.25) if not strided else (t * 4 + 1)
            ax.plot([t * 2 + 1, x], [1.6, 0.62], color=THREAD, lw=0.5)
            ax.plot([t * 2 + 1], [1.65], "s", color=THREAD, ms=4)
        ax.text(-0.8, 1.75, "warp:", fontsize=8, ha="right")
        ax.text(-0.8, 0.3, "memory:", fontsize=8, ha="right")
        text = ("coalesced: 32 threads read 32 neighbouring floats, 128 bytes = 4 sectors of 32 bytes" if not strided else
                f"strided: 16 threads read one float each from 16 rows of W1, {n_in * 4:,} bytes apart = 16 sectors "
                "(the figure folds the gaps)")
        ax.text(33, -0.5, text, ha="center", va="top", fontsize=8.5, color=FORWARD if not strided else BACKWARD)
    fig.tight_layout()
    return fig
