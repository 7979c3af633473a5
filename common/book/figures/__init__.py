"""The chapters' teaching figures, drawn with matplotlib: one module per chapter (common.book.figures.level1, ...), each
function returning a figure for common.book.chapter.show_figure. The drawing helpers here give every diagram the same look.

A chapter imports only its own module, so a new figure for one chapter leaves the others' outputs current.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # figures are drawn to PNG, never to a window

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

# One palette for the whole course: forward values, gradients (the backward pass), memory, threads and highlights.
FORWARD, BACKWARD, MEMORY, THREAD, HIGHLIGHT, MUTED = "#1f77b4", "#d62728", "#7f7f7f", "#2ca02c", "#ff7f0e", "#c7c7c7"


def diagram(width: float, height: float, figsize: tuple[float, float] = (9, 3)):
    """A blank figure whose axes run from (0, 0) to (width, height) in drawing units, without ticks or frame."""
    fig, ax = plt.subplots(figsize=figsize)
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig, ax


def box(ax, x: float, y: float, w: float, h: float, text: str = "", color: str = FORWARD, fill: float = 0.15,
        fontsize: int = 10, **text_options) -> None:
    """A rounded box with its lower-left corner at (x, y), tinted by `color`, text centred in it."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", linewidth=1.2,
                                edgecolor=color, facecolor=matplotlib.colors.to_rgba(color, fill)))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, **text_options)


def arrow(ax, start: tuple[float, float], end: tuple[float, float], color: str = FORWARD, text: str = "",
          offset: tuple[float, float] = (0, 0.15), **options) -> None:
    """An arrow from `start` to `end`, labelled at its middle (shifted by `offset`)."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color=color, linewidth=1.4,
                                 **options))
    if text:
        middle = (np.add(start, end) / 2) + offset
        ax.text(*middle, text, ha="center", va="bottom", fontsize=9, color=color)


def grid(ax, x: float, y: float, rows: int, cols: int, cell: float = 0.3, colors=None, text=None,
         edge: str = "white", fontsize: int = 7) -> None:
    """A rows x cols grid of square cells (a matrix, memory, threads) with its top-left corner at (x, y).

    colors[r][c] and text[r][c], when given, colour and label each cell.
    """
    for r in range(rows):
        for c in range(cols):
            color = colors[r][c] if colors is not None else MUTED
            ax.add_patch(plt.Rectangle((x + c * cell, y - (r + 1) * cell), cell, cell, facecolor=color,
                                       edgecolor=edge, linewidth=0.8))
            if text is not None and text[r][c] != "":
                ax.text(x + (c + 0.5) * cell, y - (r + 0.5) * cell, str(text[r][c]), ha="center", va="center",
                        fontsize=fontsize)
