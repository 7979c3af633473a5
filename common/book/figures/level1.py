"""Level 1's figures: the data and the network."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from common.book.figures import (
    BACKWARD,
    FORWARD,
    HIGHLIGHT,
    MEMORY,
    MUTED,
    arrow,
    box,
    diagram,
)


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
