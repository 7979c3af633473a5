"""Level 8, the framework: every operation against PyTorch (values and gradients), autograd's engine (deep graphs,
tensors used twice, backward() twice, the graph freed), the layers and their names, bad input, the course's MLP as
level 3's bit for bit on the CPU, and the MLP with a sigmoid and MSE step by step against PyTorch. Each test runs on
both backends (the GPU's skip where there is none; `make test-gpu` runs them).

The tolerance of an operation: float32 computes a sum of n terms, in any order, to within gamma_n * sum |terms| of
the exact sum (common/harness/verify.py's gamma, u = 2^-24), and rounds any result to within u |result|. So each result is
checked against PyTorch in float64, entry by entry, within gamma_n |terms| + 2u |exact| (`assert_float32`): a bound no
correct float32 kernel can exceed, which a wrong formula (a missing sum, a transposed index, a lost 1/N) exceeds by
orders of magnitude. Functions (exp in softmax and sigmoid) get a few ulps more: `ULPS` below.
"""

from __future__ import annotations

import copy
import gc
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from common.harness.verify import FLOOR, YARDSTICK, U, gamma
from common.levels import level
from common.nets import get
from common.nets.mlp import init_params
from strided_stand_in import device  # noqa: F401 (a fixture: cpu, cuda, cuda over a stand-in)

pytestmark = pytest.mark.level8

ULPS = 8  # exp and log of NumPy, PyTorch and CUDA are each within a few ulps of exact; 8u per step of a function


@pytest.fixture
def fw():
    import level8_framework

    return level8_framework


def normal(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([*shape, seed]).standard_normal(shape).astype(np.float32)


def exact(a: np.ndarray, requires_grad: bool = True) -> torch.Tensor:
    """A float64 torch leaf holding float32 values: the yardstick computes from exactly the inputs the framework has."""
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=requires_grad)


def assert_float32(ours, exact64, terms=None, what: str = "", extra: float = 0.0) -> None:
    """ours (float32) within gamma_n * terms + (2 + extra) u |exact| of exact64 (float64), entry by entry; terms: the
    sum of |terms| behind each entry (None: a single rounding)."""
    ours = ours.numpy() if hasattr(ours, "numpy") and not isinstance(ours, np.ndarray) else np.asarray(ours)
    exact64 = exact64.detach().numpy() if isinstance(exact64, torch.Tensor) else np.asarray(exact64)
    assert ours.dtype == np.float32, f"{what}: {ours.dtype}"
    assert ours.shape == exact64.shape, f"{what}: shape {ours.shape}, expected {exact64.shape}"
    bound = (2 + extra) * U * np.abs(exact64) + np.finfo(np.float32).tiny  # below it, float32 rounds absolutely
    if terms is not None:
        n, total = terms
        total = total.detach().numpy() if isinstance(total, torch.Tensor) else np.asarray(total)
        bound = bound + gamma(n) * np.abs(total)
    err = np.abs(ours.astype(np.float64) - exact64)
    worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else ()
    assert (err <= bound).all(), f"{what}: {err[worst]:.3g} from float64 at {worst}, {bound[worst]:.3g} allowed"


def leaf(fw, a: np.ndarray, device: str):
    return fw.Tensor(a, requires_grad=True, device=device)


# ---- the operations, each against PyTorch in float64 ----


@pytest.mark.parametrize("form", ["a @ b", "a @ b.T", "a.T @ b", "a.T @ b.T"])
def test_matmul_and_its_gradients_in_every_layout(fw, device, form):
    """(5, 7) @ (7, 3) written four ways: a transposed view is read in place, and its gradient comes in its layout."""
    shapes = {"a @ b": ((5, 7), (7, 3)), "a @ b.T": ((5, 7), (3, 7)), "a.T @ b": ((7, 5), (7, 3)),
              "a.T @ b.T": ((7, 5), (3, 7))}[form]
    a, b, g = normal(*shapes[0], seed=1), normal(*shapes[1], seed=2), normal(5, 3, seed=3)
    ta, tb = leaf(fw, a, device), leaf(fw, b, device)
    ea, eb = exact(a), exact(b)
    run = {"a @ b": lambda x, y: x @ y, "a @ b.T": lambda x, y: x @ y.T, "a.T @ b": lambda x, y: x.T @ y,
           "a.T @ b.T": lambda x, y: x.T @ y.T}[form]
    out, expected = run(ta, tb), run(ea, eb)
    out.backward(fw.Tensor(g, device=device))
    expected.backward(torch.from_numpy(g).double())
    absolute = run(exact(np.abs(a), False), exact(np.abs(b), False))
    assert_float32(out, expected, (7, absolute), "out")
    assert_float32(ta.grad, ea.grad, (3, np.abs(ea.grad.numpy()) + 10), "da")  # |g| |b| sums: bounded by 10 here
    assert_float32(tb.grad, eb.grad, (5, np.abs(eb.grad.numpy()) + 10), "db")
    for t in (ta, tb):
        assert t.grad.shape == t.shape and t.grad.numpy().flags.c_contiguous


# (a's shape, b's): on the GPU the first six are a bias (level 5's kernels), the last two any broadcast (ops.cu's)
@pytest.mark.parametrize("a_shape, b_shape", [((4, 3), (3,)), ((4, 3), (1, 3)), ((2, 4, 3), (3,)), ((4, 3), ()),
                                              ((4, 3), (4, 3)), ((3,), (4, 3)), ((4, 1), (1, 3)), ((2, 1, 3), (4, 1))],
                         ids=["bias", "row", "3d-bias", "scalar", "same", "bias-first", "outer", "both-ways"])
def test_add_broadcasts_and_its_backward_sums_over_the_broadcast_axes(fw, device, a_shape, b_shape):
    a, b = normal(*a_shape, seed=1), normal(*b_shape, seed=2)
    ta, tb = leaf(fw, a, device), leaf(fw, b, device)
    out = ta + tb
    g = normal(*out.shape, seed=3)
    ea, eb = exact(a), exact(b)
    expected = ea + eb
    expected.backward(torch.from_numpy(g).double())
    out.backward(fw.Tensor(g, device=device))
    assert_float32(out, expected, None, "a + b")
    n = g.size  # a gradient entry sums at most every entry of g
    assert_float32(ta.grad, ea.grad, (n, np.abs(g).sum()), "da")
    assert_float32(tb.grad, eb.grad, (n, np.abs(g).sum()), "db")


def test_add_of_a_number(fw, device):
    t = leaf(fw, normal(3, 2), device)
    out = 1.5 + t + 2.0
    np.testing.assert_array_equal(out.numpy(), normal(3, 2) + np.float32(1.5) + np.float32(2.0))


def test_reshape_flatten_and_transpose_move_values_and_gradients_exactly(fw, device):
    a = normal(2, 3, 4)
    t = leaf(fw, a, device)
    out = t.flatten().T.reshape(4, 6)
    g = normal(4, 6, seed=1)
    out.backward(fw.Tensor(g, device=device))
    e = exact(a)
    expected = e.flatten(1).T.reshape(4, 6)
    expected.backward(torch.from_numpy(g).double())
    np.testing.assert_array_equal(out.numpy(), expected.detach().numpy().astype(np.float32))
    np.testing.assert_array_equal(t.grad.numpy(), e.grad.numpy().astype(np.float32))


def test_relu_and_its_gradient_zero_at_exactly_zero(fw, device):
    a = np.array([[-1.0, 0.0, 2.0], [0.0, 3.0, -0.5]], dtype=np.float32)
    t = leaf(fw, a, device)
    out = t.relu()
    out.backward(fw.Tensor(np.ones_like(a), device=device))
    np.testing.assert_array_equal(out.numpy(), np.maximum(a, 0))
    np.testing.assert_array_equal(t.grad.numpy(), (a > 0).astype(np.float32))


def test_sigmoid_against_torch_including_far_tails(fw, device):
    a = np.concatenate([normal(3, 5) * 4, [[-100.0, -20.0, 0.0, 20.0, 100.0]]]).astype(np.float32)
    t, e = leaf(fw, a, device), exact(a)
    out, expected = t.sigmoid(), torch.sigmoid(e)
    g = normal(*a.shape, seed=1)
    out.backward(fw.Tensor(g, device=device))
    expected.backward(torch.from_numpy(g).double())
    assert_float32(out, expected, None, "sigmoid", extra=ULPS)
    assert np.isfinite(out.numpy()).all()
    # g (1 - s) s: where s is near 1, 1 - s loses what s's own error was, ULPS u |s| absolute: g s ULPS u s
    s64 = expected.detach().numpy()
    assert_float32(t.grad, e.grad, (ULPS, np.abs(g) * s64 * s64), "dsigmoid", extra=4)


def test_mean_and_its_gradient(fw, device):
    a = normal(7, 13)
    t, e = leaf(fw, a, device), exact(a)
    out, expected = t.mean(), e.mean()
    out.backward()
    expected.backward()
    assert out.shape == () and abs(out.item() - expected.item()) <= gamma(a.size) * np.abs(a).mean() + 2 * U
    assert_float32(t.grad, e.grad, None, "dmean")


@pytest.mark.parametrize("scale", [1.0, 2000.0], ids=["logits", "logits-2000-apart"])
def test_cross_entropy_against_torch(fw, device, scale):
    logits, y = normal(13, 10) * scale, np.random.default_rng(0).integers(0, 10, 13)
    t, e = leaf(fw, logits, device), exact(logits)
    loss, expected = fw.nn.CrossEntropyLoss()(t, y), TF.cross_entropy(e, torch.from_numpy(y))
    (loss + loss).backward()  # the loss used twice: its gradient 2, which reaches dlogits
    (2 * expected).backward()
    assert np.isfinite(loss.item())
    # log-sum-exp of 10 terms and a mean of 13: relative 1e-6 of the largest logit, generous for float32
    assert abs(loss.item() - expected.item()) <= 1e-6 * (np.abs(logits).max() + 1)
    assert_float32(t.grad, e.grad, (10, np.ones_like(logits) / 13), "dlogits", extra=ULPS)


def test_mse_loss_against_torch_both_inputs(fw, device):
    x, target = normal(6, 10), normal(6, 10, seed=1)
    tx, tt = leaf(fw, x, device), leaf(fw, target, device)
    ex, et = exact(x), exact(target)
    loss, expected = fw.nn.MSELoss()(tx, tt), TF.mse_loss(ex, et)
    loss.backward()
    expected.backward()
    assert abs(loss.item() - expected.item()) <= gamma(x.size + 2) * expected.item() + 2 * U * expected.item()
    assert_float32(tx.grad, ex.grad, None, "dx", extra=4)  # (x - t), times 2/N, times g: three roundings
    assert_float32(tt.grad, et.grad, None, "dtarget", extra=4)


def test_conv2d_against_torch(fw, device):
    """Odd sizes: 2 images of 3 channels, 9 x 9 (the GPU's convolution takes square images), 4 filters of 3 x 3."""
    x, w, b = normal(2, 3, 9, 9), normal(4, 3, 3, 3, seed=1), normal(4, seed=2)
    tx = leaf(fw, x, device)
    ex, ew, eb = exact(x), exact(w), exact(b)
    conv = fw.nn.Conv2d(3, 4, 3)
    conv.load_state_dict({"weight": w, "bias": b})
    conv.to(device)
    out = conv(tx)
    expected = TF.conv2d(ex, ew, eb)
    g = normal(*out.shape, seed=3)
    out.backward(fw.Tensor(g, device=device))
    expected.backward(torch.from_numpy(g).double())
    terms = TF.conv2d(exact(np.abs(x), False), exact(np.abs(w), False), exact(np.abs(b), False))
    assert_float32(out, expected, (28, terms), "conv2d")
    assert_float32(tx.grad, ex.grad, (4 * 9, np.abs(ex.grad.numpy()) + 40), "dx")  # |g| |w| sums below 40 here
    assert_float32(conv.weight.grad, ew.grad, (2 * 49, np.abs(ew.grad.numpy()) + 400), "dw")
    assert_float32(conv.bias.grad, eb.grad, (2 * 49, np.abs(g).sum(axis=(0, 2, 3))), "db")


def test_max_pool2d_sends_the_gradient_to_the_first_maximum(fw, device):
    x = normal(2, 3, 6, 6)
    x[0, 0, :2, :2] = 5.0  # a window of four equal maxima: PyTorch's gradient goes to the first
    tx, ex = leaf(fw, x, device), exact(x)
    out, expected = fw.nn.MaxPool2d(2)(tx), TF.max_pool2d(ex, 2)
    g = normal(*out.shape, seed=1)
    out.backward(fw.Tensor(g, device=device))
    expected.backward(torch.from_numpy(g).double())
    np.testing.assert_array_equal(out.numpy(), expected.detach().numpy().astype(np.float32))
    np.testing.assert_array_equal(tx.grad.numpy(), ex.grad.numpy().astype(np.float32))


def test_an_mse_sigmoid_graph_against_central_differences(fw, device):
    """The engine composing matmul, broadcast add, sigmoid and MSE: d loss / d w by float64 central differences of
    the framework's own float32 forward. eps = 1e-2 keeps float32's rounding of the loss (~1e-7 of it) at ~1e-5 of
    the difference quotient; the truncation, eps^2 times the third derivative, is ~1e-4: 2e-3 relative is the bound."""
    x, w, b, target = normal(5, 4), normal(3, 4, seed=1) * 0.5, normal(3, seed=2), normal(5, 3, seed=3)

    def loss_of(w_values: np.ndarray, grad: bool = False):
        tw = fw.Tensor(w_values, requires_grad=grad, device=device)
        loss = fw.nn.MSELoss()((fw.Tensor(x, device=device) @ tw.T + fw.Tensor(b, device=device)).sigmoid(),
                               fw.Tensor(target, device=device))
        return loss, tw

    loss, tw = loss_of(w, grad=True)
    loss.backward()
    eps, numeric = 1e-2, np.zeros(w.shape)
    for i in np.ndindex(w.shape):
        plus, minus = w.copy(), w.copy()
        plus[i] += eps
        minus[i] -= eps
        numeric[i] = (np.float64(loss_of(plus)[0].item()) - loss_of(minus)[0].item()) / (2 * eps)
    np.testing.assert_allclose(tw.grad.numpy(), numeric, rtol=0, atol=2e-3 * np.abs(numeric).max())


# ---- autograd's engine ----


def test_a_tensor_used_twice_gets_both_gradients_added(fw, device):
    a = normal(4, 3)
    t, e = leaf(fw, a, device), exact(a)
    (t.relu() + t).mean().backward()
    (torch.relu(e) + e).mean().backward()
    assert_float32(t.grad, e.grad, (2, np.full(a.shape, 2 / a.size)), "used twice")
    x = leaf(fw, a, device)
    (x + x).mean().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.full(a.shape, 2 * np.float32(1 / a.size), np.float32))


def test_a_graph_10000_operations_deep_needs_no_recursion(fw, device):
    t = leaf(fw, np.ones(3, dtype=np.float32), device)
    out = t
    for _ in range(10_000):
        out = out.relu() + 0.0
    out.mean().backward()
    np.testing.assert_array_equal(t.grad.numpy(), np.full(3, np.float32(1 / 3)))


def test_backward_twice_raises_after_the_graph_is_freed_and_accumulates_when_kept(fw, device):
    a = normal(3, 4)
    t = leaf(fw, a, device)
    loss = (t.relu() + t).mean()
    loss.backward(retain_graph=True)
    first = t.grad.numpy()
    loss.backward()  # as PyTorch: gradients add up in .grad until zero_grad
    np.testing.assert_array_equal(t.grad.numpy(), first + first)
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()
    e = exact(a)
    e_loss = (torch.relu(e) + e).mean()
    e_loss.backward(retain_graph=True)
    e_loss.backward()
    assert_float32(t.grad, e.grad, (4, np.full(a.shape, 4 / a.size)), "twice")


def test_the_graph_is_freed_by_backward(fw, device):
    """After backward() no node keeps its inputs or the values it saved: they go with the last reference."""
    t = leaf(fw, normal(8, 8), device)
    hidden = t.relu()
    saved = weakref.ref(hidden)
    loss = (hidden @ t).mean()
    del hidden
    gc.collect()
    assert saved() is not None  # the graph holds it
    loss.backward()
    gc.collect()
    assert saved() is None and loss.node.inputs == () and loss.node.backward is None


def test_the_topological_order_puts_every_tensor_after_its_inputs(fw, device):
    from level8_framework.tensor import topological_order

    a, b = leaf(fw, normal(2, 2), device), leaf(fw, normal(2, 2, seed=1), device)
    h = a @ b
    out = (h + a).relu() + (h @ b)
    order = topological_order(out)
    place = {id(t): i for i, t in enumerate(order)}
    assert order[-1] is out and len(place) == len(order)
    for t in order:
        for i in t.node.inputs if t.node else ():
            assert place[id(i)] < place[id(t)]
    assert [id(t) for t in topological_order(out)] == [id(t) for t in order]  # the same order every time


def test_retain_grad_no_grad_and_detach(fw, device):
    t = leaf(fw, normal(3, 3), device)
    h = t.relu()
    h.retain_grad()
    h.mean().backward()
    np.testing.assert_array_equal(h.grad.numpy(), np.full((3, 3), np.float32(1 / 9)))
    with fw.no_grad():
        assert not (t + t).requires_grad
    assert not t.detach().requires_grad and (t + t).requires_grad


def test_bad_input_is_refused_with_a_clear_error(fw, device):
    t = fw.Tensor(normal(3, 4), requires_grad=True, device=device)
    cases = [
        (lambda: t @ t, ValueError, r"matmul needs \(M, K\) and \(K, N\)"),
        (lambda: t.reshape(5, 5), ValueError, "reshape|size"),
        (lambda: fw.nn.CrossEntropyLoss()(t, np.array([0, 1, 4])), ValueError, r"class indices must be in \[0, 4\)"),
        (lambda: fw.nn.CrossEntropyLoss()(t, np.array([0, -1, 2])), ValueError, "class indices"),
        (lambda: fw.nn.CrossEntropyLoss()(t, np.zeros(3, np.float32)), TypeError, "integer class indices"),
        (lambda: fw.nn.CrossEntropyLoss()(t, np.zeros(2, int)), ValueError, r"shape \(3,\)"),
        (lambda: fw.nn.MSELoss()(t, t.T), ValueError, "one shape"),
        (lambda: (t + t).backward(), RuntimeError, "single value"),
        (lambda: fw.Tensor(normal(3)).mean().backward(), RuntimeError, "does not require grad"),
        (lambda: fw.nn.MaxPool2d(2)(fw.Tensor(normal(1, 1, 3, 4), device=device)), ValueError, "even"),
        (lambda: fw.nn.MaxPool2d(3), ValueError, "2 x 2"),
        (lambda: fw.nn.Conv2d(2, 4, 3).to(device)(fw.Tensor(normal(1, 3, 5, 5), device=device)), ValueError,
         "conv2d needs"),
        (lambda: fw.nn.Linear(0, 3), ValueError, "in_features must be an integer >= 1"),
        (lambda: fw.Tensor([1.0], device="tpu"), ValueError, "device must be one of"),
        (lambda: fw.nn.Sequential(fw.nn.ReLU(), "relu"), TypeError, "Sequential takes Modules"),
    ]
    for make, error, words in cases:
        with pytest.raises(error, match=words):
            make()


def test_tensors_on_two_devices_are_refused(fw, device):
    if device == "cpu":
        pytest.skip("needs a second device: runs as the cuda case")
    a, b = fw.Tensor(normal(2, 2)), fw.Tensor(normal(2, 2), device="cuda")
    with pytest.raises(RuntimeError, match="one device"):
        a + b
    np.testing.assert_array_equal((a.to("cuda") + b).numpy(), normal(2, 2) + normal(2, 2))


# ---- the layers ----


def test_parameters_are_named_as_pytorch_names_them(fw):
    net = fw.nn.Sequential({"fc1": fw.nn.Linear(5, 4), "relu": fw.nn.ReLU(), "fc2": fw.nn.Linear(4, 2)})
    plain = fw.nn.Sequential(fw.nn.Conv2d(1, 2, 3), fw.nn.ReLU(), fw.nn.Flatten(), fw.nn.Linear(2, 3, bias=False))
    twin = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(2, 3, bias=False))
    assert list(net.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert {k: v.shape for k, v in plain.state_dict().items()} == {k: tuple(v.shape) for k, v in
                                                                   twin.state_dict().items()}
    assert len(net) == 3 and net["fc2"] is net[2]
    bound = 1 / np.sqrt(5)  # PyTorch's default initialization, U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert np.abs(net.fc1.weight.numpy()).max() <= bound and np.abs(net.fc1.bias.numpy()).max() <= bound


def test_load_state_dict_checks_names_and_shapes_and_keeps_the_parameters(fw):
    net = fw.nn.Sequential({"fc": fw.nn.Linear(3, 2)})
    weight = net.fc.weight
    with pytest.raises(KeyError, match="missing"):
        net.load_state_dict({"fc.weight": np.zeros((2, 3))})
    with pytest.raises(ValueError, match="shape"):
        net.load_state_dict({"fc.weight": np.zeros((3, 2)), "fc.bias": np.zeros(2)})
    net.load_state_dict({"fc.weight": np.ones((2, 3)), "fc.bias": np.zeros(2)})
    assert net.fc.weight is weight and (weight.numpy() == 1).all()


def test_the_mlp_is_level3s_bit_for_bit_on_the_cpu(mnist):
    """The same functions in the same order: level 8's MLP on the CPU computes exactly what level 3's does."""
    params = init_params(0, 37)
    X, y = mnist[0][:203], mnist[1][:203]
    ours, theirs = level(8).load()(params), level(3).load()(params)
    np.testing.assert_array_equal(ours.train_epoch(X, y, 13, 0.05), theirs.train_epoch(X, y, 13, 0.05))
    for name, value in theirs.state_dict().items():
        np.testing.assert_array_equal(ours.state_dict()[name], value, err_msg=name)


@pytest.mark.lenet
def test_lenet_is_level3s_bit_for_bit_on_the_cpu(mnist):
    from common.nets import lenet

    params = lenet.init_params(0)
    X, y = mnist[0][:40], mnist[1][:40]
    ours, theirs = level(8).load(get("lenet"))(params), level(3).load(get("lenet"))(params)
    np.testing.assert_array_equal(ours.train_epoch(X, y, 16, 0.05), theirs.train_epoch(X, y, 16, 0.05))
    for name, value in theirs.state_dict().items():
        np.testing.assert_array_equal(ours.state_dict()[name], value, err_msg=name)


@pytest.mark.parametrize("network", ["mlp", pytest.param("lenet", marks=pytest.mark.lenet)])
def test_the_levels_classes_train_on_every_backend(device, mnist, network):
    """The level's own class (what the harness trains) on the device: a shuffled epoch of 45 images in batches of 16
    (a partial last one), its losses and parameters as on the CPU to float32's rounding (measured below 1e-6)."""
    network = get(network)
    params = network.network.init_params(3, 16)
    X, y = mnist[0][:45], mnist[1][:45]
    order = np.random.default_rng(0).permutation(45)
    model, cpu = level(8).load(network)(params, device=device), level(8).load(network)(params)
    np.testing.assert_allclose(model.train_epoch(X, y, 16, 0.05, order), cpu.train_epoch(X, y, 16, 0.05, order),
                               rtol=1e-5)
    for name, value in cpu.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[name], value, rtol=0, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(model.forward(X), cpu.forward(X), rtol=0, atol=1e-4)


def test_a_thousand_models_leave_no_device_memory(device, mnist):
    """Every device array's memory goes back when Python collects it: the library's count of its buffers
    (mlp_device_buffers) is where it was after 1,000 models, each trained, its optimizer's state made, and dropped."""
    if device == "cpu":
        pytest.skip("device memory: the GPU backend's")
    from level8_framework import cuda

    params, X, y = init_params(0, 8), mnist[0][:32], mnist[1][:32]
    gc.collect()
    before = cuda.backend().buffers()
    for i in range(1000):
        model = level(8).load()(params, device=device, optimizer="adam" if i % 2 else "sgd")
        model.train_epoch(X, y, 16, 0.01)
        if i == 0:
            assert cuda.backend().buffers() > before  # the count sees the live model's memory
    del model
    gc.collect()
    assert cuda.backend().buffers() == before


def test_the_networks_are_sequentials_of_pytorchs_layers(fw):
    from level8_framework.lenet import lenet
    from level8_framework.mlp import mlp

    assert [type(m).__name__ for _, m in mlp(16).named_children()] == ["Linear", "ReLU", "Linear"]
    layers = dict(lenet().named_children())
    assert [type(m).__name__ for m in layers.values()] == ["Conv2d", "ReLU", "MaxPool2d"] * 2 + ["Flatten"] + \
        ["Linear", "ReLU"] * 2 + ["Linear"]


# ---- the sigmoid and MSE, step by step against PyTorch (with SGD and with Adam) ----


def sigmoid_mlp_torch(params, dtype):
    net = torch.nn.Sequential(torch.nn.Linear(784, params["fc1.weight"].shape[0]), torch.nn.Sigmoid(),
                              torch.nn.Linear(params["fc1.weight"].shape[0], 10)).to(dtype)
    net.load_state_dict({k.replace("fc1", "0").replace("fc2", "2"): torch.from_numpy(v) for k, v in params.items()})
    return net


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_sigmoid_mlp_with_mse_in_lockstep_with_pytorch(fw, device, mnist, optimizer):
    """784-32-10 with a sigmoid and MSE on one-hot targets, 40 steps of batch 16 on MNIST. At every step both start from
    PyTorch's float32 parameters (and, for Adam, its optimizer state, loaded into ours): the framework's update must
    be within PyTorch's 2x rule of the same step in float64 (common/harness/verify.py's: YARDSTICK times PyTorch's own
    distance, plus one rounding of each parameter, plus FLOOR u of the update for tensors where PyTorch is exact by
    luck). There are no ties (no ReLU): nothing else is allowed."""
    params = init_params(7, 32)
    X, y = np.array(mnist[0][:640]), mnist[1][:640]  # a writeable copy: torch.from_numpy warns about read-only ones
    onehot = np.eye(10, dtype=np.float32)[y]
    lr = 0.5 if optimizer == "sgd" else 1e-3
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=lr), "adam": lambda ps: torch.optim.Adam(ps, lr=lr)}[optimizer]
    ref32 = sigmoid_mlp_torch(params, torch.float32)
    opt32 = make(ref32.parameters())
    net = fw.nn.Sequential({"fc1": fw.nn.Linear(784, 32), "sigmoid": fw.nn.Sigmoid(), "fc2": fw.nn.Linear(32, 10)})
    net.to(device)
    ours = {"sgd": lambda ps: fw.optim.SGD(ps, lr=lr), "adam": lambda ps: fw.optim.Adam(ps, lr=lr)}[optimizer](
        net.parameters())
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for step in range(40):
        rows = slice(16 * step, 16 * step + 16)
        before = {k: v.detach().numpy().copy() for k, v in zip(names, ref32.parameters())}
        state = copy.deepcopy(opt32.state_dict())  # its tensors are the live ones, which the step changes
        # float64: the same step from the same parameters and optimizer state
        ref64 = sigmoid_mlp_torch(before, torch.float64)
        opt64 = make(ref64.parameters())
        opt64.load_state_dict(copy.deepcopy(state))  # PyTorch keeps the step tensor it is given, and counts on it
        for reference, opt, dtype in ((ref32, opt32, torch.float32), (ref64, opt64, torch.float64)):
            loss = TF.mse_loss(reference(torch.from_numpy(X[rows]).to(dtype)), torch.from_numpy(onehot[rows]).to(dtype))
            opt.zero_grad()
            loss.backward()
            opt.step()
        net.load_state_dict(before)
        ours.load_state_dict({"state": {i: {k: v.numpy() if torch.is_tensor(v) else v for k, v in s.items()}
                                        for i, s in state["state"].items()}, "param_groups": state["param_groups"]})
        our_loss = fw.nn.MSELoss()(net(fw.Tensor(X[rows], device=device)),
                                                 fw.Tensor(onehot[rows], device=device))
        ours.zero_grad()
        our_loss.backward()
        ours.step()
        assert abs(our_loss.item() - loss.item()) <= 1e-5 * loss.item()
        for name, p32, p64 in zip(names, ref32.parameters(), ref64.parameters()):
            got, theirs, exact64 = net.state_dict()[name].numpy(), p32.detach().numpy(), p64.detach().numpy()
            own = np.linalg.norm(theirs - exact64)
            allowed = YARDSTICK * own + 2 * U * np.linalg.norm(exact64) + \
                FLOOR * U * np.linalg.norm(theirs - before[name])
            assert np.linalg.norm(got - exact64) <= allowed, f"step {step}, {name}"
