"""What "verified against the gold standard" means here: two checks, both on the real data.

1. Lockstep, every step of the run (tight). At step k the level is loaded with level 1's parameters
   theta_k, takes one step on level 1's batch, and must reproduce level 1's loss and level 1's update
   theta_{k+1} - theta_k, tensor by tensor. Every step starts from the gold standard's parameters, so
   float32 differences cannot pile up. The yardstick for "reproduce" is the one PyTorch's own tests use
   for float32: the same step computed in float64 (`exact_step`); the level's result may be at most
   YARDSTICK times as far from it as level 1's is, plus the rounding of the result to float32, which no
   level can avoid. One exception is handled, not excused: a tie, a ReLU (or, in LeNet-5, a max-pool window) that
   float32 may decide either way (common/harness/verify_lenet.py for LeNet's rule). With Adam, the step starts from
   level 1's optimizer state too, and its new moments are checked as the parameters are; its ties are the elements
   whose first moment float32 may put on either side of 0 (AdamRule).
2. The free run, statistically. The level's uninterrupted run (the timed one) cannot be compared step
   by step: once a tie sends two float32 runs different ways, they part, as any two float32 trainings
   that sum in different orders do. So the free run is compared by what float32 noise allows, measured
   in the same run: the farthest of level 1's honest runs from it - its float64 twin, and level 1 again with the
   rows of each batch permuted (`check_free_run`).

A run whose loss becomes NaN or infinite is reported as diverged at its first such step, with the likely
cause, and never as a disagreement.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from common.harness.phases import Phases
from common.levels import THE_MLP, level
from common.nets import Network
from common.nets.mlp import N_IN, PARAM_NAMES
from common.nets.optimizers import SGD, Optimizer

# ---- 1. lockstep ----

# The update rule, per tensor: ||theta_level - theta_64|| <= YARDSTICK * ||theta_1 - theta_64||
#     + 2u * ||theta_64||       rounding p - lr * grad to float32: one ulp of each parameter (2u|p| bounds it,
#                               u = 2^-24) - two correct levels may round to neighbouring floats;
#     + FLOOR * u * ||update||  the relative error a chain of float32 sums and a softmax routinely leaves in one
#                               gradient entry, whatever level 1's luck: level 1's own error is the yardstick,
#                               but in a tensor of one element (hidden 1) it can be almost 0 by chance.
# where theta_64 is the step in float64 and theta_1 level 1's. Why not a fixed relative tolerance: late in
# training the updates are tiny beside the parameters, so rounding each parameter to float32 is a large part
# of an update, and where softmax is confident, p - 1 cancels. Both are float32 facts that level 1 suffers
# too; float64 measures them step by step.
# How much of this allowance each level uses is measured in every run: the `lockstep` column of results/*/ (and
# of `make compare`'s table). A learning rate 0.2% off is 2e-3 = 34,000u of every update: it breaks the rule at the
# first step (tests/test_verify.py), and so does every planted bug of tests/plant_bugs.py; tests/test_sharpness.py
# pins that 1.5x the allowance fails and 0.5x passes.
# YARDSTICK = 2 is PyTorch's multiple for float32 against float64.
YARDSTICK = 2.0
FLOOR = 32
# The loss: |loss - level 1's| <= LOSS_RTOL * level 1's loss + LOSS_ATOL. A loss is the difference of a
# log-sum-exp and a logit, each a few units in size, so its rounding is absolute (~1e-7), not relative to
# a loss near 0; the correct levels' distances sit well inside it (the `lockstep` column counts the loss too). A
# wrong loss (a missing mean, a wrong label) is off by far more.
LOSS_RTOL, LOSS_ATOL = 1e-5, 2e-6

# ReLU ties. A hidden unit's pre-activation h = b + sum_i w_i x_i is 785 rounded terms. Summed in any
# order, float32 lands within gamma_n * S of the exact value, where S = |b| + sum_i |w_i x_i|,
# u = 2^-24 (float32's unit roundoff) and gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability of
# Numerical Algorithms, section 3.1; it covers the rounding of the products too, and any order or
# blocking of the sum). So a float32 ReLU can decide differently from exact arithmetic, or from another
# float32 level, only where |h| <= gamma_n * S: a tie. There one level passes a gradient the other does
# not, and unit j's row of fc1.weight and its fc1.bias entry change by exactly lr * da[r, j] * [x_r, 1]
# for the batch row r concerned; nothing else changes visibly (a = h is then within rounding of 0 either
# way). So at every tie candidate the flip that explains a difference is found (greedily, one at a time)
# and taken into account, first for level 1 (the float64 step follows level 1's decisions), then for the
# level under test. Each flip the level needs is reported as a tie, and the rule above must still hold:
# a difference that no flip explains fails.
U = 2.0**-24


def gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u): a float32 sum of n terms, in any order, is within gamma_n * sum |terms|."""
    return n * U / (1 - n * U)


GAMMA = gamma(N_IN + 1)  # ~4.7e-5: the pre-activations


@dataclass
class ExactStep:
    """One SGD step in float64 from given parameters: the result, and what the tie analysis needs."""

    loss: float
    params: dict[str, np.ndarray]  # float64, not rounded
    x: np.ndarray  # (B, 784) the batch
    w1: np.ndarray  # (H, 784) fc1.weight before the step
    b1: np.ndarray  # (H)
    h: np.ndarray  # (B, H) the pre-activations
    da: np.ndarray  # (B, H) d(loss)/d(activation), the size of a flip
    grads: dict[str, np.ndarray] = field(default_factory=dict)  # float64, for another optimizer's update (Adam)

    def candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, units) where float32 may put h on either side of 0: |h| <= gamma_n * S."""
        bound = GAMMA * (np.abs(self.x) @ np.abs(self.w1).T + np.abs(self.b1))
        return np.nonzero(np.abs(self.h) <= bound)

    def bound(self, r: int, j: int) -> float:
        """gamma_n * S of one (row, unit)."""
        return float(GAMMA * (np.abs(self.x[r]) @ np.abs(self.w1[j]) + abs(self.b1[j])))


def exact_step(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, lr: float) -> ExactStep:
    """The SGD step in float64, its gradients by autograd: level 1's network, none of the levels' formulas (LABS.md)."""
    p = {name: torch.tensor(params[name], dtype=torch.float64, requires_grad=True) for name in PARAM_NAMES}
    x64 = torch.tensor(x, dtype=torch.float64)
    h = x64 @ p["fc1.weight"].T + p["fc1.bias"]
    a = torch.relu(h)
    a.retain_grad()  # da, the size of a ReLU flip
    loss = F.cross_entropy(a @ p["fc2.weight"].T + p["fc2.bias"], torch.as_tensor(y, dtype=torch.int64))
    loss.backward()
    stepped = {name: (t - lr * t.grad).detach().numpy() for name, t in p.items()}
    w1, b1 = (p[name].detach().numpy() for name in ("fc1.weight", "fc1.bias"))
    return ExactStep(loss.item(), stepped, x64.numpy(), w1, b1, h.detach().numpy(), a.grad.numpy(),
                     {name: t.grad.numpy() for name, t in p.items()})


def explain_flips(residual_w: np.ndarray, residual_b: np.ndarray, exact: ExactStep, lr: float):
    """The ReLU flips (row, unit) at tie candidates that explain residuals of fc1.weight (H, 784) and fc1.bias (H):
    of the parameters after SGD's step, where a flip moves them by lr times its gradient; or, given 1 - beta1 as `lr`,
    of Adam's first moment.

    Returns (dw, db, flips): the change the flips make to the update, to add to the expected one.
    """
    dw, db, flips = np.zeros_like(residual_w), np.zeros_like(residual_b), []
    rows, units = exact.candidates()
    for j in np.unique(units):
        residual = np.append(residual_w[j], residual_b[j])
        candidates = list(rows[units == j])
        while candidates:
            # A flip of row r adds or removes da[r, j] * [x_r, 1] in the gradient: -+lr times that in the update.
            moves = [(r, s * lr * exact.da[r, j] * np.append(exact.x[r], 1.0)) for r in candidates for s in (1, -1)]
            left = [np.linalg.norm(residual - move) for _, move in moves]
            best = int(np.argmin(left))
            if left[best] >= np.linalg.norm(residual):
                break
            r, move = moves[best]
            residual -= move
            dw[j] += move[:-1]
            db[j] += move[-1]
            candidates.remove(r)
            flips.append((int(r), int(j)))
    return dw, db, flips


@dataclass
class Tie:
    """A ReLU the level decided differently from level 1: at this step, for this image, this hidden unit."""

    step: int
    unit: int
    image: int  # row of the training set
    h: float  # the exact pre-activation, within `bound` of 0
    bound: float  # gamma_n * S

    def describe(self) -> str:
        return (f"step {self.step}, hidden unit {self.unit}, image {self.image}: exact pre-activation {self.h:.2g}, "
                f"within float32's reach of 0 ({self.bound:.2g}); its ReLU went the other way from level 1's")


class MlpStep:
    """The MLP's float64 step, and the ReLU flips (closed form, explain_flips) that explain a float32 result; with
    Adam (optimizer, and level 1's state before the step), Adam's update and its sign ties (AdamRule)."""

    names = PARAM_NAMES

    def __init__(self, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, lr: float,
                 optimizer: Optimizer = SGD, state: dict | None = None):
        self.exact, self.lr = exact_step(params, x, y, lr), lr
        self.loss, self.params = self.exact.loss, dict(self.exact.params)
        self.adam = None
        if optimizer.state:
            self.adam = AdamRule(params, state, lr, optimizer, lambda: gradient_reach(MLP_REACH, params, x, y))
            self.grads = self.exact.grads  # the float64 gradients, level 1's ReLU decisions taken (take_reference)
            self.params = self.adam.step(self.grads)

    def observe(self, model) -> None:
        """What the step needs of an implementation before it steps: nothing, the flips have a closed form."""
        return

    def take_reference(self, after: dict[str, np.ndarray], observed=None) -> dict[str, np.ndarray]:
        """Level 1's step ended at `after`: where it went the other way from exact arithmetic at a tie (its fc1
        update moved further than rounding), the float64 step follows it from now on. Returns that step."""
        if self.adam:
            self.grads = self._adam_flips(after, -1, None, None)[0]
            self.params = self.adam.take_reference(self.grads, after)
            return dict(self.params)
        self.params = self.follow(after, observed, -1, None, None)[0]
        return dict(self.params)

    def follow(self, got: dict[str, np.ndarray], observed, k: int, batch: np.ndarray | None,
               allowed: dict | None) -> tuple[dict[str, np.ndarray], list[Tie]]:
        """(the float64 step taking the ReLU flips that explain `got`, the flips as ties), searched where `got` is
        past `allowed` (None: further than rounding)."""
        if self.adam:
            grads, ties = self._adam_flips(got, k, batch, allowed)
            expected, signs = self.adam.follow(grads, got, k)
            return expected, ties + signs
        first = ("fc1.weight", "fc1.bias")
        far = [_flipped(_norm(got[n] - self.params[n]), self.params[n]) if allowed is None
               else _norm(got[n] - self.params[n]) > allowed[n] for n in first]
        if not any(far):
            return dict(self.params), []
        dw, db, flips = explain_flips(got[first[0]] - self.params[first[0]], got[first[1]] - self.params[first[1]],
                                      self.exact, self.lr)
        expected = {**self.params, first[0]: self.params[first[0]] + dw, first[1]: self.params[first[1]] + db}
        ties = [] if batch is None else [Tie(k, j, int(batch[r]), float(self.exact.h[r, j]), self.exact.bound(r, j))
                                         for r, j in flips]
        return expected, ties

    def _adam_flips(self, got: dict[str, np.ndarray], k: int, batch: np.ndarray | None, allowed: dict | None):
        """(the float64 gradients taking the ReLU flips that explain `got`'s first moments of fc1, the flips as ties):
        a flip adds da[r, j] [x_r, 1] to a row's gradient, so (1 - beta1) times that to its m. Searched where the m is
        past `allowed` (None: past its rounding)."""
        first = ("fc1.weight", "fc1.bias")
        residual = [got[f"{n}.exp_avg"] - self.params[f"{n}.exp_avg"] for n in first]
        limits = [allowed[f"{n}.exp_avg"] if allowed else (2 + FLOOR) * U * _norm(self.params[f"{n}.exp_avg"])
                  for n in first]
        if all(_norm(r) <= limit for r, limit in zip(residual, limits)):
            return dict(self.grads), []
        weight = 1 - self.adam.beta1
        dw, db, flips = explain_flips(*residual, self.exact, weight)
        grads = {**self.grads, first[0]: self.grads[first[0]] + dw / weight,
                 first[1]: self.grads[first[1]] + db / weight}
        ties = [] if batch is None else [Tie(k, j, int(batch[r]), float(self.exact.h[r, j]), self.exact.bound(r, j))
                                         for r, j in flips]
        return grads, ties

    def unexplained(self, name: str) -> str:
        """What a failure of this tensor adds: only fc1's updates can hold a ReLU tie; with Adam, any a sign tie."""
        ties = (["ReLU"] if name.startswith("fc1") else []) + (["Adam sign"] if self.adam else [])
        return f"; no {' or '.join(ties)} tie explains it" if ties else ""


# ---- Adam: its step in float64, and its sign ties ----
# With Adam (common/nets/optimizers.py) each step starts from level 1's parameters and level 1's optimizer state (its
# step count and both moments, loaded into the level, and converted to float64 for the float64 step), which takes
# torch.optim.Adam's step in exact arithmetic:
#     m = m + (1 - beta1)(g - m)    v = beta2 v + (1 - beta2) g^2    p = p - lr / bc1 m / (sqrt(v) / sqrt(bc2) + eps)
# (bc1 = 1 - beta1^t, bc2 = 1 - beta2^t at step t). Lockstep then checks the parameters AND the new m and v (exp_avg,
# exp_avg_sq), tensor by tensor, by the rule above; the step count exactly, as an integer. A moment's floor counts, beside
# its change in the step, what the rounding of its gradient may move it: FLOOR u (1 - beta1) ||S|| for m and
# FLOOR u (1 - beta2) ||2 |g| S|| for v, S each gradient element's sum of absolute terms (gradient_reach). Where softmax
# is confident, p - 1 cancels, and a float32 gradient element is routinely u S off (level 3's fc2.bias at step 4,302 of
# the chapter's run: 1.1 u S), far beyond u |g|; level 1's own error, the yardstick, can be 3x smaller by chance.
#
# Sign ties. At the first step m = (1 - beta1) g and v = (1 - beta2) g^2, so the update is lr g / (|g| + eps): about
# lr sign(g), however small g is. Where a gradient element is within float32's reach of 0, two correct float32 levels
# may put it on either side of 0 and move that element up to 2 lr apart: a tie, as a ReLU's is, but in the optimizer.
# Beyond the first step the same holds wherever the new m is within reach of 0 while v is small too, an element whose
# every gradient so far was (a weight of a pixel the batches rarely light): Adam then divides one number within
# float32's reach of 0 by another, and not only the update's sign but its size is float32's to choose, by up to lr.
# Where v is not small, the update there is tiny either way. So the rule is on m:
#   R    float32's reach on each gradient element: a rigorous bound on how far a float32 level's gradient can be from
#        the float64 one, carried through the layers forward and back (gradient_reach, below);
#   R_m  = (1 - beta1) R + 4u (|m_before| + |g| + R), R_v = (1 - beta2)(2 |g| R + R^2) + 4u (beta2 v_before +
#        (1 - beta2)(|g| + R)^2): the reach on the new m and v (their own roundings too);
#   the float64 step's update is Adam's formula applied, in float64, to the level's own new m and v: the moments are
#   checked against the float64 step by the rule above, and the update as what Adam makes of them. Where both moments
#   are small (an element with no history and a gradient near R, as a unit of LeNet-5's fc1 that has just woken up),
#   Adam's division turns the gradient's rounding into an update error far past the floor; taken so, each error is
#   checked where it arises, and a wrong gradient shows in the moments;
#   a candidate: an element whose new m in float64 is within R_m of 0. Where the level's m and v are within R_m and R_v
#   of the float64 ones and its m is on the other side of 0 (which only a candidate's can be), they are taken as the
#   new moments as well: the float64 step takes the level's side of 0.
#   Level 1's side first (the float64 step follows level 1), then the level's; each element whose m the level put on
#   another side of 0 than level 1 did is reported as a tie, with its tensor and index. No other element's moments are
#   taken: there the float64 step keeps its own m and v, and a difference fails the rule above.
# The reach, carried as common/harness/verify_lenet.py carries a pre-activation's (gradient_reach):
#   forward, each layer: E_out = gamma_n (|W| (|a| + E_in) + |b|) + |W| E_in, n the terms of each sum; a ReLU passes
#       E where its input may be positive (h > -E), a 2 x 2 max-pool the largest E of its window;
#   the logits' gradient dz = (p - onehot) / B, p the softmax: E_dz = (|dp| + 3u (p + onehot)) / B, where
#       |dp| <= p (1 - p)(e^(2 max E_z) - 1) + p (2 |z - max z| + 64) u  (the logits' bounds, and the softmax's own
#       rounding: exp and log within 4 ulps, as NumPy's, Sleef's and CUDA's are);
#   backward, each layer, with D = |dz_out| + E_out (a bound on the level's gradient of the layer's output):
#       E_in = gamma_f |W|^T D + |W|^T E_out  (f: the terms of each sum; the gradient of the layer's input);
#       its weight's R = sum over the batch (and positions) of gamma_n D (|a| + E_in) + D E_in + E_out |a|, its bias's
#       R = sum gamma_n D + E_out (n: the terms of the sum); a ReLU passes E back where it may pass, a max-pool to every
#       element that may be its window's maximum (a_i + E_i >= a_j - E_j for all j);
#   and R + u (|g| + R) in the end (a level may divide by B last).
# S is carried back the same way with absolute values alone: (p + onehot) / B for the logits' gradient, |W| and |a|
# for each layer, along exact arithmetic's decisions.
# R is a worst case, as the ReLU rule's reach is: the levels' actual gradient errors are 1e4 to 1e5 times smaller
# (tests/test_optimizers.py checks that R bounds them), and for LeNet-5's convolutions R exceeds the gradient itself
# (each layer a worst case, each layer's worst case carried through the next). It only says where a side may be taken.

MOMENTS = {"exp_avg": "first moment m", "exp_avg_sq": "second moment v"}  # Adam's state, by PyTorch's names


class AdamRule:
    """Adam's step in float64, from a network's float64 gradients and level 1's state, and its sign ties (above)."""

    def __init__(self, params: dict[str, np.ndarray], state: dict | None, lr: float, optimizer: Optimizer, reach):
        self.start = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
        state = state or {}  # {} before the first step: both moments 0
        self.m_before, self.v_before = ({k: np.asarray(state[k][key], dtype=np.float64) if state else np.zeros_like(p)
                                         for k, p in self.start.items()} for key in ("exp_avg", "exp_avg_sq"))
        self.t = (next(iter(state.values()))["step"] if state else 0) + 1
        self.lr, (self.beta1, self.beta2), self.eps = lr, optimizer.hyper["betas"], optimizer.hyper["eps"]
        self._reach, self._reached = reach, None  # () -> (R, S) by tensor (gradient_reach), computed when first needed
        self.reference_m: dict[str, np.ndarray] = {}  # level 1's new m

    def step(self, grads: dict[str, np.ndarray], taken: dict | None = None) -> dict[str, np.ndarray]:
        """The parameters after the step, and the new moments as "name.exp_avg", "name.exp_avg_sq"; taken: by tensor,
        a level's own moments, for its update, and its side of 0 (candidates())."""
        bc1, bc2 = 1 - self.beta1**self.t, 1 - self.beta2**self.t
        out = {}
        for name, g in grads.items():
            m = self.m_before[name] + (1 - self.beta1) * (g - self.m_before[name])
            v = self.beta2 * self.v_before[name] + (1 - self.beta2) * g * g
            m_step, v_step = m, v
            if taken:
                side = taken[name]
                m_step, v_step = side.m, np.maximum(side.v, 0)  # a v below 0 fails the rule above, not as NaN here
                m, v = np.where(side.other, side.m, m), np.where(side.other, side.v, v)
            out[name] = self.start[name] - self.lr / bc1 * m_step / (np.sqrt(v_step) / np.sqrt(bc2) + self.eps)
            out[f"{name}.exp_avg"], out[f"{name}.exp_avg_sq"] = m, v
        return out

    def reach(self) -> dict[str, np.ndarray]:
        """R, float32's reach on each gradient element (gradient_reach), once per step."""
        return self._bounds()[0]

    def moment_floor(self, grads: dict[str, np.ndarray]) -> dict[str, float]:
        """By moment ("fc1.weight.exp_avg"), what the rounding of its gradient may move it, on the scale of the update
        rule's floor (u ||..||): (1 - beta1) ||S|| for m, (1 - beta2) ||2 |g| S|| for v, S each gradient element's sum
        of absolute terms (gradient_reach)."""
        terms = self._bounds()[1]
        return {k: v for name, g in grads.items() for k, v in (
            (f"{name}.exp_avg", (1 - self.beta1) * _norm(terms[name])),
            (f"{name}.exp_avg_sq", (1 - self.beta2) * _norm(2 * np.abs(g) * terms[name])))}

    def _bounds(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        if self._reached is None:
            self._reached = self._reach()
        return self._reached

    def candidates(self, grads: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> dict[str, Side]:
        """By tensor, what the float64 step takes of a level's step `got` (Side)."""
        taken = {}
        for name, g in grads.items():
            m_before, v_before, reach = self.m_before[name], self.v_before[name], self.reach()[name]
            m = m_before + (1 - self.beta1) * (g - m_before)
            v = self.beta2 * v_before + (1 - self.beta2) * g * g
            reach_m = (1 - self.beta1) * reach + 4 * U * (np.abs(m_before) + np.abs(g) + reach)
            reach_v = (1 - self.beta2) * (2 * np.abs(g) * reach + reach**2) + \
                4 * U * (self.beta2 * v_before + (1 - self.beta2) * (np.abs(g) + reach) ** 2)
            mine_m, mine_v = (np.asarray(got[f"{name}.{key}"], dtype=np.float64) for key in ("exp_avg", "exp_avg_sq"))
            close = (np.abs(mine_m - m) <= reach_m) & (np.abs(mine_v - v) <= reach_v)
            taken[name] = Side(close, close & (np.sign(mine_m) != np.sign(m)), mine_m, mine_v, m, reach_m)
        return taken

    def take_reference(self, grads: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The float64 step taking level 1's own moments (its state after the step: `after`)."""
        self.reference_m = {name: after[f"{name}.exp_avg"] for name in grads}
        return self.step(grads, self.candidates(grads, after))

    def follow(self, grads: dict[str, np.ndarray], got: dict[str, np.ndarray], k: int):
        """(the float64 step taking the level's own moments, the sign ties: the elements whose m the level put, within
        reach, on another side of 0 than level 1 did)."""
        taken = self.candidates(grads, got)
        ties = []
        for name, side in taken.items():
            other = side.close & (np.sign(side.m) != np.sign(self.reference_m[name]))
            ties += [SignTie(k, name, tuple(int(i) for i in index), float(side.exact[index]), float(side.reach[index]))
                     for index in zip(*np.nonzero(other))]
        return self.step(grads, taken), ties


class Side(NamedTuple):
    """What the float64 step takes of a level's step in one tensor (the rule above)."""

    close: np.ndarray  # where the level's m and v are within R_m and R_v of the float64 step's
    other: np.ndarray  # where they are taken as the new moments: those where the level's m is on the other side of 0
    m: np.ndarray  # the level's new m, float64
    v: np.ndarray  # ... and v
    exact: np.ndarray  # the float64 step's m
    reach: np.ndarray  # R_m


@dataclass
class SignTie:
    """An element whose Adam first moment the level put on another side of 0 than level 1 did, within float32's reach
    of 0: at this step, in this tensor, at this index."""

    step: int
    tensor: str
    index: tuple[int, ...]
    m: float  # its new first moment in exact arithmetic
    bound: float  # float32's reach on it, R_m

    def describe(self) -> str:
        return (f"step {self.step}, {self.tensor}{list(self.index)}: Adam's first moment {self.m:.2g} in exact "
                f"arithmetic, within float32's reach of 0 ({self.bound:.2g}); its sign, and its update's, went the "
                "other way from level 1's")


MLP_REACH = (("fc1", "fc"), ("relu1", "relu"), ("fc2", "fc"))  # the MLP as gradient_reach reads a network
LINEAR = {"fc": F.linear, "conv": F.conv2d}


def gradient_reach(layers: tuple[tuple[str, str], ...], params: dict[str, np.ndarray], x: np.ndarray,
                   y: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(R, float32's reach on every gradient element of a step (the statement above); S, the sum of the absolute values
    of the terms that make each gradient element), by parameter name. The network is its layers in the forward order,
    (name, kind): "fc" or "conv" (its parameters name.weight and name.bias), "relu", "pool" (2 x 2) or "flatten"; x is
    the batch as its first layer reads it. Decisions are exact arithmetic's, the ReLUs and pools passing bounds
    wherever float32 may decide otherwise (S follows exact arithmetic's decisions alone)."""
    p = {k: torch.tensor(np.asarray(v, dtype=np.float64), requires_grad=True) for k, v in params.items()}
    a = torch.tensor(np.asarray(x, dtype=np.float64))
    bound = torch.zeros_like(a)
    kept = []  # what the backward needs of each layer
    for name, kind in layers:
        value = a.detach()
        if kind in LINEAR:
            w, b, op = p[f"{name}.weight"], p[f"{name}.bias"], LINEAR[kind]
            with torch.no_grad():
                next_bound = gamma(w[0].numel() + 1) * op(value.abs() + bound, w.abs(), b.abs()) + op(bound, w.abs())
            a = op(a, w, b)
            a.retain_grad()  # the gradient of its output, for the backward
            kept.append((name, kind, (value, bound, a)))
            bound = next_bound
        elif kind == "relu":
            may_pass = value > -bound
            kept.append((name, kind, (may_pass, value > 0)))
            a, bound = torch.relu(a), bound * may_pass
        elif kind == "pool":
            may_win = value + bound >= _spread(F.max_pool2d(value - bound, 2))
            kept.append((name, kind, (may_win, _winners(value))))
            a, bound = F.max_pool2d(a, 2), F.max_pool2d(bound, 2)
        else:  # flatten
            kept.append((name, kind, a.shape))
            a, bound = a.flatten(1), bound.flatten(1)
    F.cross_entropy(a, torch.as_tensor(y, dtype=torch.int64)).backward()
    z = a.detach()
    probs, onehot = torch.softmax(z, dim=1), F.one_hot(torch.as_tensor(y, dtype=torch.int64), z.shape[1])
    shift = z - z.max(dim=1, keepdim=True).values
    carried = probs * (1 - probs) * torch.expm1(2 * bound.max(dim=1, keepdim=True).values)  # the logits' bounds
    dp = carried + probs * (2 * shift.abs() + 64) * U  # and the softmax's own rounding
    bound = (dp + 3 * U * (probs + onehot)) / len(z)
    absolute = (probs + onehot) / len(z)  # S of the logits' gradient: the absolute values of p and -onehot, over B
    reach, terms = {}, {}
    for name, kind, saved in reversed(kept):
        if kind in LINEAR:
            value, bound_in, out = saved
            w, op = p[f"{name}.weight"], LINEAR[kind]
            n = out.numel() // out.shape[1]  # of each weight-gradient sum: a term per image (and position)
            sums = [0, *range(2, out.ndim)]
            gradient = out.grad.abs() + bound  # D
            weight_terms, input_terms = _vjp(op, gamma(n) * (value.abs() + bound_in) + bound_in, w.abs(), gradient)
            weight_carried, input_carried = _vjp(op, value.abs(), w.abs(), bound)
            reach[f"{name}.weight"] = weight_terms + weight_carried
            reach[f"{name}.bias"] = gamma(n) * gradient.sum(sums) + bound.sum(sums)
            bound = gamma(w.shape[0] * w[0, 0].numel()) * input_terms + input_carried  # f: out features, or F k k
            terms[f"{name}.weight"], absolute_in = _vjp(op, value.abs(), w.abs(), absolute)
            terms[f"{name}.bias"], absolute = absolute.sum(sums), absolute_in
        elif kind == "relu":
            bound, absolute = bound * saved[0], absolute * saved[1]
        elif kind == "pool":
            bound, absolute = _spread(bound) * saved[0], _spread(absolute) * saved[1]
        else:
            bound, absolute = bound.reshape(saved), absolute.reshape(saved)
    return ({k: (r + U * (p[k].grad.abs() + r)).numpy() for k, r in reach.items()},
            {k: s.numpy() for k, s in terms.items()})


def _winners(a: torch.Tensor) -> torch.Tensor:
    """1 at the element each 2 x 2 pool window passes on, 0 elsewhere: one per window, where equal values tie (a flat
    patch of background makes a convolution's outputs equal) as in PyTorch's pool."""
    where = F.max_pool2d(a, 2, return_indices=True)[1].flatten(2)
    return torch.zeros_like(a).flatten(2).scatter_(2, where, 1.0).view_as(a)


def _spread(a: torch.Tensor) -> torch.Tensor:
    """Each element of a 2 x 2 pool's output over its window: (n, c, h, w) -> (n, c, 2h, 2w)."""
    return a.repeat_interleave(2, dim=-2).repeat_interleave(2, dim=-1)


def _vjp(op, a: torch.Tensor, w: torch.Tensor, cotangent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The transposes of a layer's product op(a, w), applied to `cotangent`: (its weight's, its input's)."""
    a, w = a.detach().requires_grad_(), w.detach().requires_grad_()
    return torch.autograd.grad(op(a, w), (w, a), cotangent)


@dataclass
class LockstepRecord:
    """One level's lockstep: per-step errors, the ties, and the first failure."""

    label: str
    names: tuple[str, ...] = PARAM_NAMES  # the network's parameters
    loss_err: list[float] = field(default_factory=list)  # |loss - level 1's| / level 1's loss
    update_err: list[list[float]] = field(default_factory=list)  # ||update - level 1's|| / ||level 1's||, per tensor
    used: list[float] = field(default_factory=list)  # the largest share of an allowance used (loss or any tensor)
    ties: list = field(default_factory=list)  # Tie (the MLP) or common.harness.verify_lenet.LayerTie
    failure: str | None = None

    def summary(self) -> dict:
        """Maxima and percentiles, ties and the verdict, as results.json keeps them."""
        update = np.asarray(self.update_err).reshape(-1, len(self.names))
        per_tensor = {
            name: {q: float(np.percentile(update[:, i], p)) if len(update) else 0.0
                   for q, p in (("median", 50), ("p99", 99), ("max", 100))}
            for i, name in enumerate(self.names)
        }
        return {
            "steps": len(self.used),
            "max_loss_err": max(self.loss_err, default=0.0),
            "update_err": per_tensor,
            "max_used": max(self.used, default=0.0),
            "ties": [asdict(t) for t in self.ties],
            "failure": self.failure,
        }


def _norm(a) -> float:
    return float(np.linalg.norm(a))


def _share(distance: float, allowed: float) -> float:
    """distance / allowed, where nothing allowed and nothing moved (a parameter exactly 0 that stays 0) is 0."""
    return distance / allowed if allowed else (0.0 if distance == 0 else np.inf)


def _flipped(distance: float, params64: np.ndarray) -> bool:
    """Could a ReLU flip be in this distance? A flip moves a row by lr * |da| * ||x|| (~1e-4 here), rounding
    alone by u * ||theta|| (~1e-6): so not below 4 x the rounding. Saves the tie search on most steps."""
    return distance > 4 * U * _norm(params64)


@dataclass
class Step:
    """What every level's step is compared with: level 1's, and the float64 one that follows level 1's decisions."""

    k: int  # the step's number
    batch: np.ndarray  # its rows of the training set
    names: tuple[str, ...]  # what is checked: the parameters, and with Adam its moments ("fc1.weight.exp_avg", ...)
    before: dict[str, np.ndarray]  # level 1's parameters (and moments) before it
    after: dict[str, np.ndarray]  # ... and after it
    loss: float  # level 1's loss
    exact: MlpStep  # the float64 step (the network's kind: MlpStep, common.harness.verify_lenet.LeNetStep)
    expected: dict[str, np.ndarray]  # its parameters, level 1's decisions taken
    own: dict[str, float]  # level 1's distance from them, per tensor
    size: dict[str, float]  # the size of level 1's update, per tensor
    allowed: dict[str, float]  # how far a level's result may be from `expected`, per tensor
    params: dict[str, np.ndarray]  # level 1's parameters before it, as every level is loaded with them
    state: dict | None  # ... and its optimizer's state (Adam's), or None
    steps: dict[str, int]  # its optimizer's step counts after it


class Lockstep:
    """Steps level 1 one batch at a time and, from its parameters before each step, every level under test."""

    def __init__(self, reference, models: dict, X: np.ndarray, y: np.ndarray, lr: float, float64_step=MlpStep,
                 optimizer: Optimizer = SGD, clock: Phases | None = None):
        self.reference, self.models, self.X, self.y = reference, models, X, y
        self.clock = clock or Phases()  # the wall time of level 1's and the float64 step, and of each level's
        self.lr = float(np.float32(lr))  # the float32 learning rate every level steps with (contract.check_training)
        self.float64_step = float64_step  # the network's: (params, x, y, lr, optimizer, state) -> MlpStep or the like
        self.optimizer = optimizer
        self.names = float64_step.names + tuple(f"{n}.{key}" for n in float64_step.names for key in optimizer.moments)
        self.records = {label: LockstepRecord(label, self.names) for label in models}
        self.steps = 0
        self.reference_diverged: str | None = None

    def step(self, batch: np.ndarray) -> None:
        """One step on rows `batch` of X: level 1's, the exact one, then each level's from the same parameters."""
        k = self.steps
        self.steps += 1
        if self.reference_diverged:
            return
        with self.clock("level 1 and the float64 step"):
            step = self._reference_step(k, batch)
        if step is None:
            return
        for label, model in self.models.items():
            if not self.records[label].failure:
                with self.clock(label):
                    self._level_step(label, model, step)

    def _reference_step(self, k: int, batch: np.ndarray) -> Step | None:
        """Level 1's step k and the float64 one, and what every level's is compared with; None where level 1 diverged."""
        X, y, lr = self.X, self.y, self.lr
        params = self.reference.state_dict()
        state = self.reference.optimizer_state() if self.optimizer.state else None  # Adam's, before the step
        exact = self.float64_step(params, X[batch], y[batch], lr, self.optimizer, state)
        observed = exact.observe(self.reference)
        loss = float(self.reference.train_epoch(X, y, len(batch), lr, batch)[0])
        after, steps = self._checked(self.reference)
        if not (np.isfinite(loss) and all(np.isfinite(v).all() for v in after.values())):
            self.reference_diverged = f"level 1 itself diverged at lockstep step {k}"
            return None
        expected = exact.take_reference(after, observed)  # where level 1 went the other way at a tie, so does it
        names, before = self.names, {**params, **self._moments(state or {}, params)}
        own = {n: _norm(after[n] - expected[n]) for n in names}  # level 1's own distance
        size = {n: _norm(after[n] - before[n]) for n in names}
        floor = dict(size)
        if exact.adam:  # a moment's floor also counts what its gradient's rounding may move it
            floor.update({n: size[n] + moved for n, moved in exact.adam.moment_floor(exact.grads).items()})
        allowed = {n: YARDSTICK * own[n] + 2 * U * _norm(expected[n]) + FLOOR * U * floor[n] for n in names}
        return Step(k, batch, names, before, after, loss, exact, expected, own, size, allowed, params, state, steps)

    def _level_step(self, label: str, model, step: Step) -> None:
        """One level's step from level 1's parameters (and optimizer state) before step k, checked against it."""
        record, X, y, lr, k = self.records[label], self.X, self.y, self.lr, step.k
        params, state, steps, batch = step.params, step.state, step.steps, step.batch
        model.load_state_dict(params)
        if self.optimizer.state:
            model.load_optimizer_state(state)
        observed = step.exact.observe(model)
        got_loss = float(model.train_epoch(X, y, len(batch), lr, batch)[0])
        got, got_steps = self._checked(model)
        if not (np.isfinite(got_loss) and all(np.isfinite(v).all() for v in got.values())):
            record.failure = f"step {k}: non-finite loss or parameters from level 1's finite ones: a bug, not the data"
        elif got_steps != steps:  # an integer: exactly
            record.failure = (f"step {k}: {self.optimizer.title}'s step counts are {got_steps}, level 1's {steps}: "
                              "the state loaded before the step was not the one it stepped from")
        else:
            self._compare(record, step, got_loss, got, observed)

    def _checked(self, model) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """What is checked of a model after a step: its parameters and its optimizer's moments by name ("fc1.weight",
        "fc1.weight.exp_avg", ...), and its optimizer's step counts."""
        params = model.state_dict()
        if not self.optimizer.state:
            return params, {}
        state = model.optimizer_state()
        return {**params, **self._moments(state, params)}, {name: s["step"] for name, s in state.items()}

    def _moments(self, state: dict, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """An optimizer state's arrays by "name.key"; zeros where there is none yet (before the first step)."""
        return {f"{n}.{key}": state[n][key] if state else np.zeros_like(params[n], dtype=np.float32)
                for n in params for key in self.optimizer.moments}

    @staticmethod
    def _compare(record: LockstepRecord, step: Step, loss: float, got: dict[str, np.ndarray], observed) -> None:
        """Record the step's errors and ties for one level; set its failure if a rule is broken."""
        names = step.names
        expected, ties = step.exact.follow(got, observed, step.k, step.batch, step.allowed)
        record.ties += ties
        distance = {n: _norm(got[n] - expected[n]) for n in names}
        loss_allowed = LOSS_RTOL * abs(step.loss) + LOSS_ATOL
        shares = [abs(loss - step.loss) / loss_allowed] + [_share(distance[n], step.allowed[n]) for n in names]
        record.loss_err.append(abs(loss - step.loss) / max(abs(step.loss), np.finfo(np.float32).tiny))
        record.update_err.append([_norm(_update_difference(got[n], step.after[n], expected[n], step.expected[n]))
                                  / step.size[n] if step.size[n] else 0.0 for n in names])
        record.used.append(max(shares))
        if shares[0] > 1:
            record.failure = (f"step {step.k}: loss {loss:.8g}, level 1's {step.loss:.8g}: "
                              f"{abs(loss - step.loss):.2g} apart, more than {loss_allowed:.2g} allowed")
        elif max(shares) > 1:
            name = names[int(np.argmax(shares[1:]))]
            record.failure = (f"step {step.k}: the {_what(name)} is {distance[name]:.3g} from the float64 step, where "
                              f"level 1's is {step.own[name]:.3g} ({step.allowed[name]:.3g} allowed)"
                              + step.exact.unexplained(name.split(".exp_avg")[0]))


def _update_difference(got: np.ndarray, after: np.ndarray, expected: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """A level's update less level 1's, less what the level's own tie decisions changed in the float64 step
    (expected - reference): nothing where it took level 1's, the same array (a difference of zeros skipped)."""
    difference = (got - after).astype(np.float64)  # measured in float64, as every distance here
    return difference if expected is reference else difference - (expected - reference)


def _what(name: str) -> str:
    """How a failure names what it checked: "fc1.weight update", or "exp_avg of fc1.weight (Adam's first moment m)"."""
    tensor, _, key = name.rpartition(".")
    return f"{key} of {tensor} (Adam's {MOMENTS[key]})" if key in MOMENTS else f"{name} update"


@contextmanager
def torch_threads(n: int):
    """PyTorch on n threads inside the block: lockstep alternates PyTorch and NumPy every step, and their two
    thread pools, each spinning while the other works, slow it severalfold on a machine of few cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def lockstep(models: dict, params, X, y, orders: list[np.ndarray], batch: int, lr: float, quiet: bool = True,
             network: Network = THE_MLP, optimizer: Optimizer = SGD,
             clock: Phases | None = None) -> tuple[dict[str, LockstepRecord], str | None]:
    """Every step of the run (the batches of `orders`, epoch by epoch) in lockstep with level 1 on the CPU, for a
    network of common/nets and an optimizer of its list (the models train with it). Returns each model's record and,
    if level 1 itself diverged, why; `clock` gets the time of level 1's and the float64 step, and of each model's.
    """
    reference = level(1).load(network)(params, device="cpu", **optimizer.options)
    run = Lockstep(reference, models, X, y, lr, network.float64_step(), optimizer, clock)
    batches = [order[start : start + batch] for order in orders for start in range(0, len(order), batch)]
    with torch_threads(1):
        for b in tqdm(batches, desc="lockstep", disable=quiet, leave=False):
            run.step(b)
            if run.reference_diverged or all(r.failure for r in run.records.values()):
                break
    return run.records, run.reference_diverged


# ---- the per-layer check: where a step went wrong ----
# Each layer is given the level's own input to it and recomputed alone in float64, forward and backward, so an error
# is blamed on the layer that made it, not on the ones after it. The rule is lockstep's: at most YARDSTICK times as
# far from float64 as level 1's layer is (from float64 of level 1's own inputs), plus the rounding of the result
# (2u of its size) and the floor of FLOOR u of its size; a ReLU or a max-pool, which do no arithmetic, exactly.
# A network gives its layers as ops: name -> (its float64 function, its input: the level's output of the layer
# before), in the forward order (MLP_LAYERS below; LeNet-5's in common/harness/verify_lenet.py). The checks, by name: each
# layer's output; "d<layer>", the gradient of each layer's input but the first's (the pixels have none); "dloss",
# the gradient of the loss with respect to the logits.

MLP_LAYERS = ("fc1", "relu1", "fc2")
MLP_EXACT = ("relu1",)


def mlp_layer_ops(params: dict, x: np.ndarray, outputs: dict) -> dict:
    """The MLP's layers in float64 as (function, the level's own input to it)."""
    p = {k: torch.tensor(np.asarray(v, dtype=np.float64)) for k, v in params.items()}
    t = {k: torch.tensor(np.asarray(v, dtype=np.float64)) for k, v in outputs.items()}
    return {"fc1": (lambda a: F.linear(a, p["fc1.weight"], p["fc1.bias"]), torch.tensor(np.asarray(x, np.float64))),
            "relu1": (torch.relu, t["fc1"]), "fc2": (lambda a: F.linear(a, p["fc2.weight"], p["fc2.bias"]), t["relu1"])}


def layer_references(ops: dict, logits: np.ndarray | None, y: np.ndarray | None, grads: dict | None):
    """For each layer of `ops`, from the level's own inputs to it: its output in float64 and, given the level's
    gradients (grads, by layer), the gradient of its input from the level's gradient of its output; "loss": the
    gradient of the loss with respect to the level's logits, for labels y. grads None: the outputs only."""
    g = {k: torch.tensor(np.asarray(v, dtype=np.float64)) for k, v in (grads or {}).items()}
    first = next(iter(ops))
    forward, backward = {}, {}
    for name, (op, given) in ops.items():
        leaf = given.clone().requires_grad_(name != first and grads is not None)
        out = op(leaf)
        forward[name] = out.detach().numpy()
        if name != first and grads is not None:
            out.backward(g[name])
            backward[name] = leaf.grad.numpy()
    if grads is not None:
        leaf = torch.tensor(np.asarray(logits, dtype=np.float64), requires_grad=True)
        F.cross_entropy(leaf, torch.tensor(np.asarray(y, dtype=np.int64))).backward()
        backward["loss"] = leaf.grad.numpy()
    return forward, backward


def per_layer(layer_ops, order: tuple[str, ...], exact_layers: tuple[str, ...], level_layers: tuple[dict, dict],
              reference_layers: tuple[dict, dict], params: dict, x: np.ndarray, y: np.ndarray):
    """Every layer of a level (layers(): outputs and gradients, by layer) against float64 from its own inputs,
    forward and backward, by the rule above, level 1's layers (reference_layers) giving the yardstick. Returns each
    check's share of its allowance and the first failure (or None)."""
    (outputs, grads), (ref_outputs, ref_grads) = level_layers, reference_layers
    mine, theirs = (layer_references(layer_ops(params, x, out), out[order[-1]], y, g)
                    for out, g in (level_layers, reference_layers))
    previous = dict(zip(order[1:], order))
    checks = [(name, outputs[name], mine[0][name], ref_outputs[name], theirs[0][name], name in exact_layers)
              for name in order]
    checks += [(f"d{name}", grads[previous[name]], mine[1][name], ref_grads[previous[name]], theirs[1][name],
                name in exact_layers) for name in order[1:]]
    checks.append(("dloss", grads[order[-1]], mine[1]["loss"], ref_grads[order[-1]], theirs[1]["loss"], False))
    return _judge(checks)


def per_layer_forward(layer_ops, order: tuple[str, ...], exact_layers: tuple[str, ...], outputs: dict,
                      reference_outputs: dict, params: dict, x: np.ndarray):
    """per_layer's forward half, for inference (no labels, no gradients): every layer's output."""
    mine, theirs = (layer_references(layer_ops(params, x, out), None, None, None)[0]
                    for out in (outputs, reference_outputs))
    return _judge([(name, outputs[name], mine[name], reference_outputs[name], theirs[name], name in exact_layers)
                   for name in order])


def mlp_per_layer(level_layers: tuple[dict, dict], reference_layers: tuple[dict, dict], params: dict, x: np.ndarray,
                  y: np.ndarray):
    """per_layer with the MLP's layers."""
    return per_layer(mlp_layer_ops, MLP_LAYERS, MLP_EXACT, level_layers, reference_layers, params, x, y)


def _judge(checks: list[tuple]) -> tuple[dict[str, float], str | None]:
    """Each check (name, got, its float64, the reference's got, its float64, exact op) against its allowance."""
    shares, failure = {}, None
    for name, got, exact, ref_got, ref_exact, exact_op in checks:
        distance, own = _norm(got - exact), _norm(ref_got - ref_exact)
        allowed = 0.0 if exact_op else YARDSTICK * own + (2 + FLOOR) * U * _norm(exact)
        shares[name] = _share(distance, allowed)
        if shares[name] > 1 and failure is None:
            what = f"{name[1:]}'s input gradient" if name.startswith("d") else f"{name}'s output"
            failure = (f"per layer: {what} is {distance:.3g} from float64 of the level's own inputs; level 1's is "
                       f"{own:.3g} ({allowed:.3g} allowed)")
    return shares, failure


# ---- 2. the free run ----

# Once a ReLU tie sends them different ways, two correct float32 runs are two different SGD trajectories
# through the same batches. Their per-step losses then differ by 1e-3..1e-2, but their per-epoch mean
# losses and test accuracy agree to what float32 noise allows, and that noise is measured in the same run,
# on honest runs, each level 1's run with other roundings: its float64 twin (the same code in double precision,
# see level1_pytorch), and level 1 again HONEST_SAMPLES times with the rows of each batch permuted (the same sums,
# added in another order). The farthest of them from level 1 is the size of float32's effect on this run.
# Why several: a few ties decide which of a handful of trajectories a run follows, so an honest run's distance
# from level 1 is ~0 (same branch) or the branches' spread, and one sample may be either. Measured on LeNet-5 with
# Adam, 2,000 images, one epoch (issue 41): eight reruns 1e-9 or 8e-5 from level 1, the twin and levels 3 and 8 8.6e-5;
# with moments carried over from a warm-up epoch, the twin 3.0e-3 and six reruns 3.8e-3..7.5e-3 here, while on
# another machine the twin fell on level 1's branch (3.3e-4) and correct levels 3.0e-3 away failed.
# The `free run` column of results/*/ gives the share of this band each level used. A bug that only the free run
# can show (an epoch's later steps, the order of its batches) moves the means by 1e-2 or more.
HONEST_SAMPLES = 3  # level 1's reruns with permuted rows, beside the twin: the cost of HONEST_SAMPLES level 1 runs
FREE_K = 4  # the band is FREE_K times the measured noise ...
FREE_FLOOR = 2.5e-4  # ... and at least FREE_K x FREE_FLOOR x the epoch's mean loss: a level may part from level 1
# late in a run, at a tie the twin never met, and one epoch cannot yet show the twin's noise for it
ACC_FLOOR = 10  # test images: accuracy may differ by as many images as an honest run flipped, and at least this


@dataclass
class FreeRun:
    """One free run against level 1's, with level 1's honest runs as the yardstick of float32 noise."""

    epoch_means: list[float]  # the level's mean loss per epoch
    epoch_dev: list[float]  # |its mean - level 1's| per epoch
    band: list[float]  # allowed per epoch
    accuracy_dev: float  # |test accuracy - level 1's|
    accuracy_band: float
    failure: str | None = None

    @property
    def used(self) -> float:
        """The largest share of a band used (per-epoch means or accuracy); infinite when the runs differ in length."""
        if not self.band:
            return float("inf")
        return max(max(d / b for d, b in zip(self.epoch_dev, self.band)), self.accuracy_dev / self.accuracy_band)


def epoch_means(losses, epochs: int) -> np.ndarray:
    """Mean loss of each epoch (float64)."""
    return np.asarray(losses, dtype=np.float64).reshape(epochs, -1).mean(axis=1)


def rows_permuted(order: np.ndarray, batch: int, sample: int) -> np.ndarray:
    """`order` with the rows of each batch permuted (seeded by `sample`): the same batches and sums, other roundings."""
    rng, order = np.random.default_rng([sample, len(order)]), np.array(order)
    for start in range(0, len(order), batch):
        order[start : start + batch] = rng.permutation(order[start : start + batch])
    return order


def free_run_noise(reference_losses, twin_losses, reference_pred, twin_pred, epochs: int, samples=()) -> dict:
    """float32's effect on this run: the farthest from level 1 of its honest runs, its float64 twin and `samples`
    (level 1 with permuted rows: (losses, test predictions) each), in per-epoch means and test predictions."""
    honest = [(twin_losses, twin_pred), *samples]
    if any(len(losses) != len(reference_losses) or not np.isfinite(losses).all() for losses, _ in honest):
        raise ValueError("an honest run of level 1 (its float64 twin, or a rerun with permuted rows) did not finish: "
                         "no yardstick for the free runs")
    means = epoch_means(reference_losses, epochs)
    devs = [float(np.abs(means - epoch_means(losses, epochs)).max()) for losses, _ in honest]
    flips = [int((np.asarray(reference_pred) != np.asarray(pred)).sum()) for _, pred in honest]
    return {"epoch_dev": max(devs), "test_images_flipped": max(flips), "samples": {"epoch_dev": devs,
                                                                                   "test_images_flipped": flips}}


def check_free_run(losses, reference_losses, accuracy: float, reference_accuracy: float, n_test: int,
                   noise: dict, epochs: int) -> FreeRun:
    """The level's free run against level 1's, within FREE_K x the float32 noise measured by the honest runs."""
    if len(losses) != len(reference_losses):
        return FreeRun([], [], [], 0.0, 1.0, f"{len(losses)} steps instead of {len(reference_losses)}: "
                                             "a batch was dropped or added")
    means, reference_means = epoch_means(losses, epochs), epoch_means(reference_losses, epochs)
    dev = np.abs(means - reference_means)
    band = FREE_K * np.maximum(noise["epoch_dev"], FREE_FLOOR * reference_means)
    accuracy_band = max(noise["test_images_flipped"], ACC_FLOOR) / n_test
    run = FreeRun(means.tolist(), dev.tolist(), band.tolist(), abs(accuracy - reference_accuracy), accuracy_band)
    if (dev > band).any():
        e = int(np.argmax(dev > band))
        run.failure = (f"epoch {e}: mean loss {means[e]:.6g}, level 1's {reference_means[e]:.6g}: "
                       f"{dev[e]:.2g} apart, more than float32 noise allows ({band[e]:.2g})")
    elif run.accuracy_dev > accuracy_band:
        run.failure = (f"test accuracy {accuracy:.4f}, level 1's {reference_accuracy:.4f}: more than float32 "
                       f"noise allows ({accuracy_band * n_test:.0f} of {n_test:,} images)")
    return run


def divergence(losses, lr: float, X: np.ndarray) -> str | None:
    """Why a run's losses stopped being finite, or None: the first bad step and the likely cause."""
    bad = np.flatnonzero(~np.isfinite(np.asarray(losses, dtype=np.float64)))
    if not len(bad):
        return None
    step = int(bad[0])
    scale = float(np.abs(X).max())
    cause = (f"the inputs reach |x| = {scale:.3g}: normalize them (common.harness.data.normalize)" if scale > 1e3
             else f"the learning rate {lr:g} is too large: try one 10x smaller")
    return f"diverged: loss {losses[step]} at step {step}; likely cause: {cause}"
