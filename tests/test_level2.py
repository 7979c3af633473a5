"""Level 2: every backprop formula against central differences and torch.autograd in float64, and the pitfalls caught.

Tolerances are normwise, rel_error(a, b) = max|a - b| / max|b|:
  FD_TOL = 1e-6 against central differences (eps = 1e-5, the best step for these functions: the chapter's
    table). Their truncation error is O(eps^2) ~ 1e-10; their rounding error ~ 1e-16 |f| / eps ~ 1e-11 |f|:
    measured at most 3.1e-9 over these checks. The smallest bug shown here is off by a factor of 2 or more,
    i.e. a rel_error >= 0.5, eight orders of magnitude above FD_TOL.
  TORCH_TOL = 1e-12 against torch.autograd: the same formulas in float64, differing only in the order
    of summation, so ~1e-16 per operation (measured <= 1.3e-15); 1e-12 leaves room for any BLAS.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.nets.mlp import N_IN, N_OUT, PARAM_NAMES, init_params
from conftest import graded
from level2_theory import backprop as bp

pytestmark = pytest.mark.level2

FD_TOL = 1e-6
TORCH_TOL = 1e-12
BATCHES = (1, 13)
# (in, out) of a linear layer: out = 1 and 37 are the odd hidden sizes;
# 3 x 3 is square, where a transposed dW has the right shape.
LINEAR_SHAPES = ((5, 1), (5, 37), (3, 3))


def rng_for(*key: int) -> np.random.Generator:
    """A generator seeded by the test's parameters, so every case is reproducible on its own."""
    return np.random.default_rng(list(key))


def away_from_kink(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Pre-activations with 0.1 <= |h| <= 2: relu has a kink at 0, where a +-eps step would straddle it."""
    return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.1, 2.0, shape)


def logits_and_labels(rng: np.random.Generator, batch: int, scale: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    """Random float64 logits (B, 10) and integer labels (B,)."""
    return scale * rng.standard_normal((batch, N_OUT)), rng.integers(0, N_OUT, batch)


def small_params(rng: np.random.Generator, n_in: int, hidden: int) -> dict[str, np.ndarray]:
    """float64 parameters with the PyTorch layouts, biases non-zero so that a bias bug shows."""
    shapes = {"fc1.weight": (hidden, n_in), "fc1.bias": (hidden,), "fc2.weight": (N_OUT, hidden), "fc2.bias": (N_OUT,)}
    return {name: 0.5 * rng.standard_normal(shape) for name, shape in shapes.items()}


def torch_leaf(a: np.ndarray) -> torch.Tensor:
    """A float64 tensor that records its gradient."""
    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


# ---- each formula against central differences -------------------------------------------------
# A layer's output is a tensor, so it is checked through the scalar <out, dout> = sum(out * dout):
# its gradient with respect to an input is exactly what the backward function returns for that dout.


@graded(2, "linear layer")
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("n_in,n_out", LINEAR_SHAPES)
def test_linear_backward_vs_finite_differences(batch, n_in, n_out):
    rng = rng_for(batch, n_in, n_out)
    x, W, b = rng.standard_normal((batch, n_in)), rng.standard_normal((n_out, n_in)), rng.standard_normal(n_out)
    dout = rng.standard_normal((batch, n_out))
    dx, dW, db = bp.linear_backward(dout, x, W)
    assert (dx.shape, dW.shape, db.shape) == (x.shape, W.shape, b.shape)
    assert bp.rel_error(dx, bp.numerical_gradient(lambda v: np.sum(bp.linear_forward(v, W, b) * dout), x)) < FD_TOL
    assert bp.rel_error(dW, bp.numerical_gradient(lambda v: np.sum(bp.linear_forward(x, v, b) * dout), W)) < FD_TOL
    assert bp.rel_error(db, bp.numerical_gradient(lambda v: np.sum(bp.linear_forward(x, W, v) * dout), b)) < FD_TOL


@graded(2, "ReLU")
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("hidden", (1, 37))
def test_relu_backward_vs_finite_differences(batch, hidden):
    rng = rng_for(batch, hidden)
    h, da = away_from_kink(rng, (batch, hidden)), rng.standard_normal((batch, hidden))
    numeric = bp.numerical_gradient(lambda v: np.sum(bp.relu_forward(v) * da), h)
    assert bp.rel_error(bp.relu_backward(da, h), numeric) < FD_TOL


@graded(2, "softmax cross-entropy")
@pytest.mark.parametrize("batch", BATCHES)
def test_softmax_jacobian_vs_finite_differences(batch):
    rng = rng_for(batch)
    logits, _ = logits_and_labels(rng, batch)
    dp = rng.standard_normal((batch, N_OUT))
    p = bp.softmax(logits)
    dlogits = p * (dp - np.sum(dp * p, axis=1, keepdims=True))  # the vector-Jacobian product of softmax
    assert bp.rel_error(dlogits, bp.numerical_gradient(lambda v: np.sum(bp.softmax(v) * dp), logits)) < FD_TOL


@graded(2, "softmax cross-entropy")
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("scale", (1.0, 10.0))
def test_softmax_xent_backward_vs_finite_differences(batch, scale):
    rng = rng_for(batch, int(scale))
    logits, y = logits_and_labels(rng, batch, scale)
    numeric = bp.numerical_gradient(lambda v: bp.softmax_xent_forward(v, y), logits)
    assert bp.rel_error(bp.softmax_xent_backward(logits, y), numeric) < FD_TOL


@graded(2, "mlp_loss_and_grads")
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("hidden", (1, 37))
def test_mlp_grads_vs_finite_differences(batch, hidden):
    rng = rng_for(batch, hidden)
    n_in = 5  # the formulas do not depend on 784; a small input keeps the entry-by-entry differences fast
    params, x, y = small_params(rng, n_in, hidden), rng.random((batch, n_in)), rng.integers(0, N_OUT, batch)
    h = bp.linear_forward(x, params["fc1.weight"], params["fc1.bias"])
    assert np.abs(h).min() > 1e-4, "a hidden unit sits on the relu kink: finite differences would straddle it"
    _, grads = bp.mlp_loss_and_grads(params, x, y)
    for name in PARAM_NAMES:
        numeric = bp.numerical_gradient(lambda v: bp.mlp_loss_and_grads({**params, name: v}, x, y)[0], params[name])
        assert bp.rel_error(grads[name], numeric) < FD_TOL, name


# ---- each formula against torch.autograd ------------------------------------------------------


@graded(2, "linear layer")
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("n_in,n_out", LINEAR_SHAPES)
def test_linear_vs_autograd(batch, n_in, n_out):
    rng = rng_for(batch, n_in, n_out)
    x, W, b = rng.standard_normal((batch, n_in)), rng.standard_normal((n_out, n_in)), rng.standard_normal(n_out)
    dout = rng.standard_normal((batch, n_out))
    tx, tW, tb = torch_leaf(x), torch_leaf(W), torch_leaf(b)
    out = F.linear(tx, tW, tb)
    out.backward(torch.tensor(dout))
    assert bp.rel_error(bp.linear_forward(x, W, b), out.detach().numpy()) < TORCH_TOL
    for mine, ref in zip(bp.linear_backward(dout, x, W), (tx, tW, tb)):
        assert bp.rel_error(mine, ref.grad.numpy()) < TORCH_TOL


@graded(2, "ReLU")
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("hidden", (1, 37))
def test_relu_vs_autograd(batch, hidden):
    rng = rng_for(batch, hidden)
    # autograd needs no distance from the kink: it takes no finite step
    h, da = rng.standard_normal((batch, hidden)), rng.standard_normal((batch, hidden))
    th = torch_leaf(h)
    a = torch.relu(th)
    a.backward(torch.tensor(da))
    assert np.array_equal(bp.relu_forward(h), a.detach().numpy())  # a max and a multiply by 0/1 are exact
    assert np.array_equal(bp.relu_backward(da, h), th.grad.numpy())


@graded(2, "softmax cross-entropy")
@pytest.mark.parametrize("batch", BATCHES)
def test_softmax_xent_vs_autograd(batch):
    rng = rng_for(batch)
    logits, y = logits_and_labels(rng, batch)
    tlogits = torch_leaf(logits)
    loss = F.cross_entropy(tlogits, torch.tensor(y))  # reduction="mean", the loss every level trains on
    loss.backward()
    assert bp.rel_error(bp.softmax(logits), torch.softmax(tlogits, dim=1).detach().numpy()) < TORCH_TOL
    assert abs(bp.softmax_xent_forward(logits, y) - loss.item()) < TORCH_TOL * abs(loss.item())
    assert bp.rel_error(bp.softmax_xent_backward(logits, y), tlogits.grad.numpy()) < TORCH_TOL


def test_softmax_minus_onehot_identity():
    """d mean_b xent / d logits = (softmax - onehot) / B, with autograd on one side and the closed form on the other."""
    rng = rng_for(13)
    logits, y = logits_and_labels(rng, 13)
    tlogits = torch_leaf(logits)
    F.cross_entropy(tlogits, torch.tensor(y)).backward()
    closed_form = (torch.softmax(tlogits, dim=1).detach().numpy() - np.eye(N_OUT)[y]) / len(y)
    assert bp.rel_error(closed_form, tlogits.grad.numpy()) < TORCH_TOL
    # each row sums to 1 - 1 = 0: the gradient never pushes all logits of an example the same way
    assert np.allclose(closed_form.sum(axis=1), 0, atol=1e-16)


class TorchMLP(torch.nn.Module):
    """The network as level 1 writes it, with the same parameter names."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(N_IN, hidden)
        self.fc2 = torch.nn.Linear(hidden, N_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@graded(2, "mlp_loss_and_grads")
def test_mlp_loss_and_grads_vs_autograd():
    batch, hidden = 13, 37
    rng = rng_for(batch, hidden)
    params = {k: v.astype(np.float64) for k, v in init_params(seed=0, hidden=hidden).items()}
    for name in ("fc1.bias", "fc2.bias"):  # init_params zeroes the biases; non-zero ones make a bias bug visible
        params[name] = 0.1 * rng.standard_normal(params[name].shape)
    x, y = rng.random((batch, N_IN)), rng.integers(0, N_OUT, batch)

    model = TorchMLP(hidden).double()
    model.load_state_dict({k: torch.tensor(v) for k, v in params.items()})
    loss = F.cross_entropy(model(torch.tensor(x)), torch.tensor(y))
    loss.backward()

    my_loss, grads = bp.mlp_loss_and_grads(params, x, y)
    assert abs(my_loss - loss.item()) < TORCH_TOL * abs(loss.item())
    assert grads.keys() == params.keys()
    for name, p in model.named_parameters():
        assert grads[name].shape == tuple(p.shape), name
        assert bp.rel_error(grads[name], p.grad.numpy()) < TORCH_TOL, name

    lr = 0.1
    torch.optim.SGD(model.parameters(), lr=lr).step()
    for name, p in bp.sgd_update(params, grads, lr).items():
        assert bp.rel_error(p, model.state_dict()[name].numpy()) < TORCH_TOL, name


# ---- the pitfalls: each buggy variant differs from the truth, and the checks above catch it ----


def test_forgetting_one_over_batch_is_caught():
    rng = rng_for(13)
    logits, y = logits_and_labels(rng, 13)
    numeric = bp.numerical_gradient(lambda v: bp.softmax_xent_forward(v, y), logits)
    buggy = bp.buggy_softmax_xent_backward(logits, y)
    assert bp.rel_error(buggy, numeric) > 1  # it is 12 = B - 1: the finite-difference check fails
    assert np.allclose(buggy / bp.softmax_xent_backward(logits, y), 13)
    # At B = 1 the bug is invisible, which is why the shapes above include B > 1.
    one, label = logits[:1], y[:1]
    assert np.array_equal(bp.buggy_softmax_xent_backward(one, label), bp.softmax_xent_backward(one, label))


def test_relu_mask_from_wrong_tensor_is_caught():
    rng = rng_for(13, 37)
    h, da = away_from_kink(rng, (13, 37)), rng.standard_normal((13, 37))
    numeric = bp.numerical_gradient(lambda v: np.sum(bp.relu_forward(v) * da), h)
    assert bp.rel_error(bp.buggy_relu_backward(da, h), numeric) > 0.5


@pytest.mark.parametrize("n_in,n_out", LINEAR_SHAPES)
def test_transposed_weight_gradient_is_caught(n_in, n_out):
    rng = rng_for(13, n_in, n_out)
    x, W, dout = rng.standard_normal((13, n_in)), rng.standard_normal((n_out, n_in)), rng.standard_normal((13, n_out))
    _, dW, _ = bp.buggy_linear_backward(dout, x, W)
    if n_in != n_out:
        assert dW.shape != W.shape  # a shape assertion catches it for free
    else:
        assert dW.shape == W.shape  # square W: the shape is right, only the values can tell
        assert bp.rel_error(dW, bp.linear_backward(dout, x, W)[1]) > 0.5


def test_softmax_without_max_subtraction_overflows():
    rng = rng_for(100)
    logits = (100 + rng.standard_normal((13, N_OUT))).astype(np.float32)  # exp(z) overflows float32 above z ~ 88.7
    y = rng.integers(0, N_OUT, 13)
    with pytest.warns(RuntimeWarning, match="overflow"), pytest.warns(RuntimeWarning, match="invalid value"):
        unstable = bp.buggy_softmax(logits)
    assert not np.isfinite(unstable).all()  # inf / inf = nan

    # The stable versions stay finite and agree with float64 to float32 precision: each entry goes through a few
    # roundings of 2^-24 ~ 6e-8; measured 6e-8 (softmax) and 5e-8 (loss), so 1e-6 leaves a margin of ~15x.
    reference = torch.tensor(logits, dtype=torch.float64)
    stable = bp.softmax(logits)
    assert np.isfinite(stable).all()
    assert bp.rel_error(stable, torch.softmax(reference, dim=1).numpy()) < 1e-6
    loss = F.cross_entropy(reference, torch.tensor(y)).item()
    assert abs(bp.softmax_xent_forward(logits, y) - loss) < 1e-6 * abs(loss)


# ---- LeNet-5: the convolution and max-pooling (level2_theory/convolution.py) ----

from level2_theory import convolution as conv  # noqa: E402

# (N, C, H, F, k): conv1 and conv2 of LeNet at a small batch, and an odd size where an off-by-one shows.
CONV_SHAPES = ((2, 1, 12, 3, 5), (2, 6, 12, 4, 5), (3, 2, 7, 2, 3))


def conv_inputs(shape):
    n, c, h, f, k = shape
    rng = rng_for(n, c, h, f, k)
    return rng.standard_normal((n, c, h, h)), rng.standard_normal((f, c, k, k)), rng.standard_normal(f)


@pytest.mark.lenet
@pytest.mark.parametrize("shape", CONV_SHAPES)
def test_conv2d_forward_is_pytorchs_conv2d(shape):
    x, W, b = conv_inputs(shape)
    expected = F.conv2d(torch.tensor(x), torch.tensor(W), torch.tensor(b)).numpy()
    assert bp.rel_error(conv.conv2d_forward(x, W, b), expected) < TORCH_TOL
    assert bp.rel_error(conv.buggy_conv2d_forward(x, W, b), expected) > 0.5


@pytest.mark.lenet
@pytest.mark.parametrize("shape", CONV_SHAPES)
def test_conv2d_backward_vs_finite_differences_and_autograd(shape):
    x, W, b = conv_inputs(shape)
    dout = rng_for(7, *shape).standard_normal(conv.conv2d_forward(x, W, b).shape)
    dx, dW, db = conv.conv2d_backward(dout, x, W)
    for got, wrt in ((dx, x), (dW, W), (db, b)):
        def loss(value, wrt=wrt):
            args = [value if a is wrt else a for a in (x, W, b)]
            return float((conv.conv2d_forward(*args) * dout).sum())
        assert bp.rel_error(got, bp.numerical_gradient(loss, wrt)) < FD_TOL
    leaves = [torch_leaf(a) for a in (x, W, b)]
    (F.conv2d(*leaves) * torch.tensor(dout)).sum().backward()
    for got, leaf in zip((dx, dW, db), leaves):
        assert bp.rel_error(got, leaf.grad.numpy()) < TORCH_TOL
    buggy_dx = conv.buggy_conv2d_backward(dout, x, W)[0]
    assert bp.rel_error(buggy_dx, dx) > 0.5  # dx without the flipped kernel


@pytest.mark.lenet
def test_maxpool_backward_vs_finite_differences_and_autograd():
    rng = rng_for(11)
    a = rng.permutation(2 * 3 * 6 * 6).reshape(2, 3, 6, 6) / 10.0  # distinct values: no ties, a smooth function
    dout = rng.standard_normal((2, 3, 3, 3))
    out, choice = conv.maxpool_forward(a)
    da = conv.maxpool_backward(dout, choice)
    numeric = bp.numerical_gradient(lambda v: float((conv.maxpool_forward(v)[0] * dout).sum()), a, eps=1e-3)
    assert bp.rel_error(da, numeric) < FD_TOL
    leaf = torch_leaf(a)
    (F.max_pool2d(leaf, 2) * torch.tensor(dout)).sum().backward()
    assert bp.rel_error(out, F.max_pool2d(torch.tensor(a), 2).numpy()) == 0
    assert bp.rel_error(da, leaf.grad.numpy()) == 0
    assert bp.rel_error(conv.buggy_maxpool_backward(dout, choice), numeric) > 0.5


@pytest.mark.lenet
def test_a_tie_in_a_window_sends_the_gradient_to_the_first_maximum():
    """Two equal maxima: the output is the same either way, but PyTorch's gradient goes to the first."""
    a = np.array([[[[1.0, 3.0], [3.0, 0.0]]]])
    leaf = torch_leaf(a)
    F.max_pool2d(leaf, 2).sum().backward()
    assert leaf.grad.numpy().ravel().tolist() == [0, 1, 0, 0]
    assert conv.maxpool_backward(np.ones((1, 1, 1, 1)), conv.maxpool_forward(a)[1]).ravel().tolist() == [0, 1, 0, 0]
    out, choice = conv.buggy_maxpool_forward(a)
    assert out.item() == 3.0 and conv.maxpool_backward(np.ones((1, 1, 1, 1)), choice).ravel().tolist() == [0, 0, 1, 0]
