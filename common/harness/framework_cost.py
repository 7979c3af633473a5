"""What a framework costs, measured: level 8's price per operation over its backend's own functions, and its training
step against the levels that write the step by hand.

    python -m common.harness.framework_cost --tag cpu-2core   # the CPU's rows
    python -m common.harness.framework_cost --tag h100        # on a GPU machine: the CPU's rows and the GPU's

1. One operation: ReLU of a (8, 256) tensor (the chapter's hidden layer: too little work to matter) called CALLS times
   in a row, four ways on each backend: the backend's function alone (level 3's relu_forward on the CPU, a kernel
   launch through the library on the GPU); level 8's relu with the graph off (no_grad); level 8's relu recording its
   node, its input requiring grad as in training; and PyTorch's torch.relu on a tensor that requires grad. The
   framework's cost per operation is the third minus the first. On the GPU a call only queues its kernel: the time is
   the host's, per call, with the queue drained at the end of each part.
2. One training step of the MLP at the chapter's size (784-256-10, batch 8, real MNIST): each implementation's
   train_epoch over STEPS batches, per step. On the CPU level 8 against level 3 (the same functions, called by hand)
   and level 1; on the GPU level 8, op by op and its step replayed as one CUDA graph (level8_framework/graphs.py),
   against PyTorch eager (torch-eager) and level 6. Each is verified before it is timed: those STEPS steps in lockstep
   with level 1 (common/harness/verify.py), as make compare verifies a level.

On the CPU every time is the thread's CPU time (time.thread_time): all the work runs on the calling thread, and the
time the machine's other processes run instead is not counted (the load average is recorded before and after). On
the GPU it is wall time, which includes the waits for the device. Every time is the median of REPEATS repeats, each
the median of PARTS parts, after one untimed warm-up, taken in rounds over the rows (a disturbance of the machine
lands on several rows, not on one); with its range. A row whose slowest repeat is more than STEADY_RATIO times its
fastest is flagged unsteady and its time is not published. Everything runs on one CPU thread (OpenBLAS's and
PyTorch's): a batch of 8 is too small for threads to help. Writes results/<tag>/framework-cost.json and .md.
"""

from __future__ import annotations

import os

# One thread for NumPy's BLAS: it reads these when it loads, so before numpy is imported (the command line's case).
for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from contextlib import nullcontext  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.harness import compare, results, verify  # noqa: E402
from common.harness.data import dataset, load_mnist, normalize  # noqa: E402
from common.levels import THE_MLP, gpu_available, level, machine_tag, missing  # noqa: E402
from common.nets.mlp import init_params  # noqa: E402

CALLS, STEPS = 10_000, 500  # per repeat: the operation's calls, the step's steps
REPEATS, PARTS = 7, 10  # each repeat the median of PARTS parts of its calls or steps
BATCH, HIDDEN, LR = 8, 256, 0.01  # the chapter's run
STEADY_RATIO = compare.STEADY_RATIO  # a row's slowest repeat at most this many times its fastest
OP_ROWS = ("backend function", "level 8, no graph", "level 8, recording", "PyTorch, recording")


CLOCKS = {"cpu": (time.thread_time, "the thread's CPU time"), "cuda": (time.perf_counter, "wall time")}


def devices() -> list[str]:
    """The backends this machine runs level 8 on: the CPU, and the GPU where there is one and libops.so is built."""
    return ["cpu"] + (["cuda"] if not missing(level(8), "cuda") else [])


def row(label: str, per_call_s: list[float], **about) -> dict:
    """A timed row: the median of its repeats in microseconds, their range, and whether they agree."""
    us = [1e6 * s for s in per_call_s]
    steady = max(us) <= STEADY_RATIO * min(us)
    return {"label": label, **about, "us": float(np.median(us)) if steady else None, "us_range": [min(us), max(us)],
            "repeats_us": us, "steady": steady}


def in_rounds(timers: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Each timer (() -> seconds) run once untimed, then `repeats` times, in rounds over all of them."""
    for timer in timers.values():
        timer()
    times: dict[str, list[float]] = {label: [] for label in timers}
    for _ in range(repeats):
        for label, timer in timers.items():
            times[label].append(timer())
    return times


# ---- 1. one operation ----


def op_calls(device: str) -> dict[str, tuple[Callable, Callable, object, str]]:
    """Each way to run the operation on `device`: (the call, the wait for the device, the context it runs in (a
    function that makes it), what ran: the device read back from the object that computes)."""
    from level8_framework import tensor as F

    rng = np.random.default_rng(0)
    values = rng.standard_normal((BATCH, HIDDEN)).astype(np.float32)
    t = F.Tensor(values, requires_grad=True, device=device)
    be = t.backend
    x = torch.tensor(values, device=device, requires_grad=True)
    probe = be.from_numpy(np.zeros(1, np.float32))
    wait = (lambda: be.to_numpy(probe)) if device == "cuda" else (lambda: None)  # one stream: the last in the queue
    torch_wait = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return {
        "backend function": (lambda: be.relu_forward(t.data), wait, nullcontext, be.device),
        "level 8, no graph": (lambda: F.relu(t), wait, F.no_grad, F.relu(t).device),
        "level 8, recording": (lambda: F.relu(t), wait, nullcontext, F.relu(t).device),
        "PyTorch, recording": (lambda: torch.relu(x), torch_wait, nullcontext, torch.relu(x).device.type),
    }


def op_timer(call: Callable, wait: Callable, context: Callable, calls: int, parts: int,
             clock: Callable[[], float]) -> Callable[[], float]:
    """() -> seconds per call: `calls` calls in a row inside context(), in `parts` parts, each timed by `clock` with
    the device's queue drained before and after; the median part's."""
    def timer() -> float:
        seconds = []
        with context():
            for _ in range(parts):
                wait()
                start = clock()
                for _ in range(calls // parts):
                    call()
                wait()
                seconds.append((clock() - start) / (calls // parts))
        return float(np.median(seconds))
    return timer


def measure_ops(device: str, calls: int = CALLS, repeats: int = REPEATS, parts: int = PARTS) -> dict:
    """The operation, each way, on one device: its rows and the framework's cost per operation (recording minus the
    backend's function, medians; None where either row is unsteady)."""
    ways = op_calls(device)
    with verify.torch_threads(1):
        times = in_rounds({label: op_timer(call, wait, context, calls, parts, CLOCKS[device][0])
                           for label, (call, wait, context, _) in ways.items()}, repeats)
    rows = [row(label, times[label], ran=ways[label][3]) for label in OP_ROWS]
    by = {r["label"]: r["us"] for r in rows}
    cost = by["level 8, recording"] - by["backend function"] if None not in (by["level 8, recording"],
                                                                          by["backend function"]) else None
    return {"device": device, "clock": CLOCKS[device][1], "op": f"relu of a ({BATCH}, {HIDDEN}) tensor",
            "calls": calls, "rows": rows, "framework_us_per_op": cost}


# ---- 2. one training step ----


def step_factories(device: str) -> dict[str, Callable]:
    """params -> a fresh model, for each implementation timed on `device` (level 8's last). Raises for one this
    machine cannot run, saying why."""
    levels = {"cpu": {"level3[cpu]": level(3), compare.REFERENCE: level(1)}, "cuda": {"level6[cuda]": level(6)}}[device]
    for label, lv in {**levels, f"level8[{device}]": level(8)}.items():
        if why := missing(lv, device):
            raise RuntimeError(f"{label} cannot run here: {'; '.join(why)}")
    factories = {label: compare.factory(lv, device) for label, lv in levels.items()}
    if device == "cuda":
        from level1_pytorch.peers import peers

        factories["torch-eager[cuda]"] = peers(THE_MLP)["torch-eager"]
    factories[f"level8[{device}]"] = compare.factory(level(8), device)
    if device == "cuda":
        factories["level8[cuda, graph]"] = compare.factory(level(8), device, step="graph")
    return factories


def step_timer(model, data, order: np.ndarray, batch: int, parts: int,
               clock: Callable[[], float]) -> Callable[[], float]:
    """() -> seconds per step: the steps of `order` as `parts` epochs, each timed by `clock` (train_epoch returns its
    losses in host memory: the device is done when it returns); the median epoch's."""
    def timer() -> float:
        seconds = []
        for rows in np.array_split(order, parts):
            start = clock()
            model.train_epoch(*data, batch, LR, rows)
            seconds.append((clock() - start) / len(range(0, len(rows), batch)))
        return float(np.median(seconds))
    return timer


def measure_steps(device: str, data, steps: int = STEPS, batch: int = BATCH, hidden: int = HIDDEN,
                  repeats: int = REPEATS, parts: int = PARTS) -> dict:
    """One training step of each implementation on `device`: verified in lockstep with level 1 over the steps it is
    timed on, then timed. Raises for one that fails its check: nothing unverified is timed."""
    params = init_params(0, hidden)
    order = np.arange(steps * batch, dtype=np.int32)
    X, y = data
    factories = step_factories(device)
    checked = {label: make(params) for label, make in factories.items() if label != compare.REFERENCE}
    records, diverged = verify.lockstep(checked, params, X, y, [order], batch, LR)
    for label, record in records.items():
        if diverged or record.failure:
            raise AssertionError(f"{label} failed lockstep with level 1, so it is not timed: "
                                 f"{diverged or record.failure}")
    models = {label: make(params) for label, make in factories.items()}
    with verify.torch_threads(1):
        times = in_rounds({label: step_timer(model, data, order, batch, parts, CLOCKS[device][0])
                           for label, model in models.items()}, repeats)
    rows = [row(label, times[label], ran=models[label].variant(),
                lockstep_used=records[label].summary()["max_used"] if label in records else None)
            for label in factories]
    return {"device": device, "clock": CLOCKS[device][1], "batch": batch, "hidden": hidden, "steps": steps,
            "rows": rows}


# ---- the files ----


def _us(r: dict) -> str:
    """A row's time: its median with the range, or, for an unsteady row, the range only, flagged."""
    low, high = r["us_range"]
    return f"{r['us']:.1f} ({low:.1f}-{high:.1f})" if r["steady"] else f"unsteady ({low:.1f}-{high:.1f}): not published"


def ratio(ours: float | None, theirs: float | None) -> str:
    """ours / theirs as "1.23x", or "-" where either row is unsteady."""
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def markdown(record: dict) -> str:
    """The tables of framework-cost.json: the operation on each device, then the step."""
    m = record["machine"]
    lines = [(f"What a framework costs - {m.get('gpu', 'no GPU')}; {m.get('cpu', '?')}, {m.get('cpu_count', '?')} "
              f"cores, one thread; load average {record['load']['before'][0]:.2f} before, "
              f"{record['load']['after'][0]:.2f} after (`python -m common.harness.framework_cost`). Each time: the "
              f"median of {record['repeats']} repeats (range); a row whose repeats are more than {STEADY_RATIO}x "
              "apart is unsteady, its time not published."), ""]
    for ops in record["ops"]:
        lines += [f"One operation on {ops['device']}, {ops['op']}, {ops['calls']:,} calls in a row ({ops['clock']}):",
                  "",
                  "| way | us per call (range) |", "|---|---:|"]
        lines += [f"| {r['label']} | {_us(r)} |" for r in ops["rows"]]
        cost = ops["framework_us_per_op"]
        lines += ["", f"Level 8's cost per operation on {ops['device']} (recording minus the backend's function): "
                  + (f"{cost:.1f} us." if cost is not None else "not published (a row is unsteady)."), ""]
    for steps in record["steps"]:
        ours = next(r["us"] for r in steps["rows"] if r["label"] == f"level8[{steps['device']}]")
        lines += [(f"One training step on {steps['device']}, batch {steps['batch']}, hidden {steps['hidden']} "
                   f"({steps['clock']}; {steps['steps']} steps per repeat, each implementation first verified in "
                   "lockstep with level 1 over them):"), "",
                  "| implementation | us per step (range) | level 8's time over it | lockstep |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {r['label']} | {_us(r)} | {ratio(ours, r['us'])} | "
                  f"{'-' if r['lockstep_used'] is None else format(r['lockstep_used'], '.2f')} |"
                  for r in steps["rows"]]
        lines.append("")
    return "\n".join(lines).rstrip()


def measure(calls: int = CALLS, steps: int = STEPS, repeats: int = REPEATS, parts: int = PARTS, hidden: int = HIDDEN,
            quiet: bool = False) -> dict:
    """Every measurement this machine can make, as framework-cost.json keeps it."""
    load = [os.getloadavg()]
    mnist = load_mnist(quiet=True)
    n = steps * BATCH
    data = dataset(normalize(mnist.train_images[:n]), mnist.train_labels[:n])
    ops, step_rows = [], []
    for device in devices():
        ops.append(measure_ops(device, calls, repeats, parts))
        step_rows.append(measure_steps(device, data, steps, BATCH, hidden, repeats, parts))
        if not quiet:
            print(f"{device}: measured", flush=True)
    load.append(os.getloadavg())
    return {"machine": compare.machine(), "data": mnist.source, "load": {"before": load[0], "after": load[1]},
            "threads": {"torch": 1, **{k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}},
            "repeats": repeats, "parts": parts, "steady_ratio": STEADY_RATIO, "ops": ops, "steps": step_rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", default=None, help="results/<tag>/ (default: the GPU's model, h100 or h200, or cpu)")
    args = p.parse_args(argv)
    args.tag = args.tag or machine_tag()  # the results folder of the GPU that measures
    record = measure()
    table = markdown(record)
    print("\n" + table)
    results.write(args.tag, "framework-cost.json", [json.dumps(record, indent=1)])
    print(f"\nwrote {results.write(args.tag, 'framework-cost.md', [table])} and framework-cost.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
