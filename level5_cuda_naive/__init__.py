"""Level 5: the networks in naive CUDA kernels (mlp.cu, lenet.cu), through the shared cffi binding. Build with
`make level5`."""

from common.levels import level
from common.native import native_level

MLP = native_level(level(5))
__all__ = ["MLP", "LeNet"]


def __getattr__(name: str):
    """LeNet, loaded when first asked for (from liblenet.so): the MLP's users never load the second network's files."""
    if name == "LeNet":
        globals()["LeNet"] = native_level(level(5), "lenet")
        return globals()["LeNet"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
