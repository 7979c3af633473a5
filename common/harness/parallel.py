"""The lockstep of common/harness/verify.py split over worker processes by steps: every step checked as in one
process, in a fraction of the wall time.

    records, diverged, _ = lockstep(factories, params, data, orders, batch, lr, jobs=16, network=get("mlp"))

One process checks step k of every level after level 1's step k-1, so the run is as long as all the steps of all the
levels together. But a step only needs level 1's parameters (and optimizer state) before it, and level 1 on one
thread is deterministic: run alone, it finds them at any step at a fraction of the cost of checking. So level 1 runs
first, alone, and keeps its state at the first step of each stretch of the run; each worker process makes every
level's model once (its CUDA context, compiled graphs), then checks whole stretches, each started from level 1's
state there, with verify.Lockstep itself. The stretches' records are joined in step order, and a level's first
failure ends its record, as in one process.

A model whose making compiles its step (torch.compile, JAX's XLA: the `compiling` labels) costs seconds in every
process that makes it, even with the compilers' caches warm (common/harness/compile_cache.py), and processes compiling
at once slow each other down. Those models are checked in at most COMPILING_PROCESSES long stretches instead, each
made in one process: the same steps, each checked once.
"""

from __future__ import annotations

import multiprocessing
import pickle
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

import numpy as np

from common.harness import verify
from common.environment import environment
from common.harness.phases import Phases
from common.levels import level
from common.nets import Network
from common.nets.optimizers import SGD, Optimizer

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
STRETCHES_PER_JOB = 3  # a stretch per worker would leave the others idle once the fastest is done
COMPILING_PROCESSES = 4  # at most this many processes make a compiling model: fewer compilations, longer stretches

_worker: dict = {}  # in a worker process: its models, the data, the network and the optimizer


def lockstep(factories: dict[str, Callable], params: dict[str, np.ndarray], data: Callable, orders: list[np.ndarray],
             batch: int, lr: float, jobs: int, network: Network, optimizer: Optimizer = SGD,
             clock: Phases | None = None, workers: Phases | None = None, also: list[Callable] = (),
             compiling: frozenset[str] = frozenset()):
    """verify.lockstep over `jobs` processes: each model made in each worker by its factory (picklable, as
    compare.Factory), the training set by `data()` -> (X, y). `also`: more picklable jobs for the pool, started
    first, beside the lockstep (level 1's honest runs). Returns (records, why level 1 diverged or None, the results of
    `also`, in order); `clock` gets the lockstep's wall time, `workers` each model's time summed over the
    workers. `compiling`: the labels of the models whose making compiles, checked in few long stretches."""
    clock, workers = clock or Phases(), workers or Phases()
    X, y = data()
    batches = [order[start: start + batch] for order in orders for start in range(0, len(order), batch)]
    starts = stretches(len(batches), jobs * STRETCHES_PER_JOB)
    tasks = stretch_tasks(starts, list(factories), compiling)
    # What starts a worker is written to it as it is spawned: kept small (no parameters), or the parent would wait for
    # every worker's start in turn. Each task brings level 1's state, through the pool's queue.
    with single_threaded(), worker_pool(jobs, (pickle.dumps((factories, data)), network.name, optimizer.name)) as pool:
        extra = [pool.submit(job) for job in also]  # the longest jobs: each a whole free run
        pending, diverged = [], None
        with clock("lockstep: level 1 alone, its state at each stretch"):
            for (first, end), state in zip(starts, level1_states(params, X, y, batches, lr, network, optimizer,
                                                                  [first for first, _ in starts])):
                if isinstance(state, str):
                    diverged = state
                    break
                for task_end, labels in tasks[first]:
                    pending.append(pool.submit(_check, first, state, batches[first:task_end], lr, labels))
        with clock(f"lockstep: every level, in {jobs} processes"):
            stretch_results = [future.result() for future in pending]
            also_results = [future.result() for future in extra]
    stretch_results.sort(key=lambda result: result[0])  # in step order
    records = join([records for _, records, _, _ in stretch_results], list(factories), network, optimizer)
    for _, _, seconds, _ in stretch_results:
        workers.merge(seconds)
    diverged = next((why for _, _, _, why in stretch_results if why), diverged)
    return records, diverged, also_results


@contextmanager
def worker_pool(jobs: int, start: tuple) -> Iterator[ProcessPoolExecutor]:
    """`jobs` worker processes, each started by _start(*start): spawned, never forked (the parent may hold threads).
    concurrent.futures' pool, not multiprocessing.Pool: stopped by an error, that one can end its workers while its
    task thread still writes them a task of level 1's state, and wait for ever (python/cpython#96995); and it waits
    for ever on a task whose worker died. Here a worker that dies (a crash in a level's native code) fails the job
    with BrokenProcessPool. Its workers may start processes of their own (level 9's model starts its ranks). Left by an
    error or Ctrl-C, it ends its workers at once instead of letting them finish their stretches."""
    pool = ProcessPoolExecutor(jobs, multiprocessing.get_context("spawn"), initializer=_start, initargs=start)
    try:
        yield pool
    except BaseException:
        end_now(pool)
        raise
    pool.shutdown()


def end_now(pool: ProcessPoolExecutor) -> None:
    """Cancel the tasks not started and end the workers: Python 3.14's pool.terminate_workers(), done as it does it
    where it is missing (its list of workers is private before 3.14)."""
    if hasattr(pool, "terminate_workers"):
        pool.terminate_workers()
        return
    workers = list((pool._processes or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        if worker.is_alive():
            worker.terminate()


def stretches(steps: int, count: int) -> list[tuple[int, int]]:
    """[first, end) of `count` (at most `steps`) stretches of nearly equal length covering 0..steps."""
    bounds = np.linspace(0, steps, min(count, steps) + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def stretch_tasks(starts: list[tuple[int, int]], labels: list[str], compiling: frozenset[str]) -> dict:
    """first step -> [(end, the labels checked from it)]: every label over every stretch, the compiling ones over at
    most COMPILING_PROCESSES runs of consecutive stretches, each starting where a stretch starts."""
    light = [label for label in labels if label not in compiling]
    heavy = [label for label in labels if label in compiling]
    tasks = {first: ([(end, light)] if light else []) for first, end in starts}
    if heavy:
        for group in np.array_split(np.arange(len(starts)), min(COMPILING_PROCESSES, len(starts))):
            tasks[starts[group[0]][0]].insert(0, (starts[group[-1]][1], heavy))  # the long one first
    return tasks


def level1_states(params, X, y, batches, lr: float, network: Network, optimizer: Optimizer, firsts: list[int]):
    """Level 1 alone, on one thread, as verify.Lockstep steps it: yields (its parameters, its optimizer state) before
    each step of `firsts`, in order; or, where it diverged before one, why (and stops)."""
    reference = level(1).load(network)(params, device="cpu", **optimizer.options)
    lr = float(np.float32(lr))  # as verify.Lockstep steps it
    wanted = iter(firsts)
    target = next(wanted, None)
    with verify.torch_threads(1):
        for k, rows in enumerate(batches):
            if k == target:
                yield reference.state_dict(), reference.optimizer_state() if optimizer.state else None
                target = next(wanted, None)
                if target is None:
                    return
            loss = float(reference.train_epoch(X, y, len(rows), lr, rows)[0])
            if not np.isfinite(loss):
                yield f"level 1 itself diverged at lockstep step {k}"
                return


def join(parts: list[dict[str, verify.LockstepRecord]], labels: list[str], network: Network,
         optimizer: Optimizer) -> dict[str, verify.LockstepRecord]:
    """The stretches' records of each level, in step order, as one record: up to and with its first failure. A part
    holds the levels it checked (a compiling model's parts are fewer and longer)."""
    names = network.float64_step().names
    names += tuple(f"{n}.{key}" for n in names for key in optimizer.moments)
    joined = {label: verify.LockstepRecord(label, names) for label in labels}
    for label, record in joined.items():
        for part in (part for part in parts if label in part):
            piece = part[label]
            record.loss_err += piece.loss_err
            record.update_err += piece.update_err
            record.used += piece.used
            record.ties += piece.ties
            if piece.failure:
                record.failure = piece.failure
                break
    return joined


@contextmanager
def single_threaded():
    """Worker processes started inside the block run their BLAS and OpenMP on one thread each (they inherit the
    environment): several workers' thread pools, each spinning while it waits, would only fight over the cores."""
    with environment({name: "1" for name in THREAD_VARIABLES}):
        yield


def _start(made: bytes, network: str, optimizer: str) -> None:
    """A worker's start: the data set; the models are made at its first stretch, from the parameters it brings. `made`
    is the pickled (factories, data): unpickled here, where an error is kept for that stretch to raise (raised here,
    it would break the pool, whose error would not say why)."""
    from common.nets import get, optimizers

    try:
        factories, data = pickle.loads(made)
        X, y = data()
        _worker.update(factories=factories, X=X, y=y, network=get(network), optimizer=optimizers.get(optimizer))
    except Exception as error:  # noqa: BLE001 - any error: it reaches the caller through _check
        _worker["error"] = error


def _check(first: int, state: tuple, batches: list[np.ndarray], lr: float, labels: list[str]):
    """One stretch of steps from level 1's state at its first, for the models `labels`: (its first step, each model's
    record, the time by model, why level 1 diverged or None)."""
    if "error" in _worker:
        raise RuntimeError(f"a lockstep worker could not start: {_worker['error']!r}") from _worker["error"]
    network, optimizer = _worker["network"], _worker["optimizer"]
    params, optimizer_state = state
    models = _worker.setdefault("models", {})  # each made once in a worker (a CUDA context, compiled graphs); each
    for label in labels:  # step then loads level 1's parameters into it
        if label not in models:
            models[label] = _worker["factories"][label](params)
    reference = level(1).load(network)(params, device="cpu", **optimizer.options)
    if optimizer_state is not None:
        reference.load_optimizer_state(optimizer_state)
    clock = Phases()
    run = verify.Lockstep(reference, {label: models[label] for label in labels}, _worker["X"], _worker["y"], lr,
                          network.float64_step(), optimizer, clock)
    run.steps = first
    with verify.torch_threads(1):
        for rows in batches:
            run.step(rows)
            if run.reference_diverged or all(r.failure for r in run.records.values()):
                break
    return first, run.records, dict(clock.seconds), run.reference_diverged
