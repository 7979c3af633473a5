"""Level 5: the networks in naive CUDA kernels (mlp.cu, lenet.cu), through the shared cffi binding. Build with
`make level5`."""

from common.levels import level
from common.native import lazy_lenet, native_level

MLP = native_level(level(5))
__all__ = ["MLP", "LeNet"]

__getattr__ = lazy_lenet(level(5), globals())
