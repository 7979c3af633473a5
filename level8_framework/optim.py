"""Level 8's optimizers: SGD (with momentum) and Adam, with PyTorch's exact rules; the updates are the backend's
(on the CPU level 3's sgd_update, sgd_momentum_update and adam_update; on the GPU their kernels).

The state is PyTorch's, under PyTorch's names, so that a verifier can load one optimizer's state into the other and
compare them: state_dict() -> {"state": {i: {"step", "exp_avg", "exp_avg_sq"} or {"momentum_buffer"}}, "param_groups":
[{hyperparameters, "params": [0, 1, ...]}]}, arrays as NumPy copies; load_state_dict() takes that, or PyTorch's own
(torch.optim's state_dict(), its tensors on the CPU).
"""

from __future__ import annotations

import numpy as np

from level8_framework.tensor import Tensor

# What this module's optimizers do not have, at the value that means "off" in PyTorch's param_groups: a state_dict
# that turns one on is refused rather than half obeyed.
NEUTRAL = {"weight_decay": 0, "dampening": 0, "nesterov": False, "amsgrad": False, "maximize": False}


class Optimizer:
    """What SGD and Adam share: the parameters, a state per parameter, zero_grad and the state_dict."""

    hyper: tuple[str, ...] = ()  # the hyperparameters, as named in PyTorch's param_groups

    def __init__(self, params):
        self.params = list(params)
        if not self.params:
            raise ValueError("the optimizer got no parameters")
        for p in self.params:
            if not isinstance(p, Tensor) or not p.requires_grad:
                raise TypeError(f"an optimizer updates tensors that require grad, got {p!r}")
        self.state: list[dict] = [{} for _ in self.params]

    def zero_grad(self) -> None:
        """Forget every gradient (PyTorch's default, set_to_none): the next backward() starts them afresh."""
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        """Update every parameter that has a gradient, in place (the backend's arrays: no autograd graph is recorded).
        Inside a recorded step (graphs.py), the update's kernels read their numbers from device memory that the graph
        refills before each replay, and the state changes (Adam's step count) at each replay, not now."""
        live = [(i, p) for i, p in enumerate(self.params) if p.grad is not None]
        recording = live[0][1].backend.recording if live else None
        if recording is None:
            self._step(live)
            return
        if missing := [i for i, _ in live if not self.has_state(i)]:
            raise RuntimeError(f"parameters {missing} have no {type(self).__name__} state yet: take one step before "
                               "recording one (the state is made by a first step, which a recording does not run)")
        self._record(live, recording)

    def state_arrays(self) -> list:
        """Every array of the state, in a fixed order: what a recorded step updates in place."""
        return [s[key] for s in self.state for key in sorted(s) if key != "step"]

    def state_dict(self) -> dict:
        """The step count and arrays of each parameter's state (NumPy copies), and the hyperparameters."""
        state = {i: {k: v if k == "step" else p.backend.to_numpy(v) for k, v in s.items()}
                 for i, (p, s) in enumerate(zip(self.params, self.state)) if s}
        group = {k: getattr(self, k) for k in self.hyper}
        return {"state": state, "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take a state (this class's state_dict(), or torch.optim's same optimizer's): every array is checked against
        its parameter's shape and copied to its device; nothing changes unless everything fits."""
        groups = state_dict["param_groups"]
        if len(groups) != 1 or list(groups[0]["params"]) != list(range(len(self.params))):
            raise ValueError(f"expected one parameter group of {len(self.params)} parameters, "
                             f"got {[len(g['params']) for g in groups]}")
        for key, off in NEUTRAL.items():
            if groups[0].get(key, off) != off:
                raise ValueError(f"{key}={groups[0][key]!r}: {type(self).__name__} here has no {key}")
        state: list[dict] = [{} for _ in self.params]
        for i, saved in state_dict["state"].items():
            p = self.params[int(i)]
            for key, value in saved.items():
                if key == "step":
                    state[int(i)][key] = int(np.asarray(value))
                elif value is not None:  # PyTorch's SGD keeps momentum_buffer None until it has one
                    array = np.asarray(value, dtype=np.float32)
                    if array.shape != p.shape:
                        raise ValueError(f"state {key} of parameter {i} has shape {array.shape}, the parameter "
                                         f"{p.shape}")
                    state[int(i)][key] = array
        hyper = {k: groups[0][k] for k in self.hyper}
        self._check(**hyper)
        for k, v in hyper.items():
            setattr(self, k, tuple(v) if isinstance(v, (list, tuple)) else v)
        self.state = [self._placed(p, own, loaded) for p, own, loaded in zip(self.params, self.state, state)]

    @staticmethod
    def _placed(p: Tensor, own: dict, loaded: dict) -> dict:
        """A parameter's loaded state on its device: written into the arrays it has under the same keys (so that a
        recorded step, which updates those, goes on with the loaded values), new arrays for the others."""
        placed = {}
        for key, value in loaded.items():
            if key != "step" and key in own:
                p.backend.assign(own[key], value)
                value = own[key]
            elif key != "step":
                value = p.backend.from_numpy(value)
            placed[key] = value
        return placed

    def _step(self, live: list[tuple[int, Tensor]]) -> None:
        raise NotImplementedError

    def has_state(self, i: int) -> bool:
        """Whether parameter i has the state its update needs (made by its first step)."""
        return True

    def _record(self, live: list[tuple[int, Tensor]], graph) -> None:
        """The update of live's parameters, queued inside a recorded step (a graphs.StepGraph)."""
        raise NotImplementedError

    @staticmethod
    def _check(**hyper) -> None:
        """Refuse hyperparameters the update cannot use."""
        lr = hyper["lr"]
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not np.isfinite(lr) or lr < 0:
            raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")


class SGD(Optimizer):
    """torch.optim.SGD: p -= lr g; with momentum, buf = momentum buf + g, the first step's buf = g, and p -= lr buf."""

    hyper = ("lr", "momentum")

    def __init__(self, params, lr: float, momentum: float = 0.0):
        super().__init__(params)
        self._check(lr=lr, momentum=momentum)
        self.lr, self.momentum = lr, momentum

    def _step(self, live: list[tuple[int, Tensor]]) -> None:
        lr = np.float32(self.lr)  # the update's arithmetic is float32, lr included, as PyTorch's
        if not self.momentum:
            for be, params, grads in _by_backend(live):
                be.sgd_update(params, grads, lr)
            return
        for i, p in live:
            be, state = p.backend, self.state[i]
            buf = state.get("momentum_buffer")
            if buf is None:
                state["momentum_buffer"] = be.copy(p.grad.data)  # PyTorch's first step: buf = g, not momentum 0 + g
                be.sgd_update({i: p.data}, {i: state["momentum_buffer"]}, lr)
            else:
                be.sgd_momentum_update({i: p.data}, {i: p.grad.data}, {i: buf}, lr, self.momentum)

    def has_state(self, i: int) -> bool:
        return not self.momentum or "momentum_buffer" in self.state[i]

    def _record(self, live: list[tuple[int, Tensor]], graph) -> None:
        """The kernels read lr (and momentum), refilled before each replay: a learning rate changed between epochs
        holds at the next replay."""
        if not self.momentum:
            numbers = graph.refilled((1,), lambda: np.array([self.lr], dtype=np.float32))
            for _, p in live:
                p.backend.sgd_update_from(p.data, p.grad.data, numbers)
            return
        numbers = graph.refilled((2,), lambda: np.array([self.lr, self.momentum], dtype=np.float32))
        for i, p in live:
            p.backend.sgd_momentum_update_from(p.data, p.grad.data, self.state[i]["momentum_buffer"], numbers)

    @staticmethod
    def _check(**hyper) -> None:
        Optimizer._check(**hyper)
        momentum = hyper["momentum"]
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")


class Adam(Optimizer):
    """torch.optim.Adam (no weight decay, no amsgrad): the step count, m and v per parameter, level 3's adam_update."""

    hyper = ("lr", "betas", "eps")

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        super().__init__(params)
        self._check(lr=lr, betas=betas, eps=eps)
        self.lr, self.betas, self.eps = lr, tuple(betas), eps

    def _step(self, live: list[tuple[int, Tensor]]) -> None:
        for i, p in live:
            be, state = p.backend, self.state[i]
            if not state:
                state.update(step=0, exp_avg=be.zeros(p.shape), exp_avg_sq=be.zeros(p.shape))
            state["step"] += 1
            be.adam_update({i: p.data}, {i: p.grad.data}, {i: state["exp_avg"]}, {i: state["exp_avg_sq"]},
                           state["step"], self.lr, self.betas, self.eps)

    def has_state(self, i: int) -> bool:
        return bool(self.state[i])

    def _record(self, live: list[tuple[int, Tensor]], graph) -> None:
        """The kernels read each parameter's six numbers (the backend's adam_numbers) from a row of a table that is
        refilled before each replay, each parameter's step count advanced then: the step the replay takes."""

        def numbers() -> np.ndarray:
            rows = []
            for i, p in live:
                self.state[i]["step"] += 1
                rows.append(p.backend.adam_numbers(self.state[i]["step"], self.lr, self.betas, self.eps))
            return np.array(rows, dtype=np.float32)

        table = graph.refilled((len(live), 6), numbers)
        for row, (i, p) in enumerate(live):
            state, numbers = self.state[i], p.backend.as_strided(table, (6,), (1,), 6 * row)
            p.backend.adam_update_from(p.data, p.grad.data, state["exp_avg"], state["exp_avg_sq"], numbers)

    @staticmethod
    def _check(**hyper) -> None:
        Optimizer._check(**hyper)
        betas, eps = hyper["betas"], hyper["eps"]
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"eps must be a number >= 0, got {eps!r}")


def _by_backend(live: list[tuple[int, Tensor]]):
    """(backend, {i: parameter}, {i: gradient}) for each backend among the parameters: one update call per device."""
    groups: dict[int, tuple] = {}
    for i, p in live:
        be, params, grads = groups.setdefault(id(p.backend), (p.backend, {}, {}))
        params[i], grads[i] = p.data, p.grad.data
    return groups.values()
