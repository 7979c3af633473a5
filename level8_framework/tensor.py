"""Level 8 - a framework of your own: the Tensor, its operations and autograd.

What this level adds over level 7: nobody writes a backward pass any more. Each operation on a Tensor computes its
result with the kernels of the tensor's backend - NumPy on the CPU (cpu.py: level 3's layer functions), the GPU
(cuda.py: level 5's kernels and level 6's cuBLAS) - and records what the backward pass needs: its inputs, and a
function from the gradient of its output to the gradients of its inputs. backward() sorts that graph, every tensor
after the tensors it was computed from, and walks it from the loss back: level 2's autograd.py, on whole tensors
instead of scalars. A tensor's values lie in a storage, read through its shape and strides (strides.py): transpose,
permute, slicing, broadcasting and most reshapes are views, new strides over the same storage. nn.py builds layers and
losses from these operations, optim.py updates the parameters, and mlp.py and lenet.py write the course's two networks
in a few lines each.

Run: `python -m common.harness.compare --levels 1,8` or `pytest -m level8`.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np

from level8_framework import cpu, strides

DEVICES = ("cpu", "cuda")


def backend_for(device: str):
    """The backend of a device: "cpu" (NumPy) or "cuda" (this course's kernels; their library is loaded when first
    asked for, and a machine that cannot run it says why)."""
    if device == "cpu":
        return cpu.BACKEND
    if device == "cuda":
        from level8_framework import cuda

        return cuda.backend()
    raise ValueError(f"device must be one of {DEVICES}, got {device!r}")


class _GradMode:
    enabled = True  # whether operations record the graph (no_grad turns it off)


@contextmanager
def no_grad():
    """Operations inside record no graph: for inference, and for the optimizer's updates."""
    before, _GradMode.enabled = _GradMode.enabled, False
    try:
        yield
    finally:
        _GradMode.enabled = before


class Node:
    """What an operation leaves in the graph: its inputs, and backward(g) -> one gradient (or None) per input.
    After backward() has passed through it (without retain_graph), both are dropped: the graph is freed."""

    __slots__ = ("inputs", "backward")

    def __init__(self, inputs: tuple[Tensor, ...], backward: Callable):
        self.inputs, self.backward = inputs, backward


class Tensor:
    """float32 values on a backend (CPU or GPU), in a storage read through a shape and strides (strides.py), and what
    autograd needs: requires_grad, the gradient .grad after backward(), and the node of the operation that computed it
    (None for a leaf)."""

    __slots__ = ("data", "backend", "requires_grad", "grad", "node", "retains_grad", "__weakref__")

    def __init__(self, data, requires_grad: bool = False, device: str = "cpu"):
        """A copy of `data` (anything numpy.array reads) as float32, on `device`."""
        backend = backend_for(device)
        values = data.numpy() if isinstance(data, Tensor) else np.asarray(data, dtype=np.float32)
        self.data, self.backend = backend.from_numpy(values), backend
        self.requires_grad, self.grad, self.node, self.retains_grad = bool(requires_grad), None, None, False

    # ---- what it is ----

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    @property
    def device(self) -> str:
        return self.backend.device

    def numel(self) -> int:
        """The number of values."""
        return int(self.data.size)

    def __len__(self) -> int:
        if not self.data.shape:
            raise TypeError("len() of a tensor of one value (shape ())")
        return self.data.shape[0]

    def __repr__(self) -> str:
        grad = f", grad_fn={self.node.backward.__qualname__.split('.')[0]}" if self.node and self.node.backward else ""
        requires = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={self.shape}, device={self.device!r}{requires}{grad})"

    # ---- storage, shape and strides (strides.py) ----

    def stride(self) -> tuple[int, ...]:
        """How far apart in the storage two neighbours along each axis lie, in values (PyTorch's stride())."""
        return self.backend.strides(self.data)

    def storage_offset(self) -> int:
        """Where the first value lies in the storage, in values."""
        return self.backend.offset(self.data)

    def is_contiguous(self) -> bool:
        """Whether the values lie row-major in the storage without gaps, as a kernel reads them."""
        return strides.is_contiguous(self.shape, self.stride())

    # ---- leaving the graph, the device ----

    def numpy(self) -> np.ndarray:
        """A NumPy copy of the values (from a GPU: copied back)."""
        return self.backend.to_numpy(self.data)

    def item(self) -> float:
        """The one value of a tensor of one element, as a Python float."""
        if self.numel() != 1:
            raise ValueError(f"item() needs a tensor of one value, this one has shape {self.shape}")
        return float(self.numpy().reshape(()))

    def detach(self) -> Tensor:
        """The same values (the same memory), out of the graph."""
        return _new(self.data, self.backend)

    def to(self, device: str) -> Tensor:
        """The tensor on `device`: itself if it is there already, else a copy, through which gradients flow back."""
        target = backend_for(device)
        if target is self.backend:
            return self
        source = self.backend
        return _result(target.from_numpy(source.to_numpy(self.data)), target, (self,),
                       lambda g: (source.from_numpy(target.to_numpy(g)),))

    # ---- autograd ----

    def retain_grad(self) -> None:
        """Keep this tensor's gradient in .grad after backward(), though it is not a leaf (a layer's output)."""
        self.retains_grad = True

    def backward(self, gradient: Tensor | None = None, retain_graph: bool = False) -> None:
        """Add d(self)/d(leaf) to the .grad of every leaf that requires grad (as PyTorch, gradients accumulate in .grad
        until the optimizer's zero_grad()). Without a gradient, self must be one value, a loss. The graph is freed
        on the way, unless retain_graph: a second backward() through it then raises."""
        if not self.requires_grad:
            raise RuntimeError("backward() of a tensor that does not require grad: no tensor it was computed from has "
                               "requires_grad=True (parameters do)")
        if gradient is None:
            if self.data.size != 1:
                raise RuntimeError(f"backward() without a gradient needs a single value (a loss); this tensor has "
                                   f"shape {self.shape}: pass gradient=, a tensor of that shape")
            seed = self.backend.ones(self.data.shape)
        else:
            if not isinstance(gradient, Tensor) or gradient.shape != self.shape or gradient.backend is not self.backend:
                raise ValueError(f"gradient must be a Tensor of shape {self.shape} on {self.device}")
            seed = self.backend.copy(gradient.data)
        run_backward(self, seed, retain_graph)

    # ---- operations as operators (a number on either side) and methods ----

    def __add__(self, other: Tensor | float) -> Tensor:
        return add(self, other)

    def __radd__(self, other: float) -> Tensor:
        return add(self, other)

    def __sub__(self, other: Tensor | float) -> Tensor:
        return sub(self, other)

    def __rsub__(self, other: float) -> Tensor:
        return sub(other, self)

    def __mul__(self, other: Tensor | float) -> Tensor:
        return mul(self, other)

    def __rmul__(self, other: float) -> Tensor:
        return mul(other, self)

    def __truediv__(self, other: Tensor | float) -> Tensor:
        return div(self, other)

    def __rtruediv__(self, other: float) -> Tensor:
        return div(other, self)

    def __neg__(self) -> Tensor:
        return neg(self)

    def __pow__(self, k: float) -> Tensor:
        return pow(self, k)

    def __matmul__(self, other: Tensor) -> Tensor:
        return matmul(self, other)

    def __getitem__(self, key) -> Tensor:
        return index(self, key)

    @property
    def T(self) -> Tensor:
        if self.ndim != 2:
            raise ValueError(f".T transposes a 2-D tensor, got shape {self.shape}: use permute")
        return transpose(self, 0, 1)

    def transpose(self, dim0: int, dim1: int) -> Tensor:
        return transpose(self, dim0, dim1)

    def permute(self, *dims: int) -> Tensor:
        return permute(self, *dims)

    def reshape(self, *shape) -> Tensor:
        return reshape(self, *shape)

    def view(self, *shape) -> Tensor:
        return view(self, *shape)

    def expand(self, *shape) -> Tensor:
        return expand(self, *shape)

    def contiguous(self) -> Tensor:
        return contiguous(self)

    def flatten(self, start_dim: int = 1) -> Tensor:
        return flatten(self, start_dim)

    def relu(self) -> Tensor:
        return relu(self)

    def sigmoid(self) -> Tensor:
        return sigmoid(self)

    def tanh(self) -> Tensor:
        return tanh(self)

    def exp(self) -> Tensor:
        return exp(self)

    def log(self) -> Tensor:
        return log(self)

    def sum(self, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> Tensor:
        return sum(self, dim, keepdim)

    def mean(self, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> Tensor:
        return mean(self, dim, keepdim)

    def max(self, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> Tensor:
        return max(self, dim, keepdim)

    def log_softmax(self, dim: int = -1) -> Tensor:
        return log_softmax(self, dim)


class Parameter(Tensor):
    """A tensor a Module learns: requires_grad, and listed by the module's parameters()."""

    __slots__ = ()

    def __init__(self, data, device: str = "cpu"):
        super().__init__(data, requires_grad=True, device=device)


def from_numpy(array: np.ndarray) -> Tensor:
    """A CPU tensor on the memory of a float32 array, without a copy (as torch.from_numpy): a change to one is a change
    to the other."""
    if not isinstance(array, np.ndarray) or array.dtype != np.float32:
        raise TypeError(f"from_numpy takes a float32 NumPy array, got {getattr(array, 'dtype', type(array).__name__)}")
    return _new(array, cpu.BACKEND)


def from_backend(data, backend) -> Tensor:
    """A tensor on memory a backend made (a batch it gathered), without a copy."""
    return _new(data, backend)


def _new(data, backend, requires_grad: bool = False) -> Tensor:
    """A tensor of backend memory `data`, without a copy: a leaf, or an operation's result for _result to link."""
    t = Tensor.__new__(Tensor)
    t.data, t.backend, t.requires_grad, t.grad, t.node, t.retains_grad = data, backend, requires_grad, None, None, False
    return t


def _result(data, backend, inputs: tuple[Tensor, ...], backward: Callable) -> Tensor:
    """An operation's output; in the graph (with its node) when recording and some input requires grad."""
    out = _new(data, backend)
    if _GradMode.enabled:
        for t in inputs:
            if t.requires_grad:
                out.requires_grad, out.node = True, Node(inputs, backward)
                break
    return out


def _constant(value: float, backend) -> Tensor:
    """A number as a tensor of one value (shape ()) on `backend`, out of the graph; filled there, not uploaded (a
    recorded step copies nothing from the host)."""
    return _new(backend.full((), value), backend)


def _operands(a: Tensor | float, b: Tensor | float) -> tuple[Tensor, Tensor]:
    """The two operands of an arithmetic operator, a number on either side made a tensor of one value beside the
    other's (broadcast like any tensor)."""
    if isinstance(b, Tensor) and isinstance(a, numbers.Real):
        a = _constant(a, b.backend)
    if isinstance(a, Tensor) and isinstance(b, numbers.Real):
        b = _constant(b, a.backend)
    return a, b


def _backend(*tensors: Tensor):
    """The backend of an operation's inputs, which must all be tensors on one device."""
    backend = tensors[0].backend if isinstance(tensors[0], Tensor) else None
    for t in tensors:
        if not isinstance(t, Tensor):
            raise TypeError(f"expected a Tensor, got {type(t).__name__}")
        if t.backend is not backend:
            raise RuntimeError(f"expected every tensor on one device, got {tensors[0].device} and {t.device}: move one "
                               "with .to(device)")
    return backend


# ---- autograd: the graph, sorted, walked backwards ----


def topological_order(root: Tensor) -> list[Tensor]:
    """Every tensor that requires grad in root's graph, once, each after the tensors it was computed from (root last),
    for a graph of any depth (far past Python's 1,000 nested calls)."""
    # BEGIN LAB 8.1 autograd
    # Iterative depth-first search, as level 2's: an explicit stack, no recursion.
    order: list[Tensor] = []
    visited: set[int] = set()
    stack: list[tuple[Tensor, bool]] = [(root, False)]
    while stack:
        t, inputs_done = stack.pop()
        if inputs_done:
            order.append(t)
        elif id(t) not in visited:
            visited.add(id(t))
            stack.append((t, True))
            if t.node is not None:
                for i in t.node.inputs:
                    if i.requires_grad and id(i) not in visited:
                        stack.append((i, False))
    return order
    # END LAB


FREED = ("backward() through a graph a second time: its first backward() freed it (saved values included); "
         "pass retain_graph=True to the first call to go through it again")


def run_backward(root: Tensor, seed, retain_graph: bool) -> None:
    """The chain rule over root's graph, from d(root)/d(root) = seed: d(root)/d(t) added to the .grad of every leaf t
    that requires grad and of every tensor that retains its grad. A tensor used twice receives both gradients, added
    in an order that never changes (the same bits every run). Unless retain_graph, each node passed through is freed
    (inputs and backward dropped); a node found freed raises RuntimeError(FREED)."""
    # BEGIN LAB 8.1 autograd
    # Each tensor's gradient is complete when its turn comes (every tensor computed from it came before, in reverse
    # topological order) and is passed to its inputs through its node.
    order = topological_order(root)
    grads = {id(root): seed}
    for t in reversed(order):
        g = grads.pop(id(t), None)
        if g is None:  # no gradient reaches it (an input that needs none sits between it and the root)
            continue
        node = t.node
        if node is None or t.retains_grad:
            t.grad = _new(g, t.backend) if t.grad is None else _new(t.backend.add(t.grad.data, g), t.backend)
            if node is None:
                continue
        if node.backward is None:
            raise RuntimeError(FREED)
        for i, gi in zip(node.inputs, node.backward(g)):
            if gi is None or not i.requires_grad:
                continue
            if gi.shape != i.data.shape:
                op = node.backward.__qualname__.split(".")[0]
                raise RuntimeError(f"the backward of {op} gave a gradient of shape {tuple(gi.shape)} for an input of "
                                   f"shape {i.shape}")
            key = id(i)
            if key in grads:
                grads[key] = i.backend.add(grads[key], gi)
            else:
                grads[key] = gi
        if not retain_graph:
            node.inputs, node.backward = (), None
    # END LAB


# ---- the operations: each computes its result and says how to differentiate it ----


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a (M, K) @ b (K, N) -> (M, N). Either may be a transposed view (w.T), which the product reads as it lies."""
    be = _backend(a, b)
    a_data, b_data = a.data, b.data
    if len(a_data.shape) != 2 or len(b_data.shape) != 2 or a_data.shape[1] != b_data.shape[0]:
        raise ValueError(f"matmul needs (M, K) and (K, N), got {a.shape} and {b.shape}")

    def backward(g):  # da = g @ b^T, db = a^T @ g, each in its input's own layout
        return be.matmul_backward(g, a_data, b_data, a.requires_grad, b.requires_grad)

    return _result(be.matmul(a_data, b_data), be, (a, b), backward)


# ---- views: a new shape, strides and offset over the same storage (strides.py); nothing is copied ----


def transpose(x: Tensor, dim0: int = 0, dim1: int = 1) -> Tensor:
    """x with axes dim0 and dim1 swapped, a view: their sizes and strides trade places (x.T of a 2-D x). Backward: the
    same swap of the gradient."""
    dims = list(range(x.ndim))
    first, second = _axis(dim0, x.ndim), _axis(dim1, x.ndim)
    dims[first], dims[second] = second, first
    be = x.backend
    return _result(_permuted(be, x.data, dims), be, (x,), lambda g: (_permuted(be, g, dims),))


def permute(x: Tensor, *dims: int) -> Tensor:
    """x's axes reordered, a view: axis d of the result is x's axis dims[d], with its size and stride. Backward: the
    inverse reordering of the gradient."""
    dims = tuple(_axis(d, x.ndim) for d in _sizes(dims))
    strides.permute(x.shape, x.stride(), dims)  # each axis once, or why not
    inverse = tuple(sorted(range(len(dims)), key=dims.__getitem__))
    be = x.backend
    return _result(_permuted(be, x.data, dims), be, (x,), lambda g: (_permuted(be, g, inverse),))


def _permuted(be, data, dims) -> object:
    """A view of backend array `data` with its axes in the order dims: its sizes and strides reordered
    (strides.permute), by the backend."""
    return be.permute(data, tuple(dims))


def index(x: Tensor, key) -> Tensor:
    """x[key], basic indexing, a view: ints pick a position and drop the axis, slices (steps > 0) keep it, the offset
    moved to the first value picked and each stride times its step (strides.index). Backward: g written into the same
    positions of a gradient of zeros."""
    be, shape = x.backend, x.shape
    picked = strides.index(shape, x.stride(), key)

    def backward(g):
        dx = be.zeros(shape)
        be.copy_into(be.as_strided(dx, *strides.index(shape, strides.contiguous_strides(shape), key)), g)
        return (dx,)

    return _result(be.as_strided(x.data, *picked), be, (x,), backward)


def expand(x: Tensor, *shape: int) -> Tensor:
    """x repeated to `shape` (broadcasting, shapes lined up from the right), a view: stride 0 along every axis it is
    repeated on, so each step there reads the same value. Backward: g summed over those axes (sum_to)."""
    be, before, shape = x.backend, x.shape, _sizes(shape)
    view_strides = strides.broadcast_strides(before, x.stride(), shape)
    return _result(be.as_strided(x.data, shape, view_strides, 0), be, (x,), lambda g: (be.sum_to(g, before),))


def reshape(x: Tensor, *shape: int) -> Tensor:
    """The same values in another shape (one size may be -1: what is left), as PyTorch's reshape: a view where the
    strides allow one (strides.view_strides), else a row-major copy."""
    be, before = x.backend, x.shape
    shape = strides.infer_shape(x.numel(), _sizes(shape))
    return _result(_reshaped(be, x.data, shape), be, (x,), lambda g: (_reshaped(be, g, before),))


def view(x: Tensor, *shape: int) -> Tensor:
    """reshape that never copies, as PyTorch's view: refused where the strides allow no view."""
    be, before = x.backend, x.shape
    shape = strides.infer_shape(x.numel(), _sizes(shape))
    view_strides = strides.view_strides(before, x.stride(), shape)
    if view_strides is None:
        raise RuntimeError(f"view {shape} of a tensor of shape {before} and strides {x.stride()}: its values, read "
                           "in that shape, are not evenly spaced in the storage; reshape() copies them")
    return _result(be.as_strided(x.data, shape, view_strides, 0), be, (x,), lambda g: (_reshaped(be, g, before),))


def _reshaped(be, data, shape: tuple[int, ...]) -> object:
    """Backend array `data` in another shape: a view where its strides allow one, else a row-major copy, viewed."""
    view_strides = strides.view_strides(tuple(data.shape), be.strides(data), shape)
    if view_strides is None:
        data, view_strides = be.contiguous(data), strides.contiguous_strides(shape)
    return be.as_strided(data, shape, view_strides, 0)


def flatten(x: Tensor, start_dim: int = 1) -> Tensor:
    """Every axis from start_dim on made one: (N, C, H, W) -> (N, C * H * W)."""
    if not 0 <= start_dim < (x.ndim or 1):
        raise ValueError(f"start_dim must be in [0, {x.ndim}), got {start_dim}")
    return reshape(x, x.shape[:start_dim] + (-1,))


def contiguous(x: Tensor) -> Tensor:
    """x itself if its values lie row-major without gaps, else a row-major copy (a kernel that reads memory in order
    needs one); the gradient passes through unchanged."""
    if x.is_contiguous():
        return x
    be = x.backend
    return _result(be.contiguous(x.data), be, (x,), lambda g: (g,))


def _sizes(sizes: tuple) -> tuple[int, ...]:
    """Sizes given one by one (x.reshape(2, 3)) or as one tuple (x.reshape((2, 3))), as ints."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = sizes[0]
    return tuple(operator.index(n) for n in sizes)


def _axis(d: int, ndim: int) -> int:
    """Axis d of ndim, counted from the end where negative (-1: the last)."""
    if isinstance(d, bool) or not -ndim <= operator.index(d) < ndim:
        raise IndexError(f"axis {d} is out of range for a tensor of {ndim} axes")
    return operator.index(d) % ndim


def _dims(dim: int | tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
    """The axes a reduction runs over, sorted: dim (an axis or a tuple of them), or every axis for None."""
    if dim is None:
        return tuple(range(ndim))
    dims = sorted(_axis(d, ndim) for d in (dim if isinstance(dim, tuple) else (dim,)))
    if not dims or len(set(dims)) != len(dims):
        raise ValueError(f"dim must name each axis once, got {dim}")
    return tuple(dims)


# ---- arithmetic, broadcast as NumPy does; a broadcast input's gradient is summed back to its shape (sum_to) ----


def add(a: Tensor | float, b: Tensor | float) -> Tensor:
    """a + b, broadcast as NumPy does (a layer's bias: (B, n) + (n,)). Backward: a broadcast input was used once per
    copy, so its gradient is g summed over the axes it was broadcast along."""
    a, b = _operands(a, b)
    be = _backend(a, b)
    a_shape, b_shape = a.data.shape, b.data.shape

    def backward(g):
        da = be.sum_to(g, a_shape) if a.requires_grad else None
        db = be.sum_to(g, b_shape) if b.requires_grad else None
        if da is g and db is g:  # two tensors' gradients never share memory
            db = be.copy(g)
        return da, db

    return _result(be.add(a.data, b.data), be, (a, b), backward)


def sub(a: Tensor | float, b: Tensor | float) -> Tensor:
    """a - b, broadcast; d/da = g, d/db = -g, each summed back to its input's shape."""
    a, b = _operands(a, b)
    be = _backend(a, b)
    a_shape, b_shape = a.data.shape, b.data.shape

    def backward(g):
        return (be.sum_to(g, a_shape) if a.requires_grad else None,
                be.sum_to(be.neg(g), b_shape) if b.requires_grad else None)

    return _result(be.sub(a.data, b.data), be, (a, b), backward)


def mul(a: Tensor | float, b: Tensor | float) -> Tensor:
    """a * b, broadcast; d/da = g b, d/db = g a, each summed back to its input's shape."""
    a, b = _operands(a, b)
    be = _backend(a, b)
    a_data, b_data = a.data, b.data

    def backward(g):
        return (be.sum_to(be.mul(g, b_data), a_data.shape) if a.requires_grad else None,
                be.sum_to(be.mul(g, a_data), b_data.shape) if b.requires_grad else None)

    return _result(be.mul(a_data, b_data), be, (a, b), backward)


def div(a: Tensor | float, b: Tensor | float) -> Tensor:
    """a / b, broadcast; d/da = g / b, d/db = -g (a / b) / b, PyTorch's order, from the output a / b."""
    a, b = _operands(a, b)
    be = _backend(a, b)
    a_shape, b_data = a.data.shape, b.data
    out = be.div(a.data, b_data)

    def backward(g):
        return (be.sum_to(be.div(g, b_data), a_shape) if a.requires_grad else None,
                be.sum_to(be.mul(be.neg(g), be.div(out, b_data)), b_data.shape) if b.requires_grad else None)

    return _result(out, be, (a, b), backward)


def neg(x: Tensor) -> Tensor:
    """-x; d/dx = -g."""
    be = x.backend
    return _result(be.neg(x.data), be, (x,), lambda g: (be.neg(g),))


def pow(x: Tensor, k: float) -> Tensor:
    """x ** k for a number k; d/dx = g k x^(k-1), PyTorch's (0 for k = 0, where x^-1 at x = 0 would give 0 inf)."""
    if isinstance(k, (bool, Tensor)) or not isinstance(k, numbers.Real):
        raise TypeError(f"x ** k takes a number k, got {type(k).__name__}")
    be, h = x.backend, x.data

    def backward(g):
        if k == 0:
            return (be.zeros(h.shape),)
        return (be.mul(g, be.mul(_constant(k, be).data, be.pow(h, k - 1))),)

    return _result(be.pow(h, k), be, (x,), backward)


# ---- functions of each value ----


def exp(x: Tensor) -> Tensor:
    """e^x; d/dx = g e^x, from the output."""
    be = x.backend
    out = be.exp(x.data)
    return _result(out, be, (x,), lambda g: (be.mul(g, out),))


def log(x: Tensor) -> Tensor:
    """The natural logarithm; d/dx = g / x."""
    be, h = x.backend, x.data
    return _result(be.log(h), be, (x,), lambda g: (be.div(g, h),))


def tanh(x: Tensor) -> Tensor:
    """t = tanh x; dt/dx = 1 - t^2, from the output (PyTorch's g (1 - t t))."""
    be = x.backend
    t = be.tanh(x.data)
    return _result(t, be, (x,), lambda g: (be.mul(g, be.sub(_constant(1.0, be).data, be.mul(t, t))),))


def relu(x: Tensor) -> Tensor:
    """max(x, 0); its gradient is 0 where x is exactly 0, as PyTorch's."""
    be, h = x.backend, x.data
    return _result(be.relu_forward(h), be, (x,), lambda g: (be.relu_backward(g, h),))


def sigmoid(x: Tensor) -> Tensor:
    """s = 1 / (1 + exp(-x)); ds/dx = s (1 - s), from the output."""
    be = x.backend
    s = be.sigmoid_forward(x.data)
    return _result(s, be, (x,), lambda g: (be.sigmoid_backward(g, s),))


# ---- reductions over axes: dim an axis, a tuple of them or None (all); keepdim keeps them with size 1 ----


def sum(x: Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> Tensor:
    """The sum over the axes dim. Backward: every value summed gets the gradient of its sum (_spread)."""
    be, shape, dims = x.backend, x.shape, _dims(dim, x.ndim)
    return _result(be.sum(x.data, dims, keepdim), be, (x,), lambda g: (_spread(be, g, shape, dims),))


def mean(x: Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> Tensor:
    """The mean over the axes dim, the sum over N values divided by N; each value gets g / N."""
    be, shape = x.backend, x.shape
    if dim is None and not keepdim:  # of every value: level 3's np.mean, level 5's mean in double
        return _result(be.mean(x.data), be, (x,), lambda g: (be.mean_backward(g, shape),))
    dims = _dims(dim, x.ndim)
    count = _constant(math.prod(shape[d] for d in dims), be).data
    return _result(be.div(be.sum(x.data, dims, keepdim), count), be, (x,),
                   lambda g: (_spread(be, be.div(g, count), shape, dims),))


def max(x: Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> Tensor:
    """The largest value over the axes dim, as torch.amax (the values only). Backward: the gradient goes to the
    largest values, split evenly where several tie (PyTorch's: g / count, times the mask of the maxima)."""
    be, shape, dims, h = x.backend, x.shape, _dims(dim, x.ndim), x.data
    out = be.amax(h, dims, keepdim)

    def backward(g):
        kept = _kept(shape, dims)
        mask = be.eq(h, _reshaped(be, out, kept))
        return (be.mul(be.div(_reshaped(be, g, kept), be.sum(mask, dims, True)), mask),)

    return _result(out, be, (x,), backward)


def _kept(shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a reduction over dims with keepdim: size 1 on those axes."""
    return tuple(1 if d in dims else n for d, n in enumerate(shape))


def _spread(be, g, shape: tuple[int, ...], dims: tuple[int, ...]) -> object:
    """g, the gradient of a reduction over dims of a tensor of `shape`, sent back to every value reduced: viewed with
    size 1 on those axes, broadcast (stride 0) to `shape`, and copied row-major."""
    kept = _kept(shape, dims)
    g = _reshaped(be, g, kept)
    return be.contiguous(be.as_strided(g, shape, strides.broadcast_strides(kept, be.strides(g), shape), 0))


# ---- losses ----


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """log softmax along dim: x - max - log(sum(exp(x - max))), the max subtracted first so that any finite x stays
    finite (PyTorch's order). Backward: g - softmax(x) sum(g), the sums along dim (PyTorch's)."""
    be, d, h = x.backend, _axis(dim, x.ndim), x.data
    shifted = be.sub(h, be.amax(h, (d,), True))
    out = be.sub(shifted, be.log(be.sum(be.exp(shifted), (d,), True)))
    return _result(out, be, (x,), lambda g: (be.sub(g, be.mul(be.exp(out), be.sum(g, (d,), True))),))


def cross_entropy(logits: Tensor, target) -> Tensor:
    """The batch's mean of -log softmax(logits)[target]: log-softmax and the negative log-likelihood in one operation,
    the row's max subtracted before exp() so that any finite logits stay finite (level 3's softmax_xent_forward).
    logits (B, C); target (B,) class indices in [0, C), an integer array (on the GPU also the backend's labels)."""
    be = _backend(logits)
    if len(logits.data.shape) != 2:
        raise ValueError(f"cross_entropy takes logits (B, C), got shape {logits.shape}")
    labels = be.labels(target, logits.data.shape)
    loss, probs = be.softmax_xent_forward(logits.data, labels)
    return _result(loss, be, (logits,), lambda g: (be.softmax_xent_backward(probs, labels, g),))


def mse_loss(x: Tensor, target: Tensor) -> Tensor:
    """mean((x - target)^2) over every value, as PyTorch's MSELoss; d/dx = 2 (x - target) / N."""
    be = _backend(x, target)
    if x.shape != target.shape:
        raise ValueError(f"mse_loss needs one shape for the input and the target, got {x.shape} and {target.shape}")
    x_data, t_data = x.data, target.data

    def backward(g):
        return (be.mse_backward(g, x_data, t_data) if x.requires_grad else None,
                be.mse_backward(g, t_data, x_data) if target.requires_grad else None)

    return _result(be.mse_forward(x_data, t_data), be, (x, target), backward)


def conv2d(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """PyTorch's Conv2d (a correlation), stride 1, no padding: x (N, C, H, W), weight (F, C, k, k), bias (F,) ->
    (N, F, H - k + 1, W - k + 1)."""
    be = _backend(x, weight, bias)
    if x.ndim != 4 or weight.ndim != 4 or weight.shape[1] != x.shape[1] or weight.shape[2] != weight.shape[3] \
            or bias.shape != weight.shape[:1] or min(x.shape[2:]) < weight.shape[2]:
        raise ValueError(f"conv2d needs x (N, C, H, W), weight (F, C, k, k) with k <= H, W and bias (F,), got "
                         f"{x.shape}, {weight.shape} and {bias.shape}")
    x_data, w_data = x.data, weight.data

    def backward(g):
        dx, dw, db = be.conv2d_backward(g, x_data, w_data, x.requires_grad)
        return dx, dw if weight.requires_grad else None, db if bias.requires_grad else None

    return _result(be.conv2d_forward(x_data, w_data, bias.data), be, (x, weight, bias), backward)


def max_pool2d(x: Tensor) -> Tensor:
    """2 x 2 max-pooling, stride 2, of x (N, C, H, W), H and W even; the gradient goes to each window's maximum, the
    first of equal ones, as PyTorch's."""
    be = x.backend
    if x.ndim != 4 or x.shape[2] % 2 or x.shape[3] % 2:
        raise ValueError(f"max_pool2d takes (N, C, H, W) with H and W even, got {x.shape}")
    out, choice = be.maxpool_forward(x.data)
    return _result(out, be, (x,), lambda g: (be.maxpool_backward(g, choice),))
