"""Level 3 - NumPy by hand.

What this level adds over level 1: no autograd and no optimizer. The forward pass, the backward
pass (derived in level 2's chapter) and the SGD update are written out with NumPy, float32,
vectorized over the batch: each line below is one formula of the derivation, and the names
(h, a, logits, dlogits, da, dh, dW1, ...) are the ones levels 4-6 use in C and CUDA.

Run: `python -m common.compare --levels 1,3` or `pytest -m level3`.
"""

from __future__ import annotations

import numpy as np

from common.contract import DataCache, check_params, check_training, check_X, check_y, n_steps


class MLP:
    """The level contract, forward and backward by hand."""

    def __init__(self, params: dict[str, np.ndarray]):
        self.params = check_params(params)
        self._data = DataCache()

    def train_epoch(self, X: np.ndarray, y: np.ndarray, batch_size: int, lr: float, order=None) -> np.ndarray:
        """One pass over X in `order`; returns each step's loss, taken before that step's update."""
        X, y = self._data.fetch(X, y, lambda X, y: (X, y))  # nothing to upload: NumPy reads X in place
        order, batch_size, lr = check_training(len(X), batch_size, lr, order)
        losses = np.empty(n_steps(len(order), batch_size), dtype=np.float32)
        for step in range(len(losses)):
            batch = order[step * batch_size : (step + 1) * batch_size]
            losses[step], grads = self._loss_and_grads(X[batch], y[batch])
            for name, grad in grads.items():  # sgd_update: p -= lr * dp
                self.params[name] -= lr * grad
        return losses

    def loss_and_grads(self, X: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        """Mean cross-entropy of one batch and its gradients; parameters unchanged."""
        X = check_X(X)
        loss, grads = self._loss_and_grads(X, check_y(y, len(X)))
        return float(loss), grads

    def forward(self, X: np.ndarray) -> np.ndarray:
        """Logits (N, 10)."""
        return self._forward(check_X(X))[2]

    def state_dict(self) -> dict[str, np.ndarray]:
        """float32 copies of the parameters."""
        return {name: p.copy() for name, p in self.params.items()}

    def load_state_dict(self, params: dict[str, np.ndarray]) -> None:
        """Replace the parameters (same hidden size)."""
        self.params = check_params(params, len(self.params["fc1.bias"]))

    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x (B, 784) -> h (B, H), a (B, H), logits (B, 10); h and a are kept for the backward pass."""
        p = self.params
        h = x @ p["fc1.weight"].T + p["fc1.bias"]  # linear_forward
        a = np.maximum(h, 0)  # relu_forward
        logits = a @ p["fc2.weight"].T + p["fc2.bias"]  # linear_forward
        return h, a, logits

    def _loss_and_grads(self, x: np.ndarray, y: np.ndarray) -> tuple[np.float32, dict[str, np.ndarray]]:
        """Forward, loss, then every gradient, each line the derivative of one forward line."""
        p = self.params
        batch = len(x)
        rows = np.arange(batch)
        h, a, logits = self._forward(x)
        # softmax_xent_forward: subtracting the row max keeps exp() finite; log-sum-exp gives the loss
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_sum = np.log(np.exp(shifted).sum(axis=1))
        loss = np.mean(log_sum - shifted[rows, y])
        # softmax_xent_backward: d(mean loss)/d(logits) = (softmax - onehot) / B
        dlogits = np.exp(shifted - log_sum[:, None])
        dlogits[rows, y] -= 1
        dlogits /= batch
        # linear_backward of logits = a W2^T + b2
        dW2 = dlogits.T @ a
        db2 = dlogits.sum(axis=0)
        da = dlogits @ p["fc2.weight"]
        # relu_backward of a = max(h, 0): the mask comes from h, the input of the ReLU
        dh = da * (h > 0)
        # linear_backward of h = x W1^T + b1 (no gradient for the pixels: nothing learns them)
        dW1 = dh.T @ x
        db1 = dh.sum(axis=0)
        return loss, {"fc1.weight": dW1, "fc1.bias": db1, "fc2.weight": dW2, "fc2.bias": db2}
