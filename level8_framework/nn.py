"""Level 8's layers: Module (parameters found by name, state_dict), the layers of the course's two networks, Sequential
to chain them, and the two losses. Each layer's forward is a few tensor operations (tensor.py); autograd differentiates
them, so no layer has a backward of its own. Names, shapes and initializations are PyTorch's.
"""

from __future__ import annotations

import math

import numpy as np

from level8_framework import tensor as F
from level8_framework.tensor import Parameter, Tensor, backend_for


class Module:
    """A layer, or layers: its Parameters and sub-modules are found from its attributes, in the order they were set,
    and named as PyTorch names them (fc1.weight)."""

    def __init__(self):
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __call__(self, *inputs):
        return self.forward(*inputs)

    def forward(self, *inputs):
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    def named_parameters(self, prefix: str = ""):
        """(name, parameter) of this module and then of each sub-module, depth first."""
        for name, p in self._parameters.items():
            yield prefix + name, p
        for name, module in self._modules.items():
            yield from module.named_parameters(f"{prefix}{name}.")

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def named_children(self):
        return iter(self._modules.items())

    def state_dict(self) -> dict[str, Tensor]:
        """Every parameter by name, out of the graph; the same memory, as PyTorch's."""
        return {name: p.detach() for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict) -> None:
        """Copy values (Tensors or arrays) into the parameters, in place: an optimizer holding them sees the new values.
        Every name must match and every shape; nothing is changed unless all do."""
        own = dict(self.named_parameters())
        if set(state) != set(own):
            raise KeyError(f"state_dict keys must be {sorted(own)}: missing {sorted(set(own) - set(state))}, "
                           f"unexpected {sorted(set(state) - set(own))}")
        values = {name: v.numpy() if isinstance(v, Tensor) else np.asarray(v, dtype=np.float32)
                  for name, v in state.items()}
        for name, p in own.items():
            if values[name].shape != p.shape:
                raise ValueError(f"{name} has shape {p.shape}, the state_dict's {values[name].shape}")
        for name, p in own.items():
            p.backend.assign(p.data, values[name])

    def to(self, device: str) -> Module:
        """Move every parameter (and its gradient) to `device`, in place: the same Parameter objects, on new memory.
        Move a model before giving its parameters to an optimizer, whose state stays where it was made."""
        target = backend_for(device)
        for p in self.parameters():
            if p.backend is not target:
                p.data, p.backend = target.from_numpy(p.backend.to_numpy(p.data)), target
                if p.grad is not None:
                    p.grad = p.grad.to(device)
        return self

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None


def _uniform(rng: np.random.Generator, fan_in: int, shape: tuple[int, ...]) -> np.ndarray:
    """PyTorch's default initialization of Linear and Conv2d: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1 / math.sqrt(fan_in)
    return rng.uniform(-bound, bound, shape)


def _size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


class Linear(Module):
    """y = x @ weight.T + bias: x (B, in_features), weight (out_features, in_features), bias (out_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: str = "cpu", rng=None):
        super().__init__()
        n_in, n_out = _size("in_features", in_features), _size("out_features", out_features)
        rng = rng or np.random.default_rng()
        self.weight = Parameter(_uniform(rng, n_in, (n_out, n_in)), device)
        self.bias = Parameter(_uniform(rng, n_in, (n_out,)), device) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        out = x @ self.weight.T
        return out + self.bias if self.bias is not None else out


class Conv2d(Module):
    """PyTorch's Conv2d(in_channels, out_channels, kernel_size), stride 1, no padding: weight (F, C, k, k), bias (F)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, device: str = "cpu", rng=None):
        super().__init__()
        c, f, k = (_size(n, v) for n, v in (("in_channels", in_channels), ("out_channels", out_channels),
                                            ("kernel_size", kernel_size)))
        rng = rng or np.random.default_rng()
        self.weight = Parameter(_uniform(rng, c * k * k, (f, c, k, k)), device)
        self.bias = Parameter(_uniform(rng, c * k * k, (f,)), device)

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.weight, self.bias)


class MaxPool2d(Module):
    """2 x 2 max-pooling, stride 2 (the only kind here, LeNet-5's)."""

    def __init__(self, kernel_size: int = 2):
        super().__init__()
        if kernel_size != 2:
            raise ValueError(f"MaxPool2d pools 2 x 2 windows with stride 2 (LeNet-5's), got kernel_size="
                             f"{kernel_size!r}")

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool2d(x)


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


class Sigmoid(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.sigmoid(x)


class Flatten(Module):
    """(N, C, H, W) -> (N, C * H * W): every axis from start_dim on made one."""

    def __init__(self, start_dim: int = 1):
        super().__init__()
        self.start_dim = start_dim

    def forward(self, x: Tensor) -> Tensor:
        return F.flatten(x, self.start_dim)


class Sequential(Module):
    """Modules applied in turn, named "0", "1", ... or, given one dict, by its keys (PyTorch: an OrderedDict)."""

    def __init__(self, *modules):
        super().__init__()
        named = modules[0].items() if len(modules) == 1 and isinstance(modules[0], dict) else \
            ((str(i), m) for i, m in enumerate(modules))
        for name, module in named:
            if not isinstance(module, Module):
                raise TypeError(f"Sequential takes Modules, got {type(module).__name__} for {name!r}")
            setattr(self, name, module)

    def forward(self, x: Tensor) -> Tensor:
        for module in self._modules.values():
            x = module(x)
        return x

    def __getitem__(self, key: int | str) -> Module:
        return list(self._modules.values())[key] if isinstance(key, int) else self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)


class CrossEntropyLoss(Module):
    """The batch's mean cross-entropy of logits (B, C) against class indices (B,): log-softmax and NLL in one op."""

    def forward(self, logits: Tensor, target) -> Tensor:
        return F.cross_entropy(logits, target)


class MSELoss(Module):
    """The mean of (x - target)^2 over every value, as PyTorch's (reduction="mean")."""

    def forward(self, x: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(x, target)
