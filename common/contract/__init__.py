"""Input checks shared by every level, so bad input raises the same clear exception everywhere.

The level contract (every level's `MLP` has exactly these methods):
    MLP(params, **level_options)
    .train_epoch(X, y, batch_size, lr, order=None) -> losses (steps,) float32, each before its step's update
    .loss_and_grads(X, y) -> (loss, grads keyed like params)
    .forward(X) -> logits (N, 10) float32
    .state_dict() -> float32 copies of the params, PyTorch names and layouts
    .load_state_dict(params) -> None: replace the parameters (same hidden size), as PyTorch's does
A level that trains with more than SGD (common/nets/optimizers.py: levels 1, 3 and 8) also takes optimizer="adam" (SGD
is the default), reports it in variant(), and exposes its optimizer's state so that a verifier can start each step
from another's (common/harness/verify.py's lockstep):
    .optimizer_state() -> {parameter name: {"step": steps taken, "exp_avg": m, "exp_avg_sq": v}}: PyTorch's state by
        parameter name, copies (float32, as the parameters); {} before the first step, and for SGD, which keeps none
    .load_optimizer_state(state) -> None: replace it (the same form; {} forgets it); nothing changes unless it all fits

Conversions are few and documented: params and labels are copied to float32 / int32, and every check is
made on the values the level will use (a float64 parameter of 1e39 is refused: it would be inf in float32).
X must already be float32 and C-contiguous (a silent copy of a 60,000-image array would hide a cost).
A batch_size larger than the epoch is the whole epoch, one step, at every level.
The MLP's GPU levels also take X and y on a CUDA device in train_epoch (check_device_data), read in place.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from common.contract.device_arrays import DeviceArray, device_array, on_device
from common.nets import mlp
from common.nets.mlp import N_IN, N_OUT
from common.nets.optimizers import OPTIMIZERS, Optimizer


def check_params(params: dict[str, np.ndarray], hidden: int | None = None, network=mlp) -> dict[str, np.ndarray]:
    """Validate names, shapes and values; return C-contiguous float32 copies. network: the module that defines the
    network (common.nets.mlp, the MLP, whose hidden size is as given or as fc1.weight says; common.nets.lenet)."""
    names = network.PARAM_NAMES
    if not isinstance(params, dict) or set(params) != set(names):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"params must be a dict with keys {list(names)}, got {got}")
    if network is mlp and hidden is None:
        hidden = np.shape(params["fc1.weight"])[0] if np.ndim(params["fc1.weight"]) == 2 else -1
        if hidden == 0:
            raise ValueError("params['fc1.weight'] has 0 rows: a model needs at least 1 hidden unit")
    out = {}
    for name, shape in network.param_shapes(hidden).items():
        value = np.asarray(params[name])
        if (network is mlp and hidden < 1) or value.shape != shape:
            raise ValueError(f"params[{name!r}] has shape {value.shape}, expected {shape}")
        if not np.issubdtype(value.dtype, np.floating):
            raise TypeError(f"params[{name!r}] must be floating point, got {value.dtype}")
        with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes inf: refused just below
            out[name] = np.array(value, dtype=np.float32, order="C")
        if not np.isfinite(out[name]).all():
            raise ValueError(f"params[{name!r}] contains NaN or infinity (as float32, the type every level uses)")
    return out


def check_optimizer(name: str) -> Optimizer:
    """The entry of common/nets/optimizers.py that a level's optimizer= names."""
    for optimizer in OPTIMIZERS:
        if name == optimizer.name:
            return optimizer
    raise ValueError(f"optimizer must be one of {[o.name for o in OPTIMIZERS]}, got {name!r}")


def check_optimizer_state(state: dict, params: dict[str, np.ndarray], optimizer: Optimizer,
                          dtype=np.float32) -> dict[str, dict]:
    """Validate an optimizer state for a model's parameters `params` (by name): {} (none), or for every parameter the
    optimizer's state (its keys, PyTorch's names): "step", the steps taken (an integer >= 1, the same for every
    parameter: they step together), and each array of the parameter's shape, finite as `dtype` ("exp_avg_sq", an
    average of squares, >= 0). Returns copies, the arrays as `dtype`."""
    if not isinstance(state, dict):
        raise TypeError(f"an optimizer state is a dict {{parameter name: its state}}, got {type(state).__name__}")
    if not state:
        return {}
    if not optimizer.state:
        raise ValueError(f"{optimizer.title} keeps no state, got one for {sorted(state)}")
    if set(state) != set(params):
        raise ValueError(f"an optimizer state has an entry for every parameter, {list(params)}; got {sorted(state)}")
    out = {}
    for name, saved in state.items():
        if not isinstance(saved, dict) or set(saved) != set(optimizer.state):
            got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(f"the {optimizer.title} state of {name} has the keys {list(optimizer.state)}, got {got}")
        out[name] = {"step": _step_count(saved["step"], name)}
        for key in optimizer.moments:
            value = np.asarray(saved[key])
            if value.shape != params[name].shape or not np.issubdtype(value.dtype, np.floating):
                raise ValueError(f"the {key} of {name} must be a floating-point array of its shape "
                                 f"{params[name].shape}, got {value.dtype} {value.shape}")
            with np.errstate(over="ignore"):
                out[name][key] = np.array(value, dtype=dtype, order="C")
            if not np.isfinite(out[name][key]).all() or (key.endswith("_sq") and (out[name][key] < 0).any()):
                raise ValueError(f"the {key} of {name} holds NaN, infinity" + (" or a negative value (it averages "
                                 "squares)" if key.endswith("_sq") else "") + f", as {np.dtype(dtype).name}")
    if len({s["step"] for s in out.values()}) > 1:
        raise ValueError(f"every parameter's step count must be the same (they step together), got "
                         f"{ {name: s['step'] for name, s in out.items()} }")
    return out


def _step_count(step, name: str) -> int:
    """An optimizer's count of steps taken, an integer >= 1 (a state exists only after a first step)."""
    value = np.asarray(step)
    number = value.ndim == 0 and value.dtype != bool and np.issubdtype(value.dtype, np.number)
    if not (number and np.isfinite(value) and value == np.round(value) and value >= 1):
        raise ValueError(f"the step of {name} must be a whole number of steps >= 1, got {step!r}")
    return int(value)


def hidden_size(params: dict[str, np.ndarray]) -> int:
    """H, read off fc1.weight (H, 784)."""
    return params["fc1.weight"].shape[0]


def check_X(X: np.ndarray) -> np.ndarray:
    """X must be a non-empty (N, 784) float32 C-contiguous array of finite values."""
    if not isinstance(X, np.ndarray):
        raise TypeError(_on_device_here("X") if on_device(X) else f"X must be a numpy array, got {type(X).__name__}")
    if X.dtype != np.float32:
        raise TypeError(f"X must be float32, got {X.dtype}; convert with X.astype(np.float32)")
    if X.ndim != 2 or X.shape[1] != N_IN:
        raise ValueError(f"X must have shape (N, {N_IN}), got {X.shape}")
    if X.shape[0] == 0:
        raise ValueError("X is empty: a batch needs at least one image")
    if not X.flags.c_contiguous:
        raise ValueError("X must be C-contiguous; use np.ascontiguousarray(X)")
    if not np.isfinite(X).all():
        raise ValueError("X contains NaN or infinity")
    return X


def check_y(y: np.ndarray, n: int) -> np.ndarray:
    """y must hold n integer labels in [0, 10); returned as C-contiguous int32."""
    if on_device(y):
        raise TypeError(_on_device_here("y"))
    y = np.asarray(y)
    if not np.issubdtype(y.dtype, np.integer):
        raise TypeError(f"y must hold integer labels, got {y.dtype}")
    if y.shape != (n,):
        raise ValueError(f"y must have shape ({n},) to match X, got {y.shape}")
    if n and (y.min() < 0 or y.max() >= N_OUT):
        raise ValueError(f"labels must be in [0, {N_OUT}), got range [{y.min()}, {y.max()}]")
    return np.ascontiguousarray(y, dtype=np.int32)


MAX_ROWS = 2**31 - 1  # rows of a data set, or of an epoch's order: the native levels count them in a C int


def _on_device_here(name: str) -> str:
    """What to do with an array on a CUDA device where only NumPy arrays are read."""
    return (f"{name} is an array on a CUDA device; here only NumPy arrays are read: pass {name}.cpu().numpy(). "
            "Device arrays are read in place by train_epoch of the MLP's GPU levels (5, 6, 7), and only there")


@dataclass(frozen=True)
class DeviceData:
    """A training set on a CUDA device, checked (check_device_data): X (rows, 784) float32, y (rows,) int32."""

    X: DeviceArray
    y: DeviceArray
    rows: int


def check_device_data(X, y) -> DeviceData:
    """X and y on the current CUDA device as the GPU levels read them in place, without a copy: X (N, 784) float32
    and y (N,) int32 labels, both C-contiguous. Anything else is refused here, before native code sees a pointer, with
    the fix; the library then checks the device and every label (mlp_use_device_data)."""
    X_dev, y_dev = device_array(X, "X"), device_array(y, "y")
    if X_dev is None or y_dev is None:
        on, off = ("X", "y") if y_dev is None else ("y", "X")
        raise TypeError(f"{on} is an array on a CUDA device and {off} is not: hand both on the device (y as int32) "
                        "or both as NumPy arrays")
    if X_dev.dtype != "float32":
        raise TypeError(f"X is {X_dev.dtype} on the device: pass float32 (PyTorch: X.float()); "
                        "the GPU levels read X without copying it")
    if len(X_dev.shape) != 2 or X_dev.shape[1] != N_IN:
        raise ValueError(f"X must have shape (N, {N_IN}), got {X_dev.shape}")
    rows = X_dev.shape[0]
    if rows == 0:
        raise ValueError("X is empty: a batch needs at least one image")
    if rows > MAX_ROWS:
        raise ValueError(f"X has {rows:,} rows: the native levels count at most {MAX_ROWS:,}")
    if y_dev.dtype != "int32":
        raise TypeError(f"labels are {y_dev.dtype} on the device: pass int32 labels (PyTorch: y.int()); "
                        "the GPU levels read labels without copying them")
    if y_dev.shape != (rows,):
        raise ValueError(f"y must have shape ({rows},) to match X, got {y_dev.shape}")
    for name, array in (("X", X_dev), ("y", y_dev)):
        if not array.contiguous(4):
            raise ValueError(f"{name} on the device must be C-contiguous, got strides {array.strides} (bytes) for "
                             f"shape {array.shape}: pass {name}.contiguous()")
    return DeviceData(X_dev, y_dev, rows)


def check_training(n: int, batch_size: int, lr: float, order: np.ndarray | None) -> tuple[np.ndarray, int, np.float32]:
    """Validate the epoch's arguments; return the visiting order (int32 indices into X), the batch size (at most
    the epoch: one step) and the learning rate as the float32 every level uses."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float, np.integer, np.floating)):
        raise TypeError(f"lr must be a number, got {type(lr).__name__} {lr!r}")
    with np.errstate(over="ignore"):
        lr32 = np.float32(lr)
    if not np.isfinite(lr32) or lr32 < 0:
        raise ValueError(f"lr must be a finite number >= 0 (as float32, the type every level uses), got {lr!r}")
    if order is None:
        order = np.arange(n, dtype=np.int32)
    order = np.asarray(order)
    if not np.issubdtype(order.dtype, np.integer) or order.ndim != 1 or order.size == 0:
        raise ValueError(f"order must be a non-empty 1-D integer index array, got {order.dtype} {order.shape}")
    if order.size > MAX_ROWS:
        raise ValueError(f"order has {order.size:,} entries: at most {MAX_ROWS:,} per epoch")
    if order.min() < 0 or order.max() >= n:
        raise ValueError(f"order indexes rows of X: values must be in [0, {n}), got [{order.min()}, {order.max()}]")
    return np.ascontiguousarray(order, dtype=np.int32), int(min(batch_size, order.size)), lr32


def n_steps(n: int, batch_size: int) -> int:
    """Steps in an epoch of n samples: a final partial batch is a real, smaller step."""
    return -(-n // batch_size)


def immutable(a: np.ndarray) -> np.ndarray:
    """A read-only copy of `a` that nothing can ever change: its memory is an immutable bytes object.

    A read-only flag alone does not make an array constant: an array that owns its memory can be made
    writeable again, and a view taken before the flag was set still writes to it. An array whose memory
    is a bytes object can be neither: numpy refuses to make it writeable, and bytes has no writeable view.
    """
    a = np.ascontiguousarray(a)
    return np.frombuffer(a.tobytes(), dtype=a.dtype).reshape(a.shape)


def is_immutable(a: np.ndarray) -> bool:
    """True when the array's memory is an immutable bytes object (see `immutable`)."""
    while isinstance(a, np.ndarray):
        a = a.base
    return isinstance(a, bytes)


REUPLOAD = ("train_epoch uploads X and y to the GPU again at every call: they are NumPy arrays that can change "
            "(writeable, or views of writeable memory), and a change must be seen. To check and upload a training set "
            "once, hand over common.harness.data.dataset(X, y): data = dataset(X, y), then model.train_epoch(*data, ...)")


class DataCache:
    """Checks a training set once and keeps the level's copy of it (on a GPU: the upload) while it is unchanged.

    Correct first: the copy is reused only for the very same X and y objects as last time, and only when both
    are immutable (their memory is a bytes object: `immutable`), so no write anywhere can have changed them.
    The harness, common.harness.data.normalize and common.harness.data.dataset hand every level immutable arrays, so the data set is
    checked and uploaded once, not every epoch - the fair, best-practice loop for every level. Any other array
    (writeable, or merely flagged read-only) is checked and uploaded again on every call, so a change is always seen;
    on a GPU (`on_gpu`) that costs a copy per epoch, and the first such call warns (REUPLOAD).

    Arrays on a CUDA device, for a level that reads them in place (`use_device`), are never copied: they are checked
    and handed over again at every call (the library waits for their writers and checks the labels), and the cache
    holds them while the level reads their memory.
    """

    def __init__(self, on_gpu: bool = False):
        self._key: tuple[np.ndarray, np.ndarray] | None = None
        self._copy = None
        self._held: DeviceData | None = None  # arrays on the device that the level reads, kept alive
        self._on_gpu = on_gpu

    def fetch(self, X: np.ndarray, y: np.ndarray, upload, use_device=None):
        """The level's copy of (X, y), validated and made by upload(X float32, y int32) unless it is known unchanged;
        for arrays on a CUDA device, their row count, once use_device(DeviceData) has handed them to the level."""
        if self._key is not None and self._key[0] is X and self._key[1] is y:
            return self._copy
        self._key = self._copy = None  # forget the old copy first: a failed upload must not leave it in place
        if use_device is not None and (on_device(X) or on_device(y)):
            data = check_device_data(X, y)
            rows = use_device(data)
            self._held = data  # the level now reads this memory (and no longer the last one's)
            return rows
        checked_X = check_X(X)
        copy = upload(checked_X, check_y(y, len(checked_X)))
        self._held = None
        if is_immutable(X) and is_immutable(y):
            self._key, self._copy = (X, y), copy  # holding them keeps their ids from being reused
        elif self._on_gpu:
            warnings.warn(REUPLOAD, stacklevel=3)  # at the caller of train_epoch: once per line of theirs
        return copy
