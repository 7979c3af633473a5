"""What a hostile user tries, and what every level must answer: a clear exception or the right result, never a crash.

Copies, threads, Ctrl-C, data changed behind a cache, sizes past what native code can hold, values that only
overflow once converted, a failed upload, huge batches. The native levels share one binding (common/native)
and one data cache (common/contract), so each fix lives there once and each test runs over every level
where it applies.
"""

from __future__ import annotations

import copy
import os
import pickle
import signal
import threading
import time

import numpy as np
import pytest

from common.contract import DataCache, immutable
from common.native import NativeError, NativeMLP, TrainingInterrupted
from common.nets.mlp import init_params
from conftest import ALL, NATIVE, implementation_params, reference

every_level = pytest.mark.parametrize("impl", implementation_params(ALL))
native_levels = pytest.mark.parametrize("impl", implementation_params(NATIVE))

rng = np.random.default_rng(0)
X = rng.standard_normal((64, 784)).astype(np.float32)
y = rng.integers(0, 10, 64)


def same_params(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in a)


# ---- 1. copies ----

@native_levels
@pytest.mark.parametrize("make_copy", [copy.copy, copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))],
                         ids=["copy", "deepcopy", "pickle"])
def test_a_copy_is_an_independent_model(factory, make_copy):
    model = factory(init_params(0, 8))
    twin = make_copy(model)
    assert same_params(twin.state_dict(), model.state_dict())
    expected = model.forward(X)
    twin.train_epoch(X, y, 8, 0.1)
    twin.close()  # freeing the copy must not free the original
    np.testing.assert_array_equal(model.forward(X), expected)
    assert same_params(model.state_dict(), init_params(0, 8))


# ---- 2. threads ----

@native_levels
def test_forward_from_another_thread_during_training_is_right(factory):
    model = factory(init_params(0, 64))
    expected = model.forward(X)
    data_X, data_y = immutable(np.tile(X, (40, 1))), immutable(np.tile(y, 40))
    wrong, stop = [], threading.Event()

    def forward_repeatedly():
        while not stop.is_set():
            if not np.array_equal(model.forward(X), expected):
                wrong.append(1)

    reader = threading.Thread(target=forward_repeatedly)
    reader.start()
    try:
        for _ in range(5):
            model.train_epoch(data_X, data_y, 1, 0.0)  # lr 0: the parameters never change
    finally:
        stop.set()
        reader.join()
    assert not wrong, f"{len(wrong)} forward passes returned wrong logits while another thread trained"


@native_levels
def test_growing_buffers_in_one_thread_while_another_trains(factory):
    model = factory(init_params(0, 64))
    big = immutable(np.tile(X, (50, 1)))  # 3,200 rows: forward() and a large batch reallocate the buffers
    errors = []

    def grow():
        try:
            for rows in (1100, 2100, 3200):
                model.forward(big[:rows])
                model.loss_and_grads(big[:rows], np.tile(y, 50)[:rows])
        except Exception as e:  # noqa: BLE001 - any exception is a failure of the test
            errors.append(e)

    thread = threading.Thread(target=grow)
    thread.start()
    for batch in (1, 7, 64):
        model.train_epoch(immutable(X), immutable(y), batch, 0.01)
    thread.join()
    assert not errors, errors


@native_levels
def test_close_during_another_threads_epoch_is_safe(factory):
    model = factory(init_params(0, 64))
    data_X, data_y = immutable(np.tile(X, (200, 1))), immutable(np.tile(y, 200))
    outcome = []

    def train():
        try:
            outcome.append(len(model.train_epoch(data_X, data_y, 1, 0.01)))
        except NativeError as e:
            outcome.append(str(e))

    thread = threading.Thread(target=train)
    thread.start()
    time.sleep(0.05)
    model.close()  # waits for the epoch's current native call, then frees
    thread.join()
    assert outcome == [12_800] or "closed" in outcome[0]
    with pytest.raises(NativeError, match="closed"):
        model.forward(X)


# ---- 3. sizes native code cannot hold ----

@native_levels
def test_a_batch_too_large_for_native_buffers_is_refused_before_the_call(factory):
    """hidden 100,000 x batch 21,476 = 2,147,600,000 elements per buffer: more than MLP_MAX_ELEMENTS (2^31 - 1)."""
    model = factory(init_params(0, 100_000))
    rows = np.zeros((21_476, 784), dtype=np.float32)
    labels = np.zeros(21_476, dtype=np.int64)
    with pytest.raises(ValueError, match="21,476 rows x 100,000 values"):
        model.loss_and_grads(rows, labels)
    with pytest.raises(ValueError, match="use a smaller batch_size"):
        model.train_epoch(rows, labels, 21_476, 0.1)
    model.train_epoch(rows[:64], labels[:64], 64, 0.0)  # still usable


# ---- 4. data changed behind the cache ----

def epoch_losses(model, X, y=immutable(y)):
    return model.train_epoch(X, y, 8, 0.0)


@every_level
def test_a_read_only_array_made_writeable_and_changed_is_seen(factory):
    data = X.copy()
    data.flags.writeable = False
    model = factory(init_params(0, 16))
    first = epoch_losses(model, data)
    data.flags.writeable = True
    data[:] = 0
    data.flags.writeable = False
    assert not np.array_equal(epoch_losses(model, data), first)
    np.testing.assert_array_equal(epoch_losses(model, data), epoch_losses(factory(init_params(0, 16)), data))


@every_level
def test_writes_through_an_earlier_writeable_view_are_seen(factory):
    data = X.copy()
    view = data[:]
    data.flags.writeable = False
    model = factory(init_params(0, 16))
    first = epoch_losses(model, data)
    view[:] = 0
    assert not np.array_equal(epoch_losses(model, data), first)


@every_level
def test_two_immutable_data_sets_of_the_same_length_never_share_a_cache_entry(factory):
    a, b = immutable(X), immutable(X[::-1].copy())
    model = factory(init_params(0, 16))
    epoch_losses(model, a)
    np.testing.assert_array_equal(epoch_losses(model, b), epoch_losses(factory(init_params(0, 16)), b))


def test_only_immutable_data_is_kept_between_calls():
    uploads, labels = [], immutable(y)
    cache = DataCache()
    for data in (immutable(X), immutable(X)):
        for _ in range(3):
            cache.fetch(data, labels, lambda X, y: uploads.append(X) or len(X))
    assert len(uploads) == 2  # once per immutable data set
    writeable = X.copy()
    for _ in range(3):
        cache.fetch(writeable, y, lambda X, y: uploads.append(X) or len(X))
    assert len(uploads) == 5  # every call: a writeable array may have changed


# ---- 5. checks on the values the level will use ----

@every_level
def test_params_that_overflow_float32_are_refused(factory):
    params = {k: v.astype(np.float64) for k, v in init_params(0, 8).items()}
    params["fc1.weight"][0, 0] = 1e39  # finite in float64, inf in float32
    with pytest.raises(ValueError, match="NaN or infinity .*float32"):
        factory(params)


@every_level
@pytest.mark.parametrize("lr, error, words", [(1e39, ValueError, "lr must be a finite number"),
                                              ("0.1", TypeError, "lr must be a number, got str")])
def test_a_learning_rate_the_level_cannot_use_is_refused(factory, lr, error, words):
    model = factory(init_params(0, 8))
    with pytest.raises(error, match=words):
        model.train_epoch(X, y, 8, lr)
    assert same_params(model.state_dict(), init_params(0, 8))


@every_level
def test_zero_hidden_units_are_named(factory):
    params = init_params(0, 8)
    params["fc1.weight"], params["fc1.bias"], params["fc2.weight"] = np.zeros((0, 784)), np.zeros(0), np.zeros((10, 0))
    with pytest.raises(ValueError, match="at least 1 hidden unit"):
        factory(params)


# ---- 6. a failed upload ----

@native_levels
def test_a_failed_upload_leaves_no_stale_data_set(factory, monkeypatch):
    model = factory(init_params(0, 16))
    first, second = immutable(X), immutable(X[::-1].copy())
    expected = epoch_losses(model, first)
    real_upload = NativeMLP._upload

    def out_of_memory(self, data, labels):
        if data is not None and np.array_equal(data, second):
            raise NativeError("cudaMalloc: out of memory (simulated)")
        return real_upload(self, data, labels)

    monkeypatch.setattr(NativeMLP, "_upload", out_of_memory)
    with pytest.raises(NativeError, match="out of memory"):
        epoch_losses(model, second)
    np.testing.assert_array_equal(epoch_losses(model, first), expected)


# ---- 8. a batch larger than the data set ----

@every_level
def test_a_batch_beyond_2_to_the_31_is_the_whole_epoch_at_every_level(factory):
    model = factory(init_params(0, 16))
    losses = model.train_epoch(X, y, 2**31, 0.0)
    assert losses.shape == (1,)
    np.testing.assert_allclose(losses[0], reference(init_params(0, 16)).loss_and_grads(X, y)[0], rtol=1e-5)


# ---- 9. Ctrl-C ----

@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler for the test. A process started in the background (`cmd &` in a script, as some CI
    runners start jobs) inherits SIGINT ignored, and Python then installs no handler: Ctrl-C would do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@native_levels
def test_ctrl_c_stops_an_epoch_promptly_and_leaves_the_model_consistent(factory, ctrl_c_raises):
    params = init_params(0, 256)
    data_X, data_y = immutable(X), immutable(y)
    order = np.tile(np.arange(64, dtype=np.int32), 20_000)  # 160,000 steps of batch 8: far longer than the wait
    model = factory(params)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    start = time.perf_counter()
    timer.start()
    with pytest.raises(TrainingInterrupted) as info:
        model.train_epoch(data_X, data_y, 8, 0.01, order)
    waited = time.perf_counter() - start - 0.5
    timer.join()
    done = info.value.steps_done
    assert waited < 0.5, f"Ctrl-C answered {waited:.2f} s after it came"
    assert 0 < done < 20_000 * 8 and info.value.losses.shape == (done,) and np.isfinite(info.value.losses).all()
    # Consistent: exactly the parameters after `done` whole steps, and the same losses.
    again = factory(params)
    np.testing.assert_array_equal(again.train_epoch(data_X, data_y, 8, 0.01, order[: done * 8]), info.value.losses)
    assert same_params(model.state_dict(), again.state_dict())


# ---- 11. the mean loss of a large batch ----

@every_level
def test_the_mean_loss_of_a_large_batch_does_not_drift(factory):
    """200,000 equal rows: every row has the same loss, so the mean must be that loss. A float32 running sum drifted
    by 1.9e-6 (relative) at 60,000 rows and grows with the batch; a double or pairwise sum stays near 1e-7."""
    params = init_params(0, 8)
    rows = np.ascontiguousarray(np.broadcast_to(X[0], (200_000, 784)))
    labels = np.full(200_000, 3)
    one_row, _ = factory(params).loss_and_grads(X[:1], labels[:1])
    loss, _ = factory(params).loss_and_grads(rows, labels)
    assert abs(loss - one_row) <= 1e-6 * one_row


# ---- 12. forward over several native chunks ----

@every_level
def test_forward_over_several_chunks_with_a_partial_last_one(factory, mnist):
    """2,085 rows: two whole chunks of 1,024 (the native levels' FORWARD_CHUNK) and 37 rows."""
    params = init_params(0, 32)
    rows = mnist[2][:2085]
    np.testing.assert_allclose(factory(params).forward(rows), reference(params).forward(rows), rtol=0, atol=1e-4)
