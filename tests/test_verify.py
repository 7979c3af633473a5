"""The verifier itself (common/harness/verify.py): what it must catch, what it must let through, and what it reports.

Each test builds the situation on purpose - a learning rate 0.2% off, a ReLU tie, a mismatch that is not a
tie, a free run outside float32 noise, a divergence - on real MNIST digits, and checks the verdict.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.harness import compare, verify
from common.nets.mlp import init_params
from conftest import reference

pytestmark = pytest.mark.harness


class Perturbed:
    """Level 3 with something added after each step: the learning rate scaled, or a change to one fc1 row."""

    def __init__(self, params, lr_scale: float = 1.0, unit: int | None = None, row: int = 0):
        from level3_numpy import MLP

        self.inner, self.lr_scale, self.unit, self.row = MLP(params), lr_scale, unit, row

    def load_state_dict(self, params):
        self.inner.load_state_dict(params)

    def state_dict(self):
        return self.inner.state_dict()

    def train_epoch(self, X, y, batch_size, lr, order=None):
        before = self.inner.state_dict()
        losses = self.inner.train_epoch(X, y, batch_size, lr * self.lr_scale, order)
        if self.unit is not None:  # what a flipped ReLU of (row, unit) would add to the update
            exact = verify.exact_step(before, X[order], y[order], lr)
            move = lr * exact.da[self.row, self.unit] * np.append(exact.x[self.row], 1.0)
            state = self.inner.state_dict()
            sign = 1.0 if exact.h[self.row, self.unit] > 0 else -1.0  # passing -> blocked, or blocked -> passing
            state["fc1.weight"][self.unit] += np.float32(sign) * move[:-1].astype(np.float32)
            state["fc1.bias"][self.unit] += np.float32(sign * move[-1])
            self.inner.load_state_dict(state)
        return losses


def one_step(model, params, X, y, lr: float = 0.05):
    """Lockstep over one batch of all of X; the model's record."""
    records, diverged = verify.lockstep({"model": model}, params, X, y, [np.arange(len(X), dtype=np.int32)], len(X), lr)
    assert diverged is None
    return records["model"]


@pytest.fixture(scope="module")
def digits(mnist):
    return mnist[0][:8], mnist[1][:8]


def trained(hidden: int, mnist) -> dict:
    model = reference(init_params(2, hidden))
    model.train_epoch(mnist[0][:64], mnist[1][:64], 8, 0.1)
    return model.state_dict()


def test_a_correct_level_passes_with_room(mnist, digits):
    params = trained(16, mnist)
    record = one_step(Perturbed(params), params, *digits)
    assert record.failure is None and not record.ties and record.used[0] < 0.9


@pytest.mark.parametrize("scale", [1.002, 0.998])
def test_a_learning_rate_off_by_0_2_percent_fails(mnist, digits, scale):
    params = trained(16, mnist)
    record = one_step(Perturbed(params, lr_scale=scale), params, *digits)
    assert record.failure and "update" in record.failure


def tie_params(mnist, digits, unit: int):
    """Trained parameters with fc1.bias[unit] set so that image 0's exact pre-activation of that unit is a quarter of
    float32's reach of 0: a tie for the verifier, yet far enough from 0 that level 3's own float32 sum keeps the
    exact sign (the reach is a worst case, far above the error of an actual sum). At exactly 0, level 3 itself would
    flip the unit on some digits and not on others, and each test would depend on which digits this machine has."""
    params = trained(16, mnist)
    x = digits[0][0].astype(np.float64)
    dot = params["fc1.weight"][unit].astype(np.float64) @ x
    params["fc1.bias"][unit] = np.float32(-dot)
    reach = verify.exact_step(params, *digits, 0.05).bound(0, unit)
    params["fc1.bias"][unit] = np.float32(-dot + reach / 4)
    return params


def test_a_relu_tie_is_reported_as_a_tie_and_passes(mnist, digits):
    params = tie_params(mnist, digits, unit=3)
    exact = verify.exact_step(params, *digits, 0.05)
    assert abs(exact.h[0, 3]) <= exact.bound(0, 3), "the built pre-activation must be within float32's reach of 0"
    record = one_step(Perturbed(params, unit=3), params, *digits)
    assert record.failure is None, record.failure
    assert [(t.step, t.unit, t.image) for t in record.ties] == [(0, 3, 0)]
    assert abs(record.ties[0].h) <= record.ties[0].bound


def test_the_same_change_where_there_is_no_tie_fails(mnist, digits):
    params = tie_params(mnist, digits, unit=3)
    exact = verify.exact_step(params, *digits, 0.05)
    far = int(np.argmax(np.abs(exact.h[0]) / exact.bound(0, 0) * (np.abs(exact.da[0]) > 1e-4)))
    assert abs(exact.h[0, far]) > 10 * exact.bound(0, far) and far != 3
    record = one_step(Perturbed(params, unit=far), params, *digits)
    assert record.failure and "no ReLU tie explains it" in record.failure and not record.ties


def test_the_loss_is_checked(mnist, digits):
    class WrongLoss(Perturbed):
        def train_epoch(self, *args, **kwargs):
            return super().train_epoch(*args, **kwargs) * np.float32(1.0001)

    params = trained(16, mnist)
    record = one_step(WrongLoss(params), params, *digits)
    assert record.failure and "loss" in record.failure


def test_the_yardstick_is_level1s_own_distance_from_float64(mnist, digits):
    """Level 1 itself, in lockstep with itself, uses the allowance only for its own rounding: under half of it."""
    params = trained(16, mnist)
    record = one_step(reference(params), params, *digits)
    assert record.failure is None and record.used[0] <= 0.5


# ---- the free run ----

NOISE = {"epoch_dev": 1e-4, "test_images_flipped": 16}


def losses_with_means(means, steps: int = 50) -> np.ndarray:
    rng = np.random.default_rng(0)
    noise = rng.standard_normal((len(means), steps)) * 0.01
    return (np.asarray(means)[:, None] + noise - noise.mean(axis=1, keepdims=True)).ravel().astype(np.float32)


def test_a_free_run_within_float32_noise_passes():
    expected = losses_with_means([0.5, 0.3, 0.2])
    got = losses_with_means([0.5 + 3e-4, 0.3 - 3e-4, 0.2])
    verdict = verify.check_free_run(got, expected, 0.9500, 0.9510, 10_000, NOISE, 3)
    assert verdict.failure is None and 0.7 < verdict.used < 0.8  # 3e-4 of a 4e-4 band


def test_a_free_run_outside_the_band_fails_at_its_epoch():
    expected = losses_with_means([0.5, 0.3, 0.2])
    got = losses_with_means([0.5, 0.3 + 1e-3, 0.2])
    verdict = verify.check_free_run(got, expected, 0.95, 0.95, 10_000, NOISE, 3)
    assert verdict.failure and verdict.failure.startswith("epoch 1:")


def test_test_accuracy_outside_the_band_fails():
    losses = losses_with_means([0.5, 0.3])
    verdict = verify.check_free_run(losses, losses, 0.9480, 0.9500, 10_000, NOISE, 2)  # 20 images > 16 flipped
    assert verdict.failure and "test accuracy" in verdict.failure


def test_a_free_run_with_a_missing_step_fails():
    losses = losses_with_means([0.5, 0.3])
    verdict = verify.check_free_run(losses[:-1], losses, 0.95, 0.95, 10_000, NOISE, 2)
    assert "a batch was dropped" in verdict.failure


# ---- divergence ----

@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_a_diverging_run_is_reported_as_diverged_with_its_cause(tmp_path, capsys):
    args = ["--levels", "1,3", "--epochs", "1", "--train-size", "64", "--lr", "1e30", "--out", str(tmp_path), "--quiet"]
    assert compare.main(args) == 1
    out = capsys.readouterr().out
    assert "DIVERGED: level1[cpu] diverged: loss" in out and "likely cause: the learning rate 1e+30 is too large" in out
    assert "DIVERGED: level3[cpu]" in out and "disagree" not in out


def test_huge_inputs_are_named_as_the_cause():
    losses = np.array([2.3, np.inf, np.nan], dtype=np.float32)
    assert verify.divergence(losses, 0.01, np.full((4, 784), 1e38, np.float32)) == (
        "diverged: loss inf at step 1; likely cause: the inputs reach |x| = 1e+38: normalize them "
        "(common.harness.data.normalize)")


def test_lockstep_runs_pytorch_on_one_thread_and_restores_it():
    before = torch.get_num_threads()
    with verify.torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
