"""Level 1 - PyTorch, the gold standard.

The MLP as a PyTorch user would write it: an nn.Module with two nn.Linear layers, autograd for
the backward pass, torch.optim.SGD for the update (optimizer="adam": torch.optim.Adam). Every other
level must reproduce its per-step losses. Full float32 (TF32 off) and deterministic algorithms, so
that the reference is exact.

On CUDA it follows the best-practice loop, so that later levels are timed against a fair opponent:
the data set is copied to the GPU once, each step's loss stays on the GPU, and the losses are read
back once per epoch.

The harness also builds a float64 twin of it (dtype="float64": the same code, the same batches, in
double precision) as the yardstick of float32 noise for the free runs (common/harness/verify.py).

Run: `python -m common.harness.compare --levels 1` or `pytest -m level1`.
"""

from __future__ import annotations

import os
import warnings
from contextlib import nullcontext

# cuBLAS needs a fixed workspace to be deterministic; it reads this when its handle is created.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from common.contract import (  # noqa: E402
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
from common.nets import mlp, optimizers  # noqa: E402
from common.nets.mlp import N_IN, N_OUT  # noqa: E402


class Net(nn.Module):
    """784 -> hidden (ReLU) -> 10, each layer a module, so that a forward hook can watch any of them."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(N_IN, hidden)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(hidden, N_OUT)

    def forward(self, x: torch.Tensor, keep: dict | None = None) -> torch.Tensor:
        """Logits of x (N, 784); with `keep`, every layer's output is stored there by name (mlp.activations)."""
        h = self.fc1(x)
        a = self.relu1(h)
        logits = self.fc2(a)
        if keep is not None:
            keep.update(fc1=h, relu1=a, fc2=logits)
        return logits


def _as_tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """Zero-copy on the CPU (the arrays may be read-only: PyTorch never writes them here), a copy on a GPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return torch.from_numpy(a).to(device)


DTYPES = {"float32": torch.float32, "float64": torch.float64}
TORCH_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}  # common/nets/optimizers.py's, in torch.optim


class Model:
    """The level contract, implemented with nn.Module, autograd and torch.optim (SGD, or Adam), for any network:
    `build` makes the module, `network` names its parameters (the MLP below; LeNet-5 in lenet.py)."""

    network = mlp  # the module of the network's parameter names and shapes

    def __init__(self, params: dict[str, np.ndarray], device: str = "cpu", dtype: str = "float32",
                 optimizer: str = "sgd"):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device='cuda' asked for, but PyTorch sees no CUDA device")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
        self.rule = check_optimizer(optimizer)  # its entry in common/nets/optimizers.py
        torch.backends.cuda.matmul.allow_tf32 = False  # full float32: TF32 would change losses at 1e-3
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True)
        params = check_params(params, network=self.network)
        self.device, self.dtype = torch.device(device), DTYPES[dtype]
        self.net = self.build(params).to(self.device, self.dtype)
        self.load_state_dict(params)
        self.optimizer = TORCH_OPTIMIZERS[self.rule.name](self.net.parameters(), lr=0.0, **self.rule.hyper)
        self._data = DataCache(on_gpu=device == "cuda")

    def train_epoch(self, X: np.ndarray, y: np.ndarray, batch_size: int, lr: float, order=None) -> np.ndarray:
        """One pass over X in `order`; returns each step's loss, taken before that step's update."""
        X_dev, y_dev = self._data.fetch(X, y, self._upload)
        order, batch_size, lr = check_training(len(X_dev), batch_size, lr, order)
        order = torch.from_numpy(order).to(self.device).long()
        for group in self.optimizer.param_groups:
            group["lr"] = float(lr)
        losses = torch.empty(n_steps(len(order), batch_size), device=self.device, dtype=self.dtype)
        with self.arithmetic():
            for step in range(len(losses)):
                batch = order[step * batch_size : (step + 1) * batch_size]
                loss = F.cross_entropy(self.net(X_dev[batch]), y_dev[batch])
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                losses[step] = loss.detach()  # stays on the device: no synchronisation per step
        return losses.cpu().numpy()

    def variant(self) -> dict[str, str]:
        """What this model computes with, read from it: its device, float type and optimizer (named unless SGD)."""
        optimizer = next(name for name, cls in TORCH_OPTIMIZERS.items() if type(self.optimizer) is cls)
        return {"device": self.device.type, "dtype": str(self.dtype).removeprefix("torch."),
                **optimizers.get(optimizer).options}

    def arithmetic(self):
        """The context of every computation of this model: nothing beyond the gold standard's settings, made in
        __init__ (deterministic algorithms, no TF32); the benchmark's peers run in plain PyTorch's (peers.py)."""
        return nullcontext()

    def _upload(self, X: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The data set on the model's device: one copy for many epochs."""
        return _as_tensor(X, self.device).to(self.dtype), _as_tensor(y, self.device).long()

    def loss_and_grads(self, X: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        """Mean cross-entropy of one batch and its gradients; parameters unchanged."""
        X = _as_tensor(check_X(X), self.device).to(self.dtype)
        y = _as_tensor(check_y(y, len(X)), self.device).long()
        self.optimizer.zero_grad()
        with self.arithmetic():
            loss = F.cross_entropy(self.net(X), y)
            loss.backward()
        grads = {name: p.grad.detach().cpu().numpy().copy() for name, p in self.net.named_parameters()}
        self.optimizer.zero_grad()
        return float(loss.detach()), grads

    def layers(self, X: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every layer's output for a batch, and the gradient of the batch's mean loss with respect to each; the
        parameters unchanged."""
        X = _as_tensor(check_X(X), self.device).to(self.dtype)
        y = _as_tensor(check_y(y, len(X)), self.device).long()
        keep: dict[str, torch.Tensor] = {}
        self.optimizer.zero_grad()
        with self.arithmetic():
            logits = self.net(X, keep)
            for tensor in keep.values():
                tensor.retain_grad()
            F.cross_entropy(logits, y).backward()
        self.optimizer.zero_grad()
        return ({k: t.detach().cpu().numpy() for k, t in keep.items()},
                {k: t.grad.detach().cpu().numpy() for k, t in keep.items()})

    def forward(self, X: np.ndarray) -> np.ndarray:
        """Logits (N, 10)."""
        with torch.no_grad(), self.arithmetic():
            return self.net(_as_tensor(check_X(X), self.device).to(self.dtype)).cpu().numpy()

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the parameters (float32; float64 for the float64 twin)."""
        return {name: t.detach().cpu().numpy().copy() for name, t in self.net.state_dict().items()}

    def load_state_dict(self, params: dict[str, np.ndarray]) -> None:
        """Replace the parameters (same sizes); the optimizer keeps working on them."""
        params = check_params(params, self.hidden, network=self.network)
        self.net.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})

    def optimizer_state(self) -> dict[str, dict]:
        """torch.optim's state by parameter name (common/contract): the step count and copies of the arrays."""
        if not self.rule.state:
            return {}
        return {name: {key: int(s[key]) if key == "step" else s[key].detach().cpu().numpy().copy()
                       for key in self.rule.state}
                for name, p in self.net.named_parameters() if (s := self.optimizer.state.get(p))}

    def load_optimizer_state(self, state: dict[str, dict]) -> None:
        """Replace the optimizer's state (optimizer_state()'s form) through torch.optim's load_state_dict, which casts
        the arrays to each parameter's type and device. Its tensors are made here, fresh: torch.optim keeps the tensors
        it is handed, and counts its steps up in the step tensor itself."""
        state = check_optimizer_state(state, self.state_dict(), self.rule, str(self.dtype).removeprefix("torch."))
        saved = self.optimizer.state_dict()
        saved["state"] = {i: {key: torch.tensor(float(value)) if key == "step" else torch.from_numpy(value)
                              for key, value in state[name].items()}
                          for i, (name, _) in enumerate(self.net.named_parameters()) if name in state}
        self.optimizer.load_state_dict(saved)

    def build(self, params: dict[str, np.ndarray]) -> nn.Module:
        """The network's module, for these parameters' sizes."""
        raise NotImplementedError

    @property
    def hidden(self) -> int | None:
        """The hidden size, for a network that has one."""
        return None


class MLP(Model):
    """The MLP: 784 -> hidden (ReLU) -> 10."""

    def build(self, params: dict[str, np.ndarray]) -> nn.Module:
        return Net(hidden_size(params))

    @property
    def hidden(self) -> int:
        return self.net.fc1.out_features
