"""When two GPUs pay: the MLP's training step timed on one GPU and on two, for the gold standard (PyTorch's DDP) and
for the course's own (level 6 on one GPU, level 9 on two).

    rows, ran = step_times([(256, 8), (1024, 256), (4096, 4096)], world=2)        # DDP: (hidden, batch) -> s/step
    rows, ran = level_step_times([(256, 8), (1024, 256), (4096, 4096)], world=2)  # level 9 (world 1: level 6)

One GPU runs level 1's network plainly (world 1: no DDP, what a user with one GPU writes); two run it wrapped in
DistributedDataParallel, each rank on its half of every batch, NCCL summing the gradients in buckets while backward()
still runs. The course's own: level 6's step on one GPU, and level 9's on two (level 6's step on each half, NCCL's
all-reduce between the backward pass and the update). Full float32 (TF32 off), SGD, real MNIST rows on the GPU, batch
i being rows i * batch onwards. Each size is timed ROUNDS times over STEPS steps after WARMUP, every rank starting
together; rank 0 reports each round's seconds per step.

Run on two GPUs: `python -m common.harness.scaling` writes results/<gpu>x2/scaling.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from level9_data_parallel.allreduce import on_ranks, what_ran
from level9_data_parallel.mlp import TIMEOUT, WORLD

# (hidden, batch): the chapter's run, then larger, until two GPUs pay
SIZES = [(256, 8), (1024, 256), (1024, 1024), (4096, 1024), (4096, 4096), (4096, 8192), (4096, 16384), (8192, 16384)]
WARMUP, STEPS, ROUNDS = 20, 100, 5
UNSTEADY = 1.2  # rounds further apart than this are flagged, and their median not published


def _time(rank: int, world: int, store: str, out, sizes: list[tuple[int, int]]) -> None:
    """One rank: each size's seconds per step in every round, sent to `out` by rank 0 with what ran."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from common.harness.data import load_mnist, normalize
    from level1_pytorch.mlp import Net

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False  # full float32, as every level
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        mnist = load_mnist(quiet=True)
        X = torch.from_numpy(normalize(mnist.train_images).copy()).to(device)
        y = torch.from_numpy(mnist.train_labels.astype(np.int64)).to(device)
        rows = {}
        for hidden, batch in sizes:
            torch.manual_seed(0)  # the same initial weights on every rank; DDP broadcasts rank 0's anyway
            net = Net(hidden).to(device)
            model = DistributedDataParallel(net, device_ids=[rank]) if world > 1 else net
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            share = batch // world

            def step(i: int) -> None:
                first = (i * batch) % (len(X) - batch) + rank * share  # this rank's share of batch i
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(model(X[first : first + share]), y[first : first + share]).backward()
                optimizer.step()

            for i in range(WARMUP):
                step(i)
            rounds = []
            for _ in range(ROUNDS):
                torch.cuda.synchronize()
                dist.barrier()  # every rank starts the round together
                torch.cuda.synchronize()
                start = time.perf_counter()
                for i in range(STEPS):
                    step(i)
                torch.cuda.synchronize()
                rounds.append((time.perf_counter() - start) / STEPS)
            rows[(hidden, batch)] = rounds
        if rank == 0:
            out.send((rows, what_ran(dist, device, steps=STEPS, rounds=ROUNDS, ddp=world > 1,
                                     tf32=torch.backends.cuda.matmul.allow_tf32)))
    finally:
        dist.destroy_process_group()


def step_times(sizes: list[tuple[int, int]], world: int) -> tuple[dict[tuple[int, int], list[float]], dict]:
    """(hidden, batch) -> each round's seconds per step on `world` GPUs, and what ran (allreduce.what_ran)."""
    import torch

    if torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} GPUs asked for, {torch.cuda.device_count()} seen")
    return on_ranks(_time, world, sizes)


def _batches(batch: int, steps: int, rows: int) -> np.ndarray:
    """The visiting order of `steps` batches, batch i being rows i * batch onwards (wrapping before the end), as the
    DDP timer takes them."""
    firsts = (np.arange(steps) * batch) % (rows - batch)
    return (firsts[:, None] + np.arange(batch)).ravel().astype(np.int32)


def level_step_times(sizes: list[tuple[int, int]], world: int) -> tuple[dict[tuple[int, int], list[float]], dict]:
    """(hidden, batch) -> each round's seconds per step of the course's own step on `world` GPUs (1: level 6, in this
    process; more: level 9, a worker per GPU), and what ran, read back from the models."""
    import torch

    from common.harness.data import load_mnist, normalize
    from common.nets.mlp import init_params
    from level6_cublas import MLP as Level6
    from level9_data_parallel import MLP as Level9

    if torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} GPUs asked for, {torch.cuda.device_count()} seen")
    mnist = load_mnist(quiet=True)
    X, y = normalize(mnist.train_images), mnist.train_labels
    rows, ran = {}, {}
    for hidden, batch in sizes:
        warm, timed = _batches(batch, WARMUP, len(X)), _batches(batch, STEPS, len(X))
        if world == 1:
            model = Level6(init_params(0, hidden))
            model.train_epoch(X, y, batch, 0.01, warm)
            rounds = []
            for _ in range(ROUNDS):
                start = time.perf_counter()
                model.train_epoch(X, y, batch, 0.01, timed)  # returns once the GPU is done: the losses are back
                rounds.append((time.perf_counter() - start) / STEPS)
            ran = {"level": "level6", "world": 1, "device": torch.cuda.get_device_name(0), "matmul": model.matmul}
        else:
            with Level9(init_params(0, hidden), workers=world, device="cuda") as model:
                model.train_epoch(X, y, batch, 0.01, warm)
                rounds = model.time_epochs(X, y, batch, 0.01, timed, ROUNDS)
                described = model.variant()
            ran = {"level": "level9", "world": int(described["workers"]), "device": described["gpu"],
                   "nccl": described["nccl"], "matmul": described["matmul"]}
        rows[(hidden, batch)] = rounds
    return rows, ran | {"steps": STEPS, "rounds": ROUNDS}


def kernel_profile(hidden: int, batch: int, steps: int = 5) -> dict:
    """Where one GPU's step goes, kernel by kernel, for level 6 and for plain PyTorch at one size: each kernel's GPU
    microseconds per step over `steps` steps (torch.profiler, which sees level 6's kernels too: they run in the same
    process), longest first, and what ran."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from common.harness.data import load_mnist, normalize
    from common.nets.mlp import init_params
    from level1_pytorch.mlp import Net
    from level6_cublas import MLP as Level6

    mnist = load_mnist(quiet=True)
    X, y = normalize(mnist.train_images), mnist.train_labels
    order = _batches(batch, steps, len(X))

    def kernels(run) -> list[list]:
        run()  # warm: the libraries pick their kernels
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        times = [[e.key, e.self_device_time_total / steps] for e in prof.key_averages() if e.self_device_time_total > 0]
        return sorted(times, key=lambda kernel: -kernel[1])

    level6 = Level6(init_params(0, hidden))
    own = kernels(lambda: level6.train_epoch(X, y, batch, 0.01, order))
    del level6
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    net = Net(hidden).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    X_gpu, y_gpu = torch.from_numpy(X.copy()).to(device), torch.from_numpy(y.astype(np.int64)).to(device)

    def eager() -> None:
        for rows in torch.from_numpy(order.reshape(steps, batch)).to(device):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(net(X_gpu[rows]), y_gpu[rows]).backward()
            optimizer.step()

    return {"hidden": hidden, "batch": batch, "steps": steps, "level6": own, "torch": kernels(eager),
            "ran": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "tf32": torch.backends.cuda.matmul.allow_tf32}}


def table_row(hidden: int, batch: int, rounds_1: list[float], rounds_2: list[float]) -> dict:
    """A row of scaling.json: each round's seconds per step on one GPU and on WORLD, their medians in us, and whether
    both sets of rounds are steady (within UNSTEADY)."""
    steady = all(max(rounds) / min(rounds) <= UNSTEADY for rounds in (rounds_1, rounds_2))
    return {"hidden": hidden, "batch": batch, "rounds_1": rounds_1, "rounds_2": rounds_2,
            "us_1": float(np.median(rounds_1)) * 1e6, "us_2": float(np.median(rounds_2)) * 1e6, "steady": steady}


def markdown(scaled: dict, allreduce: dict | None = None) -> str:
    """results/README.md's tables of a scaling.json (medians with their rounds' range; an unsteady row flagged, not
    printed): DDP's, then the course's own where it was timed, and the all-reduce's fitted cost from the allreduce.json
    beside it."""
    one, two = scaled["ran_1"], scaled["ran_2"]
    tf32 = "on" if two["tf32"] else "off"
    lines = [f"**The MLP's step on one GPU and on {two['world']} in DDP** - {two['device']}, NCCL {two['nccl']}, "
             f"{two['rounds']} rounds of {two['steps']} steps each, full float32 (TF32 {tf32}), eager; one GPU "
             "without DDP. us/step: the rounds' median (range).", "",
             *_table(scaled["table"], f"{two['world']} GPUs, DDP")]
    if "level_table" in scaled:
        own = scaled["level_2"]
        ddp = {(row["hidden"], row["batch"]): row for row in scaled["table"]}
        lines += ["", f"**The course's own step: level 6 on one GPU, level 9 on {own['world']}** (level 6's step on "
                  f"each half, NCCL's all-reduce through cffi) - {own['device']}, NCCL {own['nccl']}, matrix products "
                  f"{own['matmul']}, {own['rounds']} rounds of {own['steps']} steps each. The last column: level 9's "
                  "time over DDP's on the same GPUs (below 1: level 9 is faster).", "",
                  *_table(scaled["level_table"], f"{own['world']} GPUs, level 9", ddp)]
    if allreduce:
        ran = allreduce["ran"]
        lines += ["", f"NCCL's all-reduce over {ran['world']} x {ran['device']} (median of {ran['repeats']}): "
                  + ", ".join(f"{int(size) / 1024:,.0f} KB {seconds * 1e6:,.1f} us"
                              for size, seconds in allreduce["seconds"].items())
                  + f"; fitted latency {allreduce['latency_s'] * 1e6:.1f} us, bandwidth "
                  f"{allreduce['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s."]
    devices = {scaled[key]["device"] for key in ("ran_1", "ran_2", "level_1", "level_2") if key in scaled}
    if len(devices) > 1:
        lines += ["", f"**The timings ran on different GPUs ({', '.join(sorted(devices))})**: their ratios compare "
                  "different GPUs."]
    return "\n".join(lines)


def _table(rows: list[dict], two_label: str, ddp: dict | None = None) -> list[str]:
    """A Markdown table of table_row()s; with ddp (DDP's rows by (hidden, batch)), a last column: this row's time on
    two GPUs over DDP's."""
    head = f"| hidden | batch | 1 GPU | {two_label} | speedup |" + (" vs DDP |" if ddp else "")
    lines = [head, "|---:|---:|---:|---:|---:|" + ("---:|" if ddp else "")]
    for row in rows:
        if not row["steady"]:
            lines.append(f"| {row['hidden']:,} | {row['batch']:,} | unsteady: rounds more than {UNSTEADY}x apart, "
                         "not published | | |" + (" |" if ddp else ""))
            continue
        cells = [f"{row[f'us_{n}']:,.1f} ({min(row[f'rounds_{n}']) * 1e6:,.1f}-{max(row[f'rounds_{n}']) * 1e6:,.1f})"
                 for n in (1, 2)]
        line = f"| {row['hidden']:,} | {row['batch']:,} | {cells[0]} | {cells[1]} | {row['us_1'] / row['us_2']:.2f}x |"
        if ddp:
            gold = ddp.get((row["hidden"], row["batch"]))
            line += f" {row['us_2'] / gold['us_2']:.2f}x |" if gold and gold["steady"] else " - |"
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    """Time SIZES on one GPU and on WORLD, print the table and write it to results/."""
    import argparse
    import json

    from common.levels import ROOT, gpu_tag

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="default: results/<gpu>x2/scaling.json")
    args = p.parse_args(argv)
    one, ran_one = step_times(SIZES, 1)
    two, ran_two = step_times(SIZES, WORLD)
    own_one, level_one = level_step_times(SIZES, 1)
    own_two, level_two = level_step_times(SIZES, WORLD)
    scaled = {"ran_1": ran_one, "ran_2": ran_two, "table": [table_row(*size, one[size], two[size]) for size in SIZES],
              "level_1": level_one, "level_2": level_two,
              "level_table": [table_row(*size, own_one[size], own_two[size]) for size in SIZES],
              "profile": kernel_profile(*SIZES[-1])}
    out = args.out or ROOT / "results" / f"{gpu_tag(ran_two['device'])}x{ran_two['world']}" / "scaling.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(scaled, indent=1) + "\n")
    print(markdown(scaled))
    print(f"\nDDP, 1 GPU: {ran_one}\nDDP, {WORLD} GPUs: {ran_two}")
    print(f"level 6: {level_one}\nlevel 9: {level_two}\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
