"""The main job: train every level this machine can run on the same data, from the same weights, and verify each.

    python -m common.harness.compare [--model lenet] [--optimizer adam] [--levels 1,3,4] [--epochs 10] [--batch 8] ...
    make compare ARGS="--levels 1,3,4"          make compare ARGS="--model lenet"       ARGS="--optimizer adam"

The network is one of common/nets' list (the MLP by default), the optimizer one of common/nets/optimizers.py's (SGD
by default). Every level that implements both gets the same initial weights (the network's init_params) and visits
the same batches in the same order. Each level's uninterrupted run is timed; then each is verified against level 1 on
the CPU, the gold standard, by the two checks of common/harness/verify.py: lockstep at every step of the run, and its
free run against float32 noise measured by level 1's float64 twin. Writes results.json and two plots
(loss_curves.png, lockstep.png) to the output folder, prints one table, and exits non-zero when a level
fails a check or diverges (on a GPU the peers of level1_pytorch/peers.py are checked too; their verdicts are reported).

Before training it says how long the job will take (estimate), and at the end how long it took. Level 1 on the CPU
is timed on one PyTorch thread at a small step (ONE_THREAD_BELOW), and its row says how many it ran on. The machine's
load is checked around the timed rows (busy): where other programs took the cores, one WARNING line says the times
are not to be trusted, and results.json records why. --wide shows every column, --verbose where the time went and
each tie.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common.contract import immutable
from common.harness import compile_cache, parallel, verify
from common.harness.data import load_mnist, normalize
from common.harness.phases import Phases
from common.levels import LEVELS, ROOT, THE_MLP, Level, gpu_available, level, missing
from common.nets import NETWORKS, Network, get, optimizers
from common.nets.mlp import HIDDEN
from level1_pytorch.peers import COMPILING, NAMES as PEERS  # on a GPU, the yardsticks of speed; which compile

REFERENCE = "level1[cpu]"
WARM_UP = "one untimed epoch first (then the initial weights back), then each epoch timed"  # train() does it
# A row's rounds (--rounds: the timed run again, on the row's warm model, each round over every row) must agree:
# its slowest round at most this many times its fastest (each round's median epoch). A row past it is flagged
# "unsteady" and its time and ratios are not published: one disturbed run must not set a number.
STEADY_RATIO = 1.2
# A later round times the run's first epochs again: the spread needs each round's median epoch, not a whole run (the
# first round's run, the one verified and plotted, is whole). As many as last LATER_ROUND_SECONDS at the first round's
# pace, at most LATER_ROUND_EPOCHS: a long epoch (PyTorch eager's 1,250 steps at batch 8, 2 s on an H200) is timed once
# a round, a short one (20 steps of LeNet-5 at batch 256) three times, its median steadier than any one of them.
LATER_ROUND_EPOCHS = 3
LATER_ROUND_SECONDS = 1.0
PROGRESS = "progress.jsonl"  # the rounds timed so far, a line after each row's round, for --resume
PARALLEL_FROM = 20_000  # level-steps (a level's step checked in lockstep) from which the lockstep runs in processes
# PyTorch's threads on the CPU wait for each other by spinning: on a small step they wait more than they work, and
# where another program holds a core they lose it and the step slows severalfold. Measured on 2 cores, level 1 at the
# chapter's batch 8 (6.5 MFLOP a step): 578 us/step on one thread, 623 on two; with one busy program beside it, 617
# and 3,007. Two threads gain only 1.11x at batch 32 (26 MFLOP) and 1.20x at batch 64 (52 MFLOP) on a quiet machine.
# So level 1 on the CPU runs on one thread below this many FLOPs a step (the MLP's chapter run, LeNet-5's at batch 16:
# 24 MFLOP), as a user on a busy laptop should run it, and on PyTorch's default (a thread per core) above.
ONE_THREAD_BELOW = 100e6
# The machine's load, checked around the timed rows (busy): a fixed loop (calibrate) timed before and after them, whose
# two times may differ by at most this factor, and the load average (1 minute), which may not pass the core count ...
BUSY_RATIO = 1.3
# ... and the CPU time the other programs took meanwhile, in cores (Linux): NumPy's BLAS threads, like PyTorch's, spin
# while they wait for each other, so a program beside them on one core slows a multi-threaded row severalfold (level 3
# at batch 8 ran 4,734 us/step here, against 396 on a quiet machine, while two other programs used a core on average).
BUSY_CORES = 0.5
# The estimate of a job's time before it starts (estimate): every step at level 1's pace, measured on PACE_STEPS steps;
# a step of the float64 twin costs TWIN_COST of level 1's, a level's step checked in lockstep LOCKSTEP_COST (level 1's
# step on one thread, its float64 step, the level's, the comparison and the search for ties), plus FIXED_S (imports,
# the checks of the machine's load, the plots). Read from results/cpu-2core/chapter (2 cores: 182 s in all, level 1 at
# 387 us/step) and from small runs on the same machine; an estimate within a factor of two, not a promise.
PACE_STEPS = 64
TWIN_COST = 1.5
LOCKSTEP_COST = 15.0
FIXED_S = 8.0


@dataclass
class Run:
    """One implementation on one device: its free run (losses, times, test predictions) and its verdicts."""

    label: str
    level: int
    device: str
    factory: Callable  # params -> a fresh model of this implementation
    asked: dict = field(default_factory=dict)  # what the run asked for: its device and options (a convolution, ...)
    ran: dict = field(default_factory=dict)  # what the trained model says it computed with (its variant())
    losses: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)  # of the first round, the run that is verified
    rounds: list[float] = field(default_factory=list)  # each round's median epoch, in seconds
    test_accuracy: float = 0.0
    predictions: np.ndarray | None = None
    lockstep: dict | None = None  # verify.LockstepRecord.summary()
    free_run: dict | None = None  # verify.FreeRun
    failure: str | None = None  # why the level failed, or None


def runs_for(numbers: list[int], gpu: bool) -> list[tuple[Level, str]]:
    """(level, device) pairs to train: level 1 on the CPU first (the reference), then on CUDA if there is a GPU; a
    level that takes a device (level 8) likewise."""
    pairs = []
    for number in numbers:
        lv = level(number)
        if not lv.trains:
            continue
        if lv.takes_device:
            pairs.append((lv, "cpu"))
            if gpu:
                pairs.append((lv, "cuda"))
        else:
            pairs.append((lv, "cuda" if "gpu" in lv.needs else "cpu"))
    return pairs


@dataclass(frozen=True)
class Factory:
    """params -> a fresh model: a level's class for a network with its options (and its device, for the levels that
    take one), or a peer's. Plain data, so that a worker process of the lockstep (common/harness/parallel.py) can
    make its own."""

    network: str
    device: str
    level: int = 0  # a level's number, or
    peer: str = ""  # a peer's name (level1_pytorch/peers.py)
    options: tuple[tuple[str, str], ...] = ()

    def __call__(self, params):
        from level1_pytorch.peers import peers

        network = get(self.network)
        if self.peer:
            return peers(network)[self.peer](params)
        lv = level(self.level)
        device = {"device": self.device} if lv.takes_device else {}
        return lv.load(network)(params, **device, **dict(self.options))


def factory(lv: Level, device: str, network: Network = THE_MLP, **options) -> Factory:
    """params -> a fresh model of the level for a network, given every option (a convolution, a matrix product); the
    levels that run on either device (1, 8) also take their device (the others have one)."""
    return Factory(network.name, device, level=lv.number, options=tuple(options.items()))


def row_label(lv: Level, device: str, options: dict[str, str]) -> str:
    """A row's name: the level, its device and its options' values, as in level5[cuda, tiled]."""
    return f"{lv.name}[{', '.join([device, *options.values()])}]"


def mismatch(asked: dict, ran: dict) -> str | None:
    """Why a model did not run what was asked of it (a device or an option it reports otherwise), or None."""
    wrong = [f"{key} {value!r} asked for, {ran.get(key)!r} ran" for key, value in asked.items()
             if ran.get(key) != value]
    return "; ".join(wrong) or None


def peer_runs(network: Network) -> list[Run]:
    """The peers of a network on the GPU that this machine has (level1_pytorch/peers.py), for the speed columns;
    verified like the levels."""
    from level1_pytorch.peers import peers

    return [Run(f"{name}[cuda]", 1, "cuda", Factory(network.name, "cuda", peer=name), {"device": "cuda"})
            for name in peers(network)]


def missing_peers(network: Network) -> dict[str, str]:
    """The network's peers this machine lacks, and why."""
    from level1_pytorch.peers import missing

    return {name: why for name in network.peers if (why := missing(name))}


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """The visiting order of one epoch: in order, or a seeded permutation - the same for every level."""
    if not shuffle:
        return np.arange(n, dtype=np.int32)
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int32)


def cpu_threads(network: Network, batch: int, hidden: int) -> int | None:
    """The PyTorch threads level 1 on the CPU is timed with: one for a step under ONE_THREAD_BELOW FLOPs, else None
    (PyTorch's default, a thread per core)."""
    return 1 if network.network.flops_per_step(batch, hidden) < ONE_THREAD_BELOW else None


def threads_of(run: Run):
    """The block in which a run trains: on the threads its row asks for (verify.torch_threads), else as it is."""
    return verify.torch_threads(run.asked["threads"]) if "threads" in run.asked else nullcontext()


def ran(model, run: Run) -> dict:
    """What a model says it computed with (its variant()), and for PyTorch on the CPU its threads, read from torch."""
    if run.level != 1 or run.device != "cpu":
        return model.variant()
    import torch

    return {**model.variant(), "threads": torch.get_num_threads()}


def train(model, run: Run, params, X, y, X_test, y_test, orders, args, quiet: bool, clock: Phases,
          warm_up: bool = True) -> Run:
    """The free run: args.epochs epochs, each timed on its own; stops after an epoch whose loss is not finite.

    A model made for this run is warmed up first (warm_up): one untimed epoch, so that the CUDA context, library
    handles, the upload, graph captures and compilation (torch.compile's, XLA's) are done before the clock starts and
    every timed epoch is a warm one. Every timed run starts from the initial parameters (and Adam's state forgotten),
    as the lockstep's does. The first call for a run keeps its losses and predictions (the run that is verified); a
    later call, a later round on the same warm model, adds its time only, over the run's first later_round_epochs. An
    untimed run (an honest run) needs no warm-up."""
    with threads_of(run):  # level 1 on the CPU: on the threads its row asks for (ONE_THREAD_BELOW)
        first = not run.rounds
        if warm_up:
            with clock(f"{run.label}: warm-up epoch"):
                model.train_epoch(X, y, args.batch, args.lr, orders[0])
        restart(model, run, params)
        run.ran = ran(model, run)
        if why := mismatch(run.asked, run.ran):  # never time one thing under another's name
            run.failure = f"ran something else than its row says: {why}"
        seconds = []
        timed = time.perf_counter()
        timed_orders = orders if first else orders[:later_round_epochs(run, len(orders))]
        for order in tqdm(timed_orders, desc=run.label, disable=quiet, leave=False):
            start = time.perf_counter()
            losses = model.train_epoch(X, y, args.batch, args.lr, order)  # returns host memory: the GPU is done
            seconds.append(time.perf_counter() - start)
            if first:
                run.losses.extend(losses.tolist())
            if not np.isfinite(losses).all():
                break
        run.rounds.append(float(np.median(seconds)))
        clock.add(f"{run.label}: timed epochs", time.perf_counter() - timed)
        if first:
            run.epoch_seconds = seconds
            with clock(f"{run.label}: the test set"):
                run.predictions = model.forward(X_test).argmax(axis=1)
            run.test_accuracy = float((run.predictions == y_test).mean())
        return run


def later_round_epochs(run: Run, epochs: int) -> int:
    """The epochs a later round of a run times: as many of its first as last LATER_ROUND_SECONDS at its first round's
    pace (its median epoch), at least one, at most LATER_ROUND_EPOCHS and the run's own."""
    wanted = np.ceil(LATER_ROUND_SECONDS / run.rounds[0]) if run.rounds[0] > 0 else LATER_ROUND_EPOCHS
    return int(min(max(wanted, 1), LATER_ROUND_EPOCHS, epochs))


def restart(model, run: Run, params) -> None:
    """The model back at the initial parameters, and Adam's moments and step count forgotten: a timed run starts at a
    first step, as the lockstep's does, not where the warm-up or an earlier round left it."""
    model.load_state_dict(params)
    if "optimizer" in run.asked:
        model.load_optimizer_state({})


def pace(run: Run, params, X, y, args) -> float:
    """Seconds a step of level 1 (the run) takes here, now: a fresh model's first steps (after 8 untimed), on its
    row's threads."""
    model, steps = run.factory(params), min(PACE_STEPS, -(-len(X) // args.batch))
    with threads_of(run):
        model.train_epoch(X[: 8 * args.batch], y[: 8 * args.batch], args.batch, args.lr)
        start = time.perf_counter()
        model.train_epoch(X[: steps * args.batch], y[: steps * args.batch], args.batch, args.lr)
        return (time.perf_counter() - start) / steps


def estimate(rows: int, steps: int, step_s: float, args) -> float:
    """Seconds the job will take, roughly, at level 1's pace (step_s) for every step: each row's warm-up epoch and its
    epochs in each round (a later one at most LATER_ROUND_EPOCHS of them), level 1's honest runs (the float64 twin's
    at TWIN_COST, and its reruns), and the lockstep's steps at LOCKSTEP_COST, over --jobs; and FIXED_S."""
    epochs = 1 + args.epochs + (args.rounds - 1) * min(LATER_ROUND_EPOCHS, args.epochs)
    training = rows * epochs * steps + (TWIN_COST + verify.HONEST_SAMPLES) * args.epochs * steps
    lockstep = LOCKSTEP_COST * (rows - 1) * args.epochs * steps / args.jobs
    return FIXED_S + step_s * (training + lockstep)


def calibrate() -> float:
    """Seconds of a fixed piece of work, Python's and NumPy's (a product on BLAS's threads, which lose their cores to
    another process as PyTorch's do): the median of three, after one untimed: about 0.3 s on a quiet machine."""
    a, b = np.ones((128, 784), np.float32), np.ones((784, 256), np.float32)

    def work() -> float:
        start = time.perf_counter()
        total = 0
        for i in range(100_000):
            total += i * i
        for _ in range(50):
            a @ b
        return time.perf_counter() - start

    work()
    return float(np.median([work() for _ in range(3)]))


def snapshot() -> dict:
    """The machine's counters at a moment: the load average over the last minute, the CPU seconds every process has
    used (Linux's /proc/stat; None elsewhere) and this job's, and the clock."""
    try:
        with open("/proc/stat") as stat:  # cpu  user nice system idle iowait irq softirq steal ...
            ticks = [int(x) for x in stat.readline().split()[1:9]]
        everyone = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        everyone = None
    ours = os.times()
    return {"load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "cpu_s": everyone,
            "own_cpu_s": ours.user + ours.system + ours.children_user + ours.children_system,
            "wall_s": time.perf_counter()}


def busy(before: dict, after: dict, calibration: list[float], cores: int) -> tuple[str | None, float | None]:
    """Why the machine was too busy while the rows were timed (between two snapshots, the fixed loop timed just before
    and just after) for their times to be trusted, or None; and how many cores the other programs used on average,
    where the system says. Too busy: the others used more than BUSY_CORES, or the loop's two times are more than
    BUSY_RATIO apart; where the system does not say (no /proc/stat), the load average passed the core count. The load
    average counts this job's own processes too (level 9's workers), so it is only the fallback."""
    why, others = [], None
    if before["cpu_s"] is not None and after["cpu_s"] is not None:
        wall = max(after["wall_s"] - before["wall_s"], 1e-9)
        others = max(after["cpu_s"] - before["cpu_s"] - (after["own_cpu_s"] - before["own_cpu_s"]), 0.0) / wall
        if others > BUSY_CORES:
            why.append(f"other programs used {others:.1f} of its {cores} cores")
    first, last = calibration
    if max(first, last) > BUSY_RATIO * min(first, last):
        why.append(f"a fixed loop took {first * 1e3:.0f} ms before the timed rows and {last * 1e3:.0f} ms after, more "
                   f"than {BUSY_RATIO}x apart")
    if others is None and (high := max(x for x in (before["load_average"], after["load_average"], 0.0)
                                       if x is not None)) > cores:
        why.append(f"the load average reached {high:.1f} on {cores} cores")
    return "; ".join(why) or None, others


def verify_runs(runs: list[Run], params, X, y, X_test, y_test, orders, args, quiet: bool, clock: Phases,
                workers: Phases) -> Run:
    """Set each run's verdict: diverged, or lockstep and free run against level 1 (runs[0]). Returns level 1's float64
    twin's run; it and level 1's reruns with permuted rows (honest_runs), the yardstick of the free runs, are made
    beside the lockstep where it runs in --jobs processes (whose time by level `workers` gets)."""
    reference, network, optimizer = runs[0], args.network, args.optimizer
    twin_options = {"dtype": "float64", **optimizer.options}
    threads = {k: v for k, v in reference.asked.items() if k == "threads"}  # level 1's, as the rule set them
    twin = Run("level1[cpu, float64]", 1, "cpu", factory(level(1), "cpu", network, **twin_options),
               {"device": "cpu", **twin_options, **threads})
    for run in runs:
        if (why := verify.divergence(run.losses, args.lr, X)) is not None:
            run.failure = run.failure or why
    checked = [run for run in runs[1:] if not run.failure]
    if args.jobs > 1 and checked and not reference.failure:
        data = TrainingData(args.train_size, args.repeat)
        records, reference_diverged, (twin, *samples) = parallel.lockstep(
            {run.label: run.factory for run in checked}, params, data, orders, args.batch, args.lr, args.jobs,
            network, optimizer, clock, workers,
            [partial(honest_run_of, k, twin, reference, params, data, orders, args.batch, args.lr)
             for k in range(1 + verify.HONEST_SAMPLES)],
            compiling=frozenset(run.label for run in checked if run.factory.peer in COMPILING))
    else:
        twin, *samples = honest_runs(twin, reference, params, X, y, X_test, y_test, orders, args, clock)
        if reference.failure:
            for run in runs[1:]:
                run.failure = run.failure or f"not verified: the reference {reference.label} {reference.failure}"
            return twin
        steps = Phases()
        with clock("lockstep: the models made"):
            models = {run.label: run.factory(params) for run in checked}
        records, reference_diverged = verify.lockstep(models, params, X, y, orders, args.batch, args.lr, quiet,
                                                      network, optimizer, steps)
        clock.merge(steps.seconds, "lockstep: ")
    noise = verify.free_run_noise(reference.losses, twin.losses, reference.predictions, twin.predictions, args.epochs,
                                  [(sample.losses, sample.predictions) for sample in samples])
    for run in checked:
        record = records[run.label]
        run.lockstep = {**record.summary(), "record": record}
        free = verify.check_free_run(run.losses, reference.losses, run.test_accuracy, reference.test_accuracy,
                                     len(y_test), noise, args.epochs)
        run.free_run = {**asdict(free), "used": free.used, "noise": noise}
        if reference_diverged:
            run.failure = f"not verified: {reference_diverged}"
        elif record.failure:
            run.failure = f"lockstep: {record.failure}"
        elif free.failure:
            run.failure = f"free run: {free.failure}"
    return twin


def machine() -> dict[str, str]:
    """What the numbers were measured on."""
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpu": platform.processor()}
    try:
        info["cpu"] = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    info["cpu_count"] = str(os.cpu_count())
    import torch

    info["numpy"], info["torch"] = np.__version__, torch.__version__
    if gpu_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda_runtime"] = str(torch.version.cuda)
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        info["driver"] = smi.stdout.strip()
    return info


def steady(run: Run) -> bool:
    """Whether a run's rounds agree (STEADY_RATIO)."""
    return max(run.rounds) <= STEADY_RATIO * min(run.rounds)


def summarize(runs: list[Run], args, steps_per_epoch: int) -> list[dict]:
    """One table row per run. A run's time is the median of its rounds, each the median of its epochs (one disturbed
    epoch cannot move it; one disturbed round cannot either, and makes its row unsteady). Speedups are against level 1
    on the CPU and, on a GPU, against each peer, all measured in this same run, between steady rows only."""
    def median_epoch(run: Run) -> float | None:
        return float(np.median(run.rounds)) if steady(run) else None

    def ratio(theirs: float | None, ours: float | None) -> float | None:
        return theirs / ours if theirs and ours else None

    reference = median_epoch(runs[0])
    peer = {name: next((median_epoch(r) for r in runs if r.label == f"{name}[cuda]"), None) for name in PEERS}
    rows = []
    for run in runs:
        epoch = median_epoch(run)
        rows.append({
            "level": run.label,
            "device": run.device,
            "ran": run.ran,
            "train_s": float(sum(run.epoch_seconds)),
            "rounds": len(run.rounds),
            # the epochs each later round timed, from the first round's pace (None: no later round)
            "later_round_epochs": later_round_epochs(run, args.epochs) if len(run.rounds) > 1 else None,
            "steady": steady(run),
            "epoch_s_median": epoch,
            "epoch_s_rounds": run.rounds,
            "epoch_s_spread": [float(min(run.epoch_seconds)), float(max(run.epoch_seconds))],
            "us_per_step": 1e6 * epoch / steps_per_epoch if epoch else None,
            "us_per_step_range": [1e6 * min(run.rounds) / steps_per_epoch, 1e6 * max(run.rounds) / steps_per_epoch],
            "steps_per_s": steps_per_epoch / epoch if epoch else None,
            "speedup_vs_level1": ratio(reference, epoch),
            **{f"speedup_vs_{short}": ratio(peer[name], epoch) for name, short in PEERS.items()},
            "gflops": (args.network.network.flops_per_step(args.batch, args.hidden) * steps_per_epoch / epoch / 1e9
                       if epoch else None),
            "final_loss": float(np.mean(run.losses[-steps_per_epoch:])),
            "test_accuracy": run.test_accuracy,
            "lockstep_used": run.lockstep["max_used"] if run.lockstep else None,
            "ties": len(run.lockstep["ties"]) if run.lockstep else None,
            "free_run_used": run.free_run["used"] if run.free_run else None,
            "agrees": run.failure is None,
            "failure": run.failure,
        })
    return rows


def _times(r: dict, wide: bool = True) -> str:
    """us/step: the median of the rounds, with their range when there are several (wide); withheld when they
    disagree."""
    low, high = r["us_per_step_range"]
    if not r["steady"]:
        return f"unsteady {low:.1f}-{high:.1f}" if wide else "unsteady"
    return f"{r['us_per_step']:.1f}" + (f" ({low:.1f}-{high:.1f})" if wide and r["rounds"] > 1 else "")


def _verdict(r: dict) -> str:
    return "ok" if r["agrees"] else ("DIVERGED" if "diverged" in (r["failure"] or "") else "FAIL")


def _number(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def table(rows: list[dict], markdown: bool = False, wide: bool = False) -> str:
    """The results table, as text (a terminal, a chapter) or Markdown (README, results/README.md): speed against
    level 1 and each peer of this run, and the two checks against level 1. lockstep and free run: the largest share of
    its allowance a level used (1.00 = at the limit; above: FAIL). The text's default view fits a terminal (about 110
    columns with four peers); wide (and Markdown) adds the train time, the rounds' range, steps/s, GFLOP/s, the loss
    and the test accuracy. Every table of the course is written here; legend() says what its columns mean."""
    wide = wide or markdown
    peers = [short for short in PEERS.values() if any(r.get(f"speedup_vs_{short}") for r in rows)]
    columns = [  # (heading, left-aligned, the cell of a row, in the default view)
        ("implementation", True, lambda r: r["level"], True),
        ("train s", False, lambda r: f"{r['train_s']:.2f}", False),
        ("us/step" + (" (range)" if wide and any(r["rounds"] > 1 for r in rows) else ""), False,
         partial(_times, wide=wide), True),
        ("steps/s", False, lambda r: _number(r["steps_per_s"], ".0f"), False),
        ("vs L1 cpu", False, lambda r: _number(r["speedup_vs_level1"], ".2f", "x"), True),
        *((f"vs {short}", False, lambda r, short=short: _number(r.get(f"speedup_vs_{short}"), ".2f", "x"), True)
          for short in peers),
        ("GFLOP/s", False, lambda r: _number(r["gflops"], ".2f"), False),
        ("loss", False, lambda r: f"{r['final_loss']:.4f}", False),
        ("test acc", False, lambda r: f"{r['test_accuracy']:.4f}", False),
        ("lockstep", False, lambda r: _number(r["lockstep_used"], ".2f"), True),
        ("ties", False, lambda r: _number(r["ties"], "d"), True),
        ("free run", False, lambda r: _number(r["free_run_used"], ".2f"), True),
        ("check", True, _verdict, True),
    ]
    columns = [(head, left, cell) for head, left, cell, default in columns if wide or default]
    cells = [[cell(r) for _, _, cell in columns] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head for head, _, _ in columns) + " |",
                 "|" + "".join("---|" if left else "---:|" for _, left, _ in columns)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])
    widths = [max(len(head), *(len(row[i]) for row in cells)) for i, (head, _, _) in enumerate(columns)]
    align = [(str.ljust if left else str.rjust) for _, left, _ in columns]
    head = "  ".join(a(h, w) for (h, _, _), a, w in zip(columns, align, widths)).rstrip()
    return "\n".join([head, "-" * len(head)] + ["  ".join(a(c, w) for c, a, w in zip(row, align, widths)).rstrip()
                                                 for row in cells])


def legend(rows: list[dict]) -> str:
    """What the table's numbers are, in lines under it: the units, and the threads level 1 ran on where it says."""
    accuracy = next((f" (level 1's: {r['test_accuracy']:.4f})" for r in rows if r["level"] == REFERENCE), "")
    lines = ["us/step: microseconds per training step; vs X: X's time per step over this row's (2.00x: twice as fast).",
             "lockstep, free run: the largest share of its allowance a check used, 1.00 = the limit (above: FAIL).",
             f"The free run checks each epoch's mean loss and test accuracy{accuracy}; ties: lockstep's, explained."]
    threads = [f"{r['level']} on {n} PyTorch thread{'s' if n > 1 else ''}" for r in rows
               if (n := r.get("ran", {}).get("threads"))]
    if threads:
        lines.append(f"threads, read from torch: {', '.join(threads)} (one below {ONE_THREAD_BELOW / 1e6:.0f} MFLOP "
                     "a step:\n  a small step's threads wait for each other more than they work).")
    return "\n".join(lines)


def print_table(rows: list[dict], wide: bool = False) -> None:
    """The table a student reads, as text, and its legend."""
    print(table(rows, wide=wide) + "\n" + legend(rows))


def plot(runs: list[Run], twin: Run, out: Path, title: str, epochs: int) -> None:
    """loss_curves.png and lockstep.png (common/harness/plots.py)."""
    from common.harness import plots

    plots.loss_curves(runs, twin, out, title, epochs)
    plots.lockstep(runs, out, title, epochs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mlp", choices=[n.name for n in NETWORKS], help="the network (common/nets)")
    p.add_argument("--optimizer", default=optimizers.DEFAULT, choices=[o.name for o in optimizers.OPTIMIZERS],
                   help="the update (common/nets/optimizers.py); only the levels that implement it run")
    p.add_argument("--levels", default=None, help="comma-separated level numbers (default: every level of the model)")
    p.add_argument("--epochs", type=int, help="default: the model's chapter run (common/nets)")
    p.add_argument("--train-size", type=int, help="the first N training images (default: the chapter run's)")
    p.add_argument("--batch", type=int, help="default: the chapter run's")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="the MLP's hidden units (LeNet-5 has fixed sizes)")
    p.add_argument("--lr", type=float, help="default: the optimizer's (Adam's: PyTorch's 1e-3), else the chapter run's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shuffle", action="store_true", help="a seeded permutation per epoch, the same for every level")
    p.add_argument(
        "--repeat", action="store_true", help="if the data set is smaller than --train-size, repeat it (for timing)"
    )
    p.add_argument("--out", type=Path, default=ROOT / "results" / "local", help="folder for results.json and plots")
    p.add_argument("--quiet", action="store_true", help="no progress bars (also when not on a terminal or in CI)")
    p.add_argument("--no-peers", action="store_true", help="on a GPU, leave out the peers (level1_pytorch/peers.py)")
    p.add_argument("--gpu-only", action="store_true", help="the rows on the GPU only, and level 1 on the CPU, the "
                   "reference (make bench on a GPU machine: the CPU levels are timed on a CPU machine)")
    p.add_argument("--resume", action="store_true", help="take the rounds already timed from the output folder's "
                   f"{PROGRESS} (a run of the same settings that was stopped), and time the rest")
    p.add_argument("--jobs", type=int, default=None, help="processes for the lockstep (default: one for a run of "
                   f"fewer than {PARALLEL_FROM:,} level-steps, else one per core)")
    p.add_argument("--wide", action="store_true", help="the table with every column: train time, the rounds' range, "
                   "steps/s, GFLOP/s, the loss and the test accuracy (results.json has them all)")
    p.add_argument("--verbose", action="store_true", help="also where the time went, phase by phase, and each tie")
    p.add_argument("--rounds", type=int, default=1, help="time every row this many times, in rounds over the rows "
                   f"(make bench: 3); a row whose rounds differ by more than {STEADY_RATIO}x is flagged, not published")
    args = p.parse_args(argv)
    network = args.network = get(args.model)  # the network, resolved once: everything after is handed this entry
    optimizer = args.optimizer = optimizers.get(args.optimizer)  # likewise the optimizer
    if args.lr is None and optimizer.lr is not None:
        args.lr = optimizer.lr
    for name, value in network.run.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.levels is None:
        args.levels = ",".join(str(lv.number) for lv in LEVELS if lv.trains and lv.number in network.levels)
    try:
        args.levels = [int(n) for n in args.levels.split(",")]
    except ValueError:
        p.error(f"--levels takes comma-separated level numbers, e.g. 1,3,4; got {args.levels!r}")
    if unknown := [n for n in args.levels if n not in [lv.number for lv in LEVELS]]:
        p.error(f"no level {unknown[0]}: the levels are {','.join(str(lv.number) for lv in LEVELS)}")
    if not network.has_hidden and args.hidden != HIDDEN:
        p.error(f"--hidden sizes the MLP; {network.title} has fixed sizes")
    if 1 not in args.levels:
        p.error("level 1 is the gold standard every level is checked against: include it in --levels")
    for name in ("epochs", "train_size", "batch", "hidden", "rounds", "jobs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.seed < 0:
        p.error(f"--seed must be >= 0 (NumPy's seeds are), got {args.seed}")
    if not (np.isfinite(args.lr) and args.lr >= 0):
        p.error(f"--lr must be a finite number >= 0, got {args.lr}")
    try:  # before the training, not after it
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / ".writable").touch()
        (args.out / ".writable").unlink()
    except OSError as e:
        p.error(f"--out {args.out}: cannot write there ({e.strerror or e})")
    return args


def training_set(data, args, notes: bool = True) -> tuple[np.ndarray, np.ndarray, int]:
    """X, y of the first --train-size images (repeated with --repeat when the set is smaller), and N."""
    images, labels = data.train_images, data.train_labels
    if args.train_size > len(images) and args.repeat:
        copies = -(-args.train_size // len(images))
        if notes:
            print(f"NOTE: this data set has {len(images):,} training images: repeating them {copies} times (--repeat)")
        # immutable like the originals (common/contract), so that a level uploads the data set once, not per epoch
        labels = immutable(np.tile(labels, copies))
        images = np.tile(images, (copies, 1))
    n = min(args.train_size, len(images))
    if n < args.train_size and notes:
        print(f"NOTE: asked for {args.train_size:,} training images, this data set has {n:,}: training on {n:,}")
    return normalize(images[:n]), labels[:n], n


@dataclass(frozen=True)
class TrainingData:
    """() -> (X, y): the run's training set (training_set), read again from the data set's cache: a worker process's
    own copy, instead of the arrays sent to every worker."""

    train_size: int
    repeat: bool

    def __call__(self) -> tuple[np.ndarray, np.ndarray]:
        X, y, _ = training_set(load_mnist(quiet=True), self, notes=False)
        return X, y


def honest_runs(twin: Run, reference: Run, params, X, y, X_test, y_test, orders, args, clock: Phases) -> list[Run]:
    """Level 1's honest runs, the yardstick of float32 noise (verify.free_run_noise), untimed: its float64 twin's, then
    verify.HONEST_SAMPLES of level 1's own with the rows of each batch permuted."""
    return [honest_run(k, twin, reference, params, X, y, X_test, y_test, orders, args, clock)
            for k in range(1 + verify.HONEST_SAMPLES)]


def honest_run(k: int, twin: Run, reference: Run, params, X, y, X_test, y_test, orders, args, clock: Phases) -> Run:
    """Honest run k: the float64 twin's (k = 0), or level 1's own with the rows of each batch permuted by sample k."""
    run = twin if k == 0 else Run(f"{reference.label} rows permuted ({k})", 1, reference.device, reference.factory,
                                  reference.asked)
    run_orders = [verify.rows_permuted(order, args.batch, k) for order in orders] if k else orders
    with clock(f"{run.label}: made"):
        model = run.factory(params)
    return train(model, run, params, X, y, X_test, y_test, run_orders, args, True, clock, warm_up=False)


def honest_run_of(k: int, twin: Run, reference: Run, params, data: TrainingData, orders, batch: int, lr: float) -> Run:
    """honest_run in a worker process beside the lockstep, one job each: the training set read again there."""
    X, y = data()
    test = load_mnist(quiet=True)
    return honest_run(k, twin, reference, params, X, y, normalize(test.test_images), test.test_labels, orders,
                      argparse.Namespace(batch=batch, lr=lr), Phases())


def run_settings(args) -> dict:
    """The settings a run's numbers depend on, as results.json records them."""
    shown = ("out", "quiet", "no_peers", "network", "resume", "wide", "verbose")  # how it runs and shows, not what
    settings = {k: v for k, v in vars(args).items() if k not in shown}
    settings["optimizer"] = args.optimizer.name
    if not args.network.has_hidden:
        del settings["hidden"]
    return settings


class Progress:
    """The rounds timed so far, in a journal of one line per row's round: a run that is stopped keeps what it
    measured, and --resume times only the rest, on the same settings, data and GPU (`key`)."""

    KEPT = ("ran", "losses", "epoch_seconds", "test_accuracy", "failure")  # a row's first round: its free run

    def __init__(self, path: Path, key: dict):
        self.path, self.key = path, {k: v for k, v in key.items() if k != "jobs"}

    def start(self) -> None:
        """A new journal: its first line, the key."""
        self.path.write_text(json.dumps({"key": self.key}) + "\n")

    def save(self, run: Run) -> None:
        """A line for the round a row has just timed (with its free run, where it is the first)."""
        line = {"label": run.label, "round": run.rounds[-1]}
        if len(run.rounds) == 1:
            line |= {k: getattr(run, k) for k in self.KEPT} | {"predictions": run.predictions.tolist()}
        with self.path.open("a") as journal:
            journal.write(json.dumps(line) + "\n")

    def restore(self, runs: list[Run]) -> None:
        """Each run's rounds from the journal, where its key matches (else a new journal); says what it took."""
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        if not lines or json.loads(lines[0]).get("key") != self.key:
            print(f"--resume: no journal of these settings, data and GPU in {self.path}: every row is timed")
            self.start()
            return
        by_label = {run.label: run for run in runs}
        for line in map(json.loads, lines[1:]):
            if (run := by_label.get(line["label"])) is None:
                continue
            if "losses" in line:
                for k in self.KEPT:
                    setattr(run, k, line[k])
                run.predictions = np.asarray(line["predictions"])
            run.rounds.append(line["round"])
        print(f"--resume: {sum(len(run.rounds) for run in runs)} rounds of {len(runs)} rows taken from {self.path}")


def row_time(run: Run, steps_per_epoch: int) -> str:
    """A row's time per step, as the table will show it (median of its rounds, their range), or why not."""
    low, high = (1e6 * t / steps_per_epoch for t in (min(run.rounds), max(run.rounds)))
    if not steady(run):
        return f"unsteady, {low:.1f}-{high:.1f} us/step"
    spread = f" ({low:.1f}-{high:.1f})" if len(run.rounds) > 1 else ""
    return f"{1e6 * float(np.median(run.rounds)) / steps_per_epoch:.1f} us/step{spread}"


def rows_to_run(args) -> tuple[list[Run], dict[str, str]]:
    """The runs of the table: every level this machine can run for the network and optimizer, in each variant, and on
    a GPU the peers; and the peers not run, with why. Says what it skips, and why."""
    network, optimizer = args.network, args.optimizer
    runs: list[Run] = []
    for lv, device in runs_for(args.levels, gpu_available()):
        if args.gpu_only and device != "cuda" and lv.number != 1:
            continue
        if why := missing(lv, device, network, optimizer):
            print(f"skipping {lv.name} ({lv.title}): {'; '.join(why)}")
            continue
        for options in network.variants(lv.number, device):  # LeNet's 4 and 5: two convolutions; the MLP's 5: three
            label = row_label(lv, device, options)
            options = options | optimizer.options  # every row trains with it: the heading says so, not the label
            threads = cpu_threads(network, args.batch, args.hidden) if (lv.number, device) == (1, "cpu") else None
            runs.append(Run(label, lv.number, device, factory(lv, device, network, **options),
                            {"device": device, **options, **({"threads": threads} if threads else {})}))
    absent = {}
    if gpu_available() and not args.no_peers:
        absent = missing_peers(network) | {name: f"it trains with {optimizers.SGD.title} only, not {optimizer.title}"
                                           for name in network.peers if name not in optimizer.peers}
        runs += [run for run in peer_runs(network) if run.label.split("[")[0] not in absent]
        for name, why in absent.items():
            print(f"skipping the peer {name}: {why}")
    return runs, absent


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with compile_cache.shared():  # the lockstep's processes read what the timed runs compiled (JAX's XLA)
        return job(args)


def job(args: argparse.Namespace) -> int:
    """The whole job for parsed arguments: train and time every row, verify each, write and print the results."""
    started, clock = time.perf_counter(), Phases()
    quiet = args.quiet or bool(os.environ.get("CI")) or not sys.stderr.isatty()
    with clock("data"):
        data = load_mnist(quiet=quiet)
        print(f"data: {data.source}")
        X, y, n = training_set(data, args)
        X_test, y_test = normalize(data.test_images), data.test_labels
    network, optimizer = args.network, args.optimizer
    params = network.network.init_params(args.seed, args.hidden)
    orders = [epoch_order(n, epoch, args.seed, args.shuffle) for epoch in range(args.epochs)]

    with clock("the rows found (levels, peers)"):
        runs, absent = rows_to_run(args)
    if not runs or runs[0].label != REFERENCE:
        raise SystemExit(f"{REFERENCE} must run: it is the reference every level is checked against")
    if args.jobs is None:  # worker processes cost seconds to start: worth it for a long lockstep only
        level_steps = (len(runs) - 1) * args.epochs * -(-n // args.batch)
        args.jobs = 1 if level_steps < PARALLEL_FROM else os.cpu_count() or 1
    measured_on = machine()
    progress = Progress(args.out / PROGRESS, {**run_settings(args), "data": data.source, "gpu": measured_on.get("gpu")})
    progress.restore(runs) if args.resume else progress.start()
    steps_per_epoch = -(-n // args.batch)
    with clock("the estimate: level 1's first steps"):
        step_s = pace(runs[0], params, X, y, args)
    estimated = estimate(len(runs), steps_per_epoch, step_s, args)
    rounds = f" x {args.rounds} rounds" if args.rounds > 1 else ""
    print(f"this will take about {duration(estimated)}: {len(runs)} rows x {args.epochs + 1} epochs of "
          f"{steps_per_epoch:,} steps{rounds}, then each checked in lockstep at every step, at level 1's pace here now "
          f"({step_s * 1e6:,.0f} us/step)")
    with clock("the machine's load, before and after the timed rows"):
        calibration = [calibrate()]
        before = snapshot()
    models = {}  # each row's model, made and warmed up once: a later round times it again from the start
    for round_ in range(args.rounds):  # a disturbance of the machine lands in one round of several rows
        for run in runs:
            if len(run.rounds) > round_:  # timed before the run was stopped (--resume)
                continue
            made = run.label not in models
            if made:
                with clock(f"{run.label}: made"):
                    models[run.label] = run.factory(params)
            train(models[run.label], run, params, X, y, X_test, y_test, orders, args, quiet, clock, warm_up=made)
            progress.save(run)
            if len(run.rounds) == args.rounds:
                print(f"{run.label}: {row_time(run, steps_per_epoch)}; its check comes after the last row's")
                del models[run.label]  # its last round: freed, as every row's model is before the lockstep
    with clock("the machine's load, before and after the timed rows"):
        after = snapshot()
        calibration.append(calibrate())
    too_busy, others = busy(before, after, calibration, os.cpu_count() or 1)
    workers = Phases()
    twin = verify_runs(runs, params, X, y, X_test, y_test, orders, args, quiet, clock, workers)

    with clock("the table"):
        rows = summarize(runs, args, steps_per_epoch)
    print(
        f"\n{network.title}: {n:,} images x {args.epochs} epochs, batch {args.batch}{size_note(args)}, "
        f"{optimizer_note(optimizer)}lr {args.lr}, seed {args.seed}"
        f"{', shuffled' if args.shuffle else ''}; verified against {REFERENCE}: lockstep at every step, "
        f"free run against float32 noise (common/harness/verify.py)"
    )
    settings = run_settings(args)
    settings["train_size"] = n
    settings["later_round_epochs"] = LATER_ROUND_EPOCHS if LATER_ROUND_EPOCHS < args.epochs else None  # else whole
    settings["later_round_seconds"] = LATER_ROUND_SECONDS  # ... fewer where they last that long (each row's: its own)
    settings["warm_up"] = "once per row"  # a later round times the same warm model again (before: a new one, warmed up)
    print(timing_rule(settings) + "\n")
    print_table(rows, args.wide)
    if line := ties_line(runs):
        print(line)
    results = {
        "settings": settings,
        "data": data.source,
        "machine": measured_on,
        "rules": {"yardstick": verify.YARDSTICK, "loss_rtol": verify.LOSS_RTOL, "loss_atol": verify.LOSS_ATOL,
                  "free_k": verify.FREE_K, "free_floor": verify.FREE_FLOOR, "accuracy_floor_images": verify.ACC_FLOOR},
        "timing": WARM_UP,
        "steady_ratio": STEADY_RATIO,
        "table": rows,
        "peers_not_run": absent,
        "runs": [_for_json(run) for run in runs + [twin]],
        "elapsed_s": time.perf_counter() - started,  # the whole job: data, training, every check
        "phases": clock.seconds,  # ... and where that time went
        "lockstep_workers": workers.seconds,  # each level's lockstep, its time summed over the --jobs processes
        "estimate_s": estimated,  # the job's time as estimated before it started
        # the machine's load while the rows were timed: None where it was quiet, else why their times are not trusted
        "busy": too_busy,
        "load": {"calibration_s": calibration, "before": before, "after": after, "others_cores": others,
                 "cores": os.cpu_count()},
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    progress.path.unlink(missing_ok=True)
    with clock("plots"):
        plot(runs, twin, args.out, f"{network.title}, {n:,} images, batch {args.batch}{size_note(args)}"
             f"{', ' + optimizer.title if optimizer.options else ''}", args.epochs)
    print(f"\nwrote {args.out / 'results.json'}, loss_curves.png and lockstep.png")
    if args.verbose:
        print("\n" + clock.table(time.perf_counter() - started))
        if workers.seconds:
            print("\n" + workers.table(sum(workers.seconds.values()),
                                       f"the lockstep, summed over {args.jobs} processes", rest=""))
        for run in runs:
            record = run.lockstep and run.lockstep["record"]
            for tie in (record.ties if record else [])[:5]:
                print(f"tie: {run.label} at {tie.describe()}")
    print(f"took {duration(time.perf_counter() - started)} (estimated: about {duration(estimated)})")
    if too_busy:
        print(f"WARNING: the machine was busy while the rows were timed ({too_busy}): their times and speedups are "
              "not to be trusted; run again with nothing else running")
    failed = [run for run in runs if run.failure]
    for run in failed:
        print(f"FAIL: {run.label} {run.failure}" if "diverged" not in run.failure else f"DIVERGED: {run.label} {run.failure}")
    for run in runs:
        if not steady(run):
            print(f"UNSTEADY: {run.label}'s rounds took {', '.join(f'{s * 1e3:.1f}' for s in run.rounds)} ms per "
                  f"epoch (median): more than {STEADY_RATIO}x apart, so its time is not published; run it again")
    # the peers are yardsticks: a failed check is reported (their arithmetic misses the rule), the exit status is the
    # levels'
    return 1 if any(run.label.split("[")[0] not in PEERS for run in failed) else 0


def ties_line(runs: list[Run]) -> str | None:
    """The ties lockstep found and explained (a ReLU or a sign within float32's reach of 0, decided the other way from
    level 1: not a failure), in one line: how many per level, at which steps; None where there are none."""
    found = []
    for run in runs:
        steps = [tie["step"] for tie in (run.lockstep or {}).get("ties", [])]
        if steps:
            shown = ", ".join(map(str, steps[:3])) + (f" and {len(steps) - 3} more" if len(steps) > 3 else "")
            found.append(f"{run.label} {len(steps)} at step{'s' if len(steps) > 1 else ''} {shown}")
    if not found:
        return None
    return "ties found and explained (not failures; --verbose lists them): " + "; ".join(found)


def duration(seconds: float) -> str:
    """"45 s", "3 min 20 s", "1 h 5 min"."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def timing_rule(settings: dict) -> str:
    """How a run's times were taken, in a sentence, from its settings (results.json's): its rounds, and the epochs a
    later round timed (no later_round_epochs: the whole run, as each round did before LATER_ROUND_EPOCHS; with
    later_round_seconds, as many as last that long, at most later_round_epochs), and whether a later round timed the
    same warm model again (warm_up "once per row") or a new one, warmed up."""
    rounds, later_epochs = settings.get("rounds", 1), settings.get("later_round_epochs")
    seconds = settings.get("later_round_seconds")
    if rounds == 1:
        return f"Timing: {WARM_UP}; us/step is the median epoch's."
    again = ("the same warm model from the initial weights" if settings.get("warm_up") == "once per row"
             else "a new model, warmed up")
    if seconds:  # each row's own count: results.json's table, later_round_epochs
        later = (f" (the first its whole run, each later one {again}, its first epochs: as many as last {seconds:g} s "
                 f"at the first round's pace, at most {later_epochs or settings.get('epochs')})")
    else:
        later = (f" (the first its whole run, each later one {again}, its first {later_epochs} epochs)" if later_epochs
                 else f" (each later one {again})")
    return (f"Timing: {WARM_UP}; every row timed {rounds} times, in rounds over the rows{later}; us/step is the "
            f"median of the rounds' median epochs, with their range; a row whose rounds are more than {STEADY_RATIO}x "
            "apart is flagged unsteady and not published.")


def optimizer_note(optimizer: optimizers.Optimizer) -> str:
    """"Adam, " where the run trains with another optimizer than SGD, every level's default; nothing for SGD."""
    return f"{optimizer.title}, " if optimizer.options else ""


def size_note(args) -> str:
    """", hidden 256" for the MLP; nothing for a network of fixed sizes."""
    return f", hidden {args.hidden}" if args.network.has_hidden else ""


def _for_json(run: Run) -> dict:
    """A run as results.json keeps it: no per-step arrays (the plots show them), no predictions."""
    return {
        "label": run.label, "level": run.level, "device": run.device, "ran": run.ran, "steps": len(run.losses),
        "epoch_seconds": run.epoch_seconds, "epoch_means": verify.epoch_means(run.losses, len(run.epoch_seconds)).tolist()
        if len(run.losses) % max(len(run.epoch_seconds), 1) == 0 else None,
        "test_accuracy": run.test_accuracy,
        "lockstep": {k: v for k, v in run.lockstep.items() if k != "record"} if run.lockstep else None,
        "free_run": run.free_run, "failure": run.failure,
    }


if __name__ == "__main__":
    sys.exit(main())
