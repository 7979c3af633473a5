"""Level 4: the MLP in plain C (mlp.c), loaded through the shared cffi binding. Build with `make level4`."""

from common.levels import level
from common.native import native_level

MLP = native_level(level(4))
