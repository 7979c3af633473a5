"""Level 3: the networks written out by hand in NumPy."""

from level3_numpy.mlp import MLP

__all__ = ["MLP", "LeNet"]


def __getattr__(name: str):
    """LeNet, imported when first asked for: the MLP's users never load the second network's files."""
    if name == "LeNet":
        from level3_numpy.lenet import LeNet

        return LeNet
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
