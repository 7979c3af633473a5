"""Level 9: data parallel, two workers each on its share of every batch, gradients all-reduced by torch.distributed."""

from level9_data_parallel.mlp import DDP, MLP

__all__ = ["DDP", "MLP"]
