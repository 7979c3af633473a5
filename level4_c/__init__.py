"""Level 4: the networks in plain C (mlp.c, lenet.c), loaded through the shared cffi binding. Build with `make level4`."""

from common.levels import level
from common.native import lazy_lenet, native_level

MLP = native_level(level(4))
__all__ = ["MLP", "LeNet"]

__getattr__ = lazy_lenet(level(4), globals())
