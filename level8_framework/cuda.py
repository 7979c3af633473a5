"""Level 8's GPU backend: arrays in device memory that their tensors own, and the operations of common/native/ops.h
(level8_framework/ops.cu: level 5's kernels, level 6's cuBLAS), through the course's one cffi binding
(common/native/__init__.py).

The methods are cpu.py's, under the same names, on DeviceArray instead of NumPy arrays. Memory is taken from the
library's pool when an array is made and given back when Python collects the last array on it (ffi.gc), in the order of
the one stream every operation is queued on: nothing waits for the GPU but a copy back to the host (to_numpy). Copies
between host and device happen only where asked: Tensor.to(), .numpy(), .item(), and the data set of train_epoch.

A DeviceArray is storage, shape and strides (strides.py): its memory, where its first value lies there, and a stride
per axis. A view is a new DeviceArray on the same memory. The kernels read row-major arrays: `contiguous` copies any
other view through ops.cu's strided copy (a transposed one through level 8's transpose kernel), but the products, which
read w.T in place as cuBLAS can. A layer's bias is added and summed back with level 5's kernels; any other broadcast
operand is made full-size (a stride-0 view, copied) for ops.cu's map, zip and reduce, the kernels of every other
operation. Convolutions and pools take square images (level 5's kernels): anything else is refused with
NotImplementedError, never computed wrong.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from common.levels import ROOT
from common.native import NativeError, ffi
from level8_framework import strides as layout

LIBRARY = ROOT / "level8_framework" / "libops.so"
INT_MAX = 2**31 - 1  # what a C int counts: the library's sizes


class Memory:
    """One allocation of device memory, a storage of `values` 4-byte values, given back to the pool when Python
    collects it; while a step is recorded (graphs.py), a piece of the recording's arena instead, which it keeps alive."""

    __slots__ = ("pointer", "values", "arena", "__weakref__")

    def __init__(self, backend: CudaBackend, nbytes: int):
        self.values, self.arena = nbytes // 4, backend.recording and backend.recording.arena
        if self.arena:
            self.pointer = self.arena.take(nbytes)
            return
        out = ffi.new("void **")
        backend.check(backend.lib.ops_alloc(backend.context, out, nbytes))
        self.pointer = ffi.gc(out[0], backend.free)


class DeviceArray:
    """A float32 (or int32) array on the GPU: its storage (memory), where its first value lies there (offset, in
    values), its shape and its strides (in values; row-major unless given)."""

    __slots__ = ("memory", "offset", "shape", "strides", "dtype")

    def __init__(self, memory: Memory, shape: tuple[int, ...], dtype: str = "float", offset: int = 0,
                 strides: tuple[int, ...] | None = None):
        self.memory, self.shape, self.dtype, self.offset = memory, tuple(shape), dtype, offset
        self.strides = layout.contiguous_strides(self.shape) if strides is None else tuple(strides)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def ptr(self):
        """The C pointer to its first element."""
        return ffi.cast(f"{self.dtype} *", self.memory.pointer) + self.offset

    @property
    def is_contiguous(self) -> bool:
        """Whether its values lie row-major without gaps, as the kernels read them."""
        return layout.is_contiguous(self.shape, self.strides)

    @property
    def transposed(self) -> bool:
        """Whether it is a 2-D view w.T of a row-major w, which the products read as it lies (cuBLAS's transpose)."""
        return len(self.shape) == 2 and self.strides == (1, self.shape[0])


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
    recording = None  # the StepGraph (graphs.py) being recorded, if one is
    held_back: list = []  # the memory given back while it is, freed once it is recorded (a list of its own then)

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
        call reports a broken context). While a step is recorded, held back: a free recorded in the graph would run
        again at each replay."""
        if self.recording is not None:
            self.held_back.append(pointer)
        else:
            self.lib.ops_free(self.context, pointer)

    # ---- a step recorded as a CUDA graph (graphs.py) ----

    @contextmanager
    def recording_into(self, graph) -> Iterator[None]:
        """Record the operations queued inside for `graph` (a StepGraph: its arena gives their arrays' memory), and
        give it what they make, ready to replay, at graph.executable. A failure inside stops the recording, keeping
        nothing."""
        if self.recording is not None:
            raise RuntimeError("a step is already being recorded: one recording at a time")
        self.check(self.lib.ops_record_begin(self.context))
        self.recording, self.held_back = graph, []
        try:
            yield
            made = ffi.new("ops_graph **")
            self.check(self.lib.ops_record_end(self.context, made))
            graph.executable = ffi.gc(made[0], self.lib.ops_graph_destroy)
        except BaseException:
            self.lib.ops_record_abort(self.context)
            raise
        finally:
            self.recording, held_back, self.held_back = None, self.held_back, []
            for pointer in held_back:
                self.lib.ops_free(self.context, pointer)

    def replay(self, executable) -> None:
        """Queue one replay of a recorded graph (graph.executable)."""
        self.check(self.lib.ops_replay(self.context, executable))

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

    def full(self, shape: tuple[int, ...], value: float) -> DeviceArray:
        """An array of one value, filled on the device (a kernel, which a recorded step can hold; an upload it
        cannot)."""
        return self._full(shape, value)

    def _full(self, shape: tuple[int, ...], value: float) -> DeviceArray:
        out = self.empty(shape)
        self.check(self.lib.ops_fill(self.context, out.ptr, float(value), max(out.size, 1)))
        return out

    def copy(self, a: DeviceArray) -> DeviceArray:
        """a's values on new memory: in a's layout where they lie without gaps (row-major, or transposed), else
        row-major."""
        if not (a.is_contiguous or a.transposed):
            return self.contiguous(a)
        out = DeviceArray(Memory(self, 4 * max(a.size, 1)), a.shape, a.dtype, strides=a.strides)
        self.check(self.lib.ops_copy(self.context, out.ptr, a.ptr, 4 * a.size))
        return out

    # ---- storage, shape and strides: views (strides.py) ----

    @staticmethod
    def strides(a: DeviceArray) -> tuple[int, ...]:
        return a.strides

    @staticmethod
    def offset(a: DeviceArray) -> int:
        return a.offset

    @staticmethod
    def as_strided(a: DeviceArray, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> DeviceArray:
        """A view of a's memory: value [i, j, ...] at a's first value + offset + i strides[0] + j strides[1] + ...
        Refused where a value would lie outside the memory (a wrong stride never reads another tensor's values)."""
        first = a.offset + offset
        last = first + sum((n - 1) * s for n, s in zip(shape, strides))
        if math.prod(shape) and (first < 0 or last >= a.memory.values):
            raise ValueError(f"a view of shape {tuple(shape)}, strides {tuple(strides)} from value {first} reaches "
                             f"outside its storage of {a.memory.values} values")
        return DeviceArray(a.memory, shape, a.dtype, first, strides)

    def permute(self, a: DeviceArray, dims: tuple[int, ...]) -> DeviceArray:
        """A view of a with its axes in the order dims (strides.permute: sizes and strides reordered)."""
        return self.as_strided(a, *layout.permute(tuple(a.shape), a.strides, dims), 0)

    def contiguous(self, a: DeviceArray) -> DeviceArray:
        """a if its values lie row-major without gaps, else a row-major copy: a transposed view through the transpose
        kernel, any other through the strided copy."""
        if a.is_contiguous:
            return a
        out = self.empty(a.shape)
        if a.transposed:
            self.check(self.lib.ops_transpose(self.context, out.ptr, a.ptr, _count(a.shape[1], "rows"),
                                              _count(a.shape[0], "columns")))
        else:
            self.copy_into(out, a)
        return out

    def copy_into(self, dst: DeviceArray, src: DeviceArray) -> None:
        """dst's values = src's, in place, each read and written through its own strides (ops_strided_copy)."""
        if dst.shape != src.shape:
            raise ValueError(f"copy_into needs one shape, got {dst.shape} and {src.shape}")
        if len(dst.shape) > self.lib.OPS_MAX_DIMS:
            raise NotImplementedError(f"the GPU backend's views have at most {self.lib.OPS_MAX_DIMS} axes, got "
                                      f"{len(dst.shape)}")
        shape, to, source = (dst.shape, dst.strides, src.strides) if dst.shape else ((1,), (0,), (0,))
        self.check(self.lib.ops_strided_copy(self.context, dst.ptr, [_count(s, "stride") for s in to], src.ptr,
                                             [_count(s, "stride") for s in source], [_count(n, "size") for n in shape],
                                             len(shape)))

    def assign(self, a: DeviceArray, values: np.ndarray) -> None:
        """Overwrite a's values in place, from the host (float32, or int32 for labels, as a's)."""
        host = np.asarray(values, dtype=np.float32 if a.dtype == "float" else np.int32, order="C")
        if not a.is_contiguous or host.shape != a.shape:
            raise ValueError(f"cannot assign {host.shape} to a device array of shape {a.shape}")
        self.check(self.lib.ops_upload(self.context, a.ptr, ffi.from_buffer(host), host.nbytes))

    def write(self, a: DeviceArray, index: int, value: DeviceArray) -> None:
        """a[index] = value, one value, on the device."""
        self.check(self.lib.ops_copy(self.context, a.ptr + index, value.ptr, 4))

    # ---- products and shapes ----

    def _operand(self, a: DeviceArray) -> DeviceArray:
        """a as the products read it: row-major, or a transposed view as it lies; any other view copied row-major."""
        return a if a.transposed else self.contiguous(a)

    @staticmethod
    def _transpose(a: DeviceArray) -> DeviceArray:
        """The 2-D view a.T: the same memory, shape and strides swapped."""
        return DeviceArray(a.memory, a.shape[::-1], a.dtype, a.offset, a.strides[::-1])

    def matmul(self, a: DeviceArray, b: DeviceArray) -> DeviceArray:
        a, b = self._operand(a), self._operand(b)
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
        g, a, b = self.contiguous(g), self._operand(a), self._operand(b)
        if b.transposed and not a.transposed and need_b:
            (M, K), N = a.shape, b.shape[1]
            dw, dx = self.empty((N, K)), self.empty((M, K)) if need_a else None
            self.check(self.lib.ops_linear_backward(self.context, dx.ptr if need_a else ffi.NULL, dw.ptr, g.ptr, a.ptr,
                                                    b.ptr, _count(M, "rows"), _count(K, "inputs"),
                                                    _count(N, "outputs")))
            return dx, self._transpose(dw)
        T = self._transpose
        da = db = None
        if need_a:
            da = T(self.matmul(b, T(g))) if a.transposed else self.matmul(g, T(b))
        if need_b:
            db = T(self.matmul(T(g), a)) if b.transposed else self.matmul(T(a), g)
        return da, db

    # ---- element-wise: a + b as levels 5's bias where it is one, the rest through map and zip ----

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
            return self._zip(self.lib.OPS_ADD, a, b)
        out = self.copy(big)
        self.check(self.lib.ops_bias_forward(self.context, out.ptr, bias.ptr, _count(rows, "rows"),
                                             _count(bias.size, "columns")))
        return out

    def sub(self, a: DeviceArray, b: DeviceArray) -> DeviceArray:
        return self._zip(self.lib.OPS_SUB, a, b)

    def mul(self, a: DeviceArray, b: DeviceArray) -> DeviceArray:
        return self._zip(self.lib.OPS_MUL, a, b)

    def div(self, a: DeviceArray, b: DeviceArray) -> DeviceArray:
        return self._zip(self.lib.OPS_DIV, a, b)

    def eq(self, a: DeviceArray, b: DeviceArray) -> DeviceArray:
        """1 where a == b, else 0."""
        return self._zip(self.lib.OPS_EQ, a, b)

    def neg(self, a: DeviceArray) -> DeviceArray:
        return self._map(self.lib.OPS_NEG, a)

    def pow(self, a: DeviceArray, k: float) -> DeviceArray:
        """a ** k, k a number."""
        return self._map(self.lib.OPS_POW, a, k)

    def exp(self, a: DeviceArray) -> DeviceArray:
        return self._map(self.lib.OPS_EXP, a)

    def log(self, a: DeviceArray) -> DeviceArray:
        return self._map(self.lib.OPS_LOG, a)

    def tanh(self, a: DeviceArray) -> DeviceArray:
        return self._map(self.lib.OPS_TANH, a)

    def _map(self, f: int, a: DeviceArray, k: float = 0.0) -> DeviceArray:
        """f of every value of a (ops_map)."""
        a = self.contiguous(a)
        out = self.empty(a.shape)
        if out.size:
            self.check(self.lib.ops_map(self.context, out.ptr, a.ptr, f, k, out.size))
        return out

    def _zip(self, op: int, a: DeviceArray, b: DeviceArray) -> DeviceArray:
        """a op b, value by value (ops_zip), broadcast as NumPy does: an operand repeated along an axis is first viewed
        with stride 0 there, then copied to its full size."""
        shape = tuple(np.broadcast_shapes(a.shape, b.shape))
        a, b = (self.contiguous(self.as_strided(x, shape, layout.broadcast_strides(x.shape, x.strides, shape), 0))
                for x in (a, b))
        out = self.empty(shape)
        if out.size:
            self.check(self.lib.ops_zip(self.context, out.ptr, a.ptr, b.ptr, op, out.size))
        return out

    # ---- reductions over axes ----

    def sum(self, a: DeviceArray, dims: tuple[int, ...], keepdim: bool) -> DeviceArray:
        return self._reduce(self.lib.OPS_SUM, a, dims, keepdim)

    def amax(self, a: DeviceArray, dims: tuple[int, ...], keepdim: bool) -> DeviceArray:
        return self._reduce(self.lib.OPS_MAX, a, dims, keepdim)

    def _reduce(self, op: int, a: DeviceArray, dims: tuple[int, ...], keepdim: bool) -> DeviceArray:
        """a reduced over the axes dims, one at a time, the last first: each a reduction of the middle axis of a
        row-major (outer, n, inner) array (ops_reduce)."""
        out, shape = self.contiguous(a), list(a.shape)
        for d in sorted(dims, reverse=True):
            outer, n, inner = math.prod(shape[:d]), shape[d], math.prod(shape[d + 1:])
            shape[d] = 1
            if n == 0 and op == self.lib.OPS_MAX:
                raise ValueError(f"the max of an empty axis (axis {d} of {a.shape})")
            reduced = self.zeros(tuple(shape)) if n == 0 else self.empty(tuple(shape))  # zeros: the sum of no values
            if reduced.size and n:
                self.check(self.lib.ops_reduce(self.context, reduced.ptr, out.ptr, _count(outer, "rows"),
                                               _count(n, "values"), _count(inner, "columns"), op))
            out = reduced
        final = tuple(shape) if keepdim else tuple(m for d, m in enumerate(shape) if d not in dims)
        return self.as_strided(out, final, layout.contiguous_strides(final), 0)

    def sum_to(self, g: DeviceArray, shape: tuple[int, ...]) -> DeviceArray:
        """g summed over the broadcast axes: level 5's column sums (bias_backward) of g as (rows, size of shape) for a
        bias, else the sum over the axes added in front and the axes of size 1 stretched."""
        shape = tuple(shape)
        if g.shape == shape:
            return g
        rows = _trailing(g.shape, shape)
        if rows is None:
            lead = len(g.shape) - len(shape)
            stretched = tuple(lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1)
            summed = self.sum(g, tuple(range(lead)) + stretched, keepdim=True)
            return self.as_strided(summed, shape, layout.contiguous_strides(shape), 0)
        g, out = self.contiguous(g), self.empty(shape)
        self.check(self.lib.ops_bias_backward(self.context, out.ptr, g.ptr, _count(rows, "rows"),
                                              _count(out.size, "columns")))
        return out

    # ---- element-wise layers ----

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
        numbers = self.adam_numbers(step, lr, betas, eps)
        for name, grad in grads.items():
            self.check(self.lib.ops_adam_update(self.context, params[name].ptr, self.contiguous(grad).ptr,
                                                exp_avg[name].ptr, exp_avg_sq[name].ptr, *numbers, grad.size))

    @staticmethod
    def adam_numbers(step: int, lr: float, betas: tuple[float, float], eps: float) -> tuple[float, ...]:
        """What ops_adam_update takes, computed in float64 as PyTorch's Python does: weight1, beta2, weight2,
        step_size, bias_correction2_sqrt, eps (each rounded to float32 on its way to the kernel)."""
        beta1, beta2 = betas
        return 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1**step), (1 - beta2**step) ** 0.5, eps

    # ---- the same updates in a recorded step: their numbers read from device memory (graphs.py) ----

    def sgd_update_from(self, p: DeviceArray, grad: DeviceArray, numbers: DeviceArray) -> None:
        """p -= lr grad, lr = numbers[0]."""
        self.check(self.lib.ops_sgd_update_from(self.context, p.ptr, self.contiguous(grad).ptr, numbers.ptr, p.size))

    def sgd_momentum_update_from(self, p: DeviceArray, grad: DeviceArray, buf: DeviceArray,
                                 numbers: DeviceArray) -> None:
        """sgd_momentum_update, (lr, momentum) = numbers."""
        self.check(self.lib.ops_sgd_momentum_update_from(self.context, p.ptr, self.contiguous(grad).ptr, buf.ptr,
                                                         numbers.ptr, p.size))

    def adam_update_from(self, p: DeviceArray, grad: DeviceArray, exp_avg: DeviceArray, exp_avg_sq: DeviceArray,
                         numbers: DeviceArray) -> None:
        """adam_update, its six numbers (adam_numbers) read from `numbers`."""
        self.check(self.lib.ops_adam_update_from(self.context, p.ptr, self.contiguous(grad).ptr, exp_avg.ptr,
                                                 exp_avg_sq.ptr, numbers.ptr, p.size))

    # ---- a data set, for the level's train_epoch ----

    def dataset(self, X: np.ndarray, y: np.ndarray) -> tuple[DeviceArray, DeviceArray]:
        """The training set uploaded once: X (N, 784) float32 and y (N,) int32 labels (both checked by the caller)."""
        return self.from_numpy(X), self.from_numpy(y, "int")

    def batch_into(self, x: DeviceArray, labels: DeviceArray, data: tuple[DeviceArray, DeviceArray],
                   order: DeviceArray, start: int) -> None:
        """batch(), gathered into x and labels (a recorded step's input buffers) instead of new memory."""
        X, y = data
        self.check(self.lib.ops_gather(self.context, x.ptr, labels.ptr, X.ptr, y.ptr, order.ptr + start,
                                       _count(len(x), "rows"), X.shape[1]))

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
