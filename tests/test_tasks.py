"""The lab's tasks, one check each: `make grade` (common/classroom/grade.py) runs those of the attempted tasks; `pytest -m task`
runs every one (the tasks are listed in common/classroom/lab.py).

Each test is marked task("<id>") through its parameter and checks that task's function alone, against float64
computed here, at odd sizes and on MNIST rows, with inputs chosen to expose the classic bugs of tests/plant_bugs.py:
a batch of 13 (a missing 1/B), pre-activations exactly 0 (the ReLU's mask), weights that are not square (a transposed
index), logits 2,000 apart (a softmax without its max). Level 3 is called directly; levels 4, 5 and 7 through small
libraries that export their static functions one by one (tests/lab_level4.c, lab_memory.c, lab_level5.cu,
lab_level7.cu), level 6's calls through cuBLAS's layout rules in NumPy; the autograd engines of levels 2 and 8 and
level 8's backward of matmul and of a broadcast add through common/classroom/lab_autograd.py, which builds their
graphs from numbers (in a teacher's grade, in the submission's sandbox). Level 2's layers and the levels' rows are
checked by tests marked the same way in test_level2.py and test_levels.py.

The tolerance of a sum: float32 adds n terms, in any order and with or without fused multiply-adds, to within
gamma_n * sum |terms| of the exact sum (common/harness/verify.py). The bound is rigorous, so a correct function cannot
exceed it, and each classic bug exceeds it by orders of magnitude.
"""

from __future__ import annotations

import importlib
import itertools
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.classroom import lab, lab_autograd, lab_native, sandbox
from common.classroom.sgemm import sgemm
from common.harness.verify import LOSS_ATOL, LOSS_RTOL, U, gamma
from common.levels import ROOT, level
from common.nets.mlp import N_IN, N_OUT, param_shapes
from conftest import require

# Odd sizes (B, n_in, n_out): one of everything, all different, square (where only values show a transpose), and
# the first layer on MNIST rows.
SIZES = [(1, 1, 1), (13, 37, 5), (3, 5, 5), (8, N_IN, 37)]
SIZE_IDS = ["1x1x1", "13x37x5", "square", "mnist"]


def task_params(name: str) -> list:
    """pytest.param per task of this name at levels 3-7, marked task("<id>"), levelN, and gpu where it needs one."""
    params = []
    for t in lab.tasks_named(name):
        if t.level >= 3:
            marks = [pytest.mark.task(t.id), getattr(pytest.mark, f"level{t.level}")]
            if t.gpu:
                marks.append(pytest.mark.gpu)
            params.append(pytest.param(t, marks=marks, id=t.id))
    return params


def library(number: int, config) -> None:
    """Skip where the lab library of level 4, 5 or 7 (tests/lab_level*.c[u], built into build/) cannot run or is not
    built (in a teacher's grade, the submission's worker builds it)."""
    if number > 4:
        require(level(number), "cuda", config)
    path = ROOT / "build" / f"lab_level{number}.so"
    if not sandbox.submission() and not path.exists():
        pytest.skip(f"{path.relative_to(ROOT)} is not built: run `make {path.relative_to(ROOT)}` (make grade does)")


def native(function: str, *args, gpu: bool):
    """common.classroom.lab_native's function: run here, or in a teacher's grade by the submission's sandboxed worker."""
    if sandbox.submission():
        return sandbox.remote_function("common.classroom.lab_native", function, gpu=gpu)(*args)
    return getattr(lab_native, function)(*args)


@pytest.fixture
def layers(task, request):
    """The layer functions of the task's level: level 3's module, or a native level's through its lab library."""
    if task.level == 3:
        return importlib.import_module(task.path.removesuffix(".py").replace("/", "."))
    library(task.level, request.config)  # skips where it cannot run
    if sandbox.submission():
        return sandbox.RemoteObject("common.classroom.lab_native:layers", task.level, gpu=task.gpu)
    return lab_native.layers(task.level)


@pytest.fixture(scope="module")
def images(mnist):
    """MNIST's first training images, as every level sees them."""
    return mnist[0][:64]


def normal(*shape: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """float32 N(0, scale^2) entries, reproducible from the shape and seed."""
    return (scale * np.random.default_rng([*shape, seed]).standard_normal(shape)).astype(np.float32)


def inputs(B: int, n_in: int, images: np.ndarray) -> np.ndarray:
    """A batch (B, n_in): MNIST rows for the first layer, else N(0, 1)."""
    return np.ascontiguousarray(images[:B]) if n_in == N_IN else normal(B, n_in, seed=1)


def f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


# The classic bugs the checks recognise from the numbers, each with where the chapters explain it.
BY_B = ("{factor:.0f} times too large, and the batch is {factor:.0f}: did you divide by the batch size? (level 2's "
        "chapter, section 5, 'Vectorized batches, and where 1/B comes from')")
NO_BIAS = "the bias is missing: it is what is left (level 2's chapter, section 3, 'Linear')"
TRANSPOSED = "this is the transpose of the answer (level 2's chapter, section 4, 'Transposes and shapes')"
MASK_FROM_DA = ("the ReLU's mask comes from its output gradient da; it must come from h, the forward's input (level 2's "
                "chapter, section 4, 'The ReLU mask from the wrong tensor')")
MASK_AT_ZERO = ("the gradient passes where h is exactly 0; PyTorch's slope there is 0: use h > 0 (level 2's chapter, "
                "section 3, 'ReLU')")
OVERFLOW = ("NaN or infinity from finite logits: exp() overflowed. Subtract each row's max first (level 2's chapter, "
            "section 4, 'Softmax without subtracting the max')")
WRONG_AXIS = "summed over the wrong axis: the sum runs over the batch's rows (level 2's chapter, section 3, 'Linear')"


def assert_within(got, exact: np.ndarray, bound: np.ndarray, what: str, suspects: dict | None = None,
                  dtype=np.float32) -> None:
    """got is float32 (or dtype), exact's shape, and within bound of it, entry by entry; else say where and by how
    much, and which classic bug it looks like: the first of `suspects` (a hint -> what that bug computes) that got
    matches."""
    assert got is not None, f"{what} is None"
    got = np.asarray(got)
    hint = next((h for h, value in (suspects or {}).items() if value is not None and matches(got, value, bound)), None)
    assert got.dtype == dtype, f"{what} is {got.dtype}, not {np.dtype(dtype).name}"
    assert got.shape == exact.shape, f"{what} has shape {got.shape}, not {exact.shape}" + (f": {hint}" if hint else "")
    err = np.abs(f64(got) - exact)
    bound = np.broadcast_to(bound, exact.shape) + np.finfo(np.float32).tiny
    bad = ~(err <= bound)  # NaN counts as bad
    if not bad.any():
        return
    if hint is None and not np.isfinite(got).all():
        hint = "NaN or infinity in the result"
    i = tuple(int(j) for j in np.argwhere(bad)[0])
    if bound[i] <= 2 * np.finfo(np.float32).tiny:  # an exact check: no rounding is allowed, so none is quoted
        allowed = "it must be exactly that"
    else:
        allowed = f"float32's rounding allows {bound[i]:.2g} here"
    detail = (f"{what}{list(i)} = {got[i]:.8g}, exact {exact[i]:.8g}: off by {err[i]:.2g}, {allowed} "
              f"({int(bad.sum())} of {bad.size} entries off)")
    raise AssertionError(f"{hint}. {detail}" if hint else detail)


def matches(got: np.ndarray, value, bound) -> bool:
    """Whether got is what a suspected bug computes (within four times the check's own tolerance, or 1e-6)."""
    value = np.asarray(value, dtype=np.float64)
    if got.shape != value.shape:
        return False
    try:
        tolerance = 4 * np.broadcast_to(bound, value.shape) + 1e-6 * np.abs(value)
    except ValueError:  # a bound of the right answer's shape, and a suspect of another (a transpose)
        tolerance = 1e-5 * np.abs(value).max()
    return bool(np.all(np.abs(f64(got) - value) <= tolerance + np.finfo(np.float32).tiny))


# ---- the linear layer ----


@pytest.mark.parametrize("B, n_in, n_out", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("task", task_params("linear_forward"))
def test_linear_forward(layers, images, B, n_in, n_out):
    x, w, b = inputs(B, n_in, images), normal(n_out, n_in, scale=0.1), normal(n_out, seed=2)
    out = layers.linear_forward(x, w, b)
    exact = f64(x) @ f64(w).T + b
    suspects = {NO_BIAS: f64(x) @ f64(w).T, TRANSPOSED: f64(x) @ f64(w) + b if n_in == n_out else None}
    assert_within(out, exact, gamma(n_in + 1) * (np.abs(f64(x)) @ np.abs(f64(w)).T + np.abs(b)), "out", suspects)


@pytest.mark.parametrize("B, n_in, n_out", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("task", task_params("linear_backward"))
def test_linear_backward(layers, images, B, n_in, n_out):
    x, w, dout = inputs(B, n_in, images), normal(n_out, n_in, scale=0.1), normal(B, n_out, seed=3)
    dx, dw, db = layers.linear_backward(dout, x, w)
    ax, aw, adout = np.abs(f64(x)), np.abs(f64(w)), np.abs(f64(dout))
    exact_dw = f64(dout).T @ f64(x)
    assert_within(dw, exact_dw, gamma(B) * adout.T @ ax, "dw", {TRANSPOSED: exact_dw.T})
    assert_within(dx, f64(dout) @ f64(w), gamma(n_out) * adout @ aw, "dx")
    if db is not None:  # level 5's bias has a task of its own
        assert_within(db, f64(dout).sum(axis=0), gamma(B) * adout.sum(axis=0), "db", {WRONG_AXIS: f64(dout).sum(axis=1)})
    _, dw_alone, _ = layers.linear_backward(dout, x, None)  # the first layer: no dx, the same dw
    np.testing.assert_array_equal(dw_alone, dw, err_msg="dw without dx differs from dw with it")


@pytest.mark.parametrize("task", task_params("bias_forward"))
def test_bias_forward(layers):
    out, b = normal(13, 37), normal(37, seed=1)
    assert_within(layers.bias_forward(out, b), f64(out + b), 0, "out")  # one rounded addition: exact


@pytest.mark.parametrize("B, n", [(1, 1), (13, 37), (300, 5)])
@pytest.mark.parametrize("task", task_params("bias_backward"))
def test_bias_backward(layers, B, n):
    dout = normal(B, n)
    assert_within(layers.bias_backward(dout), f64(dout).sum(axis=0), gamma(B) * np.abs(f64(dout)).sum(axis=0), "db",
                  {WRONG_AXIS: f64(dout).sum(axis=1)})


# ---- ReLU ----


def pre_activations(B: int, n: int) -> np.ndarray:
    """h (B, n) with a third of it exactly 0 (where PyTorch's slope is 0), a third negative, a third positive."""
    h = np.abs(normal(B, n, seed=4)) * np.random.default_rng(5).choice([-1.0, 0.0, 1.0], (B, n)).astype(np.float32)
    assert (h == 0).any() and (h > 0).any() and (h < 0).any()
    return h


@pytest.mark.parametrize("task", task_params("relu_forward"))
def test_relu_forward(layers):
    h = pre_activations(13, 37)
    assert_within(layers.relu_forward(h), f64(np.where(h > 0, h, 0)), 0, "a")  # a max is exact


@pytest.mark.parametrize("task", task_params("relu_backward"))
def test_relu_backward(layers):
    h, da = pre_activations(13, 37), normal(13, 37, seed=6)  # da of both signs: a mask from da shows
    suspects = {MASK_FROM_DA: f64(np.where(da > 0, da, 0)), MASK_AT_ZERO: f64(np.where(h >= 0, da, 0))}
    assert_within(layers.relu_backward(da, h), f64(np.where(h > 0, da, 0)), 0, "dh (da where h > 0, else 0)", suspects)


# ---- softmax cross-entropy ----


def exact_softmax_xent(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """(mean cross-entropy, softmax) in float64, by PyTorch."""
    z = torch.tensor(logits, dtype=torch.float64)
    return F.cross_entropy(z, torch.as_tensor(y)).item(), torch.softmax(z, dim=1).numpy()


@pytest.mark.parametrize("B, n_out, scale", [(1, 10, 3.0), (13, 10, 3.0), (5, 3, 3.0), (13, 10, 1000.0)],
                         ids=["1", "13", "3-classes", "logits-of-2000"])
@pytest.mark.parametrize("task", task_params("softmax_xent_forward"))
def test_softmax_xent_forward(layers, B, n_out, scale):
    logits, y = normal(B, n_out, seed=7, scale=scale), np.arange(B) % n_out
    loss, probs = layers.softmax_xent_forward(logits, y)
    exact_loss, exact_probs = exact_softmax_xent(logits, y)
    assert np.isfinite(loss) and np.isfinite(probs).all(), OVERFLOW
    below_max = f64(logits).max(axis=1, keepdims=True) - logits
    # The loss: the lockstep rule of common/harness/verify.py (the rounding of a log-sum-exp and a logit, a few units each).
    summed = f" ({BY_B.format(factor=B)})" if B > 1 and abs(float(loss) - B * exact_loss) <= 1e-4 * B * exact_loss else ""
    assert abs(float(loss) - exact_loss) <= LOSS_RTOL * exact_loss + LOSS_ATOL, f"loss {loss}, exact {exact_loss}{summed}"
    # Each probability: rounding z - max moves exp() by |z - max| u relatively, and exp, the sum of n_out terms and
    # the division add a few u more (4u per unit: exp() is within 2 ulp, on a GPU too).
    assert_within(probs, exact_probs, 4 * U * (below_max + n_out + 4) * exact_probs, "probs")


@pytest.mark.parametrize("B", [1, 13])
@pytest.mark.parametrize("task", task_params("softmax_xent_backward"))
def test_softmax_xent_backward(layers, B):
    logits, y = normal(B, N_OUT, seed=8, scale=3.0), np.arange(B) % N_OUT
    probs = exact_softmax_xent(logits, y)[1].astype(np.float32)
    dlogits = layers.softmax_xent_backward(probs, y)
    exact = (f64(probs) - np.eye(N_OUT)[y]) / B
    # p - onehot and the division by B, each rounded once: 2u of the result.
    assert_within(dlogits, exact, 2 * U * np.abs(exact), "dlogits", {BY_B.format(factor=B): B * exact} if B > 1 else {})


# ---- SGD ----


@pytest.mark.parametrize("task", task_params("sgd_update"))
def test_sgd_update(layers):
    params = {name: normal(*shape, seed=9) for name, shape in param_shapes(37).items()}
    grads = {name: normal(*shape, seed=10) for name, shape in param_shapes(37).items()}
    before, lr = {k: v.copy() for k, v in params.items()}, np.float32(0.1)
    layers.sgd_update(params, grads, lr)
    for name in params:
        step = f64(lr) * grads[name]
        # lr * dp and the subtraction, each rounded once. A learning rate 0.2% off is 2e-4 here, 1,000x this bound.
        taken = f64(before[name]) - params[name]  # the step the update took, against lr * dp
        ratio = float(np.median(taken / np.where(step == 0, np.nan, step))) if (step != 0).any() else 1.0
        suspects = {f"each parameter moved {ratio:.4g} times lr * grad: is the learning rate changed, or the sign? "
                    "(level 1's chapter, section 3, 'Training')": f64(before[name]) - ratio * step} if ratio != 1 else {}
        assert_within(params[name], before[name] - step, 2 * U * (np.abs(f64(before[name])) + np.abs(step)), name,
                      suspects)


# ---- Adam ----

ADAM = "(torch.optim.Adam's documentation gives its algorithm)"
EPS_INSIDE = f"eps went inside the square root: it is added to sqrt(v) / sqrt(1 - beta2^step), after the root {ADAM}"
NO_BIAS_CORRECTION = ("no bias correction: m is divided by 1 - beta1^step and sqrt(v) by sqrt(1 - beta2^step), which "
                      f"matter most in the first steps {ADAM}")
NO_BIAS_CORRECTION1 = f"m's bias correction is missing: m is divided by 1 - beta1^step {ADAM}"
NO_BIAS_CORRECTION2 = f"v's bias correction is missing: sqrt(v) is divided by sqrt(1 - beta2^step) {ADAM}"
AS_IT_WAS = ("{what} is as it was: Adam updates it in place (x += ..., x[...] = ...), and the optimizer keeps the "
             "moments for the next step")
# Steps 1 and 2 (where the bias corrections are largest), 10 with other hyperparameters, and 1,000.
ADAM_STEPS = [(1, {}), (2, {}), (10, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6}), (1000, {})]
ADAM_IDS = ["step-1", "step-2", "step-10-other-hyperparameters", "step-1000"]


def adam_state(shapes: dict[str, tuple], step: int, seed: int) -> tuple[dict, dict, dict, dict]:
    """(params, grads, exp_avg, exp_avg_sq), float32, before step `step`: gradients of every scale from 1e-9 to 1
    (where eps decides the step, and where it counts for nothing), moments of their scale (zeros before step 1)."""
    rng = np.random.default_rng(seed)
    params, grads, m, v = {}, {}, {}, {}
    for name, shape in shapes.items():
        scale = 10.0 ** rng.uniform(-9, 0, shape)
        params[name] = rng.standard_normal(shape).astype(np.float32)
        grads[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
        m[name] = (0.3 * scale * rng.standard_normal(shape) * (step > 1)).astype(np.float32)
        v[name] = (scale**2 * rng.uniform(0.2, 2.0, shape) * (step > 1)).astype(np.float32)
    return params, grads, m, v


def adam_exact(p, g, m, v, step: int, lr: float, betas: tuple, eps: float, corrected=(True, True),
               eps_inside: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """torch.optim.Adam's step in float64 from float32 state: (p, m, v) after it; `corrected` and `eps_inside` make
    its classic bugs."""
    (b1, b2), g = betas, f64(g)
    m = b1 * f64(m) + (1 - b1) * g
    v = b2 * f64(v) + (1 - b2) * g * g
    bc1 = 1 - b1**step if corrected[0] else 1.0
    bc2 = 1 - b2**step if corrected[1] else 1.0
    denom = np.sqrt(v + eps) / np.sqrt(bc2) if eps_inside else np.sqrt(v) / np.sqrt(bc2) + eps
    return f64(p) - lr / bc1 * m / denom, m, v


def check_adam(layers, shapes: dict[str, tuple], step: int, hyper: dict, seed: int) -> None:
    """One call of adam_update from a float32 state, each parameter and moment against float64 from that state."""
    lr, betas, eps = hyper.get("lr", 1e-3), tuple(hyper.get("betas", (0.9, 0.999))), hyper.get("eps", 1e-8)
    params, grads, m, v = adam_state(shapes, step, seed)
    before = {name: (params[name].copy(), m[name].copy(), v[name].copy()) for name in params}
    layers.adam_update(params, grads, m, v, step, lr, betas, eps)
    (b1, b2), U10 = betas, 1024 * U
    for name, (p0, m0, v0) in before.items():
        g = f64(grads[name])
        p1, m1, v1 = adam_exact(p0, g, m0, v0, step, lr, betas, eps)
        # The moments: a few roundings of each term (4u); 1 - beta2 of a float32 beta2 is u off, u g^2 in v.
        m_bound = 4 * U * (np.abs(f64(m0)) + np.abs(g))
        v_bound = 4 * U * (f64(v0) + (1 - b2) * g * g) + 2 * U * g * g
        # The step lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps): m's absolute rounding, v's relative one halved by the
        # root, and 1024u of the step for its five roundings and its constants' (bias corrections computed in float32
        # are 64u off at step 1,000). Missing bias corrections move the step by 20% and more, eps inside the root by
        # orders of magnitude where g is small, a learning rate 0.1% off by 1,000x this.
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        root = np.sqrt(v1) / np.sqrt(bc2)
        denom = root + eps
        v_rel = np.divide(v_bound, 2 * v1, out=np.zeros_like(v1), where=v1 > 0)
        step_bound = lr / bc1 * (m_bound + np.abs(m1) * ((root * v_rel + U * eps) / denom + U10)) / denom
        p_bound = 2 * U * (np.abs(f64(p0)) + np.abs(f64(p0) - p1)) + step_bound
        suspects = {EPS_INSIDE: adam_exact(p0, g, m0, v0, step, lr, betas, eps, eps_inside=True)[0],
                    NO_BIAS_CORRECTION: adam_exact(p0, g, m0, v0, step, lr, betas, eps, (False, False))[0],
                    NO_BIAS_CORRECTION1: adam_exact(p0, g, m0, v0, step, lr, betas, eps, (False, True))[0],
                    NO_BIAS_CORRECTION2: adam_exact(p0, g, m0, v0, step, lr, betas, eps, (True, False))[0],
                    AS_IT_WAS.format(what=f"the parameter {name}"): f64(p0)}
        assert_within(params[name], p1, p_bound, name, suspects)
        assert_within(m[name], m1, m_bound, f"exp_avg {name}", {AS_IT_WAS.format(what=f"exp_avg {name}"): f64(m0)})
        assert_within(v[name], v1, v_bound, f"exp_avg_sq {name}",
                      {AS_IT_WAS.format(what=f"exp_avg_sq {name}"): f64(v0)})


@pytest.mark.parametrize("step, hyper", ADAM_STEPS, ids=ADAM_IDS)
@pytest.mark.parametrize("task", task_params("adam_update"))
def test_adam_update(layers, step, hyper):
    check_adam(layers, param_shapes(37), step, hyper, seed=60)


# ---- LeNet-5's convolution and max-pooling ----

FLIPPED = ("this is the convolution with the kernel flipped: PyTorch's Conv2d is a correlation, no flip "
           "(LeNet's chapter, section 2, 'The backward pass of a convolution and of a pool')")
DX_UNFLIPPED = ("dx is made with the kernel as it is: dx is a full correlation of dout with the flipped kernel "
                "(LeNet's chapter, section 2, 'The backward pass of a convolution and of a pool')")
EVERY_ELEMENT = ("the gradient went to every element of the window; it goes to the maximum alone "
                 "(LeNet's chapter, section 2, 'The backward pass of a convolution and of a pool')")
LAST_OF_EQUAL = ("a tie went to the last of equal maxima; PyTorch takes the first, in row-major order "
                 "(LeNet's chapter, section 2, 'The backward pass of a convolution and of a pool')")
SIZE_OFF = ("an output size off by one: a 5x5 filter fits in 28 - 5 + 1 = 24 positions (LeNet's chapter, section 1, "
            "'The network')")
# (images, channels, size, filters, kernel): MNIST digits as conv1 sees them, conv2's shape, odd ones, a 1x1 output.
CONVS = [(3, 1, 28, 6, 5), (2, 6, 12, 16, 5), (2, 3, 9, 4, 3), (1, 2, 5, 3, 5)]
CONV_IDS = ["mnist", "conv2", "odd", "1x1"]


def conv_inputs(n: int, c: int, h: int, f: int, k: int, images: np.ndarray):
    """x (n, c, h, h): MNIST digits for the first layer, else N(0, 1); w (f, c, k, k) and b (f,)."""
    x = images[:n].reshape(n, 1, 28, 28).copy() if (c, h) == (1, 28) else normal(n, c, h, h, seed=21)
    return x, normal(f, c, k, k, seed=22, scale=0.3), normal(f, seed=23)


def torch64(a) -> torch.Tensor:
    return torch.tensor(np.asarray(a), dtype=torch.float64)


@pytest.mark.parametrize("n, c, h, f, k", CONVS, ids=CONV_IDS)
@pytest.mark.parametrize("task", task_params("conv2d_forward"))
def test_conv2d_forward(layers, images, n, c, h, f, k):
    x, w, b = conv_inputs(n, c, h, f, k, images)
    out = layers.conv2d_forward(x, w, b)
    size = h - k + 1
    assert np.shape(out)[-1] == size, f"the output is {np.shape(out)[-1]} wide, not H - k + 1 = {size}: {SIZE_OFF}"
    exact = F.conv2d(torch64(x), torch64(w), torch64(b)).numpy()
    bound = gamma(c * k * k + 1) * (F.conv2d(torch64(np.abs(x)), torch64(np.abs(w))).numpy()
                                    + np.abs(f64(b))[:, None, None])
    suspects = {FLIPPED: F.conv2d(torch64(x), torch64(w).flip(-1, -2), torch64(b)).numpy() if k > 1 else None,
                NO_BIAS: F.conv2d(torch64(x), torch64(w)).numpy()}
    assert_within(out, exact, bound, "out", suspects)


# The tiled convolution's shapes (5x5 filters): conv1 on MNIST digits and conv2, as LeNet runs them; then an output
# of 9x9 (a tile of 8 and a cut one), 3 images and 5 filters (a group of each cut short), and a single output.
TILED = [(3, 1, 28, 6, 5), (2, 6, 12, 16, 5), (3, 2, 13, 5, 5), (1, 2, 5, 3, 5)]


@pytest.mark.parametrize("n, c, h, f, k", TILED, ids=["mnist", "conv2", "cut", "1x1"])
@pytest.mark.parametrize("task", task_params("conv2d_forward_tiled"))
def test_conv2d_forward_tiled(layers, images, n, c, h, f, k):
    """As test_conv2d_forward: a tile's halo one row short, or a read before the tile is in, is off by more than
    rounding somewhere; a write past the output is caught by the guard after it (tests/lab_level5.cu)."""
    x, w, b = conv_inputs(n, c, h, f, k, images)
    out = layers.conv2d_forward_tiled(x, w, b)
    exact = F.conv2d(torch64(x), torch64(w), torch64(b)).numpy()
    bound = gamma(c * k * k + 1) * (F.conv2d(torch64(np.abs(x)), torch64(np.abs(w))).numpy()
                                    + np.abs(f64(b))[:, None, None])
    assert_within(out, exact, bound, "out", {NO_BIAS: F.conv2d(torch64(x), torch64(w)).numpy()})


@pytest.mark.parametrize("n, c, h, f, k", CONVS, ids=CONV_IDS)
@pytest.mark.parametrize("task", task_params("conv2d_backward"))
def test_conv2d_backward(layers, images, n, c, h, f, k):
    x, w, _ = conv_inputs(n, c, h, f, k, images)
    size = h - k + 1
    dout = normal(n, f, size, size, seed=24)
    dx, dw, db = layers.conv2d_backward(dout, x, w)
    tx, tw = torch64(x).requires_grad_(), torch64(w).requires_grad_()
    F.conv2d(tx, tw).backward(torch64(dout))
    ax, aw, ad = (torch64(np.abs(v)) for v in (x, w, dout))
    # Each dw entry sums n * size^2 products; each dx entry at most f * k^2; db sums n * size^2 terms.
    dw_bound = gamma(n * size * size) * torch.nn.grad.conv2d_weight(ax, w.shape, ad).numpy()
    dx_bound = gamma(f * k * k) * torch.nn.grad.conv2d_input(x.shape, aw, ad).numpy()
    unflipped = torch.nn.grad.conv2d_input(x.shape, torch64(w).flip(-1, -2), torch64(dout)).numpy() if k > 1 else None
    assert_within(dw, tw.grad.numpy(), dw_bound, "dw")
    assert_within(dx, tx.grad.numpy(), dx_bound, "dx", {DX_UNFLIPPED: unflipped})
    assert_within(db, f64(dout).sum(axis=(0, 2, 3)), gamma(n * size * size) * np.abs(f64(dout)).sum(axis=(0, 2, 3)),
                  "db", {WRONG_AXIS: f64(dout).sum(axis=(1, 2, 3)) if n == f else None})
    _, dw_alone, _ = layers.conv2d_backward(dout, x, w, need_dx=False)  # the first layer: no dx, the same dw
    np.testing.assert_array_equal(dw_alone, dw, err_msg="dw without dx differs from dw with it")


def pool_input(n: int = 2, c: int = 3, h: int = 8) -> np.ndarray:
    """a (n, c, h, h) whose windows hold ties: in a third of them the maximum appears twice, as ReLU outputs of
    uniform image regions do; and some windows all zero."""
    a = np.abs(normal(n, c, h, h, seed=31))
    rng = np.random.default_rng(32)
    for i in range(n):
        for j in range(c):
            for py in range(0, h, 2):
                for px in range(0, h, 2):
                    window = a[i, j, py : py + 2, px : px + 2]
                    if rng.random() < 0.33:
                        first, second = rng.choice(4, 2, replace=False)
                        window.flat[max(first, second)] = window.max() + 1  # a tie: the later one is placed second
                        window.flat[min(first, second)] = window.flat[max(first, second)]
                    elif rng.random() < 0.1:
                        window[:] = 0
    return a


def pool_exact(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(out, choice) of 2x2 max-pooling by PyTorch: the first of equal maxima, row-major in the window."""
    out, index = F.max_pool2d(torch64(a), 2, return_indices=True)
    h = a.shape[-1]
    rows, cols = index.numpy() // h, index.numpy() % h
    return out.numpy(), ((rows % 2) * 2 + cols % 2).astype(np.int32)


@pytest.mark.parametrize("task", task_params("maxpool_forward"))
def test_maxpool_forward(layers):
    a = pool_input()
    out, choice = layers.maxpool_forward(a)
    exact, exact_choice = pool_exact(a)
    assert_within(out, exact, 0, "out")  # a maximum is exact
    last = pool_exact(a[..., ::-1, ::-1].copy())[1][..., ::-1, ::-1]  # the last of equal maxima instead
    choice = np.asarray(choice)
    assert choice.shape == exact_choice.shape, f"choice has shape {choice.shape}, not {exact_choice.shape}"
    if not np.array_equal(choice, exact_choice):
        hint = f"{LAST_OF_EQUAL}. " if np.array_equal(choice, 3 - last) else ""
        i = tuple(int(j) for j in np.argwhere(choice != exact_choice)[0])
        raise AssertionError(f"{hint}choice{list(i)} = {choice[i]}, PyTorch's {exact_choice[i]} "
                             f"(window {a[i[0], i[1], 2 * i[2]:2 * i[2] + 2, 2 * i[3]:2 * i[3] + 2].ravel()})")


@pytest.mark.parametrize("task", task_params("maxpool_backward"))
def test_maxpool_backward(layers):
    a = pool_input()
    _, choice = pool_exact(a)
    dout = normal(*choice.shape, seed=33)
    ta = torch64(a).requires_grad_()
    F.max_pool2d(ta, 2).backward(torch64(dout))
    every = np.repeat(np.repeat(f64(dout), 2, axis=-1), 2, axis=-2)
    assert_within(layers.maxpool_backward(dout, choice), ta.grad.numpy(), 0, "da", {EVERY_ELEMENT: every})


# ---- level 4's memory, under AddressSanitizer ----


@pytest.mark.level4
@pytest.mark.parametrize("part", [pytest.param("batch", marks=pytest.mark.task("4.8"), id="4.8"),
                                  pytest.param("model", marks=pytest.mark.task("4.9"), id="4.9")])
def test_memory_under_address_sanitizer(part):
    if sandbox.submission():  # the program is the submission's: it runs in a sandbox, its verdict on a pipe of its own
        passed, output = sandbox.memory_check(part)
    else:
        program = ROOT / "build" / "lab_memory"
        if not program.exists():
            pytest.skip("build/lab_memory is not built: run `make build/lab_memory` (make grade does)")
        run = subprocess.run([str(program), part], capture_output=True, text=True, timeout=120)
        passed, output = run.returncode == 0, run.stdout + run.stderr
    report = [line for line in output.splitlines() if "ERROR" in line or "SUMMARY" in line]
    assert passed, "\n".join(report[:2] or output.splitlines()[:3])


# ---- level 6: the three products through cuBLAS's column-major rules ----

B6, N_IN6, N_OUT6 = 3, 5, 4  # all different: a square matrix would hide a transpose
PRODUCTS = {  # task -> (the output's name, its row-major value from the operands)
    "out = x @ w^T": ("out", lambda a: a["x"] @ a["w"].T),
    "dw = dout^T @ x": ("dw", lambda a: a["dout"].T @ a["x"]),
    "dx = dout @ w": ("dx", lambda a: a["dout"] @ a["w"]),
}


def sgemm_call(region: str) -> list[str]:
    """The arguments of the one cublasSgemm call in a region's code, as written."""
    calls = [m.end() for m in re.finditer(r"\bcublasSgemm\s*\(", region)]
    assert len(calls) == 1, f"expected one cublasSgemm call, found {len(calls)}: the layout check reads exactly one"
    args, depth, current = [], 0, ""
    for ch in region[calls[0]:]:
        if ch == "," and depth == 0:
            args.append(current.strip())
            current = ""
            continue
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            return args + [current.strip()]
        current += ch
    raise AssertionError("the cublasSgemm call is not closed")


@pytest.mark.parametrize("task", task_params("out = x @ w^T") + task_params("dw = dout^T @ x")
                         + task_params("dx = dout @ w"))
def test_cublas_layout(task):
    """The call as written, its sizes, leading dimensions and operands read from the source, run through
    common/classroom/sgemm.py on flat row-major arrays: it must give the row-major product, whatever the output held before."""
    region = next(r for r in lab.regions(task.path, sandbox.submission() or ROOT) if r.task == task.id)
    args = sgemm_call(region.body)
    assert len(args) == 14, f"cublasSgemm takes 14 arguments, the call has {len(args)}"
    arrays = {"x": normal(B6, N_IN6), "w": normal(N_OUT6, N_IN6, seed=1), "dout": normal(B6, N_OUT6, seed=2)}
    output, product = PRODUCTS[task.name]
    exact = product({k: f64(v) for k, v in arrays.items()})
    bound = gamma(max(B6, N_IN6, N_OUT6)) * product({k: np.abs(f64(v)) for k, v in arrays.items()})
    arrays[output] = np.full(exact.size, 7.0, np.float32)  # what an earlier step left there: beta must be 0
    names = {"B": B6, "n_in": N_IN6, "n_out": N_OUT6, "one": 1.0, "zero": 0.0, "CUBLAS_OP_N": "N", "CUBLAS_OP_T": "T",
             **{k: v.ravel() for k, v in arrays.items()}}
    sgemm(*(evaluate(a, names) for a in args[1:]))  # args[0] is the handle
    # cuBLAS wrote the column-major (m, n) = product^T: read row-major, the same floats are the product itself.
    assert_within(arrays[output].reshape(exact.shape), exact, bound, f"{output} (row-major)")


def evaluate(expression: str, names: dict):
    """An argument as written (`n_in`, `&one`, `CUBLAS_OP_T`, `x`), with the test's sizes and arrays."""
    try:
        return eval(expression.removeprefix("&"), {"__builtins__": {}}, names)  # the names above, + - * only
    except Exception as e:
        raise AssertionError(f"cannot read the argument {expression!r} (sizes B, n_in, n_out; arrays x, w, dout, "
                             f"out, dw, dx; &one, &zero): {e}") from None


# ---- level 7: the grid barrier and the ownership of the weights ----


# A thousand rounds of a working barrier take milliseconds. One that never opens keeps its kernel spinning, and
# nothing but the end of its process stops a running kernel: so the rounds run in a process of their own (a child
# here; in a teacher's grade, the submission's worker), ended after this.
BARRIER_DEADLINE_S = 30
BARRIER_CHILD = """
from common.classroom.lab_native import grid_barrier
print(*grid_barrier(1024, 1000))
"""


@pytest.mark.parametrize("task", task_params("grid_barrier"))
def test_grid_barrier(task, request):
    library(7, request.config)  # skips where level 7 cannot run
    if sandbox.submission():
        rounds = sandbox.remote_function("common.classroom.lab_native", "grid_barrier", gpu=True, timeout=BARRIER_DEADLINE_S)
        try:
            status, late, launched, message = rounds(1024, 1000)
        except sandbox.WorkerError as e:
            pytest.fail(f"the barrier's process failed: {e}")
    else:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        try:
            run = subprocess.run([sys.executable, "-c", BARRIER_CHILD], cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=BARRIER_DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the barrier never opened: 1,000 rounds still ran after {BARRIER_DEADLINE_S} s (a block that "
                        f"waits for a generation that never comes?); the process running them was ended")
        assert run.returncode == 0, f"the barrier's process failed: {run.stderr.strip().splitlines()[-1:]}"
        status, late, launched, message = (run.stdout.strip().split(maxsplit=3) + [""])[:4]
    assert int(status) == 0, message
    assert int(late) == 0, f"{late} reads of {launched} blocks' slots came before the block reached the barrier"


@pytest.mark.parametrize("hidden, units", [(256, 8), (37, 8), (1, 1), (1024, 8), (100, 16), (4000, 16)])
@pytest.mark.parametrize("task", task_params("owned_units"))
def test_owned_units(task, request, hidden, units):
    library(7, request.config)
    j0, owned = native("owned_units", hidden, units, gpu=True)
    assert (owned >= 0).all() and (owned <= units).all(), f"a block owns {owned.min()}..{owned.max()} units"
    units_seen = np.concatenate([np.arange(j, j + n) for j, n in zip(j0, owned)])
    np.testing.assert_array_equal(np.sort(units_seen), np.arange(hidden), err_msg="every unit needs exactly one owner")


# ---- the chain rule automated: level 2's scalar engine, level 8's framework ----

CHAIN_RULE = "(level 2's chapter, section 7, 'The chain rule, automated')"
SORT_RECURSION = ("a recursive sort stops at Python's limit of 1,000 nested calls, and this graph is far deeper: keep "
                  f"the nodes still to visit on a stack of your own {CHAIN_RULE}")
LISTED_TWICE = ("a node reached along two paths is listed twice: list each node once, and remember which ones are "
                f"visited {CHAIN_RULE}")
BEFORE_PARENT = ("a node comes before a node it was computed from: a node goes in the order only after all its "
                 f"parents {CHAIN_RULE}")
OVERWRITTEN = ("a gradient overwritten instead of accumulated: a node used by several operations receives the sum of "
               f"what each of them sends it, += and not = {CHAIN_RULE}")
NOTHING_REACHED = ("no gradient reached the inputs: the walk starts at the output, whose gradient is 1, and visits the "
                   f"nodes in reverse topological order {CHAIN_RULE}")
NOT_ZEROED = ("a second backward() added to the first one's gradients: set every grad of the graph to 0 first "
              f"{CHAIN_RULE}")
EXP_OVERFLOW = ("exp() overflowed on finite logits: subtract the row's max first (level 2's chapter, section 4, "
                "'Softmax without subtracting the max')")
MAX_NOT_ADDED_BACK = ("off by the row's max: exp(z - m) takes m out of the sum, and log_sum_exp must add it back "
                      "(level 2's chapter, section 4, 'Softmax without subtracting the max')")
# Level 8's engine keeps PyTorch's rules (tensor.py's Tensor.backward).
GRAD_REPLACED = ("a second backward() replaced .grad instead of adding to it: as in PyTorch, .grad accumulates until "
                 "the optimizer's zero_grad()")
NOT_FREED = ("a second backward() through a graph already walked did not raise: without retain_graph, backward() "
             "frees each node it passes (its inputs and backward), and a node found freed raises RuntimeError(FREED)")
NOT_REQUIRING = "a tensor that requires no grad is in the order: no gradient goes to it, and it is left out"
# The engines compute in float64 (Python floats; level 8's tensors of these checks hold float64), so they differ from
# PyTorch's float64 autograd in the order of their sums only: at most 4e-16 of 1 + |gradient| measured over these
# graphs at 20 seeds. ENGINE_TOL leaves room; every classic bug is off by O(1) (a lost contribution, twice a gradient).
ENGINE_TOL = 1e-10
# The graphs' leaves: three scalars (level 2), or three vectors of three (level 8), and the probe's x and y.
LEAVES = [0.7, -1.3, 0.4]
TENSOR_LEAVES = np.array([[0.7, -0.2, 1.1], [-1.3, 0.5, 0.9], [0.4, -0.8, 0.3]])
PROBE = [0.5, 3.0]


def engine(function: str, *args, hints: dict[str, str] | None = None):
    """common.classroom.lab_autograd's function, run here, or in a teacher's grade by the submission's sandboxed worker
    (a Value or a Tensor cannot reach it, numbers can). An exception of the code under grade fails the check, with the
    hint of the first name in `hints` (an exception's) that it shows."""
    try:
        if sandbox.submission():
            return sandbox.remote_function("common.classroom.lab_autograd", function)(*args)
        return getattr(lab_autograd, function)(*args)
    except Exception as e:  # noqa: BLE001 - the code under grade raised (in the worker: a WorkerError says what)
        text = str(e) if isinstance(e, sandbox.WorkerError) else f"{type(e).__name__}: {e}"
        hint = next((h for name, h in (hints or {}).items() if name in text), None)
        raise AssertionError(f"{hint}. {text[:300]}" if hint else text[:300]) from None


def exact_gradients(expression: str, leaves, length: int = 0) -> list[np.ndarray]:
    """For each output, the named nodes' d(output)/d(node) by PyTorch's autograd in float64, (named,) or (named, n)
    for leaves of n values (the output summed); NaN for a node the output was not computed from."""
    tensors = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in leaves]
    outputs, named = lab_autograd.EXPRESSIONS[expression](tensors, length)
    shape = np.shape(leaves[0])
    return [np.array([g.numpy() if g is not None else np.full(shape, np.nan) for g in
                      torch.autograd.grad(output.sum(), named, allow_unused=True, retain_graph=True)])
            for output in outputs]


def assert_gradients(got, exact: np.ndarray, what: str, suspects: dict | None = None) -> None:
    """The engine's gradients (float64) within ENGINE_TOL (1 + |exact|) of PyTorch's, where exact is not NaN (a node
    the output was not computed from)."""
    got, keep = np.asarray(got, dtype=np.float64), ~np.isnan(exact)
    assert got.shape == exact.shape, f"{what}: {got.shape} gradients, not {exact.shape}"
    if np.all((got[keep] == 0) | np.isnan(got[keep])) and np.any(exact[keep] != 0):
        raise AssertionError(f"{NOTHING_REACHED}. {what}: none of {exact[keep].size} gradients came back")
    bound = ENGINE_TOL * (1 + np.abs(np.where(keep, exact, 0)))
    suspects = {h: np.where(keep, value, 0) for h, value in (suspects or {}).items()}
    assert_within(np.where(keep, got, 0), np.where(keep, exact, 0), bound, what, suspects, dtype=np.float64)


def overwritten(got, exact: np.ndarray, contributions: list) -> dict:
    """The suspect of a gradient overwritten instead of accumulated, in a probe whose first node's gradient is the sum
    of `contributions`: the part of that sum (some of them, not all) nearest to what the engine gave."""
    if np.shape(got) != exact.shape:
        return {}
    parts = [sum(c) for n in range(1, len(contributions)) for c in itertools.combinations(contributions, n)]
    nearest = min(parts, key=lambda part: np.nanmax(np.abs(np.asarray(got)[0] - part)))
    return {OVERWRITTEN: np.concatenate([np.asarray(nearest, dtype=np.float64)[None], exact[1:]])}


def assert_ran(errors: list[str], hints: dict[str, str] | None = None) -> None:
    """Every backward() of a tensor_gradients run returned; else the first one's exception, with the hint of the first
    name in `hints` that it shows."""
    if failed := next((e for e in errors if e), None):
        hint = next((h for name, h in (hints or {}).items() if name in failed), None)
        raise AssertionError(f"{hint}. {failed}" if hint else failed)


def assert_topological(order, edges, listed, root, what: str) -> None:
    """order (indices of nodes) holds each listed node that root was computed from, and root, exactly once and
    nothing else, each after its parents, root last; edges are the graph's (parent, child) pairs."""
    order, edges, listed = np.asarray(order), np.asarray(edges).reshape(-1, 2), np.asarray(listed, dtype=bool)
    assert (order >= 0).all(), f"the order holds {int((order < 0).sum())} entries that are no {what} of the graph"
    counts = np.bincount(order, minlength=len(listed))
    if (counts > 1).any():
        k = int(counts.argmax())
        raise AssertionError(f"{LISTED_TWICE}. {what} {k} is listed {counts[k]} times ({int((counts > 1).sum())} "
                             "listed more than once)")
    parents: dict[int, list[int]] = {}
    for p, c in edges:
        if listed[p]:
            parents.setdefault(int(c), []).append(int(p))
    expected, todo = {int(root)}, [int(root)]
    while todo:
        for p in parents.get(todo.pop(), ()):
            if p not in expected:
                expected.add(p)
                todo.append(p)
    if extra := set(order.tolist()) - expected:
        k = min(extra)
        raise AssertionError(f"{NOT_REQUIRING}. {what} {k} is listed" if not listed[k] else
                             f"{what} {k} is listed, but the output was not computed from it")
    assert not (missing := expected - set(order.tolist())), \
        f"{len(missing)} of the graph's {len(expected)} {what}s are missing from the order"
    position = np.empty(len(listed), dtype=np.int64)
    position[order] = np.arange(len(order))
    inside = listed[edges[:, 0]] & np.isin(edges[:, 1], order)
    late = edges[inside][position[edges[inside][:, 0]] > position[edges[inside][:, 1]]]
    if len(late):
        raise AssertionError(f"{BEFORE_PARENT}. {what} {late[0][1]} is at {position[late[0][1]]}, its parent "
                             f"{late[0][0]} at {position[late[0][0]]}")
    assert order[-1] == root, f"the output is at {int(position[root])} of {len(order)}, not last"


SORTS = [("fan_out", 0), ("used_thrice", 0), ("chain", 50_000)]
SORT_IDS = ["fan-out", "used-thrice", "chain-50000"]


def scalar_leaves(expression: str) -> list[float]:
    """The leaves the visible checks give an expression: the probe's x and y, a chain's 1, or LEAVES."""
    return {"used_thrice": PROBE, "chain": [1.0]}.get(expression, LEAVES)


def tensor_leaves(expression: str) -> np.ndarray:
    """As scalar_leaves, for level 8: vectors of three values (a chain's of one)."""
    return {"used_thrice": TENSOR_LEAVES[:2], "chain": np.ones((1, 1))}.get(expression, TENSOR_LEAVES)


def check_scalar_order(expression: str, leaves: list[float], length: int = 0) -> None:
    """level 2's topological_order of the expression's first output, checked against the graph's edges."""
    found = engine("scalar_order", expression, leaves, length, hints={"RecursionError": SORT_RECURSION})
    assert_topological(*found, "node")


def check_scalar_gradients(expression: str, leaves: list[float], length: int = 0) -> None:
    """backward() of the first output, again (the same gradients, not twice them), then of the second if there is one:
    the nodes it was computed from hold its gradients, not the sum of both."""
    exact = exact_gradients(expression, leaves, length)
    runs = [0, 0, 1][: len(exact) + 1]
    got = engine("scalar_gradients", expression, leaves, runs, length, hints={"RecursionError": SORT_RECURSION})
    assert_gradients(got[0], exact[0], "the grads")
    # The first call was right: what differs after it can only come from what it left in the graph.
    assert_gradients(got[1], exact[0], "the grads after a second backward()", {NOT_ZEROED: got[1]})
    if len(exact) > 1:
        assert_gradients(got[2], exact[1], "the grads after backward() of the second output", {NOT_ZEROED: got[2]})


@pytest.mark.level2
@pytest.mark.task("2.6")
@pytest.mark.parametrize("expression, length", SORTS, ids=SORT_IDS)
def test_scalar_topological_order(expression, length):
    check_scalar_order(expression, scalar_leaves(expression), length)


@pytest.mark.level2
@pytest.mark.task("2.7")
def test_scalar_backward_adds_every_contribution():
    """2x + exp(x) + x y: x's gradient is the sum of three contributions (the first check, so its hint shows)."""
    got = engine("scalar_gradients", "used_thrice", PROBE, [0])[0]
    (exact,) = exact_gradients("used_thrice", PROBE)
    x, y = PROBE
    assert_gradients(got, exact, "the grads of (x, y)", overwritten(got, exact, [2.0, np.exp(x), y]))


@pytest.mark.level2
@pytest.mark.task("2.7")
@pytest.mark.parametrize("expression, length", [("fan_out", 0), ("chain", 10_000)], ids=["fan-out", "chain-10000"])
def test_scalar_backward(expression, length):
    """The fan-out's six nodes (x, y, z, c, d, e), its two outputs; a chain 40,001 nodes deep."""
    check_scalar_gradients(expression, scalar_leaves(expression), length)


@pytest.mark.level2
@pytest.mark.task("2.8")
@pytest.mark.parametrize("B, C, scale", [(1, 10, 3.0), (4, 3, 3.0), (3, 10, 1000.0)],
                         ids=["1x10", "4x3", "logits-of-2000"])
def test_scalar_log_softmax_nll(B, C, scale):
    check_log_softmax_nll(f64(normal(B, C, seed=51, scale=scale)), np.arange(B) % C)


def check_log_softmax_nll(logits: np.ndarray, y: np.ndarray) -> None:
    """log_sum_exp of each row, the row's loss log_sum_exp(z) - z[y] and its gradient, against PyTorch's float64.
    Tolerance: float64 rounds z - max z to within 1e-16 |z|, which moves the loss and each probability by no more;
    ENGINE_TOL (1 + max |z|) leaves room."""
    lse, loss, grads = engine("scalar_log_softmax_nll", logits, y, hints={"OverflowError": EXP_OVERFLOW})
    z = torch.tensor(logits, requires_grad=True)
    exact_loss = F.cross_entropy(z, torch.as_tensor(y), reduction="none")
    exact_loss.sum().backward()
    exact_lse, largest = torch.logsumexp(z, 1).detach().numpy(), logits.max(axis=1)
    bound = ENGINE_TOL * (1 + np.abs(logits).max(axis=1))
    assert_within(lse, exact_lse, bound, "log_sum_exp", {MAX_NOT_ADDED_BACK: exact_lse - largest}, dtype=np.float64)
    assert_within(loss, exact_loss.detach().numpy(), bound, "the row's loss", dtype=np.float64)
    assert_within(grads, z.grad.numpy(), bound[:, None], "d loss / d z (softmax - onehot)", dtype=np.float64)


def check_tensor_order(expression: str, leaves: np.ndarray, requires: list[bool], length: int = 0) -> None:
    """level 8's topological_order of the expression's first output, leaves requiring grad as `requires` says."""
    found = engine("tensor_order", expression, leaves, requires, length, hints={"RecursionError": SORT_RECURSION})
    assert_topological(*found, "tensor")


def check_tensor_gradients(expression: str, leaves: np.ndarray, length: int = 0) -> None:
    """With retain_graph, backward() of the first output, then of the second (or the first again): each leaf's .grad,
    and that of every named tensor, which retains its grad, is the sum of both. Without it, a second backward()
    raises."""
    exact = exact_gradients(expression, leaves, length)
    got, errors = engine("tensor_gradients", expression, leaves, [0, len(exact) - 1], True, length)
    assert_ran(errors, {"RecursionError": SORT_RECURSION})
    assert_gradients(got[0], exact[0], ".grad")
    second = exact[-1]
    assert_gradients(got[1], exact[0] + np.nan_to_num(second), ".grad after a second backward()",
                     {GRAD_REPLACED: np.where(np.isnan(second), exact[0], second)})
    _, errors = engine("tensor_gradients", expression, leaves, [0, 0], False, length)
    assert_ran(errors[:1])
    assert errors[1].startswith("RuntimeError"), f"{NOT_FREED}. The second call {errors[1] or 'returned'}"


@pytest.mark.level8
@pytest.mark.task("8.1")
@pytest.mark.parametrize("expression, length", SORTS, ids=SORT_IDS)
def test_tensor_topological_order(expression, length):
    """As level 2's, over tensors; in fan-out z requires no grad, and neither do the tensors made from it alone."""
    leaves = tensor_leaves(expression)
    check_tensor_order(expression, leaves, [True, True, False] if expression == "fan_out" else [True] * len(leaves),
                       length)


@pytest.mark.level8
@pytest.mark.task("8.1")
def test_tensor_backward_adds_every_contribution():
    leaves = tensor_leaves("used_thrice")
    got, errors = engine("tensor_gradients", "used_thrice", leaves, [0], False)
    assert_ran(errors)
    (exact,) = exact_gradients("used_thrice", leaves)
    x, y = leaves
    contributions = [np.full_like(x, 2.0), np.exp(x), y]
    assert_gradients(got[0], exact, ".grad of (x, y)", overwritten(got[0], exact, contributions))


@pytest.mark.level8
@pytest.mark.task("8.1")
@pytest.mark.parametrize("expression, length", [("fan_out", 0), ("chain", 10_000)], ids=["fan-out", "chain-10000"])
def test_tensor_backward(expression, length):
    """The fan-out's six tensors and its two outputs; a chain 20,001 tensors deep."""
    check_tensor_gradients(expression, tensor_leaves(expression), length)


MATMUL_UNTRANSPOSED = ("a transpose is missing: da pairs g with b transposed, db a transposed with g (level 2's "
                       "chapter, section 4, 'Transposes and shapes')")
NOT_IN_ITS_LAYOUT = ("the gradient of a transposed view (w.T) is not laid out as the view: compute it as the gradient "
                     "of the array underneath, then view it with .T, as level 3 computes dw")
# (M, K, N) of a (M, K) @ b (K, N): one of everything, all different, square, and MNIST rows times a layer's weights.
MATMULS = [(1, 1, 1), (13, 37, 5), (5, 5, 5), (8, N_IN, 37)]
LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]


@pytest.mark.level8
@pytest.mark.task("8.2")
@pytest.mark.parametrize("a_view, b_view", LAYOUTS, ids=["a@b", "a@bT", "aT@b", "aT@bT"])
@pytest.mark.parametrize("M, K, N", MATMULS, ids=SIZE_IDS)
def test_matmul_backward(images, M, K, N, a_view, b_view):
    check_matmul_backward(inputs(M, K, images), normal(K, N, seed=71, scale=0.1), normal(M, N, seed=72), a_view,
                          b_view)


def check_matmul_backward(a: np.ndarray, b: np.ndarray, g: np.ndarray, a_view: bool, b_view: bool) -> None:
    """da and db against float64, each operand passed as it lies or as a transposed view; each gradient in its
    operand's layout; no db where it is not needed."""
    da, db, layouts = engine("matmul_backward", g, a, b, True, True, a_view, b_view)
    (M, K), N = a.shape, b.shape[1]
    a64, b64, g64 = f64(a), f64(b), f64(g)
    exact_da, exact_db = g64 @ b64.T, a64.T @ g64
    square = M == K == N
    assert_within(da, exact_da, gamma(N) * np.abs(g64) @ np.abs(b64).T, "da",
                  {TRANSPOSED: exact_da.T if square else None, MATMUL_UNTRANSPOSED: g64 @ b64 if N == K else None})
    assert_within(db, exact_db, gamma(M) * np.abs(a64).T @ np.abs(g64), "db",
                  {TRANSPOSED: exact_db.T if square else None, MATMUL_UNTRANSPOSED: a64 @ g64 if M == K else None})
    for name, layout, view in (("da", layouts[0], a_view), ("db", layouts[1], b_view)):
        assert layout is None or layout == view, f"{NOT_IN_ITS_LAYOUT}: {name}" if view else \
            f"{name} is laid out as a transposed view, its operand is not: give it the operand's layout"
    da_alone, db_none, _ = engine("matmul_backward", g, a, b, True, False, a_view, b_view)
    assert db_none is None, "db was not asked for (need_b False), and must be None"
    np.testing.assert_array_equal(da_alone, da, err_msg="da without db differs from da with it")


NOT_SUMMED = ("the broadcast axes are not summed: an input stretched along an axis was used once per position there, "
              "and its gradient adds them all (level 2's chapter, section 3, 'Linear')")
SIZE_ONE_NOT_SUMMED = ("summed over the leading axes only: an axis of size 1 in the input, stretched by the broadcast, "
                       "is summed too, and stays of size 1 (level 2's chapter, section 3, 'Linear')")
MEAN_NOT_SUM = "the mean over the broadcast axes, not the sum: each position's gradient counts in full"
# (g's shape, the input's): a layer's bias, a row and a column kept as 2-D, a channel's bias of a convolution,
# trailing axes, a single value, sizes of 1 on both sides, and no broadcast at all.
BROADCASTS = [((13, 37), (37,)), ((13, 37), (1, 37)), ((13, 37), (13, 1)), ((2, 3, 5, 4), (3, 1, 1)),
              ((2, 3, 5, 4), (5, 4)), ((3, 4), ()), ((1, 1), (1,)), ((4, 5), (4, 5))]


@pytest.mark.level8
@pytest.mark.task("8.3")
@pytest.mark.parametrize("g_shape, shape", BROADCASTS, ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_broadcast_backward(g_shape, shape):
    check_sum_to(normal(*g_shape, seed=81), shape)


def check_sum_to(g: np.ndarray, shape: tuple[int, ...]) -> None:
    """sum_to(g, shape) against g summed in float64 over the axes a broadcast of `shape` to g's shape adds or
    stretches: within gamma_n of the sum of the |terms|, n the number of terms."""
    got = engine("sum_to", g, shape)
    lead = g.ndim - len(shape)
    stretched = tuple(lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1)
    axes, g64 = tuple(range(lead)) + stretched, f64(g)
    count = int(np.prod([g.shape[a] for a in axes]))
    exact = g64.sum(axis=axes).reshape(shape)
    first = g64[tuple(0 if a in axes else slice(None) for a in range(g.ndim))].reshape(shape)
    unchanged = np.shape(got) == g.shape != shape  # g given back as it is
    suspects = {NOT_SUMMED: g64 if unchanged else first if count > 1 else None,
                SIZE_ONE_NOT_SUMMED: g64.sum(axis=tuple(range(lead))) if stretched else None,
                MEAN_NOT_SUM: exact / count if count > 1 else None}
    assert_within(got, exact, gamma(count) * np.abs(g64).sum(axis=axes).reshape(shape), "the input's gradient",
                  suspects)


# ---- the chapters' exercises ----


@pytest.mark.level2
@pytest.mark.task("2.5")
def test_tanh_backward():
    from level2_theory import backprop as bp

    h, da = np.random.default_rng(8).standard_normal((13, 37)), np.random.default_rng(9).standard_normal((13, 37))
    mine = bp.tanh_backward(da, np.tanh(h))
    th = torch.tensor(h, requires_grad=True)
    torch.tanh(th).backward(torch.tensor(da))
    # test_level2.py's tolerances: 1e-6 against central differences, 1e-12 against autograd (both float64).
    assert bp.rel_error(mine, bp.numerical_gradient(lambda v: np.sum(np.tanh(v) * da), h)) < 1e-6
    assert bp.rel_error(mine, th.grad.numpy()) < 1e-12


@pytest.mark.level3
@pytest.mark.task("3.9")
def test_sgd_momentum_update():
    from level3_numpy.mlp import sgd_momentum_update

    params = {name: normal(*shape, seed=11) for name, shape in param_shapes(37).items()}
    exact = {k: f64(v) for k, v in params.items()}
    velocity = {k: np.zeros_like(v) for k, v in params.items()}
    exact_velocity = {k: np.zeros_like(v) for k, v in exact.items()}
    lr, steps, largest = np.float32(0.1), 20, {}
    for step in range(steps):
        grads = {name: normal(*shape, seed=12 + step) for name, shape in param_shapes(37).items()}
        sgd_momentum_update(params, grads, velocity, lr)
        for k in exact:  # torch.optim.SGD(momentum=0.9)'s rule, in float64
            exact_velocity[k] = 0.9 * exact_velocity[k] + grads[k]
            exact[k] -= f64(lr) * exact_velocity[k]
        largest = {k: np.maximum(largest.get(k, 0), np.abs(v)) for k, v in exact_velocity.items()}
    for k in exact:
        # Each step rounds v twice (2u |v|) and p twice (2u (|p| + lr |v|)); an error in v reaches p through lr at every
        # later step. Over the steps: steps 2u (|p| + lr V) + lr steps^2 2u V, with V the largest |v|.
        V = f64(largest[k])
        bound = steps * 2 * U * (np.abs(exact[k]) + f64(lr) * V) + f64(lr) * steps**2 * 2 * U * V
        assert_within(params[k], exact[k], bound, k)

