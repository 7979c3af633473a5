"""Level 6: the MLP in CUDA with cuBLAS GEMMs (mlp.cu), through the shared cffi binding. Build with `make level6`."""

from common.levels import level
from common.native import native_level

MLP = native_level(level(6))
