"""LeNet-5, the second network (common/lenet.py), at every level that implements it: the network is PyTorch's, each
layer of each level matches float64 from its own inputs (per layer), and each step matches level 1's (lockstep).

Small on purpose: a few steps of 16 real digits. The whole chapter run, every step verified, is
`make compare ARGS="--model lenet"`.
"""

from __future__ import annotations

import numpy as np
import pytest

from common import lenet, lenet_verify, verify
from common.levels import level, missing
from common.models import get

pytestmark = pytest.mark.lenet

# (level, convolution): level 4 has two, direct loops and im2col + matrix products.
IMPLEMENTATIONS = [
    pytest.param((3, None), marks=pytest.mark.level3, id="level3"),
    pytest.param((4, "direct"), marks=pytest.mark.level4, id="level4-direct"),
    pytest.param((4, "im2col"), marks=pytest.mark.level4, id="level4-im2col"),
]


@pytest.fixture
def make(request):
    """params -> a fresh LeNet of the implementation under test (skips where this machine cannot run it)."""
    number, convolution = request.param if hasattr(request, "param") else request.getfixturevalue("impl")
    if why := missing(level(number), "cpu", "lenet"):
        pytest.skip(f"level {number} cannot run here: {'; '.join(why)}")
    cls = level(number).load("lenet")
    return (lambda params: cls(params, convolution=convolution)) if convolution else cls


def reference(params):
    return level(1).load("lenet")(params, device="cpu")


@pytest.fixture(scope="module")
def digits(mnist):
    return mnist[0][:16], mnist[1][:16]


@pytest.fixture(scope="module")
def trained(mnist):
    """Parameters after 40 steps of level 1 (batch 16, lr 0.05): past the first steps, where nothing is near a tie."""
    model = reference(lenet.init_params(1))
    model.train_epoch(mnist[0][:640], mnist[1][:640], 16, 0.05)
    return model.state_dict()


# ---- the network ----


@pytest.mark.level1
def test_the_network_is_pytorchs_lenet5():
    net = level(1).load("lenet")(lenet.init_params(0)).net
    shapes = {name: tuple(t.shape) for name, t in net.state_dict().items()}
    assert shapes == lenet.SHAPES and list(shapes) == list(lenet.PARAM_NAMES)
    assert sum(int(np.prod(s)) for s in shapes.values()) == 44_426
    layers = [type(m).__name__ for m in net.children()]
    assert layers == ["Conv2d", "Conv2d", "Linear", "Linear", "Linear"]
    assert (net.conv1.kernel_size, net.conv1.stride, net.conv1.padding) == ((5, 5), (1, 1), (0, 0))


def test_the_initialization_is_the_mlps_by_fan_in():
    params = lenet.init_params(0)
    for name, value in params.items():
        if name.endswith("bias"):
            assert not value.any()
        else:
            bound = np.sqrt(2.0 / np.prod(value.shape[1:]))  # conv2: 6 x 5 x 5 = 150 inputs per unit
            assert value.dtype == np.float32 and np.abs(value).max() <= bound and np.abs(value).max() > 0.95 * bound
    assert all(np.array_equal(params[k], lenet.init_params(0)[k]) for k in params)


@pytest.mark.level1
def test_level1_layers_are_its_forward_pass(digits):
    model = reference(lenet.init_params(0))
    outputs, grads = model.layers(*digits)
    assert {k: v.shape[1:] for k, v in outputs.items()} == lenet.ACTIVATIONS
    np.testing.assert_array_equal(outputs["fc3"], model.forward(digits[0]))
    assert all(grads[k].shape == outputs[k].shape for k in outputs)


@pytest.mark.level1
def test_the_float64_step_is_level1s_float64_twin(digits):
    """lenet.forward64 (the verifier's yardstick, decisions exposed) against level 1's own float64 twin."""
    params = lenet.init_params(0)
    step = lenet_verify.LeNetStep(params, *digits, float(np.float32(0.05)))  # the float32 rate every level uses
    twin = level(1).load("lenet")(params, dtype="float64")
    losses = twin.train_epoch(*digits, 16, 0.05)
    assert abs(step.loss - losses[0]) <= 1e-12 * step.loss
    after = twin.state_dict()
    for name in lenet.PARAM_NAMES:
        np.testing.assert_allclose(step.params[name], after[name], rtol=0, atol=1e-12)


# ---- each level, layer by layer and step by step ----


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_every_layer_matches_float64_from_its_own_inputs(make, trained, digits, impl):
    shares, failure = lenet_verify.per_layer(make(trained).layers(*digits), reference(trained).layers(*digits),
                                             trained, *digits)
    assert failure is None, failure
    assert set(shares) >= set(lenet_verify.FORWARD) and max(shares.values()) <= 1


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_lockstep_with_level1_on_real_digits(make, trained, mnist, impl):
    X, y = mnist[0][:320], mnist[1][:320]
    records, diverged = verify.lockstep({"level": make(trained)}, trained, X, y, [np.arange(320, dtype=np.int32)], 16,
                                        0.05, model="lenet")
    record = records["level"]
    assert diverged is None and record.failure is None, record.failure
    assert len(record.used) == 20 and max(record.used) <= 1


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_partial_batch_is_a_smaller_step(make, trained, digits, impl):
    """21 rows in batches of 16: a step of 16 and one of 5, as level 1 takes them."""
    X, y = np.concatenate([digits[0], digits[0][:5]]), np.concatenate([digits[1], digits[1][:5]])
    got = make(trained).train_epoch(X, y, 16, 0.05)
    want = reference(trained).train_epoch(X, y, 16, 0.05)
    assert got.shape == (2,)
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_loss_and_grads_leave_the_parameters(make, trained, digits, impl):
    model = make(trained)
    loss, grads = model.loss_and_grads(*digits)
    assert set(grads) == set(lenet.PARAM_NAMES) and all(grads[k].shape == lenet.SHAPES[k] for k in grads)
    assert all(np.array_equal(model.state_dict()[k], trained[k]) for k in trained)
    assert np.isfinite(loss) and loss > 0


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bad_input_is_named(make, trained, digits, impl):
    model = make(trained)
    with pytest.raises(ValueError, match="784"):
        model.forward(np.zeros((2, 28, 28), dtype=np.float32))
    with pytest.raises(ValueError, match="label"):
        model.train_epoch(digits[0], np.full(16, 10), 16, 0.05)
    wrong = dict(trained, **{"conv1.weight": np.zeros((6, 1, 3, 3), dtype=np.float32)})
    with pytest.raises(ValueError, match=r"conv1\.weight.*\(6, 1, 5, 5\)"):
        make(wrong)
    with pytest.raises(ValueError, match="keys"):
        make({k: v for k, v in trained.items() if k != "fc3.bias"})


@pytest.mark.level4
def test_level4_convolutions_direct_and_im2col_agree(trained, digits):
    if why := missing(level(4), "cpu", "lenet"):
        pytest.skip("; ".join(why))
    cls = level(4).load("lenet")
    direct, im2col = (cls(trained, convolution=c).layers(*digits)[0] for c in ("direct", "im2col"))
    for name in lenet.ACTIVATIONS:
        np.testing.assert_allclose(direct[name], im2col[name], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="convolution"):
        cls(trained, convolution="fft")


def test_the_model_list_names_each_networks_parts():
    model = get("lenet")
    assert model.network is lenet and model.levels == (1, 2, 3, 4) and model.float64_step() is lenet_verify.LeNetStep
    assert "no model 'resnet'" in str(pytest.raises(KeyError, get, "resnet").value)
    assert "does not implement LeNet-5" in missing(level(5), "cpu", "lenet")[0]
