"""Every level against level 1, the gold standard: one suite, parametrized over the list in common/levels.py.

Run one chapter with `pytest -m level4`. GPU implementations skip with the reason where there is
no GPU; `make test-gpu` (pytest --require-gpu) turns those skips into failures. A level with variants (level 5's
three matrix products, common/nets' list) is tested in each, as the harness runs each.
"""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from common.classroom import sandbox
from common.harness import compare, parallel, verify
from common.harness.compare import epoch_order
from common.levels import ROOT, THE_MLP, level, missing
from common.native import ffi
from common.nets.mlp import PARAM_NAMES, init_params
from conftest import (
    ALL,
    IMPLEMENTATIONS,
    OWN_KERNELS,
    each_variant,
    implementation_params,
    reference,
    require,
    sanitize,
    train,
    twin,
    variant_id,
)

# Against level 1's own runs: every implementation but level 1 on the CPU itself, in each of its variants.
chapter_against_level1 = pytest.mark.parametrize("impl", implementation_params(each_variant(IMPLEMENTATIONS)))
# The same, and each a check of the level's row in the lab's grade (common/classroom/lab.py): all but the chapter's long runs.
against_level1 = pytest.mark.parametrize("impl", implementation_params(each_variant(IMPLEMENTATIONS), graded=True))
# Against torch autograd written from scratch, or against itself: every implementation, level 1 included.
every_level = pytest.mark.parametrize("impl", implementation_params(each_variant(ALL), graded=True))

# The chapter's run: the first 10,000 training images (all of them offline), batch 8, lr 0.01, 10 epochs.
CHAPTER = {"epochs": 10, "batch": 8, "lr": 0.01}
CHAPTER_IMAGES = 10_000
# One batch: logits and gradients differ from PyTorch only by float32 summation order, ~1e-7
# relative over sums of 784 terms; measured below 2e-6. A bug is off by O(1) of the value.
GRAD_ATOL = 1e-5


def in_lockstep(factory, params, X, y, epochs: int, batch: int, lr: float, shuffle: bool = False):
    """The harness's lockstep check (common/harness/verify.py) of a fresh model over every step of the run; its record."""
    orders = [epoch_order(len(X), e, 0, shuffle) for e in range(epochs)]
    records, reference_diverged = verify.lockstep({"level": factory(params)}, params, X, y, orders, batch, lr)
    assert reference_diverged is None, reference_diverged
    record = records["level"]
    assert record.failure is None, record.failure
    assert len(record.used) == sum(-(-len(o) // batch) for o in orders)  # every step was checked
    return record


def free_run(model, X, y, X_test, y_test, epochs, batch, lr, shuffle=False):
    """A free run: its losses, test predictions and test accuracy."""
    losses = train(model, X, y, epochs, batch, lr, shuffle)
    predictions = model.forward(X_test).argmax(axis=1)
    return losses, predictions, float((predictions == y_test).mean())


def reference_free_run(params, X, y, X_test, y_test, epochs, batch, lr, shuffle=False):
    """Level 1's free run (losses, test accuracy) and float32's noise on it, measured by its float64 twin."""
    losses, predictions, accuracy = free_run(reference(params), X, y, X_test, y_test, epochs, batch, lr, shuffle)
    twin_losses, twin_predictions, _ = free_run(twin(params), X, y, X_test, y_test, epochs, batch, lr, shuffle)
    return losses, accuracy, verify.free_run_noise(losses, twin_losses, predictions, twin_predictions, epochs)


def assert_free_run_agrees(run, expected, n_test: int, epochs: int) -> None:
    """The harness's free-run check: per-epoch means and test accuracy within float32 noise measured by the twin."""
    (losses, _, accuracy), (expected_losses, expected_accuracy, noise) = run, expected
    assert losses.dtype == np.float32
    verdict = verify.check_free_run(losses, expected_losses, accuracy, expected_accuracy, n_test, noise, epochs)
    assert verdict.failure is None, verdict.failure


@pytest.fixture(scope="module")
def chapter_reference(mnist):
    """Level 1's free run of the chapter, and float32's noise on it (its float64 twin), computed once for all levels."""
    X, y, X_test, y_test = mnist[0][:CHAPTER_IMAGES], mnist[1][:CHAPTER_IMAGES], mnist[2], mnist[3]
    return reference_free_run(init_params(0), X, y, X_test, y_test, **CHAPTER)


@pytest.fixture(scope="module")
def chapter_lockstep(mnist, request):
    """Every implementation this session tests (`-m gpu`: the GPU's alone), in lockstep with level 1 over the
    chapter's steps, all at once, the steps split over processes (common/harness/parallel.py): level 1 and the float64
    step once for them all. Each test reads its record by its id."""
    selected = {item.callspec.id for item in request.session.items
                if item.originalname == test_chapter_run_in_lockstep_with_level1.__name__}
    runnable = [(lv, device, options) for lv, device, options in each_variant(IMPLEMENTATIONS)
                if not missing(lv, device) and variant_id(lv, device, options) in selected]
    factories = {variant_id(lv, device, options): compare.factory(lv, device, THE_MLP, **options)
                 for lv, device, options in runnable}
    orders = [epoch_order(len(mnist[0][:CHAPTER_IMAGES]), e, 0, False) for e in range(CHAPTER["epochs"])]
    records, diverged, _ = parallel.lockstep(factories, init_params(0), compare.TrainingData(CHAPTER_IMAGES, False),
                                             orders, CHAPTER["batch"], CHAPTER["lr"], max(2, os.cpu_count() // 2),
                                             THE_MLP)
    assert diverged is None, diverged
    return records, sum(-(-len(o) // CHAPTER["batch"]) for o in orders)


# With pytest-xdist (make test-gpu), one worker runs every lockstep (they share one fixture) and one every free run
# (they share level 1's): two workers, side by side, each computing what its runs share once.
lockstep_group = pytest.mark.xdist_group("chapter-lockstep")
free_run_group = pytest.mark.xdist_group("chapter-free-run")


@chapter_against_level1
@lockstep_group
def test_chapter_run_in_lockstep_with_level1(impl, factory, mnist, request):
    """Every one of the chapter's 12,500 steps, from level 1's parameters: its loss and each tensor's update."""
    if sandbox.submission():  # a submission's models are made by its sandboxed worker: in this process
        X, y = mnist[0][:CHAPTER_IMAGES], mnist[1][:CHAPTER_IMAGES]
        record = in_lockstep(factory, init_params(0), X, y, **CHAPTER)
    else:
        records, steps = request.getfixturevalue("chapter_lockstep")
        record = records[request.node.callspec.id]
        assert record.failure is None, record.failure
        assert len(record.used) == steps  # every step was checked
    assert len(record.ties) <= 10, f"{len(record.ties)} ReLU ties: ties are rare (3 in 12,500 steps measured)"


@chapter_against_level1
@free_run_group
def test_chapter_free_run_agrees_within_float32_noise(factory, mnist, chapter_reference):
    X, y, X_test, y_test = mnist[0][:CHAPTER_IMAGES], mnist[1][:CHAPTER_IMAGES], mnist[2], mnist[3]
    run = free_run(factory(init_params(0)), X, y, X_test, y_test, **CHAPTER)
    assert_free_run_agrees(run, chapter_reference, len(y_test), CHAPTER["epochs"])


@against_level1
# Odd sizes are where indexing bugs hide: hidden 1 and 37, batch 1 and 13, N not a multiple of the
# batch (a final partial step), a shuffled order, and a wide hidden layer.
@pytest.mark.parametrize(
    "hidden, batch, n, epochs",
    [(37, 13, 200, 3), (1, 1, 40, 2), (256, 8, 101, 2), (5, 64, 300, 2), (1024, 32, 96, 1), (1024, 64, 300, 1)],
    ids=["h37-b13", "h1-b1", "h256-b8-partial", "h5-b64", "h1024-b32", "h1024-b64-partial"],
)
def test_odd_sizes_match_level1(factory, mnist, hidden, batch, n, epochs):
    X, y, X_test, y_test = mnist[0][:n], mnist[1][:n], mnist[2], mnist[3]
    params = init_params(1, hidden)
    in_lockstep(factory, params, X, y, epochs, batch, lr=0.05, shuffle=True)
    expected = reference_free_run(params, X, y, X_test, y_test, epochs, batch, 0.05, shuffle=True)
    run = free_run(factory(params), X, y, X_test, y_test, epochs, batch, 0.05, shuffle=True)
    assert_free_run_agrees(run, expected, len(y_test), epochs)


def trained_params(hidden: int, mnist) -> dict[str, np.ndarray]:
    """Parameters after a little training, so that biases and activations are not at their initial zeros."""
    model = reference(init_params(2, hidden))
    model.train_epoch(mnist[0][:64], mnist[1][:64], 8, 0.1)
    return model.state_dict()


def torch_loss_and_grads(params, X, y):
    """The same batch through torch autograd, from scratch (no level code involved)."""
    p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    h = torch.from_numpy(X) @ p["fc1.weight"].T + p["fc1.bias"]
    logits = torch.relu(h) @ p["fc2.weight"].T + p["fc2.bias"]
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y).long())
    loss.backward()
    return loss.item(), {k: v.grad.numpy() for k, v in p.items()}, logits.detach().numpy()


@against_level1
@pytest.mark.parametrize("hidden, batch", [(256, 16), (37, 13)])
def test_every_layer_matches_float64_from_its_own_inputs(factory, mnist, hidden, batch):
    """Per layer (common/harness/verify.py): each layer's output and each gradient, from the level's own inputs to that layer,
    against float64, with level 1's layers as the yardstick; a ReLU exactly."""
    params = reference(init_params(2, hidden)).state_dict()
    X, y = mnist[0][:batch], mnist[1][:batch]
    shares, failure = verify.mlp_per_layer(factory(params).layers(X, y), reference(params).layers(X, y), params, X, y)
    assert failure is None, failure
    assert set(shares) == {"fc1", "relu1", "fc2", "drelu1", "dfc2", "dloss"} and max(shares.values()) <= 1


@every_level
def test_forward_of_more_rows_than_one_native_chunk(factory, mnist):
    """forward() of 2,500 rows: the native levels work through them 1,024 at a time (FORWARD_CHUNK), so every chunk
    after the first must read its own rows. Not left to the test set's size, which is 1,000 on the offline subset."""
    params = trained_params(37, mnist)
    X = mnist[0][:2500]
    np.testing.assert_allclose(factory(params).forward(X), reference(params).forward(X), rtol=0, atol=GRAD_ATOL * 10)


@every_level
@pytest.mark.parametrize("hidden, batch", [(256, 8), (37, 13), (1, 1)])
def test_loss_grads_and_logits_match_autograd(factory, mnist, hidden, batch):
    params = trained_params(hidden, mnist)
    X, y = mnist[0][100 : 100 + batch], mnist[1][100 : 100 + batch]
    model = factory(params)
    loss, grads = model.loss_and_grads(X, y)
    expected_loss, expected_grads, expected_logits = torch_loss_and_grads(params, X, y)
    assert abs(loss - expected_loss) <= GRAD_ATOL
    assert set(grads) == set(PARAM_NAMES)
    for name in PARAM_NAMES:
        assert grads[name].shape == params[name].shape and grads[name].dtype == np.float32, name
        np.testing.assert_allclose(grads[name], expected_grads[name], rtol=0, atol=GRAD_ATOL, err_msg=name)
    np.testing.assert_allclose(model.forward(X), expected_logits, rtol=0, atol=GRAD_ATOL * 10)
    for name, value in model.state_dict().items():  # loss_and_grads must not update
        np.testing.assert_array_equal(value, params[name], err_msg=name)


@every_level
def test_training_steps_match_autograd_and_sgd_from_scratch(factory, mnist):
    """Level 1 is checked too: 12 steps of its train_epoch against autograd and p -= lr * grad written out here."""
    params = trained_params(37, mnist)
    X, y = mnist[0][:93], mnist[1][:93]  # 93 = 7 x 13 + 2: the last step is a batch of 2
    losses = factory(params).train_epoch(X, y, 13, 0.1)
    expected = []
    for start in range(0, len(X), 13):
        loss, grads, _ = torch_loss_and_grads(params, X[start : start + 13], y[start : start + 13])
        params = {k: v - np.float32(0.1) * grads[k] for k, v in params.items()}
        expected.append(loss)
    np.testing.assert_allclose(losses, expected, rtol=0, atol=GRAD_ATOL)


@every_level
def test_large_logits_stay_finite(factory, mnist):
    """Logits in the thousands: exp() overflows unless the row max is subtracted first.

    Built so on any digits: fc2 is scaled until each row's logits span 2,000, and every label is the row's
    least likely class, so each row's loss is about 2,000 (exp(2000) overflows float32 and float64 alike).
    """
    params = trained_params(16, mnist)
    X = mnist[0][:8]
    _, _, logits = torch_loss_and_grads(params, X, np.zeros(8, dtype=np.int64))
    scale = np.float32(2000 / (logits.max(axis=1) - logits.min(axis=1)).min())
    params["fc2.weight"], params["fc2.bias"] = params["fc2.weight"] * scale, params["fc2.bias"] * scale
    y = logits.argmin(axis=1)
    loss, grads = factory(params).loss_and_grads(X, y)
    expected_loss, expected_grads, _ = torch_loss_and_grads(params, X, y)
    assert np.isfinite(loss) and expected_loss > 1000
    assert abs(loss - expected_loss) <= 1e-6 * expected_loss
    for name in PARAM_NAMES:
        scale = np.abs(expected_grads[name]).max()
        np.testing.assert_allclose(grads[name], expected_grads[name], rtol=0, atol=1e-5 * scale, err_msg=name)


@every_level
def test_relu_gradient_at_exactly_zero_is_zero(factory):
    """PyTorch's ReLU has slope 0 at h == 0. Zero pixels and zero biases make every h exactly 0: no gradient reaches fc1."""
    params = init_params(6, 16)
    X = np.zeros((4, 784), dtype=np.float32)
    _, grads = factory(params).loss_and_grads(X, np.arange(4))
    assert not grads["fc1.weight"].any() and not grads["fc1.bias"].any()
    assert grads["fc2.bias"].any()  # the output layer still learns


@every_level
def test_relu_gradient_at_exactly_zero_is_zero_in_training(factory):
    """The same rule inside train_epoch, which level 7 runs in its own fused kernel: fc1 must not move."""
    params = init_params(6, 16)
    model = factory(params)
    model.train_epoch(np.zeros((16, 784), dtype=np.float32), np.arange(16) % 10, 8, 0.5)
    after = model.state_dict()
    assert all(np.array_equal(after[name], params[name]) for name in ("fc1.weight", "fc1.bias"))
    assert not np.array_equal(after["fc2.bias"], params["fc2.bias"])


@every_level
def test_runs_are_bit_identical(factory, mnist):
    """No atomics, no races, no uninitialized memory: the same run twice gives the very same bits."""
    X, y = mnist[0][:500], mnist[1][:500]
    first = train(factory(init_params(3, 64)), X, y, 2, 16, 0.05, shuffle=True)
    second = train(factory(init_params(3, 64)), X, y, 2, 16, 0.05, shuffle=True)
    np.testing.assert_array_equal(first, second)


@every_level
def test_state_dict_is_a_copy_in_pytorch_layout(factory):
    params = init_params(4, 37)
    model = factory(params)
    state = model.state_dict()
    for name in PARAM_NAMES:
        assert state[name].dtype == np.float32 and state[name].flags.c_contiguous
        np.testing.assert_array_equal(state[name], params[name])
    state["fc1.weight"][:] = 0
    params["fc1.weight"][:] = 0  # neither the input nor the output may alias the model's memory
    assert np.abs(model.state_dict()["fc1.weight"]).sum() > 0


@against_level1
def test_data_changed_in_place_is_seen(factory, mnist):
    """A writeable data set is re-read every epoch: mutating it between epochs must change the result."""
    X = np.array(mnist[0][:64])
    y = np.array(mnist[1][:64])
    model = factory(init_params(5, 16))
    model.train_epoch(X, y, 8, 0.1)
    X[:] = 0
    losses = model.train_epoch(X, y, 8, 0.0)
    expected = reference(model.state_dict()).train_epoch(X, y, 8, 0.0)
    # lr 0: the same parameters at every step, so only one forward pass's rounding (the lockstep loss rule)
    np.testing.assert_allclose(losses, expected, rtol=verify.LOSS_RTOL, atol=verify.LOSS_ATOL)


# Level 7's race stress: (MLP_FUSED_EXCHANGE, MLP_FUSED_UNITS, hidden, batch) giving one cluster of 16 blocks; a grid
# of 32 blocks, its batch one tile kept for the step; the same grid streaming a batch through shared memory in tiles;
# and a grid of 64 blocks with two barriers per step, streaming.
STRESS = [("cluster", "", 256, 8), ("grid", "", 256, 8), ("grid", "", 256, 40), ("grid", "4", 256, 128)]


@pytest.mark.parametrize("impl", implementation_params([(level(7), "cuda")], graded=True))
@pytest.mark.parametrize("exchange, units, hidden, batch", STRESS)
def test_level7_exchange_holds_when_blocks_run_apart(factory, mnist, monkeypatch, exchange, units, hidden, batch):
    """A race in what blocks hand each other (a block overwriting shares another still reads), or in the tiles of x (a
    copy landing in a slot the block still multiplies), may never show at full speed. The stress build (make build/level7_stress.so) pauses each
    block for a different time at every step, now and then for long, so that blocks run apart: its runs must still be
    the level's own, bit for bit, and in lockstep with level 1."""
    if sandbox.submission():
        pytest.skip("the stress build is made from the repository's own source, not a submission's")
    for name, value in (("EXCHANGE", exchange), ("UNITS", units)):
        monkeypatch.setenv(f"MLP_FUSED_{name}", value)
    subprocess.run(["make", "-s", "build/level7_stress.so", f"PYTHON={sys.executable}"], cwd=ROOT, check=True)
    stressed = type("StressedMLP", (factory,), {"lib": ffi.dlopen(str(ROOT / "build" / "level7_stress.so"))})
    params = init_params(6, hidden)
    plan = factory(params).plan(batch)
    assert plan.startswith(f"fused: a {exchange}"), plan
    X, y = mnist[0][:4000], mnist[1][:4000]
    model, expected = stressed(params), factory(params)
    np.testing.assert_array_equal(train(model, X, y, 1, batch, 0.05, True), train(expected, X, y, 1, batch, 0.05, True))
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, expected.state_dict()[name])
    in_lockstep(stressed, params, X[:400], y[:400], 1, batch, lr=0.05)


# What the sanitizer runs below drive: partial batches (31 = 2 x 13 + 5, 20 = 2 x 8 + 4, 72 = 64 + 8, and batch 1),
# a forward pass across FORWARD_CHUNK (1,030 = 1,024 + 6 rows) at the narrow layers, odd hidden sizes: wherever a
# kernel's bounds check matters. The chapter's layer (hidden 256, batch 8) and the wide one (hidden 1024, batch 64:
# level 7's grid, streaming its rows) take a step and a half and a short forward. A run takes three steps at most: a
# later step would launch the same kernels at the same shapes as one of them, and the sanitizer pays for every launch
# (racecheck for every shared-memory access). Each run is a test of its own, and tests run side by side.
SANITIZER_RUNS = {"h37-b13": (37, 13, 31, 1030), "h1-b1": (1, 1, 3, 1030), "h256-b8": (256, 8, 20, 70),
                  "h1024-b64": (1024, 64, 72, 70)}  # (hidden, batch, rows trained, rows forward)
MEMCHECK_SCRIPT = """
import numpy as np, {package}
from common.nets.mlp import init_params
rng = np.random.default_rng(0)
X = rng.standard_normal((1030, 784)).astype(np.float32)
y = rng.integers(0, 10, 1030)
hidden, batch, rows, forward = {run}
model = {package}.MLP(init_params(0, hidden){options})
model.train_epoch(X[:rows], y[:rows], batch, 0.1)
model.forward(X[:forward])
model.loss_and_grads(X[:13], y[:13])
"""


@pytest.mark.parametrize("impl", implementation_params(each_variant(OWN_KERNELS)))
@pytest.mark.parametrize("run", SANITIZER_RUNS.values(), ids=SANITIZER_RUNS.keys())
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_kernels_are_clean_under_compute_sanitizer(impl, factory, tool, run):
    """An out-of-bounds access, a shared-memory race or a misused barrier need not change a single loss;
    compute-sanitizer's memcheck, racecheck and synccheck see them."""
    lv, _, options = impl
    sanitize(tool, MEMCHECK_SCRIPT.format(package=lv.package, run=run,
                                          options="".join(f", {k}={v!r}" for k, v in options.items())))


# ---- the matrix products: each level's own, and level 5's three kernels ----

GPU5 = [pytest.mark.level5, pytest.mark.gpu]


@pytest.mark.parametrize("number, device, default, other, refusal", [
    pytest.param(4, "cpu", "loops", "tiled", "level 4's matrix product is its loops", marks=pytest.mark.level4,
                 id="level4"),
    pytest.param(5, "cuda", "naive", "cublas", "level 5's matrix products are naive, tiled and blocked", marks=GPU5,
                 id="level5"),
    pytest.param(6, "cuda", "cublas", "naive", "levels 6 and 7 compute their matrix products with cuBLAS",
                 marks=[pytest.mark.level6, pytest.mark.gpu], id="level6"),
    pytest.param(7, "cuda", "cublas", "blocked", "levels 6 and 7 compute their matrix products with cuBLAS",
                 marks=[pytest.mark.level7, pytest.mark.gpu], id="level7"),
])
def test_each_level_reports_its_matrix_product_and_refuses_another(request, number, device, default, other, refusal):
    """The default is read back from the library; a product the level has not is refused there, naming its own, and
    one no level has is refused in Python first."""
    require(level(number), device, request.config)
    cls = level(number).load()
    params = init_params(0, 16)
    assert cls(params).matmul == default and cls(params, matmul=default).variant()["matmul"] == default
    with pytest.raises(ValueError, match=refusal):
        cls(params, matmul=other)
    with pytest.raises(ValueError, match="matmul must be one of"):
        cls(params, matmul="strassen")


# Every (level, matrix product) the network list names, as the harness builds it.
HARNESS_MATMULS = [pytest.param(number, matmul, marks=[getattr(pytest.mark, f"level{number}"), pytest.mark.gpu],
                                id=f"level{number}-{matmul}")
                   for number, matmuls in THE_MLP.matmuls for matmul in matmuls]


@pytest.mark.parametrize("number, matmul", HARNESS_MATMULS)
def test_the_harness_builds_each_variant_it_names(request, number, matmul):
    """compare.factory hands the option to the level, and the model it builds reports (read back from its library)
    the matrix product its row is named for; a copy and a pickle keep it."""
    require(level(number), "cuda", request.config)
    model = compare.factory(level(number), "cuda", THE_MLP, matmul=matmul)(init_params(0, 37))
    assert model.variant() == {"device": "cuda", "matmul": matmul}
    assert copy.deepcopy(model).matmul == matmul and pickle.loads(pickle.dumps(model)).matmul == matmul


@pytest.mark.gpu
@pytest.mark.level5
@pytest.mark.parametrize("hidden, batch", [(37, 13), (1, 1), (256, 8), (100, 70), (1024, 64)])
def test_level5s_three_kernels_give_the_same_bits(request, mnist, hidden, batch):
    """Kernels 2 and 3 add each output's terms in kernel 1's order, one after another along the sum (past a tile's
    edge only zeros times zeros, which add nothing), so every layer, gradient, loss and update is kernel 1's to the
    bit. A kernel that drops a term, adds one twice or reads a tile before it is whole cannot be. Sizes that cut
    tiles of 16 and 64 at every edge: hidden 37 and 100, batch 13 and 70, and 784 inputs (49 tiles of 16, 12.25 of 64)."""
    require(level(5), "cuda", request.config)
    params = trained_params(hidden, mnist)
    X, y = mnist[0][: 3 * batch + 2], mnist[1][: 3 * batch + 2]  # three steps, then a partial one of 2 rows
    runs = {}
    for matmul in ("naive", "tiled", "blocked"):
        model = level(5).load()(params, matmul=matmul)
        outputs, grads = model.layers(X[:batch], y[:batch])
        loss, gradients = model.loss_and_grads(X[:batch], y[:batch])
        losses = model.train_epoch(X, y, batch, 0.05)
        runs[matmul] = {**{f"layer {k}": v for k, v in outputs.items()}, **{f"d{k}": v for k, v in grads.items()},
                        "loss": np.float32(loss), **{f"grad {k}": v for k, v in gradients.items()}, "losses": losses,
                        **{f"trained {k}": v for k, v in model.state_dict().items()},
                        "forward": model.forward(mnist[0][:1030])}  # across FORWARD_CHUNK
    for matmul in ("tiled", "blocked"):
        for name, value in runs["naive"].items():
            np.testing.assert_array_equal(runs[matmul][name], value, err_msg=f"{matmul}: {name}")


# The kernels of each product, by name as the profiler reports them.
MATMUL_KERNELS = {"naive": {"linear_forward_kernel", "linear_backward_dw_kernel", "linear_backward_dx_kernel"},
                  "tiled": {"matmul_tiled_kernel"}, "blocked": {"matmul_blocked_kernel"}}


@pytest.mark.gpu
@pytest.mark.level5
def test_level5s_matmul_is_the_kernel_that_runs(request, mnist):
    """The three kernels give the same bits (above), so a row is told apart by what it launches: the profiler sees a
    product's own kernels in an epoch, and none of the others'."""
    require(level(5), "cuda", request.config)
    from torch.profiler import ProfilerActivity, profile

    X, y = mnist[0][:16], mnist[1][:16]
    everything = set().union(*MATMUL_KERNELS.values())
    for matmul, own in MATMUL_KERNELS.items():
        model = level(5).load()(init_params(0, 37), matmul=matmul)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.train_epoch(X, y, 8, 0.05)
        launched = {e.name.split("(")[0].removeprefix("void ") for e in prof.events() if e.device_type.name == "CUDA"}
        assert own <= launched and not (everything - own) & launched, f"{matmul}: {sorted(launched)}"
