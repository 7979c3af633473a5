"""Level 8's CPU backend: NumPy arrays, with level 3's layer functions as its kernels.

Every backend has these methods, under the same names (cuda.py's take device arrays). Where level 3 has the layer,
its function is the kernel itself, imported, so that the framework's MLP computes exactly what level 3's does; the
rest (a general matmul, broadcasting, the element-wise functions, the reductions, MSE) is NumPy's, a line each.

A NumPy array is already storage, shape and strides (strides.py): its memory belongs to the array that owns it (its
`base`), and its strides count bytes. as_strided makes the views tensor.py asks for on that memory, and NumPy reads any
strides in place: a transposed view (w.T) goes to matmul as it lies, as BLAS can read it.
"""

from __future__ import annotations

import numpy as np

from level3_numpy import lenet as layers_lenet
from level3_numpy import mlp as layers


def transposed(a: np.ndarray) -> bool:
    """True for a 2-D view that runs down its columns in memory (w.T of a row-major w)."""
    return a.ndim == 2 and a.strides[0] < a.strides[1]


class NumpyBackend:
    device = "cpu"
    recording = None  # a step is recorded as a CUDA graph on the GPU only (graphs.py)

    # ---- memory ----

    @staticmethod
    def from_numpy(a: np.ndarray) -> np.ndarray:
        """The backend's own float32 copy of a host array, row-major."""
        return np.array(a, dtype=np.float32, order="C")

    @staticmethod
    def to_numpy(a: np.ndarray) -> np.ndarray:
        return np.array(a, dtype=np.float32, order="C")

    @staticmethod
    def zeros(shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    @staticmethod
    def ones(shape: tuple[int, ...]) -> np.ndarray:
        return np.ones(shape, dtype=np.float32)

    @staticmethod
    def full(shape: tuple[int, ...], value: float) -> np.ndarray:
        return np.full(shape, value, dtype=np.float32)

    @staticmethod
    def copy(a: np.ndarray) -> np.ndarray:
        return a.copy()

    @staticmethod
    def assign(a: np.ndarray, values: np.ndarray) -> None:
        """Overwrite a's values in place (load_state_dict: whoever holds the array sees the new values)."""
        a[...] = values

    @staticmethod
    def write(a: np.ndarray, index: int, value: np.ndarray) -> None:
        """a[index] = value, one value (an epoch's losses, kept where they are until the epoch ends)."""
        a[index] = value

    # ---- storage, shape and strides: views (strides.py) ----

    @staticmethod
    def strides(a: np.ndarray) -> tuple[int, ...]:
        """a's strides in values (NumPy counts bytes)."""
        return tuple(s // a.itemsize for s in a.strides)

    @staticmethod
    def offset(a: np.ndarray) -> int:
        """Where a's first value lies in its storage, in values."""
        return _start(a, _owner(a)) // a.itemsize

    @staticmethod
    def as_strided(a: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> np.ndarray:
        """A view of a's storage: value [i, j, ...] at a's first value + offset + i strides[0] + j strides[1] + ...
        NumPy refuses a view that would reach outside the storage."""
        a = np.asarray(a)  # a NumPy scalar (a sum's gradient may be one) as an array of one value
        owner = _owner(a)
        return np.ndarray(shape, a.dtype, buffer=_storage(owner), offset=_start(a, owner) + offset * a.itemsize,
                          strides=tuple(s * a.itemsize for s in strides))

    @staticmethod
    def permute(a: np.ndarray, dims: tuple[int, ...]) -> np.ndarray:
        """A view of a with its axes in the order dims: NumPy's own, which reorders sizes and strides as strides.permute
        does, at a fraction of as_strided's cost (a transpose in every linear layer's forward and backward)."""
        return np.transpose(a, dims)

    @staticmethod
    def contiguous(a: np.ndarray) -> np.ndarray:
        """a if its values lie row-major without gaps, else a row-major copy."""
        return np.ascontiguousarray(a)

    @staticmethod
    def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
        """dst's values = src's, in place (dst a view: its storage changes)."""
        dst[...] = src

    # ---- products and shapes ----

    @staticmethod
    def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a @ b

    @staticmethod
    def matmul_backward(g: np.ndarray, a: np.ndarray, b: np.ndarray, need_a: bool, need_b: bool) -> tuple:
        """The gradients (da, db) of the product a @ b (a (M, K), b (K, N)), given g (M, N), the gradient with respect
        to the product; each None where not needed (need_a, need_b). Either input may be a transposed view (w.T): its
        gradient has its shape and its layout, so that the gradient of w in x @ w.T is level 3's dw bit for bit."""
        # BEGIN LAB 8.2 matmul_backward
        # da = g @ b^T, db = a^T @ g; a transposed view's gradient is computed as its transpose's and viewed back
        # (dw = dout^T @ x, row-major, exactly level 3's linear_backward).
        da = db = None
        if need_a:
            da = (b @ g.T).T if transposed(a) else g @ b.T
        if need_b:
            db = (g.T @ a).T if transposed(b) else a.T @ g
        return da, db
        # END LAB

    # ---- element-wise, broadcast as NumPy does (a 0-d result stays an array) ----

    @staticmethod
    def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.asarray(a + b)

    @staticmethod
    def sub(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.asarray(a - b)

    @staticmethod
    def mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.asarray(a * b)

    @staticmethod
    def div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.asarray(a / b)

    @staticmethod
    def eq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """1 where a == b, else 0."""
        return np.asarray(a == b, dtype=a.dtype)

    @staticmethod
    def neg(a: np.ndarray) -> np.ndarray:
        return np.asarray(-a)

    @staticmethod
    def pow(a: np.ndarray, k: float) -> np.ndarray:
        """a ** k, k a number."""
        return np.asarray(a ** np.asarray(k, dtype=a.dtype))

    @staticmethod
    def exp(a: np.ndarray) -> np.ndarray:
        return np.asarray(np.exp(a))

    @staticmethod
    def log(a: np.ndarray) -> np.ndarray:
        return np.asarray(np.log(a))

    @staticmethod
    def tanh(a: np.ndarray) -> np.ndarray:
        return np.asarray(np.tanh(a))

    # ---- reductions over axes ----

    @staticmethod
    def sum(a: np.ndarray, dims: tuple[int, ...], keepdim: bool) -> np.ndarray:
        return np.asarray(np.sum(a, axis=dims, keepdims=keepdim))

    @staticmethod
    def amax(a: np.ndarray, dims: tuple[int, ...], keepdim: bool) -> np.ndarray:
        return np.asarray(np.max(a, axis=dims, keepdims=keepdim))

    @staticmethod
    def sum_to(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """add()'s backward (and every broadcast operation's) for an input of `shape` that add() broadcast to g's shape
        (axes added in front, axes of size 1 stretched): the input's gradient, of `shape`, from g, the gradient with
        respect to add()'s output."""
        # BEGIN LAB 8.3 broadcast backward
        # An input broadcast along an axis was used once per position there: its gradient is g summed over that axis.
        if g.shape == shape:
            return g
        if len(shape) == 1 and g.ndim == 2 and g.shape[1] == shape[0]:  # a layer's bias: level 3's dout.sum(axis=0)
            return g.sum(axis=0)
        lead = g.ndim - len(shape)
        axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1)
        return g.sum(axis=axes).reshape(shape)
        # END LAB

    # ---- element-wise layers: level 3's ----

    relu_forward = staticmethod(layers.relu_forward)
    relu_backward = staticmethod(layers.relu_backward)

    @staticmethod
    def sigmoid_forward(h: np.ndarray) -> np.ndarray:
        """1 / (1 + exp(-h)), computed from exp(-|h|) <= 1, which never overflows."""
        e = np.exp(-np.abs(h))
        return np.where(h >= 0, 1 / (1 + e), e / (1 + e))

    @staticmethod
    def sigmoid_backward(ds: np.ndarray, s: np.ndarray) -> np.ndarray:
        """dh = ds (1 - s) s, from the output s, in PyTorch's order."""
        return ds * (1 - s) * s

    # ---- losses and the mean ----

    @staticmethod
    def labels(target, logits_shape: tuple[int, int]) -> np.ndarray:
        """Class indices for logits of this shape: an integer array (B,) with values in [0, C)."""
        y = np.asarray(target)
        if y.dtype.kind not in "iu":
            raise TypeError(f"the target must hold integer class indices, got {y.dtype} (tensors are float32: pass the "
                            "labels as an integer array)")
        rows, classes = logits_shape
        if y.shape != (rows,):
            raise ValueError(f"the target must have shape ({rows},) for logits {logits_shape}, got {y.shape}")
        if rows and (y.min() < 0 or y.max() >= classes):
            raise ValueError(f"class indices must be in [0, {classes}), got [{y.min()}, {y.max()}]")
        return y

    @staticmethod
    def softmax_xent_forward(logits: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        loss, probs = layers.softmax_xent_forward(logits, y)
        return np.asarray(loss, dtype=np.float32), probs

    @staticmethod
    def softmax_xent_backward(probs: np.ndarray, y: np.ndarray, g: np.ndarray) -> np.ndarray:
        """Level 3's dlogits, times the loss's own gradient g (1 when the loss is the output)."""
        return layers.softmax_xent_backward(probs, y) * g

    @staticmethod
    def mse_forward(x: np.ndarray, t: np.ndarray) -> np.ndarray:
        d = x - t
        return np.asarray(np.mean(d * d), dtype=np.float32)

    @staticmethod
    def mse_backward(g: np.ndarray, x: np.ndarray, t: np.ndarray) -> np.ndarray:
        """dx = (x - t) (2 / N) g, PyTorch's order; N counts every value, as the mean does."""
        return (x - t) * np.float32(2 / x.size) * g

    @staticmethod
    def mean(x: np.ndarray) -> np.ndarray:
        return np.asarray(np.mean(x), dtype=np.float32)

    @staticmethod
    def mean_backward(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return np.full(shape, g / np.float32(np.prod(shape)), dtype=np.float32)

    # ---- convolution and pooling: level 3's im2col and windows ----

    conv2d_forward = staticmethod(layers_lenet.conv2d_forward)
    conv2d_backward = staticmethod(layers_lenet.conv2d_backward)
    maxpool_forward = staticmethod(layers_lenet.maxpool_forward)
    maxpool_backward = staticmethod(layers_lenet.maxpool_backward)

    # ---- the optimizers' updates, in place: dicts of parameters, gradients and state, as level 3's ----

    sgd_update = staticmethod(layers.sgd_update)
    sgd_momentum_update = staticmethod(layers.sgd_momentum_update)
    adam_update = staticmethod(layers.adam_update)

    # ---- a data set, for the level's train_epoch ----

    @staticmethod
    def dataset(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The training set as this backend reads it: NumPy reads X and y in place."""
        return X, y

    @staticmethod
    def order(order: np.ndarray) -> np.ndarray:
        return order

    @staticmethod
    def batch(data: tuple[np.ndarray, np.ndarray], order: np.ndarray, start: int, rows: int):
        """Rows order[start : start + rows] of the data set: (x (rows, 784), their labels)."""
        batch = order[start : start + rows]
        return data[0][batch], data[1][batch]


def _owner(a: np.ndarray) -> np.ndarray:
    """The array that owns a's memory: a NumPy view's base (NumPy points every view at it), or a itself."""
    return a.base if isinstance(a.base, np.ndarray) else a


def _start(a: np.ndarray, owner: np.ndarray) -> int:
    """Where a's first value lies in its owner's memory, in bytes. An array NumPy made is dense, from its first value
    on: a view of all of it without gaps (w.T of a row-major w) starts there too, and needs no address."""
    if a is owner or (a.size == owner.size and (a.flags.c_contiguous or a.flags.f_contiguous)):
        return 0
    return a.__array_interface__["data"][0] - owner.__array_interface__["data"][0]


def _storage(owner: np.ndarray) -> np.ndarray:
    """An owner's memory as one row of values, in memory order: ravel("K") views a dense array without a copy."""
    storage = owner.ravel(order="K")
    if storage.base is None and storage is not owner:
        raise ValueError("a view of an array whose memory NumPy does not hold in one piece: pass a copy")
    return storage


BACKEND = NumpyBackend()
