"""Level 1: PyTorch, the gold standard every other level is checked against."""

from level1_pytorch.mlp import MLP

__all__ = ["MLP", "LeNet"]


def __getattr__(name: str):
    """LeNet, imported when first asked for: the MLP's users never load the second network's files."""
    if name == "LeNet":
        from level1_pytorch.lenet import LeNet

        return LeNet
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
