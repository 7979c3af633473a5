"""The roofline of the GPU chapters (5, 6 and 7): the measured ceilings as the roof, each level's step and each matrix
product kernel as a point under it. A figure of its own module, so that each chapter showing it imports only this."""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
import numpy as np

from common.book.figures import MEMORY, MUTED
from common.harness.plots import colour
from common.levels import THE_MLP
from common.nets.mlp import bytes_per_step, flops_per_step

# Each kernel of common/harness/matmul_kernels.py as the implementation whose row computes with it.
KERNEL_ROWS = {"cublas": "level6[cuda]", "naive": "level5[cuda, naive]", "tiled": "level5[cuda, tiled]",
               "blocked": "level5[cuda, blocked]"}
SIZE_MARKERS = ("o", "s", "D", "^")  # one per size, in the order given


def row_colour(label: str) -> str:
    """A row's colour as the harness's plots give it: its level's, in the tint of its variant (level5[cuda, tiled]:
    level 5's second matrix product); a row without options in the level's own colour."""
    name, _, inside = label.partition("[")
    device, *options = inside.rstrip("]").split(", ")
    variants = [list(v.values()) for v in THE_MLP.variants(int(name.removeprefix("level")), device)]
    return colour(label, variants.index(options) if options in variants else 0)


def roof(intensity: np.ndarray, ceilings: dict) -> np.ndarray:
    """GFLOP/s the GPU can reach at an arithmetic intensity (FLOP per byte): the memory's rate times the intensity,
    or the arithmetic's ceiling, whichever is lower."""
    arithmetic, memory = ceilings["fp32_matmul_tflops_measured"] * 1e3, ceilings["copy_tb_per_s_measured"] * 1e3
    return np.minimum(arithmetic, memory * intensity)


def kernel_points(kernels: dict) -> list[tuple[str, int, float, float]]:
    """(kernel, size index, intensity, GFLOP/s) of each kernel over a step's five matrix products at each size: their
    FLOPs over the bytes each product reads and writes once (A, B and C, float32), and their measured rate."""
    points = []
    for index, size in enumerate(kernels["sizes"]):
        flops = sum(2 * p["m"] * p["n"] * p["k"] for p in size["products"])
        moved = sum(4 * (p["m"] * p["k"] + p["k"] * p["n"] + p["m"] * p["n"]) for p in size["products"])
        points += [(kernel, index, flops / moved, timing["gflops"]) for kernel, timing in size["step"].items()]
    return points


def step_points(runs: list[dict], rows=None) -> list[tuple[str, int, float, float]]:
    """(row, run index, intensity, GFLOP/s) of each GPU level's step (not the peers) whose time was published: its
    FLOPs over bytes_per_step, both from the run's sizes, and its measured rate. rows: the labels to keep (None: all)."""
    points = []
    for index, run in enumerate(runs):
        s = run["settings"]
        intensity = flops_per_step(s["batch"], s["hidden"]) / bytes_per_step(s["batch"], s["hidden"])
        points += [(row["level"], index, intensity, row["gflops"]) for row in run["table"]
                   if row["device"] == "cuda" and row["level"].startswith("level") and row["gflops"]
                   and (rows is None or row["level"] in rows)]
    return points


def roofline(ceilings: dict, runs: list[dict], kernels: dict | None = None, rows=None):
    """The roof of the measured ceilings (results/<gpu>/debugging/ceilings.json) and, under it, each GPU level's step
    (runs: make bench's results.json of the MLP, e.g. the chapter's and large-b256) and each matrix-product kernel over
    a step's products (kernels: common/harness/matmul_kernels.py's JSON; None: not drawn). rows: the steps and kernels
    to draw, by their rows' labels (a kernel by KERNEL_ROWS'; None: all), so that a chapter shows only the levels its
    reader has met."""
    fig, ax = plt.subplots(figsize=(9, 5.6))
    intensity = np.logspace(-1, 3, 200)
    ax.plot(intensity, roof(intensity, ceilings), color=MEMORY, lw=2, zorder=1)
    peak, bandwidth = ceilings["fp32_matmul_tflops_measured"], ceilings["copy_tb_per_s_measured"]
    ridge = peak / bandwidth
    ax.axvline(ridge, color=MUTED, lw=0.8, ls=":", zorder=0)
    ax.text(0.12, bandwidth * 1e3 * 0.12 * 1.35, f"memory: {bandwidth:.2f} TB/s", rotation=28, fontsize=8.5,
            color=MEMORY)
    ax.text(ridge * 1.15, peak * 1e3 * 1.15, f"FP32 arithmetic: {peak:.1f} TFLOP/s", fontsize=8.5, color=MEMORY)
    ax.text(ridge * 1.05, 1.5, f"ridge: {ridge:.0f} FLOP/byte", fontsize=8, color=MEMORY)

    steps = step_points(runs, rows)
    kernel_rows = [point for point in (kernel_points(kernels) if kernels else [])
                   if rows is None or KERNEL_ROWS[point[0]] in rows]
    labels = list(dict.fromkeys([label for label, *_ in steps] + [KERNEL_ROWS[k] for k, *_ in kernel_rows]))
    palette = {label: row_colour(label) for label in labels}
    for label, index, x, y in steps:
        ax.scatter(x, y, s=60, marker=SIZE_MARKERS[index], color=palette[label], edgecolor="black", lw=0.6, zorder=3)
    for kernel, index, x, y in kernel_rows:
        ax.scatter(x, y, s=70, marker=SIZE_MARKERS[index], color=palette[KERNEL_ROWS[kernel]], edgecolor="black",
                   lw=0.6, zorder=3, hatch="////")
    for label in labels:  # the legend: one entry per implementation, in its colour
        ax.scatter([], [], marker="o", color=palette[label], edgecolor="black", lw=0.6, label=label)
    sizes = [f"batch {r['settings']['batch']}, hidden {r['settings']['hidden']}" for r in runs]
    for index, size in enumerate(sizes):
        ax.scatter([], [], marker=SIZE_MARKERS[index], color="white", edgecolor="black", label=size)
    if kernel_rows:
        ax.scatter([], [], marker="o", color="white", edgecolor="black", hatch="////",
                   label="hatched: a kernel, over a step's five products")
    ax.set(xscale="log", yscale="log", xlim=(0.1, 1000), ylim=(1, 2e5), xlabel="arithmetic intensity (FLOP per byte)",
           ylabel="GFLOP/s", title=f"The roofline of the {ceilings['gpu'].removeprefix('NVIDIA ')}, FP32")
    ax.legend(fontsize=7.5, loc="upper left", ncol=2)
    measured = "each level's step (make bench)" + (" and of each kernel (matmul_kernels.py)" if kernels else
                                                    "; the kernels are not measured yet")
    fused = any(label.startswith("level7") for label, *_ in steps)
    caption = (f"Measured: the roof (an FP32 matrix product and a device copy) and the speed of {measured}. Computed "
               "from the sizes, not measured: each point's intensity, taking every kernel to read its inputs and write "
               "its outputs once." + (" Level 7 keeps its weights on chip between steps: it moves fewer bytes, so its "
                                      "true intensity is higher than its point shows." if fused else ""))
    fig.text(0.01, -0.01, textwrap.fill(caption, 135), fontsize=7.5, color=MEMORY, va="top")
    fig.tight_layout()
    return fig
