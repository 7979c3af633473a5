"""Level 1's peers: the same training step as a PyTorch user would write it for speed on a GPU.

The benchmark's yardsticks for the GPU levels, measured in the same run (common/compare.py adds them on a GPU):
  - Eager: level 1 without the deterministic-algorithm mode that the gold standard needs; everything else,
    float32 with TF32 off included, as level 1. The plain PyTorch loop.
  - Graph: one whole training step - gather the batch, forward, loss, backward, SGD update - captured once
    as a CUDA graph and replayed for every step, so that a step costs one graph launch instead of ~20
    kernel launches from Python. The strongest loop a PyTorch user would write.
Both implement the level contract (they are level 1's class with another train_epoch), so the harness verifies
them like any level before it reports their speed. For each network (common/models.py): `peers("lenet")`.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from common.contract import check_training, n_steps
from level1_pytorch.mlp import Model


@contextmanager
def plain_pytorch():
    """PyTorch as a user runs it: deterministic algorithms off (level 1 turns them on), restored afterwards."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


class EagerLoop(Model):
    """Level 1's loop, without the deterministic-algorithm mode."""

    def __init__(self, params: dict[str, np.ndarray], device: str = "cuda"):
        super().__init__(params, device=device)

    def train_epoch(self, X, y, batch_size, lr, order=None) -> np.ndarray:
        with plain_pytorch():
            return super().train_epoch(X, y, batch_size, lr, order)


class GraphLoop(Model):
    """One training step captured as a CUDA graph (per batch size and learning rate) and replayed step after step."""

    def __init__(self, params: dict[str, np.ndarray], device: str = "cuda"):
        if device != "cuda":
            raise ValueError("CUDA graphs need device='cuda'")
        super().__init__(params, device=device)
        self._graphs: dict[tuple, tuple] = {}

    def train_epoch(self, X, y, batch_size, lr, order=None) -> np.ndarray:
        X_dev, y_dev = self._data.fetch(X, y, self._upload)
        order, batch_size, lr = check_training(len(X_dev), batch_size, lr, order)
        order = torch.from_numpy(order).to(self.device).long()
        losses = torch.empty(n_steps(len(order), batch_size), device=self.device)
        full = len(order) // batch_size  # whole batches replay the graph; a final partial batch is one eager step
        with plain_pytorch():
            if full:
                graph, index, loss = self._graph(X_dev, y_dev, batch_size, float(lr))
                for step in range(full):
                    index.copy_(order[step * batch_size : (step + 1) * batch_size])
                    graph.replay()
                    losses[step] = loss
            if full < len(losses):
                losses[full] = self._step(X_dev, y_dev, order[full * batch_size :], float(lr))
        return losses.cpu().numpy()

    def _step(self, X_dev, y_dev, index, lr: float) -> torch.Tensor:
        """One step, the same operations as level 1's; returns its loss (on the device)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = F.cross_entropy(self.net(X_dev[index]), y_dev[index])
        self.optimizer.zero_grad(set_to_none=False)  # the graph's gradient buffers must stay where they are
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _graph(self, X_dev, y_dev, batch_size: int, lr: float):
        """The captured step for this data set, batch size and learning rate: (graph, its index input, its loss)."""
        key = (X_dev.data_ptr(), batch_size, lr)
        if key not in self._graphs:
            saved = self.state_dict()  # warming up takes real steps: undo them after the capture
            index = torch.zeros(batch_size, dtype=torch.long, device=self.device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # PyTorch's recipe: warm up on a side stream before capturing
                for _ in range(3):
                    self._step(X_dev, y_dev, index, lr)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                loss = self._step(X_dev, y_dev, index, lr)
            self.load_state_dict(saved)  # copies in place: the graph keeps pointing at the parameters
            self._graphs = {key: (graph, index, loss)}  # one graph at a time: each holds its own memory pool
        return self._graphs[key]


def peers(network: str = "mlp") -> dict[str, type]:
    """The two peers of a network (common/models.py), by name: its level-1 class with each loop."""
    from common.levels import level

    base = level(1).load(network)
    return {"torch-eager": type(f"Eager{base.__name__}", (EagerLoop, base), {"__module__": __name__}),
            "torch-graph": type(f"Graph{base.__name__}", (GraphLoop, base), {"__module__": __name__})}


Eager, Graph = peers("mlp").values()  # the MLP's
