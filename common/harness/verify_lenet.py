"""The verifier's LeNet-5 parts (common/harness/verify.py holds the rules): the float64 step with its ReLU and max-pool ties,
and the per-layer check.

Ties. A float32 level can decide differently from exact arithmetic, or from another float32 level, wherever a ReLU's
input is within float32's reach of 0, or the two largest elements of a max-pool window are within float32's reach of
each other: which one is the maximum, and so which one gets the window's gradient, can change. The reach is a
rigorous bound, carried through the layers: a layer's output may miss the exact value by gamma_n * sum |terms| (its
own rounding, common/harness/verify.py) plus its weights times the bound of its input. Those places are the candidates.

The MLP's closed-form flip does not carry over to convolutions (a flip there moves every later layer), so the rule
is general and direct: before a level steps, its own layer outputs (layers()) say which way it decides at each
candidate; the float64 step is recomputed taking those decisions, and the level must match that step by the usual
rule. Each decision that differs from level 1's is reported as a tie, with its layer and position. Only candidates
are taken: a decision the level takes anywhere else is not a tie, and the difference it makes fails. Level 1's own
decisions are taken first, as for the MLP: the float64 step follows level 1. With Adam, the step is Adam's from level
1's state, and its sign ties are common/harness/verify.py's (AdamRule), with LeNet-5's layers for the reach (REACH).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from common.harness import verify
from common.harness.verify import AdamRule, gamma, gradient_reach
from common.nets import lenet
from common.nets.optimizers import SGD, Optimizer

RELUS = {"relu1": ("conv1", 1 * 25 + 1), "relu2": ("conv2", 6 * 25 + 1), "relu3": ("fc1", 256 + 1),
         "relu4": ("fc2", 120 + 1)}  # each ReLU: the layer before it, and the terms of each of that layer's sums
POOL_AFTER = {"relu1": "pool1", "relu2": "pool2"}
POOL_INPUT = {pool: relu for relu, pool in POOL_AFTER.items()}
# LeNet-5 as common/harness/verify.py's gradient_reach reads a network: its layers in the forward order, by kind
REACH = (("conv1", "conv"), ("relu1", "relu"), ("pool1", "pool"), ("conv2", "conv"), ("relu2", "relu"),
         ("pool2", "pool"), ("flatten", "flatten"), ("fc1", "fc"), ("relu3", "relu"), ("fc2", "fc"), ("relu4", "relu"),
         ("fc3", "fc"))


@dataclass
class LayerTie:
    """A ReLU or a max-pool window the level decided differently from level 1, at this step and image."""

    step: int
    layer: str  # relu1..relu4, pool1, pool2
    position: tuple[int, ...]  # within the image's layer: (channel, row, column) or (unit,)
    image: int  # row of the training set
    margin: float  # how far from deciding the other way the exact values were: |h|, or the top two's difference
    bound: float  # float32's reach there

    def describe(self) -> str:
        what = "ReLU" if self.layer.startswith("relu") else "max-pool window"
        return (f"step {self.step}, {self.layer} {what} {self.position}, image {self.image}: {self.margin:.2g} from "
                f"the other decision, within float32's reach ({self.bound:.2g}); it went the other way from level 1's")


class LeNetStep:
    """One step of LeNet-5 in float64 (SGD's, or with an optimizer and level 1's state Adam's), and the ties that
    explain a float32 level's result (see the module)."""

    names = lenet.PARAM_NAMES

    def __init__(self, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, lr: float,
                 optimizer: Optimizer = SGD, state: dict | None = None):
        self.start = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
        self.x32, self.y = np.asarray(x), np.asarray(y, dtype=np.int64)
        self.x, self.lr = self.x32.astype(np.float64), lr
        images = self.x.reshape(-1, 1, lenet.IMAGE, lenet.IMAGE)
        self.adam = AdamRule(params, state, lr, optimizer, lambda: gradient_reach(REACH, params, images, self.y)) \
            if optimizer.state else None
        self.grads, self.loss, record = self._gradients({})  # self.grads: those of level 1's decisions, from now on
        self.params = self._update(self.grads)
        self.candidates = candidates(self.start, self.x, record)
        self.reference: dict = {}  # level 1's decisions where they differ from exact arithmetic's (take_reference)

    def _run(self, override: dict) -> tuple[dict[str, np.ndarray], float, dict]:
        """The step with these decisions: its parameters after the update (with Adam, also its moments, "name.exp_avg"
        and "name.exp_avg_sq"), its loss, and the forward's record."""
        grads, loss, record = self._gradients(override)
        return self._update(grads), loss, record

    def _gradients(self, override: dict) -> tuple[dict[str, np.ndarray], float, dict]:
        """The gradients of the step with these decisions, its loss, and the forward's record."""
        p = {k: torch.tensor(v, requires_grad=True) for k, v in self.start.items()}
        logits, record = lenet.forward64(p, torch.tensor(self.x), override)
        loss = F.cross_entropy(logits, torch.tensor(self.y))
        loss.backward()
        return {k: t.grad.numpy() for k, t in p.items()}, loss.item(), record

    def _update(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The optimizer's update from these gradients: SGD's, or Adam's (AdamRule.step)."""
        if self.adam:
            return self.adam.step(grads)
        return {k: self.start[k] - self.lr * g for k, g in grads.items()}

    def observe(self, model) -> dict:
        """An implementation's decisions at the candidates, where they differ from exact arithmetic's: {key: value}.
        `model` holds the step's starting parameters; its layers() gives its own values, to which the rules (a
        ReLU passes h > 0; a pool takes the first of its window's maxima, as PyTorch does) are applied."""
        outputs, _ = model.layers(self.x32, self.y)
        decide = {relu: (outputs[layer] > 0).reshape(-1).astype(int) for relu, (layer, _) in RELUS.items()}
        decide |= {pool: lenet.first_max(lenet.pool_windows(torch.tensor(outputs[relu]))).reshape(-1).numpy()
                   for pool, relu in POOL_INPUT.items()}
        taken = {}
        for c in self.candidates:
            decision = int(decide[c.layer][c.flat])
            if decision != c.exact:
                taken[c.key] = decision
        return taken

    def take_reference(self, after: dict[str, np.ndarray], decisions: dict) -> dict[str, np.ndarray]:
        """Level 1's step ended at `after` taking `decisions` (observe): from now on they are the reference. Returns
        the float64 step that takes them; with Adam, also level 1's own gradient where its sign may go either way."""
        if decisions:
            self.grads = self._gradients(decisions)[0]
            self.params = self._update(self.grads)
        self.reference = decisions
        if self.adam:
            self.params = self.adam.take_reference(self.grads, after)
        return dict(self.params)

    def follow(self, got: dict[str, np.ndarray], decisions: dict, k: int, batch: np.ndarray,
               allowed: dict[str, float]) -> tuple[dict[str, np.ndarray], list[LayerTie]]:
        """(the float64 step taking a level's decisions, the ties: where they differ from level 1's). The decisions
        say it all: the allowance is not needed, and its result `got` only with Adam (AdamRule.follow)."""
        ties = [LayerTie(k, c.layer, c.position, int(batch[c.row]), c.margin, c.bound) for c in self.candidates
                if decisions.get(c.key, c.exact) != self.reference.get(c.key, c.exact)]
        if self.adam:
            grads = self.grads if decisions == self.reference else self._gradients(decisions)[0]
            params, signs = self.adam.follow(grads, got, k)
            return params, ties + signs
        params = self.params if decisions == self.reference else self._run(decisions)[0]
        return dict(params), ties

    def unexplained(self, name: str) -> str:
        took = "the ReLU and max-pool decisions the level took" + (" and its own gradient where Adam's sign may go "
                                                                     "either way" if self.adam else "")
        return f"; {took} are in the float64 step: no tie explains it"


class Candidate(NamedTuple):
    """A decision float32 may take the other way: a ReLU whose input is within float32's reach of 0, or a max-pool
    window whose two largest elements are within float32's reach of each other."""

    layer: str  # relu1..relu4, pool1, pool2
    flat: int  # its index in the batch's layer: the ReLU's input, or the window
    row: int  # the image's row in the batch
    position: tuple[int, ...]  # within the image's layer: (channel, row, column) or (unit,)
    margin: float  # how far from the other decision the exact values are: |h|, or the top two's difference
    bound: float  # float32's reach there
    exact: int  # the decision in exact arithmetic: a ReLU passes (1) or not (0); a window's chosen position 0..3

    @property
    def key(self) -> tuple[str, int]:
        return self.layer, self.flat


def candidates(params: dict[str, np.ndarray], x: np.ndarray, record: dict) -> list[Candidate]:
    """Every decision float32 may take the other way, with bounds carried through the layers as the module says."""
    p = {k: torch.tensor(np.abs(v)) for k, v in params.items()}
    found = []
    reach = torch.zeros(len(x), 1, lenet.IMAGE, lenet.IMAGE, dtype=torch.float64)  # the pixels: exact
    inputs = torch.tensor(np.abs(x)).reshape(reach.shape)
    for relu, (layer, terms) in RELUS.items():
        h = record[relu].detach()
        weight, bias = p[f"{layer}.weight"], p[f"{layer}.bias"]
        if layer.startswith("conv"):
            total = F.conv2d(inputs, weight) + bias[:, None, None]
            bound = gamma(terms) * total + F.conv2d(reach, weight)
        else:
            inputs, reach = inputs.reshape(len(x), -1), reach.reshape(len(x), -1)
            bound = gamma(terms) * (inputs @ weight.T + bias) + reach @ weight.T
        found += _found(relu, h.abs() <= bound, h.abs(), bound, (h > 0).long())
        a = torch.relu(h)
        if relu in POOL_AFTER:
            found += _pool_candidates(POOL_AFTER[relu], a, bound)
            inputs, reach = F.max_pool2d(a, 2), F.max_pool2d(bound, 2)
        else:
            inputs, reach = a, bound
    return found


def _pool_candidates(pool: str, a: torch.Tensor, bound: torch.Tensor) -> list[Candidate]:
    """The windows whose two largest elements are within the sum of their bounds of each other (and positive: a
    window of zeros sends no gradient anywhere): the runner-up could be the maximum."""
    values, reach = lenet.pool_windows(a), lenet.pool_windows(bound)
    order = values.argsort(dim=-1, descending=True, stable=True)
    top = values.gather(-1, order[..., :2])
    top_reach = reach.gather(-1, order[..., :2])
    close = (top[..., 0] - top[..., 1] <= top_reach.sum(-1)) & (top[..., 1] > 0)
    return _found(pool, close, top[..., 0] - top[..., 1], top_reach.sum(-1), lenet.first_max(values))


def _found(layer: str, where: torch.Tensor, margin: torch.Tensor, bound: torch.Tensor, exact: torch.Tensor):
    """The candidates of one layer: where `where` holds, with their margins, bounds and exact decisions."""
    flat = torch.nonzero(where.reshape(-1)).flatten()
    index = np.unravel_index(flat.numpy(), where.shape)
    columns = [c.reshape(-1)[flat].tolist() for c in (margin, bound, exact)]
    return [Candidate(layer, f, int(row), tuple(int(i) for i in position), m, b, int(e))
            for f, row, *position, m, b, e in zip(flat.tolist(), *index, *columns)]


# ---- the per-layer check (common/harness/verify.py's rule), with LeNet-5's layers ----

FORWARD = ("conv1", "relu1", "pool1", "conv2", "relu2", "pool2", "fc1", "relu3", "fc2", "relu4", "fc3")
EXACT = ("relu1", "pool1", "relu2", "pool2", "relu3", "relu4")  # no rounding: given the same input, the same output


def layer_ops(params: dict, x: np.ndarray, outputs: dict) -> dict:
    """Each layer in float64 as (its function, its input: the implementation's own output of the layer before)."""
    p = {k: torch.tensor(np.asarray(v, dtype=np.float64)) for k, v in params.items()}
    t = {k: torch.tensor(np.asarray(v, dtype=np.float64)) for k, v in outputs.items()}
    image = torch.tensor(np.asarray(x, dtype=np.float64)).reshape(-1, 1, lenet.IMAGE, lenet.IMAGE)
    return {
        "conv1": (lambda a: F.conv2d(a, p["conv1.weight"], p["conv1.bias"]), image),
        "relu1": (torch.relu, t["conv1"]), "pool1": (lambda a: F.max_pool2d(a, 2), t["relu1"]),
        "conv2": (lambda a: F.conv2d(a, p["conv2.weight"], p["conv2.bias"]), t["pool1"]),
        "relu2": (torch.relu, t["conv2"]), "pool2": (lambda a: F.max_pool2d(a, 2), t["relu2"]),
        "fc1": (lambda a: F.linear(a.reshape(len(a), -1), p["fc1.weight"], p["fc1.bias"]), t["pool2"]),
        "relu3": (torch.relu, t["fc1"]), "fc2": (lambda a: F.linear(a, p["fc2.weight"], p["fc2.bias"]), t["relu3"]),
        "relu4": (torch.relu, t["fc2"]), "fc3": (lambda a: F.linear(a, p["fc3.weight"], p["fc3.bias"]), t["relu4"]),
    }


def layer_references(params: dict, x: np.ndarray, y: np.ndarray | None, outputs: dict, grads: dict | None):
    """common.harness.verify.layer_references with LeNet-5's layers."""
    return verify.layer_references(layer_ops(params, x, outputs), outputs["fc3"], y, grads)


def per_layer(level_layers: tuple[dict, dict], reference_layers: tuple[dict, dict], params: dict, x: np.ndarray,
              y: np.ndarray) -> tuple[dict[str, float], str | None]:
    """common.harness.verify.per_layer with LeNet-5's layers: each check's share of its allowance, and the first failure."""
    return verify.per_layer(layer_ops, FORWARD, EXACT, level_layers, reference_layers, params, x, y)


def per_layer_forward(outputs: dict, reference_outputs: dict, params: dict, x: np.ndarray):
    """common.harness.verify.per_layer_forward with LeNet-5's layers (inference: no labels, no gradients)."""
    return verify.per_layer_forward(layer_ops, FORWARD, EXACT, outputs, reference_outputs, params, x)
