"""The second network, LeNet-5: its layers, parameter names and layouts, seeded initial weights, FLOP count, and its
step in float64 with the decisions of its ReLUs and max-pools exposed (the verifier's yardstick, common/harness/verify.py).

    (N, 784) viewed as (N, 1, 28, 28)
    conv1 1->6, 5x5 (6x24x24) -> ReLU -> max-pool 2x2 (6x12x12)
    conv2 6->16, 5x5 (16x8x8) -> ReLU -> max-pool 2x2 (16x4x4) -> flatten (256, PyTorch's order: channel, row, column)
    fc1 256->120 -> ReLU -> fc2 120->84 -> ReLU -> fc3 84->10 -> mean softmax cross-entropy; plain SGD.
"""

from __future__ import annotations

import numpy as np

N_OUT = 10
IMAGE = 28
KERNEL = 5
PARAM_NAMES = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias", "fc2.weight",
               "fc2.bias", "fc3.weight", "fc3.bias")
SHAPES = {
    "conv1.weight": (6, 1, KERNEL, KERNEL), "conv1.bias": (6,),
    "conv2.weight": (16, 6, KERNEL, KERNEL), "conv2.bias": (16,),
    "fc1.weight": (120, 256), "fc1.bias": (120,),
    "fc2.weight": (84, 120), "fc2.bias": (84,),
    "fc3.weight": (10, 84), "fc3.bias": (10,),
}
# The activations of one image, in the order of the forward pass: what each level's layers() returns.
ACTIVATIONS = {
    "conv1": (6, 24, 24), "relu1": (6, 24, 24), "pool1": (6, 12, 12),
    "conv2": (16, 8, 8), "relu2": (16, 8, 8), "pool2": (16, 4, 4),
    "fc1": (120,), "relu3": (120,), "fc2": (84,), "relu4": (84,), "fc3": (10,),
}


def param_shapes(hidden: int | None = None) -> dict[str, tuple[int, ...]]:
    """PyTorch's layouts: Conv2d (out, in, k, k), Linear (out, in). (LeNet has no hidden size: `hidden` is ignored.)"""
    return dict(SHAPES)


def init_params(seed: int, hidden: int | None = None) -> dict[str, np.ndarray]:
    """The MLP's initialization (common.nets.mlp.init_params): W ~ U(-sqrt(2/fan_in), +sqrt(2/fan_in)), b = 0, where
    fan_in is a unit's inputs (in_channels x 5 x 5 for a convolution); drawn once, in PARAM_NAMES' order."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in SHAPES.items():
        if name.endswith("weight"):
            bound = np.sqrt(2.0 / int(np.prod(shape[1:])))
            params[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
        else:
            params[name] = np.zeros(shape, dtype=np.float32)
    return params


CONV1_MACS, CONV2_MACS = 6 * 24 * 24 * 25, 16 * 8 * 8 * 150  # multiply-adds of one image's convolutions
FC_MACS = 120 * 256 + 84 * 120 + 10 * 84


def flops_per_step(batch: int, hidden: int | None = None) -> int:
    """Multiply-adds x2 of a step: every layer's product forward, its weight gradient, and its input gradient but the
    first convolution's (no gradient for the pixels)."""
    return 2 * batch * (3 * (CONV1_MACS + CONV2_MACS + FC_MACS) - CONV1_MACS)


def forward_flops(batch: int) -> int:
    """Multiply-adds x2 of the forward pass alone (inference)."""
    return 2 * batch * (CONV1_MACS + CONV2_MACS + FC_MACS)


# ---- the float64 step, its decisions exposed ----


def forward64(params: dict, x, override: dict | None = None):
    """The forward pass in float64 (torch tensors with autograd), every ReLU and max-pool decision recorded.

    override: decisions taken instead of the values' own: {("relu1", flat index): 1 the ReLU passes, 0 it does not;
    ("pool1", flat window index): the window's chosen position 0..3}. Returns the logits and the record: for each
    ReLU its input h, for each pool its input a and chosen index.
    """
    import torch.nn.functional as F

    override = override or {}
    p = params
    record = {}

    def relu(name, h):
        mask = (h > 0).to(h.dtype).reshape(-1)
        for (layer, i), decision in override.items():
            if layer == name:
                mask[i] = decision
        record[name] = h
        return h * mask.reshape(h.shape)

    def pool(name, a):
        windows = pool_windows(a)
        choice = first_max(windows.detach())  # PyTorch's rule: the first of equal maxima, in row-major order
        flat = choice.reshape(-1)
        for (layer, i), position in override.items():
            if layer == name:
                flat[i] = position
        record[name] = (a, choice)
        return windows.gather(-1, choice.unsqueeze(-1)).squeeze(-1)

    x = x.reshape(-1, 1, IMAGE, IMAGE)
    a = pool("pool1", relu("relu1", F.conv2d(x, p["conv1.weight"], p["conv1.bias"])))
    a = pool("pool2", relu("relu2", F.conv2d(a, p["conv2.weight"], p["conv2.bias"])))
    a = relu("relu3", F.linear(a.reshape(len(a), -1), p["fc1.weight"], p["fc1.bias"]))
    a = relu("relu4", F.linear(a, p["fc2.weight"], p["fc2.bias"]))
    return F.linear(a, p["fc3.weight"], p["fc3.bias"]), record


def pool_windows(a):
    """(n, c, rows, cols) -> (n, c, rows / 2, cols / 2, 4): each 2x2 window's four values, in row-major order."""
    n, c, rows, cols = a.shape
    return a.reshape(n, c, rows // 2, 2, cols // 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(n, c, rows // 2, cols // 2, 4)


def first_max(windows):
    """The index of each window's maximum (last axis), the first of equal maxima: max-pooling's choice in PyTorch."""
    import torch

    best = windows.max(dim=-1, keepdim=True).values
    positions = torch.arange(windows.shape[-1], device=windows.device).expand_as(windows)
    return torch.where(windows == best, positions, windows.shape[-1]).min(dim=-1).values


# ---- the flat buffers of the native level (common/native/lenet.h) ----


def flatten(params: dict[str, np.ndarray]) -> np.ndarray:
    """The ten parameters in one float32 buffer, PARAM_NAMES' order, each in PyTorch's layout."""
    return np.concatenate([np.ascontiguousarray(params[k], dtype=np.float32).ravel() for k in PARAM_NAMES])


def unflatten(flat: np.ndarray) -> dict[str, np.ndarray]:
    """The parameters of a flat buffer, as copies of their shapes."""
    out, start = {}, 0
    for name in PARAM_NAMES:
        size = int(np.prod(SHAPES[name]))
        out[name] = flat[start : start + size].reshape(SHAPES[name]).copy()
        start += size
    return out


def split_layers(flat: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """lenet_layers' buffer of n images: each layer's (n, its shape), layer after layer."""
    out, start = {}, 0
    for name, shape in ACTIVATIONS.items():
        size = n * int(np.prod(shape))
        out[name] = flat[start : start + size].reshape(n, *shape)
        start += size
    return out
