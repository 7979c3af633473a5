"""Level 8: a framework of your own - tensors and autograd (tensor.py), views over storage, shape and strides
(strides.py), layers (nn.py), optimizers (optim.py) on a NumPy backend (cpu.py) and a GPU one (cuda.py, over ops.cu:
build with `make level8`) - and the course's two networks written in it (mlp.py, lenet.py)."""

from level8_framework import nn, optim
from level8_framework.mlp import MLP
from level8_framework.tensor import Parameter, Tensor, from_numpy, no_grad

__all__ = ["MLP", "LeNet", "Parameter", "Tensor", "from_numpy", "nn", "no_grad", "optim"]


def __getattr__(name: str):
    """LeNet, imported when first asked for: the MLP's users never load the second network's files."""
    if name == "LeNet":
        from level8_framework.lenet import LeNet

        return LeNet
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
