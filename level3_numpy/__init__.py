"""Level 3: the networks written out by hand in NumPy."""

from level3_numpy.lenet import LeNet
from level3_numpy.mlp import MLP

__all__ = ["MLP", "LeNet"]
