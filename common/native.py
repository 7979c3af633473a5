"""The one Python binding for the native levels (C, naive CUDA, cuBLAS): cffi in ABI mode over common/mlp.h.

The declarations are read from the header itself (between its cdef markers), so Python cannot
disagree with C about a signature. Every call is checked: a failing status raises NativeError
with the library's own message (which call, file and line). Python validates every argument
before native code sees it, and keeps each array alive for the duration of the call.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from cffi import FFI

from common.contract import DataCache, check_params, check_training, check_X, check_y, hidden_size, n_steps
from common.levels import ROOT, Level
from common.model import N_IN, N_OUT, PARAM_NAMES, param_shapes

HEADER = Path(__file__).with_name("mlp.h")
ffi = FFI()
ffi.cdef(re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", HEADER.read_text(), re.S).group(1))


class NativeError(RuntimeError):
    """A native call returned an error status; the message is the library's."""


def _ptr(a: np.ndarray, ctype: str):
    """A zero-copy pointer into a C-contiguous array (the caller keeps the array alive)."""
    return ffi.from_buffer(ctype, a)


class NativeMLP:
    """The level contract over a shared library implementing mlp.h. Subclasses only set `lib`."""

    lib = None  # the loaded library, set by native_level()

    def __init__(self, params: dict[str, np.ndarray]):
        params = check_params(params)
        self.hidden = hidden_size(params)
        handle = ffi.new("mlp **")
        self._check(self.lib.mlp_create(handle, N_IN, self.hidden, N_OUT))
        self._model = ffi.gc(handle[0], self.lib.mlp_destroy)  # freed when collected, or by close()
        self.load_state_dict(params)
        self._data = DataCache()  # not given self._upload: a model -> cache -> model cycle would delay freeing GPU memory

    def train_epoch(self, X: np.ndarray, y: np.ndarray, batch_size: int, lr: float, order=None) -> np.ndarray:
        """One pass over X in `order`; returns each step's loss, taken before that step's update."""
        n = self._data.fetch(X, y, self._upload)
        order = check_training(n, batch_size, lr, order)
        losses = np.empty(n_steps(len(order), batch_size), dtype=np.float32)
        self._check(
            self.lib.mlp_train_epoch(
                self._handle(), _ptr(losses, "float[]"), _ptr(order, "int[]"), len(order), int(batch_size), float(lr)
            )
        )
        return losses

    def loss_and_grads(self, X: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        """Mean cross-entropy of one batch and its gradients; parameters unchanged."""
        X = check_X(X)
        y = check_y(y, len(X))
        grads = self._empty_params()
        loss = ffi.new("float *")
        grad_ptrs = (_ptr(grads[k], "float[]") for k in PARAM_NAMES)
        self._check(
            self.lib.mlp_loss_and_grads(self._handle(), loss, *grad_ptrs, _ptr(X, "float[]"), _ptr(y, "int[]"), len(X))
        )
        return float(loss[0]), grads

    def forward(self, X: np.ndarray) -> np.ndarray:
        """Logits (N, 10)."""
        X = check_X(X)
        logits = np.empty((len(X), N_OUT), dtype=np.float32)
        self._check(self.lib.mlp_forward(self._handle(), _ptr(logits, "float[]"), _ptr(X, "float[]"), len(X)))
        return logits

    def state_dict(self) -> dict[str, np.ndarray]:
        """float32 copies of the parameters."""
        params = self._empty_params()
        self._check(self.lib.mlp_get_params(self._handle(), *(_ptr(params[k], "float[]") for k in PARAM_NAMES)))
        return params

    def load_state_dict(self, params: dict[str, np.ndarray]) -> None:
        """Replace the parameters (same hidden size)."""
        params = check_params(params, self.hidden)
        self._check(self.lib.mlp_set_params(self._handle(), *(_ptr(params[k], "float[]") for k in PARAM_NAMES)))

    def close(self) -> None:
        """Free the native model now instead of at garbage collection; any later use raises."""
        ffi.release(self._handle())
        self._model = None

    def _handle(self):
        """The native model, or a clear error after close()."""
        if self._model is None:
            raise NativeError("this model was closed: create a new MLP")
        return self._model

    def _upload(self, X: np.ndarray, y: np.ndarray) -> int:
        """Hand the training set to the library (a GPU level uploads it); returns its row count."""
        self._check(self.lib.mlp_set_data(self._handle(), _ptr(X, "float[]"), _ptr(y, "int[]"), len(X)))
        return len(X)

    def _empty_params(self) -> dict[str, np.ndarray]:
        return {k: np.empty(shape, dtype=np.float32) for k, shape in param_shapes(self.hidden).items()}

    def _check(self, status: int) -> None:
        if status != self.lib.MLP_OK:
            raise NativeError(ffi.string(self.lib.mlp_last_error()).decode(errors="replace"))


def native_level(lv: Level) -> type[NativeMLP]:
    """The MLP class of a native level; importing says how to build the library when it is missing."""
    path = lv.library_path
    if not path.exists():
        raise ImportError(f"{path.relative_to(ROOT)} is not built: run `make level{lv.number}`")
    return type("MLP", (NativeMLP,), {"lib": ffi.dlopen(str(path)), "__module__": lv.package})
