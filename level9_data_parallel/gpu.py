"""Level 9's GPU libraries in Python: level 6's MLP (libmlp.so, built from mlp.cu) and LeNet-5 (liblenet.so, from
lenet.cu), each with a function that its epoch calls between each step's backward pass and its update, to sum the
gradients across GPUs (gradient_sum.h).

They reuse the course's cffi binding (common/native): the same classes as level 6's, on level 9's libraries, and the
header's declarations added to the same FFI. Build: `make level9`.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from common.contract import check_training, n_steps
from common.native import NativeError, NativeLeNet, NativeMLP, _ptr, ffi

HEADER = Path(__file__).with_name("gradient_sum.h")

ffi.cdef(re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", HEADER.read_text(), re.DOTALL).group(1))


class Summed:
    """What level 9 adds to a level 6 model: the library is level 9's (library: its file name), and its training step
    can sum the gradients across GPUs (sum_gradients_with). Without a sum installed it trains as level 6."""

    on_gpu = True
    library = ""  # the shared library's file name, beside this file
    _sum_callback = None  # the installed sum as a C function, kept alive while the library may call it
    _sum_failure = None  # the exception the sum raised inside a native call, raised when that call returns

    def __init__(self, *args, **kwargs):
        if type(self).lib is None:
            path = Path(__file__).with_name(self.library)
            if not path.exists():
                raise ImportError(f"{path.relative_to(path.parents[1])} is not built: run `make level9`")
            type(self).lib = ffi.dlopen(str(path))
        super().__init__(*args, **kwargs)

    def sum_gradients_with(self, sum_gradients) -> None:
        """Install sum_gradients(gradients, counts, rows, stream): called once per training step, between the
        backward pass and the update, with the device addresses of the gradients (the MLP's dw1, db1, dw2, db2;
        LeNet-5's one flat buffer), their counts of floats, the step's rows and the model's CUDA stream; it queues the
        sum on that stream. None uninstalls it. An exception it raises fails the native call, and is raised from it."""
        if sum_gradients is None:
            callback = ffi.NULL
        else:
            def call(context, gradients, counts, n_gradients, rows, stream) -> int:
                try:
                    sum_gradients([int(ffi.cast("uintptr_t", gradients[i])) for i in range(n_gradients)],
                                  [counts[i] for i in range(n_gradients)], rows, int(ffi.cast("uintptr_t", stream)))
                except BaseException as failure:  # noqa: BLE001 - kept, and raised once the native call returns
                    self._sum_failure = failure
                    return self.lib.MLP_ERR_DEVICE
                return self.lib.MLP_OK

            callback = ffi.callback("mlp_gradient_sum", call)
        with self._lock:
            self._check(self._native("set_gradient_sum")(self._handle(), callback, ffi.NULL))
            self._sum_callback = callback

    def _check(self, status: int, refused: type[Exception] = NativeError) -> None:
        """As NativeModel's, but a call that failed in the installed sum raises the sum's own exception."""
        failure, self._sum_failure = self._sum_failure, None
        if status != self.lib.MLP_OK and failure is not None:
            raise failure
        super()._check(status, refused)


class SummedMLP(Summed, NativeMLP):
    """Level 6's MLP on this process's GPU, its gradients summed across GPUs by the installed sum."""

    library = "libmlp.so"


class SummedLeNet(Summed, NativeLeNet):
    """Level 6's LeNet-5 on this process's GPU, its gradients summed across GPUs by the installed sum; an epoch's whole
    batches replay one captured step, the sum inside it (lenet.cu)."""

    library = "liblenet.so"

    def train_epoch(self, X: np.ndarray, y: np.ndarray, batch_size: int, lr: float, order=None) -> np.ndarray:
        """One pass over X in `order` in one native call; each step's loss. NativeModel's epoch is native calls of
        about CHUNK_S each, cut by this process's clock, so that Ctrl-C is heard between two of them. Level 9's workers
        leave Ctrl-C to their driver, and every rank must make the same calls: a call may capture its steps, and
        their all-reduce, as a graph (lenet.cu), which every rank must do at the same step."""
        with self._lock:
            n = self._data.fetch(X, y, self._upload, self._use_device)
            order, batch_size, lr = check_training(n, batch_size, lr, order)
            self._check_rows(batch_size)
            losses = np.empty(n_steps(len(order), batch_size), dtype=np.float32)
            self._check(self._native("train_epoch")(self._handle(), _ptr(losses, "float[]"), _ptr(order, "int[]"),
                                                    len(order), batch_size, lr))
            return losses
