"""The lockstep split over processes (common/harness/parallel.py) checks exactly what one process checks, and a stopped
compare job resumes from its journal (common/harness/compare.py's Progress)."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import time
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import pytest

from common.harness import compare, compile_cache, parallel, verify
from common.harness.data import load_mnist
from common.harness.phases import Phases
from common.levels import level
from common.nets import get
from common.nets.mlp import init_params

pytestmark = pytest.mark.harness

ROWS, BATCH, LR, EPOCHS = 480, 8, 0.01, 2  # 120 steps: on the full MNIST, level 4 meets a ReLU tie (step 58)


class Level4Except:
    """Level 4 but for what a subclass changes; the instance made without parameters is the picklable factory that
    makes one in a worker."""

    def __init__(self, params=None):
        self.inner = level(4).load()(params) if params is not None else None

    def __call__(self, params):
        return type(self)(params)

    def __getattr__(self, name):  # what it does not change, level 4's (not while unpickled: no inner yet)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class OffAtARow(Level4Except):
    """Level 4, its update of fc2.bias off by 1e-3 at the steps whose batch starts at row ROW (steps 40 and 100 of
    this run): a bug that a stretch in the middle of the run meets."""

    ROW = 320
    off = False

    def train_epoch(self, X, y, batch_size, lr, order=None):
        self.off = order is not None and order[0] == self.ROW
        return self.inner.train_epoch(X, y, batch_size, lr, order)

    def state_dict(self):
        params = self.inner.state_dict()
        if self.off:
            params["fc2.bias"] = params["fc2.bias"] + np.float32(1e-3)
        return params


def orders():
    return [compare.epoch_order(ROWS, e, 0, False) for e in range(EPOCHS)]


def sequential(factories):
    """verify.lockstep in this process, the models made by the same factories."""
    X, y = compare.TrainingData(ROWS, False)()
    models = {label: make(init_params(0)) for label, make in factories.items()}
    return verify.lockstep(models, init_params(0), X, y, orders(), BATCH, LR)


def test_split_over_processes_it_checks_every_step_as_one_process_does():
    factories = {"level4": compare.factory(level(4), "cpu")}
    clock, workers = Phases(), Phases()
    records, diverged, _ = parallel.lockstep(factories, init_params(0), compare.TrainingData(ROWS, False), orders(),
                                             BATCH, LR, 2, get("mlp"), clock=clock, workers=workers)
    alone, alone_diverged = sequential(factories)
    assert diverged is alone_diverged is None
    got, expected = records["level4"], alone["level4"]
    assert len(got.used) == len(expected.used) == EPOCHS * ROWS // BATCH  # every step, in several stretches
    # level 4 is C, the same bits in any process; the float64 step is summed in another order on one thread
    np.testing.assert_allclose(got.used, expected.used, rtol=1e-9)
    np.testing.assert_allclose(got.loss_err, expected.loss_err, rtol=1e-9)
    assert [t.describe() for t in got.ties] == [t.describe() for t in expected.ties]
    assert got.ties or load_mnist(quiet=True).offline  # on the full MNIST, a tie at step 58 (the subset has none)
    assert got.failure is expected.failure is None
    assert set(workers.seconds) == {"level 1 and the float64 step", "level4"}
    assert any(name.startswith("lockstep: every level") for name in clock.seconds)


def test_a_compiling_model_is_checked_in_few_long_stretches_as_one_process_checks_it():
    """A model whose making compiles (torch.compile, JAX) is made in few processes: level 4 stands in for one here,
    beside itself as a model that does not; each is checked at every step, exactly as in one process (level 4 is C:
    the same bits in any process)."""
    factories = {"level4": compare.factory(level(4), "cpu"), "compiled": compare.factory(level(4), "cpu")}
    records, _, _ = parallel.lockstep(factories, init_params(0), compare.TrainingData(ROWS, False), orders(), BATCH,
                                      LR, 3, get("mlp"), compiling=frozenset({"compiled"}))
    alone, _ = sequential(factories)
    for label in factories:
        assert len(records[label].used) == len(alone[label].used) == EPOCHS * ROWS // BATCH
        np.testing.assert_allclose(records[label].used, alone[label].used, rtol=1e-9)
        assert [t.describe() for t in records[label].ties] == [t.describe() for t in alone[label].ties]


def test_the_compiling_models_stretches_cover_every_step_once_in_few_tasks():
    starts = parallel.stretches(120, 9)
    tasks = parallel.stretch_tasks(starts, ["cheap", "compiled"], frozenset({"compiled"}))
    spans = {label: [(first, end) for first, these in tasks.items() for end, labels in these if label in labels]
             for label in ("cheap", "compiled")}
    assert spans["cheap"] == starts
    compiled = sorted(spans["compiled"])
    assert len(compiled) == parallel.COMPILING_PROCESSES and compiled[0][0] == 0 and compiled[-1][1] == 120
    assert all(a[1] == b[0] for a, b in zip(compiled, compiled[1:]))


def test_a_failure_in_a_later_stretch_is_the_one_process_finds_and_ends_the_record():
    factories = {"off": OffAtARow()}
    records, _, _ = parallel.lockstep(factories, init_params(0), compare.TrainingData(ROWS, False), orders(), BATCH,
                                      LR, 3, get("mlp"))
    alone, _ = sequential(factories)
    assert alone["off"].failure.startswith(f"step {OffAtARow.ROW // BATCH}: the fc2.bias update")
    assert records["off"].failure == alone["off"].failure  # its first failure, not the later one at step 100
    assert len(records["off"].used) == len(alone["off"].used) == OffAtARow.ROW // BATCH + 1


def failing_lockstep(factories):
    """parallel.lockstep over 80 rows: ten batches in six stretches, two workers, so that a failure finds tasks of level
    1's state still queued for the workers (where multiprocessing.Pool could wait for ever, python/cpython#96995)."""
    return parallel.lockstep(factories, init_params(0), compare.TrainingData(80, False),
                             [np.arange(80, dtype=np.int32)], BATCH, LR, 2, get("mlp"))


def test_a_worker_that_cannot_make_its_model_raises_instead_of_hanging():
    factories = {"bad": compare.Factory("mlp", "cpu", level=3, options=(("matmul", "loops"),))}
    with pytest.raises(TypeError, match="matmul"):
        failing_lockstep(factories)


def _refuse():
    raise RuntimeError("this factory cannot be unpickled")


class Unpicklable:
    """A factory that pickles, but fails where it is unpickled: in the worker."""

    def __reduce__(self):
        return _refuse, ()


def test_a_worker_that_cannot_unpickle_its_factories_raises_instead_of_hanging():
    with pytest.raises(RuntimeError, match="could not start.*cannot be unpickled"):
        failing_lockstep({"bad": Unpicklable()})


def _exit(params):
    os._exit(3)


def test_a_worker_that_dies_fails_the_job_instead_of_hanging():
    """A worker ended while it makes its model, as a crash in a level's native code ends it."""
    with pytest.raises(BrokenProcessPool):
        failing_lockstep({"dies": _exit})


class FailsFirstStallsAfter(Level4Except):
    """Level 4, but its first step fails (after a pause: the other worker has begun its stretch by then) and every
    later step stalls for STALL_S."""

    STALL_S = 300

    def train_epoch(self, X, y, batch_size, lr, order=None):
        if order[0] == 0:
            time.sleep(2)
            raise ValueError("a planted failure at the first step")
        time.sleep(self.STALL_S)


def test_a_failure_ends_the_other_workers_at_once_instead_of_waiting_for_their_stretches():
    before = set(multiprocessing.active_children())
    started = time.monotonic()
    with pytest.raises(ValueError, match="planted failure"):
        failing_lockstep({"stalls": FailsFirstStallsAfter()})
    assert time.monotonic() - started < FailsFirstStallsAfter.STALL_S / 5
    deadline = time.monotonic() + 60  # ending a worker that loaded torch takes up to a second or so on a busy machine
    for worker in set(multiprocessing.active_children()) - before:
        # The pool's own thread may reap the worker at the same moment: until it has stored the exit code, the
        # process reads as alive (multiprocessing's poll sees ECHILD), so wait for the code, not for join().
        while worker.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker.exitcode is not None, "a lockstep worker outlived the job"


def test_the_stretches_cover_every_step_once():
    for steps, count in ((12_500, 48), (7, 48), (1, 3), (100, 7)):
        stretches = parallel.stretches(steps, count)
        assert stretches[0][0] == 0 and stretches[-1][1] == steps
        assert all(a[1] == b[0] for a, b in zip(stretches, stretches[1:])) and all(s[1] > s[0] for s in stretches)
        assert len(stretches) == min(count, steps)


def test_a_stopped_job_resumes_from_its_journal_and_times_only_the_rest(tmp_path, capsys):
    args = ["--levels", "1,4", "--epochs", "1", "--train-size", "160", "--rounds", "2", "--out", str(tmp_path),
            "--quiet", "--jobs", "1"]
    assert compare.main(args) == 0
    whole = json.loads((tmp_path / "results.json").read_text())
    assert not (tmp_path / compare.PROGRESS).exists()  # the journal goes once results.json is written
    journal = tmp_path / compare.PROGRESS
    key = compare.Progress(journal, {}).key
    lines = [{"key": key}]  # a journal whose key is not this run's: nothing is taken from it
    journal.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert compare.main(args + ["--resume"]) == 0
    assert "every row is timed" in capsys.readouterr().out
    # stop a run after level 1's first round: its journal holds that round, with its free run
    progress_lines = []

    def stop_after_first(self, run):
        progress_lines.append(run.label)
        original(self, run)
        raise KeyboardInterrupt

    original = compare.Progress.save
    compare.Progress.save = stop_after_first
    try:
        with pytest.raises(KeyboardInterrupt):
            compare.main(args)
    finally:
        compare.Progress.save = original
    assert progress_lines == ["level1[cpu]"] and len(journal.read_text().splitlines()) == 2
    assert compare.main(args + ["--resume"]) == 0
    assert "--resume: 1 rounds of 2 rows taken" in capsys.readouterr().out
    resumed = json.loads((tmp_path / "results.json").read_text())
    for a, b in zip(whole["runs"], resumed["runs"]):  # the same free runs, losses and verdicts
        assert a["epoch_means"] == b["epoch_means"] and a["failure"] == b["failure"] and a["steps"] == b["steps"]
    assert [r["rounds"] for r in resumed["table"]] == [2, 2]


def test_the_phase_table_adds_up_to_the_whole_job():
    clock = Phases()
    clock.add("the lockstep", 6.0)
    clock.add("the lockstep", 2.0)
    with clock("plots"):
        pass
    table = clock.table(10.0)
    assert clock.seconds["the lockstep"] == 8.0 and list(clock.seconds) == ["the lockstep", "plots"]
    assert "where the 10 s went" in table and "80.0%" in table
    rest = next(line for line in table.splitlines() if line.startswith("the rest"))
    assert abs(float(rest.split()[-2]) - 2.0) < 0.01


def test_the_lockstep_processes_share_a_private_compilation_cache_that_is_removed_after(monkeypatch):
    """compile_cache.shared(): JAX's cache settings in the environment the worker processes inherit, a folder only
    this user can read and write (JAX runs what a cache holds), gone after the block, the environment as before."""
    monkeypatch.delenv(compile_cache.FOLDER, raising=False)
    with compile_cache.shared():
        folder = os.environ[compile_cache.FOLDER]
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    assert not os.path.exists(folder)
    assert compile_cache.FOLDER not in os.environ and "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ


def test_a_compilation_cache_the_user_set_up_is_left_as_it_is(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.FOLDER, str(tmp_path))
    with compile_cache.shared():
        assert os.environ[compile_cache.FOLDER] == str(tmp_path)
    assert os.environ[compile_cache.FOLDER] == str(tmp_path) and tmp_path.exists()


def test_a_later_round_times_the_first_epochs_and_the_results_say_so(tmp_path):
    """The first round is the whole run (the one verified); a later one times its first epochs, as many as last
    LATER_ROUND_SECONDS (these short ones: LATER_ROUND_EPOCHS), and the timing rule, read from results.json, says so."""
    assert compare.main(["--levels", "1,3", "--epochs", "4", "--train-size", "400", "--rounds", "2", "--jobs", "1",
                         "--out", str(tmp_path), "--quiet"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["settings"]["later_round_epochs"] == compare.LATER_ROUND_EPOCHS < 4
    assert results["settings"]["later_round_seconds"] == compare.LATER_ROUND_SECONDS
    assert all(len(run["epoch_seconds"]) == 4 for run in results["runs"])  # the verified run: every epoch
    assert [row["later_round_epochs"] for row in results["table"]] == [compare.LATER_ROUND_EPOCHS] * 2
    rule = compare.timing_rule(results["settings"])
    assert (f"each later one the same warm model from the initial weights, its first epochs: as many as last "
            f"{compare.LATER_ROUND_SECONDS:g} s at the first round's pace, at most {compare.LATER_ROUND_EPOCHS})"
            in rule)
    old = compare.timing_rule({k: v for k, v in results["settings"].items() if k != "later_round_seconds"})
    assert f"its first {compare.LATER_ROUND_EPOCHS} epochs" in old  # results timed before the seconds' rule
    before = compare.timing_rule({"rounds": 3})  # results timed before: every round whole, on a new model
    assert "its first" not in before and "a new model, warmed up" in before


@pytest.mark.parametrize("first_round_s, epochs, timed", [(0.05, 10, 3), (0.4, 10, 3), (0.5, 10, 2), (2.0, 10, 1),
                                                          (0.05, 2, 2), (0.0, 10, 3)])
def test_a_later_round_times_epochs_that_last_a_second_at_most_three(first_round_s, epochs, timed):
    run = compare.Run("level3[cpu]", 3, "cpu", None, rounds=[first_round_s])
    assert compare.later_round_epochs(run, epochs) == timed


def test_a_row_is_made_and_warmed_up_once_and_every_round_starts_from_the_initial_weights(tmp_path, monkeypatch):
    """A later round times the row's warm model again: no second warm-up, but from the initial parameters, as the
    first round did (an epoch's start inside a round carries on from the epoch before)."""
    calls, starts, real_train = [], [], compare.train

    def spying(model, run, *args, warm_up=True):
        if run.label == "level3[cpu]":  # a timed row (the honest runs are level 1's)
            calls.append((id(model), warm_up))
            if not hasattr(model, "spied"):
                epoch, model.spied = model.train_epoch, True
                model.train_epoch = lambda *a: (starts.append(model.state_dict()["fc1.weight"].copy()), epoch(*a))[1]
        return real_train(model, run, *args, warm_up=warm_up)

    monkeypatch.setattr(compare, "train", spying)
    assert compare.main(["--levels", "1,3", "--epochs", "4", "--train-size", "400", "--rounds", "3", "--jobs", "1",
                         "--out", str(tmp_path), "--quiet"]) == 0
    assert [warm for _, warm in calls] == [True, False, False] and len({model for model, _ in calls}) == 1
    initial = init_params(0, compare.HIDDEN)["fc1.weight"]
    later = compare.LATER_ROUND_EPOCHS
    assert len(starts) == 1 + 4 + 2 * later  # the warm-up epoch, the whole first round, two later ones
    round_starts = {0, 1, 1 + 4, 1 + 4 + later}  # the warm-up and each round's first epoch
    for i, weights in enumerate(starts):
        assert np.array_equal(weights, initial) == (i in round_starts), f"epoch call {i}"
