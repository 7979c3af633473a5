"""What exists only on a GPU: level 7's two ways of running an epoch, and the peers of the benchmark.

Both are verified like every level (lockstep at every step, then the free run); they skip, with the reason,
where there is no GPU, and `make test-gpu` (pytest --require-gpu) turns those skips into failures.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from common.levels import THE_MLP, level
from common.nets.mlp import init_params
from conftest import implementation_params, require
from test_levels import (
    assert_free_run_agrees,
    free_run,
    in_lockstep,
    reference_free_run,
)

LEVEL7 = implementation_params([(level(7), "cuda")])


@pytest.fixture(params=["torch-eager", "torch-graph", "torch-compile", "jax-scan"])
def peer(request):
    """A peer's factory (level1_pytorch/peers.py); JAX's skips where JAX is not installed (it is optional)."""
    require(level(1), "cuda", request.config)
    from level1_pytorch.peers import missing, peers

    if why := missing(request.param):
        pytest.skip(why)
    return peers(THE_MLP)[request.param]


@pytest.mark.level1
@pytest.mark.gpu
def test_pytorch_peers_are_level1_step_for_step(peer, mnist):
    """The yardsticks of the benchmark compute what level 1 computes: 200 images, batch 13 (a partial last batch)."""
    X, y, X_test, y_test = mnist[0][:200], mnist[1][:200], mnist[2], mnist[3]
    params = init_params(1, 64)
    in_lockstep(peer, params, X, y, 2, 13, lr=0.05, shuffle=True)
    expected = reference_free_run(params, X, y, X_test, y_test, 2, 13, 0.05, shuffle=True)
    assert_free_run_agrees(free_run(peer(params), X, y, X_test, y_test, 2, 13, 0.05, shuffle=True), expected,
                           len(y_test), 2)


@pytest.mark.parametrize("impl", LEVEL7)
@pytest.mark.parametrize("hidden, batch, words", [
    (256, 8, "fused: a cluster of 16 blocks x 16 units, one barrier per step"),
    (1024, 256, "fused: a grid of 128 blocks x 8 units, two barriers per step")])
def test_level7_fuses_the_chapter_and_the_large_setting(factory, hidden, batch, words):
    assert factory(init_params(0, hidden)).plan(batch).startswith(words)


@pytest.mark.parametrize("impl", LEVEL7)
def test_level7_falls_back_with_a_warning_where_the_units_do_not_fit(factory, mnist):
    """hidden 4,000 needs more than 16 units per block: level 6's kernels run the epoch, correctly, and say so."""
    X, y = mnist[0][:64], mnist[1][:64]
    params = init_params(0, 4000)
    model = factory(params)
    assert "not fused" in model.plan(8)
    with pytest.warns(RuntimeWarning, match="level 6's queued kernels"):
        model.train_epoch(X, y, 8, 0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per batch size, not every epoch
        model.train_epoch(X, y, 8, 0.01)
    in_lockstep(factory, params, X, y, 1, 8, lr=0.01)


@pytest.mark.parametrize("impl", LEVEL7)
def test_level7_models_of_other_batch_sizes_take_turns(factory, mnist):
    """Each model keeps its plan, but a kernel's shared memory allowance belongs to the GPU: a model planned for
    batch 256 must still launch after another model has planned the same kernel for batch 64 (less memory)."""
    X, y = mnist[0][:1024], mnist[1][:1024]
    params = init_params(0, 1024)
    expected = factory(params).train_epoch(X, y, 256, 0.05)
    large = factory(params)
    assert large.plan(256).startswith("fused: a grid of 128 blocks x 8 units")
    assert factory(params).plan(64).startswith("fused: a grid of 128 blocks x 8 units")  # the same kernel, less memory
    np.testing.assert_array_equal(large.train_epoch(X, y, 256, 0.05), expected)


@pytest.mark.parametrize("impl", LEVEL7)
def test_level7_passes_lockstep_whatever_its_knobs(factory, mnist, monkeypatch):
    """The knobs change which block owns which unit (MLP_FUSED_UNITS) and how the shares travel (MLP_FUSED_EXCHANGE),
    and so the order of the sums: another order rounds differently, but every choice must pass lockstep, at a batch
    kept whole in shared memory (8) and at one streamed through it in tiles (40, with a partial last batch)."""
    X, y = mnist[0][:200], mnist[1][:200]
    for units in ("4", "8", "16"):
        for exchange in ("cluster", "grid"):
            monkeypatch.setenv("MLP_FUSED_UNITS", units)
            monkeypatch.setenv("MLP_FUSED_EXCHANGE", exchange)
            for batch in (8, 40):
                assert factory(init_params(3, 64)).plan(batch).startswith("fused")
                in_lockstep(factory, init_params(3, 64), X[:96] if batch == 8 else X, y[:96] if batch == 8 else y, 1,
                            batch, lr=0.05)
    assert np.isfinite(factory(init_params(3, 64)).train_epoch(X, y, 8, 0.05)).all()


@pytest.mark.level5
@pytest.mark.level6
@pytest.mark.gpu
def test_the_kernels_script_checks_then_times_every_kernel_on_every_product(request):
    """common/harness/matmul_kernels.py at odd sizes (batch 13, hidden 37: every tile cut at an edge): each kernel's
    result within float32's bound of the float64 product, then a time per launch, the step's total its products'."""
    require(level(5), "cuda", request.config)
    require(level(6), "cuda", request.config)
    from common.harness import matmul_kernels as mk

    (record,) = mk.run(sizes=((13, 37),), launches=3, repeats=4, quiet=True)
    assert [p["product"] for p in record["products"]] == [p.name for p in mk.step_products(37)]
    for product in record["products"]:
        assert list(product["kernels"]) == mk.KERNELS
        for kernel, timing in product["kernels"].items():
            assert timing["error_share"] <= 1 and 0 < timing["us_range"][0] <= timing["us"], (product, kernel)
    for kernel in mk.KERNELS:
        total = sum(p["kernels"][kernel]["us"] for p in record["products"])
        assert record["step"][kernel]["us"] == pytest.approx(total)
