"""The held-out checks: the teacher's grade only. `make lab` leaves this file out of the student edition, so a
solution fitted to the visible checks (tests/test_tasks.py, test_level2.py, test_levels.py) fails here.

The same checks as the visible ones, at sizes, seeds and MNIST rows the edition never shows: each task's function
alone, and each level's row in lockstep with level 1 on other images. Every test is marked task("<id>") like the
visible ones, so `make grade` and `make gradebook` in this repository run them too.
"""

from __future__ import annotations

import numpy as np
import pytest

import test_level2
import test_levels
import test_tasks
from common.nets.mlp import init_params
from conftest import graded, implementation_params
from test_tasks import images, layers, task_params  # noqa: F401 (pytest's fixtures, shared with the visible checks)

# Sizes the visible checks do not use: (B, n_in, n_out), all different but one square one.
SIZES = [(7, 11, 3), (2, 3, 19), (4, 6, 6), (5, 784, 9)]


@pytest.mark.parametrize("B, n_in, n_out", SIZES)
@pytest.mark.parametrize("task", task_params("linear_forward"))
def test_linear_forward_held_out(layers, images, B, n_in, n_out):  # noqa: F811
    test_tasks.test_linear_forward(layers, images[11:], B, n_in, n_out)


@pytest.mark.parametrize("B, n_in, n_out", SIZES)
@pytest.mark.parametrize("task", task_params("linear_backward"))
def test_linear_backward_held_out(layers, images, B, n_in, n_out):  # noqa: F811
    test_tasks.test_linear_backward(layers, images[23:], B, n_in, n_out)


@pytest.mark.parametrize("B, n", [(3, 11), (17, 2)])
@pytest.mark.parametrize("task", task_params("bias_backward"))
def test_bias_backward_held_out(layers, B, n):  # noqa: F811
    test_tasks.test_bias_backward(layers, B, n)


@pytest.mark.parametrize("task", task_params("relu_backward"))
def test_relu_backward_held_out(layers):  # noqa: F811
    h = test_tasks.pre_activations(7, 19)
    da = test_tasks.normal(7, 19, seed=41)
    expected = np.where(h > 0, da, 0).astype(np.float64)
    test_tasks.assert_within(layers.relu_backward(da, h), expected, 0, "dh (da where h > 0, else 0)")


@pytest.mark.parametrize("B, n_out, scale", [(6, 10, 3.0), (9, 4, 500.0)])
@pytest.mark.parametrize("task", task_params("softmax_xent_forward"))
def test_softmax_xent_forward_held_out(layers, B, n_out, scale):  # noqa: F811
    test_tasks.test_softmax_xent_forward(layers, B, n_out, scale)


@pytest.mark.parametrize("B", [2, 7])
@pytest.mark.parametrize("task", task_params("softmax_xent_backward"))
def test_softmax_xent_backward_held_out(layers, B):  # noqa: F811
    test_tasks.test_softmax_xent_backward(layers, B)


@graded(2, "linear layer")
@pytest.mark.parametrize("batch, n_in, n_out", [(4, 9, 2), (6, 3, 3)])
def test_linear_backward_vs_finite_differences_held_out(batch, n_in, n_out):
    test_level2.test_linear_backward_vs_finite_differences(batch, n_in, n_out)


@graded(2, "softmax cross-entropy")
@pytest.mark.parametrize("batch, scale", [(6, 2.0), (3, 20.0)])
def test_softmax_xent_backward_vs_finite_differences_held_out(batch, scale):
    test_level2.test_softmax_xent_backward_vs_finite_differences(batch, scale)


# Each level's row: lockstep with level 1, and the free run, on MNIST rows and sizes the visible checks do not use.
@pytest.mark.parametrize("impl", implementation_params(graded=True))
@pytest.mark.parametrize("hidden, batch, start, n, epochs", [(29, 11, 50_000, 150, 2), (3, 5, 30_000, 60, 1)],
                         ids=["h29-b11", "h3-b5"])
def test_lockstep_on_other_images_held_out(factory, mnist, hidden, batch, start, n, epochs):
    X, y = mnist[0][start : start + n], mnist[1][start : start + n]
    params = init_params(7, hidden)
    test_levels.in_lockstep(factory, params, X, y, epochs, batch, lr=0.05, shuffle=True)
