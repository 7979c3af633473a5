"""Level 2's scalar autograd engine (level2_theory/autograd.py): every operation and the MLP's slice against PyTorch in
float64 and against level 2's hand-derived gradients; deep graphs, values used twice, backward() run twice, bad input.

Tolerances: the engine computes in float64 (Python floats), so against torch.autograd and backprop.py it differs only
in the order of its sums, ~1e-16 relative per operation: TOL = 1e-12, as test_level2.py's TORCH_TOL (measured at
most 5e-16 over five seeds of the MLP slice). A wrong local derivative or a lost contribution is off by O(1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from level2_theory import backprop as bp
from level2_theory.autograd import Value, mlp_loss, mlp_node_count, topological_order, values

pytestmark = pytest.mark.level2

TOL = 1e-12


def test_every_operation_against_torch_float64():
    """The same expression in the engine and in torch, using each operation: its value and both inputs' gradients."""
    def expression(a, b, exp, log, relu):
        c = a * b + b**3 - a / b + (a - b) * 2.0 + 1.5 / a - 0.5 - b
        d = exp(c * 0.1) + log(a * a + 1.0) + relu(c) + relu(-c) * 0.25 + (-a) ** 2 + (b + 2.0) ** 0.5
        return d * d / 3.0 + 1.0 * d

    a, b = Value(-1.3), Value(0.7)
    out = expression(a, b, Value.exp, Value.log, Value.relu)
    out.backward()
    ta, tb = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (-1.3, 0.7))
    expected = expression(ta, tb, torch.exp, torch.log, torch.relu)
    expected.backward()
    assert abs(out.data - expected.item()) <= TOL * abs(expected.item())
    assert abs(a.grad - ta.grad.item()) <= TOL * abs(ta.grad.item())
    assert abs(b.grad - tb.grad.item()) <= TOL * abs(tb.grad.item())


def test_relu_derivative_at_exactly_zero_is_zero():
    x = Value(0.0)
    (x.relu() * 3.0).backward()
    assert x.grad == 0.0


def test_a_value_used_twice_gets_both_contributions():
    x = Value(3.0)
    y = x * x + x  # dy/dx = 2x + 1: x is a parent three times
    y.backward()
    assert x.grad == 7.0


def test_backward_twice_gives_the_same_gradients_not_twice_them():
    x = Value(2.0)
    y = (x * x).exp()
    y.backward()
    first = x.grad
    y.backward()
    assert x.grad == first == pytest.approx(4.0 * np.exp(4.0), rel=1e-15)


def test_a_chain_of_100000_nodes_needs_no_recursion():
    """A recursive topological sort stops at Python's 1,000 frames; this graph is 100,000 deep."""
    x = Value(1.0)
    y = x
    for _ in range(50_000):
        y = y * 1.00001 + 0.0  # two nodes per link (and a constant leaf each)
    y.backward()
    assert len(topological_order(y)) == 1 + 50_000 * 4
    assert x.grad == pytest.approx(1.00001**50_000, rel=1e-9)


def slice_of_the_mlp(seed: int = 0, n_in: int = 5, hidden: int = 16, batch: int = 2):
    """float64 parameters with PyTorch's layouts (biases not 0), a batch of inputs and labels."""
    rng = np.random.default_rng(seed)
    shapes = {"fc1.weight": (hidden, n_in), "fc1.bias": (hidden,), "fc2.weight": (10, hidden), "fc2.bias": (10,)}
    params = {k: 0.5 * rng.standard_normal(s) for k, s in shapes.items()}
    return params, rng.standard_normal((batch, n_in)), rng.integers(0, 10, batch)


def engine_loss_and_grads(params, x, y):
    """The loss, the gradients in params' layouts, and the graph's node count."""
    leaves = {k: values(v) for k, v in params.items()}
    loss = mlp_loss(leaves, values(x), list(y))
    loss.backward()
    grads = {k: np.array([[v.grad for v in row] for row in p] if isinstance(p[0], list) else [v.grad for v in p])
             for k, p in leaves.items()}
    return loss.data, grads, len(topological_order(loss))


def test_the_mlp_slice_against_level2s_gradients_and_torch():
    """5 inputs, hidden 16, batch 2: the engine's gradients are the ones backprop.py derives by hand, and autograd's."""
    params, x, y = slice_of_the_mlp()
    loss, grads, nodes = engine_loss_and_grads(params, x, y)
    hand_loss, hand_grads = bp.mlp_loss_and_grads(params, x, y)
    p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    logits = torch.relu(torch.from_numpy(x) @ p["fc1.weight"].T + p["fc1.bias"]) @ p["fc2.weight"].T + p["fc2.bias"]
    torch_loss = F.cross_entropy(logits, torch.from_numpy(y))
    torch_loss.backward()
    assert abs(loss - hand_loss) <= TOL * hand_loss and abs(loss - torch_loss.item()) <= TOL * hand_loss
    for name in params:
        assert grads[name].shape == params[name].shape
        assert bp.rel_error(grads[name], hand_grads[name]) < TOL, name
        assert bp.rel_error(grads[name], p[name].grad.numpy()) < TOL, name
    assert nodes == mlp_node_count(2, 5, 16, 10) == 1_337  # 1,337 scalars for 2 images of 5 pixels


def test_the_node_count_of_one_step_of_the_chapters_mlp():
    """Why nobody trains on scalars: one step of 784-256-10 at batch 8 is 3.5 million nodes (the formula checked on a
    graph it builds)."""
    params, x, y = slice_of_the_mlp(1, n_in=7, hidden=3, batch=4)
    assert engine_loss_and_grads(params, x, y)[2] == mlp_node_count(4, 7, 3, 10)
    assert mlp_node_count(8, 784, 256, 10) == 3_464_347


def test_a_second_output_resets_the_shared_leaves():
    """A grad is d(last output)/d(node): backward() from another output does not add to the first one's."""
    x = Value(2.0)
    a, b = x * 3.0, x * x
    a.backward()
    assert x.grad == 3.0
    b.backward()
    assert x.grad == 4.0


@pytest.mark.parametrize("make, error, words", [
    (lambda: Value("1.0"), TypeError, "real number"),
    (lambda: Value(True), TypeError, "real number"),
    (lambda: Value(0.0).log(), ValueError, "positive"),
    (lambda: Value(-8.0) ** 0.5, ValueError, "integer exponent"),
    (lambda: Value(2.0) ** Value(2.0), TypeError, "constant number"),
    (lambda: Value(1.0) / 0.0, ZeroDivisionError, "/ 0"),
    (lambda: Value(0.0) ** -1, ValueError, "not finite"),
])
def test_bad_input_is_refused_with_a_clear_error(make, error, words):
    with pytest.raises(error, match=words):
        make()
