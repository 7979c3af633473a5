"""The main job: train every level this machine can run on the same data, from the same weights, and compare.

    python -m common.compare [--levels 1,3,4] [--epochs 10] [--train-size 10000] [--batch 8] ...
    make compare ARGS="--levels 1,3,4"

Every level gets the same initial weights (common.model.init_params) and visits the same batches
in the same order. Each is checked against level 1 on the CPU, the gold standard, step by step,
before its speed is reported. Writes results.json and two plots (loss curves, |Δloss| per step)
to the output folder, prints one table, and exits non-zero when a level disagrees with level 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common.data import load_mnist, normalize
from common.levels import LEVELS, ROOT, Level, gpu_available, level, missing
from common.model import HIDDEN, flops_per_step, init_params

# Per-step |loss - level 1's loss| allowed. Float32 sums taken in another order round differently
# (1e-7 relative), and SGD carries those differences forward, so they grow with training - in
# jumps, when a hidden unit near 0 lands on the other side of its ReLU. So the bound grows too:
# 1e-5 at the first step, 2e-7 more each step, at most 1e-3. Measured worst cases on an H100
# machine (results/h100/*, level 1 on CUDA and levels 3-6 against level 1 on the CPU):
#   chapter (4,000 images, batch 8):   <= 7e-7 over 1,000 steps, 4.4e-5 at step ~4,300 (bound 8.7e-4);
#   60,000 x hidden 1024, batch 64:    4.9e-6 by step 200 (bound 5e-5), 3.8e-5 at step 807 (bound 1.7e-4);
#   60,000 x hidden 1024, batch 256:   <= 1.5e-6 over all 705 steps.
# Every planted bug (tests/plant_bugs.py) moves the losses by 1e-3 or more within a few steps.
TOL_START, TOL_GROWTH, TOL_MAX = 1e-5, 2e-7, 1e-3


def tolerance(steps: int) -> np.ndarray:
    """The |dloss| allowed at each of `steps` steps."""
    return np.minimum(TOL_START + TOL_GROWTH * np.arange(steps), TOL_MAX)


def disagreement(losses: np.ndarray, reference: np.ndarray) -> str | None:
    """Why per-step losses disagree with the reference's, or None when every step is within tolerance()."""
    if losses.shape != reference.shape:
        return f"{len(losses)} steps instead of {len(reference)}: a batch was dropped or added"
    diff = np.abs(losses.astype(np.float64) - reference)
    if not np.isfinite(diff).all():
        return f"non-finite loss at step {np.flatnonzero(~np.isfinite(diff))[0]}"
    bound = tolerance(len(diff))
    if (diff > bound).any():
        step = np.flatnonzero(diff > bound)[0]
        return f"|dloss| = {diff[step]:.3g} > {bound[step]:.3g} allowed at step {step}"
    return None


@dataclass
class Run:
    """One level on one device: its per-step losses, its times, its accuracy."""

    label: str
    level: int
    device: str
    losses: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    test_accuracy: float = 0.0
    max_abs_dloss: float = 0.0
    disagreement: str | None = None


def runs_for(numbers: list[int], gpu: bool) -> list[tuple[Level, str]]:
    """(level, device) pairs to train: level 1 on the CPU first (the reference), then on CUDA if there is a GPU."""
    pairs = []
    for number in numbers:
        lv = level(number)
        if not lv.trains:
            continue
        if number == 1:
            pairs.append((lv, "cpu"))
            if gpu:
                pairs.append((lv, "cuda"))
        else:
            pairs.append((lv, "cuda" if "gpu" in lv.needs else "cpu"))
    return pairs


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """The visiting order of one epoch: in order, or a seeded permutation - the same for every level."""
    if not shuffle:
        return np.arange(n, dtype=np.int32)
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int32)


def train(lv: Level, device: str, params, X, y, X_test, y_test, args, quiet: bool) -> Run:
    """Train one level for args.epochs epochs; time only the training."""
    options = {"device": device} if lv.number == 1 else {}
    model = lv.load()(params, **options)
    model.loss_and_grads(X[: args.batch], y[: args.batch])  # warm-up: CUDA context, cuBLAS handles, caches
    run = Run(label=f"{lv.name}[{device}]", level=lv.number, device=device)
    for epoch in tqdm(range(args.epochs), desc=run.label, disable=quiet, leave=False):
        order = epoch_order(len(X), epoch, args.seed, args.shuffle)
        start = time.perf_counter()
        losses = model.train_epoch(X, y, args.batch, args.lr, order)  # returns host memory: the GPU is done
        run.epoch_seconds.append(time.perf_counter() - start)
        run.losses.extend(losses.tolist())
    run.test_accuracy = float((model.forward(X_test).argmax(axis=1) == y_test).mean())
    return run


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
    import numpy
    import torch

    info["numpy"], info["torch"] = numpy.__version__, torch.__version__
    if gpu_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda_runtime"] = str(torch.version.cuda)
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        info["driver"] = smi.stdout.strip()
    return info


def summarize(runs: list[Run], args) -> list[dict]:
    """One table row per run; speedups are against level 1 on the CPU (and on CUDA, if run), measured in this same run."""
    steps = len(runs[0].losses)
    reference = sum(runs[0].epoch_seconds)
    torch_gpu = next((sum(r.epoch_seconds) for r in runs if r.level == 1 and r.device == "cuda"), None)
    rows = []
    for run in runs:
        seconds = sum(run.epoch_seconds)
        rows.append(
            {
                "level": run.label,
                "device": run.device,
                "train_s": seconds,
                "us_per_step": 1e6 * seconds / steps,
                "steps_per_s": steps / seconds,
                "speedup_vs_level1": reference / seconds,
                "speedup_vs_level1_cuda": torch_gpu / seconds if torch_gpu else None,
                "gflops": flops_per_step(args.batch, args.hidden) * steps / seconds / 1e9,
                "final_loss": float(np.mean(run.losses[-max(1, steps // args.epochs) :])),
                "test_accuracy": run.test_accuracy,
                "max_abs_dloss": run.max_abs_dloss,
                "agrees": run.disagreement is None,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    """The table a student reads: speed against level 1, and agreement with it."""
    gpu = any(r["speedup_vs_level1_cuda"] for r in rows)
    head = (
        f"{'level':<16}{'train s':>9}{'us/step':>10}{'steps/s':>10}{'vs L1 cpu':>10}{'vs L1 cuda' if gpu else '':>11}"
        f"{'GFLOP/s':>9}{'loss':>9}{'test acc':>10}{'max|dloss|':>12}  check"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        vs_cuda = f"{r['speedup_vs_level1_cuda']:>10.2f}x" if gpu else f"{'':>11}"
        print(
            f"{r['level']:<16}{r['train_s']:>9.2f}{r['us_per_step']:>10.1f}{r['steps_per_s']:>10.0f}"
            f"{r['speedup_vs_level1']:>9.2f}x{vs_cuda}{r['gflops']:>9.2f}{r['final_loss']:>9.4f}"
            f"{r['test_accuracy']:>10.4f}{r['max_abs_dloss']:>12.2e}  {'ok' if r['agrees'] else 'FAIL'}"
        )


def plot(runs: list[Run], out: Path, title: str) -> None:
    """loss_curves.png (every level overlaid) and dloss.png (|Δloss| vs level 1, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 50
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, run in enumerate(runs):
        losses = np.asarray(run.losses)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid") if len(losses) > window else losses
        ax.plot(smooth, label=run.label, lw=2.5 - 0.3 * i, alpha=0.8)
    ax.set(xlabel="step", ylabel=f"loss (mean of {window} steps)", title=f"Loss curves - {title}", yscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 5))
    reference = np.asarray(runs[0].losses)
    for run in runs[1:]:
        diff = np.abs(np.asarray(run.losses) - reference)
        ax.plot(np.maximum(diff, 1e-10), label=run.label, lw=0.6, alpha=0.8)
    ax.plot(tolerance(len(reference)), color="red", ls="--", label="tolerance")
    ax.set(xlabel="step", ylabel=f"|loss - {runs[0].label} loss|", yscale="log", title=f"Agreement - {title}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "dloss.png", dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    trainable = [lv.number for lv in LEVELS if lv.trains]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--levels", default=",".join(map(str, trainable)), help="comma-separated level numbers")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--train-size", type=int, default=10_000, help="the first N training images")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shuffle", action="store_true", help="a seeded permutation per epoch, the same for every level")
    p.add_argument(
        "--repeat", action="store_true", help="if the data set is smaller than --train-size, repeat it (for timing)"
    )
    p.add_argument("--out", type=Path, default=ROOT / "results" / "local", help="folder for results.json and plots")
    p.add_argument("--quiet", action="store_true", help="no progress bars (also when not on a terminal or in CI)")
    args = p.parse_args(argv)
    args.levels = [int(n) for n in args.levels.split(",")]
    if 1 not in args.levels:
        p.error("level 1 is the gold standard every level is checked against: include it in --levels")
    for name in ("epochs", "train_size", "batch", "hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet = args.quiet or bool(os.environ.get("CI")) or not sys.stderr.isatty()
    data = load_mnist(quiet=quiet)
    print(f"data: {data.source}")
    images, labels = data.train_images, data.train_labels
    if args.train_size > len(images) and args.repeat:
        copies = -(-args.train_size // len(images))
        print(f"NOTE: this data set has {len(images):,} training images: repeating them {copies} times (--repeat)")
        images, labels = np.tile(images, (copies, 1)).copy(), np.tile(labels, copies).copy()  # copies own their memory
        images.flags.writeable = labels.flags.writeable = False  # read-only like the originals: uploaded once
    n = min(args.train_size, len(images))
    if n < args.train_size:
        print(f"NOTE: asked for {args.train_size:,} training images, this data set has {n:,}: training on {n:,}")
    X, y = normalize(images[:n]), labels[:n]
    X_test, y_test = normalize(data.test_images), data.test_labels
    params = init_params(args.seed, args.hidden)

    runs: list[Run] = []
    for lv, device in runs_for(args.levels, gpu_available()):
        why = missing(lv, device)
        if why:
            print(f"skipping {lv.name} ({lv.title}): {'; '.join(why)}")
            continue
        runs.append(train(lv, device, params, X, y, X_test, y_test, args, quiet))
    if not runs or runs[0].label != "level1[cpu]":
        raise SystemExit("level 1 on the CPU must run: it is the reference every level is checked against")
    reference = np.asarray(runs[0].losses, dtype=np.float32)
    for run in runs:
        losses = np.asarray(run.losses, dtype=np.float32)
        run.disagreement = disagreement(losses, reference)
        run.max_abs_dloss = float(np.abs(losses - reference).max()) if losses.shape == reference.shape else float("inf")

    rows = summarize(runs, args)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "quiet")}
    settings["train_size"] = n
    print(
        f"\n{n:,} images x {args.epochs} epochs, batch {args.batch}, hidden {args.hidden}, lr {args.lr}, seed {args.seed}"
        f"{', shuffled' if args.shuffle else ''}; checked against {runs[0].label}: "
        f"|dloss| <= {TOL_START:g} + {TOL_GROWTH:g} x step, at most {TOL_MAX:g}\n"
    )
    print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {
        "settings": settings,
        "data": data.source,
        "machine": machine(),
        "tolerance": {"start": TOL_START, "growth_per_step": TOL_GROWTH, "max": TOL_MAX},
        "table": rows,
        "runs": [asdict(run) for run in runs],
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(runs, args.out, f"{n:,} images, batch {args.batch}, hidden {args.hidden}")
    print(f"\nwrote {args.out / 'results.json'}, loss_curves.png and dloss.png")
    failed = [run for run in runs if run.disagreement]
    for run in failed:
        print(f"FAIL: {run.label} disagrees with {runs[0].label}: {run.disagreement}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
