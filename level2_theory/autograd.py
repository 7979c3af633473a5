"""Level 2, the chain rule automated: a scalar autograd engine.

backprop.py derives each gradient by hand, one formula per layer. Here a program finds them. Every operation on a
Value records its inputs (its parents) and the local derivative of its result with respect to each. backward() then
visits the graph from the output back to the inputs, in reverse topological order, and applies the chain rule:
    d out / d parent += d out / d node * d node / d parent
A parent used by several nodes collects the sum of what each of them sends it.

On a slice of the MLP (mlp_loss) the gradients are level 2's hand-derived ones. The graph has one node per multiply,
add and exp (mlp_node_count): a single step of the real MLP would build millions, which is why frameworks work on
whole tensors (level 8).

Run its tests: pytest tests/test_autograd.py
"""

from __future__ import annotations

import math
from numbers import Real


class Value:
    """A scalar, the values it was computed from (parents) and d(self)/d(parent) for each (local_grads).

    grad holds d(output)/d(self) for the output that backward() last ran from."""

    __slots__ = ("data", "grad", "parents", "local_grads")

    def __init__(self, data: float, parents: tuple[Value, ...] = (), local_grads: tuple[float, ...] = ()):
        if isinstance(data, bool) or not isinstance(data, Real):
            raise TypeError(f"a Value holds a real number, got {type(data).__name__} {data!r}")
        self.data = float(data)
        self.grad = 0.0
        self.parents = parents
        self.local_grads = local_grads

    def __repr__(self) -> str:
        return f"Value(data={self.data:.6g}, grad={self.grad:.6g})"

    # ---- the operations, each with its local derivatives ----

    def __add__(self, other: Value | float) -> Value:
        other = as_value(other)
        return Value(self.data + other.data, (self, other), (1.0, 1.0))

    def __mul__(self, other: Value | float) -> Value:
        other = as_value(other)
        return Value(self.data * other.data, (self, other), (other.data, self.data))

    def __pow__(self, exponent: float) -> Value:
        """self ** exponent, for a constant exponent: d/dx x^k = k x^(k-1)."""
        if isinstance(exponent, bool) or not isinstance(exponent, Real):
            raise TypeError(f"the exponent must be a constant number, got {type(exponent).__name__}")
        if self.data < 0 and not float(exponent).is_integer():
            raise ValueError(f"{self.data!r} ** {exponent!r}: a negative base needs an integer exponent")
        if self.data == 0 and exponent < 1:
            raise ValueError(f"0 ** {exponent!r}: its derivative is not finite at 0")
        return Value(self.data**exponent, (self,), (exponent * self.data ** (exponent - 1),))

    def exp(self) -> Value:
        out = math.exp(self.data)
        return Value(out, (self,), (out,))

    def log(self) -> Value:
        if self.data <= 0:
            raise ValueError(f"log({self.data!r}): the logarithm needs a positive number")
        return Value(math.log(self.data), (self,), (1.0 / self.data,))

    def relu(self) -> Value:
        """max(x, 0); its derivative at exactly 0 is 0, as PyTorch's."""
        return Value(max(self.data, 0.0), (self,), (1.0 if self.data > 0 else 0.0,))

    def __neg__(self) -> Value:
        return Value(-self.data, (self,), (-1.0,))

    def __sub__(self, other: Value | float) -> Value:
        other = as_value(other)
        return Value(self.data - other.data, (self, other), (1.0, -1.0))

    def __truediv__(self, other: Value | float) -> Value:
        """a / b: d/da = 1 / b, d/db = -a / b^2."""
        other = as_value(other)
        if other.data == 0:
            raise ZeroDivisionError(f"{self.data!r} / 0")
        return Value(self.data / other.data, (self, other), (1.0 / other.data, -self.data / other.data**2))

    def __radd__(self, other: float) -> Value:
        return as_value(other) + self

    def __rmul__(self, other: float) -> Value:
        return as_value(other) * self

    def __rsub__(self, other: float) -> Value:
        return as_value(other) - self

    def __rtruediv__(self, other: float) -> Value:
        return as_value(other) / self

    # ---- the chain rule ----

    def backward(self) -> None:
        """d(self)/d(node) into node.grad for every node of the graph that computed self.

        Every grad of the graph is set to 0 first, so a second backward() gives the same gradients, not twice
        them: a grad is the derivative of the last output backward() ran from, never a sum over calls."""
        # BEGIN LAB 2.7 backward
        order = topological_order(self)
        for node in order:
            node.grad = 0.0
        self.grad = 1.0
        for node in reversed(order):  # every node before its parents: its grad is complete when it is passed on
            for parent, local in zip(node.parents, node.local_grads):
                parent.grad += local * node.grad
        # END LAB


def as_value(x: Value | float) -> Value:
    """x itself, or a constant Value holding the number x."""
    return x if isinstance(x, Value) else Value(x)


def topological_order(root: Value) -> list[Value]:
    """Every node of root's graph once, each after all of its parents (root last), for a graph of any depth: a
    chain of 100,000 operations too, far past Python's 1,000 nested calls."""
    # BEGIN LAB 2.6 topological_order
    # Iterative depth-first search: an explicit stack instead of recursion. A node is appended when popped the second
    # time, once its parents are in.
    order: list[Value] = []
    visited: set[int] = set()
    stack: list[tuple[Value, bool]] = [(root, False)]
    while stack:
        node, parents_done = stack.pop()
        if parents_done:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        stack.append((node, True))
        stack.extend((parent, False) for parent in node.parents if id(parent) not in visited)
    return order
    # END LAB


# ---- a slice of the MLP, one scalar at a time ----


def values(array) -> list:
    """A nested list of Values (leaves) of an array's entries, in its shape."""
    return [values(row) for row in array] if hasattr(array[0], "__len__") else [Value(float(x)) for x in array]


def mlp_loss(params: dict[str, list], x: list[list[Value]], y: list[int]) -> Value:
    """The MLP's mean softmax cross-entropy, one scalar operation at a time: params as level 2's names and layouts
    (fc1.weight (H, in), fc1.bias (H), fc2.weight (10, H), fc2.bias (10)) of nested lists of Values, a batch x (B, in)
    of Values and its labels y (B). The same formulas as backprop.py: no gradient written by hand."""
    W1, b1, W2, b2 = (params[k] for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    total = None
    for row, label in zip(x, y):
        a = [linear_unit(row, w, b).relu() for w, b in zip(W1, b1)]
        logits = [linear_unit(a, w, b) for w, b in zip(W2, b2)]
        row_loss = log_sum_exp(logits) - logits[label]
        total = row_loss if total is None else total + row_loss
    return total / len(x)


def linear_unit(x: list[Value], w: list[Value], b: Value) -> Value:
    """b + sum_i w_i x_i: one multiply and one add per input."""
    out = b
    for wi, xi in zip(w, x):
        out = out + wi * xi
    return out


def log_sum_exp(z: list[Value]) -> Value:
    """log(exp(z_1) + ... + exp(z_n)) of a row of Values, as a Value whose gradient reaches every z_i; finite for any
    finite z, however large. A row's loss is log_sum_exp(z) - z[label]: -log softmax(z)[label]."""
    # BEGIN LAB 2.8 log-softmax + NLL
    # m + log(sum exp(z - m)) with m = max z taken as a constant: any constant gives the same value and the same
    # gradient, and the max keeps every exp() at most 1.
    m = Value(max(v.data for v in z))
    total = None
    for v in z:
        e = (v - m).exp()
        total = e if total is None else total + e
    return m + total.log()
    # END LAB


def mlp_node_count(batch: int, n_in: int, hidden: int, n_out: int) -> int:
    """Nodes in mlp_loss's graph: the leaves (parameters and inputs), then per row H hidden units of 2 n_in + 1 nodes
    (n_in multiplies, n_in adds, a ReLU), n_out logits of 2 H, and the loss's 3 n_out + 3 (the max, n_out differences
    and exps, n_out - 1 adds, the log, + m, - logit); then B - 1 adds, the constant B and the division."""
    leaves = hidden * n_in + hidden + n_out * hidden + n_out + batch * n_in
    per_row = hidden * (2 * n_in + 1) + n_out * 2 * hidden + 3 * n_out + 3
    return leaves + batch * per_row + batch + 1
