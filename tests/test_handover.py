"""How a training set reaches a level: checked and uploaded once (common.harness.data.dataset), checked and copied at every
epoch (a NumPy array that can change), or read in place on the GPU (arrays on a CUDA device: PyTorch, CuPy, Numba,
DLPack; common/contract/device_arrays.py, mlp_use_device_data in common/native/mlp.h).

The CPU tests check the handle, the cache, and every refusal made before native code sees a pointer: fake device
arrays (a __cuda_array_interface__ dict, and NumPy's own DLPack capsule dressed as a CUDA one). The GPU tests hand
PyTorch CUDA tensors to levels 5, 6 and 7; they skip, with the reason, where there is no GPU.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np
import pytest

from common.contract import REUPLOAD, immutable, is_immutable
from common.contract.device_arrays import device_array
from common.harness.data import dataset
from common.levels import level
from common.native import NativeMLP
from common.nets import get, lenet
from common.nets.mlp import init_params
from conftest import ALL, NATIVE, implementation_params, require

LENET = get("lenet")

every_level = pytest.mark.parametrize("impl", implementation_params(ALL))
native_levels = pytest.mark.parametrize("impl", implementation_params(NATIVE))
gpu_levels = pytest.mark.parametrize("impl", implementation_params([(level(n), "cuda") for n in (5, 6, 7)]))

rng = np.random.default_rng(0)
X = rng.standard_normal((16, 784)).astype(np.float32)
y = rng.integers(0, 10, 16)


def same_params(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in a)


# ---- 1. the handle: a training set checked once, uploaded once ----

def test_a_dataset_is_checked_once_and_nothing_can_change_it():
    data = dataset(X, y)
    assert data.X.dtype == np.float32 and data.y.dtype == np.int32 and is_immutable(data.X) and is_immutable(data.y)
    np.testing.assert_array_equal(data.X, X)
    np.testing.assert_array_equal(data.y, y)
    for array in data:
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 0
        with pytest.raises(ValueError, match="WRITEABLE"):
            array.flags.writeable = True
    already = immutable(X)
    assert dataset(already, y).X is already  # nothing copied that is already immutable
    with pytest.raises(TypeError, match="float32"):
        dataset(X.astype(np.float64), y)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\)"):
        dataset(X, np.full(16, 10))


@native_levels
def test_a_dataset_is_uploaded_once_and_a_writeable_array_at_every_epoch(factory, monkeypatch):
    uploads = []
    upload = NativeMLP._upload
    monkeypatch.setattr(NativeMLP, "_upload", lambda self, X, y: uploads.append(len(X)) or upload(self, X, y))
    model = factory(init_params(0, 8))
    data = dataset(X, y)
    for _ in range(3):
        model.train_epoch(*data, 4, 0.1)
    assert len(uploads) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a GPU level's warning: the next test's
        for _ in range(3):
            model.train_epoch(X, y, 4, 0.1)
    assert len(uploads) == 4  # every call: a writeable array may have changed


@native_levels
def test_a_gpu_level_warns_once_that_an_array_that_can_change_is_uploaded_at_every_epoch(factory, impl):
    model = factory(init_params(0, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: once per line of the caller
        for _ in range(3):
            model.train_epoch(X, y, 4, 0.1)
        model.train_epoch(*dataset(X, y), 4, 0.1)
    assert [str(w.message) for w in caught] == ([REUPLOAD] if impl[1] == "cuda" else [])
    assert not caught or caught[0].filename == __file__  # it points at the caller's line


# ---- 2. device arrays refused before any native call ----

class FakeCUDA:
    """An object that says it is on a CUDA device, through a CUDA array interface of our making."""

    def __init__(self, interface):
        self.__cuda_array_interface__ = interface


class FakeDLPack:
    """A NumPy array exported through DLPack, its device given as CUDA: what the reader parses is a real capsule."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __dlpack_device__(self):
        return 2, 0  # kDLCUDA, device 0

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)


def cai(shape, typestr, **change) -> FakeCUDA:
    """A CUDA array interface (version 3), as CuPy gives one, with some of its entries changed."""
    return FakeCUDA({"shape": shape, "typestr": typestr, "data": (0x7F0000000000, False), "version": 3,
                     "strides": None, "stream": 1, **change})


GOOD_X, GOOD_Y = cai((16, 784), "<f4"), cai((16,), "<i4")
BAD_DEVICE_DATA = [
    pytest.param(cai((16, 784), "<f8"), GOOD_Y, TypeError, "X is float64 on the device: pass float32", id="X-float64"),
    pytest.param(cai((16, 784), "zz"), GOOD_Y, TypeError, "not a NumPy type string", id="X-typestr"),
    pytest.param(cai((16, 700), "<f4"), GOOD_Y, ValueError, r"shape \(N, 784\)", id="X-shape"),
    pytest.param(cai((16, 784, 1), "<f4"), GOOD_Y, ValueError, r"shape \(N, 784\)", id="X-3-d"),
    pytest.param(cai((0, 784), "<f4"), GOOD_Y, ValueError, "empty", id="X-empty"),
    pytest.param(cai((16, 784), "<f4", strides=(4, 64)), GOOD_Y, ValueError, "X on the device must be C-contiguous",
                 id="X-fortran-order"),
    pytest.param(cai((16, 784), "<f4", strides=(6272, 4)), GOOD_Y, ValueError, "C-contiguous", id="X-every-other-row"),
    pytest.param(cai((16, 784), "<f4", version=4), GOOD_Y, ValueError, "version 4; this reader knows versions 2 and 3",
                 id="X-version-4"),
    pytest.param(cai((16, 784), "<f4", version=1), GOOD_Y, ValueError, "version 1", id="X-version-1"),
    pytest.param(cai((16, 784), "<f4", mask=GOOD_Y), GOOD_Y, ValueError, "masked", id="X-masked"),
    pytest.param(FakeCUDA({"shape": (16, 784), "typestr": "<f4"}), GOOD_Y, TypeError,
                 "must be a dict with shape, typestr, data and version", id="X-no-data"),
    pytest.param(GOOD_X, cai((16,), "<i8"), TypeError,
                 r"labels are int64 on the device: pass int32 labels \(PyTorch: y.int\(\)\)", id="y-int64"),
    pytest.param(GOOD_X, cai((16,), "<f4"), TypeError, "labels are float32 on the device", id="y-float32"),
    pytest.param(GOOD_X, cai((15,), "<i4"), ValueError, r"y must have shape \(16,\) to match X", id="y-too-few"),
    pytest.param(GOOD_X, cai((16,), "<i4", strides=(8,)), ValueError, "y on the device must be C-contiguous",
                 id="y-strided"),
    pytest.param(GOOD_X, y, TypeError, "X is an array on a CUDA device and y is not", id="y-numpy"),
    pytest.param(X, GOOD_Y, TypeError, "y is an array on a CUDA device and X is not", id="X-numpy"),
    pytest.param(FakeDLPack(X.astype(np.float64)), GOOD_Y, TypeError, "X is float64 on the device",
                 id="dlpack-float64"),
    pytest.param(FakeDLPack(np.asfortranarray(X)), GOOD_Y, ValueError, "C-contiguous", id="dlpack-fortran-order"),
    pytest.param(GOOD_X, FakeDLPack(y.astype(np.int64)), TypeError, "labels are int64 on the device",
                 id="dlpack-y-int64"),
]


@pytest.mark.parametrize("impl", implementation_params([pair for pair in NATIVE if pair[0].number in (4, 5)]))
@pytest.mark.parametrize("bad_X, bad_y, error, words", BAD_DEVICE_DATA)
def test_a_bad_device_array_is_refused_before_native_code_sees_it(factory, bad_X, bad_y, error, words, monkeypatch):
    model = factory(init_params(0, 8))
    monkeypatch.setattr(NativeMLP, "_use_device", lambda self, data: pytest.fail("handed to native code"))
    with pytest.raises(error, match=words):
        model.train_epoch(bad_X, bad_y, 4, 0.1)
    assert same_params(model.state_dict(), init_params(0, 8))


def test_both_protocols_are_read_as_they_describe_the_memory():
    rows = np.zeros((5, 784), dtype=np.float32)
    dlpack = device_array(FakeDLPack(rows[2:]), "X")
    assert (dlpack.pointer, dlpack.dtype, dlpack.shape) == (rows.ctypes.data + 2 * 784 * 4, "float32", (3, 784))
    assert dlpack.contiguous(4) and not device_array(FakeDLPack(rows.T), "X").contiguous(4)
    interface = device_array(cai((3, 784), "<f4", strides=(3136, 4)), "X")
    assert (interface.pointer, interface.dtype, interface.shape) == (0x7F0000000000, "float32", (3, 784))
    assert interface.contiguous(4)
    assert device_array(X, "X") is None  # NumPy speaks DLPack too, from the CPU


@pytest.mark.parametrize("impl", implementation_params([pair for pair in NATIVE if pair[0].number == 4]))
def test_level4_refuses_device_arrays_and_trains_on_afterwards(factory):
    model = factory(init_params(0, 8))
    with pytest.raises(ValueError, match="level 4 runs on the CPU: hand it NumPy arrays"):
        model.train_epoch(GOOD_X, GOOD_Y, 4, 0.1)
    np.testing.assert_array_equal(model.train_epoch(X, y, 4, 0.1), factory(init_params(0, 8)).train_epoch(X, y, 4, 0.1))


@every_level
def test_only_the_mlps_gpu_levels_take_device_arrays_and_the_others_say_so(factory, impl):
    model = factory(init_params(0, 8))
    words = r"X is an array on a CUDA device; here only NumPy arrays are read: pass X.cpu\(\).numpy\(\)"
    for call in (lambda: model.forward(GOOD_X), lambda: model.loss_and_grads(GOOD_X, GOOD_Y)):
        with pytest.raises(TypeError, match=words):
            call()
    if not impl[0].library_for():  # levels 1 and 3; the native levels' train_epoch is the tests' above
        with pytest.raises(TypeError, match=words + ".*MLP's GPU levels"):
            model.train_epoch(GOOD_X, GOOD_Y, 4, 0.1)


@pytest.mark.lenet
@pytest.mark.parametrize("number, device", [pytest.param(4, "cpu", marks=pytest.mark.level4, id="level4"),
                                            pytest.param(5, "cuda", marks=[pytest.mark.level5, pytest.mark.gpu],
                                                         id="level5")])
def test_lenet_takes_numpy_arrays_only(number, device, request):
    require(level(number), device, request.config, LENET)
    model = level(number).load(LENET)(lenet.init_params(0))
    with pytest.raises(TypeError, match="read in place by train_epoch of the MLP's GPU levels"):
        model.train_epoch(GOOD_X, GOOD_Y, 4, 0.1)


# ---- 3. on a GPU: PyTorch's CUDA tensors, read in place ----

@pytest.fixture
def on_gpu(mnist):
    """512 real digits as NumPy arrays (writeable copies) and as PyTorch CUDA tensors (float32, int32)."""
    import torch

    X_np, y_np = np.array(mnist[0][:512]), mnist[1][:512].astype(np.int32)
    return X_np, y_np, torch.from_numpy(X_np).cuda(), torch.from_numpy(y_np).cuda()


def epochs(model, X, y, count: int = 2, lr: float = 0.05, rows: int = 512) -> np.ndarray:
    """Every step's loss over `count` shuffled epochs of the fixture's 512 rows (the same orders for every model),
    batch 32."""
    rng = np.random.default_rng(1)
    return np.concatenate([model.train_epoch(X, y, 32, lr, rng.permutation(rows)) for _ in range(count)])


@gpu_levels
def test_torch_cuda_tensors_train_bit_identically_to_numpy(factory, on_gpu):
    X_np, y_np, X_dev, y_dev = on_gpu
    params = init_params(0, 64)
    on_device, on_host = factory(params), factory(params)
    expected = epochs(on_host, *dataset(X_np, y_np))
    np.testing.assert_array_equal(epochs(on_device, X_dev, y_dev), expected)  # the same bytes: the same steps
    assert same_params(on_device.state_dict(), on_host.state_dict())


@gpu_levels
def test_device_arrays_are_read_in_place_not_uploaded(factory, on_gpu):
    """The library's own count of its device buffers: the NumPy data set costs two (X and y), device arrays none."""
    X_np, y_np, X_dev, y_dev = on_gpu
    lib = factory(init_params(0, 64)).lib

    def buffers_taken(X, y) -> int:
        before = lib.mlp_device_buffers()
        model = factory(init_params(0, 64))
        model.train_epoch(X, y, 32, 0.05)
        return lib.mlp_device_buffers() - before

    assert buffers_taken(*dataset(X_np, y_np)) - buffers_taken(X_dev, y_dev) == 2


@gpu_levels
def test_the_model_holds_device_arrays_while_it_reads_them(factory, on_gpu):
    import torch

    X_np, y_np, _, y_dev = on_gpu
    X_dev = torch.from_numpy(X_np).cuda()  # this test's own: the fixture holds its tensors to the end
    model = factory(init_params(0, 64))
    model.train_epoch(X_dev, y_dev, 32, 0.05)
    held = weakref.ref(X_dev)
    del X_dev
    gc.collect()
    assert held() is not None  # the model still reads its memory
    model.train_epoch(*dataset(X_np, y_np), 32, 0.05)
    gc.collect()
    assert held() is None  # let go once the model reads another data set


@gpu_levels
def test_labels_are_checked_on_the_device_at_every_epoch(factory, on_gpu):
    """A label written out of range after an epoch is refused by the next one (never read past a row), and so is a
    NaN in X; the model is left as it was, and trains again once the data is mended."""
    _, _, X_dev, y_dev = on_gpu
    model = factory(init_params(0, 64))
    model.train_epoch(X_dev, y_dev, 32, 0.05)
    before = model.state_dict()
    y_dev[5] = 10
    with pytest.raises(ValueError, match=r"label y\[5\] = 10 is outside \[0, 10\) \(checked on the device\)"):
        model.train_epoch(X_dev, y_dev, 32, 0.05)
    y_dev[5], X_dev[7, 3] = 3, float("nan")
    with pytest.raises(ValueError, match=r"x\[7, 3\] is NaN or infinity"):
        model.train_epoch(X_dev, y_dev, 32, 0.05)
    assert same_params(model.state_dict(), before)
    X_dev[7, 3] = 0.0
    assert np.isfinite(model.train_epoch(X_dev, y_dev, 32, 0.05)).all()


@gpu_levels
def test_x_changed_in_place_is_seen_even_while_another_stream_still_writes_it(factory, on_gpu):
    """The write is queued behind a sleep on another stream when train_epoch starts: the level must wait for it."""
    import torch

    X_np, y_np, X_dev, y_dev = on_gpu
    params = init_params(0, 64)
    model = factory(params)
    first = epochs(model, X_dev, y_dev, 1, lr=0.0)  # lr 0: only X differs between the two epochs
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda._sleep(100_000_000)  # about 50 ms of the GPU's clock
        X_dev.mul_(0.5)
    second = epochs(model, X_dev, y_dev, 1, lr=0.0)
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(second, epochs(factory(params), *dataset(X_np * np.float32(0.5), y_np), 1, lr=0.0))


class DLPackOnly:
    """A tensor that speaks DLPack and nothing else."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        return self.tensor.__dlpack__(**kwargs)


@gpu_levels
def test_dlpack_arrays_train_as_numpy_does(factory, on_gpu):
    X_np, y_np, X_dev, y_dev = on_gpu
    params = init_params(0, 64)
    expected = epochs(factory(params), *dataset(X_np, y_np))
    np.testing.assert_array_equal(epochs(factory(params), DLPackOnly(X_dev), DLPackOnly(y_dev)), expected)


@gpu_levels
def test_device_arrays_the_levels_cannot_read_in_place_are_refused(factory, on_gpu):
    import torch

    X_np, _, X_dev, y_dev = on_gpu
    model = factory(init_params(0, 64))
    with pytest.raises(TypeError, match=r"labels are int64 on the device: pass int32 labels \(PyTorch: y.int\(\)\)"):
        model.train_epoch(X_dev, y_dev.long(), 32, 0.05)
    with pytest.raises(ValueError, match=r"X on the device must be C-contiguous.*X.contiguous\(\)"):
        model.train_epoch(X_dev.t().contiguous().t(), y_dev, 32, 0.05)
    shifted = torch.zeros(X_dev.numel() + 1, device="cuda")[1:].view(X_dev.shape)  # 4 bytes past an allocation's start
    with pytest.raises(ValueError, match="x must start at a multiple of 16 bytes"):
        model.train_epoch(shifted, y_dev, 32, 0.05)
    host = cai(X_np.shape, "<f4", data=(X_np.ctypes.data, False))  # host memory, said to be on the device
    with pytest.raises(ValueError, match="is not memory of the current CUDA device"):
        model.train_epoch(host, y_dev, 32, 0.05)
    assert same_params(model.state_dict(), init_params(0, 64))
