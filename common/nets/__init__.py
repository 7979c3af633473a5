"""The networks: each one's definition (mlp.py, lenet.py) and the one list of them, NETWORKS; the optimizers they
train with are listed beside them (optimizers.py).

The harness, the benchmark, the tests and the plots read the list, beside common/levels.py's list of levels. Each
entry names the module that defines the network (its parameter names and shapes, initial weights and FLOP count),
the class every level exports for it, the shared library of each native level that implements it, the levels and
the peers that do, its verifier's parts and its chapter run. Adding a network: its module here, its levels' files,
its verifier's step, and an entry below. The command line names a network once (`--model lenet`); `get` turns the
name into its entry, which is what the rest of the code is handed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


def _attribute(where: str):
    """The object "module:name" names, imported when first asked for."""
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Network:
    name: str  # as `--model` takes it
    title: str
    module: str  # of the network: PARAM_NAMES, param_shapes(hidden), init_params(seed, hidden), flops_per_step(...)
    class_name: str  # what each level's package exports: level3_numpy.MLP, level3_numpy.LeNet
    levels: tuple[int, ...]  # the levels that implement it (level 2 derives; it does not train)
    libraries: tuple[tuple[int, str], ...]  # (level, shared library relative to its package) of the native levels
    has_hidden: bool  # whether `--hidden` sizes it
    step: str  # "module:class" of its float64 step for the verifier's lockstep (common/harness/verify.py)
    per_layer: str  # "module:function" of its per-layer check (common/harness/verify.py's rule)
    run: dict  # the chapter run, `make compare`'s defaults: epochs, train_size, batch, lr
    peers: tuple[str, ...] = ()  # the loops it is timed against on a GPU (level1_pytorch/peers.py)
    convolutions: tuple[tuple[int, tuple[str, ...]], ...] = ()  # (level, its convolutions, the default first)
    matmuls: tuple[tuple[int, tuple[str, ...]], ...] = ()  # (level, its matrix products, in teaching order)
    graphs: tuple[int, ...] = ()  # the levels with a row of their GPU step recorded once and replayed (step="graph")

    @property
    def network(self) -> ModuleType:
        """The network's module, imported when first asked for (an MLP run never imports LeNet's files)."""
        return importlib.import_module(self.module)

    def library(self, number: int) -> str | None:
        """The shared library of native level `number` for this network, or None."""
        return dict(self.libraries).get(number)

    def variants(self, number: int, device: str = "cpu") -> tuple[dict[str, str], ...]:
        """The options of each variant of level `number` on `device` for this network, each a run of `make compare`:
        its convolutions ({"convolution": "tiled"}) or its matrix products ({"matmul": "tiled"}), the default first;
        on a GPU, its step replayed as a CUDA graph ({"step": "graph"}) after its eager one ({}); ({},) where it has no
        choice."""
        for option, choices in (("convolution", self.convolutions), ("matmul", self.matmuls)):
            if number in dict(choices):
                return tuple({option: name} for name in dict(choices)[number])
        if device == "cuda" and number in self.graphs:
            return {}, {"step": "graph"}
        return ({},)

    def float64_step(self):
        """The class of its float64 step: (params, x, y, lr[, optimizer, level 1's state]) -> the step, with the ties
        that explain a level's."""
        return _attribute(self.step)

    def per_layer_check(self):
        """Its per-layer check: (a level's layers, level 1's layers, params, x, y) -> (shares, failure)."""
        return _attribute(self.per_layer)


PEERS = ("torch-eager", "torch-graph", "torch-compile", "jax-scan")  # every peer, in the tables' order

NETWORKS: tuple[Network, ...] = (
    Network("mlp", "the MLP, 784-hidden-10", "common.nets.mlp", "MLP", (1, 2, 3, 4, 5, 6, 7, 8, 9),
            ((4, "libmlp.so"), (5, "libmlp.so"), (6, "libmlp.so"), (7, "libmlp.so")), has_hidden=True,
            step="common.harness.verify:MlpStep", per_layer="common.harness.verify:mlp_per_layer",
            run={"epochs": 10, "train_size": 10_000, "batch": 8, "lr": 0.01}, peers=PEERS,
            matmuls=((5, ("naive", "tiled", "blocked")),), graphs=(8,)),
    Network("lenet", "LeNet-5", "common.nets.lenet", "LeNet", (1, 2, 3, 4, 5, 6, 7, 8),
            ((4, "liblenet.so"), (5, "liblenet.so"), (6, "liblenet.so"), (7, "liblenet.so")), has_hidden=False,
            step="common.harness.verify_lenet:LeNetStep", per_layer="common.harness.verify_lenet:per_layer",
            run={"epochs": 2, "train_size": 10_000, "batch": 16, "lr": 0.05}, peers=PEERS,
            convolutions=((4, ("direct", "im2col")), (5, ("direct", "tiled")))),
)


def get(name: str) -> Network:
    """The network of this name."""
    for network in NETWORKS:
        if network.name == name:
            return network
    raise KeyError(f"no network {name!r}; the networks are {', '.join(n.name for n in NETWORKS)}")
