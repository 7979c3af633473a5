"""Level 6: the networks in CUDA with the libraries: cuBLAS GEMMs (mlp.cu) and, for LeNet-5, cuDNN's convolutions
(lenet.cu), through the shared cffi binding. Build with `make level6`."""

from common.levels import level
from common.native import native_level

MLP = native_level(level(6))
__all__ = ["MLP", "LeNet"]


def __getattr__(name: str):
    """LeNet, loaded when first asked for (from liblenet.so): the MLP's users never load the second network's files."""
    if name == "LeNet":
        globals()["LeNet"] = native_level(level(6), "lenet")
        return globals()["LeNet"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
