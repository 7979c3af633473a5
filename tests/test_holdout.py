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


# The autograd engines (level 2's Values, level 8's tensors): a tangle of 400 operations drawn at random, whose nodes
# feed several others, other leaves and another chain's depth.
HELD_OUT_LEAVES = [0.3, -1.1, 0.8, 0.25]
HELD_OUT_TENSORS = np.array([[0.3, -0.6], [-1.1, 0.2], [0.8, 0.9], [0.25, -0.4]])


@graded(2, "topological_order")
@pytest.mark.parametrize("expression, length", [("tangle", 400), ("chain", 30_001)])
def test_scalar_topological_order_held_out(expression, length):
    test_tasks.check_scalar_order(expression, HELD_OUT_LEAVES[: 1 if expression == "chain" else 4], length)


@graded(2, "backward")
@pytest.mark.parametrize("expression, leaves, length", [("tangle", HELD_OUT_LEAVES, 400),
                                                         ("fan_out", [-0.4, 0.9, -1.2], 0)])
def test_scalar_backward_held_out(expression, leaves, length):
    test_tasks.check_scalar_gradients(expression, leaves, length)


@graded(2, "log-softmax + NLL")
@pytest.mark.parametrize("B, C, scale", [(5, 7, 10.0), (2, 10, 5000.0)])
def test_scalar_log_softmax_nll_held_out(B, C, scale):
    logits = test_tasks.f64(test_tasks.normal(B, C, seed=52, scale=scale))
    test_tasks.check_log_softmax_nll(logits, (np.arange(B) * 3) % C)


@pytest.mark.parametrize("step, hyper", [(3, {}), (20, {"lr": 3e-4, "betas": (0.5, 0.9), "eps": 1e-7})])
@pytest.mark.parametrize("task", task_params("adam_update"))
def test_adam_update_held_out(layers, step, hyper):  # noqa: F811
    test_tasks.check_adam(layers, {"w": (19, 7), "b": (19,), "v": (3,)}, step, hyper, seed=63)


@graded(8, "autograd")
@pytest.mark.parametrize("expression, length", [("tangle", 400), ("chain", 30_001)])
def test_tensor_topological_order_held_out(expression, length):
    leaves = HELD_OUT_TENSORS[:1] if expression == "chain" else HELD_OUT_TENSORS
    test_tasks.check_tensor_order(expression, leaves, [True, False, True, True][: len(leaves)], length)


@graded(8, "autograd")
@pytest.mark.parametrize("expression, leaves, length", [("tangle", HELD_OUT_TENSORS, 400),
                                                         ("fan_out", -HELD_OUT_TENSORS[1:], 0)])
def test_tensor_backward_held_out(expression, leaves, length):
    test_tasks.check_tensor_gradients(expression, leaves, length)


@graded(8, "matmul_backward")
@pytest.mark.parametrize("a_view, b_view", test_tasks.LAYOUTS)
@pytest.mark.parametrize("M, K, N", [(7, 11, 3), (2, 3, 19), (4, 6, 6), (5, 784, 9)])
def test_matmul_backward_held_out(images, M, K, N, a_view, b_view):  # noqa: F811
    a = np.ascontiguousarray(images[30 : 30 + M]) if K == 784 else test_tasks.normal(M, K, seed=73)
    test_tasks.check_matmul_backward(a, test_tasks.normal(K, N, seed=74, scale=0.1), test_tasks.normal(M, N, seed=75),
                                     a_view, b_view)


@graded(8, "broadcast backward")
@pytest.mark.parametrize("g_shape, shape", [((7, 3), (3,)), ((6, 2, 5), (2, 1)), ((2, 3, 4, 5), (1, 3, 1, 5)),
                                            ((5,), ()), ((3, 1, 4), (1, 4))])
def test_broadcast_backward_held_out(g_shape, shape):
    test_tasks.check_sum_to(test_tasks.normal(*g_shape, seed=82), shape)
