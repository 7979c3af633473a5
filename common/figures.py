"""The chapters' teaching figures, drawn with matplotlib: each function returns a figure for common.chapter.show_figure.

One section per chapter, in the course's order. The drawing helpers at the top give every diagram the same look.
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


# ---- level 1: the data and the network ----


def digits(images: np.ndarray, labels: np.ndarray, predicted: np.ndarray | None = None, columns: int = 12):
    """A grid of MNIST digits, each titled with its label (and the network's answer, red when it is wrong)."""
    rows = -(-len(images) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(columns * 0.72, rows * 0.9))
    for i, ax in enumerate(np.ravel(axes)):
        ax.axis("off")
        if i >= len(images):
            continue
        ax.imshow(np.asarray(images[i]).reshape(28, 28), cmap="gray_r")
        if predicted is None:
            ax.set_title(str(labels[i]), fontsize=10)
        else:
            wrong = predicted[i] != labels[i]
            ax.set_title(f"{predicted[i]} ({labels[i]})" if wrong else str(predicted[i]), fontsize=9,
                         color=BACKWARD if wrong else "black")
    fig.tight_layout(pad=0.3)
    return fig


def network(hidden: int = 256):
    """The course's network: 784 pixels -> fc1 -> ReLU -> fc2 -> 10 logits -> softmax cross-entropy."""
    fig, ax = diagram(15, 4.6, figsize=(9, 2.8))
    layers = [(0.3, "image\n28 x 28 = 784\npixels x", MUTED), (3.3, f"fc1\nh = x W1ᵀ + b1\n({hidden} units)", FORWARD),
              (6.3, "ReLU\na = max(h, 0)", FORWARD), (9.0, "fc2\nz = a W2ᵀ + b2\n(10 logits)", FORWARD),
              (12.0, "softmax +\ncross-entropy\nloss L", HIGHLIGHT)]
    for x, text, color in layers:
        box(ax, x, 1.2, 2.4, 2.2, text, color=color, fontsize=9)
    for (x, _, _), (nx, _, _) in zip(layers, layers[1:]):
        arrow(ax, (x + 2.45, 2.3), (nx - 0.05, 2.3))
    ax.text(0.3, 0.55, f"W1: {hidden} x 784 weights, b1: {hidden};  W2: 10 x {hidden}, b2: 10  "
            f"({hidden * 785 + 10 * (hidden + 1):,} parameters)", fontsize=9, color=MEMORY)
    ax.text(13.2, 4.25, "label y", fontsize=9, color=HIGHLIGHT, ha="center")
    arrow(ax, (13.2, 4.2), (13.2, 3.45), color=HIGHLIGHT)
    return fig


def training_curve(losses: np.ndarray, steps_per_epoch: int, window: int = 50):
    """Each step's loss (light) and its moving average over `window` steps, epochs marked."""
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.plot(losses, color=MUTED, lw=0.5, label="loss of each step's batch")
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax.plot(np.arange(window - 1, len(losses)), smooth, color=FORWARD, lw=2, label=f"mean of {window} steps")
    for epoch in range(steps_per_epoch, len(losses), steps_per_epoch):
        ax.axvline(epoch, color=HIGHLIGHT, lw=0.8, ls="--")
    ax.set(xlabel="step", ylabel="loss", yscale="log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---- level 2: backpropagation ----


def slope(ws: np.ndarray, losses: np.ndarray, w0: float, loss0: float, gradient: float, w1: float, loss1: float,
          name: str):
    """The loss along one weight, the tangent that the gradient gives at w0, and one SGD step to w1."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(ws, losses, color=FORWARD, label=f"loss along {name}")
    ax.plot(ws, loss0 + gradient * (ws - w0), "--", color=MEMORY, label=f"tangent: slope dL/dw = {gradient:.4f}")
    ax.plot([w0], [loss0], "ko")
    ax.annotate("", xy=(w1, loss1), xytext=(w0, loss0), arrowprops={"arrowstyle": "-|>", "color": BACKWARD, "lw": 1.5})
    ax.text(w1, loss1, "  one SGD step", color=BACKWARD, va="top", fontsize=9)
    ax.set(xlabel="w", ylabel="mean loss of 8 digits", title="The gradient points uphill; SGD steps down")
    ax.set_ylim(losses.min() - 0.1 * np.ptp(losses), losses.max() + 0.1 * np.ptp(losses))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def backprop_graph():
    """The network as a computational graph: values forward (blue, with shapes), gradients backward (red)."""
    fig, ax = diagram(19, 7.2, figsize=(9.5, 3.6))
    values = [(0.2, "x", "(B, 784)"), (5.0, "h", "(B, H)"), (9.0, "a", "(B, H)"), (13.0, "z", "(B, 10)"),
              (17.6, "L", "scalar")]
    ops = [(2.4, "fc1"), (6.9, "ReLU"), (10.9, "fc2"), (15.1, "softmax\n+ xent")]
    for x, name, shape in values:
        box(ax, x, 3.0, 1.2, 1.0, name, color=MUTED, fontsize=11)
        ax.text(x + 0.6, 2.65, shape, ha="center", va="top", fontsize=8, color=MEMORY)
    for x, name in ops:
        box(ax, x, 2.9, 1.6, 1.2, name, color=FORWARD, fontsize=9)
    centres = sorted([x + 0.6 for x, _, _ in values] + [x + 0.8 for x, _ in ops])
    for left, right in zip(centres, centres[1:]):
        arrow(ax, (left + 0.75, 3.7), (right - 0.75, 3.7))
    for x, text in ((2.4, "W1 (H, 784), b1 (H)"), (10.9, "W2 (10, H), b2 (10)"), (15.1, "labels y (B)")):
        ax.text(x + 0.8, 5.9, text, ha="center", fontsize=8, color=FORWARD)
        arrow(ax, (x + 0.8, 5.8), (x + 0.8, 4.15))
    for x, text in ((2.4, "dW1 = dhᵀx\ndb1 = Σ_b dh"), (10.9, "dW2 = dzᵀa\ndb2 = Σ_b dz")):
        ax.text(x + 2.0, 5.0, text, fontsize=8, color=BACKWARD, va="center")
    backward = [(17.6, 13.6, "1"), (13.0, 9.6, "dz = (p − onehot(y)) / B"), (9.0, 5.6, "da = dz W2"),
                (5.0, 1.4, "dh = da ⊙ [h > 0]")]
    for start, end, text in backward:
        arrow(ax, (start + 0.3, 2.2), (end + 0.3, 2.2), color=BACKWARD)
        ax.text((start + end) / 2 + 0.3, 1.6, text, ha="center", va="top", fontsize=8, color=BACKWARD)
    ax.text(0.2, 0.2, "forward: values left to right (blue);   backward: gradients right to left (red), each made "
            "from the one to its right and a value kept from the forward pass", fontsize=8, color=MEMORY)
    return fig
