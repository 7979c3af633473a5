"""Level 5's figures: threads, blocks, warps, how a warp reads memory, and the tiles of a matrix product."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch

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


def tiles(tile: int = 16, m_tiles: int = 3, n_tiles: int = 4, k_tiles: int = 4, block: tuple[int, int] = (1, 2),
          step: int = 1):
    """c = a @ b in tiles of tile x tile floats, as kernel 2 computes it: one block's tile of outputs (block = its row
    and column of tiles), the row of a's tiles and the column of b's tiles it sums over, and the pair it has staged in
    shared memory at one step of the sum (step), each thread then adding its row of one times its column of the
    other."""
    fig, ax = plt.subplots(figsize=(9.5, 4.6))
    gap = 0.6
    c_x, b_y = k_tiles + gap, m_tiles + gap  # c right of a, b above c
    row, col = block

    def cell(x0, y0, i, j, rows, color, alpha=1.0, label=""):
        """Tile (i, j) of a matrix of `rows` tiles whose lower-left corner is (x0, y0): row 0 at the top."""
        y = y0 + rows - 1 - i
        ax.add_patch(plt.Rectangle((x0 + j, y), 1, 1, facecolor=color, alpha=alpha, edgecolor="white", lw=1.5))
        if label:
            ax.text(x0 + j + 0.5, y + 0.5, label, ha="center", va="center", fontsize=7.5)

    for i in range(m_tiles):  # a: row `row` is the block's, tile `step` staged now
        for j in range(k_tiles):
            mine = i == row
            cell(0, 0, i, j, m_tiles, HIGHLIGHT if mine and j == step else FORWARD if mine else MUTED,
                 1.0 if mine and j == step else 0.45 if mine else 0.35, "a tile" if mine and j == step else "")
    for i in range(k_tiles):  # b: column `col` is the block's
        for j in range(n_tiles):
            mine = j == col
            cell(c_x, b_y, i, j, k_tiles, HIGHLIGHT if mine and i == step else FORWARD if mine else MUTED,
                 1.0 if mine and i == step else 0.45 if mine else 0.35, "b tile" if mine and i == step else "")
    for i in range(m_tiles):  # c: the block's tile of outputs
        for j in range(n_tiles):
            cell(c_x, 0, i, j, m_tiles, THREAD if (i, j) == block else MUTED, 0.9 if (i, j) == block else 0.35,
                 "block\n" f"({col}, {row})" if (i, j) == block else "")
    ax.text(k_tiles / 2, -0.35, f"a ({m_tiles * tile} x {k_tiles * tile})", ha="center", va="top", fontsize=9)
    ax.text(c_x + n_tiles / 2, -0.35, f"c = a @ b ({m_tiles * tile} x {n_tiles * tile})", ha="center", va="top",
            fontsize=9)
    ax.text(c_x + n_tiles + 0.1, b_y + k_tiles / 2, f"b ({k_tiles * tile} x {n_tiles * tile})", ha="left",
            va="center", fontsize=9)
    # Shared memory, above a: the two staged tiles, and one thread's row and column in them.
    size, s_y = 1.5, b_y + 0.9
    corners = {"a_tile": (0.3, s_y), "b_tile": (k_tiles - 0.3 - size, s_y)}
    for name, (x0, y0) in corners.items():
        ax.add_patch(plt.Rectangle((x0, y0), size, size, facecolor=HIGHLIGHT, alpha=0.35, edgecolor=HIGHLIGHT))
        ax.add_patch(plt.Rectangle((x0, y0 + size * 0.55), size, size / tile, facecolor=THREAD) if name == "a_tile"
                     else plt.Rectangle((x0 + size * 0.3, y0), size / tile, size, facecolor=THREAD))
        ax.text(x0 + size / 2, y0 + size + 0.1, name, ha="center", va="bottom", fontsize=8.5)
    ax.text(k_tiles / 2, s_y + size + 0.75, "shared memory", ha="center", fontsize=9, color=MEMORY)
    ax.text(0.1, s_y - 0.25, "then thread (tx, ty) adds\nrow ty of a_tile times\ncolumn tx of b_tile", ha="right",
            va="top", fontsize=8, color=THREAD)
    arrows = (((step + 0.5, m_tiles - row), (corners["a_tile"][0] + size / 2, s_y)),  # staged: a's tile, b's tile
              ((c_x + col, b_y + k_tiles - step - 0.5), (corners["b_tile"][0] + size, s_y + size / 2)))
    for start, end in arrows:
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=10, color=MEMORY, lw=1))
    ax.text(0.1, s_y + size / 2, f"step {step + 1} of {k_tiles}: the block\nstages a tile of each,\n"
            "then __syncthreads();", ha="right", va="center", fontsize=8, color=MEMORY)
    ax.set_xlim(-3.3, c_x + n_tiles + 1.6)
    ax.set_ylim(-1.2, b_y + k_tiles + 0.3)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"Kernel 2: one block's {tile} x {tile} outputs, summed one pair of tiles at a time", fontsize=10)
    fig.text(0.01, 0.01, "An illustration, not a measurement. The block walks its row of a and its column of b, one "
             "pair of tiles (orange) per step; blue: its tiles of the other steps; grey: tiles it never touches.",
             fontsize=7.5, color=MEMORY)
    fig.tight_layout()
    return fig
