"""Level 3's figures: where a float32 run and its float64 twin part."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from common.book.figures import BACKWARD, FORWARD, MUTED


def parting(gaps: np.ndarray, split: dict | None):
    """|loss in float32 - loss in float64| at every step of the two runs (measured), the step where their first ReLU
    decided differently marked."""
    fig, ax = plt.subplots(figsize=(9, 3.4))
    steps = np.arange(len(gaps))
    ax.semilogy(steps, np.maximum(gaps, 1e-10), lw=0.6, color=FORWARD)
    if split:
        k = split["step"]
        ax.axvline(k, color=BACKWARD, ls="--", lw=1)
        ax.text(k, ax.get_ylim()[0] * 2, f"  step {k}: hidden unit {split['unit']} of image {split['image']}\n"
                f"  decides differently", color=BACKWARD, fontsize=8, va="bottom")
    ax.axhline(2.0**-24 * 2.3, color=MUTED, lw=0.8)
    ax.text(len(gaps), 2.0**-24 * 2.3, "float32's rounding of a loss near 2.3 ", color="gray", fontsize=7,
            ha="right", va="bottom")
    ax.set(xlabel="step", ylabel="|loss float32 - loss float64|",
           title="Level 1 in float32 and in float64, the same batches: one ReLU, then two runs")
    fig.tight_layout()
    return fig
