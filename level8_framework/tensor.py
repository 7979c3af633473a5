"""Level 8 - a framework of your own: the Tensor, its operations and autograd.

What this level adds over level 7: nobody writes a backward pass any more. Each operation on a Tensor computes its
result with the kernels of the tensor's backend - NumPy on the CPU (cpu.py: level 3's layer functions), the GPU
(cuda.py: level 5's kernels and level 6's cuBLAS) - and records what the backward pass needs: its inputs, and a
function from the gradient of its output to the gradients of its inputs. backward() sorts that graph, every tensor
after the tensors it was computed from, and walks it from the loss back: level 2's autograd.py, on whole tensors
instead of scalars. nn.py builds layers and losses from these operations, optim.py updates the parameters, and mlp.py
and lenet.py write the course's two networks in a few lines each.

Run: `python -m common.harness.compare --levels 1,8` or `pytest -m level8`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import numpy as np

from level8_framework import cpu

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
    """float32 values in contiguous storage on a backend (CPU or GPU), and what autograd needs: requires_grad, the
    gradient .grad after backward(), and the node of the operation that computed it (None for a leaf)."""

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

    # ---- operations as methods and operators ----

    def __matmul__(self, other: Tensor) -> Tensor:
        return matmul(self, other)

    def __add__(self, other: Tensor | float) -> Tensor:
        return add(self, other)

    def __radd__(self, other: float) -> Tensor:
        return add(self, other)

    @property
    def T(self) -> Tensor:
        return transpose(self)

    def reshape(self, *shape) -> Tensor:
        return reshape(self, *shape)

    def flatten(self, start_dim: int = 1) -> Tensor:
        return flatten(self, start_dim)

    def relu(self) -> Tensor:
        return relu(self)

    def sigmoid(self) -> Tensor:
        return sigmoid(self)

    def mean(self) -> Tensor:
        return mean(self)


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


def transpose(x: Tensor) -> Tensor:
    """x.T of a 2-D tensor: a view of the same memory, rows and columns swapped."""
    if len(x.data.shape) != 2:
        raise ValueError(f".T transposes a 2-D tensor, got shape {x.shape}")
    be = x.backend
    return _result(be.transpose(x.data), be, (x,), lambda g: (be.transpose(g),))


def add(a: Tensor, b: Tensor | float) -> Tensor:
    """a + b, broadcast as NumPy does (a layer's bias: (B, n) + (n,)). Backward: a broadcast input was used once per
    copy, so its gradient is g summed over the axes it was broadcast along."""
    if not isinstance(b, Tensor):
        b = _new(a.backend.from_numpy(np.array(b, dtype=np.float32)), a.backend)
    be = _backend(a, b)
    a_shape, b_shape = a.data.shape, b.data.shape

    def backward(g):
        da = be.sum_to(g, a_shape) if a.requires_grad else None
        db = be.sum_to(g, b_shape) if b.requires_grad else None
        if da is g and db is g:  # two tensors' gradients never share memory
            db = be.copy(g)
        return da, db

    return _result(be.add(a.data, b.data), be, (a, b), backward)


def reshape(x: Tensor, *shape) -> Tensor:
    """The same values in another shape (one entry may be -1: what is left)."""
    shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    be, before = x.backend, x.data.shape
    return _result(be.reshape(x.data, shape), be, (x,), lambda g: (be.reshape(g, before),))


def flatten(x: Tensor, start_dim: int = 1) -> Tensor:
    """Every axis from start_dim on made one: (N, C, H, W) -> (N, C * H * W)."""
    if not 0 <= start_dim < max(x.ndim, 1):
        raise ValueError(f"start_dim must be in [0, {x.ndim}), got {start_dim}")
    return reshape(x, x.shape[:start_dim] + (-1,))


def relu(x: Tensor) -> Tensor:
    """max(x, 0); its gradient is 0 where x is exactly 0, as PyTorch's."""
    be, h = x.backend, x.data
    return _result(be.relu_forward(h), be, (x,), lambda g: (be.relu_backward(g, h),))


def sigmoid(x: Tensor) -> Tensor:
    """s = 1 / (1 + exp(-x)); ds/dx = s (1 - s), from the output."""
    be = x.backend
    s = be.sigmoid_forward(x.data)
    return _result(s, be, (x,), lambda g: (be.sigmoid_backward(g, s),))


def mean(x: Tensor) -> Tensor:
    """The mean of every value (one value); each input gets g / N."""
    be, shape = x.backend, x.data.shape
    return _result(be.mean(x.data), be, (x,), lambda g: (be.mean_backward(g, shape),))


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
