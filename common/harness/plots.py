"""The harness's two plots of a run (make compare writes them beside results.json), drawn the same way for every run.

loss_curves.png: level 1's free run, step by step, with its float64 twin; then each implementation's mean loss per
epoch against level 1's, inside the band float32 noise allows. lockstep.png: for each verified implementation, the
share of its tolerance each step used, ties marked. One colour per implementation in both (and in every chapter).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # drawn to PNG, never to a window

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from common.harness import verify  # noqa: E402

# One colour per implementation, by the name its rows start with: the levels in order, the peers in greys and browns.
COLOURS = {
    "level1": "#1f77b4", "level3": "#ff7f0e", "level4": "#2ca02c", "level5": "#d62728", "level6": "#9467bd",
    "level7": "#8c564b", "level8": "#e377c2", "torch-eager": "#7f7f7f", "torch-graph": "#bcbd22",
    "torch-compile": "#17becf", "jax-scan": "#393b79",
}
WINDOW = 50  # steps in the free run's rolling mean


# The variants of one level (LeNet's convolutions, the MLP's matrix products) in its colour: as it is, a lighter tint, a
# darker shade, a paler tint. Each (the colour's share, white's share).
VARIANT_MIX = ((1.0, 0.0), (0.55, 0.45), (0.65, 0.0), (0.3, 0.7))


def colour(label: str, variant: int = 0) -> str:
    """The implementation's colour (level4[cpu, im2col]: level 4's); a level's further variants in tints and shades."""
    base = COLOURS.get(label.split("[")[0], "#000000")
    own, white = VARIANT_MIX[min(variant, len(VARIANT_MIX) - 1)]
    return matplotlib.colors.to_hex(own * np.array(matplotlib.colors.to_rgb(base)) + white)


def colours(labels: list[str]) -> dict[str, str]:
    """Each label's colour: variants of one level (its convolutions) told apart by their tint."""
    seen: dict[str, int] = {}
    out = {}
    for label in labels:
        name = label.split("[")[0]
        out[label] = colour(label, seen.get(name, 0))
        seen[name] = seen.get(name, 0) + 1
    return out


def rolling_mean(losses: np.ndarray, window: int = WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """(steps, the mean of the `window` steps ending at each): every point stands at the last step it averages."""
    if len(losses) < window:
        return np.arange(len(losses)), losses
    means = np.convolve(losses, np.ones(window) / window, mode="valid")
    return np.arange(window - 1, len(losses)), means


def epoch_axis(ax, steps_per_epoch: int, epochs: int) -> None:
    """A step axis whose epochs are marked: a faint line at each boundary, ticks labelled by epoch."""
    for e in range(1, epochs):
        ax.axvline(e * steps_per_epoch, color="#dddddd", lw=0.8, zorder=0)
    step = max(1, epochs // 10)
    ticks = list(range(0, epochs + 1, step))
    ax.set_xticks([e * steps_per_epoch for e in ticks], [str(e) for e in ticks])


def loss_curves(runs, twin, out: Path, title: str, epochs: int) -> None:
    """loss_curves.png: level 1's free run and its twin's, then each run's per-epoch mean loss minus level 1's."""
    reference = runs[0]
    steps_per_epoch = len(reference.losses) // max(epochs, 1)
    palette = colours([run.label for run in runs])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7.5))
    for run, style in ((reference, "-"), (twin, "--")):
        steps, means = rolling_mean(np.asarray(run.losses))
        top.plot(steps, means, style, color=palette.get(run.label, "black"), lw=1.4, label=run.label)
    epoch_axis(top, steps_per_epoch, epochs)
    top.set(xlabel="epoch (each tick: the first step of an epoch)", ylabel=f"loss, mean of the last {WINDOW} steps",
            yscale="log", title=f"Level 1's free run and its float64 twin\n{title}")
    top.legend(fontsize=8)

    epoch_offsets(bottom, runs, twin, epochs, palette)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=120, bbox_inches="tight")  # with the legend beside the lower panel
    plt.close(fig)


def epoch_offsets(ax, runs, twin, epochs: int, palette: dict[str, str]) -> None:
    """Each epoch's mean loss minus level 1's: a column per epoch, each run a stem of its own in it (side by side, so
    runs that agree to the last digit stay visible), the allowed band a box per epoch, the legend beside the panel."""
    reference = runs[0]
    mean_1 = verify.epoch_means(reference.losses, epochs)
    x = np.arange(1, epochs + 1)
    series = [(twin, "black", "float64 twin (the noise)")] + [
        (run, palette[run.label], run.label) for run in runs[1:] if len(run.losses) == len(reference.losses)]
    band = next((np.asarray(r.free_run["band"]) for r in runs[1:] if r.free_run and r.free_run["band"]), None)
    if band is not None:
        ax.bar(x, 2 * band, bottom=-band, width=0.9, color="red", alpha=0.12, label="allowed: 4x float32's noise")
    width = 0.8 / len(series)
    for i, (run, shade, label) in enumerate(series):
        at = x + (i - (len(series) - 1) / 2) * width
        offset = verify.epoch_means(run.losses, epochs) - mean_1
        ax.vlines(at, 0, offset, color=shade, lw=1)
        ax.plot(at, offset, "o" if run is not twin else "s", ms=4, color=shade, label=label)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xticks(x)
    ax.set(xlabel="epoch", ylabel="mean loss - level 1's", title="Each epoch's mean loss against level 1's")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)


def lockstep(runs, out: Path, title: str, epochs: int) -> None:
    """lockstep.png: a panel per verified run, the share of its tolerance each step used (loss or any tensor), the
    limit at 1, ties marked."""
    checked = [run for run in runs[1:] if run.lockstep and run.lockstep["record"].used]
    if not checked:
        return
    palette = colours([run.label for run in runs])
    columns = 2 if len(checked) > 4 else 1
    rows = -(-len(checked) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(9 if columns == 1 else 12, 1.9 * rows + 1.1), sharex=True,
                             sharey=True, squeeze=False)
    for ax in axes.flat[len(checked):]:
        ax.axis("off")
    for ax, run in zip(axes.flat, checked):
        record = run.lockstep["record"]
        used = np.maximum(np.asarray(record.used), 1e-4)
        ax.plot(np.arange(len(used)), used, lw=0.5, color=palette[run.label])
        tie_steps = sorted({t.step for t in record.ties})
        if tie_steps:
            ties = len(record.ties)
            ax.plot(tie_steps, used[tie_steps], "x", color="black", ms=6, label=f"{ties} tie{'s' if ties > 1 else ''}")
            ax.legend(fontsize=7, loc="lower right")
        ax.axhline(1, color="red", ls="--", lw=1)
        ax.set(yscale="log", ylim=(1e-4, 3))
        ax.set_title(f"{run.label}: at most {max(record.used):.2f} of the tolerance", fontsize=9)
        epoch_axis(ax, len(used) // max(epochs, 1), epochs)
    for ax in axes[:, 0]:
        ax.set_ylabel("share used")
    for ax in axes[-1, :]:
        ax.set_xlabel("epoch")
    fig.suptitle(f"Lockstep: every step from level 1's parameters, against the float64 step (1 = the limit)\n{title}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "lockstep.png", dpi=120)
    plt.close(fig)
