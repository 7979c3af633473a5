"""Level 7's figures: which block owns which weights, and the timeline of one step around its exchange."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from common.figures import BACKWARD, FORWARD, HIGHLIGHT, MEMORY, MUTED, THREAD, arrow

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


def step_timeline(phases: list[tuple[str, float]], title: str, blocks: int = 4, seed: int = 0):
    """One step of level 7 as a timeline per block: the measured phases of block 0 (microseconds), the other blocks
    finishing their shares a little earlier or later, and everyone going on once the last share has arrived."""
    rng = np.random.default_rng(seed)
    fig, ax = plt.subplots(figsize=(9, 0.55 * blocks + 1.6))
    durations = dict(phases)
    before = [p for p in phases if p[0] in ("start of the step", "forward", "share of the logits")]
    after = [p for p in phases if p not in before and p[0] != WAIT]
    # Block 0's wait is the measured one; the other blocks send their shares a little earlier or later.
    release = sum(d for _, d in before) + durations.get(WAIT, 0)
    ready = [sum(d for _, d in before) * (1 + (0 if b == 0 else rng.uniform(-0.15, 0.15))) for b in range(blocks)]
    ready = [min(r, release) for r in ready]
    for b in range(blocks):
        t = 0.0
        scale = ready[b] / sum(d for _, d in before)
        for name, d in before:
            ax.barh(b, d * scale, left=t, color=PHASE_COLORS.get(name, MUTED), edgecolor="white")
            t += d * scale
        ax.barh(b, release - t, left=t, color=PHASE_COLORS[WAIT], edgecolor="white", alpha=0.6)
        t = release
        for name, d in after:
            ax.barh(b, d, left=t, color=PHASE_COLORS.get(name, MUTED), edgecolor="white")
            t += d
    ax.set_yticks(range(blocks), [f"block {b}" for b in range(blocks)])
    ax.invert_yaxis()
    ax.set_xlabel("microseconds into the step")
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for n, c in PHASE_COLORS.items() if n in durations]
    ax.legend(handles, [n for n in PHASE_COLORS if n in durations], fontsize=7, ncol=4, loc="upper center",
              bbox_to_anchor=(0.5, -0.35), frameon=False)
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
