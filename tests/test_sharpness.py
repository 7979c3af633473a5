"""The verifier's own sharpness: an error of 1.5x what a rule allows fails, and one of 0.5x passes.

Each rule is written here again from its statement (common/harness/verify.py's and common/harness/verify_lenet.py's docstrings), with
its numbers, not read from the code it tests: a rule made looser there (a yardstick 10x larger, a wider band, a
larger reach for ties) fails these tests.
    update:   ||theta - theta_64|| <= 2 ||theta_1 - theta_64|| + 2u ||theta_64|| + 32u ||update||, per tensor
    loss:     |loss - level 1's| <= 1e-5 level 1's + 2e-6
    ties:     a ReLU within gamma_n * sum |terms| of 0; a pool window's top two within the sum of their reaches
    free run: per epoch, |mean - level 1's| <= 4 max(the farthest honest run's distance, 2.5e-4 x the mean); test
              accuracy within max(the images an honest run flipped, 10); the honest runs: level 1's float64 twin and
              3 reruns of level 1 with the rows of each batch permuted
    per layer: each layer's output and each gradient, from the level's own inputs, within 2x level 1's distance
              from float64 + 34u of its size; a ReLU or a pool exactly
    Adam:     the float64 step from level 1's parameters and state, its update from the level's own m and v: each
              parameter's update and each new moment (m, v) by the update rule, `update` its change in the step, and
              for a moment + 32u (1 - beta1) ||S|| (m) or + 32u (1 - beta2) ||2 |g| S|| (v), S each gradient
              element's sum of absolute terms (the backward pass with (p + onehot) / B for the logits' gradient and
              the absolute values of the weights and activations); the step count exactly
    Adam's sign: an element whose new m is within R_m = 0.1 R + 4u (|m_before| + |g| + R) of 0 takes the level's side
              of 0, R its gradient's reach; for the MLP's fc2.bias R = the sum over the batch of gamma_B (|dz| + E_dz)
              + E_dz, then R + u (|g| + R), where E_dz = (p (1 - p)(e^(2 max E_z) - 1) + p (2 |z - max z| + 64) u
              + 3u (p + onehot)) / B, E_z = gamma_(H+1) (|W2| (|a| + E_a) + |b2|) + |W2| E_a, E_a = E_h where
              h > -E_h (else 0), E_h = gamma_785 (|W1| |x| + |b1|)
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.harness import verify, verify_lenet
from common.levels import level
from common.nets import get, lenet, mlp, optimizers

pytestmark = pytest.mark.harness

U = 2.0**-24
SHARES = [pytest.param(0.5, id="half"), pytest.param(1.5, id="one-and-a-half")]


def stated_allowance(after, expected, before) -> dict[str, float]:
    """The update rule's allowance per tensor, from its statement."""
    norm = np.linalg.norm
    return {n: 2 * norm(after[n] - expected[n]) + 2 * U * norm(expected[n]) + 32 * U * norm(after[n] - before[n])
            for n in expected}


class Wrapped:
    """A level-1 model (self.inner) as the verifier sees it: every method of the contract passed through; a subclass
    replaces the one it changes."""

    def layers(self, X, y):
        return self.inner.layers(X, y)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, params):
        self.inner.load_state_dict(params)

    def optimizer_state(self):
        return self.inner.optimizer_state()

    def load_optimizer_state(self, state):
        self.inner.load_optimizer_state(state)


class Nudged(Wrapped):
    """Level 1 with its step's result moved: one tensor to `share` of the stated allowance from the float64 step (in a
    seeded random direction), or the loss by `share` of its allowance."""

    def __init__(self, network: str, params, tensor: str | None = None, share: float = 0.0, loss_share: float = 0.0):
        self.network, self.tensor, self.share, self.loss_share = get(network), tensor, share, loss_share
        self.inner = level(1).load(self.network)(params)

    def train_epoch(self, X, y, batch_size, lr, order=None):
        before = self.inner.state_dict()
        exact = self.network.float64_step()(before, X[order], y[order], float(np.float32(lr)))
        observed = exact.observe(self.inner)
        losses = self.inner.train_epoch(X, y, batch_size, lr, order)
        after = self.inner.state_dict()
        expected = exact.take_reference(after, observed)
        if self.tensor:
            allowed = stated_allowance(after, expected, before)[self.tensor]
            direction = np.random.default_rng(0).standard_normal(expected[self.tensor].shape)
            moved = expected[self.tensor] + self.share * allowed * direction / np.linalg.norm(direction)
            self.inner.load_state_dict({**after, self.tensor: moved.astype(np.float32)})
        return losses + np.float32(self.loss_share * (1e-5 * abs(float(losses[0])) + 2e-6))


@pytest.fixture(scope="module")
def batches(mnist):
    return mnist[0][:16], mnist[1][:16]


@pytest.fixture(scope="module")
def start(mnist):
    """Each network after 30 steps of level 1 (batch 16): past the first steps."""
    params = {}
    for name, network in (("mlp", mlp), ("lenet", lenet)):
        reference = level(1).load(get(name))(network.init_params(3))
        reference.train_epoch(mnist[0][:480], mnist[1][:480], 16, 0.05)
        params[name] = reference.state_dict()
    return params


def one_step(network: str, candidate, params, X, y) -> verify.LockstepRecord:
    records, diverged = verify.lockstep({"level": candidate}, params, X, y, [np.arange(len(X), dtype=np.int32)],
                                        len(X), 0.05, network=get(network))
    assert diverged is None
    return records["level"]


TENSORS = [pytest.param(network, name, id=f"{network}-{name}")
           for network, names in (("mlp", mlp.PARAM_NAMES), ("lenet", lenet.PARAM_NAMES)) for name in names]


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize(("network", "tensor"), TENSORS)
def test_each_tensors_update_rule(start, batches, network, tensor, share):
    record = one_step(network, Nudged(network, start[network], tensor, share), start[network], *batches)
    assert record.used[0] == pytest.approx(share, abs=0.2)  # the float32 rounding of the moved tensor, at most
    assert (record.failure is not None) == (share > 1), record.failure
    if share > 1:
        assert f"the {tensor} update" in record.failure


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("network", ["mlp", "lenet"])
def test_the_loss_rule(start, batches, network, share):
    record = one_step(network, Nudged(network, start[network], loss_share=share), start[network], *batches)
    assert (record.failure is not None) == (share > 1), record.failure
    if share > 1:
        assert "loss" in record.failure


# ---- ties ----


def relu1_tie(params, x, y, at: float) -> tuple[dict, tuple[int, int, int]]:
    """params with conv1.bias[0] set so that image 0's exact conv1 output at one position of channel 0 is `at` times
    float32's reach of 0 there (stated: gamma_26 x (|b| + sum |w x|)). The position is the largest of its pool
    window (so the window passes its gradient there, and the ReLU's decision matters), the one whose window gets the
    largest gradient times the size of its patch."""
    image = x[0].astype(np.float64).reshape(28, 28)
    w = params["conv1.weight"][0, 0].astype(np.float64)
    patches = np.lib.stride_tricks.sliding_window_view(image, (5, 5))
    dots = (patches * w).sum(axis=(2, 3))  # (24, 24): the bias shifts them all alike, so each window keeps its max
    dpool = np.abs(level(1).load(get("lenet"))(params).layers(x, y)[1]["pool1"][0, 0])  # (12, 12)
    window_max = dots.reshape(12, 2, 12, 2).max(axis=(1, 3)).repeat(2, axis=0).repeat(2, axis=1)
    score = np.where(dots == window_max, dpool.repeat(2, axis=0).repeat(2, axis=1), 0) * np.abs(patches).sum(axis=(2, 3))
    r, c = np.unravel_index(score.argmax(), score.shape)
    dot, total = float((w * patches[r, c]).sum()), float((np.abs(w) * np.abs(patches[r, c])).sum())
    gamma = 26 * U / (1 - 26 * U)
    bias = -dot
    for _ in range(3):  # the reach counts |b| too: settle it
        bias = -dot + at * gamma * (total + abs(bias))
    return {**params, "conv1.bias": np.concatenate([[np.float32(bias)], params["conv1.bias"][1:]])}, (0, int(r), int(c))


class FlipsOneReLU(Wrapped):
    """A level that decides the other way from exact arithmetic at one conv1 ReLU of image 0 and is exact elsewhere:
    its layers() shows that decision, its step is the float64 step taking it."""

    def __init__(self, params, where):
        self.inner, self.where = level(1).load(get("lenet"))(params), where
        self.flat = np.ravel_multi_index((0, *where), (16, 6, 24, 24))

    def layers(self, X, y):
        outputs, grads = self.inner.layers(X, y)
        outputs["conv1"].reshape(-1)[self.flat] *= -1 if outputs["conv1"].reshape(-1)[self.flat] else 1
        return outputs, grads

    def train_epoch(self, X, y, batch_size, lr, order=None):
        step = verify_lenet.LeNetStep(self.inner.state_dict(), X[order], y[order], float(np.float32(lr)))
        start = {k: torch.tensor(v) for k, v in step.start.items()}
        exact = int(lenet.forward64(start, torch.tensor(step.x))[1]["relu1"].reshape(-1)[self.flat] > 0)
        params, loss, _ = step._run({("relu1", int(self.flat)): 1 - exact})
        self.inner.load_state_dict({k: v.astype(np.float32) for k, v in params.items()})
        return np.array([loss], dtype=np.float32)


@pytest.mark.parametrize("share", SHARES)
def test_the_relu_tie_rule_of_lenet(start, batches, share):
    params, where = relu1_tie(start["lenet"], *batches, share)
    record = one_step("lenet", FlipsOneReLU(params, where), params, *batches)
    if share < 1:
        assert record.failure is None, record.failure
        assert [(t.layer, t.position, t.image) for t in record.ties] == [("relu1", where, 0)]
    else:
        assert record.failure and "no tie explains it" in record.failure and not record.ties


@pytest.mark.parametrize("share", SHARES)
def test_the_pool_tie_rule(share):
    """A window whose top two are `share` times the sum of their reaches apart is a candidate only below 1."""
    a = torch.tensor([[[[5.0, 5.0 - 2e-3 * share], [1.0, 0.0]]]], dtype=torch.float64)
    bound = torch.full_like(a, 1e-3)
    found = verify_lenet._pool_candidates("pool1", a, bound)
    assert [(c.layer, c.position, c.exact) for c in found] == ([("pool1", (0, 0, 0), 0)] if share < 1 else [])


@pytest.mark.parametrize("share", SHARES)
def test_the_relu_tie_rule_of_the_mlp(share):
    """A hidden unit whose exact pre-activation is `share` times gamma_785 x (|b| + sum |w x|) from 0 is a candidate
    only below 1."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, mlp.N_IN)).astype(np.float32)
    params = mlp.init_params(0, 4)
    w, b = params["fc1.weight"][0].astype(np.float64), 0.0
    dot, total = float(w @ x[0]), float(np.abs(w) @ np.abs(x[0]))
    gamma = 785 * U / (1 - 785 * U)
    for _ in range(3):
        b = -dot + share * gamma * (total + abs(b))
    params["fc1.bias"][0] = np.float32(b)
    exact = verify.exact_step(params, x, np.array([1]), 0.05)
    rows, units = exact.candidates()
    assert (0 in units[rows == 0]) == (share < 1)


# ---- the free run ----


@pytest.mark.parametrize("share", SHARES)
def test_the_free_run_band(share):
    means = np.array([0.9, 0.5, 0.4])
    noise = {"epoch_dev": 3e-4, "test_images_flipped": 4}
    band = 4 * np.maximum(3e-4, 2.5e-4 * means)
    run = verify.check_free_run(np.repeat(means + share * band, 10), np.repeat(means, 10), 0.9, 0.9, 10_000, noise, 3)
    assert (run.failure is not None) == (share > 1) and run.used == pytest.approx(share, rel=1e-3)


@pytest.mark.parametrize("share", SHARES)
def test_the_free_run_band_is_the_farthest_honest_run(share):
    """Issue 41's LeNet-5 with Adam: the twin fell on level 1's branch (3.3e-4 away), a permuted rerun did not (4e-3)."""
    means, honest = np.array([1.209]), [3.25e-4, 1e-9, 4e-3, 2e-5]
    twin, *samples = [np.repeat(means + d, 10) for d in honest]
    noise = verify.free_run_noise(np.repeat(means, 10), twin, np.zeros(8), np.zeros(8), 1,
                                  [(losses, np.zeros(8)) for losses in samples])
    assert noise["epoch_dev"] == pytest.approx(4e-3) and noise["samples"]["epoch_dev"] == pytest.approx(honest)
    run = verify.check_free_run(np.repeat(means + share * 4 * 4e-3, 10), np.repeat(means, 10), 0.9, 0.9, 10_000, noise,
                                1)
    assert (run.failure is not None) == (share > 1) and run.used == pytest.approx(share, rel=1e-3)


@pytest.mark.parametrize("share", SHARES)
def test_the_test_accuracy_band(share):
    noise = {"epoch_dev": 3e-4, "test_images_flipped": 4}
    losses = np.repeat([0.9, 0.5], 10)
    run = verify.check_free_run(losses, losses, 0.9 + share * 10 / 10_000, 0.9, 10_000, noise, 2)
    assert (run.failure is not None) == (share > 1)


# ---- the per-layer check (common/harness/verify.py): every layer's output and every gradient, each on its own ----
#   per layer: ||got - float64 of the level's own inputs|| <= 2 ||level 1's - its float64|| + 34u ||float64||;
#              a ReLU or a max-pool (and their gradients) exactly.

NETWORK_LAYERS = {  # each network's layers in the forward order, and those that do no arithmetic
    "mlp": (("fc1", "relu1", "fc2"), ("relu1",)),
    "lenet": (("conv1", "relu1", "pool1", "conv2", "relu2", "pool2", "fc1", "relu3", "fc2", "relu4", "fc3"),
              ("relu1", "pool1", "relu2", "pool2", "relu3", "relu4")),
}


def checks_of(network: str) -> list[str]:
    """Every check the rule states: each layer's output, the gradient of each layer's input (the image has none),
    and the gradient of the loss with respect to the logits."""
    layers = NETWORK_LAYERS[network][0]
    return [*layers, *(f"d{name}" for name in layers[1:]), "dloss"]


def per_layer(network: str):
    """The per-layer check of a network, as the networks' list names it."""
    return get(network).per_layer_check()


def planted_layers(model, X, y, output=None, gradient=None):
    """Level 1's layers() with one layer's output moved (output: (layer, delta)), the later layers computed from it;
    or the gradient of one layer's output moved (gradient: (layer, delta)), the earlier gradients computed from it:
    a bug in one layer, which every other layer then takes as its input."""
    import torch.nn.functional as F

    net, hooks = model.net, []
    if output:
        name, delta = output
        hooks.append(getattr(net, name).register_forward_hook(lambda m, i, out: out + torch.from_numpy(delta)))
    keep = {}
    try:
        logits = net(torch.from_numpy(X), keep)
        for tensor in keep.values():
            tensor.retain_grad()
        if gradient:
            name, delta = gradient
            keep[name].register_hook(lambda g: g + torch.from_numpy(delta))
        F.cross_entropy(logits, torch.from_numpy(y).long()).backward()
    finally:
        for hook in hooks:
            hook.remove()
        model.optimizer.zero_grad()
    return ({k: t.detach().numpy().copy() for k, t in keep.items()},
            {k: t.grad.detach().numpy().copy() for k, t in keep.items()})


def planted_error(got, exact, share):
    """A float32 delta moving `got` to `share` times the stated allowance from `exact` (its own distance doubled, plus
    34u of its size), in a seeded direction."""
    got64, exact = got.astype(np.float64), exact.astype(np.float64)
    error = got64 - exact
    allowed = 2 * np.linalg.norm(error) + 34 * U * np.linalg.norm(exact)
    direction = np.random.default_rng(1).standard_normal(got.shape)
    direction /= np.linalg.norm(direction)
    along = float((error * direction).sum())
    t = -along + np.sqrt(along**2 - float((error**2).sum()) + (share * allowed) ** 2)
    return (t * direction).astype(np.float32)


def ulp_at_largest(got, share):
    """One ulp on the largest element of `got` at 1.5, nothing at 0.5: an exact layer's planted error."""
    delta = np.zeros_like(got)
    if share > 1:
        i = np.unravel_index(np.abs(got).argmax(), got.shape)
        delta[i] = np.spacing(got[i])
    return delta


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize(("network", "check"), [pytest.param(network, check, id=f"{network}-{check}")
                                                for network in NETWORK_LAYERS for check in checks_of(network)])
def test_the_per_layer_rule_of_each_layer(start, batches, network, check, share):
    """An error planted in one layer's output or one gradient, `share` times that check's stated allowance (one ulp
    for a ReLU or a pool): the per-layer check fails at 1.5, naming that layer and only it, and passes at 0.5."""
    X, y = batches
    params = start[network]
    layers, exact_layers = NETWORK_LAYERS[network]
    model = level(1).load(get(network))(params)
    clean = planted_layers(model, X, y)
    ops = (verify.mlp_layer_ops if network == "mlp" else verify_lenet.layer_ops)(params, X, clean[0])
    forward64, backward64 = verify.layer_references(ops, clean[0][layers[-1]], y, clean[1])
    layer = check.removeprefix("d")
    exact_layer = layer in exact_layers
    if not check.startswith("d"):  # the layer's output
        got, exact = clean[0][layer], forward64[layer]
        delta = ulp_at_largest(got, share) if exact_layer else planted_error(got, exact, share)
        planted = planted_layers(model, X, y, output=(layer, delta))
    else:  # the gradient of the layer's input: of the previous layer's output, or of the logits for the loss
        moved = layers[-1] if layer == "loss" else layers[layers.index(layer) - 1]
        got, exact = clean[1][moved], backward64[layer]
        delta = ulp_at_largest(got, share) if exact_layer else planted_error(got, exact, share)
        planted = planted_layers(model, X, y, gradient=(moved, delta))
    shares, failure = per_layer(network)(planted, clean, params, X, y)
    assert sorted(shares) == sorted(checks_of(network)), "the per-layer check skips or adds a check"
    failing = sorted(name for name, used in shares.items() if used > 1)
    if share < 1:
        assert failure is None and not failing, failure
    else:
        assert failing == [check], f"planted in {check}, failing: {failing}"
        what = f"{layer}'s input gradient" if check.startswith("d") else f"{layer}'s output"
        assert failure.startswith(f"per layer: {what}"), failure
        if not exact_layer:
            assert shares[check] == pytest.approx(share, rel=0.05)


# ---- Adam: the update rule for every parameter and both moments, from level 1's state; and its sign ties ----

ADAM = optimizers.get("adam")
ADAM_LR = 1e-3
MOMENTS = ("exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def adam_start(start, mnist):
    """Each network's parameters and level 1's Adam state after 10 Adam steps from `start`, on other digits."""
    out = {}
    for name in ("mlp", "lenet"):
        reference = level(1).load(get(name))(start[name], optimizer="adam")
        reference.train_epoch(mnist[0][480:640], mnist[1][480:640], 16, ADAM_LR)
        out[name] = reference.state_dict(), reference.optimizer_state()
    return out


def one_adam_step(network: str, candidate, params, state, X, y) -> verify.LockstepRecord:
    """Lockstep over one batch of all of X with Adam, level 1 and the candidate starting from `state`."""
    reference = level(1).load(get(network))(params, optimizer="adam")
    reference.load_optimizer_state(state)
    run = verify.Lockstep(reference, {"level": candidate}, X, y, ADAM_LR, get(network).float64_step(), ADAM)
    with verify.torch_threads(1):
        run.step(np.arange(len(X)))
    assert run.reference_diverged is None
    return run.records["level"]


def with_moments(params: dict, state: dict) -> dict:
    """Parameters and Adam's moments by name, "fc1.weight.exp_avg" for fc1.weight's m."""
    return {**params, **{f"{name}.{key}": state[name][key] for name in params for key in MOMENTS}}


class AdamLevel1(Wrapped):
    """Level 1 with Adam; a subclass changes its step."""

    def __init__(self, network: str, params):
        self.inner = level(1).load(get(network))(params, optimizer="adam")


class NudgedAdam(AdamLevel1):
    """Level 1 with Adam, its step's result moved: one parameter tensor, or one moment ("fc1.weight.exp_avg"), to
    `share` of the stated allowance from the float64 step."""

    def __init__(self, network: str, params, tensor: str, share: float):
        super().__init__(network, params)
        self.network, self.tensor, self.share = get(network), tensor, share

    def train_epoch(self, X, y, batch_size, lr, order=None):
        params, state = self.inner.state_dict(), self.inner.optimizer_state()
        exact = self.network.float64_step()(params, X[order], y[order], float(np.float32(lr)), ADAM, state)
        observed = exact.observe(self.inner)
        losses = self.inner.train_epoch(X, y, batch_size, lr, order)
        after_params, after_state = self.inner.state_dict(), self.inner.optimizer_state()
        after = with_moments(after_params, after_state)
        expected = exact.take_reference(after, observed)
        allowed = stated_allowance(after, expected, with_moments(params, state))[self.tensor] + \
            stated_moment_floors(self.network.name, params, X[order], y[order]).get(self.tensor, 0.0)
        name, key = self.tensor.rsplit(".", 1)
        # a moment scaled, as a wrong beta would scale it (v stays >= 0), and the update made from it; a parameter in
        # a random direction
        direction = expected[self.tensor] if key in MOMENTS else \
            np.random.default_rng(0).standard_normal(expected[self.tensor].shape)
        moved = expected[self.tensor] + self.share * allowed * direction / np.linalg.norm(direction)
        moved = moved.astype(np.float32)
        if key in MOMENTS:
            after_state[name][key] = moved
            self.inner.load_optimizer_state(after_state)
            m, v, t = (np.asarray(after_state[name][k], dtype=np.float64) for k in (*MOMENTS, "step"))
            stepped = params[name] - stated_adam_update(m, v, int(t), float(np.float32(lr)))
            self.inner.load_state_dict({**after_params, name: stepped.astype(np.float32)})
        else:
            self.inner.load_state_dict({**after_params, self.tensor: moved})
        return losses


def stated_moment_floors(network: str, params, x, y) -> dict[str, float]:
    """What a moment's allowance adds to the update rule's, from its statement, by "fc1.weight.exp_avg"."""
    layers = verify.MLP_REACH if network == "mlp" else verify_lenet.REACH
    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    ghost = {k: torch.zeros_like(v, requires_grad=True) for k, v in p.items()}  # their gradients will be S
    a = torch.tensor(x, dtype=torch.float64)
    a = a if network == "mlp" else a.reshape(-1, 1, lenet.IMAGE, lenet.IMAGE)
    carried = torch.zeros_like(a)  # its value is 0; its gradient carries S back through |W| and the decisions
    for name, kind in layers:
        if kind in ("fc", "conv"):
            op, w, b = F.linear if kind == "fc" else F.conv2d, p[f"{name}.weight"], p[f"{name}.bias"]
            carried = op(a.detach().abs(), ghost[f"{name}.weight"], ghost[f"{name}.bias"]) + op(carried, w.detach().abs())
            a = op(a, w, b)
        elif kind == "relu":
            carried, a = carried * (a > 0), torch.relu(a)
        elif kind == "pool":
            a, where = F.max_pool2d(a, 2, return_indices=True)
            carried = carried.flatten(2).gather(2, where.flatten(2)).view_as(a)
        else:
            carried, a = carried.flatten(1), a.flatten(1)
    labels = torch.tensor(y, dtype=torch.int64)
    F.cross_entropy(a, labels).backward(retain_graph=True)
    (carried * (torch.softmax(a.detach(), dim=1) + F.one_hot(labels, a.shape[1])) / len(a)).sum().backward()
    out = {}
    for name in p:
        terms, g = ghost[name].grad.numpy(), p[name].grad.numpy()
        out[f"{name}.exp_avg"] = 32 * U * 0.1 * np.linalg.norm(terms)
        out[f"{name}.exp_avg_sq"] = 32 * U * 0.001 * np.linalg.norm(2 * np.abs(g) * terms)
    return out


ADAM_TENSORS = [pytest.param(network, name, id=f"{network}-{name}")
                for network, names in (("mlp", mlp.PARAM_NAMES), ("lenet", lenet.PARAM_NAMES))
                for param in names for name in (param, *(f"{param}.{key}" for key in MOMENTS))]


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize(("network", "tensor"), ADAM_TENSORS)
def test_each_tensors_update_and_moments_rule_with_adam(adam_start, batches, network, tensor, share):
    params, state = adam_start[network]
    record = one_adam_step(network, NudgedAdam(network, params, tensor, share), params, state, *batches)
    assert record.used[0] == pytest.approx(share, abs=0.2)  # the float32 rounding of the moved tensor, at most
    assert (record.failure is not None) == (share > 1), record.failure
    if share > 1:
        name, key = tensor.rsplit(".", 1)
        assert (f"the {key} of {name} (Adam's" if key in MOMENTS else f"the {tensor} update") in record.failure


def stated_fc2_bias_reach(params, x, y) -> tuple[np.ndarray, np.ndarray]:
    """(the gradient of the MLP's fc2.bias in float64, R: float32's reach on it, as the module's docstring says)."""
    def gamma(n):
        return n * U / (1 - n * U)

    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    x64, labels = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.int64)
    h = x64 @ p["fc1.weight"].T + p["fc1.bias"]
    z = torch.relu(h) @ p["fc2.weight"].T + p["fc2.bias"]
    F.cross_entropy(z, labels).backward()
    w1, b1, w2, b2 = (p[k].detach().abs() for k in mlp.PARAM_NAMES)
    h, z, batch = h.detach(), z.detach(), len(x)
    e_h = gamma(785) * (x64.abs() @ w1.T + b1)
    e_a = torch.where(h > -e_h, e_h, 0)
    e_z = gamma(w2.shape[1] + 1) * ((torch.relu(h) + e_a) @ w2.T + b2) + e_a @ w2.T
    probs, onehot = torch.softmax(z, dim=1), F.one_hot(labels, 10)
    e_dz = (probs * (1 - probs) * torch.expm1(2 * e_z.max(dim=1, keepdim=True).values)
            + probs * (2 * (z - z.max(dim=1, keepdim=True).values).abs() + 64) * U + 3 * U * (probs + onehot)) / batch
    dz = (probs - onehot) / batch
    reach = (gamma(batch) * (dz.abs() + e_dz) + e_dz).sum(dim=0)
    g = p["fc2.bias"].grad
    return g.numpy(), (reach + U * (g.abs() + reach)).numpy()


def stated_adam_update(m, v, t: int, lr: float):
    """Adam's update from its new moments at step t, torch.optim.Adam's defaults, in float64."""
    return lr / (1 - 0.9**t) * m / (np.sqrt(v) / np.sqrt(1 - 0.999**t) + 1e-8)


class OtherSide(AdamLevel1):
    """Level 1 with Adam, but at one element of one tensor it puts the new m on the other side of 0 (a quarter of
    its size), its v and its update as Adam makes them from that m (torch.optim.Adam's defaults, in float64)."""

    def __init__(self, params, tensor: str, index: int):
        super().__init__("mlp", params)
        self.tensor, self.index = tensor, index

    def train_epoch(self, X, y, batch_size, lr, order=None):
        before, state = self.inner.state_dict(), self.inner.optimizer_state()
        losses = self.inner.train_epoch(X, y, batch_size, lr, order)
        params, after = self.inner.state_dict(), self.inner.optimizer_state()
        i, saved, t = self.index, after[self.tensor], after[self.tensor]["step"]
        m_before, v_before = (float(state[self.tensor][key][i]) for key in MOMENTS)
        m = -float(saved["exp_avg"][i]) / 4
        g = (m - 0.9 * m_before) / 0.1
        v = 0.999 * v_before + 0.001 * g * g
        saved["exp_avg"][i], saved["exp_avg_sq"][i] = m, v
        params[self.tensor][i] = float(before[self.tensor][i]) - stated_adam_update(m, v, t, float(np.float32(lr)))
        self.inner.load_state_dict(params)
        self.inner.load_optimizer_state(after)
        return losses


@pytest.mark.parametrize("share", SHARES)
def test_the_sign_tie_rule_of_adam(adam_start, batches, share):
    """fc2.bias[k]'s m_before set so that its new m in float64 is `share` times its stated reach R_m from 0, and a
    level that puts that m on the other side of 0: a tie at 0.5 (reported with its tensor and index, the step passing),
    a failure at 1.5 that no tie explains."""
    params, state = adam_start["mlp"]
    X, y = batches
    g, reach = stated_fc2_bias_reach(params, X, y)
    k = int(np.argmax(np.abs(g)))
    state = copy.deepcopy(state)
    m_before = state["fc2.bias"]["exp_avg"]
    for _ in range(3):  # R_m counts |m_before| too: settle it
        reach_m = 0.1 * reach[k] + 4 * U * (abs(float(m_before[k])) + abs(g[k]) + reach[k])
        m_before[k] = np.float32((share * reach_m - 0.1 * g[k]) / 0.9)
    assert 0.9 * float(m_before[k]) + 0.1 * g[k] == pytest.approx(share * reach_m, rel=1e-3)
    record = one_adam_step("mlp", OtherSide(params, "fc2.bias", k), params, state, X, y)
    if share < 1:
        assert record.failure is None, record.failure
        assert [(t.tensor, t.index) for t in record.ties] == [("fc2.bias", (k,))]
    else:
        assert record.failure and "fc2.bias" in record.failure and "no Adam sign tie explains it" in record.failure
        assert not record.ties
