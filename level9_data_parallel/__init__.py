"""Level 9: data parallel, two workers each on its share of every batch, gradients all-reduced by torch.distributed (on
the CPU) or by NCCL (on GPUs)."""

from level9_data_parallel.mlp import DDP, MLP, LeNet

__all__ = ["DDP", "MLP", "LeNet"]
