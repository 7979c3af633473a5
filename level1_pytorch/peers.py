"""Level 1's peers: the same training step as a PyTorch or JAX user would write it for speed on a GPU.

The benchmark's yardsticks for the GPU levels, measured in the same run (common/harness/compare.py adds them on a GPU):
  - torch-eager: level 1 without the deterministic-algorithm mode that the gold standard needs (cuDNN free to pick
    its fastest algorithms); everything else, float32 with TF32 off included, as level 1. The plain PyTorch loop.
  - torch-graph: one whole training step - pick the batch's rows by a step counter on the GPU, forward, loss,
    backward, SGD update, store the loss - captured once as a CUDA graph on static buffers and replayed for every
    step, so that a step costs one graph launch instead of ~20 kernel launches from Python.
  - torch-compile: the same graph, around a step whose forward and backward torch.compile generated (fused kernels)
    and PyTorch's fused SGD: the strongest loop a PyTorch user would write.
  - jax-scan: the network in JAX, a whole epoch as one jit-compiled lax.scan (jax_peer.py), where JAX is installed.
Each implements the level contract (the PyTorch ones are level 1's class with another train_epoch), so the harness
verifies them like any level before it reports their speed. For each network of common/nets: `peers(get("lenet"))`.
Their speed is checked against the same loops written plainly, apart from the harness (plain_peers.py):

    python -m common.harness.peers --check results/h100/chapter [results/h100/lenet-inference ...]
"""

from __future__ import annotations

import importlib.util
import warnings
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from common.contract import check_training
from common.levels import THE_MLP, level
from common.nets import Network
from level1_pytorch.mlp import Model

# TF32 stays off everywhere in this course (level 1's chapter says why); torch.compile's advice to turn it on is not
# for us, and would only clutter every run's output.
warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores for float32 matrix multiplication available")

# each peer by name, and its short name in the tables' columns (speedup_vs_<short> in results.json)
NAMES = {"torch-eager": "eager", "torch-graph": "graph", "torch-compile": "compile", "jax-scan": "jax"}
COMPILING = frozenset({"torch-compile", "jax-scan"})  # making one compiles its step: seconds to minutes


@contextmanager
def plain_pytorch():
    """PyTorch as a user tuning for speed runs it: level 1's deterministic-algorithm mode off, cuDNN on and free to
    pick its fastest algorithms (benchmark mode); float32 products stay float32 (no TF32, as everywhere in this
    course). Restored afterwards."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.enabled,
              torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.enabled = torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark = before[1:]


def batch_loss(net, X_dev, y_dev, index) -> torch.Tensor:
    """The mean cross-entropy of the batch `index` of the data set, as level 1 computes it."""
    return F.cross_entropy(net(X_dev[index]), y_dev[index])


class EagerLoop(Model):
    """Level 1's loop, in plain PyTorch's arithmetic."""

    written_as = "level 1's loop, deterministic mode off"

    def __init__(self, params: dict[str, np.ndarray], device: str = "cuda"):
        super().__init__(params, device=device)

    def arithmetic(self):
        return plain_pytorch()

    def variant(self) -> dict[str, str]:
        return {**super().variant(), "written as": self.written_as}


class GraphLoop(EagerLoop):
    """One training step captured as a CUDA graph (per batch size and learning rate) and replayed step after step."""

    written_as = "the whole step captured once as a CUDA graph, replayed each step"

    def __init__(self, params: dict[str, np.ndarray], device: str = "cuda"):
        if device != "cuda":
            raise ValueError("CUDA graphs need device='cuda'")
        super().__init__(params, device=device)
        self._graphs: dict[tuple, tuple] = {}

    def train_epoch(self, X, y, batch_size, lr, order=None) -> np.ndarray:
        X_dev, y_dev = self._data.fetch(X, y, self._upload)
        order, batch_size, lr = check_training(len(X_dev), batch_size, lr, order)
        order = torch.from_numpy(order).to(self.device).long()
        full = len(order) // batch_size  # whole batches replay the graph; a final partial batch is one eager step
        losses = []
        with self.arithmetic():
            if full:
                graph, batches, counter, graph_losses = self._graph(X_dev, y_dev, batch_size, float(lr), full)
                batches.copy_(order[: full * batch_size].view(full, batch_size))
                counter.zero_()
                for _ in range(full):
                    graph.replay()
                losses.append(graph_losses)
            if full * batch_size < len(order):
                losses.append(self._step(X_dev, y_dev, order[full * batch_size :], float(lr)).view(1))
        return torch.cat(losses).cpu().numpy()

    def _step(self, X_dev, y_dev, index, lr: float) -> torch.Tensor:
        """One step, the same operations as level 1's; returns its loss (on the device)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self.loss(X_dev, y_dev, index)
        self.optimizer.zero_grad(set_to_none=False)  # the graph's gradient buffers must stay where they are
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def loss(self, X_dev, y_dev, index) -> torch.Tensor:
        return batch_loss(self.net, X_dev, y_dev, index)

    def _graph(self, X_dev, y_dev, batch_size: int, lr: float, steps: int):
        """The captured step for this data set, batch size, learning rate and number of steps: (graph, its static
        batches (steps, batch_size), its step counter, its losses (steps,)). The step picks its batch's row numbers
        by the counter on the GPU and stores its loss there, so that an epoch is nothing but replays."""
        key = (X_dev.data_ptr(), batch_size, lr, steps)
        if key not in self._graphs:
            self._graphs = {}  # one graph at a time: each holds its own memory pool
            saved = self.state_dict()  # warming up takes real steps: undo them after the capture
            batches = torch.zeros(steps, batch_size, dtype=torch.long, device=self.device)
            counter = torch.zeros(1, dtype=torch.long, device=self.device)
            losses = torch.zeros(steps, dtype=self.dtype, device=self.device)

            def step():
                loss = self._step(X_dev, y_dev, batches.index_select(0, counter).view(-1), lr)
                losses.index_copy_(0, counter, loss.view(1))
                counter.add_(1)

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # PyTorch's recipe: warm up on a side stream before capturing
                for _ in range(3):
                    counter.zero_()
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            self.load_state_dict(saved)  # copies in place: the graph keeps pointing at the parameters
            self._graphs[key] = (graph, batches, counter, losses)
        return self._graphs[key]


class CompileLoop(GraphLoop):
    """The graphed step, its forward and backward generated by torch.compile and its update PyTorch's fused SGD."""

    written_as = "torch.compile's forward and backward, fused SGD, the step captured as a CUDA graph"

    def __init__(self, params: dict[str, np.ndarray], device: str = "cuda"):
        super().__init__(params, device=device)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.0, fused=True)  # one kernel for every tensor
        # Compiled in this process: inductor's default, a pool of one worker process per core, each importing PyTorch,
        # keeps every core busy for seconds after the compile (it slowed the rows timed next, and the lockstep's
        # processes that make this model). The kernels it generates are the same.
        import torch._inductor.config as inductor

        inductor.compile_threads = 1
        # static shapes: one compilation per batch size (a partial last batch is another)
        self._compiled = torch.compile(batch_loss, dynamic=False)

    def loss(self, X_dev, y_dev, index) -> torch.Tensor:
        return self._compiled(self.net, X_dev, y_dev, index)


def peers(network: Network) -> dict[str, type]:
    """The peers the networks' list names for a network (common/nets) that this machine has, by name: its level-1
    class with each PyTorch loop, and its JAX twin where JAX is installed (missing() says why one is absent)."""
    found = torch_peers(network)
    if not missing("jax-scan"):
        from level1_pytorch.jax_peer import jax_peer

        found["jax-scan"] = jax_peer(network)
    return {name: cls for name, cls in found.items() if name in network.peers}


def torch_peers(network: Network) -> dict[str, type]:
    """The network's level-1 class with each PyTorch loop, by name."""
    base = level(1).load(network)
    loops = {"torch-eager": EagerLoop, "torch-graph": GraphLoop, "torch-compile": CompileLoop}
    return {name: type(f"{loop.__name__.removesuffix('Loop')}{base.__name__}", (loop, base), {"__module__": __name__})
            for name, loop in loops.items()}


def missing(name: str) -> str | None:
    """Why the peer `name` cannot run here, or None."""
    if name == "jax-scan" and importlib.util.find_spec("jax") is None:
        return "JAX is not installed (pip install \"jax[cuda13]\")"
    return None


Eager, Graph, Compile = torch_peers(THE_MLP).values()  # the MLP's
