"""Level 3 - NumPy by hand.

What this level adds over level 1: no autograd and no optimizer. The forward pass, the backward
pass (derived in level 2's chapter) and the SGD update are written out with NumPy, float32,
vectorized over the batch, as the layer functions below - the very names, order and arguments
that levels 4-6 use in C and CUDA (outputs first there; here they are returned). Each backward
function sits next to its forward, and each can be checked against PyTorch on its own (the chapter
does: "isolate and conquer"). Two more updates stand beside SGD's: momentum's and Adam's, PyTorch's
rules written out (level 8's optimizers run them on the CPU; optimizer="adam" trains this level's
networks with Adam).

Run: `python -m common.harness.compare --levels 1,3` or `pytest -m level3`.
"""

from __future__ import annotations

import numpy as np

from common.contract import (
    DataCache,
    check_optimizer,
    check_optimizer_state,
    check_params,
    check_training,
    check_X,
    check_y,
    n_steps,
)
from common.nets import mlp

# ---- the layers: each forward followed by its backward ----


def linear_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The fully connected layer: x (B, n_in), weights w (n_out, n_in), bias b (n_out,) -> out (B, n_out)."""
    # BEGIN LAB 3.1 linear_forward
    return x @ w.T + b
    # END LAB


def linear_backward(dout: np.ndarray, x: np.ndarray, w: np.ndarray | None) -> tuple:
    """Backward of linear_forward: given dout (B, n_out), the gradient with respect to its output, and its inputs x
    (B, n_in) and w (n_out, n_in), the gradients (dx (B, n_in), dw (n_out, n_in), db (n_out,)).

    dx is None when w is None: the first layer needs no gradient for the pixels.
    """
    # BEGIN LAB 3.2 linear_backward
    return (dout @ w if w is not None else None), dout.T @ x, dout.sum(axis=0)
    # END LAB


def relu_forward(h: np.ndarray) -> np.ndarray:
    """ReLU, elementwise: a = max(h, 0), of h's shape."""
    # BEGIN LAB 3.3 relu_forward
    return np.maximum(h, 0)
    # END LAB


def relu_backward(da: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Backward of relu_forward: given da, the gradient with respect to its output, and h, its input (one shape),
    the gradient dh with respect to h; 0 where h is exactly 0, as in PyTorch."""
    # BEGIN LAB 3.4 relu_backward
    return da * (h > 0)
    # END LAB


def softmax_xent_forward(logits: np.ndarray, y: np.ndarray) -> tuple[np.float32, np.ndarray]:
    """(the mean softmax cross-entropy of logits (B, 10) against labels y (B), the softmax probabilities (B, 10));
    both finite for any finite logits, however large."""
    # BEGIN LAB 3.5 softmax_xent_forward
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(shifted).sum(axis=1))
    loss = np.mean(log_sum - shifted[np.arange(len(y)), y])
    return loss, np.exp(shifted - log_sum[:, None])
    # END LAB


def softmax_xent_backward(probs: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Backward of softmax_xent_forward: given its probabilities probs (B, 10) and the labels y (B), dlogits
    (B, 10), the gradient of the mean loss with respect to the logits."""
    # BEGIN LAB 3.6 softmax_xent_backward
    dlogits = probs.copy()
    dlogits[np.arange(len(y)), y] -= 1
    return dlogits / len(y)
    # END LAB


def sgd_update(params: dict[str, np.ndarray], grads: dict[str, np.ndarray], lr: np.float32) -> None:
    """p -= lr * dp, in place, for every parameter."""
    # BEGIN LAB 3.7 sgd_update
    for name, grad in grads.items():
        params[name] -= lr * grad
    # END LAB


def sgd_momentum_update(params: dict[str, np.ndarray], grads: dict[str, np.ndarray],
                        velocity: dict[str, np.ndarray], lr: np.float32, momentum: float = 0.9) -> None:
    """The update of torch.optim.SGD(momentum=momentum), in place: every parameter and its velocity (same names and
    shapes as params, zeros before the first step) change; the chapter's exercise."""
    # BEGIN LAB 3.9 sgd_momentum_update
    for name, grad in grads.items():
        velocity[name] *= momentum
        velocity[name] += grad
        params[name] -= lr * velocity[name]
    # END LAB


def adam_update(params: dict[str, np.ndarray], grads: dict[str, np.ndarray], exp_avg: dict[str, np.ndarray],
                exp_avg_sq: dict[str, np.ndarray], step: int, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                eps: float = 1e-8) -> None:
    """The update of torch.optim.Adam (no weight decay, no amsgrad) at step `step` (1 for the first), in place, in
    PyTorch's float32 order of operations: every parameter of params and its moments exp_avg and exp_avg_sq (same
    names and shapes as params, zeros before step 1) change; grads are the parameters' gradients."""
    # BEGIN LAB 3.14 adam_update
    # Every parameter p, with its gradient g and its moments m and v:
    #     m = m + (1 - beta1) (g - m)                      m.lerp_(g, 1 - beta1)
    #     v = beta2 v + (1 - beta2) g g                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    #     p = p - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps),   bc1 = 1 - beta1^step, bc2 = 1 - beta2^step
    # The bias corrections and lr / bc1 are float64, as PyTorch's Python computes them; eps is added outside the
    # square root.
    beta1, beta2 = betas
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    step_size = np.float32(lr / bias_correction1)
    for name, grad in grads.items():
        m, v = exp_avg[name], exp_avg_sq[name]
        m += np.float32(1 - beta1) * (grad - m)
        v *= np.float32(beta2)
        v += np.float32(1 - beta2) * grad * grad
        denom = np.sqrt(v) / np.float32(bias_correction2_sqrt) + np.float32(eps)
        params[name] -= step_size * m / denom
    # END LAB


# ---- the model: the contract every level implements ----


class Model:
    """The level contract, forward and backward by hand, for any network: a subclass writes `_forward` and
    `_loss_and_grads`, and `network` names its parameters (the MLP below; LeNet-5 in lenet.py). The update is
    sgd_update, or with optimizer="adam" adam_update, its moments kept from step to step."""

    network = mlp  # the module of the network's parameter names and shapes

    def __init__(self, params: dict[str, np.ndarray], optimizer: str = "sgd"):
        self.params = check_params(params, network=self.network)
        self.rule = check_optimizer(optimizer)  # its entry in common/nets/optimizers.py
        self.steps = 0  # Adam's steps taken, and its moments m and v by parameter name (made at the first step)
        self.exp_avg: dict[str, np.ndarray] = {}
        self.exp_avg_sq: dict[str, np.ndarray] = {}
        self._data = DataCache()

    def train_epoch(self, X: np.ndarray, y: np.ndarray, batch_size: int, lr: float, order=None) -> np.ndarray:
        """One pass over X in `order`; returns each step's loss, taken before that step's update."""
        X, y = self._data.fetch(X, y, lambda X, y: (X, y))  # nothing to upload: NumPy reads X in place
        order, batch_size, lr = check_training(len(X), batch_size, lr, order)
        losses = np.empty(n_steps(len(order), batch_size), dtype=np.float32)
        for step in range(len(losses)):
            batch = order[step * batch_size : (step + 1) * batch_size]
            losses[step], grads = self._loss_and_grads(X[batch], y[batch])
            self._update(grads, lr)
        return losses

    def _update(self, grads: dict[str, np.ndarray], lr: np.float32) -> None:
        """The optimizer's step: sgd_update, or adam_update from the moments of the step before."""
        if self.rule.name == "sgd":
            sgd_update(self.params, grads, lr)
            return
        if not self.steps:  # Adam's first step: both moments start at zero
            self.exp_avg, self.exp_avg_sq = ({k: np.zeros_like(p) for k, p in self.params.items()} for _ in range(2))
        self.steps += 1
        adam_update(self.params, grads, self.exp_avg, self.exp_avg_sq, self.steps, float(lr), **self.rule.hyper)

    def variant(self) -> dict[str, str]:
        """What this model computes with: NumPy, on the CPU; its optimizer, unless SGD."""
        return {"device": "cpu", **self.rule.options}

    def loss_and_grads(self, X: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        """Mean cross-entropy of one batch and its gradients; parameters unchanged."""
        X = check_X(X)
        loss, grads = self._loss_and_grads(X, check_y(y, len(X)))
        return float(loss), grads

    def forward(self, X: np.ndarray) -> np.ndarray:
        """Logits (N, 10)."""
        return self._forward(check_X(X))[-1]

    def state_dict(self) -> dict[str, np.ndarray]:
        """float32 copies of the parameters."""
        return {name: p.copy() for name, p in self.params.items()}

    def load_state_dict(self, params: dict[str, np.ndarray]) -> None:
        """Replace the parameters (same sizes)."""
        self.params = check_params(params, len(self.params["fc1.bias"]), network=self.network)

    def optimizer_state(self) -> dict[str, dict]:
        """Adam's state by parameter name, as torch.optim keeps it (common/contract): the step count and copies of m
        and v; {} before the first step, and for SGD."""
        if not self.steps:
            return {}
        return {name: {"step": self.steps, "exp_avg": self.exp_avg[name].copy(),
                       "exp_avg_sq": self.exp_avg_sq[name].copy()} for name in self.params}

    def load_optimizer_state(self, state: dict[str, dict]) -> None:
        """Replace Adam's state (optimizer_state()'s form; {} forgets it)."""
        state = check_optimizer_state(state, self.params, self.rule)
        self.steps = next(iter(state.values()))["step"] if state else 0
        self.exp_avg = {name: s["exp_avg"] for name, s in state.items()}
        self.exp_avg_sq = {name: s["exp_avg_sq"] for name, s in state.items()}


class MLP(Model):
    """The MLP: 784 -> hidden (ReLU) -> 10."""

    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x (B, 784) -> h (B, H), a (B, H), logits (B, 10); h and a are kept for the backward pass."""
        p = self.params
        h = linear_forward(x, p["fc1.weight"], p["fc1.bias"])
        a = relu_forward(h)
        return h, a, linear_forward(a, p["fc2.weight"], p["fc2.bias"])

    def _loss_and_grads(self, x: np.ndarray, y: np.ndarray, keep: dict | None = None):
        """Forward, loss, then every gradient: the backward functions in the reverse order of the forward ones. With
        keep, every layer's output and the gradient with respect to it are stored there, as (output, gradient)."""
        p = self.params
        h, a, logits = self._forward(x)
        loss, probs = softmax_xent_forward(logits, y)
        dlogits = softmax_xent_backward(probs, y)
        da, dW2, db2 = linear_backward(dlogits, a, p["fc2.weight"])
        dh = relu_backward(da, h)
        _, dW1, db1 = linear_backward(dh, x, None)
        if keep is not None:
            keep.update(fc1=(h, dh), relu1=(a, da), fc2=(logits, dlogits))
        return loss, {"fc1.weight": dW1, "fc1.bias": db1, "fc2.weight": dW2, "fc2.bias": db2}

    def layers(self, X: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every layer's output for a batch, and the gradient of the batch's mean loss with respect to each."""
        X = check_X(X)
        keep: dict[str, tuple] = {}
        self._loss_and_grads(X, check_y(y, len(X)), keep)
        return {k: out for k, (out, _) in keep.items()}, {k: grad for k, (_, grad) in keep.items()}
