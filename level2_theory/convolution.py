"""Level 2 for LeNet-5: the backward pass of a convolution and of max-pooling, derived and written as plainly as the
formulas, in float64 NumPy, to be checked against central differences and torch.autograd (tests/test_level2.py).

Shapes: x (N, C, H, W), weights W (F, C, k, k), bias b (F,), out (N, F, OH, OW) with OH = H - k + 1 (stride 1, no
padding); a gradient is its forward name with a `d` prefix. Levels 3 and 4 compute the same things faster (im2col,
loops over memory in order); this file is the yardstick they are derived from.

The forward, PyTorch's "convolution", is a correlation (the kernel is not flipped):
    out[n, f, i, j] = b[f] + sum_{c, p, q} x[n, c, i + p, j + q] W[f, c, p, q]
Each input x[n, c, i + p, j + q] meets weight W[f, c, p, q] in output (i, j); the chain rule sums over those meetings:
    db[f]          = sum_{n, i, j} dout[n, f, i, j]                                (b was added to every output)
    dW[f, c, p, q] = sum_{n, i, j} dout[n, f, i, j] x[n, c, i + p, j + q]          (a correlation of x with dout)
    dx[n, c, r, s] = sum_{f, p, q} dout[n, f, r - p, s - q] W[f, c, p, q]          (where 0 <= r - p < OH)
                   = a full correlation of dout (padded by k - 1) with W flipped in both axes.
Max-pooling, 2 x 2 windows, stride 2, passes each window's largest element on; its gradient goes to that element
only (the others did not affect the output), the first of equal maxima as PyTorch chooses.
"""

from __future__ import annotations

import numpy as np


def correlate(x: np.ndarray, W: np.ndarray) -> np.ndarray:
    """sum_{c, p, q} x[n, c, i + p, j + q] W[f, c, p, q]: x (N, C, H, W), W (F, C, k, k) -> (N, F, OH, OW)."""
    k = W.shape[2]
    oh, ow = x.shape[2] - k + 1, x.shape[3] - k + 1
    out = np.zeros((x.shape[0], W.shape[0], oh, ow))
    for p in range(k):
        for q in range(k):  # every output's term of kernel entry (p, q), for all outputs at once
            out += np.einsum("ncij,fc->nfij", x[:, :, p : p + oh, q : q + ow], W[:, :, p, q])
    return out


def conv2d_forward(x: np.ndarray, W: np.ndarray, b: np.ndarray) -> np.ndarray:
    """out = b + x correlated with W (PyTorch's Conv2d, stride 1, no padding)."""
    return correlate(x, W) + b[None, :, None, None]


def conv2d_backward(dout: np.ndarray, x: np.ndarray, W: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dx = dout (padded by k - 1) correlated with W flipped,  dW = x correlated with dout,  db = sum dout."""
    k = W.shape[2]
    oh, ow = dout.shape[2:]
    padded = np.pad(dout, ((0, 0), (0, 0), (k - 1, k - 1), (k - 1, k - 1)))
    dx = correlate(padded, W[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))  # (F, C) swapped: dx has C channels
    dW = np.zeros_like(W, dtype=np.float64)
    for p in range(k):
        for q in range(k):
            dW[:, :, p, q] = np.einsum("nfij,ncij->fc", dout, x[:, :, p : p + oh, q : q + ow])
    return dx, dW, dout.sum(axis=(0, 2, 3))


def windows(a: np.ndarray) -> np.ndarray:
    """(N, C, H, W) -> (N, C, H/2, W/2, 4): each 2 x 2 window's elements, in row-major order."""
    n, c, h, w = a.shape
    return a.reshape(n, c, h // 2, 2, w // 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, c, h // 2, w // 2, 4)


def maxpool_forward(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """out = each window's maximum; choice = its position 0..3 (the first of equal maxima)."""
    choice = windows(a).argmax(axis=-1)
    return np.take_along_axis(windows(a), choice[..., None], axis=-1)[..., 0], choice


def maxpool_backward(dout: np.ndarray, choice: np.ndarray) -> np.ndarray:
    """da: each window's dout at the position it chose, 0 at the three others."""
    n, c, oh, ow = dout.shape
    win = np.zeros((n, c, oh, ow, 4))
    np.put_along_axis(win, choice[..., None], dout[..., None], axis=-1)
    return win.reshape(n, c, oh, ow, 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, c, 2 * oh, 2 * ow)


# The usual mistakes, kept to show that the checks catch them. Never call these from a level.


def buggy_conv2d_forward(x: np.ndarray, W: np.ndarray, b: np.ndarray) -> np.ndarray:
    """WRONG: the textbook convolution, the kernel flipped; PyTorch's layer is a correlation. Silent for a kernel
    symmetric under a half-turn."""
    return conv2d_forward(x, W[:, :, ::-1, ::-1], b)


def buggy_conv2d_backward(dout: np.ndarray, x: np.ndarray, W: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """WRONG: dx as a full correlation with W not flipped."""
    dx, dW, db = conv2d_backward(dout, x, W[:, :, ::-1, ::-1])
    return dx, conv2d_backward(dout, x, W)[1], db


def buggy_maxpool_backward(dout: np.ndarray, choice: np.ndarray) -> np.ndarray:
    """WRONG: each window's gradient sent to all four of its elements, as if pooling were a sum."""
    return np.repeat(np.repeat(dout, 2, axis=2), 2, axis=3)


def buggy_maxpool_forward(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """WRONG at ties only: the last of equal maxima; PyTorch takes the first. The output is the same, the gradient
    goes elsewhere."""
    choice = 3 - windows(a)[..., ::-1].argmax(axis=-1)
    return np.take_along_axis(windows(a), choice[..., None], axis=-1)[..., 0], choice
