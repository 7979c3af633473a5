"""Adam and SGD with momentum against torch.optim, step by step: level 3's update functions and level 8's optimizers;
the optimizers' list (common/nets/optimizers.py) and the levels' contract for it; and every level that trains with Adam
in lockstep with level 1 on real digits (common/harness/verify.py's rule, with Adam's state).

The yardstick is PyTorch's own for float32 (common/harness/verify.py): the same steps in float64, from the same float32
gradients. Per tensor, a result may be at most twice as far from float64 as torch.optim's float32 result is, plus the
rounding of each value to float32 (2u |value|, u = 2^-24). Measured over the 30 steps below: level 3's Adam is 0.98 to
1.1 times as far as PyTorch's (PyTorch fuses its lerp and addcmul into fused multiply-adds on this CPU, NumPy rounds
each product: a few ulps on single elements, nothing in the norm). A missing bias correction moves the first update
by a factor of 3, and eps inside the square root moves the updates of small gradients by up to 100 times.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from common.harness import compare, verify
from common.harness.verify import U
from common.levels import LEVELS, level
from common.nets import get, optimizers
from common.nets.mlp import init_params, param_shapes
from conftest import require
from ops_stand_in import device  # noqa: F401 (a fixture: cpu, cuda, cuda over a stand-in)

STEPS = 30
LR = 1e-3


def random_run(seed: int, hidden: int = 37) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """float32 parameters and STEPS gradients for the MLP's shapes. Gradients span 1e-6 to 1 (where eps matters and
    where it does not); one parameter's gradient is exactly 0 at every step (Adam must leave it in place)."""
    rng = np.random.default_rng(seed)
    shapes = param_shapes(hidden)
    params = {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    grads = []
    for _ in range(STEPS):
        grads.append({k: (rng.standard_normal(s) * 10.0 ** rng.uniform(-6, 0, s)).astype(np.float32)
                      for k, s in shapes.items()})
        grads[-1]["fc2.bias"][3] = 0.0
    return params, grads


def torch_run(params, grads, dtype, make) -> dict[str, tuple[np.ndarray, ...]]:
    """torch.optim's run in `dtype`: each tensor's (parameter, and its optimizer state's arrays, in `make`'s keys)."""
    tensors = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in params.items()}
    optimizer, keys = make(list(tensors.values()))
    for g in grads:
        for k, t in tensors.items():
            t.grad = torch.tensor(g[k], dtype=dtype)
        optimizer.step()
    return {k: (t.detach().numpy(), *(optimizer.state[t][key].numpy() for key in keys)) for k, t in tensors.items()}


def assert_within_twice_pytorchs_error(ours, theirs, exact, what: str) -> None:
    """||ours - exact|| <= 2 ||theirs - exact|| + 2u ||exact||: PyTorch's 2x rule for float32 against float64."""
    ours, theirs, exact = (np.asarray(a, dtype=np.float64) for a in (ours, theirs, exact))
    allowed = 2 * np.linalg.norm(theirs - exact) + 2 * U * np.linalg.norm(exact)
    assert np.linalg.norm(ours - exact) <= allowed, f"{what}: {np.linalg.norm(ours - exact):.3g} from float64, " \
                                                    f"{allowed:.3g} allowed"


def adam(tensors):
    return torch.optim.Adam(tensors, lr=LR), ("exp_avg", "exp_avg_sq")


@pytest.mark.level3
def test_level3_adam_update_is_torch_optim_adams():
    from level3_numpy.mlp import adam_update

    params, grads = random_run(0)
    expected, exact = torch_run(params, grads, torch.float32, adam), torch_run(params, grads, torch.float64, adam)
    p = {k: v.copy() for k, v in params.items()}
    m, v = ({k: np.zeros_like(a) for k, a in p.items()} for _ in range(2))
    for step, g in enumerate(grads, 1):
        adam_update(p, g, m, v, step, LR)
    for k in params:
        for what, ours, theirs, exact_value in zip(("p", "exp_avg", "exp_avg_sq"), (p[k], m[k], v[k]), expected[k],
                                                   exact[k]):
            assert ours.dtype == np.float32
            assert_within_twice_pytorchs_error(ours, theirs, exact_value, f"{k} {what}")
    assert p["fc2.bias"][3] == params["fc2.bias"][3]  # g = 0 at every step: m = 0, so p stays exactly where it was


# ---- level 8's optimizers, on each backend ----



def framework_run(params, grads, device, make):
    """Level 8's optimizer over the same gradients: each tensor's parameter and state (in torch.optim's keys)."""
    import level8_framework as fw

    tensors = {k: fw.Parameter(v, device=device) for k, v in params.items()}
    optimizer, keys = make(list(tensors.values()))
    for g in grads:
        for k, t in tensors.items():
            t.grad = fw.Tensor(g[k], device=device)
        optimizer.step()
    state = optimizer.state_dict()["state"]
    return {k: (t.numpy(), *(state[i][key] for key in keys)) for i, (k, t) in enumerate(tensors.items())}


def torch_and_ours(name: str):
    """(torch.optim's optimizer and its state's keys, level 8's) for one of the rules tested below."""
    import level8_framework as fw

    rules = {"sgd": (lambda ts: (torch.optim.SGD(ts, lr=0.1), ()), lambda ps: (fw.optim.SGD(ps, lr=0.1), ())),
             "momentum": (lambda ts: (torch.optim.SGD(ts, lr=0.1, momentum=0.9), ("momentum_buffer",)),
                          lambda ps: (fw.optim.SGD(ps, lr=0.1, momentum=0.9), ("momentum_buffer",))),
             "adam": (adam, lambda ps: (fw.optim.Adam(ps, lr=LR), ("exp_avg", "exp_avg_sq")))}
    return rules[name]


@pytest.mark.level8
@pytest.mark.parametrize("rule", ["sgd", "momentum", "adam"])
def test_level8_optimizers_are_torch_optims(device, rule):
    """30 steps from the same gradients: parameters and state within PyTorch's 2x rule of float64."""
    theirs_rule, ours_rule = torch_and_ours(rule)
    params, grads = random_run(1)
    expected, exact = torch_run(params, grads, torch.float32, theirs_rule), torch_run(params, grads, torch.float64,
                                                                                      theirs_rule)
    got = framework_run(params, grads, device, ours_rule)
    for k in params:
        for i, (ours, theirs, exact_value) in enumerate(zip(got[k], expected[k], exact[k])):
            assert_within_twice_pytorchs_error(ours, theirs, exact_value, f"{k} {i}")


@pytest.mark.level8
def test_momentums_first_step_is_the_gradient_and_its_buffer_carries_over(device):
    """PyTorch's SGD: buf = g at the first step (not 0.9 * 0 + g: the same here, but by rule), then buf = 0.9 buf + g;
    three steps of a constant gradient 1 move p by lr (1 + 1.9 + 2.71)."""
    import level8_framework as fw

    p = fw.Parameter(np.zeros(3, dtype=np.float32), device=device)
    optimizer = fw.optim.SGD([p], lr=0.5, momentum=0.9)
    for _ in range(3):
        p.grad = fw.Tensor(np.ones(3), device=device)
        optimizer.step()
    np.testing.assert_allclose(p.numpy(), -0.5 * (1 + 1.9 + 2.71), rtol=1e-6)
    np.testing.assert_allclose(optimizer.state_dict()["state"][0]["momentum_buffer"], 2.71, rtol=1e-6)


@pytest.mark.level8
@pytest.mark.parametrize("rule", ["momentum", "adam"])
def test_level8_takes_torch_optims_state_and_goes_on_as_it_does(device, rule):
    """Ten steps of torch.optim, its state_dict() loaded into level 8's optimizer, the other twenty on each: the
    verifier's way of starting a step from level 1's state. Then level 8's own state_dict() round trip changes
    nothing."""
    import level8_framework as fw

    theirs_rule, ours_rule = torch_and_ours(rule)
    params, grads = random_run(2)
    first = torch_run(params, grads[:10], torch.float32, theirs_rule)
    tensors = [torch.tensor(v, requires_grad=True) for v in params.values()]
    optimizer, _ = theirs_rule(tensors)
    for g in grads[:10]:
        for t, k in zip(tensors, params):
            t.grad = torch.tensor(g[k])
        optimizer.step()
    ours_params = [fw.Parameter(first[k][0], device=device) for k in params]
    ours, _ = ours_rule(ours_params)
    ours.load_state_dict(optimizer.state_dict())
    ours.load_state_dict(ours.state_dict())  # a round trip of its own changes nothing
    for g in grads[10:]:
        for t, p, k in zip(tensors, ours_params, params):
            t.grad, p.grad = torch.tensor(g[k]), fw.Tensor(g[k], device=device)
        optimizer.step()
        ours.step()
    for t, p, k in zip(tensors, ours_params, params):
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=0, atol=1e-6, err_msg=k)  # ~ulps of lr sums
    assert ours.state_dict()["state"][0].get("step", STEPS) == STEPS


@pytest.mark.level8
def test_level8_optimizers_refuse_what_they_do_not_do(device):
    import level8_framework as fw

    p = fw.Parameter(np.zeros(3), device=device)
    with pytest.raises(ValueError, match="momentum"):
        fw.optim.SGD([p], lr=0.1, momentum=1.5)
    with pytest.raises(ValueError, match="lr"):
        fw.optim.Adam([p], lr=float("nan"))
    with pytest.raises(ValueError, match="no parameters"):
        fw.optim.SGD([], lr=0.1)
    with pytest.raises(TypeError, match="require grad"):
        fw.optim.SGD([fw.Tensor(np.zeros(3))], lr=0.1)
    torch_state = torch.optim.Adam([torch.zeros(3, requires_grad=True)], weight_decay=0.1).state_dict()
    with pytest.raises(ValueError, match="weight_decay"):
        fw.optim.Adam([p]).load_state_dict(torch_state)
    with pytest.raises(ValueError, match="shape"):
        fw.optim.SGD([p], lr=0.1, momentum=0.9).load_state_dict(
            {"state": {0: {"momentum_buffer": np.zeros(4)}}, "param_groups": [{"lr": 0.1, "momentum": 0.9,
                                                                                "params": [0]}]})


@pytest.mark.level8
def test_the_level8_mlp_trains_with_adam_as_torch_does(mnist):
    """The level's class with optimizer="adam": 12 steps of batch 16 against level 1's network with torch.optim.Adam.
    From the same start, float32 runs part by their roundings only: 1e-5 on losses of ~2, 1e-6 on the parameters."""
    from common.levels import level

    params = init_params(3, 32)
    X, y = mnist[0][:192], mnist[1][:192]
    ours = level(8).load()(params, optimizer="adam")
    losses = ours.train_epoch(X, y, 16, 1e-3)
    reference = level(1).load()(params)
    reference.optimizer = torch.optim.Adam(reference.net.parameters(), lr=1e-3)
    np.testing.assert_allclose(losses, reference.train_epoch(X, y, 16, 1e-3), rtol=0, atol=1e-5)
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(ours.state_dict()[name], value, rtol=0, atol=1e-6, err_msg=name)
    assert ours.optimizer.state_dict()["state"][0]["step"] == 12


# ---- the optimizers' list, and the levels' contract for it ----

ADAM = optimizers.get("adam")
ADAM_LEVELS = [pytest.param(n, marks=getattr(pytest.mark, f"level{n}"), id=f"level{n}") for n in ADAM.levels]


def test_the_optimizers_are_listed_once():
    """SGD at every level that trains; Adam at levels 1, 3 and 8, with torch.optim.Adam's defaults."""
    assert optimizers.SGD.levels == tuple(lv.number for lv in LEVELS if lv.trains)
    assert ADAM.levels == (1, 3, 8) and ADAM.state == ("step", "exp_avg", "exp_avg_sq")
    defaults = torch.optim.Adam([torch.zeros(1, requires_grad=True)]).defaults
    assert ADAM.hyper == {key: defaults[key] for key in ADAM.hyper}
    assert optimizers.SGD.options == {} and ADAM.options == {"optimizer": "adam"}
    with pytest.raises(KeyError, match="no optimizer 'adamw'; the optimizers are sgd, adam"):
        optimizers.get("adamw")


@pytest.mark.parametrize("number", ADAM_LEVELS)
@pytest.mark.parametrize("network", ["mlp", pytest.param("lenet", marks=pytest.mark.lenet)])
def test_a_level_says_its_optimizer_and_hands_over_its_state(number, network, mnist):
    """variant() names Adam (nothing for SGD, every level's default); optimizer_state() is {} before the first step,
    then PyTorch's names by parameter, copies; load_optimizer_state() takes another level's, which then steps on as
    that level does, and {} forgets it."""
    net = get(network)
    cls = level(number).load(net)
    params = net.network.init_params(1)
    X, y = mnist[0][:48], mnist[1][:48]
    model, sgd = cls(params, optimizer="adam"), cls(params)
    assert model.variant()["optimizer"] == "adam" and "optimizer" not in sgd.variant()
    assert model.optimizer_state() == {} and sgd.optimizer_state() == {}
    model.train_epoch(X, y, 16, 1e-3)
    state = model.optimizer_state()
    assert list(state) == list(net.network.PARAM_NAMES)
    for name, saved in state.items():
        assert saved["step"] == 3 and set(saved) == set(ADAM.state)
        assert saved["exp_avg"].shape == saved["exp_avg_sq"].shape == params[name].shape
    state["fc1.bias"]["exp_avg"][:] = 7.0
    assert not (model.optimizer_state()["fc1.bias"]["exp_avg"] == 7.0).any(), "optimizer_state() must copy"
    reference = level(1).load(net)(model.state_dict(), optimizer="adam")
    reference.load_optimizer_state(model.optimizer_state())
    model.load_optimizer_state(reference.optimizer_state())  # a round trip through level 1
    np.testing.assert_allclose(model.train_epoch(X, y, 16, 1e-3), reference.train_epoch(X, y, 16, 1e-3), rtol=1e-5)
    assert model.optimizer_state()["fc1.bias"]["step"] == 6
    model.load_optimizer_state({})
    assert model.optimizer_state() == {}


def test_level1_keeps_no_array_it_is_handed(mnist):
    """torch.optim's load_state_dict keeps the tensors it is given, and counts steps up in the step tensor itself:
    level 1 makes its own, so the state handed to it is the same after its steps."""
    model = level(1).load()(init_params(1, 16), optimizer="adam")
    model.train_epoch(mnist[0][:32], mnist[1][:32], 16, 1e-3)
    state = model.optimizer_state()
    kept = {name: {key: np.copy(value) for key, value in saved.items()} for name, saved in state.items()}
    model.load_optimizer_state(state)
    model.train_epoch(mnist[0][:32], mnist[1][:32], 16, 1e-3)
    for name, saved in state.items():
        for key, value in saved.items():
            np.testing.assert_array_equal(value, kept[name][key], err_msg=f"{name} {key}")


@pytest.mark.parametrize("number", ADAM_LEVELS)
def test_bad_optimizers_and_states_are_refused_with_the_reason(number):
    cls = level(number).load()
    params = init_params(1, 4)
    with pytest.raises(ValueError, match="optimizer must be one of \\['sgd', 'adam'\\], got 'adamw'"):
        cls(params, optimizer="adamw")
    model = cls(params, optimizer="adam")
    good = {name: {"step": 2, "exp_avg": np.zeros_like(p), "exp_avg_sq": np.ones_like(p)} for name, p in params.items()}
    model.load_optimizer_state(good)
    bad = [
        ([], TypeError, "an optimizer state is a dict"),
        ({"fc1.weight": good["fc1.weight"]}, ValueError, "an entry for every parameter"),
        ({**good, "fc2.bias": {"step": 2, "exp_avg": np.zeros(10)}}, ValueError, "fc2.bias has the keys"),
        ({**good, "fc2.bias": {**good["fc2.bias"], "exp_avg": np.zeros(9)}}, ValueError, "exp_avg of fc2.bias must be"),
        ({**good, "fc2.bias": {**good["fc2.bias"], "step": 0}}, ValueError, "step of fc2.bias must be a whole number"),
        ({**good, "fc2.bias": {**good["fc2.bias"], "step": 3}}, ValueError, "the same"),
        ({**good, "fc2.bias": {**good["fc2.bias"], "exp_avg_sq": -np.ones(10)}}, ValueError, "negative"),
        ({**good, "fc2.bias": {**good["fc2.bias"], "exp_avg": np.full(10, np.nan)}}, ValueError, "NaN"),
    ]
    for state, error, words in bad:
        with pytest.raises(error, match=words):
            model.load_optimizer_state(state)
        assert model.optimizer_state()["fc2.bias"]["step"] == 2, "a refused state must change nothing"
    with pytest.raises(ValueError, match="SGD keeps no state"):
        cls(params).load_optimizer_state(good)


# ---- every level that trains with Adam, in lockstep with level 1 (common/harness/verify.py) ----

# (level, device, float type): level 1's float64 twin (the rule's own sanity: it is closer to float64 than level 1),
# level 3, level 8 on the CPU, and on a GPU level 1 and level 8.
ADAM_IMPLEMENTATIONS = [
    pytest.param((1, "cpu", "float64"), marks=pytest.mark.level1, id="level1-float64"),
    pytest.param((1, "cuda", None), marks=[pytest.mark.level1, pytest.mark.gpu], id="level1-cuda"),
    pytest.param((3, "cpu", None), marks=pytest.mark.level3, id="level3"),
    pytest.param((8, "cpu", None), marks=pytest.mark.level8, id="level8-cpu"),
    pytest.param((8, "cuda", None), marks=[pytest.mark.level8, pytest.mark.gpu], id="level8-cuda"),
]
# Short runs on real digits, a partial last batch included: the MLP 2 epochs of 150 images (batch 16: 10 steps an
# epoch, the last of 6), from the initial weights, so that its first steps are Adam's first; LeNet-5 170 images from
# weights 30 SGD steps in.
ADAM_RUNS = [pytest.param("mlp", 150, 2, id="mlp"), pytest.param("lenet", 170, 1, marks=pytest.mark.lenet, id="lenet")]


@pytest.mark.parametrize("impl", ADAM_IMPLEMENTATIONS)
@pytest.mark.parametrize(("network", "n", "epochs"), ADAM_RUNS)
def test_adam_in_lockstep_with_level1_on_real_digits(request, mnist, impl, network, n, epochs):
    """Every step from level 1's parameters and Adam state: the loss, each parameter's update, both new moments and the
    step count, by the rule; sign ties are rare (none measured in these runs)."""
    number, where, dtype = impl
    net = get(network)
    require(level(number), where, request.config, net)
    params = net.network.init_params(4)
    if network == "lenet":
        warm = level(1).load(net)(params)
        warm.train_epoch(mnist[0][:480], mnist[1][:480], 16, 0.05)
        params = warm.state_dict()
    options = {"device": where, **({"dtype": dtype} if dtype else {})} if level(number).takes_device else {}
    model = level(number).load(net)(params, optimizer="adam", **options)
    X, y = mnist[0][:n], mnist[1][:n]
    orders = [np.random.default_rng([4, e]).permutation(n).astype(np.int32) for e in range(epochs)]
    records, diverged = verify.lockstep({"level": model}, params, X, y, orders, 16, 1e-3, network=net, optimizer=ADAM)
    record = records["level"]
    assert diverged is None and record.failure is None, record.failure
    assert len(record.used) == epochs * -(-n // 16) and max(record.used) <= 1
    assert record.names[-1] == f"{net.network.PARAM_NAMES[-1]}.exp_avg_sq"  # the moments were checked too
    assert len(record.ties) <= 2, [t.describe() for t in record.ties]


# `make compare --optimizer adam` as a user runs it, over a grid of small runs of both networks: the chapter's batch
# (5,000 images, 2 epochs: 1,250 steps of the MLP, 626 of LeNet-5; long enough for the softmax's cancellation in the
# MLP's fc2.bias and for units of LeNet-5's fc1 that wake up with a gradient near float32's reach, both of which
# Adam's rule must allow for) and batch 256 (4,096 images, 2 epochs: 32 steps).
ADAM_GRID = [
    pytest.param("mlp", 5000, 2, None, id="mlp-5000x2"),
    pytest.param("mlp", 4096, 2, 256, id="mlp-4096x2-b256"),
    pytest.param("lenet", 5000, 2, None, marks=pytest.mark.lenet, id="lenet-5000x2"),
    pytest.param("lenet", 4096, 2, 256, marks=pytest.mark.lenet, id="lenet-4096x2-b256"),
]


@pytest.mark.level3
@pytest.mark.level8
@pytest.mark.parametrize(("network", "n", "epochs", "batch"), ADAM_GRID)
def test_make_compare_with_adam_passes_a_grid_of_small_runs(tmp_path, cpu_rows, network, n, epochs, batch):
    """Levels 1, 3 and 8 on the CPU, each verified in lockstep at every step and by its free run, Adam's state with
    them: every row passes, within its allowances."""
    args = ["--model", network, "--levels", "1,3,8", "--optimizer", "adam", "--train-size", str(n), "--epochs",
            str(epochs), *(["--batch", str(batch)] if batch else []), "--out", str(tmp_path), "--quiet"]
    assert compare.main(args) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["table"]
    assert [row["level"] for row in rows] == ["level1[cpu]", "level3[cpu]", "level8[cpu]"]
    for row in rows[1:]:
        assert row["ran"]["optimizer"] == "adam" and row["failure"] is None, row
        assert row["lockstep_used"] <= 1 and row["free_run_used"] <= 1, row
