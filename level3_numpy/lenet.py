"""Level 3 - NumPy by hand, for LeNet-5 (common/nets/lenet.py): the convolution and the max-pooling written out.

What this adds over the MLP (mlp.py, whose linear_*, relu_*, softmax_xent_* and sgd_update it reuses): a
convolution as one matrix product over image patches (im2col: every 5x5 patch of the batch becomes a row), its
backward as a product and a scatter back into the image (col2im), and max-pooling, whose gradient goes to the one
element of each window that was the maximum. Vectorized over the batch, float32.

Run: `python -m common.harness.compare --model lenet --levels 1,3` or `pytest -m level3 -k lenet`.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from common.contract import check_X
from common.nets import lenet
from level3_numpy.mlp import (
    Model,
    linear_backward,
    linear_forward,
    relu_backward,
    relu_forward,
    softmax_xent_backward,
    softmax_xent_forward,
)

# ---- the layers: each forward followed by its backward ----


def im2col(x: np.ndarray, k: int) -> np.ndarray:
    """The k x k patches of x (N, C, H, W) as rows: (N * OH * OW, C * k * k), OH = H - k + 1; each row in the order of
    a weight's (C, k, k) entries, so that a convolution is one matrix product."""
    # BEGIN LAB 3.10 conv2d_forward
    patches = sliding_window_view(x, (k, k), axis=(2, 3))  # (N, C, OH, OW, k, k), a view
    n, c, oh, ow = patches.shape[:4]
    return patches.transpose(0, 2, 3, 1, 4, 5).reshape(n * oh * ow, c * k * k)
    # END LAB


def col2im(cols: np.ndarray, shape: tuple[int, ...], k: int) -> np.ndarray:
    """The adjoint of im2col: each patch row of cols (N * OH * OW, C * k * k) added back where it came from, into an
    array of `shape` (N, C, H, W)."""
    # BEGIN LAB 3.11 conv2d_backward
    n, c, h, w = shape
    oh, ow = h - k + 1, w - k + 1
    patches = cols.reshape(n, oh, ow, c, k, k)
    x = np.zeros(shape, dtype=cols.dtype)
    for i in range(k):
        for j in range(k):
            x[:, :, i : i + oh, j : j + ow] += patches[:, :, :, :, i, j].transpose(0, 3, 1, 2)
    return x
    # END LAB


def conv2d_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A convolution (PyTorch's: a correlation, no flip), stride 1, no padding: x (N, C, H, W), weights w (F, C, k, k),
    bias b (F,) -> out (N, F, H - k + 1, W - k + 1)."""
    # BEGIN LAB 3.10 conv2d_forward
    n, _, h, width = x.shape
    f, k = w.shape[0], w.shape[2]
    out = im2col(x, k) @ w.reshape(f, -1).T + b  # (N * OH * OW, F)
    return out.reshape(n, h - k + 1, width - k + 1, f).transpose(0, 3, 1, 2)
    # END LAB


def conv2d_backward(dout: np.ndarray, x: np.ndarray, w: np.ndarray, need_dx: bool = True) -> tuple:
    """Backward of conv2d_forward: given dout (N, F, OH, OW), the gradient with respect to its output, and its inputs
    x and w, the gradients (dx of x's shape or None when need_dx is False, dw of w's shape, db (F,))."""
    # BEGIN LAB 3.11 conv2d_backward
    f, k = w.shape[0], w.shape[2]
    dflat = dout.transpose(0, 2, 3, 1).reshape(-1, f)  # (N * OH * OW, F), rows in im2col's order
    dw = (dflat.T @ im2col(x, k)).reshape(w.shape)
    dx = col2im(dflat @ w.reshape(f, -1), x.shape, k) if need_dx else None
    return dx, dw, dflat.sum(axis=0)
    # END LAB


def windows(a: np.ndarray) -> np.ndarray:
    """The 2 x 2 windows of a (N, C, H, W), H and W even: (N, C, H/2, W/2, 4), each window's 4 elements in row-major
    order."""
    n, c, h, w = a.shape
    return a.reshape(n, c, h // 2, 2, w // 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, c, h // 2, w // 2, 4)


def maxpool_forward(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """2 x 2 max-pooling, stride 2: a (N, C, H, W) -> (out (N, C, H/2, W/2), the position 0..3 of each window's maximum,
    row-major, the first of equal maxima as in PyTorch)."""
    # BEGIN LAB 3.12 maxpool_forward
    win = windows(a)
    choice = win.argmax(axis=-1)  # argmax returns the first of equal maxima
    return np.take_along_axis(win, choice[..., None], axis=-1)[..., 0], choice
    # END LAB


def maxpool_backward(dout: np.ndarray, choice: np.ndarray) -> np.ndarray:
    """Backward of maxpool_forward: given dout (N, C, H/2, W/2) and the positions it chose, da (N, C, H, W), the
    gradient with respect to its input."""
    # BEGIN LAB 3.13 maxpool_backward
    n, c, oh, ow = dout.shape
    win = np.zeros((n, c, oh, ow, 4), dtype=dout.dtype)
    np.put_along_axis(win, choice[..., None], dout[..., None], axis=-1)
    return win.reshape(n, c, oh, ow, 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, c, 2 * oh, 2 * ow)
    # END LAB


# ---- the model: the contract every level implements ----


class LeNet(Model):
    """LeNet-5, forward and backward by hand."""

    network = lenet

    def variant(self) -> dict[str, str]:
        """What this model computes with: NumPy on the CPU, its convolutions as im2col; its optimizer, unless SGD."""
        return {**super().variant(), "convolution": "im2col"}

    def _forward(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """x (B, 784) -> every layer's output, in order (lenet.ACTIVATIONS), and the pools' choices; the last is the
        logits."""
        p, keep = self.params, {}
        keep["conv1"] = conv2d_forward(x.reshape(-1, 1, lenet.IMAGE, lenet.IMAGE), p["conv1.weight"], p["conv1.bias"])
        keep["relu1"] = relu_forward(keep["conv1"])
        keep["pool1"], keep["choice1"] = maxpool_forward(keep["relu1"])
        keep["conv2"] = conv2d_forward(keep["pool1"], p["conv2.weight"], p["conv2.bias"])
        keep["relu2"] = relu_forward(keep["conv2"])
        keep["pool2"], keep["choice2"] = maxpool_forward(keep["relu2"])
        keep["fc1"] = linear_forward(keep["pool2"].reshape(len(x), -1), p["fc1.weight"], p["fc1.bias"])
        keep["relu3"] = relu_forward(keep["fc1"])
        keep["fc2"] = linear_forward(keep["relu3"], p["fc2.weight"], p["fc2.bias"])
        keep["relu4"] = relu_forward(keep["fc2"])
        keep["fc3"] = linear_forward(keep["relu4"], p["fc3.weight"], p["fc3.bias"])
        return keep

    def forward(self, X: np.ndarray) -> np.ndarray:
        """Logits (N, 10)."""
        return self._forward(check_X(X))["fc3"]

    def _loss_and_grads(self, x: np.ndarray, y: np.ndarray, keep_grads: dict | None = None):
        """Forward, loss, then every gradient, the backward functions in the reverse order of the forward ones; with
        keep_grads, the gradient with respect to every layer's output is stored there by name."""
        p, a = self.params, self._forward(x)
        d = {} if keep_grads is None else keep_grads
        loss, probs = softmax_xent_forward(a["fc3"], y)
        d["fc3"] = softmax_xent_backward(probs, y)
        d["relu4"], dW5, db5 = linear_backward(d["fc3"], a["relu4"], p["fc3.weight"])
        d["fc2"] = relu_backward(d["relu4"], a["fc2"])
        d["relu3"], dW4, db4 = linear_backward(d["fc2"], a["relu3"], p["fc2.weight"])
        d["fc1"] = relu_backward(d["relu3"], a["fc1"])
        dflat, dW3, db3 = linear_backward(d["fc1"], a["pool2"].reshape(len(x), -1), p["fc1.weight"])
        d["pool2"] = dflat.reshape(a["pool2"].shape)
        d["relu2"] = maxpool_backward(d["pool2"], a["choice2"])
        d["conv2"] = relu_backward(d["relu2"], a["conv2"])
        d["pool1"], dW2, db2 = conv2d_backward(d["conv2"], a["pool1"], p["conv2.weight"])
        d["relu1"] = maxpool_backward(d["pool1"], a["choice1"])
        d["conv1"] = relu_backward(d["relu1"], a["conv1"])
        _, dW1, db1 = conv2d_backward(d["conv1"], x.reshape(-1, 1, lenet.IMAGE, lenet.IMAGE), p["conv1.weight"],
                                      need_dx=False)
        grads = {"conv1.weight": dW1, "conv1.bias": db1, "conv2.weight": dW2, "conv2.bias": db2, "fc1.weight": dW3,
                 "fc1.bias": db3, "fc2.weight": dW4, "fc2.bias": db4, "fc3.weight": dW5, "fc3.bias": db5}
        return loss, grads

    def layers(self, X: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every layer's output for a batch, and the gradient of the batch's mean loss with respect to each."""
        from common.contract import check_y

        X = check_X(X)
        grads: dict[str, np.ndarray] = {}
        self._loss_and_grads(X, check_y(y, len(X)), grads)
        outputs = self._forward(X)
        return {k: outputs[k] for k in lenet.ACTIVATIONS}, {k: grads[k] for k in lenet.ACTIVATIONS}
