"""Level 5: the MLP in naive CUDA kernels (mlp.cu), through the shared cffi binding. Build with `make level5`."""

from common.levels import level
from common.native import native_level

MLP = native_level(level(5))
