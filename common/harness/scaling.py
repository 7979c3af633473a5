"""When two GPUs pay: the training step timed on one GPU and on two, for the gold standard (PyTorch's DDP) and for
the course's own (level 6 on one GPU, level 9 on two); the MLP, then LeNet-5.

    rows, ran = step_times([(256, 8), (1024, 256), (4096, 4096)], world=2)        # DDP: (hidden, batch) -> s/step
    rows, ran = level_step_times([(256, 8), (1024, 256), (4096, 4096)], world=2)  # level 9 (world 1: level 6)
    rows, ran = level_step_times([(None, 64), (None, 4096)], world=2, net="lenet")  # LeNet-5 (no hidden size)

One GPU runs level 1's network plainly (world 1: no DDP, what a user with one GPU writes); two run it wrapped in
DistributedDataParallel, each rank on its half of every batch, NCCL summing the gradients in buckets while backward()
still runs. The course's own: level 6's step on one GPU, and level 9's on two (level 6's step on each half, NCCL's
all-reduce between the backward pass and the update). Full float32 (TF32 off), SGD, real MNIST rows on the GPU, batch
i being rows i * batch onwards. PyTorch's cuDNN picks LeNet-5's convolution algorithms by timing them (benchmark mode),
as a user after speed sets it; level 6 keeps its fixed, deterministic ones. Each size is timed ROUNDS times over
STEPS steps after WARMUP, every rank starting together; rank 0 reports each round's seconds per step.

Run on two GPUs: `python -m common.harness.scaling` writes results/<gpu>x2/scaling.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from level9_data_parallel.allreduce import on_ranks, what_ran
from level9_data_parallel.mlp import TIMEOUT, WORLD

# (hidden, batch): the chapter's run, then larger, until two GPUs pay; LeNet-5's, which has no hidden size to choose
SIZES = [(256, 8), (1024, 256), (1024, 1024), (4096, 1024), (4096, 4096), (4096, 8192), (4096, 16384), (8192, 16384)]
LENET_SIZES = [(None, 64), (None, 256), (None, 1024), (None, 4096), (None, 16384)]
WARMUP, STEPS, ROUNDS = 20, 100, 5
UNSTEADY = 1.2  # rounds further apart than this are flagged, and their median not published


def _net(net: str, hidden: int | None):
    """Level 1's network: the MLP with `hidden` units, or LeNet-5."""
    from level1_pytorch import lenet, mlp

    return mlp.Net(hidden) if net == "mlp" else lenet.Net()


def _time(rank: int, world: int, store: str, out, sizes: list[tuple[int | None, int]], net: str) -> None:
    """One rank: each size's seconds per step in every round, sent to `out` by rank 0 with what ran."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from common.harness.data import load_mnist, normalize

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False  # full float32, as every level
    torch.backends.cudnn.allow_tf32 = False  # LeNet-5's convolutions too
    torch.backends.cudnn.benchmark = True  # cuDNN times its algorithms once and keeps the fastest, as a user would
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        mnist = load_mnist(quiet=True)
        X = torch.from_numpy(normalize(mnist.train_images).copy()).to(device)
        y = torch.from_numpy(mnist.train_labels.astype(np.int64)).to(device)
        rows = {}
        for hidden, batch in sizes:
            torch.manual_seed(0)  # the same initial weights on every rank; DDP broadcasts rank 0's anyway
            plain = _net(net, hidden).to(device)
            model = DistributedDataParallel(plain, device_ids=[rank]) if world > 1 else plain
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
                                     tf32=torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)))
    finally:
        dist.destroy_process_group()


def step_times(sizes: list[tuple[int | None, int]], world: int, net: str = "mlp") -> tuple[dict, dict]:
    """(hidden, batch) -> each round's seconds per step of level 1's network (net: "mlp" or "lenet") on `world` GPUs,
    and what ran (allreduce.what_ran)."""
    import torch

    if torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} GPUs asked for, {torch.cuda.device_count()} seen")
    rows, ran = on_ranks(_time, world, sizes, net)
    return rows, ran | {"net": net}


def _batches(batch: int, steps: int, rows: int) -> np.ndarray:
    """The visiting order of `steps` batches, batch i being rows i * batch onwards (wrapping before the end), as the
    DDP timer takes them."""
    firsts = (np.arange(steps) * batch) % (rows - batch)
    return (firsts[:, None] + np.arange(batch)).ravel().astype(np.int32)


def level_step_times(sizes: list[tuple[int | None, int]], world: int, net: str = "mlp") -> tuple[dict, dict]:
    """(hidden, batch) -> each round's seconds per step of the course's own step (net: "mlp" or "lenet") on `world`
    GPUs (1: level 6, in this process; more: level 9, a worker per GPU), and what ran, read back from the models: the
    GPU, and the MLP's matrix product or LeNet-5's convolution."""
    import torch

    import level6_cublas
    import level9_data_parallel
    from common.harness.data import load_mnist, normalize
    from common.nets import get

    if torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} GPUs asked for, {torch.cuda.device_count()} seen")
    mnist = load_mnist(quiet=True)
    X, y = normalize(mnist.train_images), mnist.train_labels
    network, name = get(net).network, get(net).class_name  # name: the class a level's package exports, MLP or LeNet
    rows, ran = {}, {}
    for hidden, batch in sizes:
        params = network.init_params(0, hidden)  # LeNet-5's takes no hidden size: None
        warm, timed = _batches(batch, WARMUP, len(X)), _batches(batch, STEPS, len(X))
        if world == 1:
            model = getattr(level6_cublas, name)(params)
            model.train_epoch(X, y, batch, 0.01, warm)
            rounds = []
            for _ in range(ROUNDS):
                start = time.perf_counter()
                model.train_epoch(X, y, batch, 0.01, timed)  # returns once the GPU is done: the losses are back
                rounds.append((time.perf_counter() - start) / STEPS)
            described = model.variant() | {"gpu": torch.cuda.get_device_name(0), "workers": "1"}
        else:
            with getattr(level9_data_parallel, name)(params, workers=world, device="cuda") as model:
                model.train_epoch(X, y, batch, 0.01, warm)
                rounds = model.time_epochs(X, y, batch, 0.01, timed, ROUNDS)
                described = model.variant()
        ran = {"level": "level6" if world == 1 else "level9", "net": net, "world": int(described["workers"]),
               "device": described["gpu"], **{k: described[k] for k in ("nccl", "matmul", "convolution")
                                              if k in described}}
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


def table_row(hidden: int | None, batch: int, rounds_1: list[float], rounds_2: list[float]) -> dict:
    """A row of scaling.json: each round's seconds per step on one GPU and on WORLD, their medians in us, and whether
    both sets of rounds are steady (within UNSTEADY)."""
    steady = all(max(rounds) / min(rounds) <= UNSTEADY for rounds in (rounds_1, rounds_2))
    return {"hidden": hidden, "batch": batch, "rounds_1": rounds_1, "rounds_2": rounds_2,
            "us_1": float(np.median(rounds_1)) * 1e6, "us_2": float(np.median(rounds_2)) * 1e6, "steady": steady}


def markdown(scaled: dict, allreduce: dict | None = None) -> str:
    """results/README.md's tables of a scaling.json (medians with their rounds' range; an unsteady row flagged, not
    printed): the MLP's, then LeNet-5's where it was timed, each DDP's then the course's own; and the all-reduce's
    fitted cost from the allreduce.json beside it."""
    lines = _network_tables(scaled, "The MLP's")
    if "lenet" in scaled:
        lines += [""] + _network_tables(scaled["lenet"], "LeNet-5's")
    if allreduce:
        ran = allreduce["ran"]
        lines += ["", f"NCCL's all-reduce over {ran['world']} x {ran['device']} (median of {ran['repeats']}): "
                  + ", ".join(f"{int(size) / 1024:,.0f} KB {seconds * 1e6:,.1f} us"
                              for size, seconds in allreduce["seconds"].items())
                  + f"; fitted latency {allreduce['latency_s'] * 1e6:.1f} us, bandwidth "
                  f"{allreduce['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s."]
    timed = [scaled, scaled.get("lenet", {})]
    devices = {part[key]["device"] for part in timed for key in ("ran_1", "ran_2", "level_1", "level_2") if key in part}
    if len(devices) > 1:
        lines += ["", f"**The timings ran on different GPUs ({', '.join(sorted(devices))})**: their ratios compare "
                  "different GPUs."]
    return "\n".join(lines)


def _network_tables(scaled: dict, whose: str) -> list[str]:
    """One network's tables: DDP's step on one GPU and on two, then the course's own where it was timed."""
    two = scaled["ran_2"]
    tf32 = "on" if two["tf32"] else "off"
    lines = [f"**{whose} step on one GPU and on {two['world']} in DDP** - {two['device']}, NCCL {two['nccl']}, "
             f"{two['rounds']} rounds of {two['steps']} steps each, full float32 (TF32 {tf32}), eager; one GPU "
             "without DDP. us/step: the rounds' median (range).", "",
             *_table(scaled["table"], f"{two['world']} GPUs, DDP")]
    if "level_table" in scaled:
        own = scaled["level_2"]
        computes = (f"matrix products {own['matmul']}" if "matmul" in own
                    else f"convolutions {own['convolution']} (cuDNN)")
        ddp = {(row["hidden"], row["batch"]): row for row in scaled["table"]}
        lines += ["", f"**The course's own step: level 6 on one GPU, level 9 on {own['world']}** (level 6's step on "
                  f"each half, NCCL's all-reduce through cffi) - {own['device']}, NCCL {own['nccl']}, {computes}, "
                  f"{own['rounds']} rounds of {own['steps']} steps each. The last column: level 9's time over DDP's "
                  "on the same GPUs (below 1: level 9 is faster).", "",
                  *_table(scaled["level_table"], f"{own['world']} GPUs, level 9", ddp)]
    return lines


def _table(rows: list[dict], two_label: str, ddp: dict | None = None) -> list[str]:
    """A Markdown table of table_row()s (without the hidden column for a network that has none: LeNet-5); with ddp
    (DDP's rows by (hidden, batch)), a last column: this row's time on two GPUs over DDP's."""
    hidden = any(row["hidden"] is not None for row in rows)
    head = ("| hidden " if hidden else "") + f"| batch | 1 GPU | {two_label} | speedup |" + (" vs DDP |" if ddp else "")
    lines = [head, "|---:" * (4 + hidden + bool(ddp)) + "|"]
    for row in rows:
        size = (f"| {row['hidden']:,} " if hidden else "") + f"| {row['batch']:,} |"
        if not row["steady"]:
            lines.append(f"{size} unsteady: rounds more than {UNSTEADY}x apart, not published | | |"
                         + (" |" if ddp else ""))
            continue
        cells = [f"{row[f'us_{n}']:,.1f} ({min(row[f'rounds_{n}']) * 1e6:,.1f}-{max(row[f'rounds_{n}']) * 1e6:,.1f})"
                 for n in (1, 2)]
        line = f"{size} {cells[0]} | {cells[1]} | {row['us_1'] / row['us_2']:.2f}x |"
        if ddp:
            gold = ddp.get((row["hidden"], row["batch"]))
            line += f" {row['us_2'] / gold['us_2']:.2f}x |" if gold and gold["steady"] else " - |"
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    """Time SIZES (the MLP) and LENET_SIZES on one GPU and on WORLD, profile the largest MLP step, print the tables
    and write them to results/."""
    import argparse
    import json

    from common.levels import ROOT, gpu_tag

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="default: results/<gpu>x2/scaling.json")
    args = p.parse_args(argv)
    scaled = timed(SIZES, "mlp") | {"lenet": timed(LENET_SIZES, "lenet"), "profile": kernel_profile(*SIZES[-1])}
    two = scaled["ran_2"]
    out = args.out or ROOT / "results" / f"{gpu_tag(two['device'])}x{two['world']}" / "scaling.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(scaled, indent=1) + "\n")
    print(markdown(scaled))
    for part in (scaled, scaled["lenet"]):
        print("\n" + "\n".join(f"{key}: {part[key]}" for key in ("ran_1", "ran_2", "level_1", "level_2")))
    print(f"wrote {out}")
    return 0


def timed(sizes: list[tuple[int | None, int]], net: str) -> dict:
    """One network's part of scaling.json: DDP's step and the course's, each on one GPU and on WORLD, at `sizes`."""
    one, ran_one = step_times(sizes, 1, net)
    two, ran_two = step_times(sizes, WORLD, net)
    own_one, level_one = level_step_times(sizes, 1, net)
    own_two, level_two = level_step_times(sizes, WORLD, net)
    return {"ran_1": ran_one, "ran_2": ran_two, "table": [table_row(*size, one[size], two[size]) for size in sizes],
            "level_1": level_one, "level_2": level_two,
            "level_table": [table_row(*size, own_one[size], own_two[size]) for size in sizes]}


if __name__ == "__main__":
    sys.exit(main())
