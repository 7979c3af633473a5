"""The network every level trains: sizes, parameter names and layouts, the seeded initial weights, the FLOP count."""

from __future__ import annotations

import numpy as np

N_IN = 784  # 28 x 28 pixels
N_OUT = 10  # digits 0-9
HIDDEN = 256
PARAM_NAMES = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def param_shapes(hidden: int = HIDDEN) -> dict[str, tuple[int, ...]]:
    """PyTorch's layouts: nn.Linear stores its weight as (out_features, in_features)."""
    return {
        "fc1.weight": (hidden, N_IN),
        "fc1.bias": (hidden,),
        "fc2.weight": (N_OUT, hidden),
        "fc2.bias": (N_OUT,),
    }


def activations(hidden: int = HIDDEN) -> dict[str, tuple[int, ...]]:
    """The activations of one image, in the order of the forward pass: what each level's layers() returns."""
    return {"fc1": (hidden,), "relu1": (hidden,), "fc2": (N_OUT,)}


def split_layers(flat: np.ndarray, n: int, hidden: int) -> dict[str, np.ndarray]:
    """mlp_layers' buffer of n images: each layer's (n, its size), layer after layer."""
    out, start = {}, 0
    for name, (size,) in activations(hidden).items():
        out[name] = flat[start : start + n * size].reshape(n, size)
        start += n * size
    return out


def init_params(seed: int, hidden: int = HIDDEN) -> dict[str, np.ndarray]:
    """W ~ U(-sqrt(2/fan_in), +sqrt(2/fan_in)), b = 0; drawn once here and handed to every level.

    A uniform draw scaled by fan_in (the inputs of a unit). Its variance, 2 / (3 fan_in), is a third of He's
    (2 / fan_in) and twice that of PyTorch's nn.Linear default, U(-1/sqrt(fan_in), +1/sqrt(fan_in)). It is not a named
    scheme: it is simply the fixed starting point every level shares.
    """
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(hidden).items():
        if name.endswith("weight"):
            bound = np.sqrt(2.0 / shape[1])
            params[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
        else:
            params[name] = np.zeros(shape, dtype=np.float32)
    return params


def flops_per_step(batch: int, hidden: int) -> int:
    """Multiply-adds x2 of the three matrix products of a step, both layers.

    Forward: x W1^T and a W2^T; backward: dW2 = dz^T a, da = dz W2, dW1 = dh^T x
    (no gradient for the input pixels). The elementwise work is negligible beside these.
    """
    return 2 * batch * hidden * (2 * N_IN + 3 * N_OUT)


def bytes_per_step(batch: int, hidden: int) -> int:
    """The bytes a step moves to and from memory when each of its kernels, queued one after another as at levels 5 and
    6, reads each of its inputs and writes each of its outputs once (float32, and int32 labels and order): a step's
    least traffic unfused. (Level 7's fused epoch keeps activations, and the weights between steps, on chip.)"""
    B, H, I, O = batch, hidden, N_IN, N_OUT
    x, h, z, w1, w2 = B * I, B * H, B * O, H * I, O * H  # the batch, a hidden layer's values, the logits, the weights
    moved = {  # each kernel's inputs + outputs, in 4-byte elements
        "gather": (B + x + B) + (x + B),  # the order, the data set's rows and labels; the batch
        "fc1": (x + w1) + h, "+ b1": (h + H) + h, "ReLU": h + h,
        "fc2": (h + w2) + z, "+ b2": (z + O) + z,
        "softmax, loss": (z + B) + (z + B) + (B + 1),  # probabilities and each row's loss, then their mean
        "dlogits": (z + B) + z,
        "dW2": (z + h) + w2, "da": (z + w2) + h, "db2": z + O,
        "ReLU backward": (h + h) + h,
        "dW1": (h + x) + w1, "db1": h + H,
        "SGD": 3 * (w1 + H + w2 + O),  # each parameter and its gradient read, the parameter written
    }
    return 4 * sum(moved.values())
