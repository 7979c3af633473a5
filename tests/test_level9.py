"""Level 9, data parallel: what the suite parametrized over every level (tests/test_levels.py) cannot see.

Two workers in lockstep with level 1's single-process step on real digits (and the gold standard beside them,
PyTorch's DistributedDataParallel on the same process group), the replicas bit for bit the same after
an epoch, each classic data-parallel bug planted and caught, and a clean end: a dead worker or bad input is a clear
Python exception, and no worker outlives its model. Then the timers of chapter 9's last section: the all-reduce's
(gloo here, NCCL on two GPUs) and the step's on one GPU and two (common/harness/scaling.py), each saying what ran.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from common.harness import scaling, verify
from common.harness.compare import epoch_order
from common.levels import ROOT
from common.nets.mlp import PARAM_NAMES, init_params
from level3_numpy import MLP as Level3
from level9_data_parallel import DDP, MLP, allreduce
from level9_data_parallel.mlp import BUGS, WORLD, WorkerError

pytestmark = pytest.mark.level9


def lockstep(models: dict, params, X, y, batch: int, epochs: int = 1, shuffle: bool = False):
    """verify.lockstep over `epochs` epochs of X; the records by label."""
    orders = [epoch_order(len(X), e, 0, shuffle) for e in range(epochs)]
    records, diverged = verify.lockstep(models, params, X, y, orders, batch, 0.05)
    assert diverged is None, diverged
    return records, sum(-(-len(o) // batch) for o in orders)


@pytest.mark.parametrize("batch, n", [(8, 384), (13, 300)], ids=["b8", "b13-partial"])
def test_lockstep_with_level1_on_mnist(mnist, batch, n):
    """Every step from level 1's parameters, checked against level 1's single-process step of the whole batch (an odd
    batch: shares of 7 and 6 rows; a partial last batch). The sum over the ranks reorders float32's sums; level 3, the
    same step in one process, beside it shows what that costs in the allowance."""
    X, y, params = mnist[0][:n], mnist[1][:n], init_params(0)
    with MLP(params) as model, DDP(params) as gold:
        records, steps = lockstep({"level3": Level3(params), "level9": model, "ddp": gold}, params, X, y, batch,
                                  shuffle=True)
    for label, record in records.items():
        assert record.failure is None, f"{label}: {record.failure}"
        assert len(record.used) == steps  # every step was checked
    print(f"batch {batch}: largest share of the allowance used over {steps} steps: "
          + ", ".join(f"{label} {max(record.used):.3f}" for label, record in records.items()))


@pytest.mark.parametrize("kind", [MLP, DDP], ids=["level9", "ddp"])
def test_replicas_are_bit_identical_after_an_epoch(mnist, kind):
    """An epoch of 32 data-parallel steps: every replica holds the very same bits as rank 0's."""
    X, y = mnist[0][:256], mnist[1][:256]
    with kind(init_params(3, 64)) as model:
        model.train_epoch(X, y, 8, 0.05, epoch_order(len(X), 0, 0, True))
        first, *others = model.replica_states()
        assert others
        for state in others:
            for name in PARAM_NAMES:
                assert state[name].tobytes() == first[name].tobytes(), name
        assert not np.array_equal(first["fc1.weight"], init_params(3, 64)["fc1.weight"])  # it did train


# Where each planted bug is caught: the lockstep (the step is wrong), or the replicas' check (they parted).
CAUGHT_BY = {
    "undivided": "lockstep",  # the sum of two means: every gradient twice its size, the replicas still alike
    "same_share": "lockstep",  # rank 1 steps on rank 0's rows: the batch's second half never seen
    "stale_buffer": "replicas",  # the all-reduce sums last step's buffer: each rank steps on its own gradient
    "no_broadcast": "replicas",  # rank 1 steps from zeros, not rank 0's weights: the replicas part at once
}


@pytest.mark.parametrize("bug", BUGS)
def test_each_planted_bug_is_caught(mnist, bug):
    """Each classic data-parallel bug, planted in the workers, fails a check at the first step."""
    X, y, params = mnist[0][:64], mnist[1][:64], init_params(0)
    with MLP(params, bug=bug) as model:
        try:
            records, _ = lockstep({"level9": model}, params, X, y, 8)
        except WorkerError as error:
            assert CAUGHT_BY[bug] == "replicas" and "replicas parted" in str(error)
            return
    record = records["level9"]
    assert CAUGHT_BY[bug] == "lockstep" and record.failure is not None and record.failure.startswith("step 0:")


def test_a_dead_worker_is_an_exception_and_ends_the_others(mnist):
    X, y = mnist[0][:64], mnist[1][:64]
    model = MLP(init_params(0, 16))
    procs = list(model._workers.procs)
    procs[1].kill()
    procs[1].join()
    with pytest.raises(WorkerError, match="worker 1"):
        model.train_epoch(X, y, 8, 0.1)
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(WorkerError, match="make a new model"):
        model.state_dict()


def test_closing_the_model_ends_its_workers():
    model = MLP(init_params(0, 16))
    procs = list(model._workers.procs)
    model.close()
    assert not any(p.is_alive() for p in procs)
    model.close()  # twice is harmless


def test_bad_input_is_a_clear_exception_and_the_workers_carry_on(mnist):
    with pytest.raises(ValueError, match="workers"):
        MLP(init_params(0, 16), workers=0)
    with pytest.raises(ValueError, match="bug"):
        MLP(init_params(0, 16), bug="typo")
    with MLP(init_params(0, 16)) as model:
        with pytest.raises(TypeError, match="float32"):
            model.train_epoch(mnist[0][:64].astype(np.float64), mnist[1][:64], 8, 0.1)
        with pytest.raises(ValueError, match="batch_size"):
            model.train_epoch(mnist[0][:64], mnist[1][:64], 0, 0.1)
        with pytest.raises(ValueError, match="shape"):
            model.load_state_dict(init_params(0, 17) | {"fc1.bias": np.zeros(16, np.float32)})
        assert np.isfinite(model.train_epoch(mnist[0][:64], mnist[1][:64], 8, 0.1)).all()


def test_the_allreduce_timer_says_what_ran_and_refuses_an_unknown_backend():
    times, ran = allreduce.measure([4 << 10, 64 << 10], repeats=3)
    assert list(times) == [4 << 10, 64 << 10] and all(0 < t < 10 for t in times.values())
    assert ran == {"backend": "gloo", "world": WORLD, "repeats": 3, "device": "cpu"}
    with pytest.raises(ValueError, match="backend 'mpi'"):
        allreduce.measure([4 << 10], backend="mpi")


def test_the_cost_model_fits_a_line_it_was_made_from():
    latency, bandwidth = 30e-6, 200e9
    times = {size: latency + size / bandwidth for size in allreduce.SIZES}
    assert np.allclose(allreduce.fit(times), (latency, bandwidth), rtol=1e-9)


def two_gpus() -> None:
    """Skip a test of NCCL unless this machine has two GPUs (even under --require-gpu: one GPU cannot run it)."""
    import torch

    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"NCCL over {WORLD} GPUs: this machine has {torch.cuda.device_count()}")


@pytest.mark.gpu
def test_nccl_allreduce_on_two_gpus_says_what_ran():
    two_gpus()
    import torch

    times, ran = allreduce.measure([4 << 10, 4 << 20], repeats=5, backend="nccl")
    assert ran["backend"] == "nccl" and ran["world"] == WORLD and ran["device"] == torch.cuda.get_device_name(0)
    assert times[4 << 20] > 0 and ran["nccl"].count(".") == 2


@pytest.mark.gpu
def test_ddp_step_times_on_one_and_two_gpus_say_what_ran():
    two_gpus()
    for world in (1, WORLD):
        rows, ran = scaling.step_times([(64, 32)], world)
        assert len(rows[(64, 32)]) == scaling.ROUNDS and min(rows[(64, 32)]) > 0
        assert ran["world"] == world and ran["ddp"] == (world > 1) and ran["tf32"] is False


def test_step_times_refuse_more_gpus_than_the_machine_has():
    import torch

    with pytest.raises(RuntimeError, match=f"{torch.cuda.device_count() + 1} GPUs asked for"):
        scaling.step_times([(64, 32)], torch.cuda.device_count() + 1)


def test_the_scaling_table_publishes_medians_with_their_range_and_flags_unsteady_rows():
    ran = {"backend": "nccl", "world": 2, "steps": 100, "rounds": 3, "ddp": True, "tf32": False, "device": "GPU A",
           "nccl": "2.28.9"}
    scaled = {"ran_1": ran | {"world": 1, "ddp": False}, "ran_2": ran,
              "table": [scaling.table_row(256, 8, [1e-3, 1.1e-3, 1.05e-3], [2e-3, 2.1e-3, 2e-3]),
                        scaling.table_row(4096, 16384, [5e-3, 5e-3, 9e-3], [2.9e-3, 2.9e-3, 2.9e-3])]}
    table = scaling.markdown(scaled)
    assert "| 256 | 8 | 1,050.0 (1,000.0-1,100.0) | 2,000.0 (2,000.0-2,100.0) | 0.53x |" in table
    assert "| 4,096 | 16,384 | unsteady" in table and "5,000" not in table  # the unsteady row's times stay out
    assert "TF32 off" in table and "GPU A" in table and "not a" not in table
    other = scaling.markdown(scaled | {"ran_1": scaled["ran_1"] | {"device": "GPU B"}})
    assert "One GPU was a GPU B, not a GPU A" in other


def rank_that_fails(rank: int, world: int, store: str, out) -> None:
    """A target for on_ranks whose rank 0 fails before it reports."""
    if rank == 0:
        raise SystemExit(3)


def test_ranks_that_end_without_a_report_are_an_exception_not_a_hang():
    with pytest.raises(RuntimeError, match="ended before they reported"):
        allreduce.on_ranks(rank_that_fails, WORLD)


def test_the_committed_scaling_rows_are_what_their_rounds_give():
    for path in ROOT.glob("results/*x2/scaling.json"):
        for row in json.loads(path.read_text())["table"]:
            assert scaling.table_row(row["hidden"], row["batch"], row["rounds_1"], row["rounds_2"]) == row, path
