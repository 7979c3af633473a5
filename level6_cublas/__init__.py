"""Level 6: the networks in CUDA with the libraries: cuBLAS GEMMs (mlp.cu) and, for LeNet-5, cuDNN's convolutions
(lenet.cu), through the shared cffi binding. Build with `make level6`."""

from common.levels import level
from common.native import lazy_lenet, native_level

MLP = native_level(level(6))
__all__ = ["MLP", "LeNet"]

__getattr__ = lazy_lenet(level(6), globals())
