"""Level 8's GPU backend: arrays in device memory that their tensors own, and the operations of common/native/ops.h
(level8_framework/ops.cu: level 5's kernels, level 6's cuBLAS), through the course's one cffi binding
(common/native/__init__.py).

The methods are cpu.py's, under the same names, on DeviceArray instead of NumPy arrays. Memory is taken from the
library's pool when an array is made and given back when Python collects the last array on it (ffi.gc), in the order of
the one stream every operation is queued on: nothing waits for the GPU but a copy back to the host (to_numpy). Copies
between host and device happen only where asked: Tensor.to(), .numpy(), .item(), and the data set of train_epoch.
Broadcasting here is a layer's bias, a trailing shape (its backward, level 5's column sums); convolutions and pools
take square images (level 5's kernels). Anything else is refused with NotImplementedError, never computed wrong.
"""

from __future__ import annotations

import numpy as np

from common.levels import ROOT
from common.native import NativeError, ffi

LIBRARY = ROOT / "level8_framework" / "libops.so"
INT_MAX = 2**31 - 1  # what a C int counts: the library's sizes


class Memory:
    """One allocation of device memory, given back to the pool when Python collects it."""

    __slots__ = ("pointer", "__weakref__")

    def __init__(self, backend: CudaBackend, nbytes: int):
        out = ffi.new("void **")
        backend.check(backend.lib.ops_alloc(backend.context, out, nbytes))
        self.pointer = ffi.gc(out[0], backend.free)


class DeviceArray:
    """A float32 (or int32) array on the GPU: a shape over memory, from an offset (in elements); a 2-D view may be
    transposed (w.T: the memory holds the transpose, row-major), which only the products read as it lies."""

    __slots__ = ("memory", "offset", "shape", "dtype", "transposed")

    def __init__(self, memory: Memory, shape: tuple[int, ...], dtype: str = "float", offset: int = 0,
                 transposed: bool = False):
        self.memory, self.shape, self.dtype = memory, tuple(shape), dtype
        self.offset, self.transposed = offset, transposed

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def ptr(self):
        """The C pointer to its first element."""
        return ffi.cast(f"{self.dtype} *", self.memory.pointer) + self.offset

    def view(self, shape=None, offset: int = 0, transposed=None) -> DeviceArray:
        """Another array on the same memory."""
        return DeviceArray(self.memory, self.shape if shape is None else shape, self.dtype, self.offset + offset,
                           self.transposed if transposed is None else transposed)


def _count(n: int, what: str) -> int:
    """A size the library counts in a C int."""
    if n > INT_MAX:
        raise ValueError(f"{what} of {n:,} is more than the {INT_MAX:,} the GPU backend's kernels count")
    return int(n)


def _trailing(big: tuple[int, ...], small: tuple[int, ...]) -> int | None:
    """How many values `small` repeats over when broadcast to `big` as a trailing shape (a bias: (B, n) and (n,)), its
    leading 1s dropped; None when it is not one."""
    while small and small[0] == 1:
        small = small[1:]
    if len(small) > len(big) or tuple(big[len(big) - len(small):]) != tuple(small):
        return None
    return int(np.prod(big[: len(big) - len(small)], dtype=np.int64))


class CudaBackend:
    device = "cuda"

    def __init__(self):
        if not LIBRARY.exists():
            raise RuntimeError(f"{LIBRARY.relative_to(ROOT)} is not built: run `make level8` (it needs nvcc)")
        self.lib = ffi.dlopen(str(LIBRARY))
        context = ffi.new("ops **")
        self.check(self.lib.ops_create(context), RuntimeError)
        self.context = context[0]  # one for the process: never destroyed while an array may still give memory back

    def check(self, status: int, error: type[Exception] = NativeError) -> None:
        """Raise for a failed status, with the library's message."""
        if status != self.lib.MLP_OK:
            raise error(ffi.string(self.lib.mlp_last_error()).decode(errors="replace"))

    def free(self, pointer) -> None:
        """ffi.gc's destructor: give the memory back (a failure cannot be raised from a collection; the stream's next
        call reports a broken context)."""
        self.lib.ops_free(self.context, pointer)

    # ---- memory ----

    def empty(self, shape: tuple[int, ...], dtype: str = "float") -> DeviceArray:
        shape = tuple(int(n) for n in shape)
        return DeviceArray(Memory(self, 4 * max(int(np.prod(shape, dtype=np.int64)), 1)), shape, dtype)

    def from_numpy(self, a: np.ndarray, dtype: str = "float") -> DeviceArray:
        """A device copy of a host array (float32, or int32 for labels)."""
        host = np.asarray(a, dtype=np.float32 if dtype == "float" else np.int32, order="C")  # (0-d stays 0-d)
        out = self.empty(host.shape, dtype)
        if host.size:
            self.check(self.lib.ops_upload(self.context, out.ptr, ffi.from_buffer(host), host.nbytes))
        return out

    def to_numpy(self, a: DeviceArray) -> np.ndarray:
        a = self.contiguous(a)
        host = np.empty(a.shape, dtype=np.float32 if a.dtype == "float" else np.int32)
        if host.size:
            self.check(self.lib.ops_download(self.context, ffi.from_buffer(host), a.ptr, host.nbytes))
        return host

    def zeros(self, shape: tuple[int, ...]) -> DeviceArray:
        return self._full(shape, 0.0)

    def ones(self, shape: tuple[int, ...]) -> DeviceArray:
        return self._full(shape, 1.0)

    def _full(self, shape: tuple[int, ...], value: float) -> DeviceArray:
        out = self.empty(shape)
        self.check(self.lib.ops_fill(self.context, out.ptr, value, max(out.size, 1)))
        return out

    def copy(self, a: DeviceArray) -> DeviceArray:
        out = DeviceArray(Memory(self, 4 * max(a.size, 1)), a.shape, a.dtype, transposed=a.transposed)
        self.check(self.lib.ops_copy(self.context, out.ptr, a.ptr, 4 * a.size))
        return out

    def contiguous(self, a: DeviceArray) -> DeviceArray:
        """a, or a transposed view made row-major."""
        if not a.transposed:
            return a
        out = self.empty(a.shape)
        self.check(self.lib.ops_transpose(self.context, out.ptr, a.ptr, _count(a.shape[1], "rows"),
                                          _count(a.shape[0], "columns")))
        return out

    def assign(self, a: DeviceArray, values: np.ndarray) -> None:
        """Overwrite a's values in place, from the host."""
        host = np.asarray(values, dtype=np.float32, order="C")
        if a.transposed or host.shape != a.shape:
            raise ValueError(f"cannot assign {host.shape} to a device array of shape {a.shape}")
        self.check(self.lib.ops_upload(self.context, a.ptr, ffi.from_buffer(host), host.nbytes))

    def write(self, a: DeviceArray, index: int, value: DeviceArray) -> None:
        """a[index] = value, one value, on the device."""
        self.check(self.lib.ops_copy(self.context, a.ptr + index, value.ptr, 4))

    # ---- products and shapes ----

    def matmul(self, a: DeviceArray, b: DeviceArray) -> DeviceArray:
        (M, K), N = a.shape, b.shape[1]
        out = self.empty((M, N))
        if b.transposed and not a.transposed:  # x @ w.T: level 6's linear layer product
            self.check(self.lib.ops_linear_forward(self.context, out.ptr, a.ptr, b.ptr, _count(M, "rows"),
                                                   _count(K, "inputs"), _count(N, "outputs")))
        else:
            self.check(self.lib.ops_gemm(self.context, out.ptr, a.ptr, b.ptr, _count(M, "M"), _count(N, "N"),
                                         _count(K, "K"), int(a.transposed), int(b.transposed)))
        return out

    def matmul_backward(self, g: DeviceArray, a: DeviceArray, b: DeviceArray, need_a: bool, need_b: bool) -> tuple:
        """(da = g @ b^T, db = a^T @ g), each in its input's layout (cpu.py's rule); x @ w.T's two are level 6's
        linear_backward, in one call."""
        g = self.contiguous(g)
        if b.transposed and not a.transposed and need_b:
            (M, K), N = a.shape, b.shape[1]
            dw, dx = self.empty((N, K)), self.empty((M, K)) if need_a else None
            self.check(self.lib.ops_linear_backward(self.context, dx.ptr if need_a else ffi.NULL, dw.ptr, g.ptr, a.ptr,
                                                    b.ptr, _count(M, "rows"), _count(K, "inputs"),
                                                    _count(N, "outputs")))
            return dx, dw.view(shape=(K, N), transposed=True)
        T = self.transpose
        da = db = None
        if need_a:
            da = T(self.matmul(b, T(g))) if a.transposed else self.matmul(g, T(b))
        if need_b:
            db = T(self.matmul(T(g), a)) if b.transposed else self.matmul(T(a), g)
        return da, db

    @staticmethod
    def transpose(a: DeviceArray) -> DeviceArray:
        return a.view(shape=a.shape[::-1], transposed=not a.transposed)

    def reshape(self, a: DeviceArray, shape: tuple[int, ...]) -> DeviceArray:
        shape = tuple(int(n) for n in shape)
        if shape.count(-1) == 1:
            known = int(np.prod([n for n in shape if n != -1], dtype=np.int64))
            shape = tuple(a.size // known if n == -1 and known else n for n in shape)
        if int(np.prod(shape, dtype=np.int64)) != a.size or min(shape, default=0) < 0:
            raise ValueError(f"cannot reshape a tensor of size {a.size} into shape {shape}")
        return self.contiguous(a).view(shape=shape)

    def add(self, a: DeviceArray, b: DeviceArray) -> DeviceArray:
        a, b = self.contiguous(a), self.contiguous(b)
        if a.shape == b.shape:
            out = self.empty(a.shape)
            self.check(self.lib.ops_add(self.context, out.ptr, a.ptr, b.ptr, a.size))
            return out
        shape = np.broadcast_shapes(a.shape, b.shape)  # NumPy's rule, and its error for shapes that do not broadcast
        big, bias = (a, b) if a.shape == shape else (b, a)  # a + b = b + a, bit for bit
        rows = _trailing(shape, bias.shape) if big.shape == shape else None
        if rows is None:
            raise NotImplementedError(f"the GPU backend broadcasts a trailing shape (a bias) only, not {a.shape} + "
                                      f"{b.shape}: on the CPU NumPy broadcasts any shapes")
        out = self.copy(big)
        self.check(self.lib.ops_bias_forward(self.context, out.ptr, bias.ptr, _count(rows, "rows"),
                                             _count(bias.size, "columns")))
        return out

    def sum_to(self, g: DeviceArray, shape: tuple[int, ...]) -> DeviceArray:
        """g summed over the broadcast axes: level 5's column sums (bias_backward) of g as (rows, size of shape)."""
        if g.shape == tuple(shape):
            return g
        rows = _trailing(g.shape, tuple(shape))
        if rows is None:
            raise NotImplementedError(f"the GPU backend sums a trailing shape (a bias) only, not {g.shape} to {shape}")
        g, out = self.contiguous(g), self.empty(shape)
        self.check(self.lib.ops_bias_backward(self.context, out.ptr, g.ptr, _count(rows, "rows"),
                                              _count(out.size, "columns")))
        return out

    # ---- element-wise ----

    def _unary(self, function, h: DeviceArray) -> DeviceArray:
        h = self.contiguous(h)
        out = self.empty(h.shape)
        self.check(function(self.context, out.ptr, h.ptr, h.size))
        return out

    def _backward(self, function, d: DeviceArray, kept: DeviceArray) -> DeviceArray:
        d, kept = self.contiguous(d), self.contiguous(kept)
        out = self.empty(d.shape)
        self.check(function(self.context, out.ptr, d.ptr, kept.ptr, d.size))
        return out

    def relu_forward(self, h: DeviceArray) -> DeviceArray:
        return self._unary(self.lib.ops_relu_forward, h)

    def relu_backward(self, da: DeviceArray, h: DeviceArray) -> DeviceArray:
        return self._backward(self.lib.ops_relu_backward, da, h)

    def sigmoid_forward(self, h: DeviceArray) -> DeviceArray:
        return self._unary(self.lib.ops_sigmoid_forward, h)

    def sigmoid_backward(self, ds: DeviceArray, s: DeviceArray) -> DeviceArray:
        return self._backward(self.lib.ops_sigmoid_backward, ds, s)

    # ---- losses and the mean ----

    def labels(self, target, logits_shape: tuple[int, int]) -> DeviceArray:
        """Class indices on the device: a batch's own (int32, gathered from a checked data set), or host labels,
        checked as the CPU checks them and uploaded."""
        if isinstance(target, DeviceArray):
            if target.dtype != "int" or target.shape != (logits_shape[0],):
                raise ValueError(f"device labels must be int32 of shape ({logits_shape[0]},), got {target.dtype} "
                                 f"{target.shape}")
            return target
        from level8_framework.cpu import BACKEND

        return self.from_numpy(BACKEND.labels(target, logits_shape), "int")

    def softmax_xent_forward(self, logits: DeviceArray, y: DeviceArray) -> tuple[DeviceArray, DeviceArray]:
        logits = self.contiguous(logits)
        B, C = logits.shape
        loss, probs, row_loss = self.empty(()), self.empty((B, C)), self.empty((B,))
        self.check(self.lib.ops_softmax_xent_forward(self.context, loss.ptr, probs.ptr, row_loss.ptr, logits.ptr, y.ptr,
                                                     _count(B, "rows"), _count(C, "classes")))
        return loss, probs

    def softmax_xent_backward(self, probs: DeviceArray, y: DeviceArray, g: DeviceArray) -> DeviceArray:
        B, C = probs.shape
        out = self.empty((B, C))
        self.check(self.lib.ops_softmax_xent_backward(self.context, out.ptr, probs.ptr, y.ptr, g.ptr, B, C))
        return out

    def mse_forward(self, x: DeviceArray, t: DeviceArray) -> DeviceArray:
        x, t = self.contiguous(x), self.contiguous(t)
        loss, squares = self.empty(()), self.empty(x.shape)
        self.check(self.lib.ops_mse_forward(self.context, loss.ptr, squares.ptr, x.ptr, t.ptr,
                                            _count(x.size, "values")))
        return loss

    def mse_backward(self, g: DeviceArray, x: DeviceArray, t: DeviceArray) -> DeviceArray:
        x, t = self.contiguous(x), self.contiguous(t)
        out = self.empty(x.shape)
        self.check(self.lib.ops_mse_backward(self.context, out.ptr, x.ptr, t.ptr, g.ptr, _count(x.size, "values")))
        return out

    def mean(self, x: DeviceArray) -> DeviceArray:
        x, out = self.contiguous(x), self.empty(())
        self.check(self.lib.ops_mean(self.context, out.ptr, x.ptr, _count(x.size, "values")))
        return out

    def mean_backward(self, g: DeviceArray, shape: tuple[int, ...]) -> DeviceArray:
        out = self.empty(shape)
        self.check(self.lib.ops_mean_backward(self.context, out.ptr, g.ptr, _count(out.size, "values")))
        return out

    # ---- convolution and pooling: level 5's kernels ----

    @staticmethod
    def _square(shape: tuple[int, ...], what: str) -> int:
        if shape[2] != shape[3]:
            raise NotImplementedError(f"the GPU backend's {what} takes square images (level 5's kernels), got {shape}")
        return _count(shape[2], "height")

    def conv2d_forward(self, x: DeviceArray, w: DeviceArray, b: DeviceArray) -> DeviceArray:
        (B, C, _, _), (F, _, k, _), H = x.shape, w.shape, self._square(x.shape, "convolution")
        x, w, b = self.contiguous(x), self.contiguous(w), self.contiguous(b)
        out = self.empty((B, F, H - k + 1, H - k + 1))
        self.check(self.lib.ops_conv2d_forward(self.context, out.ptr, x.ptr, w.ptr, b.ptr, _count(B, "images"), C, H,
                                               F, k))
        return out

    def conv2d_backward(self, g: DeviceArray, x: DeviceArray, w: DeviceArray, need_dx: bool = True) -> tuple:
        (B, C, H, _), (F, _, k, _) = x.shape, w.shape
        g = self.contiguous(g)
        dx, dw, db = self.empty(x.shape) if need_dx else None, self.empty(w.shape), self.empty((F,))
        self.check(self.lib.ops_conv2d_backward(self.context, dx.ptr if need_dx else ffi.NULL, dw.ptr, db.ptr, g.ptr,
                                                x.ptr, w.ptr, _count(B, "images"), C, H, F, k))
        return dx, dw, db

    def maxpool_forward(self, a: DeviceArray) -> tuple[DeviceArray, DeviceArray]:
        (B, C, _, _), H = a.shape, self._square(a.shape, "max-pooling")
        a = self.contiguous(a)
        out, choice = self.empty((B, C, H // 2, H // 2)), self.empty((B, C, H // 2, H // 2), "int")
        self.check(self.lib.ops_maxpool_forward(self.context, out.ptr, choice.ptr, a.ptr, _count(B, "images"), C, H))
        return out, choice

    def maxpool_backward(self, g: DeviceArray, choice: DeviceArray) -> DeviceArray:
        B, C, P, _ = g.shape
        g, da = self.contiguous(g), self.empty((B, C, 2 * P, 2 * P))
        self.check(self.lib.ops_maxpool_backward(self.context, da.ptr, g.ptr, choice.ptr, B, C, 2 * P))
        return da

    # ---- the optimizers' updates, in place: dicts of parameters, gradients and state, as level 3's ----

    def sgd_update(self, params: dict, grads: dict, lr: np.float32) -> None:
        for name, grad in grads.items():
            self.check(self.lib.ops_sgd_update(self.context, params[name].ptr, self.contiguous(grad).ptr, float(lr),
                                               grad.size))

    def sgd_momentum_update(self, params: dict, grads: dict, velocity: dict, lr: np.float32, momentum: float) -> None:
        for name, grad in grads.items():
            self.check(self.lib.ops_sgd_momentum_update(self.context, params[name].ptr, self.contiguous(grad).ptr,
                                                        velocity[name].ptr, float(lr), momentum, grad.size))

    def adam_update(self, params: dict, grads: dict, exp_avg: dict, exp_avg_sq: dict, step: int, lr: float,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        """Level 3's adam_update on the device: the same float64 scalars (PyTorch's), rounded to float32 by the call."""
        beta1, beta2 = betas
        step_size, bias_correction2_sqrt = lr / (1 - beta1**step), (1 - beta2**step) ** 0.5
        for name, grad in grads.items():
            self.check(self.lib.ops_adam_update(self.context, params[name].ptr, self.contiguous(grad).ptr,
                                                exp_avg[name].ptr, exp_avg_sq[name].ptr, 1 - beta1, beta2, 1 - beta2,
                                                step_size, bias_correction2_sqrt, eps, grad.size))

    # ---- a data set, for the level's train_epoch ----

    def dataset(self, X: np.ndarray, y: np.ndarray) -> tuple[DeviceArray, DeviceArray]:
        """The training set uploaded once: X (N, 784) float32 and y (N,) int32 labels (both checked by the caller)."""
        return self.from_numpy(X), self.from_numpy(y, "int")

    def order(self, order: np.ndarray) -> DeviceArray:
        return self.from_numpy(order, "int")

    def batch(self, data: tuple[DeviceArray, DeviceArray], order: DeviceArray, start: int, rows: int):
        """Rows order[start : start + rows] of the data set, gathered on the device: (x (rows, 784), labels (rows,))."""
        X, y = data
        x, labels = self.empty((rows, X.shape[1])), self.empty((rows,), "int")
        self.check(self.lib.ops_gather(self.context, x.ptr, labels.ptr, X.ptr, y.ptr, order.ptr + start, rows,
                                       X.shape[1]))
        return x, labels

    def buffers(self) -> int:
        """The device buffers the library holds now (every live array's memory, and the models' of levels 5-7 if this
        library held any): a freed tensor gives its back."""
        return int(self.lib.mlp_device_buffers())


_BACKEND: CudaBackend | None = None


def backend() -> CudaBackend:
    """The GPU backend, its library loaded and its context made when first asked for."""
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = CudaBackend()
    return _BACKEND
