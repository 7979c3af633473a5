"""LeNet-5 served from a PyTorch state_dict (common/harness/serving.py, lenet.h's lenet_infer_*): the weights file refused with
the reason when it is not LeNet's, every level's inference forward checked layer by layer against PyTorch's forward
hooks, and the loaded batch and its CUDA graph kept right across other calls. The timing is `make infer`'s."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.harness import serving
from common.levels import level
from common.nets import get, lenet
from conftest import require

LENET = get("lenet")

pytestmark = pytest.mark.lenet

GPU = [pytest.mark.gpu]
LEVELS = [  # (level, convolution): level 4 on the CPU, and every GPU level's forward
    pytest.param((4, "direct"), marks=pytest.mark.level4, id="level4"),
    pytest.param((5, "direct"), marks=[pytest.mark.level5, *GPU], id="level5-direct"),
    pytest.param((5, "tiled"), marks=[pytest.mark.level5, *GPU], id="level5-tiled"),
    pytest.param((6, "direct"), marks=[pytest.mark.level6, *GPU], id="level6"),
    pytest.param((7, "direct"), marks=[pytest.mark.level7, *GPU], id="level7-fused"),
]


@pytest.fixture
def make(request, impl):
    number, convolution = impl
    require(level(number), "cpu" if number == 4 else "cuda", request.config, LENET)
    return lambda params: level(number).load(LENET)(params, convolution=convolution)


@pytest.fixture(scope="module")
def trained(mnist):
    """Parameters after 60 steps of level 1: the ReLUs and pools decide, the logits are far from 0."""
    model = level(1).load(LENET)(lenet.init_params(2))
    model.train_epoch(mnist[0][:960], mnist[1][:960], 16, 0.05)
    return model.state_dict()


@pytest.fixture(scope="module")
def test_digits(mnist):
    return mnist[2][:600], mnist[3][:600]


# ---- the weights file ----


def save(tmp_path, state) -> str:
    path = tmp_path / "weights.pt"
    torch.save(state, path)
    return path


def torch_state(params):
    return {k: torch.from_numpy(v.copy()) for k, v in params.items()}


@pytest.mark.level1
def test_a_saved_state_dict_loads_as_it_was(tmp_path, trained):
    net = serving.pytorch_net(trained, "cpu")
    loaded = serving.load_weights(save(tmp_path, net.state_dict()))
    assert list(loaded) == list(lenet.PARAM_NAMES)
    for name in lenet.PARAM_NAMES:
        np.testing.assert_array_equal(loaded[name], trained[name])
        assert loaded[name].dtype == np.float32 and loaded[name].flags.c_contiguous


BAD_FILES = {  # what is wrong -> (how the state is spoiled, the error, words the message must hold)
    "missing": (lambda s: s.pop("fc3.bias"), ValueError, "missing ['fc3.bias']"),
    "prefixed": (lambda s: s.update({f"module.{k}": s.pop(k) for k in list(s)}), ValueError, "unexpected ['module."),
    "extra": (lambda s: s.update({"fc4.weight": torch.zeros(2)}), ValueError, "unexpected ['fc4.weight']"),
    "shape": (lambda s: s.update({"conv2.weight": torch.zeros(16, 6, 3, 3)}), ValueError,
              "conv2.weight has shape (16, 6, 3, 3)"),
    "float64": (lambda s: s.update({"fc1.weight": s["fc1.weight"].double()}), TypeError, "fc1.weight is torch.float64"),
    "float16": (lambda s: s.update({"conv1.bias": s["conv1.bias"].half()}), TypeError, "model.float()"),
    "nan": (lambda s: s["fc2.bias"].__setitem__(3, float("nan")), ValueError, "fc2.bias contains NaN"),
    "not a tensor": (lambda s: s.update({"fc2.bias": [0.0] * 84}), TypeError, "fc2.bias is a list"),
}


@pytest.mark.level1
@pytest.mark.parametrize("what", BAD_FILES)
def test_a_bad_weights_file_is_refused_with_the_reason(tmp_path, trained, what):
    spoil, error, words = BAD_FILES[what]
    state = torch_state(trained)
    spoil(state)
    with pytest.raises(error) as caught:
        serving.load_weights(save(tmp_path, state))
    assert words in str(caught.value) and "weights.pt" in str(caught.value)


@pytest.mark.level1
@pytest.mark.parametrize("args, words", [(["--batches", "1,a"], "comma-separated batch sizes"),
                                         (["--batches", "0"], "every batch size >= 1"),
                                         (["--calls", "10"], "--calls must be >= 100")])
def test_bad_arguments_are_refused_before_anything_runs(args, words, capsys):
    with pytest.raises(SystemExit):
        serving.main(args)
    assert words in capsys.readouterr().err


def test_files_that_are_not_a_state_dict_are_refused(tmp_path, trained):
    with pytest.raises(FileNotFoundError, match="no such weights file"):
        serving.load_weights(tmp_path / "absent.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="not a PyTorch file of tensors"):
        serving.load_weights(tmp_path / "junk.pt")
    with pytest.raises(ValueError, match="holds a list, not a state_dict"):
        serving.load_weights(save(tmp_path, list(torch_state(trained).values())))
    with pytest.raises(ValueError, match="not a PyTorch file of tensors"):  # a whole module pickled: code, refused
        serving.load_weights(save(tmp_path, serving.pytorch_net(trained, "cpu")))


# ---- every level's inference forward ----


@pytest.mark.parametrize("impl", LEVELS)
def test_every_layer_matches_pytorchs_forward_hooks(make, trained, test_digits, impl):
    X, labels = test_digits
    net = serving.pytorch_net(trained, "cpu")
    logits = serving.pytorch_logits(net, X)
    layers = serving.hooked_layers(net, X[:serving.CHECK_DIGITS])
    check = serving.check_level(make(trained), trained, X, labels, layers, logits)
    assert check["failure"] is None, check["failure"]
    assert check["per_layer"] <= 1 and abs(check["accuracy"] - (logits.argmax(1) == labels).mean()) < 0.01


@pytest.mark.level4
def test_the_per_layer_check_sees_a_wrong_weight(request, trained, test_digits):
    """Sharpness: a level whose conv2 bias is off by 1e-4 in one filter fails at conv2, not later."""
    require(level(4), "cpu", request.config, LENET)
    X, labels = test_digits
    wrong = {k: v.copy() for k, v in trained.items()}
    wrong["conv2.bias"][5] += 1e-4
    net = serving.pytorch_net(trained, "cpu")
    check = serving.check_level(level(4).load(LENET)(wrong), trained, X, labels,
                              serving.hooked_layers(net, X[:serving.CHECK_DIGITS]), serving.pytorch_logits(net, X))
    assert check["failure"] and check["failure"].startswith("per layer: conv2's output")


@pytest.mark.parametrize("impl", LEVELS)
def test_inference_is_the_forward_pass_and_keeps_its_batch(make, trained, mnist, impl):
    """Bit for bit the level's forward(), at sizes that cut blocks and chunks (1, 37, 1,030); the loaded batch and its
    graph survive other calls in between, and a larger batch or a training step that moves buffers."""
    model = make(trained)
    X = mnist[0][:1030]
    with pytest.raises(RuntimeError, match="no batch loaded"):
        model.infer_run()
    for rows in (1, 37, 1030, 37):
        model.infer_load(X[:rows])
        first = model.infer_run()
        np.testing.assert_array_equal(first, model.forward(X[:rows]))
        model.layers(X[:200], mnist[1][:200])  # a larger batch elsewhere: the graph's buffers move
        model.forward(X[500:600])
        np.testing.assert_array_equal(model.infer_run(), first)
        np.testing.assert_array_equal(model.infer_layers()["fc3"], first)
        assert model.infer_run(logits=False) is None
    model.train_epoch(X[:64], mnist[1][:64], 32, 0.05)  # new parameters: the next run uses them
    np.testing.assert_array_equal(model.infer_run(), model.forward(X[:37]))


@pytest.mark.parametrize("impl", LEVELS)
def test_bad_inference_input_is_named(make, trained, impl):
    model = make(trained)
    with pytest.raises(TypeError, match="float32"):
        model.infer_load(np.zeros((2, 784)))
    with pytest.raises(ValueError, match=r"shape \(N, 784\)"):
        model.infer_load(np.zeros((2, 28, 28), dtype=np.float32))
    with pytest.raises(ValueError, match="empty"):
        model.infer_load(np.zeros((0, 784), dtype=np.float32))
