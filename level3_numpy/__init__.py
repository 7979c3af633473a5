"""Level 3: the MLP written out by hand in NumPy."""

from level3_numpy.mlp import MLP

__all__ = ["MLP"]
