"""The optimizers the networks train with, and the one list of them, OPTIMIZERS, beside the list of networks.

The harness, the levels' classes, the verifier and the tests read it. Each entry names the levels that implement it,
its hyperparameters beyond the learning rate (PyTorch's defaults) and its state per parameter, by PyTorch's names.
The command line names an optimizer once (`--optimizer adam`); `get` turns the name into its entry, which is what the
rest of the code is handed. SGD is every level's update and every level's default: a level's class is given
`optimizer=` (and its variant() reports one) only for another (`options`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.nets import PEERS


@dataclass(frozen=True)
class Optimizer:
    name: str  # as `--optimizer` takes it, and as a level's class takes it: optimizer="adam"
    title: str
    levels: tuple[int, ...]  # the levels that implement it
    hyper: dict = field(default_factory=dict)  # beyond lr, as torch.optim takes them
    state: tuple[str, ...] = ()  # its state per parameter, PyTorch's names: a step count, then arrays
    lr: float | None = None  # `make compare`'s default learning rate; None: the network's chapter run's
    peers: tuple[str, ...] = ()  # the GPU peers that train with it (level1_pytorch/peers.py)

    @property
    def moments(self) -> tuple[str, ...]:
        """The arrays of its state per parameter (each the parameter's shape): its state but the step count."""
        return tuple(key for key in self.state if key != "step")

    @property
    def options(self) -> dict[str, str]:
        """What a level's class is given for it, and what the model's variant() says: nothing for SGD."""
        return {} if self.name == DEFAULT else {"optimizer": self.name}


DEFAULT = "sgd"

OPTIMIZERS: tuple[Optimizer, ...] = (
    Optimizer("sgd", "SGD", (1, 3, 4, 5, 6, 7, 8, 9), peers=PEERS),
    # level 1 with torch.optim.Adam, level 3 with adam_update beside sgd_update, level 8 with its optim.Adam
    Optimizer("adam", "Adam", (1, 3, 8), {"betas": (0.9, 0.999), "eps": 1e-8}, ("step", "exp_avg", "exp_avg_sq"),
              lr=1e-3),
)


def get(name: str) -> Optimizer:
    """The optimizer of this name."""
    for optimizer in OPTIMIZERS:
        if optimizer.name == name:
            return optimizer
    raise KeyError(f"no optimizer {name!r}; the optimizers are {', '.join(o.name for o in OPTIMIZERS)}")


SGD = get(DEFAULT)
