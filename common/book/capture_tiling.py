"""Why the tiled convolution beats the direct one, measured: Nsight Compute's counters for LeNet-5's two forward
convolution kernels, layer by layer, side by side (level5_cuda_naive/lenet.cu).

    python -m common.book.capture_tiling [--batches 16,64,1024] [--out results/h100/lenet-tiling.md]   # and .json

Needs a GPU and Nsight Compute (`ncu`). The script runs itself under ncu, which profiles the convolution kernels of
one forward pass of MNIST digits with each convolution (caches flushed before each kernel, ncu's default), and
prints a table per batch size: each kernel's time, the load instructions it issued to global and to shared memory,
and the bytes that reached each level of the memory (L1, L2, DRAM).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

# Nsight Compute's metric -> (the table's row, the factor to its unit)
METRICS = {
    "gpu__time_duration.sum": ("time (us)", 1e-3),
    "smsp__inst_executed_op_global_ld.sum": ("global load instructions (per warp)", 1),
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": ("L1: 32-byte sectors the global loads asked for", 1),
    "l1tex__t_sector_pipe_lsu_mem_global_op_ld_hit_rate.pct": ("L1: hit rate of those sectors (%)", 1),
    "lts__t_bytes.sum": ("L2: bytes moved (KB)", 1e-3),
    "dram__bytes_read.sum": ("DRAM: bytes read (KB)", 1e-3),
    "smsp__inst_executed_op_shared_ld.sum": ("shared load instructions (per warp)", 1),
}
CONVOLUTIONS = ("direct", "tiled")


def forward_passes(batch: int) -> None:
    """What ncu watches: one forward pass of `batch` digits with each convolution."""
    from common.harness.data import load_mnist, normalize
    from common.nets.lenet import init_params
    from level5_cuda_naive import LeNet

    X = normalize(load_mnist(quiet=True).test_images[:batch])
    for convolution in CONVOLUTIONS:
        LeNet(init_params(0), convolution=convolution).forward(X)


def profile(batch: int) -> list[dict]:
    """Each convolution kernel's metrics, in launch order: direct conv1, conv2, then tiled conv1, conv2."""
    ncu = shutil.which("ncu") or shutil.which("/usr/local/cuda/bin/ncu")
    if ncu is None:
        raise SystemExit("Nsight Compute (ncu) is not on PATH: it comes with the CUDA toolkit")
    run = subprocess.run([ncu, "--csv", "--print-units", "base", "--metrics", ",".join(METRICS),
                          "--kernel-name", "regex:conv2d_forward", sys.executable, "-m", "common.book.capture_tiling",
                          "--inside-ncu", "--batches", str(batch)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rows = [line for line in run.stdout.splitlines() if line.startswith('"')]
    if run.returncode or not rows:
        raise SystemExit(f"ncu failed (exit {run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(rows))):
        kernel = kernels.setdefault(row["ID"], {"name": row["Kernel Name"].split("(")[0], "grid": row["Grid Size"]})
        kernel[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    return list(kernels.values())


def table(kernels: list[dict], batch: int) -> str:
    """The markdown table: a row per metric, a column per (layer, convolution), and tiled's ratio to direct."""
    if len(kernels) != 4:
        raise SystemExit(f"expected 4 convolution kernels (2 layers x 2 convolutions), ncu reported {len(kernels)}")
    columns = {(layer, conv): kernels[i * 2 + j] for i, conv in enumerate(CONVOLUTIONS)
               for j, layer in enumerate(("conv1", "conv2"))}
    head = "| batch %d | conv1 direct | conv1 tiled | ratio | conv2 direct | conv2 tiled | ratio |" % batch
    lines = [head, "|---" + "|---:" * 6 + "|"]
    for metric, (label, scale) in METRICS.items():
        cells = []
        for layer in ("conv1", "conv2"):
            direct, tiled = (columns[layer, c][metric] * scale for c in CONVOLUTIONS)
            ratio = f"{direct / tiled:.1f}x" if tiled and not metric.endswith(".pct") else ""
            cells += [f"{direct:,.1f}", f"{tiled:,.1f}", ratio]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    grids = ", ".join(f"{layer} {conv}: grid {columns[layer, conv]['grid']}" for layer, conv in columns)
    return "\n".join(lines) + f"\n\n(ratio: direct / tiled; {grids})\n"


def by_layer(kernels: list[dict]) -> dict:
    """profile()'s kernels as {layer: {convolution: {"grid": ..., table row: value in its unit}}}."""
    out: dict = {}
    for i, conv in enumerate(CONVOLUTIONS):
        for j, layer in enumerate(("conv1", "conv2")):
            kernel = kernels[i * 2 + j]
            values = {label: kernel[metric] * scale for metric, (label, scale) in METRICS.items()}
            out.setdefault(layer, {})[conv] = {"grid": kernel["grid"], **values}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="16,64,1024", help="comma-separated batch sizes, a table each")
    p.add_argument("--out", type=Path, help="also write the table to this file")
    p.add_argument("--inside-ncu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.inside_ncu:
        forward_passes(batches[0])
        return 0
    kernels = {batch: profile(batch) for batch in batches}
    text = "\n".join(table(found, batch) for batch, found in kernels.items())
    print(text)
    if args.out:
        import json

        from common.book.make import write_capture

        args.out.parent.mkdir(parents=True, exist_ok=True)
        sources = ["level5_cuda_naive/lenet.cu", "common/native/cuda_lenet.cuh"]
        write_capture(args.out, text, sources)
        numbers = {batch: by_layer(found) for batch, found in kernels.items()}  # for a chapter's sentences
        write_capture(args.out.with_suffix(".json"), json.dumps(numbers, indent=1) + "\n", sources)
    return 0


if __name__ == "__main__":
    sys.exit(main())
