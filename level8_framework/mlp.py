"""Level 8 - a framework of your own, and the MLP written in it.

What this level adds over the others: the network is three lines (mlp below), and its training step is PyTorch's,
loss.backward() and optimizer.step(), on this course's own framework: tensors and autograd (tensor.py), layers (nn.py),
optimizers (optim.py), on the CPU through NumPy and level 3's layer functions, on the GPU through level 5's kernels
and level 6's cuBLAS. The class below keeps the level contract (common/contract/__init__.py), so the harness trains and
verifies level 8 like any level; device="cuda" runs it on the GPU, optimizer="adam" with Adam, and step="graph" replays
the step recorded once as a CUDA graph (graphs.py) instead of running it op by op.

Run: `python -m common.harness.compare --levels 1,8` or `pytest -m level8`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from common.contract import (
    DataCache,
    check_optimizer,
    check_optimizer_state,
    check_params,
    check_training,
    check_X,
    check_y,
    hidden_size,
    n_steps,
)
from common.nets import mlp as mlp_network
from common.nets.mlp import N_IN, N_OUT
from level8_framework import nn, optim
from level8_framework.tensor import Tensor, backend_for, from_backend, from_numpy, no_grad

if TYPE_CHECKING:
    from level8_framework.graphs import StepGraph


def mlp(hidden: int) -> nn.Sequential:
    """784 -> hidden (ReLU) -> 10, its layers named as level 1's."""
    return nn.Sequential({"fc1": nn.Linear(N_IN, hidden), "relu1": nn.ReLU(), "fc2": nn.Linear(hidden, N_OUT)})


OPTIMIZERS = {"sgd": optim.SGD, "adam": optim.Adam}  # common/nets/optimizers.py's, at the lr train_epoch is given
STEPS = ("eager", "graph")  # a step run op by op, or recorded once and replayed (graphs.py; on the GPU)


class Model:
    """The level contract with the framework, for any network: `build` makes its Sequential, `network` names its
    parameters (the MLP below; LeNet-5 in lenet.py)."""

    network = mlp_network  # the module of the network's parameter names and shapes

    def __init__(self, params: dict[str, np.ndarray], device: str = "cpu", optimizer: str = "sgd", step: str = "eager"):
        if step not in STEPS:
            raise ValueError(f"step must be one of {STEPS}, got {step!r}")
        if step == "graph" and device != "cuda":
            raise ValueError("step='graph' records the step as a CUDA graph: it needs device='cuda'")
        backend = backend_for(device)  # a device this machine cannot run is refused here, with the reason
        self.rule = check_optimizer(optimizer)  # its entry in common/nets/optimizers.py
        self.step_form, self._graph, self._replays = step, None, 0
        params = check_params(params, network=self.network)
        self.device, self._backend = device, backend
        self.net = self.build(params).to(device)
        self.net.load_state_dict(params)
        self.loss_fn = nn.CrossEntropyLoss()
        self.optimizer = OPTIMIZERS[self.rule.name](self.net.parameters(), lr=0.0, **self.rule.hyper)
        self._data = DataCache(on_gpu=device == "cuda")

    def train_epoch(self, X: np.ndarray, y: np.ndarray, batch_size: int, lr: float, order=None) -> np.ndarray:
        """One pass over X in `order`, a step per batch: forward, loss, backward, the optimizer's step; returns each
        step's loss, taken before that step's update. With step="graph", each full batch's step is a replay of the
        step recorded once (section 12 of the chapter)."""
        be = self._backend
        data = self._data.fetch(X, y, be.dataset)
        order, batch_size, lr = check_training(len(data[1]), batch_size, lr, order)
        self.optimizer.lr = float(lr)
        steps, rows = n_steps(len(order), batch_size), be.order(order)
        losses = be.zeros((steps,))
        for step in range(steps):
            start = step * batch_size
            size = min(batch_size, len(order) - start)
            graph = self._graph_for(size, data) if self.step_form == "graph" and size == batch_size else None
            if graph is None:  # op by op
                x, target = be.batch(data, rows, start, size)
                loss = self._step(from_backend(x, be), target).data
            else:
                loss = self._replay(graph, data, rows, start)
            be.write(losses, step, loss)  # on the GPU the losses stay there until the epoch ends
        return be.to_numpy(losses)

    def _step(self, x: Tensor, target) -> Tensor:
        """One training step on a batch: the loss, its gradients, the optimizer's update; returns the loss."""
        loss = self.loss_fn(self.forward_tensor(x), target)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss

    def _replay(self, graph: StepGraph, data, rows, start: int):
        """The recorded step on the batch at `start`: gathered into its input buffers, replayed; each parameter's
        .grad is then this step's, as after an eager step. Returns the loss (on the device)."""
        self._backend.batch_into(graph.x, graph.labels, data, rows, start)
        graph.replay()
        for p, grad in graph.grads:
            p.grad = grad
        self._replays += 1
        return graph.loss

    def _graph_for(self, size: int, data) -> StepGraph | None:
        """The recorded step for batches of `size` rows of the data set, recorded now if it is not (or no longer: the
        optimizer's state was forgotten, the parameters moved, the batch size changed); None where the step runs
        op by op: the first step, or the first after the state was forgotten (it makes the state, and sets cuBLAS up,
        which a recording cannot). An epoch's short last batch runs op by op too (train_epoch)."""
        from level8_framework.graphs import StepGraph

        graph, params = self._graph, self.net.parameters()
        held = [p.data for p in params] + self.optimizer.state_arrays()  # what the recorded kernels update in place
        if graph is not None and len(graph.x) == size and len(held) == len(graph.held) \
                and all(a is b for a, b in zip(held, graph.held)):
            return graph
        self._graph = None
        if any(p.grad is None for p in params) or not all(map(self.optimizer.has_state, range(len(params)))):
            return None
        be = self._backend
        x, labels = be.empty((size, data[0].shape[1])), be.empty((size,), "int")
        try:
            graph = StepGraph(be, lambda: self._step(from_backend(x, be), labels))
        except BaseException:  # the recording stopped (a failure, Ctrl-C): the gradients it made were never computed
            for p in params:
                p.grad = None
            raise
        graph.x, graph.labels, graph.held = x, labels, held
        graph.grads = [(p, p.grad) for p in params]
        self._graph = graph
        return graph

    def variant(self) -> dict[str, str]:
        """What this model computes with, read from it: the device of its parameters' backend, its optimizer (named
        unless SGD)."""
        optimizer = next(name for name, cls in OPTIMIZERS.items() if type(self.optimizer) is cls)
        graph = {"step": "graph"} if self._replays else {}  # only once a recorded step has been replayed
        return {"device": self.net.parameters()[0].backend.device, **check_optimizer(optimizer).options, **graph}

    def loss_and_grads(self, X: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        """Mean cross-entropy of one batch and its gradients; parameters unchanged."""
        X = check_X(X)
        y = check_y(y, len(X))
        self.net.zero_grad()
        loss = self.loss_fn(self.forward_tensor(from_numpy(X).to(self.device)), y)
        loss.backward()
        grads = {name: p.grad.numpy() for name, p in self.net.named_parameters()}
        self.net.zero_grad()
        return loss.item(), grads

    def forward(self, X: np.ndarray) -> np.ndarray:
        """Logits (N, 10)."""
        with no_grad():
            return self.forward_tensor(from_numpy(check_X(X)).to(self.device)).numpy()

    def forward_tensor(self, x: Tensor) -> Tensor:
        """The network on a batch x (B, 784) already on the model's device."""
        return self.net(self.as_input(x))

    def as_input(self, x: Tensor) -> Tensor:
        """A batch x (B, 784) as the network's first layer reads it."""
        return x

    def layers(self, X: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every layer's output for a batch, and the gradient of the batch's mean loss with respect to each (kept by
        retain_grad, as in PyTorch); the parameters unchanged."""
        X = check_X(X)
        y = check_y(y, len(X))
        kept: dict[str, Tensor] = {}
        a = self.as_input(from_numpy(X).to(self.device))
        for name, layer in self.net.named_children():
            a = layer(a)
            if name in self.activations():
                a.retain_grad()
                kept[name] = a
        self.net.zero_grad()
        self.loss_fn(a, y).backward()
        self.net.zero_grad()
        return {k: t.numpy() for k, t in kept.items()}, {k: t.grad.numpy() for k, t in kept.items()}

    def activations(self) -> tuple[str, ...]:
        """The names of the layers whose outputs layers() returns, in order."""
        return tuple(mlp_network.activations(self.hidden))

    def state_dict(self) -> dict[str, np.ndarray]:
        """float32 copies of the parameters, PyTorch's names and layouts."""
        return {name: p.numpy() for name, p in self.net.named_parameters()}

    def load_state_dict(self, params: dict[str, np.ndarray]) -> None:
        """Replace the parameters (same sizes); the optimizer keeps working on them."""
        self.net.load_state_dict(check_params(params, self.hidden, network=self.network))

    def optimizer_state(self) -> dict[str, dict]:
        """The optimizer's state_dict() by parameter name (common/contract): the step count and copies of the arrays;
        {} for SGD."""
        if not self.rule.state:
            return {}
        names = [name for name, _ in self.net.named_parameters()]
        return {names[i]: {key: s[key] for key in self.rule.state}
                for i, s in self.optimizer.state_dict()["state"].items()}

    def load_optimizer_state(self, state: dict[str, dict]) -> None:
        """Replace the optimizer's state (optimizer_state()'s form; {} forgets it), through its load_state_dict."""
        state = check_optimizer_state(state, self.state_dict(), self.rule)
        saved = self.optimizer.state_dict()
        saved["state"] = {i: state[name] for i, (name, _) in enumerate(self.net.named_parameters()) if name in state}
        self.optimizer.load_state_dict(saved)

    def build(self, params: dict[str, np.ndarray]) -> nn.Module:
        """The network, for these parameters' sizes."""
        raise NotImplementedError

    @property
    def hidden(self) -> int | None:
        """The hidden size, for a network that has one."""
        return None


class MLP(Model):
    """The MLP: 784 -> hidden (ReLU) -> 10."""

    def build(self, params: dict[str, np.ndarray]) -> nn.Module:
        return mlp(hidden_size(params))

    @property
    def hidden(self) -> int:
        return self.net.fc1.weight.shape[0]
