"""Level 2's figures: slopes and the backward pass."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from common.book.figures import BACKWARD, FORWARD, MEMORY, MUTED, arrow, box, diagram


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
