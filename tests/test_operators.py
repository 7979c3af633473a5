"""Level 8's operators the way PyTorch's own tests check theirs: every operator against torch.autograd (its value and
every input's gradient), on random shapes that broadcast, in both operand orders and with a number on either side;
views, reductions and losses; graphs of every shape (chains, diamonds, an interior tensor reused, a leaf used twice);
no_grad nested; the optimizers over parameters that got no gradient and a learning rate changed between epochs. Each
on both backends (the GPU's skip where there is none; its Python side runs over a stand-in of the library anywhere).

The rule is common/harness/verify.py's for one layer, PyTorch's for float32 against float64: the same expression in
torch, on the same float32 values, in float32 and in float64 (the exact yardstick). Per tensor, ours may be at most
YARDSTICK (2) times as far from float64 as torch's float32 is, plus (2 + FLOOR) u of its size (u = 2^-24): float32's
own rounding, and the few ulps by which two correct kernels part where torch's error is 0 by luck. Measured on the CPU
and the stand-in: no check here uses more than 0.48 of its allowance (a sum of 60 values). A wrong local derivative, a
gradient not summed over a broadcast axis or a transposed index is off by O(1) of the tensor's size: each such bug,
planted, fails a test here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from common.harness.verify import FLOOR, YARDSTICK, U
from strided_stand_in import device  # noqa: F401 (a fixture: cpu, cuda, cuda over a stand-in)

pytestmark = pytest.mark.level8


@pytest.fixture
def fw():
    import level8_framework

    return level8_framework


def values(shape: tuple[int, ...], seed: int, positive: bool = False, away: bool = False) -> np.ndarray:
    """float32 normal values; |x| + 0.5 where positive (log, x ** 0.5), sign(x) (|x| + 0.5) where away from 0 (a
    divisor)."""
    x = np.random.default_rng([*shape, seed]).standard_normal(shape).astype(np.float32)
    if positive:
        return np.abs(x) + np.float32(0.5)
    return np.sign(x) * (np.abs(x) + np.float32(0.5)) if away else x


def assert_as_close_as_pytorch(ours, torch32, exact, what: str) -> None:
    """||ours - exact|| <= YARDSTICK ||torch32 - exact|| + (2 + FLOOR) u ||exact||, the norms over the tensor."""
    ours, torch32, exact = (np.asarray(a.detach().numpy() if torch.is_tensor(a) else a, np.float64)
                            for a in (ours, torch32, exact))
    assert ours.shape == exact.shape, f"{what}: shape {ours.shape}, PyTorch's {exact.shape}"
    distance, own = np.linalg.norm(ours - exact), np.linalg.norm(torch32 - exact)
    allowed = YARDSTICK * own + (2 + FLOOR) * U * np.linalg.norm(exact)
    assert distance <= allowed, f"{what}: {distance:.3g} from float64, {allowed:.3g} allowed (PyTorch's {own:.3g})"


def check(fw, device, expression, inputs: list[np.ndarray], theirs=None, seed: int = 0) -> None:
    """The expression on level 8's tensors and on torch's (`theirs` where torch spells it otherwise), from the same
    float32 inputs: its value, then every input's gradient from one random gradient of the output."""
    theirs = theirs or expression
    ours = [fw.Tensor(a, requires_grad=True, device=device) for a in inputs]
    runs = {dtype: [torch.tensor(a, dtype=dtype, requires_grad=True) for a in inputs]
            for dtype in (torch.float32, torch.float64)}
    out = expression(*ours)
    expected = {dtype: theirs(*leaves) for dtype, leaves in runs.items()}
    g = np.random.default_rng(seed).standard_normal(tuple(expected[torch.float64].shape)).astype(np.float32)
    out.backward(fw.Tensor(g, device=device))
    for dtype, result in expected.items():
        result.backward(torch.from_numpy(g).to(dtype))
    assert_as_close_as_pytorch(out.numpy(), expected[torch.float32], expected[torch.float64], "the value")
    for i, t in enumerate(ours):
        assert_as_close_as_pytorch(t.grad.numpy(), runs[torch.float32][i].grad, runs[torch.float64][i].grad,
                                   f"the gradient of input {i}")


# ---- arithmetic: + - * / between tensors that broadcast, both orders, and with numbers on either side ----

BINARY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


def broadcast_pairs(count: int = 6, seed: int = 0) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Pairs of shapes that broadcast: a random shape of 0 to 3 axes, and a trailing part of it with some sizes made
    1; then, at random, some of the first's sizes made 1 where the second's are not (stretched both ways)."""
    rng, pairs = np.random.default_rng(seed), []
    while len(pairs) < count:
        first = tuple(int(n) for n in rng.integers(2, 5, rng.integers(0, 4)))
        second = [1 if rng.random() < 0.4 else n for n in first[rng.integers(0, len(first) + 1):]]
        lead = len(first) - len(second)
        first = tuple(1 if d >= lead and second[d - lead] != 1 and rng.random() < 0.3 else n
                      for d, n in enumerate(first))
        if (first, tuple(second)) not in pairs:
            pairs.append((first, tuple(second)))
    return pairs


PAIRS = [((4, 3), (3,)), ((4, 3), (4, 3)), ((2, 1, 3), (4, 1)), ((), (2, 3))] + broadcast_pairs()


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("shapes", PAIRS, ids=lambda p: f"{p[0]}{p[1]}".replace(" ", ""))
def test_arithmetic_between_tensors_in_both_orders(fw, device, op, shapes):
    """a op b and b op a, broadcast: each input's gradient summed back to its own shape."""
    a, b = values(shapes[0], 1), values(shapes[1], 2, away=op == "/")
    check(fw, device, BINARY[op], [a, b])
    a = values(shapes[0], 3, away=op == "/")
    check(fw, device, lambda x, y: BINARY[op](y, x), [a, b], seed=1)


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("number", [2.5, -3, 0.0])
def test_arithmetic_with_a_number_on_either_side(fw, device, op, number):
    """t op number and number op t (radd, rsub, rmul, rtruediv); a number divides only where it is not 0."""
    x = values((3, 4), 4, away=op == "/")
    check(fw, device, lambda t: BINARY[op](number, t), [x])
    if op != "/" or number:
        check(fw, device, lambda t: BINARY[op](t, number), [x])


# ---- functions of each value, on contiguous inputs and on views ----

UNARY = {
    "neg": (lambda t: -t, {}),
    "exp": (lambda t: t.exp(), {}),
    "log": (lambda t: t.log(), {"positive": True}),
    "tanh": (lambda t: (2 * t).tanh(), {}),
    "sigmoid": (lambda t: t.sigmoid(), {}),
    "relu": (lambda t: t.relu(), {}),
    "** 2": (lambda t: t**2, {}),
    "** 3": (lambda t: t**3, {}),
    "** 0.5": (lambda t: t**0.5, {"positive": True}),
    "** -1": (lambda t: t**-1, {"away": True}),
    "** 0": (lambda t: t**0, {}),
}


@pytest.mark.parametrize("name", UNARY, ids=lambda name: name.replace(" ", ""))
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_functions_of_each_value(fw, device, name, layout):
    f, domain = UNARY[name]
    before = {"contiguous": lambda t: t, "transposed": lambda t: t.T, "sliced": lambda t: t[1:, ::2]}[layout]
    check(fw, device, lambda t: f(before(t)), [values((5, 6), 5, **domain)])


# ---- reductions over axes, keepdim or not ----


@pytest.mark.parametrize("dim", [None, 0, -1, (0, 2), (2, 1, 0)], ids=lambda dim: str(dim).replace(" ", ""))
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("name", ["sum", "mean", "max"])
def test_reductions_over_axes(fw, device, name, dim, keepdim):
    """sum, mean and max (torch.amax) over (3, 4, 5), and over its permutation, a view."""
    ours = {"sum": lambda t: t.sum(dim, keepdim), "mean": lambda t: t.mean(dim, keepdim),
            "max": lambda t: t.max(dim, keepdim)}[name]
    theirs = {"sum": lambda t: t.sum(dim if dim is not None else tuple(range(t.ndim)), keepdim),
              "mean": lambda t: t.mean(dim if dim is not None else tuple(range(t.ndim)), keepdim),
              "max": lambda t: t.amax(dim if dim is not None else tuple(range(t.ndim)), keepdim)}[name]
    check(fw, device, ours, [values((3, 4, 5), 6)], theirs)
    check(fw, device, lambda t: ours(t.permute(2, 0, 1)), [values((4, 5, 3), 7)], lambda t: theirs(t.permute(2, 0, 1)))


def test_max_splits_its_gradient_among_ties_as_pytorch(fw, device):
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]], np.float32)
    ours, theirs = fw.Tensor(x, requires_grad=True, device=device), torch.tensor(x, requires_grad=True)
    ours.max(1).sum().backward()
    theirs.amax(1).sum().backward()
    np.testing.assert_array_equal(ours.grad.numpy(), theirs.grad.numpy())  # 1/2 and 1/3: each exact in both
    ours.grad = None
    ours.max().backward()
    np.testing.assert_array_equal(ours.grad.numpy(), [[0, 0.5, 0.5], [0, 0, 0]])


# ---- views: the gradient goes back through the same strides ----

VIEWS = {
    "transpose": lambda t: t.transpose(0, 2),
    "permute": lambda t: t.permute(1, 2, 0),
    "slices and ints": lambda t: t[1, ::2, 1:],
    "a slice of a permute": lambda t: t.permute(2, 0, 1)[1:3, :, ::2],
    "expand": lambda t: t[:, :1].expand(4, 2, 3, 4),
    "reshape, a view": lambda t: t.reshape(6, 4),
    "reshape, a copy": lambda t: t.permute(2, 0, 1).reshape(4, 6),
    "view": lambda t: t.view(2, 12),
    "contiguous": lambda t: t.transpose(1, 2).contiguous(),
}


@pytest.mark.parametrize("name", VIEWS, ids=lambda name: name.replace(" ", "-").replace(",", ""))
def test_views_send_the_gradient_back_through_their_strides(fw, device, name):
    """Each followed by a product with a second tensor, so that every position's gradient is its own."""
    check(fw, device, lambda t, w: VIEWS[name](t) * w, [values((2, 3, 4), 8), values(VIEWS[name](
        torch.zeros(2, 3, 4)).shape, 9)])


def test_a_product_of_views(fw, device):
    """matmul of a sliced and a transposed view: the GPU copies the first row-major and reads the second in place."""
    check(fw, device, lambda a, b: a[::2, 1:] @ b.T, [values((6, 5), 10), values((3, 4), 11)])


# ---- losses ----


@pytest.mark.parametrize("dim", [-1, 0])
@pytest.mark.parametrize("scale", [1.0, 1000.0], ids=["logits", "logits-1000"])
def test_log_softmax(fw, device, dim, scale):
    """Far-apart logits too: the max subtracted first keeps exp() finite."""
    check(fw, device, lambda t: t.log_softmax(dim), [values((5, 7), 12) * np.float32(scale)])


def test_cross_entropy_is_log_softmax_and_the_negative_log_likelihood(fw, device):
    """The fused loss, and the same loss written with log_softmax, a one-hot product and a mean."""
    y = np.random.default_rng(0).integers(0, 7, 5)
    onehot = np.eye(7, dtype=np.float32)[y]
    check(fw, device, lambda t: fw.nn.CrossEntropyLoss()(t, y), [values((5, 7), 13)],
          lambda t: TF.cross_entropy(t, torch.from_numpy(y)))
    check(fw, device, lambda t, h: -(t.log_softmax(1) * h).sum(1).mean(), [values((5, 7), 14), onehot])


def test_mse(fw, device):
    check(fw, device, lambda x, t: fw.nn.MSELoss()(x, t), [values((4, 6), 15), values((4, 6), 16)], TF.mse_loss)


# ---- graphs of every shape ----

GRAPHS = {
    "a chain": lambda x, w: ((x * w).exp() * 0.5 + 1).log().sum(),
    "a diamond": lambda x, w: (lambda h: (h.tanh() + h.sigmoid()).sum())(x * w),
    "an interior tensor used three times": lambda x, w: (lambda h: (h * h * h + h).mean())(x - w),
    "a leaf used twice in one operation": lambda x, w: (x * x + w).sum(),
    "a leaf on two paths": lambda x, w: ((x @ w.T).relu().sum(0) + x.sum(1).sum() * w[:, 0]).sum(),
    "a branch that needs no gradient": lambda x, w: (x * w.detach() + w).max(),
}


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda name: name.replace(" ", "-"))
def test_graphs_of_every_shape(fw, device, graph):
    check(fw, device, GRAPHS[graph], [values((4, 5), 17), values((4, 5), 18)])


# ---- no_grad ----


def test_no_grad_nests_and_restores_what_was_before(fw):
    """As torch.no_grad: inside, nothing records; an inner one leaves the outer off when it ends; an exception ends
    it as well; and it decorates a function."""
    t = fw.Tensor(np.ones(3), requires_grad=True)
    with fw.no_grad():
        with fw.no_grad():
            assert not (t * 2).requires_grad
        assert not (t * 2).requires_grad
    assert (t * 2).requires_grad
    with pytest.raises(KeyError):
        with fw.no_grad():
            raise KeyError
    assert (t * 2).requires_grad

    @fw.no_grad()
    def doubled(x):
        return x * 2

    assert not doubled(t).requires_grad and (t * 2).requires_grad


# ---- the optimizers: parameters without a gradient, and the learning rate changed between epochs ----

OPTIMIZERS = {
    "sgd": (lambda ps, lr: torch.optim.SGD(ps, lr=lr), "SGD", {}),
    "momentum": (lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9), "SGD", {"momentum": 0.9}),
    "adam": (lambda ps, lr: torch.optim.Adam(ps, lr=lr), "Adam", {}),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizers_skip_parameters_without_a_gradient_and_follow_a_new_lr(fw, device, name):
    """Three epochs of four steps, the learning rate set anew for each (as train_epoch does: optimizer.lr, PyTorch's
    param_groups[0]["lr"]); the second parameter gets a gradient at every other step only, and no state while it has
    none (Adam's step counts differ, its momentum buffer waits). Parameters and state by PyTorch's 2x rule."""
    make, cls, hyper = OPTIMIZERS[name]
    start = [values((3, 4), 19), values((4,), 20)]
    runs = {dtype: [torch.tensor(a, dtype=dtype, requires_grad=True) for a in start] for dtype in (torch.float32,
                                                                                                  torch.float64)}
    theirs = {dtype: make(ps, 0.1) for dtype, ps in runs.items()}
    params = [fw.Parameter(a, device=device) for a in start]
    ours = getattr(fw.optim, cls)(params, lr=0.1, **hyper)
    for epoch, lr in enumerate((0.1, 0.03, 0.2)):
        ours.lr = lr
        for optimizer in theirs.values():
            optimizer.param_groups[0]["lr"] = lr
        for step in range(4):
            grads = [values((3, 4), 100 * epoch + step)] + ([values((4,), 50 + step)] if step % 2 else [None])
            for p, g in zip(params, grads):
                p.grad = None if g is None else fw.Tensor(g, device=device)
            for dtype, ps in runs.items():
                for p, g in zip(ps, grads):
                    p.grad = None if g is None else torch.from_numpy(g).to(dtype)
                theirs[dtype].step()
            ours.step()
            for i, p in enumerate(params):
                assert_as_close_as_pytorch(p.numpy(), runs[torch.float32][i], runs[torch.float64][i],
                                           f"epoch {epoch}, step {step}, parameter {i}")
    state, expected = ours.state_dict()["state"], theirs[torch.float32].state_dict()["state"]
    assert sorted(state) == sorted(expected)
    for i, s in state.items():
        assert {k: int(v) for k, v in s.items() if k == "step"} == {k: int(v) for k, v in expected[i].items()
                                                                    if k == "step"}


# ---- what is refused ----


def test_operators_refuse_what_they_do_not_do(fw, device):
    t = fw.Tensor(values((2, 3), 21), requires_grad=True, device=device)
    cases = [
        (lambda: t ** t, TypeError, "number"),
        (lambda: 2 ** t, TypeError, "unsupported"),
        (lambda: t + "1", TypeError, "expected a Tensor"),
        (lambda: t + fw.Tensor(np.ones(4), device=device), ValueError, "broadcast"),
        (lambda: t[:, ::-1], ValueError, "positive"),
        (lambda: t[2], IndexError, "out of range"),
        (lambda: t.sum((0, 0)), ValueError, "each axis once"),
        (lambda: t.sum(2), IndexError, "axis 2"),
        (lambda: t.expand(4, 3), ValueError, "broadcast"),
        (lambda: t.permute(0, 0), ValueError, "axes once"),
        (lambda: t.reshape(4, -1), ValueError, "cannot reshape"),
        (lambda: t.reshape(2, 3, 1).T, ValueError, "2-D"),
    ]
    for make, error, words in cases:
        with pytest.raises(error, match=words):
            make()
