"""Level 6's figures: row-major against column-major, and what cublasSgemm's arguments mean."""

from __future__ import annotations

import matplotlib.pyplot as plt

from common.book.figures import (
    BACKWARD,
    FORWARD,
    HIGHLIGHT,
    MEMORY,
    THREAD,
    arrow,
    grid,
)

SHADES = [FORWARD, THREAD, HIGHLIGHT]  # one colour per row of the 3 x 4 example


def layouts():
    """One row-major (3, 4) array in memory, and the same 12 floats read column-major: a (4, 3) array, the
    transpose; its leading dimension is 4, the distance between the starts of its columns."""
    fig, ax = plt.subplots(figsize=(9.5, 3.4))
    ax.set_xlim(-0.5, 15)
    ax.set_ylim(-1.6, 4.6)
    ax.set_aspect("equal")
    ax.axis("off")
    rows, cols, cell = 3, 4, 0.7
    labels = [[f"{r}{c}" for c in range(cols)] for r in range(rows)]
    grid(ax, 0, 3.6, rows, cols, cell=cell, colors=[[SHADES[r]] * cols for r in range(rows)], text=labels,
         edge="white", fontsize=8)
    ax.text(cols * cell / 2, 3.9, "M (3, 4), row-major\n(C, NumPy, PyTorch)", ha="center", fontsize=8.5)
    # Memory: the 12 floats in order.
    flat = [[SHADES[i // cols] for i in range(rows * cols)]]
    grid(ax, 3.1, 1.0, 1, rows * cols, cell=cell, colors=flat, text=[[labels[i // cols][i % cols]
                                                                      for i in range(rows * cols)]], fontsize=8)
    ax.text(3.1 + rows * cols * cell / 2, 1.25, "memory: one row after another", ha="center", fontsize=8.5,
            color=MEMORY)
    arrow(ax, (1.4, 1.35), (3.0, 0.65), color=MEMORY)
    # Read column-major with ld = 4: column j starts at float 4 j, so the array is (4, 3) = M transposed.
    for c in range(rows):  # each column of the column-major view is one row of M
        for r in range(cols):
            ax.add_patch(plt.Rectangle((12.3 + c * cell, 3.6 - (r + 1) * cell), cell, cell, facecolor=SHADES[c],
                                       edgecolor="white"))
            ax.text(12.3 + (c + 0.5) * cell, 3.6 - (r + 0.5) * cell, labels[c][r], ha="center", va="center",
                    fontsize=8)
    ax.text(12.3 + rows * cell / 2, 3.9, "the same floats, column-major\n(cuBLAS), ld = 4: Mᵀ (4, 3)", ha="center",
            fontsize=8.5)
    arrow(ax, (11.6, 0.65), (12.9, 0.75), color=MEMORY)
    ax.text(0, -0.5, "So cuBLAS sees every row-major array as its transpose. To get P = X @ Y row-major, ask cuBLAS "
            "for Pᵀ = Yᵀ @ Xᵀ:\nswap the operands, keep each one's N or T, and pass each array's row-major width as "
            "its ld.", fontsize=8.5, va="top", color=BACKWARD)
    return fig
