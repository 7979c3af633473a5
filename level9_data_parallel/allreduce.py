"""What an all-reduce costs: torch.distributed's all_reduce timed in WORLD processes, for messages of growing size.

    times = allreduce_seconds([4 << 10, 1 << 20, 64 << 20])   # bytes -> the median seconds of one all-reduce
    latency, bandwidth = fit(times)                          # the cost model: latency + bytes / bandwidth

Each process joins a group, gloo's on the CPU or NCCL's on GPUs (rank r on GPU r), then for each size sums a float32
buffer across the processes REPEATS times after one untimed call; the barrier before each call makes every rank
start together, and on a GPU the clock stops when the GPU has finished the sum. Rank 0's median is returned.

Run on two GPUs: `python -m level9_data_parallel.allreduce --backend nccl` writes results/<gpu>x2/allreduce.json.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from level9_data_parallel.mlp import TIMEOUT, WORLD, _one_thread

REPEATS = 25


def _time(rank: int, world: int, store: str, out, sizes: list[int], repeats: int, backend: str) -> None:
    """One rank: the median seconds of an all-reduce of each size (bytes), and what ran, sent to `out` by rank 0."""
    import torch
    import torch.distributed as dist

    on_gpu = backend == "nccl"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        medians = {}
        for size in sizes:
            buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
            dist.all_reduce(buffer)  # untimed: the first call of a size sets up its buffers
            seconds = []
            for _ in range(repeats):
                dist.barrier()
                if on_gpu:
                    torch.cuda.synchronize()  # the barrier's own work done: the clock times the sum alone
                start = time.perf_counter()
                dist.all_reduce(buffer)
                if on_gpu:
                    torch.cuda.synchronize()  # NCCL returns once the sum is queued; it ends on the GPU
                seconds.append(time.perf_counter() - start)
            medians[size] = float(np.median(seconds))
        if rank == 0:
            out.send((medians, what_ran(dist, device, repeats=repeats)))
    finally:
        dist.destroy_process_group()


def what_ran(dist, device, **settings) -> dict:
    """The group and device a measurement ran on, read back from them: backend, world, GPU, NCCL's version."""
    import torch

    ran = {"backend": dist.get_backend(), "world": dist.get_world_size(), **settings,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if device.type == "cuda":
        version = torch.cuda.nccl.version()  # a tuple, (2, 27, 5), or in older versions one number
        ran["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return ran


def on_ranks(target, world: int, *args):
    """Run target(rank, world, store, out, *args) in `world` fresh processes, joined by a file store; return what
    rank 0 sends on `out`."""
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="level9-") as folder, _one_thread():
        ours, theirs = context.Pipe()
        procs = [context.Process(target=target, args=(rank, world, os.path.join(folder, "store"), theirs, *args))
                 for rank in range(world)]
        for proc in procs:
            proc.start()
        theirs.close()
        try:
            while not ours.poll(1):  # a rank that fails ends; one that waits for a dead rank ends at TIMEOUT
                if not any(proc.is_alive() for proc in procs):
                    break
            return ours.recv()
        except EOFError:
            raise RuntimeError(f"the {world} processes of {target.__name__} ended before they reported") from None
        finally:
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()


def allreduce_seconds(sizes: list[int], world: int = WORLD, repeats: int = REPEATS, backend: str = "gloo"
                      ) -> dict[int, float]:
    """Message size in bytes -> the median wall time of one all-reduce over `world` processes (gloo on the CPU, or
    nccl on `world` GPUs)."""
    return measure(sizes, world, repeats, backend)[0]


def measure(sizes: list[int], world: int = WORLD, repeats: int = REPEATS, backend: str = "gloo"
            ) -> tuple[dict[int, float], dict]:
    """allreduce_seconds' medians, and what ran (what_ran, as rank 0 read it back)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: gloo (CPU) or nccl (GPUs)")
    return on_ranks(_time, world, sizes, repeats, backend)


def fit(times: dict[int, float]) -> tuple[float, float]:
    """The cost model t = latency + bytes / bandwidth, fitted by least squares on the relative error (every size
    weighs the same): (latency in seconds, bandwidth in bytes per second)."""
    sizes = np.array(list(times), dtype=np.float64)
    seconds = np.array(list(times.values()))
    design = np.stack([np.ones_like(sizes), sizes], axis=1) / seconds[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(design, np.ones_like(sizes), rcond=None)
    return float(latency), float(1 / per_byte)


SIZES = [4 << 10 << 2 * k for k in range(8)]  # 4 KB, 16 KB, ... 64 MB: each four times the one before


def main(argv: list[str] | None = None) -> int:
    """Time the all-reduce at SIZES and write the medians, the fitted cost model and what ran to results/."""
    import argparse
    import json

    from common.levels import ROOT, gpu_tag

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("gloo", "nccl"), default="nccl")
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--out", type=Path, default=None, help="default: results/<machine>x2/allreduce.json")
    args = p.parse_args(argv)
    times, ran = measure(SIZES, WORLD, args.repeats, args.backend)
    latency, bandwidth = fit(times)
    out = args.out or ROOT / "results" / f"{gpu_tag(ran['device'])}x{ran['world']}" / "allreduce.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"ran": ran, "seconds": {str(k): v for k, v in times.items()},
                               "latency_s": latency, "bandwidth_bytes_per_s": bandwidth}, indent=1) + "\n")
    for size, seconds in times.items():
        print(f"{size / 1024:>10,.0f} KB  {seconds * 1e6:10.1f} us  {size / seconds / 1e9:7.2f} GB/s")
    print(f"{ran}: latency {latency * 1e6:.1f} us, bandwidth {bandwidth / 1e9:.1f} GB/s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
