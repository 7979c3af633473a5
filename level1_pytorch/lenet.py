"""Level 1 - PyTorch, the gold standard, for the second network: LeNet-5 (common/nets/lenet.py).

The same contract as the MLP's (mlp.Model: nn.Module, autograd, torch.optim.SGD or Adam, full float32, deterministic,
CPU and CUDA, a float64 twin with dtype="float64", and layers(), every layer's output and gradient, for the verifier's
per-layer check); only the network differs.

Run: `python -m common.harness.compare --model lenet --levels 1` or `pytest -m level1 -k lenet`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from common.nets import lenet
from level1_pytorch.mlp import Model


class Net(nn.Module):
    """conv1 -> ReLU -> max-pool -> conv2 -> ReLU -> max-pool -> fc1 -> ReLU -> fc2 -> ReLU -> fc3, each layer a module
    named as in lenet.ACTIVATIONS, so that a forward hook can watch any of them (common/harness/serving.py does)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.relu1, self.pool1 = nn.Conv2d(1, 6, lenet.KERNEL), nn.ReLU(), nn.MaxPool2d(2)
        self.conv2, self.relu2, self.pool2 = nn.Conv2d(6, 16, lenet.KERNEL), nn.ReLU(), nn.MaxPool2d(2)
        self.fc1, self.relu3 = nn.Linear(256, 120), nn.ReLU()
        self.fc2, self.relu4 = nn.Linear(120, 84), nn.ReLU()
        self.fc3 = nn.Linear(84, lenet.N_OUT)

    def forward(self, x: torch.Tensor, keep: dict | None = None) -> torch.Tensor:
        """Logits of x (N, 784); with `keep`, every layer's output is stored there by name (lenet.ACTIVATIONS)."""
        a = x.reshape(-1, 1, lenet.IMAGE, lenet.IMAGE)
        for name in lenet.ACTIVATIONS:
            a = getattr(self, name)(a.flatten(1) if name == "fc1" else a)  # fc1 reads pool2 flattened
            if keep is not None:
                keep[name] = a
        return a


class LeNet(Model):
    """LeNet-5, the level contract with nn.Module, autograd and torch.optim."""

    network = lenet

    def build(self, params: dict[str, np.ndarray]) -> nn.Module:
        return Net()
