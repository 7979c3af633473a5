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
from common.nets import get, lenet
from level3_numpy import LeNet as Level3LeNet
from level3_numpy import MLP as Level3
from level9_data_parallel import DDP, MLP, LeNet, allreduce
from level9_data_parallel.mlp import BUGS, WORLD, WorkerError

pytestmark = pytest.mark.level9


def lockstep(models: dict, params, X, y, batch: int, epochs: int = 1, shuffle: bool = False, net: str = "mlp"):
    """verify.lockstep over `epochs` epochs of X; the records by label."""
    orders = [epoch_order(len(X), e, 0, shuffle) for e in range(epochs)]
    records, diverged = verify.lockstep(models, params, X, y, orders, batch, 0.05, network=get(net))
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


def test_lenet_in_lockstep_with_level1_on_mnist(mnist):
    """LeNet-5, data parallel the same way, level 3's and PyTorch's DDP: every step against level 1's single-process
    step of the whole batch (an odd batch of 13: shares of 7 and 6; a partial last batch), then the replicas bit for
    bit."""
    X, y, params = mnist[0][:160], mnist[1][:160], lenet.init_params(0)
    with LeNet(params) as model, DDP(params) as gold:
        records, steps = lockstep({"level3": Level3LeNet(params), "level9": model, "ddp": gold}, params, X, y, 13,
                                  shuffle=True, net="lenet")
        for states in (model.replica_states(), gold.replica_states()):
            for name in lenet.PARAM_NAMES:
                assert states[0][name].tobytes() == states[1][name].tobytes(), name
    for label, record in records.items():
        assert record.failure is None, f"{label}: {record.failure}"
        assert len(record.used) == steps


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


@pytest.mark.parametrize("kind, device",
                         [(MLP, "cpu"), (LeNet, "cpu"), pytest.param(MLP, "cuda", marks=pytest.mark.gpu),
                          pytest.param(LeNet, "cuda", marks=pytest.mark.gpu)],
                         ids=["mlp-cpu", "lenet-cpu", "mlp-cuda", "lenet-cuda"])
@pytest.mark.parametrize("bug", BUGS)
def test_each_planted_bug_is_caught(mnist, bug, kind, device):
    """Each classic data-parallel bug, planted in the workers, fails a check at the first step, for both networks: on
    the CPU (level 3's step, gloo) and on two GPUs (level 6's step, NCCL)."""
    if device == "cuda":
        two_gpus()
    net = "lenet" if kind is LeNet else "mlp"
    X, y, params = mnist[0][:64], mnist[1][:64], get(net).network.init_params(0)
    with kind(params, bug=bug, device=device) as model:
        try:
            records, _ = lockstep({"level9": model}, params, X, y, 8, net=net)
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
    assert "ran on different GPUs (GPU A, GPU B)" in other
    own = {"level": "level9", "world": 2, "device": "GPU A", "nccl": "2.28.9", "matmul": "cublas", "steps": 100,
           "rounds": 3}
    with_level = scaling.markdown(scaled | {
        "level_1": own | {"level": "level6", "world": 1}, "level_2": own,
        "level_table": [scaling.table_row(256, 8, [1e-4, 1e-4, 1e-4], [1.5e-4, 1.5e-4, 1.5e-4]),
                        scaling.table_row(4096, 16384, [5e-3, 5e-3, 5e-3], [2.5e-3, 2.5e-3, 2.5e-3])]})
    assert "| 256 | 8 | 100.0 (100.0-100.0) | 150.0 (150.0-150.0) | 0.67x | 0.07x |" in with_level  # 150 / 2,000
    assert "| 4,096 | 16,384 | 5,000.0 (5,000.0-5,000.0) | 2,500.0 (2,500.0-2,500.0) | 2.00x | - |" in with_level
    assert "different GPUs" not in with_level
    lenet_own = {key: value for key, value in own.items() if key != "matmul"} | {"convolution": "direct"}
    with_lenet = scaling.markdown(scaled | {"lenet": {
        "ran_1": scaled["ran_1"], "ran_2": ran, "table": [scaling.table_row(None, 64, [2e-4] * 3, [3e-4] * 3)],
        "level_1": lenet_own | {"level": "level6", "world": 1}, "level_2": lenet_own | {"device": "GPU C"},
        "level_table": [scaling.table_row(None, 64, [1e-4] * 3, [1.2e-4] * 3)]}})
    lenet_part = with_lenet.split("LeNet-5's step", 1)[1]
    assert "| batch | 1 GPU | 2 GPUs, DDP | speedup |" in lenet_part and "hidden" not in lenet_part
    assert "| 64 | 100.0 (100.0-100.0) | 120.0 (120.0-120.0) | 0.83x | 0.40x |" in lenet_part  # 120 / 300
    assert "convolutions direct (cuDNN)" in lenet_part and "ran on different GPUs (GPU A, GPU C)" in with_lenet


def rank_that_fails(rank: int, world: int, store: str, out) -> None:
    """A target for on_ranks whose rank 0 fails before it reports."""
    if rank == 0:
        raise SystemExit(3)


def test_ranks_that_end_without_a_report_are_an_exception_not_a_hang():
    with pytest.raises(RuntimeError, match="ended before they reported"):
        allreduce.on_ranks(rank_that_fails, WORLD)


def test_the_committed_scaling_rows_are_what_their_rounds_give():
    for path in ROOT.glob("results/*x2/scaling.json"):
        scaled = json.loads(path.read_text())
        parts = [scaled] + ([scaled["lenet"]] if "lenet" in scaled else [])
        for row in [row for part in parts for row in part["table"] + part.get("level_table", [])]:
            assert scaling.table_row(row["hidden"], row["batch"], row["rounds_1"], row["rounds_2"]) == row, path


# ---- level 9 on GPUs: level 6's step on each GPU, NCCL's all-reduce through cffi ----


def test_nccl_through_cffi_gives_its_version_and_a_unique_id():
    """The binding loads NCCL and makes a communicator's id without a GPU, where NCCL is installed."""
    from level9_data_parallel import nccl

    try:
        version = nccl.version()
    except nccl.NCCLUnavailable as error:
        pytest.skip(str(error))
    assert version.count(".") == 2 and int(version.split(".")[0]) >= 2
    first, second = nccl.unique_id(), nccl.unique_id()
    assert len(first) == nccl.UNIQUE_ID_BYTES and first != second
    with pytest.raises(ValueError, match="128 bytes"):
        nccl.Communicator(first[:-1], WORLD, 0)


@pytest.mark.parametrize("kind", [MLP, LeNet], ids=["mlp", "lenet"])
def test_level9_on_gpus_refuses_a_bad_device_and_more_gpus_than_there_are(kind):
    import torch

    params = kind.network.init_params(0, 16 if kind is MLP else None)
    with pytest.raises(ValueError, match="device must be one of"):
        kind(params, device="gpu")
    with pytest.raises(RuntimeError, match=f"{torch.cuda.device_count() + 1} workers asked for"):
        kind(params, workers=torch.cuda.device_count() + 1, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("net", ["mlp", "lenet"])
def test_the_gradient_sum_is_called_as_the_steps_are_queued_and_its_failure_is_raised(mnist, request, net):
    """Level 9's libraries call the installed sum with the gradients (the MLP's four, LeNet-5's one flat buffer) and
    the step's rows: the MLP at each step; LeNet-5 at each step it queues, and twice for the whole batches it replays
    as a graph (a step before the capture, and the capture). A sum that adds nothing leaves level 6's step bit for
    bit; an exception in it is raised from the native call, and the model carries on."""
    from conftest import require

    import level6_cublas
    from common.levels import level
    from level9_data_parallel import gpu

    require(level(6), "cuda", request.config)
    network = get(net).network
    X, y, params = mnist[0][:20], mnist[1][:20], network.init_params(0, 100 if net == "mlp" else None)
    plain = getattr(level6_cublas, get(net).class_name)(params)
    summed = gpu.SummedMLP(params) if net == "mlp" else gpu.SummedLeNet(params)
    calls = []
    summed.sum_gradients_with(lambda gradients, counts, rows, stream: calls.append((counts, rows)))
    assert np.array_equal(plain.train_epoch(X, y, 8, 0.1), summed.train_epoch(X, y, 8, 0.1))
    for name in network.PARAM_NAMES:
        assert plain.state_dict()[name].tobytes() == summed.state_dict()[name].tobytes(), name
    counts = [100 * 784, 100, 10 * 100, 10] if net == "mlp" else [summed.lib.LENET_PARAMS]
    assert calls == [(counts, rows) for rows in (8, 8, 4)]  # LeNet-5: the capture's two, then the last batch
    if net == "lenet":  # nine whole batches: two calls, then nine replays that call nothing
        calls.clear()
        X, y = mnist[0][:72], mnist[1][:72]
        assert np.array_equal(plain.train_epoch(X, y, 8, 0.1), summed.train_epoch(X, y, 8, 0.1))
        for name in network.PARAM_NAMES:
            assert plain.state_dict()[name].tobytes() == summed.state_dict()[name].tobytes(), name
        assert calls == [(counts, 8)] * 2

    def failing(*args):
        raise RuntimeError("the sum failed")

    summed.sum_gradients_with(failing)
    with pytest.raises(RuntimeError, match="the sum failed"):
        summed.train_epoch(X, y, 8, 0.1)
    summed.sum_gradients_with(None)
    assert np.isfinite(summed.train_epoch(X, y, 8, 0.1)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("batch, n", [(8, 384), (13, 300)], ids=["b8", "b13-partial"])
def test_on_two_gpus_lockstep_with_level1_on_mnist(mnist, batch, n):
    """Level 9 on two GPUs, every step from level 1's parameters against level 1's single-process step of the whole
    batch; level 6, the same step on one GPU, beside it. It says what ran, read back from its workers."""
    two_gpus()
    import torch

    from level6_cublas import MLP as Level6

    X, y, params = mnist[0][:n], mnist[1][:n], init_params(0)
    with MLP(params, device="cuda") as model:
        ran = model.variant()
        records, steps = lockstep({"level6": Level6(params), "level9": model}, params, X, y, batch, shuffle=True)
    assert ran["device"] == "cuda" and ran["gpu"] == torch.cuda.get_device_name(0) and ran["workers"] == str(WORLD)
    assert ran["matmul"] == "cublas" and ran["nccl"].count(".") == 2
    for label, record in records.items():
        assert record.failure is None, f"{label}: {record.failure}"
        assert len(record.used) == steps
    print(f"batch {batch}, {ran}: largest share of the allowance used over {steps} steps: "
          + ", ".join(f"{label} {max(record.used):.3f}" for label, record in records.items()))


@pytest.mark.gpu
def test_on_two_gpus_the_replicas_are_bit_identical_after_an_epoch(mnist):
    two_gpus()
    X, y = mnist[0][:256], mnist[1][:256]
    with MLP(init_params(3, 64), device="cuda") as model:
        model.train_epoch(X, y, 8, 0.05, epoch_order(256, 0, 0, True))
        first, second = model.replica_states()
        for name in PARAM_NAMES:
            assert first[name].tobytes() == second[name].tobytes(), name
        assert not np.array_equal(first["fc1.weight"], init_params(3, 64)["fc1.weight"])


@pytest.mark.gpu
def test_on_two_gpus_lenet_in_lockstep_with_level1_on_mnist(mnist):
    """LeNet-5 on two GPUs (level 6's step on each, cuDNN's convolutions, NCCL summing its one gradient buffer): every
    step against level 1's single-process step of the whole batch (batch 13, shares of 7 and 6, a partial last
    batch), level 6's LeNet-5 on one GPU beside it; then the replicas bit for bit. It says what ran."""
    two_gpus()
    import torch

    from level6_cublas import LeNet as Level6LeNet

    X, y, params = mnist[0][:160], mnist[1][:160], lenet.init_params(0)
    with LeNet(params, device="cuda") as model:
        ran = model.variant()
        records, steps = lockstep({"level6": Level6LeNet(params), "level9": model}, params, X, y, 13, shuffle=True,
                                  net="lenet")
        first, second = model.replica_states()
    assert ran["device"] == "cuda" and ran["gpu"] == torch.cuda.get_device_name(0) and ran["workers"] == str(WORLD)
    assert ran["convolution"] == "direct" and ran["nccl"].count(".") == 2
    for label, record in records.items():
        assert record.failure is None, f"{label}: {record.failure}"
        assert len(record.used) == steps
    for name in lenet.PARAM_NAMES:
        assert first[name].tobytes() == second[name].tobytes(), name
    print(f"LeNet-5, batch 13, {ran}: largest share of the allowance used over {steps} steps: "
          + ", ".join(f"{label} {max(record.used):.3f}" for label, record in records.items()))


@pytest.mark.gpu
def test_on_two_gpus_a_lenet_epoch_replayed_as_a_graph_is_its_steps_one_by_one(mnist):
    """LeNet-5's whole batches replay one captured step, the all-reduce inside it; the same steps made one native call
    each (queued, no graph) give the very same losses and weights, on both replicas."""
    two_gpus()
    X, y, params = mnist[0][:300], mnist[1][:300], lenet.init_params(0)
    order = epoch_order(len(X), 0, 0, True)
    with LeNet(params, device="cuda") as graphed, LeNet(params, device="cuda") as stepped:
        losses = graphed.train_epoch(X, y, 8, 0.05, order)
        one_by_one = [stepped.train_epoch(X, y, 8, 0.05, order[start : start + 8])[0] for start in range(0, 300, 8)]
        assert losses.tobytes() == np.array(one_by_one, np.float32).tobytes()
        for first, second in zip(graphed.replica_states(), stepped.replica_states()):
            for name in lenet.PARAM_NAMES:
                assert first[name].tobytes() == second[name].tobytes(), name


@pytest.mark.gpu
@pytest.mark.parametrize("batch, n", [(1, 6), (3, 7)], ids=["b1", "b3-last-of-1"])
def test_on_two_gpus_a_rank_without_rows_adds_nothing(mnist, batch, n):
    """Batches of fewer rows than GPUs (every batch of 1; a last batch of 1): the rank without a row steps on a
    stand-in weighted 0, and the step is still level 1's, also for the loss and gradients of one row."""
    two_gpus()
    X, y, params = mnist[0][:n], mnist[1][:n], init_params(0, 32)
    with MLP(params, device="cuda") as model:
        records, steps = lockstep({"level9": model}, params, X, y, batch)
        assert records["level9"].failure is None and len(records["level9"].used) == steps
        state = model.state_dict()
        loss, grads = model.loss_and_grads(X[:1], y[:1])
    expected_loss, expected = Level3(state).loss_and_grads(X[:1], y[:1])
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for name in PARAM_NAMES:
        np.testing.assert_allclose(grads[name], expected[name], rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_the_step_times_on_one_and_two_gpus_say_what_ran():
    """DDP's timer and the course's (level 6 on one GPU, level 9 on two), and the kernel profile of one GPU's step."""
    two_gpus()
    import torch

    for world in (1, WORLD):
        for net, size, computes in (("mlp", (64, 32), {"matmul": "cublas"}),
                                    ("lenet", (None, 32), {"convolution": "direct"})):
            rows, ran = scaling.step_times([size], world, net)
            own_rows, own = scaling.level_step_times([size], world, net)
            for timed in (rows, own_rows):
                assert len(timed[size]) == scaling.ROUNDS and min(timed[size]) > 0
            assert ran["world"] == world and ran["ddp"] == (world > 1) and ran["tf32"] is False and ran["net"] == net
            assert own["world"] == world and own["level"] == ("level6" if world == 1 else "level9")
            assert own["device"] == torch.cuda.get_device_name(0) and own["net"] == net
            assert {key: own[key] for key in computes} == computes
    profile = scaling.kernel_profile(64, 32, steps=2)
    assert profile["ran"]["device"] == torch.cuda.get_device_name(0) and profile["ran"]["tf32"] is False
    for label in ("level6", "torch"):
        names = [name for name, us in profile[label] if us > 0]
        assert any("gemm" in name for name in names), (label, names)
    assert any(name.startswith("relu_forward_kernel") for name, _ in profile["level6"])  # level 6's own kernels seen


class _RecordingModel:
    """A stand-in for level 9's GPU library: records each native epoch's batch size, rows and the scale in force."""

    def __init__(self, replica):
        self.replica, self.calls = replica, []

    def train_epoch(self, X, y, batch_size, lr, order):
        self.calls.append((batch_size, order.tolist(), float(self.replica.scale)))
        return np.ones(-(-len(order) // batch_size), np.float32)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_gpu_worker_steps_on_its_shares_with_its_scale_and_a_stand_in_for_no_rows(rank):
    """GPUReplica's bookkeeping, without a GPU: 7 rows in batches of 3 over 2 ranks. Rank 0 takes 2 of each whole batch
    and the last batch's one row; rank 1 takes 1 of each whole batch and, with no row of its own in the last batch,
    steps on a stand-in weighted 0. The whole batches go in one native call, the last in a second, and each step's
    loss is weighted by the rank's scale before the ranks' losses are summed."""
    from level9_data_parallel.mlp import GPUReplica

    replica = GPUReplica.__new__(GPUReplica)  # no NCCL, no process group: only the share arithmetic runs
    replica.rank, replica.world, replica.bug, replica.scale = rank, WORLD, None, np.float32(1)
    replica.X = replica.y = None
    replica.model = _RecordingModel(replica)
    replica._batch_loss = lambda weighted: weighted  # this rank's weighted losses, before the sum over the ranks
    losses = replica.epoch(np.arange(7), 3, np.float32(0.1))
    expected = {0: [(2, [0, 1, 3, 4], 2 / 3), (1, [6], 1.0)], 1: [(1, [2, 5], 1 / 3), (1, [6], 0.0)]}[rank]
    assert [(b, rows, pytest.approx(s)) for b, rows, s in replica.model.calls] == expected
    assert losses.tolist() == pytest.approx([expected[0][2]] * 2 + [expected[1][2]])
