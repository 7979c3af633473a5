"""The one list of networks. The harness, the benchmark, the tests and the plots read it, beside common/levels.py.

Each entry names the module that defines the network (its parameter names and shapes, initial weights and FLOP
count: common/model.py, common/lenet.py), the class every level exports for it, the shared library of each native
level that implements it, and the levels that do. Adding a network: its module, its levels' files, and a line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType



@dataclass(frozen=True)
class Model:
    name: str  # as `--model` takes it
    title: str
    module: str  # of the network: PARAM_NAMES, param_shapes(hidden), init_params(seed, hidden), flops_per_step(...)
    class_name: str  # what each level's package exports: level3_numpy.MLP, level3_numpy.LeNet
    levels: tuple[int, ...]  # the levels that implement it (level 2 derives; it does not train)
    libraries: tuple[tuple[int, str], ...]  # (level, shared library relative to its package) of the native levels
    has_hidden: bool  # whether `--hidden` sizes it
    step: str  # "module:class" of its float64 step for the verifier's lockstep (common/verify.py)
    run: dict  # the chapter run, `make compare`'s defaults: epochs, train_size, batch, lr
    convolutions: tuple[tuple[int, tuple[str, ...]], ...] = ()  # (level, its convolutions, the default first)

    @property
    def network(self) -> ModuleType:
        """The network's module, imported when first asked for (an MLP run never imports LeNet's files)."""
        return importlib.import_module(self.module)

    def library(self, number: int) -> str | None:
        """The shared library of native level `number` for this network, or None."""
        return dict(self.libraries).get(number)

    def variants(self, number: int) -> tuple[str | None, ...]:
        """The convolutions of level `number` for this network, each a run of `make compare`; (None,) where it has
        no choice."""
        return dict(self.convolutions).get(number, (None,))

    def float64_step(self):
        """The class of its float64 step: (params, x, y, lr) -> the step, with the ties that explain a level's."""
        module, name = self.step.split(":")
        return getattr(importlib.import_module(module), name)


MODELS: tuple[Model, ...] = (
    Model("mlp", "the MLP, 784-hidden-10", "common.model", "MLP", (1, 2, 3, 4, 5, 6, 7, 8),
          ((4, "libmlp.so"), (5, "libmlp.so"), (6, "libmlp.so"), (7, "libmlp.so")), has_hidden=True,
          step="common.verify:MlpStep", run={"epochs": 10, "train_size": 10_000, "batch": 8, "lr": 0.01}),
    Model("lenet", "LeNet-5", "common.lenet", "LeNet", (1, 2, 3, 4, 5, 6, 7, 8),
          ((4, "liblenet.so"), (5, "liblenet.so"), (6, "liblenet.so"), (7, "liblenet.so")), has_hidden=False,
          step="common.lenet_verify:LeNetStep",
          # 1,250 steps: every CPU level trained and verified at each step, 2 to 3 minutes on 2 cores
          run={"epochs": 2, "train_size": 10_000, "batch": 16, "lr": 0.05},
          convolutions=((4, ("direct", "im2col")), (5, ("direct", "tiled")))),
)


def get(name: str) -> Model:
    """The network of this name."""
    for m in MODELS:
        if m.name == name:
            return m
    raise KeyError(f"no model {name!r}; models are {', '.join(m.name for m in MODELS)}")
