"""Level 2: the backpropagation derivation that levels 3-6 implement, one small NumPy function per formula.

Level 1 lets PyTorch's autograd find the gradients. This level writes each gradient down by hand,
with the names, shapes and argument order that the NumPy, C and CUDA levels use, so that every
formula can be checked on its own against central differences and torch.autograd in float64.
It also keeps the usual mistakes (`buggy_*`), so the chapter and the tests can show that the
checks catch them. It does not train; `chapter.ipynb` beside it is the derivation in prose.

Shapes: x (B, in), W (out, in), b (out,), y (B,) integer labels, logits (B, 10);
a gradient is its forward name with a `d` prefix (dx, dW, db, dh, da, dlogits).

Run its tests:  pytest -m level2        (the notebook: pytest --nbmake level2_theory/chapter.ipynb)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def linear_forward(x: np.ndarray, W: np.ndarray, b: np.ndarray) -> np.ndarray:
    """out = x W^T + b, shapes (B, in) (out, in) (out,) -> (B, out)."""
    # BEGIN LAB 2.1 linear layer
    return x @ W.T + b
    # END LAB


def linear_backward(dout: np.ndarray, x: np.ndarray, W: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dx = dout W,  dW = dout^T x,  db = sum_b dout."""
    # BEGIN LAB 2.1 linear layer
    dx = dout @ W  # (B, out) (out, in) -> (B, in)
    dW = dout.T @ x  # (out, B) (B, in) -> (out, in): the same layout as W
    db = dout.sum(axis=0)  # b was broadcast over the batch, so its gradient sums over it
    return dx, dW, db
    # END LAB


def relu_forward(h: np.ndarray) -> np.ndarray:
    """a = max(h, 0)."""
    # BEGIN LAB 2.2 ReLU
    return np.maximum(h, 0)
    # END LAB


def relu_backward(da: np.ndarray, h: np.ndarray) -> np.ndarray:
    """dh = da * (h > 0), the mask taken from the pre-activation h."""
    # BEGIN LAB 2.2 ReLU
    return da * (h > 0)
    # END LAB


def softmax(logits: np.ndarray) -> np.ndarray:
    """p = exp(z - max z) / sum exp(z - max z), row by row; subtracting the max changes nothing but overflow."""
    # BEGIN LAB 2.3 softmax cross-entropy
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)
    # END LAB


def softmax_xent_forward(logits: np.ndarray, y: np.ndarray) -> float:
    """loss = mean_b( logsumexp(z_b) - z_b[y_b] ), logsumexp(z) = m + log sum exp(z - m), m = max z."""
    # BEGIN LAB 2.3 softmax cross-entropy
    m = logits.max(axis=1, keepdims=True)
    logsumexp = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
    return float(np.mean(logsumexp - logits[np.arange(len(y)), y]))
    # END LAB


def softmax_xent_backward(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """dlogits = (softmax(z) - onehot(y)) / B; the 1/B is the derivative of the mean."""
    # BEGIN LAB 2.3 softmax cross-entropy
    dlogits = softmax(logits)
    dlogits[np.arange(len(y)), y] -= 1
    return dlogits / len(y)
    # END LAB


def mlp_loss_and_grads(
    params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    """The whole step: forward 784 -> H (ReLU) -> 10, mean cross-entropy, then every gradient, keyed like params."""
    W1, b1, W2, b2 = (params[k] for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    h = linear_forward(x, W1, b1)  # (B, H)
    a = relu_forward(h)  # (B, H)
    logits = linear_forward(a, W2, b2)  # (B, 10)
    loss = softmax_xent_forward(logits, y)
    dlogits = softmax_xent_backward(logits, y)  # (B, 10)
    da, dW2, db2 = linear_backward(dlogits, a, W2)  # logits = a W2^T + b2
    dh = relu_backward(da, h)  # a = relu(h)
    _, dW1, db1 = linear_backward(dh, x, W1)  # h = x W1^T + b1; dx is unused (no gradient for pixels)
    return loss, {"fc1.weight": dW1, "fc1.bias": db1, "fc2.weight": dW2, "fc2.bias": db2}


def sgd_update(params: dict[str, np.ndarray], grads: dict[str, np.ndarray], lr: float) -> dict[str, np.ndarray]:
    """p <- p - lr * dp for every parameter (returned as a new dict; levels 3-6 update in place)."""
    return {name: p - lr * grads[name] for name, p in params.items()}


def numerical_gradient(f: Callable[[np.ndarray], float], x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """df/dx_i ~ (f(x + eps e_i) - f(x - eps e_i)) / (2 eps) for every entry i, in float64."""
    x = np.array(x, dtype=np.float64)  # a copy: it is perturbed in place, one entry at a time
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        f_plus = f(x)
        x[i] = old - eps
        f_minus = f(x)
        x[i] = old
        grad[i] = (f_plus - f_minus) / (2 * eps)
    return grad


def rel_error(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b|: the error measured against the size of the reference b."""
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), np.finfo(np.float64).tiny))


# The chapter's exercise: another activation.


def tanh_forward(h: np.ndarray) -> np.ndarray:
    """a = tanh(h), elementwise."""
    return np.tanh(h)


def tanh_backward(da: np.ndarray, a: np.ndarray) -> np.ndarray:
    """dh, the gradient of the loss with respect to tanh's input h, given da (with respect to its output) and the
    output a = tanh(h) kept from the forward pass; all of one shape."""
    # BEGIN LAB 2.5 tanh_backward
    return da * (1 - a**2)
    # END LAB


# The usual mistakes, kept to show that the checks catch them. Never call these from a level.


def buggy_softmax_xent_backward(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """WRONG: softmax(z) - onehot(y) without the 1/B, a gradient B times too large (invisible at B = 1)."""
    return softmax_xent_backward(logits, y) * len(y)


def buggy_relu_backward(da: np.ndarray, h: np.ndarray) -> np.ndarray:
    """WRONG: dh = da * (da > 0), the mask taken from the incoming gradient instead of the pre-activation h."""
    return da * (da > 0)


def buggy_linear_backward(dout: np.ndarray, x: np.ndarray, W: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """WRONG: dW = x^T dout, the transpose of the true dW, shape (in, out); silent when W is square."""
    dx, dW, db = linear_backward(dout, x, W)
    return dx, dW.T, db


def buggy_softmax(logits: np.ndarray) -> np.ndarray:
    """WRONG: exp(z) / sum exp(z) without subtracting the max; exp overflows to inf (z > 88 in float32)."""
    e = np.exp(logits)
    return e / e.sum(axis=1, keepdims=True)
