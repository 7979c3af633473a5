"""Level 8's figures: the graph a forward builds (drawn from the real graph), broadcasting and its backward, views of
one storage (drawn from real tensors' shapes, strides and offsets), SGD and Adam's loss curves, and one training step's
GPU work on a time line."""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from common.book.figures import BACKWARD, FORWARD, HIGHLIGHT, MEMORY, MUTED, THREAD, arrow, box, grid
from common.harness import plots

# ---- the graph a forward builds ----


def op_name(tensor) -> str:
    """The operation that computed a tensor, named as tensor.py names it (its backward function's owner)."""
    return tensor.node.backward.__qualname__.split(".")[0]


def graph(root, names: dict[int, str]) -> dict:
    """The graph behind `root`, read from the tensors themselves: from the root through each tensor's node to its
    inputs, every tensor once. Returns {"nodes": [...], "edges": [(input, output), ...]} with the nodes listed inputs
    first (each after every tensor it was computed from); a node is {"label": its name in `names` (by id) or its
    operation's, "shape", "kind": "parameter", "input" or "op", "order": its position in tensor.topological_order
    (None for a tensor that needs no gradient)}. The graph must not have been freed by a backward() yet."""
    from level8_framework.tensor import topological_order

    order = {id(t): i for i, t in enumerate(topological_order(root))}
    tensors, edges, done = [], [], set()
    stack = [(root, False)]
    while stack:  # depth first, iteratively, as topological_order: a tensor after its inputs
        t, inputs_done = stack.pop()
        if inputs_done:
            tensors.append(t)
        elif id(t) not in done:
            done.add(id(t))
            stack.append((t, True))
            if t.node is not None:
                stack += [(i, False) for i in reversed(t.node.inputs) if id(i) not in done]
    index = {id(t): k for k, t in enumerate(tensors)}
    nodes = []
    for t in tensors:
        kind = "op" if t.node is not None else "parameter" if t.requires_grad else "input"
        nodes.append({"label": names.get(id(t), op_name(t) if t.node else "?"), "shape": t.shape, "kind": kind,
                      "order": order.get(id(t))})
        if t.node is not None:
            edges += [(index[id(i)], index[id(t)]) for i in t.node.inputs]
    return {"nodes": nodes, "edges": edges}


def layout(g: dict) -> dict[int, tuple[int, int]]:
    """(column, row) of each node: the data path (from the root, each operation's first input) along row 0, left to
    right; every other input above the operation that reads it, its own inputs above it."""
    inputs: dict[int, list[int]] = {}
    for a, b in g["edges"]:
        inputs.setdefault(b, []).append(a)
    path = [len(g["nodes"]) - 1]  # the root is listed last
    while path[-1] in inputs:
        path.append(inputs[path[-1]][0])
    where = {n: (col, 0) for col, n in enumerate(reversed(path))}
    for n in path:
        col = where[n][0]
        stack = list(reversed(inputs.get(n, [])[1:]))
        while stack:  # each one on the next free row of the column
            i = stack.pop()
            if i not in where:
                where[i] = (col, 1 + max(r for c, r in where.values() if c == col))
                stack += reversed(inputs.get(i, []))
    return where


def draw_graph(g: dict, title: str):
    """The graph as boxes and arrows: the data path along the bottom, parameters above; each tensor that needs a
    gradient numbered by its place in the topological order (backward() visits them from the last to the first)."""
    where = layout(g)
    cols, rows = max(c for c, _ in where.values()) + 1, max(r for _, r in where.values()) + 1
    w, h, dx, dy = 1.9, 0.9, 2.5, 1.45
    fig, ax = plt.subplots(figsize=(min(9.5, 1.3 * cols + 0.5), 1.1 * rows + 1.2))
    ax.set_xlim(-0.3, cols * dx)
    ax.set_ylim(-0.9, rows * dy)
    ax.set_aspect("equal")
    ax.axis("off")
    centre = {n: (c * dx + w / 2, r * dy + h / 2) for n, (c, r) in where.items()}
    colors = {"op": FORWARD, "parameter": THREAD, "input": MUTED}
    for n, node in enumerate(g["nodes"]):
        (x, y), shape = centre[n], "x".join(map(str, node["shape"])) or "one value"
        box(ax, x - w / 2, y - h / 2, w, h, f"{node['label']}\n({shape})", color=colors[node["kind"]], fontsize=7.5)
        if node["order"] is not None:
            ax.text(x + w / 2, y + h / 2, str(node["order"] + 1), ha="center", va="center", fontsize=7,
                    color="white", bbox={"boxstyle": "circle,pad=0.2", "facecolor": BACKWARD, "edgecolor": "none"})
    for a, b in g["edges"]:
        (xa, ya), (xb, yb) = centre[a], centre[b]
        if ya == yb:  # along the data path
            arrow(ax, (xa + w / 2, ya), (xb - w / 2, yb), color=MEMORY)
        else:  # down into the operation that reads it
            arrow(ax, (xa, ya - h / 2), (xb, yb + h / 2), color=MEMORY)
    ax.text(0, -0.75, "green: parameters (leaves that get a .grad); grey: the input, no gradient; blue: operations. "
            "Red: the topological order; backward() walks it from the highest number down.", fontsize=7.5,
            color=MEMORY)
    ax.set_title(title, fontsize=9.5)
    return fig


# ---- broadcasting ----


def broadcast(xw: np.ndarray, b: np.ndarray, g: np.ndarray, title: str):
    """A bias b (n,) added to every row of x W^T (B, n), and the backward: b's gradient is the output's gradient g
    (B, n) summed over the rows, the axis b was broadcast along. The values are the caller's."""
    rows, n = xw.shape
    cell, gap = 0.85, 1.0
    width = n * cell
    left, middle, right = 0.0, width + gap, 2 * (width + gap)
    fig, ax = plt.subplots(figsize=(9.5, 4.4))
    ax.set_xlim(-0.2, right + width + 6.2)
    ax.set_ylim(-2 * rows * cell - 2.2, 0.9)
    ax.set_aspect("equal")
    ax.axis("off")

    def matrix(x: float, y: float, values, color: str, faded_rows=()) -> None:
        values = np.atleast_2d(values)
        light, grey = matplotlib.colors.to_rgba(color, 0.3), matplotlib.colors.to_rgba(MUTED, 0.5)
        colors = [[grey if r in faded_rows else light] * values.shape[1] for r in range(values.shape[0])]
        grid(ax, x, y, values.shape[0], values.shape[1], cell=cell, colors=colors,
             text=[[f"{v:.2f}" for v in row] for row in values], fontsize=7.5)

    matrix(left, 0, xw, FORWARD)
    matrix(middle, 0, np.tile(b, (rows, 1)), HIGHLIGHT, faded_rows=range(1, rows))
    matrix(right, 0, xw + b, FORWARD)
    for x, sign in ((width + gap / 2, "+"), (middle + width + gap / 2, "=")):
        ax.text(x, -rows * cell / 2, sign, fontsize=14, ha="center", va="center")
    for x, text in ((left, f"x Wᵀ ({rows}, {n})"), (middle, f"b ({n},), every row"), (right, f"out ({rows}, {n})")):
        ax.text(x, 0.2, text, fontsize=8.5)
    ax.text(right + width + 0.4, -rows * cell / 2, "forward: b is added to every row\n(the grey rows are the "
            "same b,\nread again)", fontsize=8.5, va="center", color=FORWARD)
    top = -rows * cell - 1.3
    matrix(right, top, g, BACKWARD)
    ax.text(right, top + 0.2, f"g = dL/d(out) ({rows}, {n})", fontsize=8.5)
    row_y = top - (rows - 1) * cell / 2
    matrix(middle, row_y, g.sum(axis=0), BACKWARD)
    ax.text(middle, row_y - cell - 0.25, f"db ({n},): the sum of\neach column of g", fontsize=8.5, va="top",
            color=BACKWARD)
    arrow(ax, (right - 0.1, row_y - cell / 2), (middle + width + 0.1, row_y - cell / 2), color=BACKWARD)
    ax.text(right + width + 0.4, top - rows * cell / 2, "backward: each entry of b was\nused once per row, so its "
            "\ngradient sums its column of g", fontsize=8.5, va="center", color=BACKWARD)
    ax.set_title(title, fontsize=9.5)
    return fig


# ---- views: storage, shape and strides ----


def views(storage: np.ndarray, layouts: list[tuple[str, tuple, tuple, int]], title: str):
    """Views of one storage, each drawn from its shape, strides and offset alone: its values as a grid, cell [i, j]
    read from storage[offset + i strides[0] + j strides[1]] (level8_framework/strides.py's index_to_position), and
    beside it the storage, each cell it reads numbered in the view's row-major order (a cell read twice, through a
    stride of 0, gets both numbers). layouts: (label, shape, strides, offset) of views of up to 2 axes."""
    from level8_framework.strides import index_to_position

    cell, gap, n = 0.6, 1.6, len(storage)
    shapes = [(1,) * (2 - len(shape)) + tuple(shape) for _, shape, _, _ in layouts]
    width = max(c for _, c in shapes) * cell
    heights = [r * cell + 1.05 for r, _ in shapes]
    fig, ax = plt.subplots(figsize=(10, 0.62 * sum(heights) + 0.8))
    ax.set_xlim(-0.1, width + gap + n * cell + 0.1)
    ax.set_ylim(-sum(heights) - 0.5, 0.1)
    ax.set_aspect("equal")
    ax.axis("off")
    top = 0.0
    for (label, shape, steps, offset), (rows, cols), height in zip(layouts, shapes, heights):
        steps = (0,) * (2 - len(steps)) + tuple(steps)
        positions = [[index_to_position((r, c), steps, offset) for c in range(cols)] for r in range(rows)]
        light = matplotlib.colors.to_rgba(FORWARD, 0.3)
        ax.text(0, top - 0.05, f"{label}: shape {tuple(shape)}, strides {tuple(steps[2 - len(shape):])}, offset "
                f"{offset}", fontsize=8.5, va="top")
        grid(ax, 0, top - 0.55, rows, cols, cell=cell, colors=[[light] * cols] * rows,
             text=[[f"{storage[p]:g}" for p in row] for row in positions], fontsize=8)
        reads: dict[int, list[int]] = {}
        for k, p in enumerate(p for row in positions for p in row):
            reads.setdefault(p, []).append(k + 1)
        left = width + gap
        grid(ax, left, top - 0.55, 1, n, cell=cell, fontsize=8, text=[[f"{v:g}" for v in storage]],
             colors=[[matplotlib.colors.to_rgba(HIGHLIGHT, 0.5) if p in reads else MUTED for p in range(n)]])
        for p, order in reads.items():
            ax.text(left + (p + 0.5) * cell, top - 0.55 - cell - 0.08, ",".join(map(str, order)), ha="center",
                    va="top", fontsize=6.5, color=HIGHLIGHT)
        top -= height
    ax.text(width + gap, top, "right: the one storage, in memory order; under a cell, which of the view's values\n"
            "(counted row by row) it holds", fontsize=8, color=MEMORY, va="top")
    ax.set_title(title, fontsize=9.5)
    return fig


# ---- SGD against Adam ----


def optimizers(curves: dict[tuple[str, str], np.ndarray], steps_per_epoch: int, title: str):
    """Each (implementation, optimizer)'s loss at every step of its run, as a rolling mean: one colour per
    implementation, a solid line for SGD and a dashed one for Adam; level 1's wide and pale, under the others."""
    fig, ax = plt.subplots(figsize=(9, 3.8))
    styles = {"SGD": "-", "Adam": "--"}
    for (label, optimizer), losses in curves.items():
        steps, means = plots.rolling_mean(np.asarray(losses))
        under = label.startswith("level1")  # wide and pale beneath: a run that follows it exactly stays visible
        ax.plot(steps, means, styles[optimizer], color=plots.colour(label), lw=4 if under else 1.3,
                alpha=0.45 if under else 1, label=f"{label}, {optimizer}")
    plots.epoch_axis(ax, steps_per_epoch, len(next(iter(curves.values()))) // steps_per_epoch)
    ax.set(yscale="log", xlabel="epoch (each tick: the first step of an epoch)",
           ylabel=f"loss, mean of the last {plots.WINDOW} steps", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---- one step on the GPU, on a time line ----


def parse_timeline(text: str) -> list[tuple[float, float, str]]:
    """The kernels of one part of a timeline capture (common/book/capture_debugging.py): (start, length, name) in
    microseconds, copies and fills left out, the time counted from the first kernel (the profiled call's own start is
    no kernel's)."""
    kernels = []
    for line in text.splitlines()[2:]:
        fields = line.split(maxsplit=3)
        if len(fields) == 4 and fields[0][0].isdigit() and not fields[3].startswith(("Memcpy", "Memset")):
            kernels.append((float(fields[0]), float(fields[1]), fields[3]))
    t0 = kernels[0][0] if kernels else 0.0
    return [(start - t0, length, name) for start, length, name in kernels]


def timelines(parts: dict[str, list[tuple[float, float, str]]], title: str):
    """Each implementation's kernels of one step as bars along one time axis (microseconds), one row each, in its
    colour; the gaps between the bars are the time the host took to launch the next."""
    fig, ax = plt.subplots(figsize=(9.5, 0.9 * len(parts) + 1.3))
    for row, (label, kernels) in enumerate(parts.items()):
        ax.broken_barh([(start, length) for start, length, _ in kernels], (row - 0.35, 0.7),
                       facecolors=plots.colour(label))
        end = max(start + length for start, length, _ in kernels)
        busy = sum(length for _, length, _ in kernels)
        ax.text(end, row, f"  {len(kernels)} kernels, {busy:.0f} us of GPU work in {end:.0f} us", va="center",
                fontsize=8)
    ax.set_yticks(range(len(parts)), list(parts), fontsize=8)
    ax.invert_yaxis()
    longest = max(s + n for kernels in parts.values() for s, n, _ in kernels)
    ax.set_xlim(0, longest * 1.45)
    ax.set(xlabel="microseconds from the step's first kernel", title=title)
    fig.tight_layout()
    return fig
