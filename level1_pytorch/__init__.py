"""Level 1: PyTorch, the gold standard every other level is checked against."""

from level1_pytorch.lenet import LeNet
from level1_pytorch.mlp import MLP

__all__ = ["MLP", "LeNet"]
