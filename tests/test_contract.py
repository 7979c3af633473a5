"""Bad input through the public API of every level: a clear exception naming the problem, never a crash or a silent wrong answer."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from common.native import NativeError, NativeMLP
from common.nets.mlp import init_params
from conftest import ALL, NATIVE, implementation_params

every_level = pytest.mark.parametrize("impl", implementation_params(ALL))

rng = np.random.default_rng(0)
X = rng.standard_normal((16, 784)).astype(np.float32)
y = rng.integers(0, 10, 16)


def nan_at(a: np.ndarray, index) -> np.ndarray:
    a = a.copy()
    a[index] = np.nan
    return a


BAD_X = [
    pytest.param(X.astype(np.float64), TypeError, "float32", id="float64"),
    pytest.param(X.tolist(), TypeError, "numpy array", id="list"),
    pytest.param(X[:, :700].copy(), ValueError, "shape", id="wrong-width"),
    pytest.param(X.reshape(16, 28, 28), ValueError, "shape", id="3-d"),
    pytest.param(np.asfortranarray(X), ValueError, "C-contiguous", id="fortran-order"),
    pytest.param(X[::2], ValueError, "C-contiguous", id="strided"),
    pytest.param(nan_at(X, (3, 5)), ValueError, "NaN", id="nan"),
    pytest.param(X[:0], ValueError, "empty", id="empty"),
]


@every_level
@pytest.mark.parametrize("bad, error, words", BAD_X)
def test_bad_X_is_refused_by_every_method(factory, bad, error, words):
    model = factory(init_params(0, 8))
    n = len(bad) if hasattr(bad, "__len__") else 16
    labels = y[:n]
    for call in (lambda: model.forward(bad), lambda: model.loss_and_grads(bad, labels), lambda: model.train_epoch(bad, labels, 4, 0.1)):
        with pytest.raises(error, match=words):
            call()
    np.testing.assert_array_equal(model.state_dict()["fc1.weight"], init_params(0, 8)["fc1.weight"])


BAD_Y = [
    pytest.param(np.where(np.arange(16) == 3, 10, y), ValueError, r"labels must be in \[0, 10\)", id="label-10"),
    pytest.param(np.where(np.arange(16) == 3, -1, y), ValueError, r"labels must be in \[0, 10\)", id="label-negative"),
    pytest.param(y.astype(np.float32), TypeError, "integer", id="float-labels"),
    pytest.param(y[:15], ValueError, "shape", id="too-few"),
    pytest.param(y.reshape(16, 1), ValueError, "shape", id="2-d"),
]


@every_level
@pytest.mark.parametrize("bad, error, words", BAD_Y)
def test_bad_labels_are_refused(factory, bad, error, words):
    model = factory(init_params(0, 8))
    with pytest.raises(error, match=words):
        model.loss_and_grads(X, bad)
    with pytest.raises(error, match=words):
        model.train_epoch(X, bad, 4, 0.1)


@every_level
@pytest.mark.parametrize(
    "batch_size, lr, order, words",
    [
        (0, 0.1, None, "batch_size"),
        (-3, 0.1, None, "batch_size"),
        (2.5, 0.1, None, "batch_size"),
        (4, float("nan"), None, "lr"),
        (4, -1.0, None, "lr"),
        (4, 0.1, np.array([0, 16]), r"order indexes rows"),
        (4, 0.1, np.array([-1, 2]), r"order indexes rows"),
        (4, 0.1, np.array([], dtype=np.int64), "order"),
        (4, 0.1, np.array([0.0, 1.0]), "order"),
    ],
)
def test_bad_training_arguments_are_refused(factory, batch_size, lr, order, words):
    with pytest.raises(ValueError, match=words):
        factory(init_params(0, 8)).train_epoch(X, y, batch_size, lr, order)


@every_level
@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda p: p.pop("fc2.bias"), ValueError, "keys"),
        (lambda p: p.update({"fc2.weight": p["fc2.weight"][:, :5]}), ValueError, "shape"),
        (lambda p: p.update({"fc1.bias": p["fc1.bias"][:3]}), ValueError, "shape"),
        (lambda p: p.update({"fc1.weight": p["fc1.weight"].astype(int)}), TypeError, "floating"),
        (lambda p: p["fc2.weight"].__setitem__((0, 0), np.inf), ValueError, "NaN or infinity"),
    ],
)
def test_bad_params_are_refused(factory, change, error, words):
    params = init_params(0, 8)
    change(params)
    with pytest.raises(error, match=words):
        factory(params)


@every_level
def test_labels_as_int64_and_params_as_float64_are_converted(factory):
    """The documented conversions: integer labels of any width, floating params of any width."""
    params = {k: v.astype(np.float64) for k, v in init_params(0, 8).items()}
    loss, _ = factory(params).loss_and_grads(X, y.astype(np.int64))
    loss32, _ = factory(init_params(0, 8)).loss_and_grads(X, y.astype(np.int32))
    assert loss == loss32


@pytest.mark.parametrize("impl", implementation_params(NATIVE))
def test_native_model_after_close_raises(factory):
    model = factory(init_params(0, 8))
    assert isinstance(model, NativeMLP)
    model.close()
    for call in (model.close, lambda: model.forward(X), lambda: model.state_dict(), lambda: model.train_epoch(X, y, 4, 0.1)):
        with pytest.raises(NativeError, match="closed"):
            call()


@every_level
def test_a_model_is_freed_as_soon_as_it_is_dropped(factory):
    """No reference cycles: memory (on a GPU, device memory) comes back with the last reference, not at a later gc."""
    model = factory(init_params(0, 8))
    model.train_epoch(X, y, 4, 0.1)
    ref = weakref.ref(model)
    del model
    assert ref() is None, f"still referenced by {[type(r).__name__ for r in gc.get_referrers(ref())]}"


@pytest.mark.parametrize("impl", implementation_params(NATIVE))
def test_a_thousand_models_leak_nothing(factory, impl):
    """Create and free models in a loop: the process may not grow, and a GPU level must hold exactly the device buffers
    it held before (its own count, mlp_device_buffers(): whatever else runs on the GPU cannot disturb it)."""
    params = init_params(0, 256)

    def cycle(count: int) -> int:
        for _ in range(count):
            m = factory(params)
            m.train_epoch(X, y, 8, 0.1)
            buffers = m.lib.mlp_device_buffers()
            m.close()
        gc.collect()
        return buffers

    lib = factory(params).lib  # the model is freed at once; its library stays loaded
    cycle(50)  # warm up allocator pools and caches
    before, held = resident_mb(), lib.mlp_device_buffers()
    while_alive = cycle(1000)
    assert resident_mb() - before < 20, "the process grew by more than 20 MB over 1,000 models"
    assert lib.mlp_device_buffers() == held
    if impl[1] == "cuda":
        assert while_alive > held  # the count sees a live model's buffers


def resident_mb() -> float:
    """This process's resident memory (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@every_level
@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda p: p.pop("fc1.bias"), ValueError, "keys"),
        (lambda p: p.update({k: v[:4] if k.startswith("fc1") else v[:, :4] if k == "fc2.weight" else v for k, v in p.items()}),
         ValueError, "shape"),  # a model of 4 hidden units into one of 8
        (lambda p: p["fc1.weight"].__setitem__((0, 0), np.nan), ValueError, "NaN or infinity"),
        (lambda p: p.update({"fc2.bias": p["fc2.bias"].astype(np.int32)}), TypeError, "floating"),
    ],
    ids=["missing-key", "other-hidden-size", "nan", "integer"],
)
def test_load_state_dict_refuses_bad_params_and_keeps_the_old_ones(factory, change, error, words):
    model = factory(init_params(0, 8))
    params = init_params(1, 8)
    change(params)
    with pytest.raises(error, match=words):
        model.load_state_dict(params)
    np.testing.assert_array_equal(model.state_dict()["fc1.weight"], init_params(0, 8)["fc1.weight"])


@every_level
def test_load_state_dict_replaces_the_parameters(factory):
    model = factory(init_params(0, 8))
    model.train_epoch(X, y, 4, 0.1)
    model.load_state_dict(init_params(1, 8))
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, init_params(1, 8)[name], err_msg=name)
    loss, _ = model.loss_and_grads(X, y)
    assert loss == factory(init_params(1, 8)).loss_and_grads(X, y)[0]
