"""Level 8 for the second network: LeNet-5 (common/nets/lenet.py) written in the framework.

The network is one Sequential of PyTorch's layers, each named as level 1's modules are (common/nets/lenet.py's
ACTIVATIONS); the level contract is mlp.py's Model, layers() included.

Run: `python -m common.harness.compare --model lenet --levels 1,8` or `pytest -m "lenet and level8"`.
"""

from __future__ import annotations

import numpy as np

from common.nets import lenet as network
from level8_framework import nn
from level8_framework.mlp import Model
from level8_framework.tensor import Tensor


def lenet() -> nn.Sequential:
    """conv1 -> ReLU -> pool -> conv2 -> ReLU -> pool -> flatten -> fc1 -> ReLU -> fc2 -> ReLU -> fc3."""
    k = network.KERNEL
    return nn.Sequential({
        "conv1": nn.Conv2d(1, 6, k), "relu1": nn.ReLU(), "pool1": nn.MaxPool2d(2),
        "conv2": nn.Conv2d(6, 16, k), "relu2": nn.ReLU(), "pool2": nn.MaxPool2d(2), "flatten": nn.Flatten(),
        "fc1": nn.Linear(256, 120), "relu3": nn.ReLU(), "fc2": nn.Linear(120, 84), "relu4": nn.ReLU(),
        "fc3": nn.Linear(84, network.N_OUT),
    })


class LeNet(Model):
    """LeNet-5, the level contract with the framework."""

    network = network

    def build(self, params: dict[str, np.ndarray]) -> nn.Module:
        return lenet()

    def as_input(self, x: Tensor) -> Tensor:
        """Images x (B, 784) viewed as (B, 1, 28, 28)."""
        return x.reshape(-1, 1, network.IMAGE, network.IMAGE)

    def activations(self) -> tuple[str, ...]:
        return tuple(network.ACTIVATIONS)
