"""The lab's autograd tasks, one call each, from numbers to numbers: level 2's scalar engine (topological_order,
backward, log_sum_exp) and level 8's (topological_order and run_backward, the backward of matmul and of a broadcast
add). A Value, a Tensor or a NumPy view's layout cannot cross the wall of the grader's sandbox; numbers can. So the
lab's checks (tests/test_tasks.py) call these, here in a student's own grade, and in a teacher's grade through the
submission's sandboxed worker (common/classroom/worker.py), which runs them on the submission's code.

Every graph is one of EXPRESSIONS, written once with the operators that Values, level 8's Tensors (through Wrapped,
below) and PyTorch's tensors share: the checks build their float64 reference from the same expression.
"""

from __future__ import annotations

import math
import random

import numpy as np

# ---- the graphs ----


def fan_out(leaves: list, length: int = 0) -> tuple[list, list]:
    """x feeds five operations and c three, d and e are diamonds: most gradients are sums of several contributions.
    Two outputs, the second sharing x, y, z and c with the first. (outputs, the nodes whose gradients are checked)."""
    x, y, z = leaves
    c = x * y + x
    d = c * c + (c * 0.5).exp() - c / (z * z + 1.0)
    e = (d - x).relu() + (x - d).relu() * 0.25 + (z.exp() + 1.0).log()
    return [e * y + e**2 * 0.1, c * z], [x, y, z, c, d, e]


def used_thrice(leaves: list, length: int = 0) -> tuple[list, list]:
    """2x + exp(x) + x y: x's gradient is the sum of three different contributions, 2, exp(x) and y."""
    x, y = leaves
    return [x * 2.0 + x.exp() + x * y], [x, y]


def chain(leaves: list, length: int = 0) -> tuple[list, list]:
    """y = x, then `length` times y = y * 1.00001 + 0.0: a graph as deep as two nodes per link (four for Values,
    whose constants are nodes too). d(out)/dx = 1.00001^length."""
    (x,) = leaves
    y = x
    for _ in range(length):
        y = y * 1.00001 + 0.0
    return [y], [x]


def tangle(leaves: list, length: int = 0) -> tuple[list, list]:
    """`length` nodes after the leaves, each the half sum or half difference of two earlier ones drawn at random
    (seeded by length): mostly recent ones, some far back, so that most nodes feed several others. Its values stay
    within the leaves' range."""
    rng = random.Random(length)
    nodes = list(leaves)
    for _ in range(length):
        a = nodes[-1 - min(int(rng.expovariate(0.5)), len(nodes) - 1)]
        b = nodes[rng.randrange(len(nodes))]
        nodes.append((a + b) * 0.5 if rng.random() < 0.5 else a * 0.5 - b * 0.5)
    return [nodes[-1]], list(leaves)


EXPRESSIONS = {"fan_out": fan_out, "used_thrice": used_thrice, "chain": chain, "tangle": tangle}


def number(x) -> float:
    """x as a float; NaN where it is none (a grad left None, an object)."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


# ---- level 2: the scalar engine ----


def _scalar_graph(expression: str, inputs, length: int):
    """(outputs, named nodes) of the expression on Values of the engine under grade."""
    from level2_theory.autograd import Value

    return EXPRESSIONS[expression]([Value(float(v)) for v in inputs], length)


def _reachable(root, parents) -> list:
    """Every node root was computed from, and root, in no particular order (what the check compares the order with)."""
    seen, todo = {id(root): root}, [root]
    while todo:
        for p in parents(todo.pop()):
            if id(p) not in seen:
                seen[id(p)] = p
                todo.append(p)
    return list(seen.values())


def _positions(order, nodes: list) -> np.ndarray:
    """The index in nodes of each entry of order (-1 for what is none of them)."""
    index = {id(n): i for i, n in enumerate(nodes)}
    return np.array([index.get(id(n), -1) for n in order], dtype=np.int64)


def _edges(nodes: list, parents) -> np.ndarray:
    """(parent, child) index pairs of the graph, (E, 2)."""
    index = {id(n): i for i, n in enumerate(nodes)}
    pairs = [(index[id(p)], i) for i, n in enumerate(nodes) for p in parents(n) if id(p) in index]
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)


def scalar_order(expression: str, inputs: list[float], length: int = 0):
    """level2_theory.autograd.topological_order of the expression's first output: (each entry's index among the
    graph's nodes, the graph's (parent, child) index pairs, which nodes belong in the order (all), the output's
    index)."""
    from level2_theory import autograd

    outputs, _ = _scalar_graph(expression, inputs, length)
    nodes = _reachable(outputs[0], _parents)
    order = list(autograd.topological_order(outputs[0]))
    return _positions(order, nodes), _edges(nodes, _parents), np.ones(len(nodes), dtype=bool), 0


def _parents(node) -> tuple:
    """A Value's parents."""
    return node.parents


def scalar_gradients(expression: str, inputs: list[float], runs: list[int], length: int = 0) -> np.ndarray:
    """For each entry of runs in turn, backward() of that output of the expression, on one graph: the named nodes'
    grads after each, (len(runs), named)."""
    outputs, named = _scalar_graph(expression, inputs, length)
    grads = []
    for run in runs:
        outputs[run].backward()
        grads.append([number(n.grad) for n in named])
    return np.array(grads, dtype=np.float64)


def scalar_log_softmax_nll(logits: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row z of logits on its own graph: (log_sum_exp(z) (B,), the row's loss log_sum_exp(z) - z[y] (B,), the
    loss's gradient with respect to z (B, C), by backward())."""
    from level2_theory.autograd import Value, log_sum_exp

    lse, loss, grads = [], [], []
    for row, label in zip(logits, y):
        z = [Value(float(v)) for v in row]
        total = log_sum_exp(z)
        row_loss = total - z[int(label)]
        row_loss.backward()
        lse.append(number(total.data))
        loss.append(number(row_loss.data))
        grads.append([number(v.grad) for v in z])
    return np.array(lse), np.array(loss), np.array(grads, dtype=np.float64).reshape(logits.shape)


# ---- level 8: the framework's engine and its CPU backend ----


class Wrapped:
    """A level 8 Tensor behind the expressions' operators. Each operation is recorded with the framework's own
    _result and a backward written here in NumPy, so that the checks run the engine under grade alone (not the
    backend's matmul or broadcast, tasks of their own). `made` lists every tensor made, in order."""

    __slots__ = ("made", "t")

    def __init__(self, t, made: list):
        self.t, self.made = t, made
        made.append(t)

    def _op(self, value, inputs: tuple, backward) -> Wrapped:
        """The result of an operation, and its backward in float64 (the seed backward() starts from is float32)."""
        from level8_framework import cpu, tensor

        return Wrapped(tensor._result(np.asarray(value, dtype=np.float64), cpu.BACKEND, tuple(i.t for i in inputs),
                                      lambda g: backward(np.asarray(g, dtype=np.float64))), self.made)

    def __add__(self, other) -> Wrapped:
        if isinstance(other, Wrapped):
            return self._op(self.t.data + other.t.data, (self, other), lambda g: (g.copy(), g.copy()))
        return self._op(self.t.data + other, (self,), lambda g: (g.copy(),))

    __radd__ = __add__

    def __sub__(self, other) -> Wrapped:
        if isinstance(other, Wrapped):
            return self._op(self.t.data - other.t.data, (self, other), lambda g: (g.copy(), -g))
        return self._op(self.t.data - other, (self,), lambda g: (g.copy(),))

    def __mul__(self, other) -> Wrapped:
        a = self.t.data
        if isinstance(other, Wrapped):
            b = other.t.data
            return self._op(a * b, (self, other), lambda g: (g * b, g * a))
        return self._op(a * other, (self,), lambda g: (g * other,))

    __rmul__ = __mul__

    def __truediv__(self, other: Wrapped) -> Wrapped:
        a, b = self.t.data, other.t.data
        return self._op(a / b, (self, other), lambda g: (g / b, -g * a / (b * b)))

    def __pow__(self, k: int) -> Wrapped:
        a = self.t.data
        return self._op(a**k, (self,), lambda g: (g * k * a ** (k - 1),))

    def exp(self) -> Wrapped:
        e = np.exp(self.t.data)
        return self._op(e, (self,), lambda g: (g * e,))

    def log(self) -> Wrapped:
        a = self.t.data
        return self._op(np.log(a), (self,), lambda g: (g / a,))

    def relu(self) -> Wrapped:
        a = self.t.data
        return self._op(np.maximum(a, 0), (self,), lambda g: (g * (a > 0),))

    def sum(self) -> Wrapped:
        shape = self.t.data.shape
        return self._op(self.t.data.sum(), (self,), lambda g: (np.broadcast_to(g, shape).copy(),))


def _tensor_graph(expression: str, inputs: np.ndarray, requires: list[bool], length: int):
    """(the outputs summed to one value each, the named nodes, every tensor made) of the expression on float64
    tensors of the engine under grade: leaves row by row of inputs, requiring grad where `requires` says."""
    from level8_framework import cpu, tensor

    made: list = []
    leaves = [Wrapped(tensor._new(np.array(row, dtype=np.float64), cpu.BACKEND, bool(r)), made)
              for row, r in zip(inputs, requires)]
    outputs, named = EXPRESSIONS[expression](leaves, length)
    return [o.sum() for o in outputs], named, made


def tensor_order(expression: str, inputs: np.ndarray, requires: list[bool], length: int = 0):
    """level8_framework.tensor.topological_order of the expression's first output (summed): (each entry's index among
    the tensors made, the graph's (input, output) index pairs, which tensors require grad, the output's index)."""
    from level8_framework import tensor

    outputs, _, made = _tensor_graph(expression, inputs, requires, length)
    root = outputs[0].t
    order = list(tensor.topological_order(root))
    flags = np.array([t.requires_grad for t in made], dtype=bool)
    return _positions(order, made), _edges(made, _inputs), flags, _positions([root], made)[0]


def _inputs(t) -> tuple:
    """The tensors a Tensor was computed from (none for a leaf, or for a tensor that requires no grad)."""
    return t.node.inputs if t.node is not None else ()


def tensor_gradients(expression: str, inputs: np.ndarray, runs: list[int], retain_graph: bool, length: int = 0):
    """For each entry of runs in turn, backward() of that output of the expression (summed to one value), on one
    graph whose interior named tensors retain their grad: (the named tensors' .grad after each, (len(runs), named,
    n), NaN for none; for each run the exception it raised, "" for none)."""
    outputs, named, _ = _tensor_graph(expression, inputs, [True] * len(inputs), length)
    for t in named:
        if t.t.node is not None:
            t.t.retain_grad()
    size = inputs.shape[1]
    grads, errors = [], []
    for run in runs:
        try:
            outputs[run].t.backward(retain_graph=retain_graph)
            errors.append("")
        except Exception as e:  # noqa: BLE001 - the check reports it (through a freed graph, one must raise)
            errors.append(f"{type(e).__name__}: {e}"[:300])
        grads.append([_values(t.t.grad, size) for t in named])
    return np.array(grads, dtype=np.float64), errors


def _values(grad, size: int) -> np.ndarray:
    """A tensor's .grad as `size` float64 values: NaN for None, or for what is not a gradient of that size."""
    try:
        values = np.asarray(grad.data, dtype=np.float64).reshape(size)
    except (AttributeError, TypeError, ValueError):
        values = np.full(size, np.nan)
    return values


def transposed(a: np.ndarray) -> bool | None:
    """Whether a 2-D array runs down its columns in memory (a view w.T of a row-major w), as level 8's cpu.py reads
    it; None where one of its sides is 1 (the layout cannot tell)."""
    return None if min(a.shape, default=1) <= 1 else bool(a.strides[0] < a.strides[1])


def matmul_backward(g: np.ndarray, a: np.ndarray, b: np.ndarray, need_a: bool, need_b: bool,
                    a_transposed: bool, b_transposed: bool) -> tuple:
    """The CPU backend's matmul_backward of g, a and b, each of a and b passed as a transposed view (w.T of a row-major
    w) where asked: (da, db, whether each is laid out as a transposed view)."""
    from level8_framework import cpu

    def laid_out(x, as_view):
        return np.ascontiguousarray(x.T).T if as_view else np.ascontiguousarray(x)

    da, db = cpu.BACKEND.matmul_backward(g, laid_out(a, a_transposed), laid_out(b, b_transposed), need_a, need_b)
    layouts = [transposed(d) if isinstance(d, np.ndarray) and d.ndim == 2 else None for d in (da, db)]
    return da, db, layouts


def sum_to(g: np.ndarray, shape: tuple[int, ...]):
    """The CPU backend's sum_to: add()'s backward for an input of `shape`."""
    from level8_framework import cpu

    return cpu.BACKEND.sum_to(g, tuple(shape))
