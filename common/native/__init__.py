"""The one Python binding for the native levels (C, naive CUDA, cuBLAS, fused): cffi in ABI mode over mlp.h, over
its twin for LeNet-5, lenet.h, and over ops.h, the operations of level 8's GPU backend (level8_framework/cuda.py),
all three here in common/native.

The declarations are read from the headers themselves (between their cdef markers), so Python cannot
disagree with C about a signature. Every call is checked: a failing status raises NativeError
with the library's own message (which call, file and line). Python validates every argument
before native code sees it, and keeps each array alive for the duration of the call.

What Python must not be able to do to a native model, and how this binding prevents it:
  - two threads at once: every method takes the model's lock, so calls from several threads run
    one after the other (a model is safe to share; one model per thread is faster);
  - copy.copy / deepcopy / pickle: each gives a new, independent native model with the same parameters,
    never a second owner of the same memory;
  - Ctrl-C: an epoch runs as several native calls of about CHUNK_S seconds each, and Ctrl-C is answered
    between two of them - at a step boundary, the model consistent - with TrainingInterrupted;
  - sizes the native code cannot hold: refused with a ValueError before any native call.

train_epoch of the MLP's GPU levels also takes X and y on a CUDA device (PyTorch, CuPy, Numba, DLPack), read in place:
checked in Python (common/contract's check_device_data), then by the library (mlp_use_device_data) at every epoch.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from cffi import FFI

from common.contract import (
    DataCache,
    DeviceData,
    check_params,
    check_training,
    check_X,
    check_y,
    hidden_size,
    n_steps,
)
from common.levels import ROOT, THE_MLP, Level
from common.nets import Network, get, mlp
from common.nets.mlp import N_IN, N_OUT

HEADERS = [Path(__file__).with_name(name) for name in ("mlp.h", "lenet.h", "ops.h")]
ffi = FFI()
for header in HEADERS:
    ffi.cdef(re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", header.read_text(), re.DOTALL).group(1))


CHUNK_S = 0.05  # the length of one native call of an epoch: Ctrl-C waits at most about this long
FORWARD_ROWS = 65_536  # rows of X per native call of forward(), for the same reason


class NativeError(RuntimeError):
    """A native call returned an error status; the message is the library's."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during train_epoch: the model holds the parameters after `steps_done` whole steps, whose losses are kept."""

    def __init__(self, steps_done: int, steps: int, losses: np.ndarray):
        super().__init__(f"interrupted after {steps_done:,} of {steps:,} steps; the model holds the parameters after "
                         f"step {steps_done:,}, and .losses the losses of those steps")
        self.steps_done, self.steps, self.losses = steps_done, steps, losses


@contextmanager
def _sigint_deferred():
    """Inside the block, Ctrl-C is noted instead of raised; the block asks `pending()` at safe points.

    Only where Python would raise KeyboardInterrupt itself (the main thread, the default handler); elsewhere the
    block runs as usual and `pending()` is always False.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: False
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield lambda: bool(caught)
    finally:
        signal.signal(signal.SIGINT, previous)


def _ptr(a: np.ndarray, ctype: str):
    """A zero-copy pointer into a C-contiguous array (the caller keeps the array alive)."""
    return ffi.from_buffer(ctype, a)


class NativeModel:
    """The level contract over a shared library implementing mlp.h or lenet.h: the calls are the same but for their
    prefix (mlp_, lenet_), how a model is created and how the parameters travel (NativeMLP, NativeLeNet below).
    A level's class only sets `lib` and `on_gpu`."""

    lib = None  # the loaded library, set by native_level()
    on_gpu = False  # True for a GPU level's library, set by native_level()
    network = mlp  # the module of the network's parameter names and shapes
    prefix = "mlp"  # of the header's functions
    _use_device = None  # NativeMLP's: X and y on the device, read in place; LeNet-5's levels take NumPy arrays only

    def __init__(self, params: dict[str, np.ndarray]):
        params = check_params(params, network=self.network)
        self.hidden = hidden_size(params) if self.network is mlp else None
        self._lock = threading.Lock()
        handle = ffi.new(f"{self.prefix} **")
        self._check(self._create(handle))
        self._model = ffi.gc(handle[0], self._native("destroy"))  # freed when collected, or by close()
        self.load_state_dict(params)
        # Not given self._upload: a model -> cache -> model cycle would delay freeing GPU memory.
        self._data = DataCache(on_gpu=self.on_gpu)

    def train_epoch(self, X: np.ndarray, y: np.ndarray, batch_size: int, lr: float, order=None) -> np.ndarray:
        """One pass over X in `order`; returns each step's loss, taken before that step's update.

        The epoch runs as native calls of about CHUNK_S seconds (the first of one step, then larger), each a
        whole number of steps; Ctrl-C between two of them raises TrainingInterrupted.
        """
        with self._lock:
            n = self._data.fetch(X, y, self._upload, self._use_device)
            order, batch_size, lr = check_training(n, batch_size, lr, order)
            self._check_rows(batch_size)
            losses = np.empty(n_steps(len(order), batch_size), dtype=np.float32)
            done, chunk = 0, 1
            with _sigint_deferred() as interrupted:
                while done < len(losses):
                    take = min(chunk, len(losses) - done)
                    rows = order[done * batch_size : (done + take) * batch_size]
                    start = time.perf_counter()
                    self._check(self._native("train_epoch")(self._handle(), _ptr(losses[done:], "float[]"),
                                                            _ptr(rows, "int[]"), len(rows), batch_size, lr))
                    done += take
                    if interrupted() and done < len(losses):
                        raise TrainingInterrupted(done, len(losses), losses[:done].copy())
                    chunk = max(1, min(4 * chunk, int(take * CHUNK_S / max(time.perf_counter() - start, 1e-6))))
            self._epoch_done(batch_size)
            return losses

    def variant(self) -> dict[str, str]:
        """What this model computes with, read from it: the device of its library."""
        return {"device": "cuda" if self.on_gpu else "cpu"}

    def _epoch_done(self, batch_size: int) -> None:
        """Called at the end of train_epoch (level 7 warns there when an epoch did not run fused)."""

    def loss_and_grads(self, X: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        """Mean cross-entropy of one batch and its gradients; parameters unchanged."""
        X = check_X(X)
        y = check_y(y, len(X))
        self._check_rows(len(X))
        grads, pointers = self._params_out()
        loss = ffi.new("float *")
        with self._lock:
            self._check(self._native("loss_and_grads")(self._handle(), loss, *pointers, _ptr(X, "float[]"),
                                                       _ptr(y, "int[]"), len(X)))
        return float(loss[0]), grads()

    def forward(self, X: np.ndarray) -> np.ndarray:
        """Logits (N, 10), FORWARD_ROWS rows per native call (Ctrl-C is answered between two)."""
        X = check_X(X)
        logits = np.empty((len(X), N_OUT), dtype=np.float32)
        with self._lock:
            for start in range(0, len(X), FORWARD_ROWS):
                rows = slice(start, start + FORWARD_ROWS)
                self._check(self._native("forward")(self._handle(), _ptr(logits[rows], "float[]"),
                                                    _ptr(X[rows], "float[]"), len(X[rows])))
        return logits

    def state_dict(self) -> dict[str, np.ndarray]:
        """float32 copies of the parameters."""
        params, pointers = self._params_out()
        with self._lock:
            self._check(self._native("get_params")(self._handle(), *pointers))
        return params()

    def load_state_dict(self, params: dict[str, np.ndarray]) -> None:
        """Replace the parameters (same sizes)."""
        params = check_params(params, self.hidden, network=self.network)
        arrays = self._params_in(params)  # kept alive for the call
        with self._lock:
            self._check(self._native("set_params")(self._handle(), *(_ptr(a, "float[]") for a in arrays)))

    def close(self) -> None:
        """Free the native model now instead of at garbage collection; any later use raises.

        Waits for a call that another thread is making on this model to finish first."""
        with self._lock:
            ffi.release(self._handle())
            self._model = None

    def __copy__(self) -> NativeModel:
        """A new, independent model with the same parameters (never a second owner of this one's memory)."""
        return type(self)(self.state_dict())

    def __deepcopy__(self, memo) -> NativeModel:
        return self.__copy__()

    def __reduce__(self):
        """Pickled as its parameters: unpickling builds a new native model."""
        return type(self), (self.state_dict(),)

    def _handle(self):
        """The native model, or a clear error after close()."""
        if self._model is None:
            raise NativeError(f"this model was closed: create a new {type(self).__name__}")
        return self._model

    def _upload(self, X: np.ndarray, y: np.ndarray) -> int:
        """Hand the training set to the library (a GPU level uploads it); returns its row count."""
        self._check(self._native("set_data")(self._handle(), _ptr(X, "float[]"), _ptr(y, "int[]"), len(X)))
        return len(X)

    def _check_rows(self, rows: int) -> None:
        """A batch the native code can hold: each of its buffers (rows x its width) within MLP_MAX_ELEMENTS."""
        width = self._row_width()
        if rows * width > self.lib.MLP_MAX_ELEMENTS:
            raise ValueError(f"a batch of {rows:,} rows x {width:,} values is {rows * width:,} elements per buffer; "
                             f"the native levels hold at most {self.lib.MLP_MAX_ELEMENTS:,} (8 GiB of float32): "
                             "use a smaller batch_size")

    def _native(self, name: str):
        """The library's function of this name, with the header's prefix."""
        return getattr(self.lib, f"{self.prefix}_{name}")

    def _check(self, status: int, refused: type[Exception] = NativeError) -> None:
        """Raise for a failed status, with the library's message: `refused` for MLP_ERR_ARG, else NativeError."""
        if status != self.lib.MLP_OK:
            error = refused if status == self.lib.MLP_ERR_ARG else NativeError
            raise error(ffi.string(self.lib.mlp_last_error()).decode(errors="replace"))




class NativeMLP(NativeModel):
    """The MLP over mlp.h: four pointers for the four parameters, and the level's choice of matrix product."""

    # mlp.h's MLP_MATMUL_*: the kernels of level 5's lesson, numbered from cuBLAS's (kernel 0), and level 4's loops
    MATMULS = ("cublas", "naive", "tiled", "blocked", "loops")

    def __init__(self, params: dict[str, np.ndarray], matmul: str | None = None):
        """matmul: one of the level's matrix products (level 5: "naive", "tiled" or "blocked"); None: its default."""
        if matmul is not None and matmul not in self.MATMULS:
            raise ValueError(f"matmul must be one of {self.MATMULS}, got {matmul!r}")
        super().__init__(params)
        if matmul is not None:  # one this level has not is refused by the library, which names its own
            self._check(self.lib.mlp_set_matmul(self._handle(), self.MATMULS.index(matmul)), refused=ValueError)

    @property
    def matmul(self) -> str:
        """The matrix product the library computes with, read back from it (not from the argument)."""
        chosen = ffi.new("int *")
        with self._lock:
            self._check(self.lib.mlp_get_matmul(self._handle(), chosen))
        return self.MATMULS[chosen[0]]

    def variant(self) -> dict[str, str]:
        return {**super().variant(), "matmul": self.matmul}

    def __copy__(self) -> NativeMLP:
        return type(self)(self.state_dict(), self.matmul)

    def __reduce__(self):
        return type(self), (self.state_dict(), self.matmul)

    def layers(self, X: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every layer's output for a batch, and the gradient of the batch's mean loss with respect to each."""
        X = check_X(X)
        y = check_y(y, len(X))
        self._check_rows(len(X))
        size = len(X) * (2 * self.hidden + N_OUT)
        outputs, grads = (np.empty(size, dtype=np.float32) for _ in range(2))
        with self._lock:
            self._check(self.lib.mlp_layers(self._handle(), _ptr(outputs, "float[]"), _ptr(grads, "float[]"),
                                            _ptr(X, "float[]"), _ptr(y, "int[]"), len(X)))
        return (mlp.split_layers(outputs, len(X), self.hidden), mlp.split_layers(grads, len(X), self.hidden))

    def _create(self, handle) -> int:
        return self.lib.mlp_create(handle, N_IN, self.hidden, N_OUT)

    def _params_in(self, params: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [params[k] for k in mlp.PARAM_NAMES]

    def _params_out(self):
        """(a function returning the filled dict, the pointers to hand the library to fill it)."""
        params = {k: np.empty(shape, dtype=np.float32) for k, shape in mlp.param_shapes(self.hidden).items()}
        return (lambda: params), [_ptr(params[k], "float[]") for k in mlp.PARAM_NAMES]

    def _row_width(self) -> int:
        return max(N_IN, self.hidden)

    def _use_device(self, data: DeviceData) -> int:
        """Train on X and y on the device, in place; returns the row count. The library waits for their writers and
        checks them (device, alignment, labels): what it refuses is the caller's argument, a ValueError."""
        self._check(self.lib.mlp_use_device_data(self._handle(), ffi.cast("float *", data.X.pointer),
                                                 ffi.cast("int *", data.y.pointer), data.rows), refused=ValueError)
        return data.rows


def _lenet():
    """common.nets.lenet, imported when LeNet-5 is first used: the MLP's users never load its files."""
    from common.nets import lenet

    return lenet


class NativeLeNet(NativeModel):
    """LeNet-5 over lenet.h: one flat buffer for the ten parameters, and every layer's output for the verifier."""

    network = property(lambda self: _lenet())
    prefix = "lenet"
    CONVOLUTIONS = ("direct", "im2col", "tiled")  # lenet.h's LENET_DIRECT, LENET_IM2COL, LENET_TILED

    def __init__(self, params: dict[str, np.ndarray], convolution: str = "direct"):
        if convolution not in self.CONVOLUTIONS:
            raise ValueError(f"convolution must be one of {self.CONVOLUTIONS}, got {convolution!r}")
        super().__init__(params)
        # A convolution this level does not have is refused by the library, which names its own.
        self._check(self.lib.lenet_set_convolution(self._handle(), self.CONVOLUTIONS.index(convolution)),
                    refused=ValueError)

    @property
    def convolution(self) -> str:
        """The convolution the library computes with, read back from it (not from the argument)."""
        chosen = ffi.new("int *")
        with self._lock:
            self._check(self.lib.lenet_get_convolution(self._handle(), chosen))
        return self.CONVOLUTIONS[chosen[0]]

    def variant(self) -> dict[str, str]:
        return {**super().variant(), "convolution": self.convolution}

    def layers(self, X: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every layer's output for a batch, and the gradient of the batch's mean loss with respect to each."""
        X = check_X(X)
        y = check_y(y, len(X))
        self._check_rows(len(X))
        outputs, grads = (np.empty(len(X) * self.lib.LENET_ACTIVATIONS, dtype=np.float32) for _ in range(2))
        with self._lock:
            self._check(self.lib.lenet_layers(self._handle(), _ptr(outputs, "float[]"), _ptr(grads, "float[]"),
                                              _ptr(X, "float[]"), _ptr(y, "int[]"), len(X)))
        return _lenet().split_layers(outputs, len(X)), _lenet().split_layers(grads, len(X))

    # Inference as a server runs it (lenet.h's lenet_infer_*): a batch loaded once, its forward run again and again.

    def infer_load(self, X: np.ndarray) -> None:
        """Load a batch of images (N, 784) for infer_run and infer_layers; a GPU level keeps it on the device."""
        X = check_X(X)
        self._check_rows(min(len(X), FORWARD_ROWS))
        with self._lock:
            self._check(self.lib.lenet_infer_load(self._handle(), _ptr(X, "float[]"), len(X)))
            self._infer_rows = len(X)

    def infer_run(self, logits: bool = True) -> np.ndarray | None:
        """The loaded batch's forward, finished when it returns (a GPU level: one CUDA graph launch and one wait);
        its logits (N, 10), or nothing with logits=False (what a latency measurement times)."""
        with self._lock:
            out = np.empty((self._loaded(), N_OUT), dtype=np.float32) if logits else None
            self._check(self.lib.lenet_infer_run(self._handle(), _ptr(out, "float[]") if logits else ffi.NULL))
        return out

    def infer_layers(self) -> dict[str, np.ndarray]:
        """Every layer's output for the loaded batch, by name (lenet.ACTIVATIONS), from the forward infer_run runs."""
        with self._lock:
            n = self._loaded()
            self._check_rows(n)
            outputs = np.empty(n * self.lib.LENET_ACTIVATIONS, dtype=np.float32)
            self._check(self.lib.lenet_infer_layers(self._handle(), _ptr(outputs, "float[]")))
        return _lenet().split_layers(outputs, n)

    def _loaded(self) -> int:
        if not getattr(self, "_infer_rows", 0):
            raise RuntimeError("no batch loaded: call infer_load(X) first")
        return self._infer_rows

    def __copy__(self) -> NativeLeNet:
        return type(self)(self.state_dict(), self.convolution)

    def __reduce__(self):
        return type(self), (self.state_dict(), self.convolution)

    def _create(self, handle) -> int:
        return self.lib.lenet_create(handle)

    def _params_in(self, params: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [_lenet().flatten(params)]

    def _params_out(self):
        flat = np.empty(self.lib.LENET_PARAMS, dtype=np.float32)
        return (lambda: _lenet().unflatten(flat)), [_ptr(flat, "float[]")]

    def _row_width(self) -> int:
        return self.lib.LENET_ROW_FLOATS


def lazy_lenet(lv: Level, namespace: dict):
    """A level package's module __getattr__ that loads its LeNet class (liblenet.so) when first asked for: the MLP's
    users never load the second network's files."""

    def __getattr__(name: str):
        if name == "LeNet":
            namespace["LeNet"] = native_level(lv, get("lenet"))
            return namespace["LeNet"]
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")

    return __getattr__


def native_level(lv: Level, network: Network = THE_MLP) -> type[NativeModel]:
    """A native level's class for a network (MLP, LeNet); importing says how to build the library when it is missing."""
    path = lv.library_for(network)
    if not path.exists():
        raise ImportError(f"{path.relative_to(ROOT)} is not built: run `make level{lv.number}`")
    base = {"mlp": NativeMLP, "lenet": NativeLeNet}[network.name]
    namespace = {"lib": ffi.dlopen(str(path)), "on_gpu": "gpu" in lv.needs, "__module__": lv.package}
    return type(base.__name__.removeprefix("Native"), (base,), namespace)
