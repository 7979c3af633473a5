"""Level 7's figures: which block owns which weights, and the timeline of one step around its exchange."""

from __future__ import annotations

import matplotlib.pyplot as plt

from common.book.figures import (
    BACKWARD,
    FORWARD,
    HIGHLIGHT,
    MEMORY,
    MUTED,
    THREAD,
    arrow,
)

PHASE_COLORS = {"start of the step": MUTED, "forward": FORWARD, "share of the logits": THREAD,
                "the exchange's wait": BACKWARD, "softmax and loss": HIGHLIGHT, "dW2, db2, dh": "#9467bd",
                "dW1 and the updates": "#8c564b"}


WAIT = "the exchange's wait"


def ownership(blocks: int = 16, units: int = 16, hidden: int = 256, n_in: int = 784):
    """fc1.weight's rows and fc2.weight's columns cut into slices of `units` hidden units, one slice per block, kept on
    that block's chip all epoch; the blocks meet only in the exchange of their shares of the logits."""
    fig, ax = plt.subplots(figsize=(9.5, 3.6))
    ax.set_xlim(0, 20.5)
    ax.set_ylim(-0.6, 8.2)
    ax.axis("off")
    shown = 4  # blocks drawn; the rest are dots
    colors = [FORWARD, THREAD, HIGHLIGHT, "#9467bd"]
    # fc1.weight (hidden, n_in): horizontal slices; fc2.weight (10, hidden): vertical slices.
    for b in range(shown):
        ax.add_patch(plt.Rectangle((0.5, 6.8 - b * 1.0), 5.5, 0.8, color=colors[b], alpha=0.5))
        ax.text(3.25, 7.2 - b * 1.0, f"rows {b * units}..{b * units + units - 1}", ha="center", va="center",
                fontsize=8)
        ax.add_patch(plt.Rectangle((7.0 + b * 0.9, 5.6), 0.8, 2.0, color=colors[b], alpha=0.5))
        ax.add_patch(plt.Rectangle((11.0 + b * 1.6, 4.9), 1.4, 1.0, facecolor=colors[b], alpha=0.25,
                                   edgecolor=colors[b]))
        ax.text(11.7 + b * 1.6, 5.4, f"block {b}", ha="center", va="center", fontsize=8)
    ax.text(3.25, 2.55, "⋮", fontsize=14, ha="center")
    ax.text(3.25, 8.0, f"fc1.weight ({hidden}, {n_in}) and fc1.bias", ha="center", fontsize=8.5)
    ax.text(8.9, 8.0, f"fc2.weight (10, {hidden})", ha="center", fontsize=8.5)
    ax.text(10.55, 6.5, "…", fontsize=12)
    ax.text(18.0, 5.4, f"… block {blocks - 1}", fontsize=8, va="center")
    ax.text(16.0, 6.9, f"{blocks} blocks, {units} units each:\neach block keeps its slices (its colour)\n"
            "on chip all epoch (fc1's rows in registers)", ha="center", fontsize=8.5)
    # The exchange: every block writes its share of the logits, then all read all of them after the barrier.
    ax.add_patch(plt.Rectangle((11.0, 2.0), 7.8, 0.9, facecolor="white", edgecolor=MEMORY))
    ax.text(14.9, 2.45, "the exchange: each block's share of the logits,\ncopied to every block", ha="center",
            va="center", fontsize=8)
    for b in range(shown):
        arrow(ax, (11.7 + b * 1.6, 4.85), (11.7 + b * 1.6, 2.95), color=colors[b])
    ax.text(14.9, 1.2, "no block reads the shares until every block's share has arrived",
            ha="center", fontsize=8.5, color=BACKWARD)
    ax.text(0.5, 0.2, "a unit's forward and backward need only its own weights and the batch; "
            "only the logits z = a W2ᵀ + b2 sum over every unit", fontsize=8, color=MEMORY)
    return fig


def step_timeline(phases: list[tuple[str, float]], title: str):
    """One step of level 7 as a timeline of block 0's measured phases (microseconds, in the order they run). Only
    block 0 is measured: the other blocks run the same phases on their own units."""
    fig, ax = plt.subplots(figsize=(9, 2.2))
    t = 0.0
    for name, d in phases:
        ax.barh(0, d, left=t, color=PHASE_COLORS.get(name, MUTED), edgecolor="white",
                alpha=0.6 if name == WAIT else 1.0)
        t += d
    ax.set_yticks([0], ["block 0"])
    ax.set_xlabel("microseconds into the step")
    ax.set_title(title, fontsize=10)
    durations = dict(phases)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for n, c in PHASE_COLORS.items() if n in durations]
    ax.legend(handles, [n for n in PHASE_COLORS if n in durations], fontsize=7, ncol=4, loc="upper center",
              bbox_to_anchor=(0.5, -0.55), frameon=False)
    fig.tight_layout()
    return fig


def parse_phases(text: str) -> dict[str, list[tuple[str, float]]]:
    """The phase table of results/h100/level7_phases.txt: for each size ('chapter', 'large'), its (phase, us) rows."""
    sizes, current = {}, None
    for line in text.splitlines():
        if line.split(":")[0] in ("chapter", "large"):
            current = sizes.setdefault(line.split(":")[0], [])
        elif current is not None and line.strip().endswith(" us") and line.startswith("  "):
            name, value = line.strip()[:-3].rsplit(None, 1)
            current.append((name.strip(), float(value)))
    return sizes


def parse_floors(text: str) -> dict[str, tuple[float, float]]:
    """The table of results/h100/level7_floors.txt: each hand-over ('cluster of 16 blocks', 'grid of 128 blocks', ...)
    and its (barrier, exchange) microseconds per round."""
    floors = {}
    for line in text.splitlines():
        parts = line.strip().rsplit(None, 2)
        if len(parts) == 3 and line.strip().startswith(("grid of", "cluster of")):
            floors[parts[0]] = (float(parts[1]), float(parts[2]))
    return floors
