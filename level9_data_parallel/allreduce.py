"""What an all-reduce costs: torch.distributed's all_reduce timed in WORLD processes, for messages of growing size.

    times = allreduce_seconds([4 << 10, 1 << 20, 64 << 20])   # bytes -> the median seconds of one all-reduce
    latency, bandwidth = fit(times)                          # the cost model: latency + bytes / bandwidth

Each process joins a gloo group (the backend on the CPU; NCCL is the one on GPUs), then for each size sums a float32
buffer across the processes REPEATS times after one untimed call; the barrier before each call makes every rank
start together. Rank 0's median is returned.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time

import numpy as np

from level9_data_parallel.mlp import WORLD, _one_thread

REPEATS = 25


def _time(rank: int, world: int, store: str, sizes: list[int], repeats: int, out) -> None:
    """One rank: the median seconds of an all-reduce of each size (bytes), sent to `out` by rank 0."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        medians = {}
        for size in sizes:
            buffer = torch.ones(size // 4, dtype=torch.float32)
            dist.all_reduce(buffer)  # untimed: the first call of a size sets up its buffers
            seconds = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(buffer)
                seconds.append(time.perf_counter() - start)
            medians[size] = float(np.median(seconds))
        if rank == 0:
            out.send(medians)
    finally:
        dist.destroy_process_group()


def allreduce_seconds(sizes: list[int], world: int = WORLD, repeats: int = REPEATS) -> dict[int, float]:
    """Message size in bytes -> the median wall time of one all-reduce over `world` processes."""
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="allreduce-") as folder, _one_thread():
        ours, theirs = context.Pipe()
        procs = [context.Process(target=_time, args=(rank, world, os.path.join(folder, "store"), sizes, repeats,
                                                     theirs)) for rank in range(world)]
        for proc in procs:
            proc.start()
        theirs.close()
        try:
            medians = ours.recv()
        except EOFError:
            raise RuntimeError("the all-reduce processes ended before they reported") from None
        finally:
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    return medians


def fit(times: dict[int, float]) -> tuple[float, float]:
    """The cost model t = latency + bytes / bandwidth, fitted by least squares on the relative error (every size
    weighs the same): (latency in seconds, bandwidth in bytes per second)."""
    sizes = np.array(list(times), dtype=np.float64)
    seconds = np.array(list(times.values()))
    design = np.stack([np.ones_like(sizes), sizes], axis=1) / seconds[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(design, np.ones_like(sizes), rcond=None)
    return float(latency), float(1 / per_byte)
