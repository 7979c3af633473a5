"""Level 4: the networks in plain C (mlp.c, lenet.c), loaded through the shared cffi binding. Build with `make level4`."""

from common.levels import level
from common.native import native_level

MLP = native_level(level(4))
LeNet = native_level(level(4), "lenet")
