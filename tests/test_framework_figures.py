"""Chapter 8's figures (common/book/figures/level8.py) draw what the framework really built: the graph's nodes and
arrows are the tensors and node.inputs of a real forward, numbered by the real topological order; the timeline reads
the capture's kernels."""

from __future__ import annotations

import numpy as np
import pytest

from common.book.figures import level8 as figures
from common.levels import ROOT
from common.nets.mlp import init_params

pytestmark = pytest.mark.level8


def mlp_graph(mnist, rows: int = 8):
    """A real loss of the framework's MLP on MNIST, its graph, and the names given to its leaves."""
    from level8_framework import MLP, from_numpy

    model = MLP(init_params(0, 16))
    x = from_numpy(np.array(mnist[0][:rows]))
    loss = model.loss_fn(model.net(x), mnist[1][:rows])
    names = {id(p): name for name, p in model.net.named_parameters()} | {id(x): "x"}
    return loss, names, figures.graph(loss, names)


def reachable(root) -> list:
    """Every tensor behind root, found independently of the figure's walk (breadth first)."""
    seen, queue = {id(root): root}, [root]
    while queue:
        t = queue.pop(0)
        for i in t.node.inputs if t.node else ():
            if id(i) not in seen:
                seen[id(i)] = i
                queue.append(i)
    return list(seen.values())


def test_the_graph_is_the_forwards_own(mnist):
    """One node per tensor behind the loss, labelled by its name or the operation that made it, with its shape; one
    arrow per entry of each node.inputs; each tensor that needs a gradient numbered by its place in
    topological_order."""
    from level8_framework.tensor import topological_order

    loss, names, g = mlp_graph(mnist)
    tensors = reachable(loss)
    assert len(g["nodes"]) == len(tensors) == 13
    by_label = sorted((n["label"], n["shape"], n["kind"]) for n in g["nodes"])
    expected = sorted((names.get(id(t)) or figures.op_name(t), t.shape,
                       "op" if t.node else "parameter" if t.requires_grad else "input") for t in tensors)
    assert by_label == expected
    assert sorted(n["label"] for n in g["nodes"] if n["kind"] == "op") == sorted(
        ["transpose", "matmul", "add", "relu", "transpose", "matmul", "add", "cross_entropy"])
    assert len(g["edges"]) == sum(len(t.node.inputs) for t in tensors if t.node)
    assert all(a < b for a, b in g["edges"])  # listed inputs first
    order = topological_order(loss)
    numbered = sorted((n["order"], n["label"], n["shape"]) for n in g["nodes"] if n["order"] is not None)
    assert numbered == [(k, names.get(id(t)) or figures.op_name(t), t.shape) for k, t in enumerate(order)]
    assert next(n for n in g["nodes"] if n["label"] == "x")["order"] is None  # no gradient is asked of the input


def test_the_graph_follows_the_network_and_a_tensor_used_twice_appears_once(mnist):
    from common.nets import lenet
    from level8_framework import LeNet, Tensor, from_numpy

    model = LeNet(lenet.init_params(0))
    x = from_numpy(np.array(mnist[0][:4]))
    g = figures.graph(model.loss_fn(model.forward_tensor(x), mnist[1][:4]), {})
    ops = [n["label"] for n in g["nodes"] if n["kind"] == "op"]
    assert ops.count("conv2d") == 2 and ops.count("max_pool2d") == 2 and ops.count("relu") == 4
    assert ops.count("matmul") == 3 and ops[-1] == "cross_entropy"

    a = Tensor([1.0, 2.0], requires_grad=True)
    g = figures.graph((a + a).mean(), {id(a): "a"})
    assert [n["label"] for n in g["nodes"]] == ["a", "add", "mean"]
    assert g["edges"] == [(0, 1), (0, 1), (1, 2)]


def test_the_layout_puts_the_data_path_in_a_row_and_each_parameter_above_its_reader(mnist):
    _, _, g = mlp_graph(mnist)
    where = figures.layout(g)
    assert len(set(where.values())) == len(g["nodes"])  # no two boxes in one place
    path = sorted((c, g["nodes"][n]["label"]) for n, (c, r) in where.items() if r == 0)
    assert [label for _, label in path] == ["x", "matmul", "add", "relu", "matmul", "add", "cross_entropy"]
    for a, b in g["edges"]:
        (ca, ra), (cb, rb) = where[a], where[b]
        assert (ra == rb == 0 and ca < cb) or (ca == cb and ra > rb)
    figure = figures.draw_graph(g, "test")
    shown = " ".join(text.get_text() for text in figure.axes[0].texts)
    assert all(f"{n['label']}\n" in shown for n in g["nodes"])


def test_the_broadcast_figure_shows_the_bias_gradient_as_column_sums():
    rng = np.random.default_rng(0)
    xw, b, g = rng.standard_normal((3, 4)), rng.standard_normal(4), rng.standard_normal((3, 4))
    shown = [text.get_text() for text in figures.broadcast(xw, b, g, "test").axes[0].texts]
    assert all(f"{v:.2f}" in shown for v in g.sum(axis=0))
    assert all(f"{v:.2f}" in shown for v in (xw + b).ravel())


def test_the_timeline_reads_the_kernels_of_a_capture():
    """The committed H100 capture's level 6 step: its kernels, copies and fills left out, from the first kernel."""
    from common.book.chapter import capture_part

    capture = ROOT / "results/h100/debugging/timeline.txt"
    if not capture.exists():  # the student edition and tests/plant_bugs.py's scratch copy have no results/
        pytest.skip(f"no {capture.relative_to(ROOT)} here")
    text = capture_part(capture.read_text(), "level6")
    rows = [line for line in text.splitlines()[2:] if line.split()[0][0].isdigit()]
    kernels = figures.parse_timeline(text)
    assert len(kernels) == sum(not line.split(maxsplit=3)[3].startswith(("Memcpy", "Memset")) for line in rows)
    assert kernels[0][0] == 0 and all(later[0] >= earlier[0] for earlier, later in zip(kernels, kernels[1:]))
    assert any(name.startswith("sgd_update_kernel") for _, _, name in kernels)
    figure = figures.timelines({"level6": kernels, "level8": kernels}, "test")
    assert [label.get_text() for label in figure.axes[0].get_yticklabels()] == ["level6", "level8"]
